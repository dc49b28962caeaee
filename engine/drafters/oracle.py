"""The oracle drafter, for benchmarks and tests: random weights make every real drafter's acceptance meaningless, so
bench.spec measures windows with drafts of a known acceptance instead.

It is given the sequence the target will produce (the prompt and its greedy continuation, from a plain run) and
proposes, after position n, the true tokens with probability `a` each and otherwise a wrong one (the true id plus a
random nonzero offset), from its own seeded generator. Past the known sequence it proposes nothing.
"""
from __future__ import annotations

import numpy as np

from engine.drafters.base import Draft, Drafter


class OracleDrafter(Drafter):
    name = "oracle"

    def __init__(self, truth, a: float, n_vocab: int, seed: int = 0):
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"the oracle's acceptance {a} is not in [0, 1]")
        self.truth = [int(t) for t in truth]
        self.a, self.n_vocab = float(a), int(n_vocab)
        self.rng = np.random.default_rng(seed)
        self.n = 0

    def rewind(self, n: int) -> None:
        self.n = min(self.n, n)

    def observe(self, tokens, hidden=None) -> None:
        self.n += len(tokens)

    def propose(self, last: int, k: int, sampler=None) -> Draft:
        true = self.truth[self.n + 1:self.n + 1 + max(k, 0)]
        out = []
        for t in true:
            right = self.rng.random() < self.a
            out.append(t if right else (t + int(self.rng.integers(1, self.n_vocab))) % self.n_vocab)
        return Draft(out)
