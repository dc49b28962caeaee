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
