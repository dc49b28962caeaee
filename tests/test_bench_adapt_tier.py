"""bench/adapt_tier.py's host side (the decode runs on the GPU): the setting argument."""
import pytest

from bench.adapt_tier import parse_setting


def test_parse_setting():
    assert parse_setting("0.7:64:32") == (0.7, 64, 32)
    assert parse_setting("0.85:256:8") == (0.85, 256, 8)


@pytest.mark.parametrize("text", ["0.7:64", "0.7:64:32:1", "1.0:64:32", "0:64:32", "0.7:0:32", "0.7:64:-1",
                                  "a:64:32", "0.7:6.5:32"])
def test_parse_setting_refuses_bad_input(text):
    with pytest.raises(SystemExit):
        parse_setting(text)
