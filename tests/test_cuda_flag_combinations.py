"""CUDA flag combinations the backend cannot run are refused before anything loads, with one line naming the fix."""
import subprocess
import sys
from pathlib import Path

from cuda_flags import parse
from engine.cuda.args import check_cuda_args

ROOT = Path(__file__).resolve().parent.parent


def test_fetch_misses_needs_the_prefetch():
    assert check_cuda_args(parse("--fetch-misses", "on", "--prefetch", "on")) is None
    assert "drop --prefetch off" in check_cuda_args(parse("--fetch-misses", "on", "--prefetch", "off"))
    assert check_cuda_args(parse("--fetch-misses", "off", "--prefetch", "off")) is None
    assert check_cuda_args(parse("--kv", "int8")) is None
    assert check_cuda_args(parse()) is None


def test_worker_exits_2_with_one_line(fixtures_dir):
    model = fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"
    p = subprocess.run([sys.executable, str(ROOT / "strata_worker.py"), "--model", str(model), "--backend", "auto",
                        "--fetch-misses", "on", "--prefetch", "off"], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "strata_worker: --fetch-misses on is part of the decode prefetch: drop --prefetch off (or --fetch-misses on)"]
