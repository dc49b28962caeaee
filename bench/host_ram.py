"""How much of a model's experts the CUDA backend may pin in host RAM beside the model file (the benches' `--resident-
budget-gib auto`).

The pinned arena is a second copy of every expert (engine/cuda/arena.py); the file itself sits in the OS file cache,
or in RAM outright when it lives in /dev/shm (tmpfs pages are not reclaimable: /proc/meminfo's MemAvailable leaves
them out, and a container's cgroup counts them). gpt-oss-120b's 63.4 GB file in /dev/shm plus its 60.9 GB arena is
124 GB of the GPU machine's 128 GiB: too close. This pins as much as RAM allows less a headroom (the process, the CUDA
context, the staging ring) and leaves the rest to the memory mode's file path (engine/cuda/memory_mode.py).
"""
from __future__ import annotations

from pathlib import Path

GiB = 1 << 30
HEADROOM_GIB = 12.0     # the bench process, the CUDA context's host side, staging ring, pinned embedding, the OS


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_room(cgroup: Path) -> int | None:
    """memory.max - memory.current of the cgroup v2 this process runs in (None: no limit, or not v2)."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        used = int((cgroup / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    try:
        return max(0, int(limit) - used)
    except ValueError:
        return None


def available_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """RAM a new pinned allocation can take now: the smaller of MemAvailable and the cgroup's room."""
    vals = [v for v in (_meminfo_available(meminfo), _cgroup_room(cgroup)) if v is not None]
    if not vals:
        raise RuntimeError(f"cannot tell the free RAM: {meminfo} has no MemAvailable and {cgroup} no memory.max; "
                           f"pass --resident-budget-gib N instead of auto")
    return min(vals)


def auto_budget_gib(expert_bytes: int, avail_bytes: int, headroom_gib: float = HEADROOM_GIB) -> float | None:
    """GiB of experts to pin: None when every expert fits with the headroom left (the ordinary arena), else what
    the RAM left after the headroom holds (0: pin none, --mmap-experts' worth)."""
    room = avail_bytes - headroom_gib * GiB
    if room >= expert_bytes:
        return None
    return max(0.0, round(room / GiB, 2))


def resolve(value: str | None, expert_bytes: int, log=print, **kw) -> float | None:
    """--resident-budget-gib's value: None (every expert pinned), a number of GiB, or 'auto' (auto_budget_gib)."""
    if value is None:
        return None
    if value != "auto":
        try:
            gib = float(value)
        except ValueError:
            raise SystemExit(f"--resident-budget-gib takes a number of GiB or auto, not {value!r}") from None
        if gib < 0:
            raise SystemExit(f"--resident-budget-gib must be >= 0, not {value}")
        return gib
    avail = available_bytes(**kw)
    gib = auto_budget_gib(expert_bytes, avail)
    what = ("every expert pinned" if gib is None else
            f"{gib:g} GiB of the {expert_bytes / GiB:.2f} GiB of experts pinned, the rest read from the file")
    log(f"resident budget auto: {avail / GiB:.1f} GiB of RAM free, {HEADROOM_GIB:g} GiB kept back: {what}")
    return gib
