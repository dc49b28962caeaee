"""bench/decode_kernels.py's host side (its kernels run on the GPU): the argument checks and the --before folder."""
from pathlib import Path

import pytest

from bench.decode_kernels import CASES, build, copies_for, parse


def test_parse_defaults_and_choices():
    a = parse([])
    assert a.cases == list(CASES) and a.defines == {} and a.before is None
    a = parse(["--only", "mv3,router", "--define", "ROUTER_F4=16", "--before", "/tmp/x"])
    assert a.cases == ["mv3", "router"] and a.defines == {"ROUTER_F4": "16"} and a.before == Path("/tmp/x")


@pytest.mark.parametrize("argv", [["--only", "attention"], ["--only", ""], ["--define", "ROUTER_F4"]])
def test_parse_refuses_bad_input(argv):
    with pytest.raises(SystemExit):
        parse(argv)


def test_a_before_folder_without_the_file_says_what_to_give(tmp_path):
    with pytest.raises(SystemExit, match="git archive"):
        build(None, tmp_path, "dense", [8], {})


def test_copies_defeat_the_l2():
    assert copies_for(12_533_760) * 12_533_760 >= 400e6      # attn_output at Q8_0
    assert copies_for(10 ** 9) == 1


def test_the_qwen3_expert_cases_are_offered():
    a = parse(["--only", "q3_gate_up,q3_down,q3_router"])
    assert a.cases == ["q3_gate_up", "q3_down", "q3_router"]


def test_kernel_names_find_the_newer_kernels(tmp_path):
    from bench.decode_kernels import kernel_names
    from engine.cuda.kernels import CUDA_SRC
    assert {"moe_down_q6k", "moe_down", "moe_gate_up", "router_fused"} <= kernel_names(CUDA_SRC)
    (tmp_path / "moe.cu").write_text("template <int QT>\n__global__ void moe_down(int n) {}\n")
    assert kernel_names(tmp_path) == {"moe_down"}      # an older tree: q3_down times moe_down there


def test_the_tiled_down_takes_q6k_layers_whose_tiles_fit():
    from engine.cuda.launch import SMEM_MAX, moe_down_tiled_bytes, moe_down_tiled_fits
    assert moe_down_tiled_bytes(8, 768, 630) == 8 * 8 * 630 + 4 * 8 * 768          # Qwen3-30B-A3B: 63.4 KiB
    assert moe_down_tiled_fits("Q6_K", 2048, 768, 8) and moe_down_tiled_fits("Q6_K", 4096, 1536, 8)
    assert not moe_down_tiled_fits("Q4_K", 2048, 768, 8)       # 16-byte-aligned rows: moe_down reads them well
    assert not moe_down_tiled_fits("Q6_K", 2044, 768, 8)       # a tile would cross its expert's end
    assert not moe_down_tiled_fits("Q6_K", 2048, 768, 33)      # a lane per expert
    assert moe_down_tiled_bytes(32, 768, 630) > SMEM_MAX and not moe_down_tiled_fits("Q6_K", 2048, 768, 32)
