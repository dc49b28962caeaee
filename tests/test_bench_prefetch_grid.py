"""bench/prefetch_grid.py's host side (the decode runs on the GPU): the grid argument."""
import pytest

from bench.prefetch_grid import parse_grid


def test_parse_grid_defaults_and_overrides():
    assert parse_grid("8x256", 128, 8) == (8, 256, 128, 8)
    assert parse_grid("16x128:64", 128, 8) == (16, 128, 64, 8)
    assert parse_grid("4x512::16", 128, 8) == (4, 512, 128, 16)


@pytest.mark.parametrize("text", ["8", "8x", "x256", "8x100", "0x256", "8x256:0", "8x256:1:2:3", "eightx256"])
def test_parse_grid_refuses_bad_input(text):
    with pytest.raises(SystemExit):
        parse_grid(text, 128, 8)
