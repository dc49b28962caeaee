"""DecodeStep's own structure on the CPU (its kernels faked): one graph per pick mode, launch() choosing the pick's
graph or the eager launches, the paged memory mode taking the step over through its hook, and a tracer filtering
launches by kind (bench.decode's per-kind profile) without touching the kept graphs."""
from types import SimpleNamespace as NS

import pytest

pytest.importorskip("cupy")

from engine.cuda.decode import PICKS, DecodeStep  # noqa: E402
from engine.cuda.trace import KindFilter  # noqa: E402


class _Graph:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def launch(self, stream):
        self.log.append(("graph", self.name))


class _Stream:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _step(sampler=True):
    log = []
    st = DecodeStep.__new__(DecodeStep)
    st.stream, st.sampler, st.tracer = _Stream(), (object() if sampler else None), None
    st.params = NS(view=[0, 0])
    st.paged = st.prefetch = None
    st.graphs = {}
    st.enqueue = lambda pick="greedy", tracer=None: log.append(("eager", pick))
    st.record = lambda pick="greedy", tracer=None: _Graph(pick, log)
    return st, log


def test_one_graph_per_pick_mode():
    st, _ = _step()
    st.capture()
    assert set(st.graphs) == set(PICKS) == {"greedy", "sampled"}
    st, _ = _step(sampler=False)
    st.capture()
    assert set(st.graphs) == {"greedy"}


def test_launch_takes_the_picks_graph_or_launches_eagerly():
    st, log = _step()
    st.capture()
    st.launch(7, 3, "sampled")
    st.launch(8, 4)
    assert log == [("graph", "sampled"), ("graph", "greedy")] and st.params.view == [8, 4]
    log.clear()
    st.launch(9, 5, "sampled", use_graph=False)
    assert log == [("eager", "sampled")]
    st.graphs = {}                              # --no-graph: nothing captured
    log.clear()
    st.launch(1, 2)
    assert log == [("eager", "greedy")]


def test_the_paged_mode_takes_the_step_over_through_its_hook():
    st, log = _step()
    seen = []
    st.set_paged(NS(launch=lambda token, pos, pick, use_graph: seen.append((token, pos, pick, use_graph))))
    st.launch(5, 6, "sampled")
    assert seen == [(5, 6, "sampled", True)] and log == []


def test_a_tracer_filters_launches_by_kind_and_records_the_kinds():
    calls = []
    st = DecodeStep.__new__(DecodeStep)
    st.kernels = lambda name, qt=None: (lambda *a, **k: calls.append(name))
    st.tracer = None
    st.kernel("mv", 12, "wo")()
    st.kernel("argmax_word")()
    assert calls == ["mv", "argmax_word"] and st.keeps("prefetch")
    only = KindFilter("wo")
    st.tracer = only
    st.kernel("mv", 12, "wo")()
    st.kernel("mv", 12, "qkv")()
    st.kernel("argmax_word")()
    assert calls == ["mv", "argmax_word", "mv"]
    assert not st.keeps("prefetch") and only.seen == {"wo", "qkv", "argmax_word", "prefetch"}
