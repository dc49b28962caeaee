"""Next-layer expert prefetch (cuda_src/prefetch.cu, engine/cuda/prefetch.py).

GPU: the predictor against NumPy (normalised x @ R.T for F32/F16/Q8_0/Q4_K rows, top-k on its logits, ties to the
lowest id, logits far below the max ranked as logits), the copy kernel's compaction, exact bytes and table
rewrites/restores on random tables at several grid shapes, and the CUDA backend with prefetch on against the NumPy
backend (greedy tokens, logits, the table after each step as before it), each at prefetch depth 1 and 2 (three
staging banks); the late-miss copy (fetch_misses: the same copy kernel with the routing as its prediction and the
staging + miss banks as a second VRAM range) on random tables, and end to end on and off against all-resident and the
CPU, in the memory modes too. CPU: the switches, the bench's summary, the fork/join order (at depth 2 over whole
48-layer steps on the stream-order graph: joins, bank reuse, the step boundary, the miss copy after the join and
fork), the launches' pointers per depth, the launch constants against the kernel's.
"""

import numpy as np
import pytest

from engine.cuda import prefetch as pf
from cuda_flags import check_tune, options, parse
from engine.cuda.args import CudaOptions
from gpu_compare import assert_same_greedy, greedy, rel_rows
from test_cuda_backend import MOE, N_GREEDY, cpu_runs, cuda_backend  # noqa: F401 (cpu_runs: a fixture)

gpu = pytest.mark.gpu


# --- CPU: host-side logic ------------------------------------------------------------------------------------------
def test_wanted_follows_the_option_unless_all_resident():
    mb = 2 << 20                                # a Qwen-sized expert
    assert not pf.wanted(True, 32, 32, mb)      # nothing to fetch: capture nothing extra
    assert not pf.wanted(None, 40, 32, mb)
    assert pf.wanted(True, 16, 32, mb)
    assert not pf.wanted(False, 16, 32, mb)
    assert pf.wanted(None, 0, 32, mb)
    # automatic: only below AUTO_MAX_SHARE of the experts in VRAM; an explicit choice decides whatever the share
    assert pf.wanted(None, 94, 100, mb) and not pf.wanted(None, 95, 100, mb)
    assert pf.wanted(True, 99, 100, mb) and not pf.wanted(False, 50, 100, mb)


def test_auto_declines_large_experts_and_says_why():
    big = pf.AUTO_MAX_EXPERT_BYTES + 1           # gpt-oss's 13.2 MB experts are past the bound
    assert pf.wanted(None, 16, 100, pf.AUTO_MAX_EXPERT_BYTES) and not pf.wanted(None, 16, 100, big)
    assert pf.wanted(True, 16, 100, big)         # prefetch=on still runs it
    assert "MiB" in pf.auto_declined(16, 100, big) and "link time" in pf.auto_declined(16, 100, big)
    assert "95%" in pf.auto_declined(96, 100, 1 << 20)
    assert pf.auto_declined(16, 100, 1 << 20) is None        # auto prefetches: nothing declined
    assert pf.auto_declined(100, 100, big) is None           # all resident: nothing to decline


def _plan(st, choice, log, depth, fetch_misses):
    return pf.plan(st.cfg, st.cache, st.layout, choice, log, depth, fetch_misses)


def test_plan_logs_the_declined_prefetch():
    from types import SimpleNamespace as NS
    step = NS(cfg=None, cache=NS(n_slots=16, n_total=100), layout=NS(stride=pf.AUTO_MAX_EXPERT_BYTES + 16))
    said = []
    assert _plan(step, None, said.append, 2, True) is None
    assert len(said) == 1 and said[0].startswith("expert prefetch off: an expert is") and "prefetch=on" in said[0]
    said.clear()
    assert _plan(step, False, said.append, 2, True) is None and not said     # asked off: nothing to say


def test_prefetch_tune_keys():
    check_tune("prefetch", "off", False, "maybe")
    assert options("--tune", "prefetch=on").prefetch is True and options("--tune", "prefetch=auto").prefetch is None
    assert CudaOptions().prefetch is None
    check_tune("prefetch_depth", "1", 1, "3")
    assert CudaOptions().prefetch_depth == 2
    check_tune("fetch_misses", "off", False, "maybe")
    assert CudaOptions().fetch_misses is True


def test_fetch_misses_needs_the_prefetch():
    from engine.cuda.args import check_cuda_args
    # the late-miss copy is part of the prefetch: asking for it with the prefetch off is refused, with the fix
    bad = check_cuda_args(parse("--tune", "prefetch=off", "--tune", "fetch_misses=on"))
    assert bad and "drop --tune prefetch=off" in bad
    for ok in ([], ["--tune", "prefetch=off"], ["--tune", "prefetch=off", "--tune", "fetch_misses=off"],
               ["--tune", "fetch_misses=on"]):
        assert check_cuda_args(parse(*ok)) is None


def test_summary():
    s = pf.PrefetchStats.from_counters(np.array([800, 600, 300, 240], dtype=np.uint64))
    out = s.summary(blob_bytes=2_000_000, steps=100)
    assert out == dict(pred_accuracy=0.75, pred_accuracy_2=None, prefetch_mb_per_token=6.0, prefetch_wasted=0.2,
                       late_mb_per_token=0.0)
    assert pf.PrefetchStats().summary(10, 0) == dict(pred_accuracy=None, pred_accuracy_2=None,
                                                      prefetch_mb_per_token=0.0, prefetch_wasted=None,
                                                      late_mb_per_token=0.0)
    # depth 2: the second counter pair, accuracy kept per depth
    s = pf.PrefetchStats.from_counters(np.array([100, 90, 300, 240, 700, 350], dtype=np.uint64))
    assert (s.predicted2, s.correct2) == (700, 350)
    assert s.summary(2_000_000, 100)["pred_accuracy"] == 0.9
    assert s.summary(2_000_000, 100)["pred_accuracy_2"] == 0.5
    # the late-miss count: its own counter (stats[6]), none of the prediction's
    s = pf.PrefetchStats.from_counters(np.array([100, 90, 300, 240, 0, 0, 150], dtype=np.uint64))
    assert s.fetched == 150 and s.staged == 300 and pf.STATS == pf.FETCHED + 1 == 7
    assert s.summary(2_000_000, 100)["late_mb_per_token"] == 3.0 and s.summary(2_000_000, 100)["pred_accuracy"] == 0.9


def test_vram_staging_slots():
    assert pf.vram_staging_slots(8, 1, False) == 16 and pf.vram_staging_slots(8, 2, False) == 24
    # the two late-miss banks on top
    assert pf.vram_staging_slots(8, 1, True) == 32 and pf.vram_staging_slots(8, 2, True) == 40
    with pytest.raises(ValueError, match="prefetch depth 3"):
        pf.banks(3)


def _fake_step(n_slots, n_total, n_expert=128, k=8, n_embd=2048, nbytes=2_654_208, arch="qwen3moe"):
    from types import SimpleNamespace as NS
    return NS(cache=NS(n_slots=n_slots, n_total=n_total),
              cfg=NS(n_expert=n_expert, n_expert_used=k, n_embd=n_embd, arch=arch),
              layout=NS(nbytes=nbytes, stride=2_654_208))


def test_plan_decides_and_refuses_what_the_kernels_cannot_serve():
    logs = []
    st = _fake_step(16, 32)
    assert _plan(st, True, logs.append, depth=1, fetch_misses=False) == pf.PrefetchPlan(1, False)
    assert "next-layer prediction, 2 x 8 staging slots, late misses read in place (40 MiB" in logs[-1]
    assert _plan(st, True, logs.append, depth=2, fetch_misses=False) == pf.PrefetchPlan(2, False)
    assert "prediction 2 layers ahead, 3 x 8 staging slots, late misses read in place (61 MiB" in logs[-1]
    assert _plan(st, True, logs.append, depth=1, fetch_misses=True) == pf.PrefetchPlan(1, True)
    assert "next-layer prediction, 2 x 8 staging slots + 2 x 8 for late misses (81 MiB" in logs[-1]
    assert _plan(_fake_step(32, 32), True, logs.append, 2, True) is None
    assert _plan(_fake_step(16, 32), False, logs.append, 2, True) is None
    with pytest.raises(ValueError, match="prefetch depth 3"):
        _plan(st, True, logs.append, 3, True)
    big = dict(n_expert=1024)
    with pytest.raises(ValueError, match="--tune prefetch=on cannot serve this model: .*1024.*--tune prefetch=off"):
        _plan(_fake_step(16, 32, **big), True, logs.append, 2, True)
    n = len(logs)
    assert _plan(_fake_step(16, 32, **big), None, logs.append, 2, True) is None
    assert len(logs) == n + 1 and logs[-1].startswith("expert prefetch off: ")
    assert pf.unsupported(_fake_step(0, 1, k=17).cfg, _fake_step(0, 1).layout)
    assert pf.unsupported(_fake_step(0, 1, n_embd=65536).cfg, _fake_step(0, 1).layout)
    assert pf.unsupported(_fake_step(0, 1, n_embd=16384).cfg, _fake_step(0, 1).layout) is None


def test_the_plan_builds_the_steps_prefetcher(monkeypatch):
    """DecodeStep builds its Prefetcher from the plan, with itself (its buffers and family program exist by then)."""
    monkeypatch.setattr(pf, "Prefetcher", lambda step, depth, fetch: (step, depth, fetch))
    assert pf.PrefetchPlan(2, True).build("step") == ("step", 2, True)


def test_gpt_oss_shapes_are_served():
    """gpt-oss is no longer refused (the predictions add its router bias): the 20b and 120b shapes (hidden 2880, 32 or
    128 experts, top-4, MXFP4 blobs of 13.2 MB) and the tiny one attach; the limits that still hold refuse it too."""
    for n_expert, n_embd, nbytes in ((32, 2880, 13_271_040), (128, 2880, 13_271_040), (16, 256, 60_000)):
        st = _fake_step(16, 32, n_expert=n_expert, k=4, n_embd=n_embd, nbytes=nbytes, arch="gpt-oss")
        assert pf.unsupported(st.cfg, st.layout) is None
    logs = []
    st = _fake_step(16, 32, n_expert=32, k=4, n_embd=2880, arch="gpt-oss")
    assert _plan(st, True, logs.append, depth=2, fetch_misses=True) == pf.PrefetchPlan(2, True)
    assert logs[-1].startswith("expert prefetch on: ")
    assert "1024" in pf.unsupported(_fake_step(0, 1, n_expert=1024, k=4, arch="gpt-oss").cfg, st.layout)


def test_predictor_blocks_are_the_routers():
    """router_predict replaces the step's router launch: its routing equals router_fused(_bias)'s bit for bit only
    at the same block shape (stage_x's sum of squares and route_block reduce over the block's threads)."""
    from engine.cuda.launch import MV_WARPS
    assert pf.PREDICT_WARPS == MV_WARPS


def test_predict_shared_memory_is_the_decode_staging():
    """predict stages x with common.cuh stage_x (launch.staged_bytes: 68 bytes per 16 floats), so the widest model
    it serves is the one whose staged x fills SMEM_MAX."""
    pytest.importorskip("cupy")
    widest = pf.SMEM_MAX * 16 // 68
    assert pf.unsupported(_fake_step(0, 1, n_embd=widest - widest % 64).cfg, _fake_step(0, 1).layout) is None
    assert pf.unsupported(_fake_step(0, 1, n_embd=widest + 64).cfg, _fake_step(0, 1).layout)
    assert "multiple of 4" in pf.unsupported(_fake_step(0, 1, n_embd=1022).cfg, _fake_step(0, 1).layout)


def test_load_module_takes_extra_defines(monkeypatch):
    """prefetch.cu through the one loader, extra defines (bench.prefetch_grid's PF_LOADS) passed on."""
    seen = []
    monkeypatch.setattr(pf.kernels, "load",
                        lambda name, defines=None, qtypes=None: seen.append((name, defines, qtypes)))
    pf.load_module([0])
    pf.load_module([12], {"PF_LOADS": 16})
    assert seen == [("prefetch", None, [0]), ("prefetch", {"PF_LOADS": 16}, [12])]


def test_every_source_edit_changes_the_build_options(tmp_path, monkeypatch):
    """The one recompile rule: each build's options carry a digest of every cuda_src file (router.cu, included by
    prefetch.cu, as much as a header)."""
    import shutil
    for f in pf.kernels.CUDA_SRC.glob("*.cu*"):
        shutil.copy(f, tmp_path / f.name)
    monkeypatch.setattr(pf.kernels, "CUDA_SRC", tmp_path)
    b = pf.kernels.Build("prefetch")
    pf.kernels.sources_digest.cache_clear()
    before = pf.kernels.options(b)
    (tmp_path / "router.cu").write_text((tmp_path / "router.cu").read_text() + "\n// edited\n")
    pf.kernels.sources_digest.cache_clear()
    after = pf.kernels.options(b)
    pf.kernels.sources_digest.cache_clear()
    assert before != after


def test_copy_grids_keep_the_link_busy_and_the_miss_copy_ahead():
    """The prefetch copy keeps at least the link's bandwidth-delay product (~100-250 KB) in flight, on few SMs; the
    miss copy requests a whole expert at once, and far more than the prefetch copy beside it; whole warps."""
    in_flight = pf.COPY_BLOCKS * pf.COPY_THREADS * pf.COPY_LOADS * 16
    assert 200 * 1000 <= in_flight <= 2**20 and pf.COPY_BLOCKS <= 16
    assert pf.MISS_BLOCKS * pf.COPY_THREADS * pf.COPY_LOADS * 16 >= max(4 * in_flight, 3 * 2**20)
    assert pf.COPY_THREADS % 32 == 0
    src = (pf.__file__.replace("engine/cuda/prefetch.py", "cuda_src/prefetch.cu"))
    text = open(src).read()
    assert f"#define PF_LOADS {pf.COPY_LOADS}" in text and f"#define PF_MAX_K {pf.MAX_K}" in text
    assert f"#define PF_MAX_EXPERTS {pf.MAX_EXPERTS}" in text


class _Log:
    def __init__(self):
        self.ops = []


class _Ev:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def record(self, stream):
        self.log.ops.append(("record", self.name, stream.name))


class _Stream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_event(self, ev):
        self.log.ops.append(("wait", self.name, ev.name))

    def __enter__(self):
        self.log.ops.append(("enter", self.name))

    def __exit__(self, *a):
        self.log.ops.append(("exit", self.name))


def _fake_prefetcher(n_layer, depth=1, fetch_misses=False):
    log = _Log()
    p = pf.Prefetcher.__new__(pf.Prefetcher)
    p.n_layer = n_layer
    p.fetch_misses = fetch_misses
    if depth is not None:
        p.depth, p.banks = depth, pf.banks(depth)
    p.step = type("S", (), {"stream": _Stream(log, "main")})()
    p.side = _Stream(log, "side")
    p.done = [_Ev(log, f"done{i}") for i in range(n_layer)]
    p.forked, p.finished = _Ev(log, "forked"), _Ev(log, "finished")
    p._pending, p._finish_pending = set(), False
    # ("predict", li): layer li predicts li+1 and notes its own routing, as depth 1 always does
    p.launch_predict = lambda li, m=None, note=True: log.ops.append(
        ("predict", li) if m in (None, li + 1) and note else ("predict", li, m, note))
    p.launch_note = lambda li: log.ops.append(("note", li))
    p.launch_copy = lambda m: log.ops.append(("copy", m))
    p.launch_miss = lambda li: log.ops.append(("miss", li))
    p.launch_finish = lambda: log.ops.append(("finish",))
    p.fused = lambda li: False
    return p, log


def _step_ops(p, log, n_layer: int) -> list:
    """The stream operations of one step as DecodeStep.enqueue orders them (router, prefetch hook, experts per layer,
    then the finish, the output and the join), stream switches left out."""
    for li in range(n_layer):
        log.ops.append(("router", li))
        p.enqueue(li)
        log.ops.append(("experts", li))
    p.enqueue_finish()
    log.ops.append(("output",))
    p.enqueue_join()
    return [o for o in log.ops if o[0] not in ("enter", "exit")]


def test_fork_join_order():
    """Layer l's prediction forks layer l+1's copy onto the side stream; layer l's experts wait for layer l's copy
    (forked one layer earlier), never for l+1's; the finish is forked after the last layer and joined at the end."""
    p, log = _fake_prefetcher(3)
    ops = _step_ops(p, log, 3)
    assert ops == [
        ("router", 0), ("predict", 0), ("record", "forked", "main"), ("wait", "side", "forked"), ("copy", 1),
        ("record", "done1", "side"), ("experts", 0),
        ("router", 1), ("predict", 1), ("record", "forked", "main"), ("wait", "side", "forked"), ("copy", 2),
        ("record", "done2", "side"), ("wait", "main", "done1"), ("experts", 1),
        ("router", 2), ("wait", "main", "done2"), ("experts", 2),
        ("record", "forked", "main"), ("wait", "side", "forked"), ("finish",), ("record", "finished", "side"),
        ("output",), ("wait", "main", "finished")]
    # the copies and the finish run on the side stream
    i = log.ops.index(("copy", 1))
    assert log.ops[i - 1] == ("enter", "side") and log.ops[i + 1] == ("exit", "side")
    # a second capture starts clean
    p.enqueue(0)
    assert p._pending == {1}


def test_fork_join_order_with_late_misses():
    """fetch_misses: each layer's miss copy runs on the main stream after its prefetch copy is joined (its staged
    entries in the table) and before its experts, the first layer too; the next copy is forked before the join, as
    without late misses, so it queues on the side stream behind this layer's and the link has no gap."""
    p, log = _fake_prefetcher(3, fetch_misses=True)
    ops = _step_ops(p, log, 3)
    assert ops == [
        ("router", 0), ("predict", 0), ("record", "forked", "main"), ("wait", "side", "forked"),
        ("copy", 1), ("record", "done1", "side"), ("miss", 0), ("experts", 0),
        ("router", 1), ("predict", 1), ("record", "forked", "main"), ("wait", "side", "forked"), ("copy", 2),
        ("record", "done2", "side"), ("wait", "main", "done1"), ("miss", 1), ("experts", 1),
        ("router", 2), ("wait", "main", "done2"), ("miss", 2), ("experts", 2),
        ("record", "forked", "main"), ("wait", "side", "forked"), ("finish",), ("record", "finished", "side"),
        ("output",), ("wait", "main", "finished")]
    i = log.ops.index(("miss", 1))
    assert ("enter", "side") not in log.ops[i - 1:i + 2]        # on the main stream


def test_fused_router_launch_predicts_instead_of_a_predict_launch():
    """Where layer li's router launch also predicts li+1 (router_predict), enqueue forks the copy without a predict
    launch of its own; the last layer (nothing to predict) and mixed router types keep router_fused + predict."""
    p, log = _fake_prefetcher(3)
    p.fused = lambda li: li + 1 < 3
    for li in range(3):
        p.enqueue(li)
    assert not any(o[0] == "predict" for o in log.ops)
    assert [o for o in log.ops if o[0] == "copy"] == [("copy", 1), ("copy", 2)]
    from types import SimpleNamespace as NS
    q = pf.Prefetcher.__new__(pf.Prefetcher)
    q.n_layer, q.depth = 4, 1
    q.step = NS(weights=NS(layers=[NS(router=NS(qt=t)) for t in (0, 0, 8, 8)]))
    assert [q.fused(li) for li in range(4)] == [True, False, True, False]


def _happens_before(ops):
    """The stream-order graph of a fake op log: each stream's ops in order, a wait after the latest record of its
    event. Returns (nodes: op per index, before(a, b): whether op a must finish before op b starts)."""
    nodes, last, rec, edges = [], {}, {}, {}
    stream = "main"
    for o in ops:
        if o[0] == "enter":
            stream = o[1]
            continue
        if o[0] == "exit":
            stream = "main"
            continue
        s = o[2] if o[0] == "record" else o[1] if o[0] == "wait" else stream
        i = len(nodes)
        nodes.append(o)
        edges[i] = set()
        if s in last:
            edges[i].add(last[s])
        if o[0] == "record":
            rec[o[1]] = i
        if o[0] == "wait":
            edges[i].add(rec[o[2]])
        last[s] = i
    anc = []
    for i in range(len(nodes)):
        a = set()
        for j in edges[i]:
            a |= anc[j] | {j}
        anc.append(a)
    return nodes, lambda a, b: a in anc[b]


def _run_steps(p, log, n_layer, steps):
    for s in range(steps):
        log.ops.append(("begin", s))
        for li in range(n_layer):          # as DecodeStep.enqueue: router, prefetch hook, experts
            log.ops.append(("router", li, s))
            p.enqueue(li)
            log.ops.append(("experts", li, s))
        p.enqueue_finish()
        log.ops.append(("output", s))
        p.enqueue_join()
        log.ops.append(("end", s))


@pytest.mark.parametrize("fetch", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("n_layer", [48, 5, 3, 2])
def test_depth2_launch_and_wait_order(n_layer, fused, fetch):
    """Depth 2 over whole steps (48 layers as Qwen3-30B, and short models), two steps back to back, checked on the
    stream-order graph: layer m's experts are predicted at layer m-2 (layer 1 at layer 0), the copy forked after that
    prediction and joined before layer m's experts, never a later layer's copy joined early; the copy reusing a bank
    (m % 3) starts only after the experts of the bank's previous layer; the finish restores after the last layer's
    experts and before the step's end; the next step's copies start after it; every layer's routing noted once.
    With late misses (fetch): each layer's miss copy once, after its own copy and its routing note, before its
    experts, and every copy forked before the miss copy of the layer that forks it."""
    p, log = _fake_prefetcher(n_layer, depth=2, fetch_misses=fetch)
    if fused:
        p.fused = lambda li: bool(p.targets(li))
        p.enqueue_router = None           # the router launch is the step's; here it is the ("router", li) op
    _run_steps(p, log, n_layer, 2)
    nodes, before = _happens_before(log.ops)
    idx = {}
    step = 0
    for i, o in enumerate(nodes):
        if o[0] == "begin":
            step = o[1]
        if o[0] in ("record", "wait"):
            continue
        key = (o[0], *o[1:]) if o[0] in ("router", "experts", "output", "begin", "end") else (*o, step)
        assert key not in idx, f"{key} twice"
        idx[key] = i
    for s in range(2):
        copies = sorted(k[1] for k in idx if k[0] == "copy" and k[-1] == s)
        assert copies == list(range(1, n_layer))                       # every layer but the first, once
        misses = sorted(k[1] for k in idx if k[0] == "miss" and k[-1] == s)
        assert misses == (list(range(n_layer)) if fetch else [])
        for li in misses:
            mi = idx[("miss", li, s)]
            assert before(idx[("router", li, s)], mi) and before(mi, idx[("experts", li, s)])
            if li > 0:
                assert before(idx[("copy", li, s)], mi)                # its staged entries are in the table
                assert before(idx[("experts", li - 1, s)], mi)
            if li + 1 < n_layer:
                assert not before(idx[("experts", li, s)], mi) and before(mi, idx[("router", li + 1, s)])
            assert before(mi, idx[("finish", s)])
        for m in copies:
            src = 0 if m == 1 else m - 2
            c = idx[("copy", m, s)]
            # predicted by layer src: fused into its router launch, or a predict launch of its own
            if fused and p.targets(src)[0] == m:
                pred_op = idx[("router", src, s)]
            else:
                pk = ("predict", src) if m == src + 1 else ("predict", src, m, m == p.targets(src)[0])
                pred_op = idx[pk + (s,)]
            assert before(pred_op, c) and before(idx[("router", src, s)], c)
            if fetch:                        # forked before the miss copy (which shares the link with it)
                assert not before(idx[("miss", src, s)], c)
            assert not before(idx[("experts", src, s)], c)              # forked before layer src's experts
            assert before(c, idx[("experts", m, s)])                   # joined before its own experts
            if m + 1 < n_layer:                                       # and only its own copy is waited for
                assert not before(idx[("copy", m + 1, s)], idx[("experts", m, s)])
            nxt = [m2 for m2 in copies if m2 > m and m2 % p.banks == m % p.banks]
            if nxt:      # the next copy into this bank restores this layer's entries: after its experts
                assert before(idx[("experts", m, s)], idx[("copy", nxt[0], s)])
            assert before(c, idx[("finish", s)])
        fin = idx[("finish", s)]
        assert before(idx[("experts", n_layer - 1, s)], fin) and before(fin, idx[("end", s)])
        if s == 0:
            for m in range(1, n_layer):
                assert before(fin, idx[("copy", m, 1)])
        # routing notes: layer li's own note once, between its router and the next layer's router
        for li in range(1, n_layer):
            notes = [k for k in idx if k[-1] == s and k[1] == li and (
                k in (("predict", li, s), ("note", li, s)) or (k[0] == "predict" and len(k) == 5 and k[3]))]
            if fused and p.targets(li):
                notes.append(("router", li, s))
            assert len(notes) == 1, (li, notes)
            assert (("note", li, s) in notes) == (li >= n_layer - 2)     # the layers with nothing to predict
            for k in notes:
                assert k[0] == "router" or before(idx[("router", li, s)], idx[k])
                if li + 1 < n_layer:
                    assert before(idx[k], idx[("router", li + 1, s)])
    assert p._pending == set() and not p._finish_pending


def test_targets_and_banks():
    p, _ = _fake_prefetcher(48, depth=2)
    assert p.banks == 3
    assert p.targets(0) == [1, 2] and p.targets(1) == [3] and p.targets(45) == [47]
    assert p.targets(46) == [] and p.targets(47) == []
    q, _ = _fake_prefetcher(48)
    assert q.depth == 1 and [q.targets(li) for li in (0, 46, 47)] == [[1], [47], []]
    assert _fake_prefetcher(2, depth=2)[0].targets(0) == [1]


class _Buf:
    """A fake device array: .data.ptr, rows by index (rec[b]) at row_bytes apart."""

    def __init__(self, ptr, row_bytes=0):
        from types import SimpleNamespace as NS
        self.data, self.row_bytes = NS(ptr=ptr), row_bytes

    def __getitem__(self, b):
        return _Buf(self.data.ptr + b * self.row_bytes)


def _pointer_prefetcher(depth, n_layer=6, k=4, n_expert=16, stride=1024, fetch_misses=True, biased=False):
    """A Prefetcher with fake buffers and launch functions that record their arguments (name, grid + block, args);
    `biased`: every layer's router with a bias at 300 + layer (gpt-oss), renorm left off in the config."""
    from types import SimpleNamespace as NS
    calls = []
    p = pf.Prefetcher.__new__(pf.Prefetcher)
    p.depth, p.banks, p.fetch_misses = depth, pf.banks(depth), fetch_misses
    p.n_layer, p.n_expert, p.top_k, p.stride, p.slot_lo, p.slot_hi = n_layer, n_expert, k, stride, 1, 2
    p.units = [60 + 4 * i for i in range(n_layer)]         # a recipe's layers copy blobs of their own sizes
    p.smem = 0
    p.staging, p.pred, p.actual = _Buf(10**6), _Buf(2 * 10**6), _Buf(3 * 10**6)
    p.rec, p.rec_addr = _Buf(4 * 10**6, 4 * (2 + k)), _Buf(5 * 10**6, 8 * k)
    p.miss_rec, p.miss_rec_addr = _Buf(4 * 10**7, 4 * (2 + k)), _Buf(5 * 10**7, 8 * k)
    p.stage_lo, p.stage_hi = 10**6, 10**6 + (p.banks + 2 * fetch_misses) * k * stride
    p.table, p.stats, p.counters, p.logits = _Buf(6 * 10**6), _Buf(7 * 10**6), _Buf(8 * 10**6), _Buf(9 * 10**6)
    rec = lambda name: lambda grid, block, args, **kw: calls.append((name, grid + block, [int(a) for a in args]))
    p.f_copy, p.f_finish, p.f_restore = rec("copy"), rec("finish"), rec("restore")
    p.f_predict = {0: rec("predict")}
    p.f_router_predict = {0: rec("router_predict")}
    p.f_predict_bias, p.f_router_predict_bias = {0: rec("predict_bias")}, {0: rec("router_predict_bias")}
    from engine.cuda.families.gptoss import GptOssDecode
    from engine.cuda.families.moe import MoeDecode
    layers = [NS(router=NS(qt=0, ptr=100 + i, row_bytes=8, cols=64), ffn_norm=_Buf(200 + i),
                 router_bias=_Buf(300 + i) if biased else None) for i in range(n_layer)]
    cfg = NS(rms_eps=1e-6, n_embd=64, expert_weights_norm=not biased, expert_weights_scale=1.0, n_expert=n_expert,
             n_expert_used=k)
    p.step = NS(tracer=None, keeps=lambda kind: True, weights=NS(layers=layers), cfg=cfg, x=_Buf(11), ids=_Buf(12),
                rlogits=_Buf(13), wts=_Buf(14),
                cache=NS(table=p.table, slot_lo=1, slot_hi=2, counts=_Buf(15), stats=_Buf(16)))
    # the family's decode program (its router_args / router_extra, no buffers): gpt-oss's when biased
    prog = MoeDecode.__new__(GptOssDecode if biased else MoeDecode)
    prog.step, prog.cfg = p.step, cfg
    p.step.layers, p.biased = prog, prog.biased_router
    return p, calls


@pytest.mark.parametrize("depth", [1, 2])
def test_launch_pointers(depth):
    """The arguments the launches get: the copy for layer m into bank m % banks (its staging, rec, rec_addr), the
    prediction of layer m into pred[m], each layer's note against the counter pair of the depth that predicted it,
    and at the end every bank restored (depth 2: prefetch_finish notes nothing, its note was launch_note's)."""
    k, stride = 4, 1024
    p, calls = _pointer_prefetcher(depth)
    for m in range(1, 6):
        calls.clear()
        p.launch_copy(m)
        (_, _, a), = calls
        b = m % (depth + 1)
        assert a[1] == m and a[4] == p.pred.data.ptr + 4 * k * m
        assert a[5] == p.staging.data.ptr + b * k * stride and a[6] == stride and a[7] == p.units[m]
        assert a[10] == a[11] == 0                          # no second VRAM range: the layer's entries are its own
        assert a[12] == p.rec.data.ptr + b * 4 * (2 + k) and a[13] == p.rec_addr.data.ptr + b * 8 * k
        assert a[14] == p.actual.data.ptr
        assert a[15] == p.stats.data.ptr + 8 * 2 and a[16] == p.stats.data.ptr + 8 * 3    # staged, used
        assert a[17] == p.counters.data.ptr + 4
    # the miss copy of layer li: its actual routing (depth 1's last layer: ids, noted only at the finish) into miss
    # bank li % 2 past the staging banks, the staging + miss range as VRAM, counted as fetched only, its own counter
    for li in range(6):
        calls.clear()
        p.launch_miss(li)
        (name, grid, a), = calls
        mb = li % 2
        assert name == "copy" and grid == (pf.MISS_BLOCKS, pf.COPY_THREADS) and a[1] == li
        assert a[4] == (p.step.ids.data.ptr if depth == 1 and li == 5 else p.actual.data.ptr + 4 * k * li)
        assert a[5] == p.staging.data.ptr + (depth + 1 + mb) * k * stride and a[7] == p.units[li]
        assert (a[8], a[9], a[10], a[11]) == (1, 2, p.stage_lo, p.stage_hi)
        assert a[5] + k * stride <= p.stage_hi
        assert a[12] == p.miss_rec.data.ptr + mb * 4 * (2 + k) and a[13] == p.miss_rec_addr.data.ptr + mb * 8 * k
        assert a[14] == 0 and a[15] == p.stats.data.ptr + 8 * pf.FETCHED and a[16] == 0
        assert a[17] == p.counters.data.ptr + 8
    stats = p.stats.data.ptr
    for li in range(6):
        for m in p.targets(li):
            calls.clear()
            p.launch_predict(li, m, note=m == p.targets(li)[0])
            (_, _, a), = calls
            assert a[4] == 100 + m and a[9] == p.pred.data.ptr + 4 * k * m          # layer m's router, into pred[m]
            assert a[1] == 200 + m                         # on x normed with layer m's weights, as its router will
            assert a[11] == p.pred.data.ptr + 4 * k * li and a[13] == p.actual.data.ptr + 4 * k * li
            assert a[12] == (1 if li > 0 and m == p.targets(li)[0] else 0)
            assert a[14] == stats + (32 if depth == 2 and li >= 2 else 0)
        if p.targets(li):
            calls.clear()
            assert p.enqueue_router(li)
            (_, _, a), = calls
            m = p.targets(li)[0]
            assert a[3] == 200 + li and a[20] == 200 + m     # each router on x normed with its own layer's weights
            assert a[18] == 100 + m and a[22] == p.pred.data.ptr + 4 * k * m
            assert a[23] == p.pred.data.ptr + 4 * k * li and a[24] == (1 if li > 0 else 0)
            assert a[26] == stats + (32 if depth == 2 and li >= 2 else 0)
        else:
            assert not p.enqueue_router(li)
    calls.clear()
    p.launch_note(5)
    (_, grid, a), = calls
    assert grid == (1, 32 * pf.PREDICT_WARPS) and a[4] == 0 and a[9] == 0 and a[12] == 1
    assert a[14] == stats + (32 if depth == 2 else 0)
    calls.clear()
    p.launch_finish()
    # the miss banks first (one warp each, counting nothing), then the prefetch's
    assert [c[0] for c in calls] == ["restore", "finish"] + ["restore"] * (depth - 1)
    (_, grid, ma), fa = calls[0], calls[1][2]
    assert grid == (1, 64) and ma[3] == p.miss_rec.data.ptr and ma[4] == p.miss_rec_addr.data.ptr
    assert ma[5] == ma[6] == 0
    assert fa[5] == (1 if depth == 1 else 0)
    recs = {fa[8], fa[10], *(c[2][3] for c in calls[2:])}
    assert recs == {p.rec.data.ptr + b * 4 * (2 + k) for b in range(depth + 1)}
    assert all(c[1] == (1, 32) and c[2][6] == stats + 8 * 3 for c in calls[2:])     # the third bank counts used
    q, calls = _pointer_prefetcher(depth, fetch_misses=False)
    q.launch_finish()
    assert [c[0] for c in calls] == ["finish"] + ["restore"] * (depth - 1)


@pytest.mark.parametrize("depth", [1, 2])
def test_launch_pointers_with_router_bias(depth):
    """gpt-oss: the predictions take the bias variants with the bias-free kernels' arguments, then the biases:
    router_predict_bias layer li's (its routing, as router_fused_bias) and the predicted layer's; predict_bias the
    predicted layer's; the routing renormalized (the softmax over the chosen) though the config does not ask it; the
    bookkeeping launch (no router) the plain predict. Without a bias: the plain kernels, no extra argument."""
    p, calls = _pointer_prefetcher(depth)
    q, qcalls = _pointer_prefetcher(depth, biased=True)
    for li in range(6):
        for m in p.targets(li):
            calls.clear(), qcalls.clear()
            p.launch_predict(li, m, note=m == p.targets(li)[0])
            q.launch_predict(li, m, note=m == p.targets(li)[0])
            (name, grid, a), = calls
            (qname, qgrid, qa), = qcalls
            assert (name, qname, len(a)) == ("predict", "predict_bias", 16)
            assert qgrid == grid and qa == a + [300 + m]
        calls.clear(), qcalls.clear()
        if p.targets(li):
            assert p.enqueue_router(li) and q.enqueue_router(li)
            (name, grid, a), = calls
            (qname, qgrid, qa), = qcalls
            m = p.targets(li)[0]
            assert (name, qname, len(a)) == ("router_predict", "router_predict_bias", 28)
            assert a[9] == 1 and qa[9] == 1                  # renorm: the config's, and gpt-oss's by the bias
            assert qgrid == grid and qa == a + [300 + li, 300 + m]
        else:
            assert not p.enqueue_router(li) and not q.enqueue_router(li)
    calls.clear(), qcalls.clear()
    p.launch_note(5)
    q.launch_note(5)
    assert [c[0] for c in qcalls] == ["predict"] and qcalls == calls


def test_decode_step_takes_the_router_launch_from_the_prefetch():
    """DecodeStep.enqueue's hook: the step's own router runs only where the Prefetcher did not launch one."""
    pytest.importorskip("cupy")
    from types import SimpleNamespace as NS

    from engine.cuda.decode import DecodeStep
    ops = []
    st = DecodeStep.__new__(DecodeStep)
    st.weights = NS(layers=[None] * 3)
    st.enqueue_pick = lambda pick: ops.append("pick")
    st.layers = NS(embed=lambda: ops.append("embed"), output=lambda: ops.append("output"),
                   mixer=lambda li: ops.append(("attn", li)), router=lambda li: ops.append(("step router", li)),
                   ffn=lambda li: ops.append(("experts", li)))
    st.prefetch = NS(enqueue_router=lambda li: li < 2 and not ops.append(("pf router", li)),
                     enqueue=lambda li: ops.append(("pf", li)), enqueue_finish=lambda: ops.append("finish"),
                     enqueue_join=lambda: ops.append("join"))
    st.enqueue()
    assert ops == ["embed", ("attn", 0), ("pf router", 0), ("pf", 0), ("experts", 0),
                   ("attn", 1), ("pf router", 1), ("pf", 1), ("experts", 1),
                   ("attn", 2), ("step router", 2), ("pf", 2), ("experts", 2), "finish", "output", "pick", "join"]


# --- GPU: the kernels ----------------------------------------------------------------------------------------------
def _cp():
    return pytest.importorskip("cupy")


def _module(qts):
    return pf.load_module(qts)


def _u64(a, off=0):
    return np.uint64(a.data.ptr + off)


def _ref_logits(x, w, R, eps):
    xn = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps) * w
    return (R.astype(np.float64) @ xn).astype(np.float32)


def _run_predict(cp, qt, x, w, Rbytes, row_bytes, n_expert, k, ids, pred_in, check, eps=1e-6, bias=None):
    """predict (predict_bias with `bias`, the predicted layer's router bias) on fresh poisoned outputs, twice."""
    f = _module([qt]).get_function(f"predict{'' if bias is None else '_bias'}<{qt}>")
    n_embd = x.size
    smem = pf.staged_bytes(n_embd)
    if smem > pf.SMEM_DEFAULT:
        f.max_dynamic_shared_size_bytes = smem
    d = dict(x=cp.asarray(x), w=cp.asarray(w), R=cp.asarray(Rbytes), ids=cp.asarray(ids, dtype=cp.int32),
             pred_in=cp.asarray(pred_in, dtype=cp.int32))
    logits = cp.full(n_expert, np.nan, dtype=cp.float32)
    pred = cp.full(k, -7, dtype=cp.int32)
    actual = cp.full(k + 2, -7, dtype=cp.int32)
    stats = cp.zeros(4, dtype=cp.uint64)
    counter = cp.zeros(1, dtype=cp.int32)
    I32, I64, F32 = np.int32, np.int64, np.float32
    warps = pf.PREDICT_WARPS
    for _ in range(2):  # twice: the last-block counter must reset itself
        stats.fill(0)
        f(((n_expert + warps - 1) // warps,), (32 * warps,),
          (_u64(d["x"]), _u64(d["w"]), F32(eps), I32(n_embd), _u64(d["R"]), I64(row_bytes), I32(n_expert), I32(k),
           _u64(logits), _u64(pred), _u64(d["ids"]), _u64(d["pred_in"]), I32(check), _u64(actual), _u64(stats),
           _u64(counter), *(() if bias is None else (_u64(cp.asarray(bias)),))), shared_mem=smem)
    cp.cuda.Device().synchronize()
    return logits.get(), pred.get(), actual.get(), stats.get(), int(counter.get()[0])


def _top_k(logits, k):
    """The reference choice on the kernel's own logits: largest first, ties to the lower id, NaN last."""
    v = np.where(np.isnan(logits), -np.inf, logits)
    return np.lexsort((np.arange(v.size), -v))[:k]


@gpu
@pytest.mark.parametrize("name", ["F32", "F16", "Q8_0", "Q4_K", "Q2_0", "Q1_0", "NVFP4"])
@pytest.mark.parametrize("n_embd,n_expert,k", [(256, 8, 2), (2048, 128, 8), (1024, 512, 16), (768, 60, 4),
                                               (4608, 128, 8)])
def test_predict_matches_numpy(name, n_embd, n_expert, k):
    """Logits against NumPy at several widths (4608: an F32 row past the PF_F4 float4 a lane preloads), every router
    row type the kernel serves through stage_x (Q4_K: the padded layout), the top-k exactly that of its logits."""
    cp = _cp()
    from engine.cuda.quant_types import qtype, random_rows
    from engine.gguf_model import dequantize
    rng = np.random.default_rng(n_embd + n_expert)
    qt = qtype(name)
    x = rng.standard_normal(n_embd).astype(np.float32) * 3
    w = (1 + 0.3 * rng.standard_normal(n_embd)).astype(np.float32)
    raw = random_rows(name, n_expert, n_embd, rng)
    R = dequantize(raw, qt.ggml).reshape(n_expert, n_embd)
    ids = rng.permutation(n_expert)[:k]
    pred_in = np.concatenate([ids[: k // 2], rng.permutation(np.setdiff1d(np.arange(n_expert), ids))[: k - k // 2]])
    logits, pred, actual, stats, counter = _run_predict(cp, qt.id, x, w, raw, raw.shape[1], n_expert, k, ids,
                                                        pred_in, check=1)
    xn = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-6) * w
    ref = R.astype(np.float64) @ xn
    scale = np.abs(R.astype(np.float64)) @ np.abs(xn)
    assert np.linalg.norm(logits - ref) / np.linalg.norm(scale) < 1e-5     # as test_router_fused measures it
    np.testing.assert_array_equal(pred, _top_k(logits, k))
    np.testing.assert_array_equal(actual[:k], ids)            # this layer's routing, kept for the restore
    assert (actual[k:] == -7).all()
    assert stats.tolist() == [k, k // 2, 0, 0]
    assert counter == 0


def _rows_with_logits(x, w, t, eps=1e-6):
    """F32 router rows whose logits on rmsnorm(x) * w are t (up to rounding): each row t_e * xn / |xn|^2."""
    xn = x.astype(np.float64) / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps) * w
    return (np.asarray(t, dtype=np.float64)[:, None] * xn[None, :] / (xn @ xn)).astype(np.float32)


@gpu
def test_predict_ties_go_to_the_lowest_id_and_bookkeeping_only_mode():
    cp = _cp()
    rng = np.random.default_rng(5)
    n_embd, n_expert, k = 256, 64, 8
    x = rng.standard_normal(n_embd).astype(np.float32)
    w = np.ones(n_embd, dtype=np.float32)
    R = (rng.standard_normal((n_expert, n_embd)) * 0.01).astype(np.float32)
    R[[40, 7, 33, 12]] = x * 10                               # four identical rows, the largest logits
    logits, pred, *_ = _run_predict(cp, 0, x, w, R.view(np.uint8), 4 * n_embd, n_expert, k,
                                    np.arange(k), np.arange(k), check=0)
    assert pred[:4].tolist() == [7, 12, 33, 40]
    assert logits[7] == logits[12] == logits[33] == logits[40]
    np.testing.assert_array_equal(pred, _top_k(logits, k))
    # no router (the last layer's bookkeeping): no logits or prediction written, routing noted
    f = _module([0]).get_function("predict<0>")
    d_ids, d_pred_in = cp.asarray(np.array([3, 1, 4, 5, 9, 2, 6, 8], dtype=np.int32)), cp.arange(8, dtype=cp.int32)
    logits = cp.full(n_expert, np.nan, dtype=cp.float32)
    pred = cp.full(k, -7, dtype=cp.int32)
    actual, stats, counter = cp.full(k, -7, dtype=cp.int32), cp.zeros(4, dtype=cp.uint64), cp.zeros(1, cp.int32)
    f((4,), (128,), (np.uint64(0), np.uint64(0), np.float32(1e-6), np.int32(n_embd), np.uint64(0), np.int64(0),
                     np.int32(n_expert), np.int32(k), _u64(logits), _u64(pred), _u64(d_ids), _u64(d_pred_in),
                     np.int32(1), _u64(actual), _u64(stats), _u64(counter)), shared_mem=pf.staged_bytes(n_embd))
    cp.cuda.Device().synchronize()
    assert np.isnan(logits.get()).all() and (pred.get() == -7).all()
    assert actual.get().tolist() == [3, 1, 4, 5, 9, 2, 6, 8]
    assert stats.get().tolist() == [8, 6, 0, 0]
    assert int(counter.get()[0]) == 0


@gpu
@pytest.mark.parametrize("n_expert", [128, 512])      # ranked by the block; by one warp's argmax rounds
def test_predict_ranks_logits_far_below_the_max(n_expert):
    """Logits 150 and more below the max (exp(logit - max) is 0 in fp32 there): the choice still follows the logits,
    not the expert ids, as router.cu's route_block since da9663e."""
    cp = _cp()
    rng = np.random.default_rng(11)
    n_embd, k = 512, 8
    x = rng.standard_normal(n_embd).astype(np.float32)
    w = (1 + 0.2 * rng.standard_normal(n_embd)).astype(np.float32)
    t = -150.0 - rng.permutation(n_expert) * 0.75          # distinct, 0.75 apart, all far below the max
    t[77] = 0.0                                             # the max
    R = _rows_with_logits(x, w, t)
    logits, pred, *_ = _run_predict(cp, 0, x, w, R.view(np.uint8), 4 * n_embd, n_expert, k,
                                    np.arange(k), np.arange(k), check=0)
    assert np.all(np.abs(logits - t) < 0.05)               # the rows give the logits meant
    assert pred[0] == 77
    np.testing.assert_array_equal(pred, np.argsort(-t, kind="stable")[:k])


@gpu
@pytest.mark.parametrize("name", ["F32", "Q8_0", "Q4_K", "Q2_0", "Q1_0", "NVFP4"])
@pytest.mark.parametrize("n_embd,n_expert,k,renorm", [(2048, 128, 8, 1), (768, 60, 4, 0), (1024, 512, 16, 1),
                                                      (4608, 128, 8, 0), (256, 8, 2, 1)])
def test_router_predict_matches_router_and_predict(name, n_embd, n_expert, k, renorm):
    """Layer l's routing exactly as router_fused's (ids by the kernel's own logits, weights, counts, hits) and the
    prediction exactly as predict's (top-k of layer l+1's router on the same x, normed with layer l+1's weights), the
    routing noted against the prediction made for it; twice, so the last-block counter resets and the counts add
    up."""
    cp = _cp()
    from engine.cuda.quant_types import qtype, random_rows
    from engine.gguf_model import dequantize
    rng = np.random.default_rng(n_embd * 3 + n_expert)
    qt = qtype(name)
    x = rng.standard_normal(n_embd).astype(np.float32) * 2
    ws = [rng.uniform(0.5, 1.5, n_embd).astype(np.float32) for _ in range(2)]     # layers l's and l+1's
    raws = [random_rows(name, n_expert, n_embd, rng) for _ in range(2)]
    Rs = [dequantize(r, qt.ggml).reshape(n_expert, n_embd).astype(np.float64) for r in raws]
    f = _module([qt.id]).get_function(f"router_predict<{qt.id}>")
    smem = pf.staged_bytes(n_embd)
    if smem > pf.SMEM_DEFAULT:
        f.max_dynamic_shared_size_bytes = smem
    d_raw = [cp.asarray(r) for r in raws]
    d_x, d_ws = cp.asarray(x), [cp.asarray(w) for w in ws]
    logits, logits2 = cp.full(n_expert, np.nan, cp.float32), cp.full(n_expert, np.nan, cp.float32)
    ids, wts = cp.full(k, -1, cp.int32), cp.full(k, np.nan, cp.float32)
    slot_lo, slot_hi = 1000, 2000
    table = rng.choice([1500, 5000], size=n_expert).astype(np.uint64)      # 1500: inside the slot range
    d_table = cp.asarray(table)
    counts, stats = cp.zeros(n_expert, cp.int32), cp.zeros(2, cp.uint64)
    pred = cp.full(k, -7, cp.int32)
    pred_in_h = rng.permutation(n_expert)[:k].astype(np.int32)
    pred_in = cp.asarray(pred_in_h)
    actual, pstats, counter = cp.full(k + 1, -7, cp.int32), cp.zeros(4, cp.uint64), cp.zeros(1, cp.int32)
    I32, I64, F32, U64 = np.int32, np.int64, np.float32, np.uint64
    nb = (n_expert + pf.PREDICT_WARPS - 1) // pf.PREDICT_WARPS
    for _ in range(2):
        f((2 * nb,), (32 * pf.PREDICT_WARPS,),
          (_u64(d_raw[0]), I64(raws[0].shape[1]), _u64(d_x), _u64(d_ws[0]), F32(1e-6), I32(n_embd), _u64(logits),
           I32(n_expert), I32(k), I32(renorm), F32(1.5), _u64(ids), _u64(wts), _u64(d_table), U64(slot_lo),
           U64(slot_hi), _u64(counts), _u64(stats), _u64(d_raw[1]), I64(raws[1].shape[1]), _u64(d_ws[1]),
           _u64(logits2), _u64(pred), _u64(pred_in), I32(1), _u64(actual), _u64(pstats), _u64(counter)),
          shared_mem=smem)
    cp.cuda.Device().synchronize()
    for got, R, w in zip((logits.get(), logits2.get()), Rs, ws):
        xn = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-6) * w
        assert np.linalg.norm(got - R @ xn) / np.linalg.norm(np.abs(R) @ np.abs(xn)) < 1e-5
    lg = logits.get().astype(np.float64)
    ref_ids = _top_k(logits.get(), k)
    np.testing.assert_array_equal(ids.get(), ref_ids)
    p = np.exp(lg - lg.max())
    ref_w = p[ref_ids] / (p[ref_ids].sum() if renorm else p.sum()) * 1.5
    np.testing.assert_allclose(wts.get(), ref_w, rtol=1e-4, atol=1e-30)   # fp32 underflows where fp64 has 1e-45
    np.testing.assert_array_equal(counts.get(), 2 * np.bincount(ref_ids, minlength=n_expert))
    assert stats.get().tolist() == [2 * int((table[ref_ids] == 1500).sum()), 2 * k]
    np.testing.assert_array_equal(pred.get(), _top_k(logits2.get(), k))
    np.testing.assert_array_equal(actual.get()[:k], ref_ids)
    assert actual.get()[k] == -7
    right = len(set(ref_ids.tolist()) & set(pred_in_h.tolist()))
    assert pstats.get().tolist() == [2 * k, 2 * right, 0, 0]
    assert int(counter.get()[0]) == 0


def _router_data(name, n_embd, n_expert, seed, biased):
    """Random inputs for two layers' routers (NumPy): x, each layer's FFN norm weights, raw rows, their float64
    values, the reference logits R . (rmsnorm(x) * w) (+ bias), and the biases (None without): gpt-oss-like biases, 2x
    the spread of the bias-free logits, so that they reorder the top-k."""
    from engine.cuda.quant_types import qtype, random_rows
    from engine.gguf_model import dequantize
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n_embd).astype(np.float32) * 2
    ws = [rng.uniform(0.5, 1.5, n_embd).astype(np.float32) for _ in range(2)]
    raws = [random_rows(name, n_expert, n_embd, rng) for _ in range(2)]
    Rs = [dequantize(r, qtype(name).ggml).reshape(n_expert, n_embd).astype(np.float64) for r in raws]
    xns = [x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5) * w for w in ws]
    plain = [R @ xn for R, xn in zip(Rs, xns)]
    biases = [(rng.standard_normal(n_expert) * 2 * p.std()).astype(np.float32) for p in plain] if biased else None
    refs = [p + b for p, b in zip(plain, biases)] if biased else plain
    scales = [np.abs(R) @ np.abs(xn) + (np.abs(b) if biased else 0) for R, xn, b in zip(Rs, xns, biases or (0, 0))]
    return dict(x=x, ws=ws, raws=raws, plain=plain, refs=refs, scales=scales, biases=biases, rng=rng)


# gpt-oss's router shapes (hidden 2880; 20b: 32 experts, 120b: 128; top-4) and the qwen-like ones
BIAS_SIZES = [(2880, 32, 4), (2880, 128, 4), (256, 16, 4), (1024, 512, 16), (768, 60, 2)]


@gpu
@pytest.mark.parametrize("name", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("n_embd,n_expert,k", BIAS_SIZES)
def test_predict_bias_matches_numpy(name, n_embd, n_expert, k):
    """predict_bias (gpt-oss's predictions where router_predict cannot serve): logits = R . xn + the predicted layer's
    router bias against NumPy, the top-k exactly that of its logits, the routing noted; the biases reorder the
    reference top-k, so a kernel leaving them out fails the ranking as well as the logits."""
    cp = _cp()
    from engine.cuda.quant_types import qtype
    d = _router_data(name, n_embd, n_expert, n_embd + n_expert + 1, True)
    ref, raw, rng = d["refs"][1], d["raws"][1], d["rng"]
    assert set(_top_k(ref.astype(np.float32), k)) != set(_top_k(d["plain"][1].astype(np.float32), k))
    ids = rng.permutation(n_expert)[:k]
    pred_in = np.concatenate([ids[: k // 2], rng.permutation(np.setdiff1d(np.arange(n_expert), ids))[: k - k // 2]])
    logits, pred, actual, stats, counter = _run_predict(cp, qtype(name).id, d["x"], d["ws"][1], raw, raw.shape[1],
                                                        n_expert, k, ids, pred_in, check=1, eps=1e-5,
                                                        bias=d["biases"][1])
    assert np.linalg.norm(logits - ref) / np.linalg.norm(d["scales"][1]) < 1e-5
    np.testing.assert_array_equal(pred, _top_k(logits, k))
    np.testing.assert_array_equal(actual[:k], ids)
    assert (actual[k:] == -7).all()
    assert stats.tolist() == [k, k // 2, 0, 0]
    assert counter == 0


@gpu
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("name", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("n_embd,n_expert,k", BIAS_SIZES)
def test_router_predict_routes_as_the_router_bit_for_bit(biased, name, n_embd, n_expert, k):
    """router_predict replaces the step's router launch: its routing (logits, ids, weights, counts, hits) equals
    router_fused's bit for bit, and router_predict_bias's router_fused_bias's (gpt-oss: each layer's bias on its
    logits, renorm 1: the softmax over the chosen k), on the same inputs with every output poisoned; the routing is
    gpt-oss's (NumPy route_softmax_weight on the kernel's logits) and the prediction layer l+1's biased top-k."""
    cp = _cp()
    from engine.arch import gptoss
    from engine.cuda import kernels
    from engine.cuda.launch import MV_WARPS
    from engine.cuda.quant_types import qtype
    qt = qtype(name).id
    d = _router_data(name, n_embd, n_expert, 7 * n_embd + n_expert + biased, biased)
    rng, raws = d["rng"], d["raws"]
    if biased:      # the biases reorder both layers' reference top-k
        for ref, plain in zip(d["refs"], d["plain"]):
            assert set(_top_k(ref.astype(np.float32), k)) != set(_top_k(plain.astype(np.float32), k))
    sfx = "_bias" if biased else ""
    router = kernels.load("router", qtypes=[qt]).get_function(f"router_fused{sfx}<{qt}>")
    fused = _module([qt]).get_function(f"router_predict{sfx}<{qt}>")
    smem = pf.staged_bytes(n_embd)
    if smem > pf.SMEM_DEFAULT:
        router.max_dynamic_shared_size_bytes = fused.max_dynamic_shared_size_bytes = smem
    d_raw, d_x, d_ws = [cp.asarray(r) for r in raws], cp.asarray(d["x"]), [cp.asarray(w) for w in d["ws"]]
    d_b = [cp.asarray(b) for b in d["biases"]] if biased else []
    slot_lo, slot_hi = 1000, 2000
    table = rng.choice([1500, 5000], size=n_expert).astype(np.uint64)      # 1500: inside the slot range
    d_table = cp.asarray(table)
    renorm = 1 if biased else int(k % 4 == 0)           # gpt-oss renormalizes; the others both ways (k 2: not)
    I32, I64, F32, U64 = np.int32, np.int64, np.float32, np.uint64

    def outputs():
        return dict(logits=cp.full(n_expert, np.nan, cp.float32), ids=cp.full(k, -1, cp.int32),
                    wts=cp.full(k, np.nan, cp.float32), counts=cp.zeros(n_expert, cp.int32),
                    stats=cp.zeros(2, cp.uint64), counter=cp.zeros(1, cp.int32))

    def routing(o):
        return (_u64(d_raw[0]), I64(raws[0].shape[1]), _u64(d_x), _u64(d_ws[0]), F32(1e-5), I32(n_embd),
                _u64(o["logits"]), I32(n_expert), I32(k), I32(renorm), F32(1.5), _u64(o["ids"]), _u64(o["wts"]),
                _u64(d_table), U64(slot_lo), U64(slot_hi), _u64(o["counts"]), _u64(o["stats"]))

    a, b = outputs(), outputs()
    logits2, pred = cp.full(n_expert, np.nan, cp.float32), cp.full(k, -7, cp.int32)
    pred_in_h = rng.permutation(n_expert)[:k].astype(np.int32)
    pred_in, actual, pstats = cp.asarray(pred_in_h), cp.full(k + 1, -7, cp.int32), cp.zeros(4, cp.uint64)
    for _ in range(2):      # twice: the last-block counters reset themselves, the counts add up
        router(((n_expert + MV_WARPS - 1) // MV_WARPS,), (32 * MV_WARPS,),
               (*routing(a), _u64(a["counter"]), *(_u64(v) for v in d_b[:1])), shared_mem=smem)
        nb = (n_expert + pf.PREDICT_WARPS - 1) // pf.PREDICT_WARPS
        fused((2 * nb,), (32 * pf.PREDICT_WARPS,),
              (*routing(b), _u64(d_raw[1]), I64(raws[1].shape[1]), _u64(d_ws[1]), _u64(logits2), _u64(pred),
               _u64(pred_in), I32(1), _u64(actual), _u64(pstats), _u64(b["counter"]), *(_u64(v) for v in d_b)),
              shared_mem=smem)
    cp.cuda.Device().synchronize()
    got = {key: (a[key].get(), b[key].get()) for key in a}
    for key, (want, have) in got.items():   # bit for bit (floats compared as their bits)
        if want.dtype == np.float32:
            want, have = want.view(np.uint32), have.view(np.uint32)
        np.testing.assert_array_equal(have, want, err_msg=key)
    lg, ids, wts = got["logits"][1], got["ids"][1], got["wts"][1]
    assert np.linalg.norm(lg - d["refs"][0]) / np.linalg.norm(d["scales"][0]) < 1e-5
    np.testing.assert_array_equal(ids, _top_k(lg, k))
    p = np.exp(lg.astype(np.float64) - lg.max())
    ref_w = p[ids] / (p[ids].sum() if renorm else p.sum()) * 1.5
    np.testing.assert_allclose(wts, ref_w, rtol=1e-4, atol=1e-30)
    if biased:
        oss_ids, oss_w = gptoss.route_softmax_weight(lg[None], k)
        assert ids.tolist() == oss_ids[0].tolist()
        np.testing.assert_allclose(wts, oss_w[0] * 1.5, rtol=1e-5, atol=1e-30)
    np.testing.assert_array_equal(got["counts"][1], 2 * np.bincount(ids, minlength=n_expert))
    assert got["stats"][1].tolist() == [2 * int((table[ids] == 1500).sum()), 2 * k]
    lg2 = logits2.get()
    assert np.linalg.norm(lg2 - d["refs"][1]) / np.linalg.norm(d["scales"][1]) < 1e-5
    np.testing.assert_array_equal(pred.get(), _top_k(lg2, k))
    np.testing.assert_array_equal(actual.get()[:k], ids)
    assert actual.get()[k] == -7
    right = len(set(ids.tolist()) & set(pred_in_h.tolist()))
    assert pstats.get().tolist() == [2 * k, 2 * right, 0, 0]
    assert int(b["counter"].get()[0]) == int(a["counter"].get()[0]) == 0


class _Arena:
    """Blobs in mapped pinned host memory (as the expert arena), some experts in 'VRAM slots', one entry 0."""

    def __init__(self, cp, rng, n_layer, n_expert, nbytes, stride, n_resident, zero=True):
        from engine.cuda.arena import HOST_ALLOC_MAPPED, HOST_ALLOC_PORTABLE, device_address
        self.cp = cp
        n = n_layer * n_expert
        self.hp = cp.cuda.runtime.hostAlloc(n * stride, HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED)
        import ctypes
        self.host = np.ctypeslib.as_array((ctypes.c_uint8 * (n * stride)).from_address(self.hp))
        self.host[:] = rng.integers(0, 256, n * stride, dtype=np.uint8)
        dp = device_address(self.hp)
        self.slots = cp.asarray(rng.integers(0, 256, n_resident * stride, dtype=np.uint8))
        self.slot_lo = self.slots.data.ptr
        self.slot_hi = self.slot_lo + n_resident * stride
        self.table0 = np.array([dp + g * stride for g in range(n)], dtype=np.uint64)
        res = rng.permutation(n)[:n_resident]
        for s, g in enumerate(res):
            self.table0[g] = self.slot_lo + s * stride
        self.resident = set(res.tolist())
        self.zero = int(rng.choice(np.setdiff1d(np.arange(n), res))) if zero else -1
        if zero:
            self.table0[self.zero] = 0
        self.table = cp.asarray(self.table0)

    def close(self):
        self.cp.cuda.runtime.freeHost(self.hp)


@gpu
@pytest.mark.parametrize("n_expert,k,nbytes,stride,grid,resident", [
    (8, 2, 3000, 3072, (pf.COPY_BLOCKS, pf.COPY_THREADS), 0.5),
    (128, 8, 40000, 40192, (pf.COPY_BLOCKS, pf.COPY_THREADS), 0.5),
    (64, 4, 160, 256, (pf.COPY_BLOCKS, pf.COPY_THREADS), 0.5),
    (16, 8, 40000, 40192, (3, 64), 0.5),          # a small grid: many rounds a warp, the tail round partial
    (16, 8, 40000, 40192, (1, 32), 0.5),          # one warp: compaction, restore and copy all by warp 0
    (16, 8, 4000, 4096, (pf.COPY_BLOCKS, pf.COPY_THREADS), 0.0),    # nothing resident: all k copied
    (16, 8, 4000, 4096, (pf.COPY_BLOCKS, pf.COPY_THREADS), 1.0),    # everything resident: nothing copied
])
@pytest.mark.parametrize("banks", [2, 3])
def test_prefetch_copy_and_restore(n_expert, k, nbytes, stride, grid, resident, banks):
    """Layer by layer as in a step: only the predicted experts whose entry is neither a VRAM slot nor 0 are copied,
    in prediction order, byte for byte (the staging past each blob, the unused slots and the other banks untouched),
    their entries rewritten and recorded, the bank's previous layer (`banks` back: 2 at depth 1, 3 at depth 2)
    restored; then the finish (+ prefetch_restore for a third bank) restores the rest."""
    cp = _cp()
    rng = np.random.default_rng(n_expert * k + grid[0])
    n_layer = 7             # every bank reused at least once
    units = (nbytes + 15) // 16
    n_res = int(n_layer * n_expert * resident)
    A = _Arena(cp, rng, n_layer, n_expert, nbytes, stride, n_resident=n_res, zero=n_res < n_layer * n_expert)
    mod = _module([0])
    copy, finish = mod.get_function("prefetch_copy"), mod.get_function("prefetch_finish")
    I32, I64, U32, U64 = np.int32, np.int64, np.uint32, np.uint64
    try:
        staging = cp.full(banks * k * stride, 0xFF, dtype=cp.uint8)
        pred = cp.zeros(banks * k, dtype=cp.int32)
        act = np.stack([rng.permutation(n_expert)[:k] for _ in range(n_layer)]).astype(np.int32)
        actual = cp.asarray(act)
        rec = cp.zeros((banks, 2 + k), dtype=cp.int32)
        rec_addr = cp.zeros((banks, k), dtype=cp.uint64)
        stats = cp.zeros(4, dtype=cp.uint64)
        counter = cp.zeros(1, dtype=cp.int32)
        expect = A.table0.copy()
        staged_by_layer = []
        used = lambda j: sum(e in act[j].tolist() for e, _ in staged_by_layer[j])
        for m in range(n_layer):
            b = m % banks
            # predictions: resident, non-resident and (where this layer has it) the 0 entry, all mixed
            p = rng.permutation(n_expert)[:k]
            z = A.zero - m * n_expert
            if A.zero >= 0 and 0 <= z < n_expert and z not in p:
                p[0] = z
            pred[b * k:(b + 1) * k] = cp.asarray(p.astype(np.int32))
            staging[b * k * stride:(b + 1) * k * stride] = 0xFF
            others = [o for o in range(banks) if o != b]
            other = [staging.get()[o * k * stride:(o + 1) * k * stride] for o in others]
            copy(grid[:1], grid[1:], (_u64(A.table), I32(m), I32(n_expert), I32(k), _u64(pred, 4 * k * b),
                                      _u64(staging, b * k * stride), I64(stride), U32(units), U64(A.slot_lo),
                                      U64(A.slot_hi), U64(0), U64(0), _u64(rec[b]), _u64(rec_addr[b]), _u64(actual),
                                      _u64(stats, 8 * 2), _u64(stats, 8 * 3), _u64(counter)))
            cp.cuda.Device().synchronize()
            orig = A.table0[m * n_expert + p]
            staged = [(int(e), int(a)) for e, a in zip(p, orig) if a and not (A.slot_lo <= a < A.slot_hi)]
            staged_by_layer.append(staged)
            if resident == 0.0:
                assert len(staged) == k - (1 if 0 <= A.zero - m * n_expert < n_expert else 0)
            if resident == 1.0:
                assert staged == []
            if m >= banks:      # the bank's previous layer is back to its original entries
                lo = (m - banks) * n_expert
                expect[lo:lo + n_expert] = A.table0[lo:lo + n_expert]
            base = staging.data.ptr + b * k * stride
            for c, (e, _) in enumerate(staged):
                expect[m * n_expert + e] = base + c * stride
            np.testing.assert_array_equal(A.table.get(), expect)
            full = staging.get()
            st = full[b * k * stride:(b + 1) * k * stride].reshape(k, stride)
            for c, (e, _) in enumerate(staged):
                g = m * n_expert + e
                np.testing.assert_array_equal(st[c, :units * 16], A.host[g * stride:g * stride + units * 16])
                assert (st[c, units * 16:] == 0xFF).all()        # exactly the blob's bytes, no more
            assert (st[len(staged):] == 0xFF).all()
            for o, before in zip(others, other):
                np.testing.assert_array_equal(full[o * k * stride:(o + 1) * k * stride], before)
            r = rec.get()[b]
            assert r[0] == m and r[1] == len(staged)
            assert r[2:2 + len(staged)].tolist() == [e for e, _ in staged]
            assert rec_addr.get()[b][:len(staged)].tolist() == [a for _, a in staged]
            s = stats.get()
            assert int(s[2]) == sum(map(len, staged_by_layer))
            assert int(s[3]) == sum(used(j) for j in range(m - banks + 1))     # restored so far: 0 .. m-banks
            assert int(counter.get()[0]) == 0
        if resident < 1.0:
            assert sum(map(len, staged_by_layer)) > 0
        # finish: the last layer's routing noted against its prediction, banks 0 and 1 restored; a third bank by
        # prefetch_restore (one warp), which must leave an already restored (empty) record alone
        last = n_layer - 1
        ids = cp.asarray(act[last])
        stats[:2] = 0
        finish((1,), (32,), (_u64(A.table), I32(n_expert), I32(k), _u64(ids), _u64(pred, 4 * k * (last % banks)),
                             I32(1), I32(last), _u64(actual), _u64(rec[0]), _u64(rec_addr[0]), _u64(rec[1]),
                             _u64(rec_addr[1]), _u64(stats)))
        if banks == 3:
            restore = mod.get_function("prefetch_restore")
            cp.cuda.Device().synchronize()
            assert int(rec.get()[2, 1]) == len(staged_by_layer[5])       # layer 5's bank: still to restore
            for b in (2, 0):                                            # bank 0: restored already, a no-op
                restore((1,), (32,), (_u64(A.table), I32(n_expert), I32(k), _u64(rec[b]), _u64(rec_addr[b]),
                                      _u64(actual), _u64(stats, 8 * 3)))
        cp.cuda.Device().synchronize()
        np.testing.assert_array_equal(A.table.get(), A.table0)
        assert rec.get()[:, 1].tolist() == [0] * banks
        s = stats.get()
        right = len(set(act[last].tolist()) & set(pred.get()[(last % banks) * k:][:k].tolist()))
        assert s.tolist() == [k, right, sum(map(len, staged_by_layer)), sum(used(j) for j in range(n_layer))]
    finally:
        A.close()


@gpu
@pytest.mark.parametrize("n_expert,k,nbytes,stride,grid", [
    (16, 8, 40000, 40192, (pf.COPY_BLOCKS, pf.COPY_THREADS)),
    (128, 8, 4000, 4096, (pf.COPY_BLOCKS, pf.COPY_THREADS)),
    (16, 8, 40000, 40192, (3, 64)),              # many rounds a warp, the restore by the block's last warp
    (8, 2, 160, 256, (1, 32)),                   # one warp does it all
])
def test_miss_copy_copies_only_what_is_still_outside_vram(n_expert, k, nbytes, stride, grid):
    """The late-miss copy (prefetch_copy with the routing as its prediction and the staging + miss banks as a second
    VRAM range), layer by layer into two miss banks: of the routed experts, those in a cache slot, already staged by
    the prefetch (entry inside the banks' range) or file-only (0) are left alone; the others are copied byte for byte
    into the layer's miss bank, their entries pointed there; the bank's layer before is restored first (the staged
    entries it met stay as the prefetch left them); only the fetched counter moves. Then prefetch_restore with two
    warps (the step's end) puts both miss banks back."""
    cp = _cp()
    rng = np.random.default_rng(n_expert + k + grid[0])
    n_layer, nb = 6, 2                           # nb: the prefetch's banks, before the two miss banks
    units = (nbytes + 15) // 16
    A = _Arena(cp, rng, n_layer, n_expert, nbytes, stride, n_resident=n_layer * n_expert // 3)
    copy, restore = _module([0]).get_function("prefetch_copy"), _module([0]).get_function("prefetch_restore")
    I32, I64, U32, U64 = np.int32, np.int64, np.uint32, np.uint64
    try:
        staging = cp.full((nb + 2) * k * stride, 0xFF, dtype=cp.uint8)
        lo, hi = staging.data.ptr, staging.data.ptr + staging.nbytes
        miss_base = lambda b: lo + (nb + b) * k * stride
        rec, rec_addr = cp.zeros((2, 2 + k), dtype=cp.int32), cp.zeros((2, k), dtype=cp.uint64)
        stats, counter = cp.zeros(pf.STATS, dtype=cp.uint64), cp.zeros(1, dtype=cp.int32)
        table0 = A.table0.copy()                 # as the prefetch left it: some routed experts staged
        routes, fetched = [], []
        for m in range(n_layer):
            ids = rng.permutation(n_expert)[:k]
            z = A.zero - m * n_expert
            if 0 <= z < n_expert and z not in ids:
                ids[-1] = z                      # the file-only expert routed
            outside = [e for e in ids if table0[m * n_expert + e] and
                       not (A.slot_lo <= table0[m * n_expert + e] < A.slot_hi)]
            # up to two of them staged by the prefetch (bank m % nb), always leaving one for the miss copy (at k=2
            # staging two left nothing to fetch in any layer)
            for c, e in enumerate(outside[:min(2, len(outside) - 1)]):
                table0[m * n_expert + e] = lo + ((m % nb) * k + c) * stride
            routes.append(ids.astype(np.int32))
        A.table[:] = cp.asarray(table0)
        expect = table0.copy()
        for m in range(n_layer):
            b = m % 2
            ids = cp.asarray(routes[m])
            copy(grid[:1], grid[1:], (_u64(A.table), I32(m), I32(n_expert), I32(k), _u64(ids),
                                      U64(miss_base(b)), I64(stride), U32(units), U64(A.slot_lo), U64(A.slot_hi),
                                      U64(lo), U64(hi), _u64(rec[b]), _u64(rec_addr[b]), U64(0), _u64(stats, 8 * 6),
                                      U64(0), _u64(counter)))
            cp.cuda.Device().synchronize()
            row = table0[m * n_expert:(m + 1) * n_expert]
            late = [int(e) for e in routes[m] if row[e] and not (A.slot_lo <= row[e] < A.slot_hi)
                    and not (lo <= row[e] < hi)]
            fetched.append(late)
            if m >= 2:                           # the bank's previous layer back to the prefetch's entries
                expect[(m - 2) * n_expert:(m - 1) * n_expert] = table0[(m - 2) * n_expert:(m - 1) * n_expert]
            for c, e in enumerate(late):
                expect[m * n_expert + e] = miss_base(b) + c * stride
            np.testing.assert_array_equal(A.table.get(), expect)
            bank = staging.get()[(nb + b) * k * stride:(nb + b + 1) * k * stride].reshape(k, stride)
            for c, e in enumerate(late):
                g = m * n_expert + e
                np.testing.assert_array_equal(bank[c, :units * 16], A.host[g * stride:g * stride + units * 16])
            r = rec.get()[b]
            assert r[0] == m and r[1] == len(late) and r[2:2 + len(late)].tolist() == late
            assert rec_addr.get()[b][:len(late)].tolist() == [int(row[e]) for e in late]
            assert stats.get().tolist() == [0] * 6 + [sum(map(len, fetched))]
            assert int(counter.get()[0]) == 0
        assert sum(map(len, fetched)) > 0
        assert (staging.get()[:nb * k * stride] == 0xFF).all()        # the prefetch's banks untouched
        restore((1,), (64,), (_u64(A.table), I32(n_expert), I32(k), _u64(rec), _u64(rec_addr), U64(0), U64(0)))
        cp.cuda.Device().synchronize()
        np.testing.assert_array_equal(A.table.get(), table0)
        assert rec.get()[:, 1].tolist() == [0, 0]
        assert stats.get().tolist() == [0] * 6 + [sum(map(len, fetched))]
    finally:
        A.close()


# --- GPU: end to end -----------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("share,graph", [("none", True), ("half", True), ("none", False)])
def test_prefetch_answer_matches_cpu(cpu_runs, name, share, graph, depth):
    model, prompt, toks, cpu_logits = cpu_runs[name]
    cfg = model.config
    total = cfg.n_layer * cfg.n_expert
    slots = {"none": 0, "half": total // 2}[share]
    be = cuda_backend(model, expert_slots=slots, adapt_every=4, prefetch=True, no_graph=not graph,
                      prefetch_depth=depth)
    try:
        assert be.step.prefetch is not None and be.info()["prefetch"] == "on"
        assert be.step.prefetch.depth == depth and be.step.prefetch.banks == depth + 1
        got = greedy(be, prompt, N_GREEDY)
        assert_same_greedy(got, toks, cpu_logits)
        be.stream.synchronize()
        np.testing.assert_array_equal(be.cache.table.get(stream=be.stream), be.cache.table_host)   # clean between steps
        assert (be.step.prefetch.rec.get()[:, 1] == 0).all()                       # every bank restored
        ps, st = be.prefetch_stats(), be.get_stats()
        steps = N_GREEDY - 1
        k = cfg.n_expert_used
        # every layer but the first noted against its prediction, layers 2.. against the depth-2 pair at depth 2
        assert ps.predicted + ps.predicted2 == steps * (cfg.n_layer - 1) * k
        assert ps.predicted2 == (steps * (cfg.n_layer - 2) * k if depth == 2 else 0)
        assert 0 <= ps.correct <= ps.predicted and 0 <= ps.correct2 <= ps.predicted2
        assert 0 < ps.staged and ps.used <= ps.staged
        assert st.lookups == steps * cfg.n_layer * k
        if share == "none":
            assert ps.staged == ps.predicted + ps.predicted2 and ps.used == ps.correct + ps.correct2
            assert st.hits == 0                  # a staged expert is not a cache hit
        be.truncate(len(prompt))
        dec = np.stack([be.forward([t]) for t in toks[:-1]])
        assert rel_rows(dec, cpu_logits[1:]).max() < 1e-2
    finally:
        be.close()


@gpu
@pytest.mark.parametrize("fetch", ["on", "off"])
@pytest.mark.parametrize("depth", [1, 2])
def test_table_after_a_step_equals_before(cpu_runs, depth, fetch):
    model, prompt, toks, _ = cpu_runs["tiny-qwen3moe-q4k"]
    cfg = model.config
    be = cuda_backend(model, expert_slots=cfg.n_layer * cfg.n_expert // 2, adapt_every=4, prefetch=True,
                      prefetch_depth=depth, fetch_misses=fetch == "on")
    try:
        greedy(be, prompt, 24)               # the adaptive tier fills half the slots: hits and misses mixed
        be.cache.poll(be.stream, wait=True)
        be.stream.synchronize()
        assert 0 < be.cache.resident().sum()
        before_staged, before_fetched = be.prefetch_stats().staged, be.prefetch_stats().fetched
        tok = toks[0]
        for _ in range(8):
            before = be.cache.table.get(stream=be.stream)
            be.step.launch(tok, be.n_cached)
            tok, _ = be.step.result()
            be.n_cached += 1
            np.testing.assert_array_equal(be.cache.table.get(stream=be.stream), before)
            np.testing.assert_array_equal(be.cache.table.get(stream=be.stream), be.cache.table_host)
            assert (be.step.prefetch.miss_rec.get()[:, 1] == 0).all()
        assert be.prefetch_stats().staged > before_staged
        assert (be.prefetch_stats().fetched > before_fetched) == (fetch == "on")
    finally:
        be.close()


@gpu
def test_prefetch_switch(cpu_runs):
    model = cpu_runs["tiny-qwen3moe-q4k"][0]
    total = model.config.n_layer * model.config.n_expert
    for slots, flag, on in [(total, True, False), (total // 2, False, False), (total // 2, True, True),
                            (total // 2, None, True), (total - 1, None, False), (total - 1, True, True)]:
        lines = []
        if flag is None:
            from engine.cuda.backend import CUDABackend, CudaOptions
            from test_cuda_backend import CTX
            be = CUDABackend(model, CTX, CudaOptions(expert_slots=slots), log=lines.append)
        else:
            be = cuda_backend(model, expert_slots=slots, prefetch=flag)
        try:
            assert (be.step.prefetch is not None) == on
            if slots == total - 1 and flag is None:   # 31 of 32 in VRAM: the default leaves it off, and says why
                assert any("expert prefetch off" in ln and "--tune prefetch=on overrides" in ln for ln in lines), lines
            assert be.info()["prefetch"] == ("on" if on else "off")
            assert (be.prefetch_stats() is not None) == on
        finally:
            be.close()


@gpu
def test_sampled_variant_at_depth_2_restores_the_table_and_matches_depth_1(fixtures_dir):
    """The sampled graph variant carries the depth-2 fork/joins too: after sampled steps the device table equals the
    host's and every bank's record is empty, a seeded run reproduces, and its tokens are depth 1's (the staged copies
    are the arena's bytes: where an expert is read from cannot change the answer)."""
    import json

    from engine.cuda.backend import CUDABackend, CudaOptions
    from engine.gguf_model import open_model
    from test_cuda_sampler import _sampled
    name = "tiny-qwen3moe-q4k"
    model = open_model(fixtures_dir / "reference" / f"{name}.gguf")
    prompt = list(json.loads((fixtures_dir / "reference" / f"{name}.json").read_text())["cases"][0]["prompt_ids"])
    total = model.config.n_layer * model.config.n_expert
    params = {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 77, "penalty_present": 0.5}
    runs = {}
    for depth in (1, 2):
        be = CUDABackend(model, 256, CudaOptions(expert_slots=total // 2, prefetch=True, adapt_every=0,
                                                 prefetch_depth=depth))
        try:
            assert be.step.prefetch is not None and be.step.prefetch.depth == depth
            runs[depth] = _sampled(be, prompt, params)
            assert set(be.step.graphs) == {"greedy", "sampled"}
            be.stream.synchronize()
            np.testing.assert_array_equal(be.cache.table.get(stream=be.stream), be.cache.table_host)
            assert (be.step.prefetch.rec.get()[:, 1] == 0).all()
            ps = be.prefetch_stats()
            assert ps.staged > 0 and (ps.predicted2 > 0) == (depth == 2)
            be.truncate(0)
            assert _sampled(be, prompt, params) == runs[depth]
        finally:
            be.close()
    assert runs[2] == runs[1]


def _teacher_forced(be, prompt, toks):
    """Decode logits along toks, the prompt decoded token by token too: the prompt pass's grouped GEMMs add with
    float atomics, so a K/V cache it wrote differs between runs by rounding, which would hide the 1e-5 comparison."""
    be.truncate(0)
    for t in prompt:
        be.forward([t])
    return np.stack([be.forward([t]) for t in toks[:-1]])


@gpu
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("name", MOE)
def test_fetch_misses_changes_no_token_or_logit(cpu_runs, name, depth):
    """fetch_misses on and off, with none and half of the experts in VRAM, against the CPU and against every expert
    resident: the same greedy tokens and the same decode logits (the late copies are the arena's bytes, read by the
    same kernels from VRAM instead of over PCIe), the table clean and every bank empty after the steps. With it on,
    every miss is either a staged expert the router chose or a late copy (used + fetched == lookups - hits, and
    fetched > 0); with it off nothing is fetched."""
    model, prompt, toks, cpu_logits = cpu_runs[name]
    cfg = model.config
    total = cfg.n_layer * cfg.n_expert
    ref = cuda_backend(model, expert_slots=total, adapt_every=0)
    try:
        assert ref.step.prefetch is None
        ref_toks = greedy(ref, prompt, N_GREEDY)
        ref_dec = _teacher_forced(ref, prompt, toks)
    finally:
        ref.close()
    assert_same_greedy(ref_toks, toks, cpu_logits)
    for fetch in ("on", "off"):
        for slots in (0, total // 2):
            be = cuda_backend(model, expert_slots=slots, adapt_every=4, prefetch=True, prefetch_depth=depth,
                              fetch_misses=fetch == "on")
            try:
                p = be.step.prefetch
                assert p is not None and p.fetch_misses == (fetch == "on") and p.depth == depth
                got = greedy(be, prompt, N_GREEDY)
                assert got == ref_toks, (fetch, slots)
                be.stream.synchronize()
                np.testing.assert_array_equal(be.cache.table.get(stream=be.stream), be.cache.table_host)
                assert (p.rec.get()[:, 1] == 0).all() and (p.miss_rec.get()[:, 1] == 0).all()
                ps, st = be.prefetch_stats(), be.get_stats()
                misses = st.lookups - st.hits
                assert misses > 0 and st.lookups == (N_GREEDY - 1) * cfg.n_layer * cfg.n_expert_used
                if fetch == "on":
                    assert ps.fetched > 0 and ps.used + ps.fetched == misses, (ps, st)
                else:
                    assert ps.fetched == 0 and ps.used <= misses
                dec = _teacher_forced(be, prompt, toks)
                # the same bytes through the same kernels: equal but for reduction order, nowhere near 1e-2
                assert rel_rows(dec, ref_dec).max() < 1e-5, (fetch, slots)
                assert rel_rows(dec, cpu_logits[1:]).max() < 1e-2
            finally:
                be.close()


def _profile_half(model, path, seed):
    """A profile putting a random half of the experts first (VRAM) and the rest after (pinned by the budget)."""
    from engine.profile import from_flat, save_profile
    cfg = model.config
    order = np.random.default_rng(seed).permutation(cfg.n_layer * cfg.n_expert)
    save_profile(path, from_flat(cfg.n_layer, cfg.n_expert, order))
    return order


@gpu
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("mode", ["mmap", "budget"])
def test_fetch_misses_in_the_memory_modes(cpu_runs, mode, depth, tmp_path):
    """--mmap-experts (no expert pinned: entries 0 until the staging ring holds them, the per-layer path, then the
    whole-step graph over the ring's pinned slots) and --resident-budget-gib (VRAM holds the profile's first half,
    the budget pins the rest: every step the whole-step graph, every miss pinned): tokens as the CPU's, the table
    clean after the steps; in the budget mode every miss a used staged copy or a late one."""
    from engine.cuda.arena import blob_layout
    from engine.cuda.backend import CUDABackend, CudaOptions
    model, prompt, toks, cpu_logits = cpu_runs["tiny-qwen3moe-q4k"]
    cfg = model.config
    total = cfg.n_layer * cfg.n_expert
    opts = dict(expert_slots=total // 2, prefetch=True, prefetch_depth=depth, fetch_misses=True)
    if mode == "mmap":
        opts.update(mmap_experts=True, adapt_every=4)
    else:
        _profile_half(model, tmp_path / "p.bin", seed=3)
        opts.update(resident_budget_gib=(total // 2) * blob_layout(model).stride / 2**30, adapt_every=0,
                    expert_profile=str(tmp_path / "p.bin"))
    be = CUDABackend(model, 256, CudaOptions(**opts))
    try:
        assert be.step.prefetch is not None and be.step.prefetch.fetch_misses
        if mode == "budget":
            assert be.cache.reachable()
        be.reset_stats()
        assert_same_greedy(greedy(be, prompt, N_GREEDY), toks, cpu_logits)
        be.stream.synchronize()
        np.testing.assert_array_equal(be.cache.table.get(stream=be.stream), be.cache.table_host)
        p = be.step.prefetch
        assert (p.rec.get()[:, 1] == 0).all() and (p.miss_rec.get()[:, 1] == 0).all()
        ps, st = be.prefetch_stats(), be.get_stats()
        if mode == "budget":
            assert be.mem.paged.paged_steps == 0 and st.file_blobs == 0
            assert ps.fetched > 0 and ps.used + ps.fetched == st.lookups - st.hits, (ps, st)
        else:
            assert ps.used + ps.fetched <= st.lookups - st.hits
            assert (ps.fetched > 0) or be.mem.paged.graph_steps == 0
    finally:
        be.close()
