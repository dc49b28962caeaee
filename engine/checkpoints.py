"""Checkpoints of a recurrent state, so prefix reuse works on models whose state cannot be rewound.

A hybrid model's Gated DeltaNet layers (qwen3next, qwen35moe) sum up every position read so far in a conv window and
a delta-rule matrix per layer, and keep no entry per position as the KV cache does: after reading a conversation,
the state for a shorter prefix of it is gone. So the session snapshots the state (engine/backend.py:
snapshot_state/restore_state) at chosen positions of the sequence it holds, and for a new prompt resumes from the
latest snapshot at or before the common prefix, reading the rest again (llama.cpp's server calls these context
checkpoints). Where the session takes them (engine/session.py): every `every` prompt tokens, CHECKPOINT_TAIL tokens
before each prompt's end, and at the end of each request.

Every checkpoint describes a prefix of the tokens the session holds now: when the session rewinds to p, checkpoints
past p describe tokens it no longer holds and are dropped (drop_after). The store keeps at most `budget` bytes; to
make room it evicts the checkpoint that costs least to lose (below), never the one being added.
"""
from __future__ import annotations

from engine.backend import RecurrentSnapshot

# Chat templates end a prompt with a few tokens that a later turn renders differently: Qwen3.5's generation prompt
# opens `<think>` (a few tokens after `<|im_start|>assistant`), and the same turn in the next request's history has
# its thinking dropped. A checkpoint this many tokens before the end survives that, for a few tokens read again.
CHECKPOINT_TAIL = 16


class CheckpointStore:
    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self._items: list[RecurrentSnapshot] = []     # ascending n_tokens, one per position

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._items)

    def positions(self) -> list[int]:
        return [c.n_tokens for c in self._items]

    def fits(self, nbytes: int) -> bool:
        """Whether one checkpoint of this size can be kept at all (evicting every other one if need be)."""
        return 0 < nbytes <= self.budget

    def add(self, snap: RecurrentSnapshot) -> None:
        if not self.fits(snap.nbytes):
            raise ValueError(f"a checkpoint of {snap.nbytes} bytes does not fit a budget of {self.budget}")
        self._items = [c for c in self._items if c.n_tokens != snap.n_tokens]
        while self._items and self.nbytes + snap.nbytes > self.budget:
            self._items.remove(self._cheapest_loss())
        self._items.append(snap)
        self._items.sort(key=lambda c: c.n_tokens)

    def _cheapest_loss(self) -> RecurrentSnapshot:
        # Without checkpoint i, a prompt that diverges between it and the next resumes from checkpoint i-1 (or from
        # nothing) instead: n_tokens[i] - n_tokens[i-1] more tokens to read. Evict the smallest such loss (the oldest
        # on a tie), which keeps the survivors spread over the conversation.
        best, best_loss, prev = None, None, 0
        for c in self._items:
            loss = c.n_tokens - prev
            if best_loss is None or loss < best_loss:
                best, best_loss = c, loss
            prev = c.n_tokens
        return best

    def latest_at_or_before(self, n: int) -> RecurrentSnapshot | None:
        found = None
        for c in self._items:
            if c.n_tokens > n:
                break
            found = c
        return found

    def drop_after(self, n: int) -> None:
        self._items = [c for c in self._items if c.n_tokens <= n]

    def clear(self) -> None:
        self._items = []
