"""What this PC has: NVIDIA GPUs (nvidia-smi), driver and CUDA version, RAM (psutil, else the kernel's), CPU, disk.

Everything the wizard decides from is in one `Machine` value, so tests inject golden machines (`Machine.from_dict`)
and `python -m setup --check` prints exactly what the decisions used. STRATA_SETUP_MACHINE=<file.json> replaces the
detection with such a dict: it is how the wizard is run end to end as a 12 GB or a no-GPU PC.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20


@dataclass
class GPU:
    index: int
    name: str
    vram_total_mib: int
    vram_free_mib: int


@dataclass
class Machine:
    gpus: list[GPU] = field(default_factory=list)
    driver: str | None = None           # NVIDIA driver version
    cuda: str | None = None             # the highest CUDA version the driver supports
    gpu_note: str = ""                  # why no GPU was found, when none was
    ram_total: int = 0                  # bytes
    ram_available: int = 0              # bytes
    cpu: str = ""
    cpu_cores: int = 0
    disk_free: int = 0                  # bytes free where the models go
    disk_path: str = ""
    os: str = ""

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Machine":
        d = dict(d)
        gpus = [GPU(**g) for g in d.pop("gpus", [])]
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown machine fields: {', '.join(sorted(unknown))}")
        return cls(gpus=gpus, **d)


def _nvidia_smi() -> tuple[list[GPU], str | None, str | None, str]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return [], None, None, "nvidia-smi not found (no NVIDIA driver installed)"
    try:
        q = subprocess.run([exe, "--query-gpu=index,name,memory.total,memory.free,driver_version",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], None, None, f"nvidia-smi failed: {e}"
    if q.returncode != 0:
        last = (q.stderr.strip() or q.stdout.strip() or "no output").splitlines()[-1]
        return [], None, None, f"nvidia-smi failed: {last}"
    gpus, driver = [], None
    for line in q.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        try:
            gpus.append(GPU(int(parts[0]), parts[1], int(float(parts[2])), int(float(parts[3]))))
        except ValueError:
            continue
        driver = parts[4]
    cuda = None
    # The plain nvidia-smi banner is the one place that states the CUDA version the driver supports.
    try:
        banner = subprocess.run([exe], capture_output=True, text=True, timeout=20).stdout
        for tok in banner.split("CUDA Version:")[1:2]:
            cuda = tok.split()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        pass
    return gpus, driver, cuda, "" if gpus else "nvidia-smi lists no GPU"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_and_cores() -> tuple[int, int, int]:
    """(RAM total, RAM available, physical cores). psutil when installed; on a bare machine (step 1 runs before the
    packages step installs psutil) the kernel's own figures: sysconf and /proc/meminfo's MemAvailable."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        vm = psutil.virtual_memory()
        return vm.total, vm.available, psutil.cpu_count(logical=False) or os.cpu_count() or 1
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    available = total
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total, available, os.cpu_count() or 1


def detect(models_dir: Path) -> Machine:
    override = os.environ.get("STRATA_SETUP_MACHINE")
    if override:
        return Machine.from_dict(json.loads(Path(override).read_text()))
    gpus, driver, cuda, note = _nvidia_smi()
    ram_total, ram_available, cores = _memory_and_cores()
    # The models folder may not exist yet: measure the nearest folder that does.
    probe = Path(models_dir).resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return Machine(gpus=gpus, driver=driver, cuda=cuda, gpu_note=note, ram_total=ram_total,
                   ram_available=ram_available, cpu=_cpu_name(), cpu_cores=cores,
                   disk_free=shutil.disk_usage(probe).free, disk_path=str(probe),
                   os=f"{platform.system()} {platform.release()}")


def describe(m: Machine) -> list[tuple[str, str]]:
    """(status, line) pairs for the check step: status is 'ok' or '!'."""
    out = []
    if m.gpus:
        for g in m.gpus:
            out.append(("ok", f"GPU {g.index}: {g.name}, {g.vram_total_mib / 1024:.1f} GiB VRAM "
                              f"({g.vram_free_mib / 1024:.1f} GiB free)"))
        out.append(("ok", f"NVIDIA driver {m.driver or '?'}, CUDA {m.cuda or '?'}"))
    else:
        out.append(("!", f"no NVIDIA GPU: {m.gpu_note or 'none found'}; Strata will use the CPU backend "
                         f"(the NumPy reference: fine for the small default model, slow for large ones)"))
    out.append(("ok", f"RAM {m.ram_total / GIB:.1f} GiB ({m.ram_available / GIB:.1f} GiB available)"))
    out.append(("ok", f"CPU {m.cpu or '?'}, {m.cpu_cores} cores; {m.os}"))
    out.append(("ok" if m.disk_free >= 2 * GIB else "!",
                f"disk: {m.disk_free / 1e9:.1f} GB free at {m.disk_path}"))
    return out
