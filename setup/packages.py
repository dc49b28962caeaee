"""Step 2: the Python packages of requirements.txt, installed into the interpreter running setup."""
from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import InvalidRequirement, Requirement
except ImportError:  # a bare interpreter: pip carries its own copy
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement


def _installed_cupy() -> str | None:
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "cupy" or name.startswith("cupy-cuda"):
            return f"{name} {dist.version}"
    return None


def plan(requirements: Path, has_gpu: bool) -> tuple[list[str], list[str], list[str]]:
    """(missing specs to install, lines already satisfied, notes on what is skipped and why)."""
    missing, ok, notes = [], [], []
    for raw in Path(requirements).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as e:
            raise ValueError(f"{requirements}: cannot read {line!r} ({e})") from None
        if req.marker is not None and not req.marker.evaluate():
            continue
        spec = f"{req.name}{req.specifier}"      # the marker is settled here; pip gets the plain requirement
        if req.name.lower().startswith("cupy"):
            # Any CuPy build serves (the GPU machine has cupy-cuda13x); without an NVIDIA GPU none is of use.
            have = _installed_cupy()
            if have:
                ok.append(have)
            elif not has_gpu:
                notes.append(f"{req.name} not installed: no NVIDIA GPU here, and the CPU backend does not need it")
            else:
                missing.append(spec)
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(spec)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            missing.append(spec)
        else:
            ok.append(f"{req.name} {version}")
    return missing, ok, notes


def install(specs: list[str]) -> tuple[bool, str]:
    """pip install specs into this interpreter; (success, the last lines of pip's output)."""
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *specs]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-12:])
    return res.returncode == 0, tail
