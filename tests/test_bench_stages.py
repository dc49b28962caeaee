"""bench/stages.py's arguments on the CPU (its rows need the GPU: python -m bench.stages on the device machine)."""
import pytest

from bench import stages as bs


def test_splits_parse_and_bad_ones_say_why():
    assert bs.parse_splits("24,24:1,46,1") == [(24, 24), (1, 46, 1)]
    for bad in ("48", "24,0", "a,b", "24,24:"):
        with pytest.raises(SystemExit, match="--splits takes splits of two or more layer counts"):
            bs.parse_splits(bad)


def test_a_split_that_does_not_cover_the_model_is_refused_before_the_gpu(fixtures_dir):
    pytest.importorskip("cupy")
    model = fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"
    with pytest.raises(SystemExit, match="--splits 3,3 covers 6 layers; tiny-qwen3moe-q4k.gguf has 4"):
        bs.main(["--model", str(model), "--splits", "2,2:3,3"])
