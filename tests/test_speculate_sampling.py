"""The speculative rule for sampled drafts (engine/sampling.py judge_draft, PickSpec.drafts): what it emits follows
the target's distribution, whatever the draft distribution q, checked by frequencies on a small vocabulary.

Each check is Pearson's chi-square of the observed counts against the target's probabilities, against the bound
its distribution exceeds with probability 1e-6 (chi2_bound: the quantile, by bisection on the regularized upper
incomplete gamma function, which needs no SciPy). A right rule passes at a set seed (the draws are fixed, so it cannot fail by
bad luck later), and a chance of 1e-6 to have failed at a random seed means the seed was not picked to pass. A wrong
rule cannot pass by luck: the test computes what the two plausible wrong rules (accept every draft; accept with
min(1, p/q) but draw a rejection from p instead of the residual) would emit, and the counts expected from them sit
many times beyond the bound.
"""
import math

import numpy as np
import pytest

from engine.backend import Backend
from engine.drafters import Draft, Drafter
from engine.protocol import GenRequest
from engine.sampling import PickSpec, SamplingParams, judge_draft, pick
from engine.session import Session
from engine.speculate import FixedWindow

def upper_gamma(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a), by its continued fraction (Lentz), for x > a + 1 as used here."""
    b = x + 1.0 - a
    c, d = 1e300, 1.0 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2.0
        d = 1.0 / (an * d + b)
        c = b + an / c
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def chi2_bound(df: int, tail: float = 1e-6) -> float:
    """The chi-square distribution's upper `tail` quantile: P(X > bound) = tail."""
    lo, hi = 0.0, 100.0 * df + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if upper_gamma(df / 2, mid / 2) > tail else (lo, mid)
    return lo


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    return float(np.sum((counts - n * probs) ** 2 / (n * probs)))


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_the_bound_is_the_quantile():
    # scipy.stats.chi2.isf(1e-6, df) for df 5, 63, 124; and the median of df 2 (an exponential's: 2 ln 2)
    assert [round(chi2_bound(df), 4) for df in (5, 63, 124)] == [35.8882, 131.3697, 213.715]
    assert chi2_bound(2, 0.5) == pytest.approx(2 * math.log(2), rel=1e-9)


def test_one_judged_pick_follows_the_target():
    rng = np.random.default_rng(0)
    V, N = 6, 40000
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, 1.5], np.float32)
    params = SamplingParams(temperature=1.0)
    p = params.probabilities(logits)
    bound = chi2_bound(V - 1)
    for q in (softmax(np.array([0.0, 2.0, 1.0, -1.0, 0.5, 0.0])),     # far from p
              np.full(V, 1.0 / V), p.copy()):                           # uniform; q = p (never rejects)
        counts = np.zeros(V)
        accepts = 0
        for i in range(N):
            d = int(rng.choice(V, p=q))
            tok = pick(logits, PickSpec(params, seed=1234, draws=i, drafts=((d, q),))).id
            counts[tok] += 1
            accepts += tok == d
        assert chi2(counts, p) < bound, (q, counts / N, p)
        assert abs(accepts / N - np.minimum(p, q).sum()) < 0.02     # acceptance is sum(min(p, q))
        # what the wrong rules emit, and how far beyond the bound their counts would sit
        always = q
        no_residual = np.minimum(p, q) + (1.0 - np.minimum(p, q).sum()) * p
        for wrong in (always, no_residual):
            if np.abs(wrong - p).max() > 1e-9:
                assert N * np.sum((wrong - p) ** 2 / p) > 10 * bound


def test_judge_draft_takes_the_draw_it_is_given():
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.6, 0.2])
    assert judge_draft(p, 1, q, 0.49) == 1              # 0.49 < p/q = 0.5: accepted
    # rejected at u = 0.75: the residual max(0, p - q) = (0.3, 0, 0) holds only token 0
    assert judge_draft(p, 1, q, 0.75) == 0
    assert judge_draft(p, 0, q, 0.99) == 0              # p/q >= 1: always accepted
    try:
        judge_draft(p, 2, np.array([0.5, 0.5, 0.0]), 0.1)
    except ValueError as e:
        assert "no probability" in str(e)
    else:
        raise AssertionError("a draft outside its own distribution was judged")


class Chain(Backend):
    """A 4-token model whose next-token logits depend on the last token only: p(. | t) = softmax(L[t])."""
    name = "chain"
    judges_drafts = True

    def __init__(self, L):
        from types import SimpleNamespace
        super().__init__(SimpleNamespace(config=SimpleNamespace(n_vocab=len(L), n_ctx_train=64)), 64)
        self.L = np.asarray(L, np.float32)
        self.held = []

    def forward(self, tokens, all_logits=False):
        self.held.extend(int(t) for t in tokens)
        self.n_cached += len(tokens)
        rows = self.L[np.asarray(tokens)]
        return rows if all_logits else rows[-1]

    def truncate(self, n):
        super().truncate(n)
        del self.held[n:]


class ChainDrafter(Drafter):
    """Drafts drawn from another chain, q(. | t) = softmax(Q[t]), with q beside each."""
    name = "chain-q"

    def __init__(self, Q, seed):
        self.Q = np.asarray(Q, np.float64)
        self.rng = np.random.default_rng(seed)

    def propose(self, last, k, sampler=None):
        toks, probs, t = [], [], last
        for _ in range(k):
            q = softmax(self.Q[t])
            t = int(self.rng.choice(len(q), p=q))
            toks.append(t)
            probs.append(q)
        return Draft(toks, probs)


def test_sampled_windows_follow_the_target_sequence_distribution():
    """Whole requests through the session: 3 tokens after the prompt [0], the second and third from windows of
    drafts drawn from q (accepted, rejected into the residual, or the target's own next token). The joint counts of
    (t1, t2, t3) against p(t1 | 0) p(t2 | t1) p(t3 | t2)."""
    V, N = 4, 12000
    L = np.array([[0.5, 0.0, -0.3, 0.2], [0.0, 0.8, 0.1, -0.2], [0.3, -0.4, 0.6, 0.0], [-0.2, 0.1, 0.0, 0.7]])
    Q = np.array([[0.0, 0.9, 0.0, -0.6], [1.0, -0.5, 0.0, 0.4], [-0.3, 0.0, 0.0, 0.9], [0.6, 0.0, 0.5, -0.8]])
    P = np.array([softmax(row) for row in L])
    want = np.einsum("a,ab,bc->abc", P[0], P, P).ravel()
    assert want.min() * N > 20          # every cell expects enough counts for the chi-square law
    be = Chain(L)
    s = Session(be, eog_ids=(), drafter=ChainDrafter(Q, 7), rule=FixedWindow(3))
    counts = np.zeros(V ** 3)
    offered = accepted = 0
    for seed in range(N):
        lines = []
        done = s.run(GenRequest(3, [0], {"temperature": 1.0, "seed": seed}), lines.append)
        t = [int(ln.split()[1]) for ln in lines if ln.startswith("T ")]
        counts[(t[0] * V + t[1]) * V + t[2]] += 1
        offered, accepted = offered + done.drafts_offered, accepted + done.drafts_accepted
    assert chi2(counts, want) < chi2_bound(V ** 3 - 1)
    assert 0 < accepted < offered
    # the rule that accepts every draft would emit t2, t3 from q: far beyond the bound at this N
    Qp = np.array([softmax(row) for row in Q])
    always = np.einsum("a,ab,bc->abc", P[0], Qp, Qp).ravel()
    assert N * np.sum((always - want) ** 2 / want) > 10 * chi2_bound(V ** 3 - 1)
