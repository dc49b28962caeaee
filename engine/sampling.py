"""Choosing the next token from logits, with llama.cpp's semantics and order: the reference every backend's pick keeps.

The chain is llama.cpp's default: penalties, then top_k, top_p, min_p (all on the untempered distribution), then
temperature, then a draw. Temperature 0 is greedy: the argmax of the penalized logits.

A backend picks with a PickSpec (engine/backend.py's `decode`): the request's SamplingParams, its seed and the draws
it has made so far (its random source), the penalty history the pick sees, the grammar mask for the next pick
(engine/grammar.py) and logprobs=K. It returns a Pick: the id, and with logprobs the id's log-probability and the K
most likely (id, log-probability) of the masked, untempered, unpenalized distribution. The spec is a value: nothing
the backend does writes into it or into the request's Sampler, which the session owns (the params, the seed, the
count of draws) and from which it builds one spec per pick.

The random source: draw number i of a request is `draw(seed, i)`, the i-th number of numpy's default_rng(seed), so a
seeded request is reproducible whatever ran before it, and the pick after position i of a verify window uses draw
spec.draws + i. The GPU sampler has its own counter-based source over the same (seed, draws) (engine/cuda/sampler.py).
A request without a seed gets 64 bits of OS entropy, as llama.cpp's default does.

Verify windows (engine/speculate.py): the pick after window position i is the target's token there, and the session
accepts draft tokens[i+1] when the two agree. For a drafter that proposes one token for sure (n-gram, greedy MTP) that
is already the standard speculative rule: a sampled pick equals the draft with probability p(d), and otherwise is p's
draw conditioned on not being d, which is what "accept with p(d)/q(d), else draw from max(0, p - q)" gives for a
one-hot q, and it is the same token plain sampling draws with that seed. A drafter that samples its drafts from a
distribution q passes it in spec.drafts; the pick then follows that rule with its own draw u: accept d when
u < p(d)/q(d), else the residual max(0, p - q), normalized, at (u - p(d)/q(d)) / (1 - p(d)/q(d)), a uniform again
given the rejection (so a pick still uses one draw). The emitted token is then p-distributed whatever q is.

The NaN rule, the same on every backend (`refuse`): NaN logits are the model's failure; no finite logit left after
the grammar mask means the grammar allows nothing; no finite logit without a mask, nothing to sample.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from engine.grammar import apply_mask
from engine.protocol import GEN_KEYS

NAN_LOGITS = "the model produced NaN logits"
NO_TOKEN = "the grammar allows no token here"
ALL_NEG_INF = "every logit is -inf: nothing to sample"


class SamplingError(ValueError):
    """The logits cannot be sampled from (NaN, or every token masked)."""


def refuse(status: int, masked: bool) -> None:
    """The NaN rule, from a pick's status: > 0 NaN logits were seen (before any mask), < 0 no finite logit was left
    (after the mask when `masked`), 0 the pick stands."""
    if status > 0:
        raise SamplingError(NAN_LOGITS)
    if status < 0:
        raise SamplingError(NO_TOKEN if masked else ALL_NEG_INF)


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling keys (engine/protocol.py GEN_KEYS), and the chain as pure functions of them."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    penalty_repeat: float = 1.0
    penalty_freq: float = 0.0
    penalty_present: float = 0.0
    penalty_last_n: int = 64        # -1: the whole context

    @classmethod
    def of(cls, params: dict | None = None) -> SamplingParams:
        """From GEN's keys (None values take the defaults); an unknown key is a ValueError that names it."""
        params = dict(params or {})
        unknown = set(params) - set(GEN_KEYS)
        if unknown:
            raise ValueError(f"unknown sampling keys: {', '.join(sorted(unknown))}")
        p = {k: params.get(k, default) for k, (_, default) in GEN_KEYS.items()}
        return cls(temperature=float(p["temperature"] or 0.0), top_k=int(p["top_k"] or 0),
                   top_p=float(p["top_p"] if p["top_p"] is not None else 1.0), min_p=float(p["min_p"] or 0.0),
                   seed=None if p["seed"] is None else int(p["seed"]),
                   penalty_repeat=float(p["penalty_repeat"] if p["penalty_repeat"] is not None else 1.0),
                   penalty_freq=float(p["penalty_freq"] or 0.0), penalty_present=float(p["penalty_present"] or 0.0),
                   penalty_last_n=int(p["penalty_last_n"] if p["penalty_last_n"] is not None else 64))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalties_active(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.penalty_repeat != 1.0 or self.penalty_freq != 0.0 or self.penalty_present != 0.0)

    @property
    def plain_greedy(self) -> bool:
        """The pick is the argmax of the logits as they are: greedy without penalties."""
        return self.greedy and not self.penalties_active

    def counted(self, ids) -> tuple[int, ...]:
        """The ids of a history (a sequence, oldest first) that the penalties count: the last penalty_last_n, all
        of them for -1, none without penalties."""
        if not self.penalties_active:
            return ()
        n = self.penalty_last_n
        return tuple(ids if n < 0 else ids[-n:])

    # --- the chain -------------------------------------------------------------------------------------------
    def apply_penalties(self, logits: np.ndarray, history=()) -> np.ndarray:
        """The logits with the repeat, frequency and presence penalties of the ids in `history` (as counted())."""
        if not self.penalties_active or not len(history):
            return logits
        logits = logits.copy()
        counts = Counter(history)
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

    def probabilities(self, logits: np.ndarray, history=()) -> np.ndarray:
        """The distribution a sampled (temperature > 0) draw uses, after the whole chain."""
        x = self.filter(self.apply_penalties(_finite(logits, None), history))
        return _softmax(x / self.temperature)

    def choose(self, logits: np.ndarray, history=(), u: float | None = None) -> int:
        """The chain's pick from checked (and masked) logits: the argmax of the penalized logits when greedy, else
        the id where u (a draw in [0, 1)) falls in the cumulative distribution of the candidates."""
        x = self.apply_penalties(logits, history)
        if self.greedy:
            return int(np.argmax(x))
        ids, vals = self.candidates(x)
        cum = np.cumsum(_softmax(vals / self.temperature))
        r = u * cum[-1]
        return int(ids[min(int(np.searchsorted(cum, r, side="right")), len(cum) - 1)])


@dataclass(frozen=True)
class Pick:
    """One picked token: its id and, when the spec asked for logprobs, its log-probability and the most likely
    (id, log-probability), most likely first (engine/protocol.py format_token)."""
    id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, eq=False)
class PickSpec:
    """What a backend picks with (engine/backend.py decode). `history` is the penalty history before the tokens a
    decode call feeds (the ids SamplingParams.counted keeps): the pick after the call's position i counts history
    plus the call's tokens up to i. `mask` limits one pick, so a call that returns several picks takes none."""
    params: SamplingParams = SamplingParams()
    seed: int = 0                       # the request's random source: draw i is draw(seed, i) (GPU: its own hash)
    draws: int = 0                      # the draws the request has made: the next pick uses draw number `draws`
    history: tuple[int, ...] = ()
    mask: np.ndarray | None = None      # allowed tokens as bitmask words (engine/grammar.py), or None
    logprobs: int | None = None         # K: return the pick's log-probability and the K most likely; None: neither
    # A window's sampled drafts: (token, q) for each fed token after the first, q the distribution it was drawn from
    # (float64 over the vocabulary); the pick after position i judges drafts[i]. Empty: no draft distribution.
    drafts: tuple = ()
    # Whether a one-token pick fed with this pick is likely to follow (the caller's hint): a backend may then run
    # that step ahead (engine/cuda/backend.py's pipeline) and discards it when the next call is anything else.
    # False at a request's last token, with a grammar, and where the next call may be a verify window.
    more: bool = True

    def __post_init__(self):
        object.__setattr__(self, "history", tuple(self.history))

    def counted(self, fed=()) -> tuple[int, ...]:
        """The ids the penalties count for the pick after `fed` (the tokens of this call up to that position)."""
        return self.params.counted(self.history + tuple(int(t) for t in fed))

    def after(self, fed) -> PickSpec:
        """The spec of the pick len(fed) positions further on, each of `fed` having had its own pick: the history
        grows by them, and each of those picks used a draw when sampling. decode(tokens, spec, all_positions=True)
        returns at position i what a one-token call with spec.after(tokens[:i]) would."""
        if not len(fed):
            return self
        return replace(self, history=self.counted(fed), draws=self.draws + (0 if self.params.greedy else len(fed)),
                       drafts=self.drafts[len(fed):])


class Sampler:
    """One request's sampling state, owned by the session: the params, the seed, the draws made so far. It builds
    the spec of each pick; the backend never writes into it."""

    def __init__(self, params: dict | SamplingParams | None = None):
        self.params = params if isinstance(params, SamplingParams) else SamplingParams.of(params)
        seed = self.params.seed
        self.seed = int(seed) if seed is not None else int.from_bytes(os.urandom(8), "little")
        self.draws = 0

    def spec(self, history=(), mask=None, logprobs: int | None = None, drafts=(), more: bool = True) -> PickSpec:
        """The spec of the next pick; history: the sequence so far (oldest first) before the tokens the decode
        call feeds; drafts: a window's sampled drafts (PickSpec.drafts); more: PickSpec.more."""
        return PickSpec(self.params, self.seed, self.draws, self.params.counted(history), mask, logprobs,
                        tuple(drafts), more)

    def advance(self, picks: int = 1) -> None:
        """`picks` picks were made (a window's included): each sampled one used a draw."""
        if not self.params.greedy:
            self.draws += picks


def draw(seed: int, i: int) -> float:
    """Draw number i (0-based) of the request with this seed, in [0, 1): the i-th random() of numpy's
    default_rng(seed), reached by jumping PCG64 ahead i steps (one 64-bit output per double)."""
    return float(np.random.Generator(np.random.PCG64(seed).advance(i)).random())


def pick(logits: np.ndarray, spec: PickSpec, fed=()) -> Pick:
    """The reference pick from one row of logits, the one after feeding `fed` (this call's tokens up to the row's
    position): the NaN rule, the mask, the chain on the history spec.counted(fed) with draw spec.draws, and the
    log-probabilities of the masked logits when asked."""
    x = _finite(logits, spec.mask)
    params = spec.params
    if spec.drafts and not params.greedy:
        tok = judge_draft(params.probabilities(x, spec.counted(fed)), *spec.drafts[0], draw(spec.seed, spec.draws))
    else:
        tok = params.choose(x, spec.counted(fed), None if params.greedy else draw(spec.seed, spec.draws))
    if spec.logprobs is None:
        return Pick(tok)
    lp, top = logprobs_of(x, tok, spec.logprobs)
    return Pick(tok, lp, tuple(top))


def judge_draft(p: np.ndarray, token: int, q: np.ndarray, u: float) -> int:
    """The speculative rule for a draft drawn from q (the module docstring): token itself with probability
    min(1, p/q) at the draw u, else the residual max(0, p - q)'s token at the rescaled draw. Both distributions over
    the whole vocabulary; the result is p-distributed."""
    token = int(token)
    q_d = float(q[token])
    if not q_d > 0.0:
        raise ValueError(f"draft token {token} has no probability in the distribution it was drawn from")
    ratio = float(p[token]) / q_d
    if u < ratio:
        return token
    residual = np.maximum(np.asarray(p, np.float64) - np.asarray(q, np.float64), 0.0)
    if not residual.sum() > 0.0:     # p == q up to rounding: the rejection had no probability; p's own draw
        residual = np.asarray(p, np.float64)
    cum = np.cumsum(residual)
    r = (u - ratio) / (1.0 - ratio) * cum[-1]
    return int(min(int(np.searchsorted(cum, r, side="right")), len(cum) - 1))


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


def _finite(logits, mask) -> np.ndarray:
    """float32 logits, masked when there is a mask, after the NaN rule."""
    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    refuse(int(np.isnan(x).sum()), mask is not None)
    if mask is not None:
        x = apply_mask(x, mask)
    if not np.isfinite(x).any():
        refuse(-1, mask is not None)
    return x


def _softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x)
    e = np.exp((x - m).astype(np.float64))
    return e / e.sum()
