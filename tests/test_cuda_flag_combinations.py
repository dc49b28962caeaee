"""CUDA flag combinations the backend cannot run are refused before anything loads, with one line naming the fix."""
import subprocess
import sys
from pathlib import Path

from cuda_flags import parse
from engine.cuda.args import DEFAULT_PREFILL, check_cuda_args

ROOT = Path(__file__).resolve().parent.parent


def test_int8_kv_needs_the_streamed_prompt_pass():
    assert check_cuda_args(parse("--kv", "int8", "--prefill", "streamed")) is None
    assert "--prefill streamed" in check_cuda_args(parse("--kv", "int8", "--prefill", "batched"))
    assert (check_cuda_args(parse("--kv", "int8")) is None) == (DEFAULT_PREFILL == "streamed")
    assert check_cuda_args(parse("--kv", "f16", "--prefill", "batched")) is None
    assert check_cuda_args(parse()) is None


def test_worker_exits_2_with_one_line(fixtures_dir):
    model = fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"
    p = subprocess.run([sys.executable, str(ROOT / "strata_worker.py"), "--model", str(model), "--backend", "auto",
                        "--kv", "int8", "--prefill", "batched"], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "strata_worker: --kv int8 needs the streamed prompt pass (the batched one reads an fp16 cache): add --prefill "
        "streamed or use --kv f16"]
