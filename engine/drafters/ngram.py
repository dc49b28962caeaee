"""Prompt-lookup drafts: where the sequence's last n tokens occurred before, propose what followed them.

The sequence is every token the session's backend holds (the prompt and the answer so far) plus the pick not yet
fed. For n from MAX_N down to MIN_N, the latest earlier occurrence of its last n tokens gives the draft: the tokens
that followed it, up to k (fewer where the sequence ends first). An index keeps, for every n-gram that has a
continuation, the position after its latest occurrence, updated as tokens arrive and rebuilt when the session cuts
back. Code edits, quotes and repeated boilerplate are where this pays: the answer copies spans of the prompt.
"""
from __future__ import annotations

from engine.drafters.base import Draft, Drafter

# 2-grams at least: a single token's last occurrence predicts its successor too rarely to pay for a window on the
# GPU; 4 and up are rarer than they are more right.
MAX_N = 4
MIN_N = 2


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_n: int = MAX_N, min_n: int = MIN_N):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes {min_n}..{max_n}: need 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n
        self.seq: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}     # n-gram -> the position after its latest occurrence

    def _add(self, tok: int) -> None:
        seq = self.seq
        i = len(seq)            # tok's position: every n-gram that ends at i - 1 now has a continuation
        for n in range(self.min_n, self.max_n + 1):
            if i >= n:
                self.index[tuple(seq[i - n:i])] = i
        seq.append(tok)

    def rewind(self, n: int) -> None:
        if n >= len(self.seq):
            return
        kept = self.seq[:n]
        self.seq, self.index = [], {}
        for t in kept:
            self._add(t)

    def observe(self, tokens, hidden=None) -> None:
        for t in tokens:
            self._add(int(t))

    def propose(self, last: int, k: int, sampler=None) -> Draft:
        if k <= 0:
            return Draft([])
        full = self.seq + [int(last)]
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(full) <= n:
                continue
            at = self.index.get(tuple(full[-n:]))
            if at is not None:
                return Draft(full[at:at + k])
        return Draft([])
