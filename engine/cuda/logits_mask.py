"""The grammar mask and log-probabilities on the GPU (cuda_src/logits_mask.cu), and the CUDA backend's pick for a
request that needs either.

References: engine/grammar.py apply_mask (the mask) and engine/sampling.py logprobs_of (the log-probabilities).
A pick with a mask or logprobs (`masked_next`) reads the logits the step (or the prompt pass) left in VRAM, masks
them in place on a copy, picks on the GPU (the step's argmax rule for plain greedy, else engine/cuda/sampler.py on
the masked logits), then asks for the log-probabilities of what was picked: only the id and k + 1 numbers come back.
Plain requests never come here: the decode graphs stay as they are.
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from engine.sampling import SamplingError

LP_THREADS = 1024      # top_logprobs' one block (cuda_src/logits_mask.cu LP_THREADS)
LP_MAX_K = 20          # the most alternatives it returns (LP_MAX_K; the protocol's MAX_TOP_LOGPROBS)
MASK_THREADS = 256


def _kernel(name: str):
    from engine.cuda import kernels
    return kernels.function("logits_mask", name)


def apply_mask(logits: cp.ndarray, words: np.ndarray) -> None:
    """Set every token of logits (float32, in VRAM) whose bit in words is 0 to -inf, in place (current stream)."""
    n = int(logits.shape[0])
    w = cp.asarray(np.ascontiguousarray(words, dtype=np.int32).view(np.uint32))
    grid = min(1024, (n + MASK_THREADS - 1) // MASK_THREADS)
    _kernel("apply_token_mask")((grid,), (MASK_THREADS,), (logits, w, np.int32(n), np.int32(w.shape[0])))


def top_logprobs(logits: cp.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of token, the k most likely (id, log-probability)) of log-softmax(logits); waits for the
    current stream."""
    if not 0 <= k <= LP_MAX_K:
        raise ValueError(f"k must be in 0..{LP_MAX_K}")
    ids = cp.full(max(k, 1), -1, cp.int32)
    lps = cp.full(max(k, 1), np.nan, cp.float32)
    tok = cp.full(2, np.nan, cp.float32)
    _kernel("top_logprobs")((1,), (LP_THREADS,), (logits, np.int32(logits.shape[0]), np.int32(token), np.int32(k),
                                                  ids, lps, tok))
    stream = cp.cuda.get_current_stream()
    ids_h, lps_h, tok_h = ids.get(stream=stream), lps.get(stream=stream), tok.get(stream=stream)
    stream.synchronize()
    top = [(int(i), float(v)) for i, v in zip(ids_h[:k], lps_h[:k]) if i >= 0]
    return float(tok_h[0]), top


def masked_next(backend, tokens, sampler) -> int:
    """CUDABackend.next_token for a sampler with a mask or top_logprobs: feed tokens, pick, record sampler.picked."""
    tokens = [int(t) for t in tokens]
    if len(tokens) > 1:
        lg = backend._prefill(tokens, False)[-1]
    else:
        backend.decode(tokens[0])         # the plain step; its own argmax is ignored
        lg = backend.step.logits
    with backend.stream:
        lg = cp.array(lg, dtype=cp.float32, copy=True).reshape(-1)
        if bool(cp.isnan(lg).any()):
            raise SamplingError("the model produced NaN logits")
        if sampler.mask is not None:
            apply_mask(lg, sampler.mask)
            if not bool(cp.isfinite(lg).any()):
                raise SamplingError("the grammar allows no token here")
        gs = backend.gpu_sampler
        plain = sampler.greedy and not sampler.penalties_active
        if plain:
            tok = int(cp.argmax(lg))       # the lowest id among equal maxima, as the step's argmax
        elif gs is not None:
            gs.load(sampler)
            gs.enqueue(backend.kernels, lg, backend.step.out.dptr)
        else:                              # no GPU sampler built: the host chain on the masked logits
            tok = sampler._pick(lg.get(stream=backend.stream))
    if not plain and gs is not None:
        tok = gs.picked(sampler, *backend.step.result())
    if sampler.top_logprobs is not None:
        with backend.stream:
            sampler.picked = top_logprobs(lg, tok, sampler.top_logprobs)
    return tok
