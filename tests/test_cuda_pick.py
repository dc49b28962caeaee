"""The CUDA backend's pick path (CUDABackend.decode, engine/cuda/sampler.py's bookkeeping, logits_mask.masked_copy) on
the CPU: CuPy replaced by NumPy, the decode step and the GPU sampler's device by a NumPy model of what their kernels
do (the chain on the device's own penalty window, the draw uniform(seed, step), the counter and the window advanced
after each pick). Every pick must be what its spec alone says, so a device state kept out of step with the specs (a
reload missed, a counter not followed) changes the picks; the session's lines over it equal those over the reference
backend for greedy requests (sampled ones differ by design: the GPU has its own random source).
"""
from types import SimpleNamespace

import numpy as np
import pytest

from engine import protocol
from engine.backend import Backend
from engine.grammar import apply_mask, mask_words
from engine.sampling import PickSpec, Sampler, SamplingError, logprobs_of
from engine.session import Session

cuda_backend = pytest.importorskip("engine.cuda.backend")
from engine.cuda import logits_mask as lm  # noqa: E402
from engine.cuda.sampler import GpuSampler, uniform, window_ids, window_length  # noqa: E402
from engine.cuda.trace import Tracer  # noqa: E402

V = 64


def logits_of(seq) -> np.ndarray:
    """The fake model: logits that depend on every token held, spread enough that draws and penalties matter."""
    h = 0
    for t in seq:
        h = (h * 1_000_003 + int(t) + 7) % (1 << 61)
    return (np.random.default_rng(h).standard_normal(V) * 2).astype(np.float32)


class _Arr(np.ndarray):
    def get(self, stream=None):
        return np.asarray(self)


class _Stream:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def synchronize(self):
        pass


class _Shim:
    """The few CuPy names the pick path uses, over NumPy."""
    float32, int32 = np.float32, np.int32

    @staticmethod
    def array(x, dtype=None, copy=True):
        return np.array(x, dtype=dtype, copy=copy).view(_Arr)

    @staticmethod
    def asarray(x, dtype=None):
        return np.asarray(x, dtype=dtype).view(_Arr)

    @staticmethod
    def full(n, v, dtype):
        return np.full(n, v, dtype).view(_Arr)

    isnan, isfinite, argmax = staticmethod(np.isnan), staticmethod(np.isfinite), staticmethod(np.argmax)

    class cuda:
        @staticmethod
        def get_current_stream():
            return _Stream()


def _fake_kernel(name):
    def apply_token_mask(grid, block, args):
        logits, words, n, _ = args
        logits[:] = apply_mask(np.asarray(logits), np.asarray(words).view(np.int32))

    def top_logprobs(grid, block, args):
        logits, n, token, k, ids, lps, tok = args
        lp, top = logprobs_of(np.asarray(logits), int(token), int(k))
        tok[0] = lp
        for j, (i, v) in enumerate(top):
            ids[j], lps[j] = i, v
    return {"apply_token_mask": apply_token_mask, "top_logprobs": top_logprobs}[name]


def gpu_pick(x, params, history, u) -> int:
    """What the sampled kernels pick: the penalized argmax when greedy, else the inverse CDF over the kept ids in id
    order at u (tests/test_cuda_sampler.py holds the kernels to this)."""
    if params.greedy:
        return int(np.argmax(params.apply_penalties(x, history)))
    probs = params.probabilities(x, history)
    ids = np.nonzero(probs > 0)[0]
    cum = np.cumsum(probs[ids])
    return int(ids[min(int(np.searchsorted(cum, u * cum[-1], side="right")), len(ids) - 1)])


class _SimSampler(GpuSampler):
    """GpuSampler over a NumPy device: load() writes `dev`, enqueue() does what cuda_src/sample.cu does with it."""

    def __init__(self, n, ring_cap, out):
        self.n, self.ring_cap, self.held, self.out = n, ring_cap, None, out
        self.dev = None
        self.loads = 0

    def load(self, held):
        self.dev = dict(params=held.params, seed=held.seed, step=held.draws,
                        window=window_ids(held.window, self.n).tolist())
        self.held = held
        self.loads += 1

    def enqueue(self, kernels, logits, out_dptr):
        x = np.asarray(logits, np.float32)
        d = self.dev
        if np.isnan(x).any() or np.isneginf(x).all():       # nothing advances
            self.out[:] = [-1, int(np.isnan(x).sum()) or -1]
            return
        p = d["params"]
        tok = gpu_pick(x, p, [t for t in d["window"] if t >= 0], uniform(d["seed"], d["step"]))
        self.out[:] = [tok, 0]
        if np.float32(p.temperature) > 0:
            d["step"] += 1
        w = window_length(p, self.ring_cap)
        if w:
            d["window"] = (d["window"] + [tok])[-w:]


class _FakeStep:
    """DecodeStep's surface: launch() runs the fake model on the held tokens (the device's K/V: a step at pos drops
    what lies past it), then the graph's pick and step_advance: the pick by position, and the next step's input
    (launch_next reads it, as the embed kernel reads params)."""

    def __init__(self, be):
        self.be = be
        self.logits = None
        self.out = SimpleNamespace(dptr=0)
        self.words = [0, 0]
        self.launches = []
        self.prefetch = None
        self.ring = {}                  # position -> (id, status): the mapped pick ring
        self.inp = [0, 0]               # params: the next step's token and position
        self.last_pos = -1

    def launch(self, token, pos, pick, use_graph=True):
        self.inp = [token, pos]
        self._run(pick)

    def launch_next(self, pos, pick, use_graph=True):
        assert pos == self.inp[1] == self.last_pos + 1
        self.launches.append("next")
        self._run(pick)

    def _run(self, pick):
        token, pos = self.inp
        held = self.be.held
        del held[pos:]
        held.append(token)
        self.logits = self.be.model_logits(held).view(_Arr)
        self.launches.append(pick)
        if pick == "greedy":                                  # argmax_word / argmax_finish: NaNs skipped, counted
            x = np.where(np.isnan(self.logits), -np.inf, self.logits)
            self.words[:] = [int(np.argmax(x)), int(np.isnan(self.logits).sum())]
        else:
            self.be.gpu_sampler.enqueue(None, self.logits, self.out.dptr)
        tok, status = self.words
        self.ring[pos] = (tok, status)                          # step_advance
        self.inp = [tok if status == 0 and 0 <= tok < V else 0, pos + 1]
        self.last_pos = pos
        self.be.on_step(pos)

    def pick_at(self, pos):
        return self.ring[pos]

    def result(self):                   # `out`: the last pick made, the step's or a sampler chain's after it
        return tuple(self.words)


class _FakePrefill:
    chunk = 16

    def __init__(self, be):
        self.be = be

    def forward(self, part, pos, all_logits, ahead=None):
        held = self.be.held
        del held[pos:]
        rows = []
        for t in part:
            held.append(int(t))
            rows.append(self.be.model_logits(held))
        return np.stack(rows if all_logits else rows[-1:]).view(_Arr)


def fake_cuda(monkeypatch, ring_cap=200, pipelined=True):
    """A CUDABackend whose step, prompt pass and sampler device are the fakes above (cp: NumPy); pipelined: decode
    steps run ahead (engine/cuda/pipeline.py), as they do by default."""
    monkeypatch.setattr(lm, "cp", _Shim)
    monkeypatch.setattr(lm, "_kernel", _fake_kernel)
    monkeypatch.setattr(cuda_backend, "cp", _Shim)
    be = cuda_backend.CUDABackend.__new__(cuda_backend.CUDABackend)
    Backend.__init__(be, SimpleNamespace(config=SimpleNamespace(n_vocab=V, n_ctx_train=512)), 400)
    be.opts = SimpleNamespace(no_graph=False)
    be.pipelined = pipelined
    be._ahead = None
    be._restorable = []
    be.pipeline_counts = cuda_backend.PipelineCounts()
    be.on_step = lambda pos: None       # the fake device ran the step at pos
    be.cache = None
    be.mem = None
    be.recurrent_state = None
    # the family's own counters and facts (families/moe.py: none)
    be.family = SimpleNamespace(reset_stats=lambda: None, request_info=lambda: {}, info=lambda: {},
                                close=lambda: None)
    be.kv = SimpleNamespace()
    be._kv_high = 0
    be.tracer = Tracer()
    be.stream = _Stream()
    be.kernels = None
    be.held = []
    be.nan_at = None                    # a position whose logits come out NaN
    be.model_logits = lambda seq: np.full(V, np.nan, np.float32) if len(seq) == be.nan_at else logits_of(seq)
    be.step = be.decoder = _FakeStep(be)
    be.window = False                   # no window step (decode_window.py): a window is one fake step a token
    be.prefill = _FakePrefill(be)
    be.gpu_sampler = _SimSampler(V, ring_cap, be.step.words)
    return be


def want(seq_before, fed, spec):
    """The pick a spec alone says: after fed on top of seq_before, masked, the GPU's draw at spec.draws."""
    x = logits_of(list(seq_before) + list(fed))
    if spec.mask is not None:
        x = apply_mask(x, spec.mask)
    tok = gpu_pick(x, spec.params, spec.counted(fed), uniform(spec.seed, spec.draws))
    if spec.logprobs is None:
        return (tok,)
    lp, top = logprobs_of(x, tok, spec.logprobs)
    f32 = lambda v: float(np.float32(v))     # the kernel's outputs are float32
    return tok, f32(lp), [(i, f32(v)) for i, v in top]


def got(p):
    return (p.id,) if p.logprob is None else (p.id, p.logprob, list(p.top))


def random_mask(rng, frac):
    allowed = rng.random(V) < frac
    allowed[rng.integers(V)] = True
    words = np.packbits(np.concatenate([allowed, np.zeros(mask_words(V) * 32 - V, bool)]),
                        bitorder="little").view(np.int32)
    return allowed, words


PARAMS = [{}, {"penalty_repeat": 1.8, "penalty_last_n": 4},
          {"temperature": 1.3, "top_k": 20, "seed": 5},
          {"temperature": 0.9, "top_p": 0.9, "seed": 8, "penalty_present": 1.0, "penalty_freq": 0.3,
           "penalty_last_n": 6},
          {"temperature": 1.0, "seed": 2, "penalty_repeat": 1.5, "penalty_last_n": -1}]


@pytest.mark.parametrize("params", PARAMS)
def test_the_sessions_loop_picks_what_each_spec_says_with_one_load(monkeypatch, params):
    be = fake_cuda(monkeypatch)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    runs = []
    for _ in range(2):                          # the same request twice from a cold cache: it reproduces
        be.truncate(0)
        s = Sampler(params)
        seq, picks = [], []
        fed = prompt
        for _ in range(20):
            spec = s.spec(seq)
            p = be.decode(fed, spec)[0]
            assert got(p) == want(seq, fed, spec)
            s.advance()
            seq += fed
            picks.append(p.id)
            fed = [p.id]
        runs.append(picks)
    assert runs[0] == runs[1]
    assert be.gpu_sampler.loads == (0 if not params else 2)     # one load a request, at its prompt; none greedy
    if params.get("temperature"):
        assert len(set(runs[0])) > 3


@pytest.mark.parametrize("params", PARAMS)
def test_masks_logprobs_rewinds_and_windows_pick_what_each_spec_says(monkeypatch, params):
    be = fake_cuda(monkeypatch)
    rng = np.random.default_rng(len(str(params)))
    s = Sampler(params)
    seq, fed = [], [7, 7, 2, 8]
    for step in range(40):
        kind = step % 5
        mask = random_mask(rng, 0.3)[1] if kind in (1, 3) else None
        logprobs = int(rng.integers(0, 6)) if kind in (2, 3) else None
        spec = s.spec(seq, mask=mask, logprobs=logprobs)
        if kind == 4:                           # a window of picks, one after each token
            window = fed + rng.integers(0, V, size=3).tolist()
            ps = be.decode(window, spec, all_positions=True)
            assert [got(p) for p in ps] == [want(seq + window[:i], window[i:i + 1], spec.after(window[:i]))
                                            for i in range(len(window))]
            s.advance(len(window))
            keep = int(rng.integers(1, len(window) + 1))      # accept a prefix, rewind the rest
            be.truncate(len(seq) + keep)
            seq += window[:keep]
            fed = [ps[keep - 1].id]
            continue
        p = be.decode(fed, spec)[0]
        assert got(p) == want(seq, fed, spec), step
        if mask is not None:
            allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:V].astype(bool)
            assert allowed[p.id]
        s.advance()
        seq += fed
        fed = [p.id]
        if step % 7 == 6:                       # a rewind: the next call reads the last two tokens again
            be.truncate(len(seq) - 2)
            fed = seq[-2:] + fed
            del seq[-2:]


def test_the_nan_rule_and_an_all_masked_pick(monkeypatch):
    for params in ({}, {"temperature": 1.0, "seed": 1}):
        be = fake_cuda(monkeypatch)
        s = Sampler(params)
        be.nan_at = 4
        with pytest.raises(SamplingError, match="^the model produced NaN logits$"):
            be.decode([1, 2, 3, 4], s.spec())                                # the prompt's pick
        be.truncate(3)
        with pytest.raises(SamplingError, match="^the model produced NaN logits$"):
            be.decode([4], s.spec([1, 2, 3]))                                # in the step's graph
        be.truncate(3)
        with pytest.raises(SamplingError, match="^the model produced NaN logits$"):
            be.decode([4], s.spec([1, 2, 3], logprobs=2))                    # logprobs: still in the graph
        be.truncate(3)
        with pytest.raises(SamplingError, match="^the model produced NaN logits$"):
            be.decode([4], s.spec([1, 2, 3], mask=random_mask(np.random.default_rng(0), 0.5)[1]))
        be.nan_at = None
        be.truncate(3)
        nothing = np.zeros(mask_words(V), np.int32)
        with pytest.raises(SamplingError, match="^the grammar allows no token here$"):
            be.decode([4], s.spec([1, 2, 3], mask=nothing))
        be.truncate(0)
        with pytest.raises(SamplingError, match="^the grammar allows no token here$"):
            be.decode([1, 2, 3, 4], s.spec(mask=nothing))
        be.truncate(0)
        p = be.decode([1, 2, 3, 4], s.spec())[0]                             # and it picks again afterwards
        assert got(p) == want([], [1, 2, 3, 4], s.spec())


def test_a_mask_limits_one_pick(monkeypatch):
    be = fake_cuda(monkeypatch)
    mask = random_mask(np.random.default_rng(1), 0.5)[1]
    with pytest.raises(ValueError, match="a grammar mask limits one pick"):
        be.decode([1, 2, 3], PickSpec(mask=mask), all_positions=True)
    assert be.n_cached == 0
    assert len(be.decode([1, 2, 3], PickSpec(mask=mask))) == 1              # one pick after a chunk: fine
    with pytest.raises(ValueError, match="at least one token"):
        be.decode([], PickSpec())


def test_plain_picks_stay_in_the_steps_graphs(monkeypatch):
    """Plain greedy uses the greedy graph, everything else without a mask the sampled graph (logprobs included);
    a mask goes off the graphs (the greedy step's logits, masked on a copy). (Unpipelined: a step run ahead would
    show among the launches; tests/test_cuda_pipeline.py has those.)"""
    be = fake_cuda(monkeypatch, pipelined=False)
    be.decode([1, 2], PickSpec())
    be.decode([3], PickSpec())
    be.decode([4], PickSpec(logprobs=3))
    be.decode([5], Sampler({"temperature": 1.0, "seed": 1}).spec(logprobs=1))
    be.decode([6], Sampler({"penalty_repeat": 1.2}).spec([1, 2, 3, 4, 5]))
    be.decode([7], Sampler({"temperature": 1.0, "seed": 1}).spec(mask=random_mask(np.random.default_rng(2), 0.5)[1]))
    assert be.step.launches == ["greedy", "greedy", "sampled", "sampled", "greedy"]


class _Reference(Backend):
    """The reference backend over the same fake model: forward() only; engine/backend.py's decode picks."""

    def __init__(self):
        super().__init__(SimpleNamespace(config=SimpleNamespace(n_vocab=V, n_ctx_train=512)), 400)
        self.held = []

    def truncate(self, n):
        super().truncate(n)
        del self.held[n:]

    def forward(self, tokens, all_logits=False):
        rows = []
        for t in tokens:
            self.held.append(int(t))
            rows.append(logits_of(self.held))
        self.n_cached += len(tokens)
        return np.stack(rows) if all_logits else rows[-1]


def test_the_sessions_lines_over_the_cuda_pick_equal_the_reference_backends_when_greedy(monkeypatch):
    reqs = [protocol.GenRequest(12, [5, 6, 7, 8, 9], {}),
            protocol.GenRequest(12, [5, 6, 7, 8, 9, 10], {"penalty_repeat": 1.7, "penalty_last_n": 5}, logprobs=3),
            protocol.GenRequest(12, [5, 6, 7], {"penalty_freq": 0.5, "penalty_last_n": -1}, logprobs=0),
            protocol.GenRequest(12, [5, 6, 7], {"temperature": 0.0, "penalty_present": 2.0})]
    out = []
    for backend in (fake_cuda(monkeypatch), _Reference()):
        session = Session(backend, eog_ids=[V - 1], prompt_chunk=2)
        lines = []
        for r in reqs:
            session.run(r, lines.append)
        out.append([ln for ln in lines if protocol.kind(ln) in ("T", "RESUME", "REUSED", "ERR")])
    assert out[0] == out[1]
    assert sum(ln.startswith("T ") for ln in out[0]) > 30
