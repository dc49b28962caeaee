"""The grammar mask and log-probabilities on the GPU (cuda_src/logits_mask.cu, engine/cuda/logits_mask.py) against
their NumPy references (engine/grammar.py apply_mask, engine/sampling.py logprobs_of): fresh random data at several
vocabulary sizes, outputs poisoned first; end to end, a masked pick on a real backend stays inside the mask and its
logprobs match the host's on the same step's logits. The launch constants are checked on the CPU."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from engine.grammar import apply_mask as mask_ref, mask_words
from engine.sampling import Sampler, logprobs_of

gpu = pytest.mark.gpu
SIZES = (1, 33, 1000, 49152, 151936)


def random_words(rng, n, p):
    allowed = rng.random(n) < p
    allowed[rng.integers(n)] = p > 0 or allowed.any()     # at least one token allowed unless p is 0
    pad = np.zeros(mask_words(n) * 32 - n, bool)
    return allowed, np.packbits(np.concatenate([allowed, pad]), bitorder="little").view(np.int32)


def test_launch_constants_match_the_kernel_defines():
    from engine.cuda import logits_mask as lm
    from engine.protocol import MAX_TOP_LOGPROBS
    src = (Path(__file__).resolve().parent.parent / "cuda_src" / "logits_mask.cu").read_text()
    defines = {m[1]: int(m[2]) for m in re.finditer(r"^#define (\w+) (\d+)\b", src, re.M)}
    assert (lm.LP_THREADS, lm.LP_MAX_K) == (defines["LP_THREADS"], defines["LP_MAX_K"]) == (1024, MAX_TOP_LOGPROBS)


@gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("p", [0.0005, 0.3, 1.0])
def test_apply_token_mask_equals_the_reference(n, p):
    import cupy as cp
    from engine.cuda.logits_mask import apply_mask
    rng = np.random.default_rng(n * 7 + int(p * 1000))
    logits = (rng.standard_normal(n) * 4).astype(np.float32)
    allowed, words = random_words(rng, n, p)
    d = cp.asarray(logits)
    apply_mask(d, words)
    got = d.get()
    want = mask_ref(logits, words)
    assert np.array_equal(np.isneginf(got), ~allowed)
    assert np.array_equal(got[allowed], want[allowed])           # bit for bit where allowed
    # a mask shorter than the vocabulary: the ids past it are masked too
    short = words[: max(1, len(words) // 2)]
    d = cp.asarray(logits)
    apply_mask(d, short)
    assert np.array_equal(d.get(), mask_ref(logits, short))


@gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_top_logprobs_equals_the_reference(n, k):
    import cupy as cp
    from engine.cuda.logits_mask import top_logprobs
    rng = np.random.default_rng(1000 + n + k)
    for masked in (False, True):
        logits = (rng.standard_normal(n) * 5).astype(np.float32)
        if masked:
            allowed, words = random_words(rng, n, 0.01)
            allowed[rng.integers(n)] = True
            logits = mask_ref(logits, np.packbits(np.concatenate([allowed, np.zeros(mask_words(n) * 32 - n, bool)]),
                                                  bitorder="little").view(np.int32))
        token = int(rng.choice(np.nonzero(np.isfinite(logits))[0]))
        lp, top = top_logprobs(cp.asarray(logits), token, k)     # the kernel's outputs start as NaN / -1
        want_lp, want_top = logprobs_of(logits, token, k)
        assert lp == pytest.approx(want_lp, abs=2e-5)
        assert [i for i, _ in top] == [i for i, _ in want_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=2e-5)
        assert len(top) == min(k, int(np.isfinite(logits).sum()))


@gpu
def test_top_logprobs_ties_take_the_lower_id():
    import cupy as cp
    from engine.cuda.logits_mask import top_logprobs
    logits = np.zeros(5000, np.float32)
    logits[[4000, 17, 2500]] = 3.0
    _, top = top_logprobs(cp.asarray(logits), 0, 4)
    assert [i for i, _ in top] == [17, 2500, 4000, 0]


@gpu
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_masked_pick_on_the_backend_stays_in_the_mask(fixtures_dir, temperature):
    from engine.cuda.backend import CUDABackend, CudaOptions
    from engine.gguf_model import open_model
    name = "tiny-qwen3moe-q4k"
    model = open_model(fixtures_dir / "reference" / f"{name}.gguf")
    prompt = list(json.loads((fixtures_dir / "reference" / f"{name}.json").read_text())["cases"][0]["prompt_ids"])
    n = model.config.n_vocab
    rng = np.random.default_rng(7)
    be = CUDABackend(model, 256, CudaOptions())
    try:
        s = Sampler({"temperature": temperature, "seed": 3})
        s.accept_many(prompt)
        s.top_logprobs = 5
        tok = None
        for step in range(12):
            allowed, words = random_words(rng, n, 0.02)
            s.mask = words
            feed = prompt if tok is None else [tok]
            if tok is not None:
                host = be.forward([tok])                    # the step's logits on the host ...
                be.truncate(be.n_cached - 1)
            tok = be.next_token(feed, s)                    # ... and the same step through the masked pick
            assert allowed[tok], f"step {step}: token {tok} is outside the mask"
            if step and temperature == 0:
                masked = mask_ref(host, words)
                want_lp, want_top = logprobs_of(masked, tok, 5)
                gaps = -np.diff(np.sort(masked[np.isfinite(masked)])[::-1][:6])
                if (gaps > 1e-3).all():      # a near-tie may part on a last-bit difference of the logits
                    assert tok == want_top[0][0] and [i for i, _ in s.picked[1]] == [i for i, _ in want_top]
                assert s.picked[0] == pytest.approx(logprobs_of(masked, tok, 0)[0], abs=1e-3)
            s.accept(tok)
    finally:
        be.close()


# --- masked_next's control flow on the CPU: CuPy and the kernels replaced by NumPy and their references ---------------
class _Arr(np.ndarray):
    def get(self, stream=None):
        return np.asarray(self)


class _Shim:
    """The few CuPy names masked_next and the launch helpers use, over NumPy."""
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


class _Stream:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def synchronize(self):
        pass


def _fake_kernel(name):
    def apply_token_mask(grid, block, args):
        logits, words, n, _ = args
        logits[:] = mask_ref(np.asarray(logits), np.asarray(words).view(np.int32))

    def top_logprobs(grid, block, args):
        logits, n, token, k, ids, lps, tok = args
        lp, top = logprobs_of(np.asarray(logits), int(token), int(k))
        tok[0] = lp
        for j, (i, v) in enumerate(top):
            ids[j], lps[j] = i, v
    return {"apply_token_mask": apply_token_mask, "top_logprobs": top_logprobs}[name]


class _FakeGs:
    """Stands in for GpuSampler: picks with the host chain from the logits it was given."""

    def __init__(self, out):
        self.out = out

    def load(self, sampler):
        self.sampler = sampler

    def enqueue(self, kernels, logits, dptr):
        self.out[:] = [self.sampler._pick(np.asarray(logits)), 0]

    def picked(self, sampler, tok, nan):
        return int(tok)


class _FakeBackend:
    def __init__(self, n, seed, with_gs):
        from types import SimpleNamespace
        self.rng = np.random.default_rng(seed)
        self.n = n
        self.stream = _Stream()
        self.kernels = None
        out = [0, 0]
        self.step = SimpleNamespace(logits=None, out=SimpleNamespace(dptr=0), result=lambda: tuple(out))
        self.gpu_sampler = _FakeGs(out) if with_gs else None
        self.fed = []

    def _logits(self):
        return (self.rng.standard_normal(self.n) * 3).astype(np.float32).view(_Arr)

    def _prefill(self, tokens, all_logits):
        self.fed.append(list(tokens))
        return [self._logits()]

    def decode(self, token):
        self.fed.append([token])
        self.step.logits = self._logits()


@pytest.mark.parametrize("params,with_gs", [({}, True), ({"temperature": 0.8, "seed": 1}, True),
                                            ({"temperature": 0.8, "seed": 1}, False),
                                            ({"penalty_repeat": 1.3}, True)])
def test_masked_next_control_flow(monkeypatch, params, with_gs):
    from engine.cuda import logits_mask as lm
    monkeypatch.setattr(lm, "cp", _Shim)
    monkeypatch.setattr(lm, "_kernel", _fake_kernel)
    be = _FakeBackend(3000, 5, with_gs)
    rng = np.random.default_rng(9)
    s = Sampler(params)
    s.top_logprobs = 3
    tok = None
    for step in range(6):
        allowed, words = random_words(rng, be.n, 0.01)
        s.mask = words
        tok = lm.masked_next(be, [1, 2, 3] if tok is None else [tok], s)
        assert allowed[tok]
        lp, top = s.picked
        assert lp <= 0 and len(top) == min(3, int(allowed.sum())) and all(allowed[i] for i, _ in top)
        if not params:
            assert top[0][0] == tok and top[0][1] == pytest.approx(lp)     # greedy: the top entry is the pick
        s.accept(tok)
    assert be.fed[0] == [1, 2, 3] and len(be.fed) == 6
    s.mask = np.zeros(mask_words(be.n), np.int32)                           # nothing allowed: a clear error
    from engine.sampling import SamplingError
    with pytest.raises(SamplingError, match="allows no token"):
        lm.masked_next(be, [tok], s)
