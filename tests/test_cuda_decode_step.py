"""DecodeStep's own structure on the CPU (its kernels faked): one graph per pick mode, launch() choosing the pick's
graph or the eager launches, its program's parts around the family's layer program, and a tracer filtering
launches by kind (bench.decode's per-kind profile) without touching the kept graphs."""
from types import SimpleNamespace as NS

import pytest

pytest.importorskip("cupy")

from engine.cuda.decode import PICKS, RING, DecodeStep  # noqa: E402
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
    st.params = NS(view=[0, 0], push=lambda stream: log.append(("push", *st.params.view)), wait=lambda: None)
    st.events = [NS(record=lambda stream, i=i: log.append(("event", i))) for i in range(RING)]
    st.last_pos = -1
    st.inputs = []                  # the family's host-side inputs (set_inputs) of each launch
    st.layers = NS(set_inputs=lambda token, pos: st.inputs.append((token, pos)))
    st.prefetch = None
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
    """launch(): the inputs copied in stream order, then the pick mode's graph (or the eager launches), then the
    position's event; launch_next(): the same without the inputs (the step before wrote them on the device)."""
    st, log = _step()
    st.capture()
    st.launch(7, 3, "sampled")
    st.launch(8, 4)
    assert log == [("push", 7, 3), ("graph", "sampled"), ("event", 3), ("push", 8, 4), ("graph", "greedy"),
                   ("event", 0)]
    assert st.inputs == [(7, 3), (8, 4)]        # the family's host inputs before each launch (qwen4exp's PLE)
    log.clear()
    st.launch_next(5, "sampled")
    assert log == [("graph", "sampled"), ("event", 1)] and st.last_pos == 5
    assert st.inputs == [(7, 3), (8, 4)]        # a step fed on the device has none (families that run ahead)
    with pytest.raises(ValueError, match="the step after position 5 is at 6, not 8"):
        st.launch_next(8)
    log.clear()
    st.launch(9, 5, "sampled", use_graph=False)
    assert log == [("push", 9, 5), ("eager", "sampled"), ("event", 1)]
    st.graphs = {}                              # --no-graph: nothing captured
    log.clear()
    st.launch(1, 2)
    assert log == [("push", 1, 2), ("eager", "greedy")] + [("event", 2)]


def test_the_program_runs_the_familys_phases_in_order():
    """program(): the embedding, per layer ("route") the family's mixer and router, ("ffn") its experts, then the
    output and the pick; without a prefetch, only the family's launches (the paged modes' per-layer parts)."""
    st = DecodeStep.__new__(DecodeStep)
    ops = []
    st.weights = NS(layers=[None] * 2)
    st.enqueue_pick = lambda pick: ops.append(("pick", pick))
    st.layers = NS(embed=lambda: ops.append("embed"), output=lambda: ops.append("output"),
                   mixer=lambda li: ops.append(("mixer", li)), router=lambda li: ops.append(("router", li)),
                   ffn=lambda li: ops.append(("ffn", li)))
    parts = st.program("sampled")
    assert [(k, li) for k, li, _ in parts] == [("head", -1), ("route", 0), ("ffn", 0), ("route", 1), ("ffn", 1),
                                               ("tail", -1)]
    for _, _, part in parts:
        part()
    assert ops == ["embed", ("mixer", 0), ("router", 0), ("ffn", 0), ("mixer", 1), ("router", 1), ("ffn", 1),
                   "output", ("pick", "sampled")]


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
