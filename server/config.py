"""The server's settings: `strata-<model>.json` (docs/design.md: files), loaded and checked key by key.

Unknown or ill-typed keys stop the start with a message naming the key: a typo in a config that runs for days must
not silently fall back to a default.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from engine.protocol import GEN_KEYS

ROOT = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """A bad config; the message names the key and says what is expected."""


@dataclass
class ServerConfig:
    model: str                                   # the GGUF the worker loads (its vocabulary tokenizes for it)
    model_name: str = ""                         # the id /v1/models shows; default: the file's stem
    worker: list = field(default_factory=lambda: [sys.executable, str(ROOT / "strata_worker.py")])
    args: list = field(default_factory=list)     # the worker's own flags (--ctx, --backend, ...)
    cwd: str | None = None
    log: str | None = None                       # the worker's stderr is appended here
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    cors_origins: list = field(default_factory=list)
    engine_silence_s: float = 300.0              # 0 = no limit
    expert_profile_save: str | None = None
    expert_profile_save_every: float | None = None   # minutes; None = the worker's default
    gpu: int | None = None
    gpus: list | None = None
    layer_split: list | None = None              # layers per GPU of `gpus` (the worker's --layer-split); None: auto
    idle_unload_s: float = 0.0                   # 0 = never unload
    load_at_start: bool = True                   # false: the worker starts at the first request (a shared GPU)
    sampling: dict = field(default_factory=dict)  # defaults for GEN keys (engine.protocol.GEN_KEYS)
    reasoning_budget_tokens: int | None = None   # None or -1 = unlimited

    def worker_command(self) -> list[str]:
        cmd = [str(c) for c in self.worker] + ["--model", str(self.model)] + [str(a) for a in self.args]
        if self.expert_profile_save:
            cmd += ["--expert-profile-save", str(self.expert_profile_save)]
            # What the last QUIT saved is what this start fills the VRAM cache from (a flag in args wins).
            if Path(self.expert_profile_save).is_file() and "--expert-profile" not in self.args:
                cmd += ["--expert-profile", str(self.expert_profile_save)]
        if self.expert_profile_save_every is not None:
            cmd += ["--expert-profile-save-every", f"{self.expert_profile_save_every:g}"]
        if self.gpus and len(self.gpus) > 1:
            # worker_env shows the worker exactly these GPUs, so "every GPU CUDA shows" is the config's list
            cmd += ["--gpus", "auto"]
            if self.layer_split:
                cmd += ["--layer-split", ",".join(str(n) for n in self.layer_split)]
        return cmd

    def worker_env(self) -> dict[str, str]:
        """Extra environment for the worker: which GPUs it sees. The indices are nvidia-smi's (setup reads them
        there), which number the cards in PCI bus order; CUDA's own default order is fastest first, so the order is
        set too, or a PC with two kinds of card would run on another one than the config names."""
        if self.gpus:
            return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in self.gpus)}
        if self.gpu is not None:
            return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(self.gpu)}
        return {}


# key -> (accepted JSON types, description for the message). bool is excluded from numbers explicitly below
# (JSON's true is Python's 1), so only a key whose types are exactly (bool,) takes true/false.
_TYPES = {
    "model": ((str,), "a path to a .gguf file"),
    "model_name": ((str,), "a string"),
    "worker": ((list,), "a list of strings (the command that starts the worker)"),
    "args": ((list,), "a list of strings (the worker's flags)"),
    "cwd": ((str, type(None)), "a directory path or null"),
    "log": ((str, type(None)), "a file path or null"),
    "host": ((str,), "an address such as \"127.0.0.1\""),
    "port": ((int,), "an integer 1..65535 (0 picks a free port)"),
    "api_key": ((str, type(None)), "a string or null"),
    "cors_origins": ((list,), "a list of origins such as \"http://localhost:3000\""),
    "engine_silence_s": ((int, float), "a number of seconds >= 0 (0 = no limit)"),
    "expert_profile_save": ((str, type(None)), "a file path or null"),
    "expert_profile_save_every": ((int, float, type(None)), "a number of minutes >= 0 or null"),
    "gpu": ((int, type(None)), "a GPU index or null"),
    "gpus": ((list, type(None)), "a list of GPU indices or null"),
    "layer_split": ((list, type(None)), "a list of layer counts, one for each GPU of 'gpus', or null (auto)"),
    "idle_unload_s": ((int, float), "a number of seconds >= 0 (0 = never)"),
    "load_at_start": ((bool,), "true (load the model when the service starts) or false (at the first request)"),
    "sampling": ((dict,), f"an object with keys among {', '.join(GEN_KEYS)}"),
    "reasoning_budget_tokens": ((int, type(None)), "an integer (-1 or null = unlimited)"),
}
assert set(_TYPES) == {f.name for f in fields(ServerConfig)}


def is_loopback(host: str) -> bool:
    """True for an address (or name) only this machine can reach."""
    import ipaddress
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bad(key: str, value, what: str) -> ConfigError:
    return ConfigError(f"config key {key!r}: expected {what}, got {json.dumps(value)[:80]}")


def _check_gpus(raw: dict) -> None:
    """gpu / gpus / layer_split together, and against the worker flags in args that say the same."""
    gpu, gpus, split = raw.get("gpu"), raw.get("gpus"), raw.get("layer_split")
    if gpu is not None and gpus is not None:
        raise ConfigError(f"config keys 'gpu' ({gpu}) and 'gpus' ({json.dumps(gpus)}) both choose the GPUs: keep "
                          f"one (gpu: one card; gpus: several, their layers split)")
    if gpus is not None and (not gpus or len(set(gpus)) != len(gpus)):
        raise _bad("gpus", gpus, "a list of distinct GPU indices (nvidia-smi's), or null")
    if split is not None:
        if not gpus or len(gpus) < 2:
            raise ConfigError(f"config key 'layer_split' ({json.dumps(split)}) splits the layers over several GPUs: "
                              f"name them in 'gpus' (one count each), or set it to null")
        if len(split) != len(gpus) or any(n < 1 for n in split):
            raise ConfigError(f"config key 'layer_split': expected one layer count >= 1 for each of the "
                              f"{len(gpus)} GPUs of 'gpus' {json.dumps(gpus)}, got {json.dumps(split)}")
    args = raw.get("args", [])
    for flag, key in (("--gpus", "gpus"), ("--layer-split", "layer_split")):
        named = key if raw.get(key) is not None else ("gpu" if gpu is not None else None)
        if named and any(a == flag or a.startswith(flag + "=") for a in args):
            raise ConfigError(f"config key 'args' has {flag} and the config sets '{named}': keep one (the config's "
                              f"keys are what setup writes)")


def validate(raw: dict, base_dir: Path | None = None) -> ServerConfig:
    """Check every key and value; relative paths are taken from base_dir (the config file's folder)."""
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a JSON object with keys such as \"model\", \"port\"")
    unknown = sorted(set(raw) - set(_TYPES))
    if unknown:
        raise ConfigError(f"config key {unknown[0]!r} is unknown (known keys: {', '.join(_TYPES)})")
    if "model" not in raw:
        raise ConfigError("config key 'model' is missing: give the path of the .gguf file")
    for key, value in raw.items():
        types, what = _TYPES[key]
        if (isinstance(value, bool) and types != (bool,)) or not isinstance(value, types):
            raise _bad(key, value, what)
    for key in ("worker", "args", "cors_origins"):
        if key in raw and not all(isinstance(x, str) for x in raw[key]):
            raise _bad(key, raw[key], _TYPES[key][1])
    for key in ("gpus", "layer_split"):
        if raw.get(key) is not None and not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                for x in raw[key]):
            raise _bad(key, raw[key], _TYPES[key][1])
    if "worker" in raw and not raw["worker"]:
        raise _bad("worker", raw["worker"], "a non-empty list of strings")
    for key in ("engine_silence_s", "idle_unload_s", "expert_profile_save_every"):
        if raw.get(key) is not None and raw[key] < 0:
            raise _bad(key, raw[key], _TYPES[key][1])
    _check_gpus(raw)
    if "port" in raw and not 0 <= raw["port"] <= 65535:
        raise _bad("port", raw["port"], _TYPES["port"][1])
    for k, v in raw.get("sampling", {}).items():
        if k not in GEN_KEYS:
            raise ConfigError(f"config key 'sampling.{k}' is unknown (known: {', '.join(GEN_KEYS)})")
        typ = GEN_KEYS[k][0]
        ok = isinstance(v, int) if typ is int else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok:
            raise _bad(f"sampling.{k}", v, f"a {'whole number' if typ is int else 'number'}")
    for origin in raw.get("cors_origins", []):
        if not origin.startswith(("http://", "https://")) or origin.endswith("/"):
            raise _bad("cors_origins", origin, "origins like \"http://localhost:3000\" (scheme, host, port; no path)")

    cfg = ServerConfig(**raw)
    base = Path(base_dir) if base_dir else Path.cwd()

    def resolve(p):
        return str(p if Path(p).is_absolute() else (base / p).resolve())

    cfg.model = resolve(cfg.model)
    if not Path(cfg.model).is_file():
        raise ConfigError(f"config key 'model': {cfg.model} does not exist; give the path of the .gguf file")
    if not cfg.model_name:
        cfg.model_name = Path(cfg.model).stem
    cfg.cwd = resolve(cfg.cwd) if cfg.cwd else str(ROOT)
    if not Path(cfg.cwd).is_dir():
        raise ConfigError(f"config key 'cwd': {cfg.cwd} is not a directory")
    cfg.log = resolve(cfg.log) if cfg.log else str(base / f"strata-{cfg.model_name}.log")
    if cfg.expert_profile_save:
        cfg.expert_profile_save = resolve(cfg.expert_profile_save)
    if not cfg.api_key and not is_loopback(cfg.host):
        raise ConfigError(f"config key 'host': {cfg.host!r} makes the service reachable from other machines, and "
                          f"'api_key' is empty: set api_key (clients then send it as a Bearer token), or listen on "
                          f"127.0.0.1")
    cfg.engine_silence_s = float(cfg.engine_silence_s)
    cfg.idle_unload_s = float(cfg.idle_unload_s)
    if cfg.reasoning_budget_tokens is not None and cfg.reasoning_budget_tokens < 0:
        cfg.reasoning_budget_tokens = None
    return cfg


def load_config(path) -> ServerConfig:
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found: run `python -m setup` to write one") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path} is not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    return validate(raw, path.resolve().parent)
