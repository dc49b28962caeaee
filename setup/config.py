"""Write (and read back) the server's config, strata-<model>.json, with exactly the keys of DESIGN section 6.

Nothing beyond those keys goes in (the server refuses unknown keys); what setup must remember between runs (the
memory mode, the VRAM reserve, the context) is read back from the worker `args` it wrote.
The expert profile is one file, strata-<model>.profile.bin: `expert_profile_save` names it, and the server's worker
command loads it (--expert-profile) whenever it exists, so what a QUIT saved is what the next start fills VRAM from.
The GPUs are `gpu` (one card: nvidia-smi's index) or `gpus` (several; the worker splits the layers, its auto split
unless the person wrote a `layer_split`, which a rerun keeps while `gpus` stays the same).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Choices:
    """What the person chose (or setup recommended) that ends up in the worker's flags."""
    backend: str = "cpu"
    ctx: int = 8192
    mode: str = "ram"                       # ram | budget | mmap | cpu
    resident_gib: int = 0
    vram_reserve_mib: int | None = None     # None: the worker's default (700)
    calibrated_args: list[str] = field(default_factory=list)
    gpu: int | None = None                  # the one card chosen (None: the card with the most VRAM)
    gpus: list[int] | None = None           # several cards chosen: the layers split across them


def config_path(config_dir: Path, model_name: str) -> Path:
    return Path(config_dir) / f"strata-{model_name}.json"


def worker_args(c: Choices) -> list[str]:
    args = ["--ctx", str(c.ctx), "--backend", c.backend]
    if c.backend == "cuda":
        if c.vram_reserve_mib is not None:
            args += ["--vram-reserve-mib", str(c.vram_reserve_mib)]
        if c.mode == "mmap":
            args.append("--mmap-experts")
        elif c.mode == "budget":
            args += ["--resident-budget-gib", str(c.resident_gib)]
        args += c.calibrated_args
    return args


def profile_path(config_dir: Path, model_name: str) -> Path:
    return Path(config_dir).resolve() / f"strata-{model_name}.profile.bin"


def choices_from_args(args: list[str]) -> Choices:
    """Read back what an earlier run chose from the args it wrote."""
    c = Choices()
    i = 0
    while i < len(args):
        a = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else None
        if a == "--ctx" and nxt:
            c.ctx, i = int(nxt), i + 1
        elif a == "--backend" and nxt:
            c.backend, i = nxt, i + 1
        elif a == "--vram-reserve-mib" and nxt:
            c.vram_reserve_mib, i = int(nxt), i + 1
        elif a == "--resident-budget-gib" and nxt:
            c.mode, c.resident_gib, i = "budget", int(float(nxt)), i + 1
        elif a == "--mmap-experts":
            c.mode = "mmap"
        elif a == "--expert-profile" and nxt:
            i += 1
        i += 1
    if c.backend == "cpu":
        c.mode = "cpu"
    return c


def build(model_name: str, model_path: Path, choices: Choices, config_dir: Path, *, host: str = "127.0.0.1",
          port: int = 8080, api_key: str | None = None, gpu: int | None = None, moe: bool = False,
          previous: dict | None = None, gpus: list[int] | None = None) -> dict:
    """The config dict. `previous` (an earlier config) keeps the person's own edits to keys setup does not decide."""
    config_dir = Path(config_dir).resolve()
    profile = profile_path(config_dir, model_name) if moe and choices.backend == "cuda" else None
    cfg = {
        "model_name": model_name,
        "model": os.path.abspath(model_path),   # not resolve(): a symlinked model stays where the person put it
        "worker": [sys.executable, str(ROOT / "strata_worker.py")],
        "args": worker_args(choices),
        "cwd": str(ROOT),
        "log": str(config_dir / f"strata-{model_name}.log"),
        "host": host,
        "port": port,
        "api_key": api_key,
        "cors_origins": [],
        "engine_silence_s": 300,
        "expert_profile_save": str(profile) if profile else None,
        "expert_profile_save_every": 10,
        "gpu": gpu if choices.backend == "cuda" and not gpus else None,
        "gpus": list(gpus) if choices.backend == "cuda" and gpus else None,
        "idle_unload_s": 0,
        "load_at_start": True,
        "sampling": {},
        "reasoning_budget_tokens": None,
    }
    if previous:
        for key in ("cors_origins", "engine_silence_s", "expert_profile_save_every", "idle_unload_s",
                    "load_at_start", "sampling", "reasoning_budget_tokens"):
            if key in previous:
                cfg[key] = previous[key]
        # a split the person wrote holds for the cards it was written for
        if cfg["gpus"] and previous.get("layer_split") and previous.get("gpus") == cfg["gpus"]:
            cfg["layer_split"] = previous["layer_split"]
    return cfg


def write(path: Path, cfg: dict) -> None:
    """Atomic: a temporary file renamed over the config, so an interrupted run never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp, path)


def read(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def installed(config_dir: Path) -> list[Path]:
    return sorted(p for p in Path(config_dir).glob("strata-*.json") if not p.name.endswith(".calibration.json"))


def check_host(host: str, api_key: str | None) -> str | None:
    """A one-line refusal when the service would listen beyond this PC without a key, else None."""
    if host not in LOOPBACK and not api_key:
        return (f"--host {host} makes the service reachable from other machines: give it an --api-key "
                f"(or keep the default host 127.0.0.1)")
    return None
