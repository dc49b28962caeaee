"""bench/prefill_attn.py's host side (its kernels run on the GPU): the causal FLOP count and the argument checks."""
import pytest

from bench.prefill_attn import causal_flops, parse


def test_causal_flops_count_only_visible_pairs():
    # 3 tokens from position 0 see 1, 2, 3 keys; after 5 earlier positions, 6, 7, 8
    assert causal_flops(3, 0, 1, 1) == 4 * 6
    assert causal_flops(3, 5, 2, 8) == 4 * (6 + 7 + 8) * 2 * 8
    # the figure the kernel's comment quotes: 48 layers of a 4K prompt at the Qwen3-30B-A3B shape, ~6.6 TFLOP
    assert 6.5e12 < 48 * causal_flops(4096, 0, 32, 128) < 6.7e12


def test_parse_defaults_and_cases():
    a = parse([])
    assert a.cases == [(1024, 0), (4096, 0), (8192, 0), (512, 3584), (512, 31744)]
    assert a.kvs == ["f16", "int8"]
    assert parse(["--tokens", "2048", "--chunks", "", "--kv", "int8"]).cases == [(2048, 0)]


@pytest.mark.parametrize("argv", [["--kv", "bf16"], ["--n-head", "30", "--n-head-kv", "4"], ["--define", "FA_WARPS"],
                                  ["--tokens", "0"], ["--head-dim", "80"]])
def test_parse_refuses_bad_input(argv):
    with pytest.raises(SystemExit):
        parse(argv)
