"""The decode pipeline (engine/cuda/pipeline.py, CUDABackend._pick_in_step): the next step, fed on the GPU by this
step's pick, is launched before the pick is read, and kept when the next call is the one it assumed.

On the CPU (tests/test_cuda_pick.py's fake CUDA backend: the fake device runs each step at its launch, in stream
order, its pick published by position and fed to the step after): the session's lines pipelined equal those
unpipelined for greedy, penalized and seeded sampled requests; an end of generation, a cancel (the server's stop
sequence) or a failed pick after a step ran ahead discards it and leaves no trace (the next request, reusing the
prefix, equals the unpipelined run, a recurrent state included); the last token (max_new), a grammar, logprobs and
drafts run nothing ahead. On the GPU (gpu-marked): the same equalities on the tiny moe, hybrid and gpt-oss models.
"""
import threading
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("cupy")

from engine.protocol import GenRequest  # noqa: E402
from engine.sampling import PickSpec, Sampler  # noqa: E402
from engine.session import Session  # noqa: E402
import test_cuda_pick as tp  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

EOG = 10 ** 6                   # an id no fake pick makes: no end of generation unless a test names one
PARAMS = [{}, {"penalty_repeat": 1.8, "penalty_last_n": 4}, {"temperature": 1.3, "top_k": 20, "seed": 5},
          {"temperature": 0.9, "top_p": 0.9, "seed": 8, "penalty_present": 1.0, "penalty_freq": 0.3,
           "penalty_last_n": 6}]


class _Recurrent:
    """A recurrent state on the fake device: one number folding in every token a step or the prompt pass read, which
    the fake model's logits read (so a step run ahead and not undone changes every later pick)."""

    def __init__(self):
        self.mem = np.zeros(1, np.int64)
        self.nbytes = 8

    def fold(self, token):
        self.mem[0] = (int(self.mem[0]) * 1_000_003 + int(token) + 11) % (1 << 40)

    def zero(self):
        self.mem[0] = 0

    def snapshot(self):
        return self.mem.copy()

    def restore(self, data):
        self.mem[:] = data


class _Copy:
    """DeviceCopy over the fake device's arrays (its copies run at once: the fake device is in stream order)."""

    def __init__(self, live):
        self.live, self.spare = live, live.copy()

    def save(self):
        self.spare[:] = self.live

    def restore(self):
        self.live[:] = self.spare


class _RecurrentPrefill(tp._FakePrefill):
    def forward(self, part, pos, all_logits, ahead=None):
        rows = []
        for i, t in enumerate(part):
            rows.append(super().forward([t], pos + i, True)[0])
            self.be.recurrent_state.fold(t)
        return np.stack(rows if all_logits else rows[-1:]).view(tp._Arr)


def backend(monkeypatch, pipelined=True, recurrent=False):
    """The fake CUDA backend, with a fake recurrent state (and its DeviceCopy) when asked; `stats` counts the steps
    the device ran (the expert cache's counters stand-in, restorable as they are)."""
    be = tp.fake_cuda(monkeypatch, pipelined=pipelined)
    be.steps_run = np.zeros(1, np.int64)
    be._restorable = [_Copy(be.steps_run)]

    def on_step(pos):
        be.steps_run[0] += 1
        if be.recurrent_state is not None:
            be.recurrent_state.fold(be.held[pos])
    be.on_step = on_step
    if recurrent:
        st = be.recurrent_state = _Recurrent()
        be._restorable.append(_Copy(st.mem))
        be.prefill = _RecurrentPrefill(be)
        be.model_logits = lambda seq: (np.full(tp.V, np.nan, np.float32) if len(seq) == be.nan_at
                                       else tp.logits_of(list(seq) + [int(st.mem[0])]))
    return be


def run(session, prompt, max_new, params=None, grammar=None, logprobs=None, cancel_after=None):
    """One request: (its T lines, finish). cancel_after: the server's stop sequence, found after that many T lines
    (its cancel arrives while the next step runs)."""
    lines, ev = [], threading.Event()

    def emit(line):
        lines.append(line)
        if cancel_after is not None and sum(x.startswith("T ") for x in lines) >= cancel_after:
            ev.set()
    done = session.run(GenRequest(max_new, list(prompt), params=dict(params or {}), grammar=grammar,
                                  logprobs=logprobs), emit, ev)
    assert done is not None, lines
    return [x for x in lines if x.startswith("T ")], done.finish


def both(monkeypatch, recurrent=False, eog=(EOG,), **kw):
    """(pipelined, unpipelined) sessions over fresh fake backends."""
    return [Session(backend(monkeypatch, p, recurrent), eog, **kw) for p in (True, False)]


@pytest.mark.parametrize("recurrent", [False, True])
@pytest.mark.parametrize("params", PARAMS)
def test_pipelined_lines_equal_unpipelined_and_steps_run_ahead(monkeypatch, params, recurrent):
    on, off = both(monkeypatch, recurrent)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    a, b = run(on, prompt, 24, params), run(off, prompt, 24, params)
    assert a == b and b[1] == "length" and len(b[0]) == 24
    c = on.backend.pipeline_counts
    # the first pick is the prompt's; each later step but the last was run ahead by the step before it (the first
    # decode step ran ahead from the first call) and kept; the last token runs nothing ahead (max_new)
    assert (c.ahead, c.kept, c.discarded) == (22, 22, 0)
    assert off.backend.pipeline_counts.ahead == 0
    assert on.backend.steps_run[0] == off.backend.steps_run[0] == 23


@pytest.mark.parametrize("recurrent", [False, True])
@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("stop", ["eog", "cancel", "length"])
def test_a_stop_after_a_step_ran_ahead_leaves_no_trace(monkeypatch, params, recurrent, stop):
    """An end of generation (or the server's cancel) found after the next step was launched: that step is discarded,
    so the device's counters, recurrent state and sampler follow the unpipelined run, and the next request (the
    conversation so far plus new tokens, its prefix reused) picks the same tokens."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    probe = Session(backend(monkeypatch, False, recurrent), (EOG,))
    toks = [int(x.split()[1]) for x in run(probe, prompt, 24, params)[0]]
    cut = next(i for i in range(4, 24) if toks.index(toks[i]) == i)      # a token first picked mid-run
    eog = (toks[cut],) if stop == "eog" else (EOG,)
    on, off = both(monkeypatch, recurrent, eog)
    kw = dict(cancel_after=7) if stop == "cancel" else {}
    first = [run(s, prompt, 24 if stop != "length" else 12, params, **kw) for s in (on, off)]
    assert first[0] == first[1]
    lines, finish = first[0]
    want = {"eog": (cut, "stop"), "cancel": (7, "cancel"), "length": (12, "length")}[stop]
    assert (len(lines), finish) == want
    c = on.backend.pipeline_counts
    assert c.discarded == (0 if stop == "length" else 1) and c.ahead == c.kept + c.discarded
    assert on.backend.steps_run[0] == off.backend.steps_run[0]          # the counters restored
    assert on.backend.n_cached == len(on.tokens) == off.backend.n_cached
    if recurrent:
        assert on.backend.recurrent_state.mem[0] == off.backend.recurrent_state.mem[0]
    # the next turn: everything so far and three new tokens, the prefix reused (a recurrent one from the checkpoint
    # at the request's end)
    convo = prompt + [int(x.split()[1]) for x in lines] + [7, 7, 2]
    second = [run(s, convo, 16, params) for s in (on, off)]
    assert second[0] == second[1]
    assert on.backend.steps_run[0] == off.backend.steps_run[0]


def test_a_failed_pick_discards_the_step_fed_by_it(monkeypatch):
    """A pick that failed (NaN logits) fed token 0 to the step launched after it: that step is discarded before the
    refusal, and the backend serves the next request as the unpipelined one does."""
    for p in ({}, {"temperature": 1.0, "seed": 3}):
        be, ref = backend(monkeypatch, True), backend(monkeypatch, False)
        outs = []
        for b in (be, ref):
            b.nan_at = 12                    # the step at position 11 (held length 12) has NaN logits
            s = Session(b, (EOG,))
            lines = []
            done = s.run(GenRequest(16, [3, 1, 4, 1, 5, 9, 2, 6], params=dict(p)), lines.append)
            assert done is None and lines[-1] == "ERR request failed: SamplingError: the model produced NaN logits"
            b.nan_at = None
            outs.append(run(s, [3, 1, 4, 1, 5, 9, 2, 6, 8], 10, p))
        assert outs[0] == outs[1]
        assert be.pipeline_counts.discarded >= 1


def test_the_last_token_a_grammar_logprobs_and_drafts_run_nothing_ahead(monkeypatch):
    be = backend(monkeypatch)
    s = Session(be, (EOG,), grammars=lambda g: _AllowAll())
    prompt = [3, 1, 4, 1, 5]
    run(s, prompt, 1)                            # one token: the prompt's pick is the last
    run(s, prompt, 8, grammar="g")               # a grammar: each mask is the host's, from the pick before
    run(s, prompt, 8, logprobs=2)                # logprobs: each pick's logits are read after the step
    assert be.pipeline_counts.ahead == 0
    spec = Sampler({}).spec()
    be.truncate(0)
    be.decode([1, 2, 3], spec)
    be.decode([4, 5, 6], spec, all_positions=True)      # a window: the next call is fed a draft
    assert be.pipeline_counts.ahead == 0
    be.decode([7], PickSpec(more=False))
    assert be.pipeline_counts.ahead == 0
    be.decode([8], PickSpec())
    assert be.pipeline_counts.ahead == 1 and be._ahead is not None
    be.truncate(be.n_cached)                     # any other call discards it first
    assert be._ahead is None and be.pipeline_counts.discarded == 1


def test_a_call_other_than_the_assumed_one_discards_the_step_ahead(monkeypatch):
    """Another token, another pick mode or another sampler state than the step ahead assumed: discarded, and the
    pick is the one its spec alone says (test_cuda_pick's `want`)."""
    be = backend(monkeypatch)
    seq, fed = [], [3, 1, 4]
    samplers = [Sampler({}), Sampler({"temperature": 1.1, "seed": 4}), Sampler({"penalty_repeat": 1.5})]
    rng = np.random.default_rng(0)
    for i in range(40):
        s = samplers[(i // 5) % 3]                  # runs of five picks of one request's sampler
        spec = s.spec(seq)
        p = be.decode(fed, spec)[0]
        assert tp.got(p) == tp.want(seq, fed, spec), i
        s.advance()
        seq += fed
        fed = [p.id] if rng.random() < 0.8 else [int(rng.integers(tp.V))]     # sometimes not the pick
    c = be.pipeline_counts
    assert c.kept > 5 and c.discarded > 5 and c.ahead == c.kept + c.discarded + (be._ahead is not None)


class _AllowAll:
    """A grammar that allows every token and never completes."""
    done = False

    def mask(self):
        from engine.grammar import mask_words
        return np.full(mask_words(tp.V), -1, np.int32)

    def accept(self, token):
        pass


# --- on the GPU --------------------------------------------------------------------------------------------------
FAMILIES = ("moe", "hybrid", "gptoss")
# The families whose steps run ahead (run_ahead): the others parted from the unpipelined run on the H200 (hybrid at
# the first token, gpt-oss by 4e-4 after a discard) and keep the pipeline off; their tests check that it is off.
RUN_AHEAD = ("moe",)
GPU_PARAMS = [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7, "penalty_repeat": 1.3, "penalty_last_n": 8}]


def _gpu_backend(model, pipeline):
    from engine.cuda.backend import CUDABackend, CudaOptions
    return CUDABackend(model, 512, CudaOptions(pipeline=pipeline, prefill_chunk=64))


def _assert_not_run_ahead(model):
    """A family that does not run ahead keeps the pipeline off under --tune pipeline=on: no step is launched early."""
    be = _gpu_backend(model, True)
    try:
        assert be.pipelined is False and be.info()["pipeline"] == "off"
        tok = be.decode([1, 2, 3], PickSpec())[0].id
        be.decode([tok], PickSpec())
        assert be.pipeline_counts.ahead == 0
    finally:
        be.close()


def _conversation(model, prompt, pipeline, params, eog_at, cancel_at):
    """Three requests on one backend: to an end of generation at the unpipelined run's token eog_at, then (the
    conversation so far and more) to a cancel after cancel_at T lines, then to max_new; each request's lines, the
    counters, and the recurrent state (hybrid) after each."""
    be = _gpu_backend(model, pipeline)
    try:
        s = Session(be, ())
        out = []
        convo = list(prompt)
        for eog, kw, n in (((eog_at,), {}, 24), ((), dict(cancel_after=cancel_at), 24), ((), {}, 12)):
            s.eog_ids = frozenset(eog)
            lines, finish = run(s, convo, n, params, **kw)
            st = be.get_stats()
            snap = be.snapshot_state()
            out.append((lines, finish, st.hits, st.lookups, None if snap.data is None else np.array(snap.data)))
            convo = convo + [int(x.split()[1]) for x in lines] + [int(t) for t in prompt[:3]]
        return out, be.pipeline_counts
    finally:
        be.close()


@pytest.mark.gpu
@pytest.mark.parametrize("params", GPU_PARAMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_pipelined_conversation_equals_unpipelined(family, params, tmp_path, fixtures_dir):
    """Each family's tiny model, greedy and seeded sampled (penalties on): requests that end by an end of generation
    and by a cancel mid-run (a step ran ahead each time) and a next request reusing the prefix pick token for token
    what the unpipelined backend picks; the expert cache's counters and the recurrent state (hybrid) are the same
    after each request."""
    model, prompt = tiny_model(family, tmp_path, fixtures_dir)
    if family not in RUN_AHEAD:
        _assert_not_run_ahead(model)
        return
    probe = _gpu_backend(model, False)
    try:
        toks = [int(x.split()[1]) for x in run(Session(probe, ()), prompt, 24, params)[0]]
    finally:
        probe.close()
    eog_at = toks[next(i for i in range(4, 24) if toks.index(toks[i]) == i)]     # first picked mid-run
    ref, _ = _conversation(model, prompt, False, params, eog_at, 9)
    got, counts = _conversation(model, prompt, True, params, eog_at, 9)
    for i, ((gl, gf, gh, glk, gs), (rl, rf, rh, rlk, rs)) in enumerate(zip(got, ref)):
        assert (gl, gf) == (rl, rf), f"request {i}: pipelined {gl} {gf}, unpipelined {rl} {rf}"
        assert (gh, glk) == (rh, rlk), f"request {i}: hits/lookups {gh}/{glk} pipelined, {rh}/{rlk} unpipelined"
        if rs is not None:
            err = float(np.max(np.abs(gs - rs)) / max(float(np.max(np.abs(rs))), 1e-30))
            assert err < 1e-4, f"request {i}: the recurrent state differs by {err:.2e} of its largest value"
    assert got[0][1] == "stop" and got[1][1] == "cancel" and got[2][1] == "length"
    assert counts.kept > 15 and counts.discarded >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_decode_loop_run_ahead_then_discarded(family, tmp_path, fixtures_dir):
    """The backend alone: a greedy loop whose every call runs the next step ahead, then a truncate / snapshot (which
    discard it): the tokens and the logits of one more step equal the unpipelined backend's."""
    model, prompt = tiny_model(family, tmp_path, fixtures_dir)
    if family not in RUN_AHEAD:
        _assert_not_run_ahead(model)
        return
    res = []
    for pipeline in (True, False):
        be = _gpu_backend(model, pipeline)
        try:
            toks = [be.decode(prompt, PickSpec())[0].id]
            for _ in range(16):
                toks.append(be.decode([toks[-1]], PickSpec())[0].id)
            snap = be.snapshot_state()
            lg = be.forward([toks[-1]])
            res.append((toks, lg, None if snap.data is None else np.array(snap.data), be.pipeline_counts))
        finally:
            be.close()
    (ta, la, sa, ca), (tb, lb, sb, cb) = res
    assert ta == tb
    assert ca.kept == 15 and ca.discarded == 1 and cb.ahead == 0
    err = float(np.max(np.abs(la - lb)) / np.max(np.abs(lb)))
    assert err < 1e-4, f"the next step's logits differ by {err:.2e}"
    if sb is not None:
        assert float(np.max(np.abs(sa - sb)) / max(float(np.max(np.abs(sb))), 1e-30)) < 1e-4


def test_the_adaptive_tier_waits_for_nothing_while_decoding(monkeypatch):
    """Every adapt_every tokens the counts are taken without a wait (adapt_start); the round is made at a later
    token, once their copy has landed (adapt_finish), and the next round starts adapt_every tokens after the last
    started."""
    be = backend(monkeypatch)
    log = []

    class Cache:
        counts_taken = False
        landed = False

        def poll(self, stream):
            pass

        def adapt(self, stream):                    # the prompt pass's round, at its end
            log.append(("adapt", be.n_cached))

        def adapt_start(self, stream):
            log.append(("start", be.n_cached))
            self.counts_taken = True

        def counts_landed(self):
            return self.counts_taken and self.landed

        def adapt_finish(self, stream):
            log.append(("finish", be.n_cached))
            self.counts_taken = False
    be.cache = Cache()
    be.prefill.lent = False
    be._tokens_since_adapt = 0
    be.opts = SimpleNamespace(no_graph=False, adapt_every=4, expert_profile_save=None, expert_profile_save_every=0)
    be.decode([1, 2, 3], PickSpec())
    tok = 1
    for i in range(12):
        be.cache.landed = i not in (4, 5)           # one copy still on its way for two tokens
        tok = be.decode([tok], PickSpec())[0].id
    assert log == [("adapt", 3), ("start", 7), ("finish", 10), ("start", 11), ("finish", 12), ("start", 15)]


def test_decode_trace_host_gaps():
    """bench.decode_trace's host gap: the main stream's idle before each step's embed, the first step's excepted."""
    from bench.decode_trace import host_gaps
    k = lambda name, ts, dur: {"name": name, "ts": ts, "dur": dur}      # noqa: E731
    ms = [k("embed", 0, 5), k("mv", 6, 10), k("argmax", 16, 2), k("embed", 418, 5), k("mv", 423, 10),
          k("_Z5embedv", 434, 1)]
    assert host_gaps(ms) == [400.0, 1.0]


def advance_ref(pos, pick, ring, n_slots, n_vocab):
    """cuda_src/sample.cu step_advance in NumPy: the pick into ring slot pos % n_slots (and `out`, the pick itself),
    and the next step's params (token 0 for a failed pick or an id outside the vocabulary)."""
    ring = ring.copy()
    i, status = int(pick[0]), int(pick[1])
    ring[2 * (pos % n_slots):2 * (pos % n_slots) + 2] = [i, status]
    return ring, np.array([i if status == 0 and 0 <= i < n_vocab else 0, pos + 1], np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("n_slots,n_vocab", [(4, 64), (8, 151936), (1, 1000)])
def test_gpu_step_advance_kernel(n_slots, n_vocab):
    import cupy as cp
    from engine.cuda.kernels import function
    from engine.cuda.launch import I32, MappedInts, ptr
    f = function("sample", "step_advance")
    rng = np.random.default_rng()
    ring, out = MappedInts(2 * n_slots), MappedInts(2)
    try:
        for _ in range(16):
            pos = int(rng.integers(0, 100_000))
            pick = np.array([int(rng.integers(-2, n_vocab + 2)), int(rng.choice([0, 0, 3, -1]))], np.int32)
            state = cp.asarray(np.array([-9, pos, -9, -9, -9, -9, -9, -9], np.int32))
            params = cp.full(2, -7, dtype=cp.int32)                     # poisoned
            ring.view[:] = rng.integers(-100, -50, size=2 * n_slots)    # poisoned
            out.view[:] = -3
            want_ring, want_params = advance_ref(pos, pick, np.array(ring.view), n_slots, n_vocab)
            pick_d = cp.asarray(pick)       # named: a temporary's memory could be reused before the kernel runs
            f((1,), (1,), (ptr(state), ptr(pick_d), ptr(params), ring.dptr, out.dptr, I32(n_slots),
                           I32(n_vocab)))
            cp.cuda.runtime.deviceSynchronize()
            np.testing.assert_array_equal(np.array(ring.view), want_ring)
            np.testing.assert_array_equal(np.array(out.view), pick)
            np.testing.assert_array_equal(params.get(), want_params)
            assert int(state[1]) == pos                                 # the step's state is left as it was
    finally:
        ring.close()
        out.close()


def test_step_advance_reference():
    ring, params = advance_ref(9, np.array([5, 0]), np.full(8, -1, np.int32), 4, 64)
    assert ring.tolist() == [-1, -1, 5, 0, -1, -1, -1, -1] and params.tolist() == [5, 10]
    ring, params = advance_ref(3, np.array([70, 0]), ring, 4, 64)
    assert ring.tolist() == [-1, -1, 5, 0, -1, -1, 70, 0] and params.tolist() == [0, 4]
    assert advance_ref(0, np.array([5, 2]), ring, 4, 64)[1].tolist() == [0, 1]


def test_families_with_host_inputs_run_nothing_ahead():
    """A family whose decode layers compute a step's inputs on the host from its token (set_inputs of their own)
    cannot have a step fed on the GPU; the plain layers (and a subclass that keeps their set_inputs) can."""
    from engine.cuda.backend import _host_inputs
    from engine.cuda.families.moe import MoeDecode

    class Plain(MoeDecode):
        pass

    class HostRows(MoeDecode):
        def set_inputs(self, token, pos):
            pass
    assert not _host_inputs(Plain.__new__(Plain)) and _host_inputs(HostRows.__new__(HostRows))
