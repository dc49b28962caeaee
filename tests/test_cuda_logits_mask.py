"""The grammar mask and log-probabilities on the GPU (cuda_src/logits_mask.cu, engine/cuda/logits_mask.py) against
their NumPy references (engine/grammar.py apply_mask, engine/sampling.py logprobs_of): fresh random data at several
vocabulary sizes, outputs poisoned first; end to end, a masked pick on a real backend stays inside the mask and its
logprobs match the host's on the same step's logits. The launch constants are checked on the CPU; the CUDA backend's
pick path around these kernels runs on the CPU in tests/test_cuda_pick.py."""
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
    """Masked picks (off the graphs) and, every third step, an unmasked one with logprobs (in the step's graph):
    the pick is allowed, and its logprobs are the host's of the same step's logits, masked when there was a mask."""
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
        seq, tok = [], None
        for step in range(12):
            allowed, words = random_words(rng, n, 0.02)
            if step % 3 == 2:
                allowed, words = np.ones(n, bool), None
            feed = prompt if tok is None else [tok]
            if tok is not None:
                host = be.forward([tok])                    # the step's logits on the host ...
                be.truncate(be.n_cached - 1)
            picked = be.decode(feed, s.spec(seq, mask=words, logprobs=5))[0]   # ... and the same step's pick
            s.advance()
            tok = picked.id
            assert allowed[tok], f"step {step}: token {tok} is outside the mask"
            if step and temperature == 0:
                masked = host if words is None else mask_ref(host, words)
                want_lp, want_top = logprobs_of(masked, tok, 5)
                gaps = -np.diff(np.sort(masked[np.isfinite(masked)])[::-1][:6])
                if (gaps > 1e-3).all():      # a near-tie may part on a last-bit difference of the logits
                    assert tok == want_top[0][0] and [i for i, _ in picked.top] == [i for i, _ in want_top]
                assert picked.logprob == pytest.approx(logprobs_of(masked, tok, 0)[0], abs=1e-3)
            seq += feed
    finally:
        be.close()
