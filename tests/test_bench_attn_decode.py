"""bench/attn_decode.py's host side (its kernels run on the GPU): the argument checks and the bytes it reports."""
import pytest

from bench.attn_decode import bytes_per_call, layers_for, parse


def test_parse_defaults_and_lists():
    a = parse([])
    assert a.shape == "qwen3" and a.kv == ["f16", "int8"] and a.ctx == [1024, 8192, 32768, 131072]
    assert a.nq == [1, 8] and a.reps == 5
    a = parse(["--shape", "gptoss", "--kv", "int8", "--ctx", "4096", "--nq", "1,2,3"])
    assert a.shape == "gptoss" and a.kv == ["int8"] and a.ctx == [4096] and a.nq == [1, 2, 3]
    assert a.chunks == [None]           # the engine's rule
    assert parse(["--chunks", "33,128"]).chunks == [33, 128]


@pytest.mark.parametrize("argv", [["--kv", "fp8"], ["--ctx", "x"], ["--ctx", "0"], ["--nq", "9"], ["--nq", ""],
                                  ["--shape", "llama"], ["--reps", "0"], ["--chunks", "0"], ["--chunks", "129"],
                                  ["--chunks", "x"]])
def test_parse_refuses_bad_input(argv):
    with pytest.raises(SystemExit):
        parse(argv)


def test_bytes_per_call():
    # Qwen3-30B at 32K: 4 KV heads x 32768 positions x 256 bytes, K and V: 67 MB a layer, 3.2 GB for 48 layers
    assert bytes_per_call(4, 128, 32768, "f16") == 2 * 4 * 32768 * 256
    assert 48 * bytes_per_call(4, 128, 32768, "f16") == pytest.approx(3.22e9, rel=1e-2)
    assert bytes_per_call(4, 128, 32768, "int8") * 16 == bytes_per_call(4, 128, 32768, "f16") * 9
    assert layers_for(2 * 4 * 1024 * 256) * 2 * 4 * 1024 * 256 >= 400e6
    assert layers_for(10 ** 9) == 2
