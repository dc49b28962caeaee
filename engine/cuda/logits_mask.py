"""The grammar mask and log-probabilities on the GPU (cuda_src/logits_mask.cu), for the CUDA backend's picks off the
decode graphs (engine/cuda/backend.py decode).

References: engine/grammar.py apply_mask (the mask) and engine/sampling.py logprobs_of (the log-probabilities).
A pick with a mask, or the one after a prompt chunk, reads the logits the prompt pass or the step left in VRAM and
masks them on a copy (`masked_copy`, which also counts what the NaN rule needs); the GPU picks from that copy, and
`top_logprobs` gives the log-probabilities of what was picked: only the id and k + 1 numbers come back.
"""
from __future__ import annotations

import cupy as cp
import numpy as np

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


def masked_copy(logits: cp.ndarray, words) -> tuple[cp.ndarray, int]:
    """A float32 copy of logits (in VRAM) with the mask applied when there is one (words: bitmask words, or None),
    and its status for the NaN rule (engine/sampling.py refuse): the NaN count of the logits as they came, else -1
    when no finite logit is left, else 0. Waits for the current stream (for the two counts)."""
    lg = cp.array(logits, dtype=cp.float32, copy=True).reshape(-1)
    nan = int(cp.isnan(lg).sum())
    if nan:
        return lg, nan
    if words is not None:
        apply_mask(lg, words)
    return lg, 0 if bool(cp.isfinite(lg).any()) else -1
