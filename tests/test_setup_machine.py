"""setup/machine.py: nvidia-smi parsing (a fake nvidia-smi on PATH), no-GPU notes, the JSON override."""
import json
import os
import stat

from setup.machine import Machine, describe, detect


def fake_smi(tmp_path, body):
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    exe = d / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return d


def test_two_gpus_driver_and_cuda(tmp_path, monkeypatch):
    bindir = fake_smi(tmp_path, '''
if [ "$1" = "" ]; then echo "| NVIDIA-SMI 560.35   Driver Version: 560.35   CUDA Version: 12.6 |"; exit 0; fi
echo "0, NVIDIA GeForce RTX 4070, 12282, 11800, 560.35"
echo "1, NVIDIA GeForce RTX 3090, 24576, 24000, 560.35"
''')
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("STRATA_SETUP_MACHINE", raising=False)
    m = detect(tmp_path / "not" / "yet" / "models")
    assert [(g.index, g.name, g.vram_total_mib) for g in m.gpus] == [(0, "NVIDIA GeForce RTX 4070", 12282),
                                                                     (1, "NVIDIA GeForce RTX 3090", 24576)]
    assert m.driver == "560.35" and m.cuda == "12.6"
    assert m.ram_total > 0 and m.disk_free > 0 and m.disk_path == str(tmp_path)
    lines = [t for _, t in describe(m)]
    assert any("GPU 1: NVIDIA GeForce RTX 3090, 24.0 GiB VRAM" in t for t in lines)


def test_failing_nvidia_smi_is_said(tmp_path, monkeypatch):
    bindir = fake_smi(tmp_path, 'echo "NVIDIA-SMI has failed because it could not communicate with the driver" >&2\nexit 9\n')
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.delenv("STRATA_SETUP_MACHINE", raising=False)
    m = detect(tmp_path)
    assert not m.has_gpu
    assert "could not communicate with the driver" in m.gpu_note
    assert describe(m)[0][0] == "!"


def test_machine_json_override(tmp_path, monkeypatch):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"gpus": [{"index": 0, "name": "X", "vram_total_mib": 12288, "vram_free_mib": 12000}],
                             "ram_total": 1 << 35, "disk_free": 10 ** 12}))
    monkeypatch.setenv("STRATA_SETUP_MACHINE", str(f))
    m = detect(tmp_path)
    assert m.has_gpu and m.gpus[0].vram_total_mib == 12288 and isinstance(m, Machine)


def test_memory_without_psutil_comes_from_the_kernel(tmp_path, monkeypatch):
    """Step 1 runs before the packages step installs psutil: the kernel's figures then, close to psutil's."""
    import sys
    import psutil
    monkeypatch.delenv("STRATA_SETUP_MACHINE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))              # no nvidia-smi either
    with_psutil = detect(tmp_path)
    total = psutil.virtual_memory().total
    monkeypatch.setitem(sys.modules, "psutil", None)        # `import psutil` now raises ImportError
    bare = detect(tmp_path)
    assert bare.ram_total == total
    assert 0 < bare.ram_available <= bare.ram_total and bare.cpu_cores >= 1
    assert abs(bare.ram_available - with_psutil.ram_available) < 0.25 * bare.ram_total
