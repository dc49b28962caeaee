"""bench.host_path: the CUDA backend's decode path and the session's loop over a no-op stub step, both pipeline
settings; the pipelined loop keeps every step it runs ahead but the last."""
import pytest

pytest.importorskip("cupy")

from bench import host_path  # noqa: E402


@pytest.mark.parametrize("pipelined", [False, True])
def test_host_path_measures_both_loops(pipelined):
    m = host_path.measure(pipelined, 300)
    assert m["decode_us"] > 0 and m["session_us"] > 0
    if pipelined:
        # the decode loop: 300 calls, each running the next ahead (the last one's discarded by the request's start);
        # the request: its first pick (the prompt's last token, the rest reused) and each later one but the last
        # (max_new) run the next ahead, and every one of them is kept
        assert m["ahead"] == 300 + 299 and m["kept"] == 299 + 299
    else:
        assert m["ahead"] == m["kept"] == 0
