"""Calibration: run the worker's `--calibrate` once on the GPU and keep what it measured and chose.

The contract with strata_worker.py's `--calibrate` (the CALIBRATE lines, the keys this parser requires and those it
understands, the arg.<flag> choices that reach the config's args) is in docs/design.md, "Calibration".
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

PREFIX = "CALIBRATE "
REQUIRED = ("pcie_gbps", "vram_free_mib", "decode_tok_s", "prompt_tok_s")
MIN_CTX = 4096             # the smallest context setup halves down to when the chosen one does not fit in VRAM
CHAT_TOKENS = 512          # strata_worker.CALIBRATE_CHAT_TOKENS: what the worker decodes over the chats
# Typical first questions: code, explanation, writing, arithmetic, a summary. Their routing is what the learned
# profile holds, so the first answers after a start read their experts from VRAM.
WARMUP_CHATS = (
    "Write a Python function that returns the n-th Fibonacci number, with a short docstring and a test.",
    "Explain in simple terms how a transformer language model predicts the next word.",
    "Draft a polite email to my landlord asking when the broken heating will be repaired.",
    "A train leaves at 9:40 and arrives at 13:05. How long is the journey? Show the steps.",
    "Summarize the causes and the main consequences of the French Revolution in a few paragraphs.",
    "What are good ways to speed up a slow SQL query that joins three large tables?",
)


class CalibrationError(RuntimeError):
    pass


def _value(v: str):
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def parse(stdout: str) -> dict:
    """The merged key/values of every CALIBRATE line; raises CalibrationError on a malformed or incomplete answer."""
    out: dict = {}
    for line in stdout.splitlines():
        if not line.startswith(PREFIX):
            continue
        try:
            tokens = shlex.split(line[len(PREFIX):])
        except ValueError as e:
            raise CalibrationError(f"unreadable calibration line ({e}): {line.strip()}") from None
        for tok in tokens:
            key, eq, val = tok.partition("=")
            if not eq or not key:
                raise CalibrationError(f"calibration line has {tok!r}, expected key=value: {line.strip()}")
            out[key] = _value(val)
    missing = [k for k in REQUIRED if k not in out]
    if missing:
        raise CalibrationError(f"the worker's calibration did not report {', '.join(missing)}"
                               + ("" if out else " (no CALIBRATE lines on its stdout)"))
    return out


def chosen_args(result: dict) -> list[str]:
    """The worker flags the calibration chose (`arg.*` keys), in the order they came."""
    args: list[str] = []
    for key, val in result.items():
        if not key.startswith("arg."):
            continue
        flag = "--" + key[4:]
        if val is True or (isinstance(val, str) and val.lower() == "true"):
            args.append(flag)
        elif isinstance(val, str) and val.lower() == "false":
            continue
        else:
            args += [flag, str(val)]
    return args


def run(worker: list[str], model: Path, args: list[str], cwd: Path, timeout: float = 900,
        env: dict | None = None) -> dict:
    """env: added to this process's environment (the GPU the service will run on: server/config.py worker_env)."""
    cmd = [*worker, "--model", str(model), *args, "--calibrate"]
    try:
        res = subprocess.run(cmd, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, **env} if env else None)
    except subprocess.TimeoutExpired:
        raise CalibrationError(f"calibration did not finish within {timeout:.0f} s: {shlex.join(cmd)}") from None
    except OSError as e:
        raise CalibrationError(f"cannot start the worker ({e}): {shlex.join(cmd)}") from None
    if res.returncode != 0:
        tail = "\n".join(res.stderr.strip().splitlines()[-8:]) or "(no output on stderr)"
        raise CalibrationError(f"the worker's --calibrate exited with status {res.returncode}:\n{tail}")
    return parse(res.stdout)


def save(path: Path, model: Path, gpus: list[str], result: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"model": str(model), "gpus": gpus, "result": result}, indent=2) + "\n")
    tmp.replace(path)


def load(path: Path, model: Path, gpus: list[str]) -> dict | None:
    """An earlier calibration for the same model file on the same GPUs, or None."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if d.get("model") != str(model) or d.get("gpus") != gpus:
        return None
    return d.get("result")


def write_chats(model: Path, path: Path) -> Path | None:
    """WARMUP_CHATS rendered with the model's own chat template and tokenized as the server does, written as the JSON
    list of token-id lists that the worker's --calibrate-chats reads; None when the template cannot render them."""
    try:
        from server.text import TextCodec
        codec = TextCodec.from_gguf(model)
        prompts = [codec.chat_prompt([{"role": "user", "content": q}])[0] for q in WARMUP_CHATS]
    except Exception:  # a vocabulary or template the server could not use either; the step says so
        return None
    path.write_text(json.dumps([[int(t) for t in p] for p in prompts]) + "\n")
    return path


def profile_args(profile: Path, chats: Path | None) -> list[str]:
    """The calibration's own flags: decode the chats, save what the cache learned where the server's worker loads it
    from (and start from an earlier one)."""
    args = ["--expert-profile-save", str(profile), "--expert-profile-save-every", "0"]
    if profile.is_file():
        args += ["--expert-profile", str(profile)]
    return args + (["--calibrate-chats", str(chats)] if chats is not None else [])


# The decode prefetch's default switches at 95% of the experts in VRAM, from one H200's figures (prefetch.py:
# on 263 / off 255 tok/s at 92%, on 285 / off 310 at 98%), and is off for experts over 8 MiB (gpt-oss-120b at 12 GiB:
# on 40.1 / off 52.0); a PC's own link moves where it pays, so when some experts have no slot setup times the chats
# both ways and keeps the other setting only when it is clearly faster.
AB_MARGIN = 0.03


def prefetch_matters(result: dict) -> bool:
    """Whether the decode prefetch can change anything: some experts have no VRAM slot."""
    slots, total = int(result.get("expert_slots", 0)), int(result.get("experts_total", 0))
    return result.get("prefetch") in ("on", "off") and slots < total


def prefetch_choice(default: str, rates: dict) -> tuple[str | None, str]:
    """(the value to pin with --tune prefetch=, or None to keep the worker's default; a sentence saying why) from the
    chats' decode tok/s with the prefetch on and off, both runs starting from the same learned profile."""
    other = "off" if default == "on" else "on"
    a, b = rates.get(default), rates.get(other)
    if not a or not b:
        return None, f"kept the decode prefetch's default ({default}): the comparison run gave no rate"
    said = f"typical chats decoded at {a} tok/s with the prefetch {default} (the default), {b} with it {other}"
    if b > a * (1 + AB_MARGIN):
        return other, f"{said}: --tune prefetch={other}"
    return None, f"{said}: the default stays"


def ab_args(profile: Path, chats: Path, scratch: Path, prefetch: str) -> list[str]:
    """One side of the prefetch comparison: from the learned profile, never writing over it."""
    return ["--expert-profile", str(profile), "--expert-profile-save", str(scratch), "--expert-profile-save-every",
            "0", "--calibrate-chats", str(chats), "--tune", f"prefetch={prefetch}"]


def default_worker() -> list[str]:
    return [sys.executable, str(Path(__file__).resolve().parent.parent / "strata_worker.py")]
