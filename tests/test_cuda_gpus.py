"""engine/cuda/gpus.py on a real GPU: the probe's figures, and the worker on the one GPU --gpus names (the planning
and the refusals are tests/test_worker_gpus.py's, with fake GPUs)."""
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cuda import gpus

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.gpu


def test_the_probe_measures_every_gpu():
    n = gpus.device_count()
    cards = gpus.probe_cards(list(range(n)), 700, None)
    assert [c.index for c in cards] == list(range(n))
    import cupy as cp
    for c in cards:
        with cp.cuda.Device(c.index):
            free, total = cp.cuda.runtime.memGetInfo()
        assert c.name and 0 < c.free_bytes <= total
        assert abs(c.free_bytes - (free - 700 * 2 ** 20)) < 512 * 2 ** 20   # the probe gave its buffers back
        assert 1.0 < c.link_gbps < 200.0, c            # PCIe 3 x16 .. 6 x16 and NVLink-C2C hosts
    capped = gpus.probe_cards([0], 700, 1024)
    assert capped[0].free_bytes == 1024 * 2 ** 20


def test_a_worker_on_the_one_gpu_named_serves_and_show_split_prints_its_plan(fixtures_dir):
    model = fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"
    base = [sys.executable, str(ROOT / "strata_worker.py"), "--model", str(model), "--backend", "cuda",
            "--ctx", "256"]
    p = subprocess.run(base + ["--gpus", "0"], input="GEN 3 1,2,3\nQUIT\n", capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert any(line.startswith("DONE") for line in p.stdout.splitlines())
    assert "strata_worker: GPU 0 (--gpus)" in p.stderr
    p = subprocess.run(base + ["--gpus", "0", "--show-split"], capture_output=True, text=True, timeout=600,
                       cwd=ROOT, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "layer split (auto): 4 over GPUs 0" in p.stderr and "READY" not in p.stdout
