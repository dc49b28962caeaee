"""Speculative decoding over the one-pick API: a verify window, its rollback, and the rule that sizes the next one.

A window is [last, d1..dk]: the token just picked (not yet fed) and k drafts proposed to follow it (engine/drafters).
decode(window, spec, all_positions=True) returns the target's pick after each position; pick i is final once d1..di
were all accepted, that is picks[j] == d[j+1] for every j < i. A window so yields its a accepted drafts and the
target's own next token, a + 1 tokens, each exactly what one-token decoding picks there (engine/sampling.py says why
that holds for sampled picks too: a pick is judged with draw spec.draws + i, and the request's draws advance by a + 1).

Rollback: the backend keeps window[:a + 1]. Without recurrent state, or with `rewinds_windows` (the backend kept the
state after each position: engine/backend.py), that is truncate(). Otherwise the state was snapshotted before the
window; it is restored and the a + 1 kept tokens are fed again, one at a time (Window.keep says why). On cost:
per-position states cost a state copy a position (the 80B shape's 75 MiB, about 0.02 ms of HBM writes on the GPU),
a replay costs a second pass over the kept tokens (their weights read again, on the GPU and on the CPU alike), and
only after a rejection. So the backends keep per-position states where the family's cache can (CPU:
qwen3next.HybridCache), and the replay is the fallback for any family's snapshot/restore (the CUDA backend until its
kernels keep them, and any other family).

The rule (WindowRule, one per request): alpha, the chance that a draft is accepted when the ones before it were,
from decayed counts of accepted drafts and of first rejections (prior one of each, decay 0.9 a window). A window with
k drafts then yields E(k) = 1 + alpha + ... + alpha^k tokens and costs c(k) = the backend's window_cost(k + 1) steps.
The next window takes the k (0..max_window - 1, and within what the request still needs) with the most tokens per
cost, E(k) / c(k). When that is 0 but some window could pay at perfect acceptance, every 16th window still offers one
draft, so a drafter that improves is noticed. The rule reads acceptance only, never the clock, so a request's windows
are a function of its tokens: with drafts drawn from a distribution (engine/sampling.py) a seeded request then
still draws the same tokens every time.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.backend import MAX_WINDOW, Backend
from engine.sampling import Pick, PickSpec

PROBE_EVERY = 16


def accepted(window: list[int], picks: list[Pick]) -> int:
    """How many of the window's drafts (window[1:]) the picks accept: the length of the run of picks[j] ==
    window[j + 1]."""
    a = 0
    while a < len(window) - 1 and picks[a].id == window[a + 1]:
        a += 1
    return a


@dataclass
class Window:
    """One verify window on a backend: its picks and accepted drafts, then keep() to cut it back."""
    backend: Backend
    tokens: list[int]
    start: int                      # backend.n_cached before the window
    picks: list[Pick]
    accepted: int
    hidden: object = None           # the backend's hidden rows of the window's tokens (drafters that read them)
    snap: object = None             # the recurrent state before the window, where the backend cannot rewind

    def keep(self, n: int) -> None:
        """Leave the backend holding the window's first n tokens (1 <= n <= len(tokens))."""
        be = self.backend
        if self.start + n == be.n_cached:
            return
        if self.snap is None:
            be.truncate(self.start + n)
        else:
            # one token at a time: one-token decoding's arithmetic, so the state is the one plain decoding holds
            # (a chunk would run the prompt pass: on CUDA fp16 GEMMs, whose state parts from it at near-ties)
            be.restore_state(self.snap)
            for t in self.tokens[:n]:
                be.forward([t])
        if be.n_cached != self.start + n:
            raise RuntimeError(f"cutting a window back to {self.start + n} tokens left {be.n_cached}")


def verify(backend: Backend, tokens: list[int], spec: PickSpec, hidden: bool = False) -> Window:
    """Run the window tokens = [last, drafts...] and judge the drafts; the caller then keeps what it uses."""
    start = backend.n_cached
    window = len(tokens) > 1
    snap = backend.snapshot_state() if window and backend.recurrent and not backend.rewinds_windows else None
    picks = backend.decode(tokens, spec, all_positions=window)
    return Window(backend, list(tokens), start, picks, accepted(tokens, picks),
                  backend.hidden() if hidden else None, snap)


@dataclass
class WindowRule:
    """The module docstring's rule. cost(n): a window of n tokens in one-token steps (None: n)."""
    cost: object = None             # callable n_tokens -> steps (Backend.window_cost)
    max_window: int = MAX_WINDOW
    decay: float = 0.9
    acc: float = 1.0                # decayed accepted drafts
    rej: float = 1.0                # decayed windows that ended in a rejection
    _since_probe: int = 0

    def __post_init__(self):
        if not 1 <= self.max_window <= MAX_WINDOW:
            raise ValueError(f"a window takes 1 to {MAX_WINDOW} tokens, not {self.max_window}")

    @property
    def alpha(self) -> float:
        return self.acc / (self.acc + self.rej)

    def steps(self, k: int) -> float:
        """What a window with k drafts costs in one-token steps."""
        return float(self.cost(k + 1)) if self.cost is not None else float(k + 1)

    def gain(self, k: int, alpha: float | None = None) -> float:
        a = self.alpha if alpha is None else alpha
        return sum(a ** i for i in range(k + 1)) / self.steps(k)

    def drafts(self, limit: int) -> int:
        """Drafts for the next window: 0..min(max_window - 1, limit)."""
        top = max(0, min(self.max_window - 1, limit))
        best = max(range(top + 1), key=lambda k: (self.gain(k) - 1e-9 * k))
        if best == 0 and top >= 1 and any(self.gain(k, 1.0) > 1.0 + 1e-9 for k in range(1, top + 1)):
            self._since_probe += 1
            if self._since_probe >= PROBE_EVERY:
                self._since_probe = 0
                return 1
        return best

    def record(self, offered: int, accepted_: int) -> None:
        """One window: drafts offered and accepted."""
        if offered:
            self.acc = self.decay * self.acc + accepted_
            self.rej = self.decay * self.rej + (1.0 if accepted_ < offered else 0.0)


@dataclass
class SpecStats:
    """One request's speculation counters (DONE's drafts fields; windows: decode calls after the first pick)."""
    offered: int = 0
    accepted: int = 0
    windows: int = 0
    propose_s: float = 0.0          # seconds the drafter spent proposing the offered drafts
    observe_s: float = 0.0          # and following the tokens the backend read


class FixedWindow(WindowRule):
    """Every window as long as it may be (max_window tokens, within what the request needs): benches and tests."""

    def __init__(self, n_tokens: int):
        super().__init__(None, n_tokens)

    def drafts(self, limit: int) -> int:
        return max(0, min(self.max_window - 1, limit))
