"""bench/layer_split.py: the plan for given cards, from a GGUF or a make_moe preset, on the CPU."""
from pathlib import Path

import pytest

from bench import layer_split as bls

TRACE = Path(__file__).parent / "fixtures" / "routing" / "tiny-qwen3moe.json"


def test_a_preset_with_its_routing_trace(capsys):
    assert bls.main(["--preset", "tiny", "--cards", "0.2:25,0.2:10", "--ctx", "1024", "--trace", str(TRACE)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"bench.layer_split: tiny: 4 layers at context 1024 (f16 KV), routing from {TRACE}"
    assert out[1].startswith("layer split (auto): 2,2 over GPUs 0,1")
    assert "beside it:" in out and any(l.startswith("layer split (auto): 4 over GPUs 0") for l in out)


def test_a_gguf_and_a_given_split(capsys, fixtures_dir):
    model = fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"
    assert bls.main(["--model", str(model), "--cards", "1:25,1:25", "--split", "3,1", "--ctx", "256"]) == 0
    out = capsys.readouterr().out
    assert "layer split (given): 3,1 over GPUs 0,1" in out


@pytest.mark.parametrize("argv,msg", [
    (["--preset", "tiny", "--cards", "12:x"], "--cards takes GIB:GBPS"),
    (["--preset", "tiny", "--cards", "1:25,1:25", "--split", "3,3"], "adds up to 6 layers; the model has 4"),
    (["--preset", "qwen3next-80b-a3b", "--cards", "12:25"], "do not all attend"),
    (["--preset", "qwen3-30b-a3b", "--cards", "12:25", "--trace", str(TRACE)], "the trace routes 4 layers"),
])
def test_bad_inputs_say_why(argv, msg):
    with pytest.raises(SystemExit, match=msg):
        bls.main(argv)
