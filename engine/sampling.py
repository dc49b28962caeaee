"""Choosing the next token from logits, with llama.cpp's semantics and order.

The chain is llama.cpp's default: penalties, then top_k, top_p, min_p (all on the untempered distribution), then
temperature, then a draw. Temperature 0 is greedy: the argmax of the penalized logits. Each request owns its
Sampler (and its numpy Generator), so a `seed` makes a sampled run reproducible whatever ran before it.

Two per-pick extras the session sets (engine/grammar.py, GEN's grammar= and logprobs=): `mask`, the allowed tokens
as bitmask words, applied to the logits before the chain (a disallowed token is -inf); and `top_logprobs`, which makes
each pick record `picked` = (its log-probability, the top_logprobs most likely (id, log-probability)) of the
masked, untempered, unpenalized distribution. A backend that picks on its own (the CUDA one) honours both the same.
"""
from __future__ import annotations

from collections import Counter, deque

import numpy as np

from engine.protocol import GEN_KEYS


class SamplingError(ValueError):
    """The logits cannot be sampled from (NaN, or every token masked)."""


class Sampler:
    def __init__(self, params: dict | None = None):
        params = dict(params or {})
        unknown = set(params) - set(GEN_KEYS)
        if unknown:
            raise ValueError(f"unknown sampling keys: {', '.join(sorted(unknown))}")
        p = {k: params.get(k, default) for k, (_, default) in GEN_KEYS.items()}
        self.temperature = float(p["temperature"] or 0.0)
        self.top_k = int(p["top_k"] or 0)
        self.top_p = float(p["top_p"] if p["top_p"] is not None else 1.0)
        self.min_p = float(p["min_p"] or 0.0)
        self.seed = p["seed"]
        self.penalty_repeat = float(p["penalty_repeat"] if p["penalty_repeat"] is not None else 1.0)
        self.penalty_freq = float(p["penalty_freq"] or 0.0)
        self.penalty_present = float(p["penalty_present"] or 0.0)
        self.penalty_last_n = int(p["penalty_last_n"] if p["penalty_last_n"] is not None else 64)
        # seed None: fresh OS entropy, so unseeded sampled runs differ, as in llama.cpp's default.
        self.rng = np.random.default_rng(self.seed)
        # -1 means the whole context; a deque with maxlen=None keeps everything.
        maxlen = None if self.penalty_last_n < 0 else self.penalty_last_n
        self.history: deque[int] = deque(maxlen=maxlen)
        self.mask: np.ndarray | None = None            # bitmask words for the next pick (engine/grammar.py)
        self.top_logprobs: int | None = None           # record log-probabilities with each pick
        self.picked: tuple[float, list[tuple[int, float]]] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalties_active(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.penalty_repeat != 1.0 or self.penalty_freq != 0.0 or self.penalty_present != 0.0)

    def accept(self, token: int) -> None:
        """Record a token of the sequence (prompt or generated): the penalties look at these."""
        if self.history.maxlen != 0:
            self.history.append(int(token))

    def accept_many(self, tokens) -> None:
        for t in tokens:
            self.accept(t)

    # --- the chain -------------------------------------------------------------------------------------------
    def apply_penalties(self, logits: np.ndarray) -> np.ndarray:
        if not self.penalties_active or not self.history:
            return logits
        logits = logits.copy()
        counts = Counter(self.history)
        ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        ids_ok = ids[(ids >= 0) & (ids < logits.shape[0])]
        c = np.array([counts[int(i)] for i in ids_ok], dtype=np.float32)
        x = logits[ids_ok]
        # llama.cpp: the repeat penalty shrinks a logit's magnitude toward "less likely" whatever its sign.
        x = np.where(x <= 0, x * self.penalty_repeat, x / self.penalty_repeat)
        x = x - c * self.penalty_freq - self.penalty_present
        logits[ids_ok] = x
        return logits

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, logits) that survive top_k, top_p and min_p on the untempered distribution; at least one.

        Works on the survivors only, never sorting the whole vocabulary unless top_p needs most of it: with 150k
        tokens a full sort per token would cost more than a decode step on the GPU.
        """
        x = logits
        n = x.shape[0]
        ids = None
        vals = x
        if 0 < self.top_k < n:
            # ties at the k-th value: keep exactly k, like llama.cpp's partial sort.
            ids = np.argpartition(-x, self.top_k - 1)[: self.top_k]
            vals = x[ids]
        if self.top_p < 1.0:
            m = float(np.max(vals))
            lse = m + float(np.log(np.sum(np.exp((vals - m).astype(np.float64)))))
            size = min(vals.shape[0], 256)
            while True:
                part = np.argpartition(-vals, size - 1)[:size] if size < vals.shape[0] else np.arange(vals.shape[0])
                order = part[np.argsort(-vals[part], kind="stable")]
                cum = np.cumsum(np.exp(vals[order].astype(np.float64) - lse))
                if cum[-1] >= self.top_p or size >= vals.shape[0]:
                    break
                size = min(size * 8, vals.shape[0])
            # the smallest set whose mass reaches top_p: the token that crosses it stays.
            n_keep = min(int(np.searchsorted(cum, self.top_p, side="left")) + 1, order.shape[0])
            sel = order[:n_keep]
            ids = sel if ids is None else ids[sel]
            vals = vals[sel]
        if self.min_p > 0.0:
            # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p)
            keep = np.nonzero(vals >= np.max(vals) + np.log(self.min_p))[0]
            ids = keep if ids is None else ids[keep]
            vals = vals[keep]
        if ids is None:
            ids = np.arange(n)
        return ids, vals

    def filter(self, logits: np.ndarray) -> np.ndarray:
        """The full-vocabulary view of candidates(): removed tokens become -inf."""
        ids, vals = self.candidates(logits)
        out = np.full_like(logits, -np.inf)
        out[ids] = vals
        return out

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a sampled (temperature > 0) draw uses, after the whole chain."""
        x = self.filter(self.apply_penalties(_checked(logits)))
        return _softmax(x / self.temperature)

    def sample(self, logits: np.ndarray) -> int:
        logits = _checked(logits)
        if self.mask is not None:
            from engine.grammar import apply_mask
            logits = apply_mask(logits, self.mask)
            if not np.isfinite(logits).any():
                raise SamplingError("the grammar allows no token here")
        tok = self._pick(logits)
        if self.top_logprobs is not None:
            self.picked = logprobs_of(logits, tok, self.top_logprobs)
        return tok

    def _pick(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(self.apply_penalties(logits)))
        ids, vals = self.candidates(self.apply_penalties(logits))
        probs = _softmax(vals / self.temperature)
        cum = np.cumsum(probs)
        r = self.rng.random() * cum[-1]
        return int(ids[min(int(np.searchsorted(cum, r, side="right")), len(cum) - 1)])


def logprobs_of(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of token, the k most likely (id, log-probability), most likely first, ties by lower id):
    log-softmax of the logits as given. The NumPy reference of cuda_src/logits_mask.cu's top_logprobs."""
    x = np.asarray(logits, np.float64)
    m = float(np.max(x))
    lse = m + float(np.log(np.sum(np.exp(x - m))))
    top = []
    if k > 0:
        part = np.argpartition(-x, min(k, x.shape[0]) - 1)[:k] if k < x.shape[0] else np.arange(x.shape[0])
        order = part[np.lexsort((part, -x[part]))]
        top = [(int(i), float(x[i] - lse)) for i in order if np.isfinite(x[i])]
    return float(x[token] - lse), top


def _checked(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    if np.isnan(x).any():
        raise SamplingError("the model produced NaN logits")
    if not np.isfinite(x).any():
        raise SamplingError("every logit is -inf: nothing to sample")
    return x


def _softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x)
    e = np.exp((x - m).astype(np.float64))
    return e / e.sum()
