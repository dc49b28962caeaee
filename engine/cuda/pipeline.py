"""The decode pipeline's pieces (engine/cuda/backend.py runs it): the step launched ahead, what it must leave
restorable, and its counters.

A decode step's pick feeds the next step on the GPU (engine/cuda/decode.py step_advance), so the backend launches
step n+1 before it reads step n's pick, and the host's work between tokens (reading the pick, the session's checks,
printing the T line, the next call) overlaps step n+1 instead of leaving the GPU idle. The step ahead is kept when the
next decode call is the one it assumed (the same position, fed the pick, the same pick mode and sampler state, no
mask); any other call, or any other backend call (truncate, a snapshot, the stats, a prompt pass), discards it first,
and a discarded step leaves no trace:
  - its K/V row lies past n_cached (host-tracked), overwritten by the next step there; a window layer's ring (gpt-oss)
    lost the row it replaced, so the position counts as written for truncate's rule (_kv_high);
  - what a step changes besides K/V (a hybrid's recurrent state, the expert cache's and the prefetch's counters) was
    copied aside before it was launched (DeviceCopy.save) and is copied back (restore), both ordered on the stream;
  - the GPU sampler's device state (RNG counter, penalty window) advanced: its `held` is dropped, so the next
    sampled pick reloads it from the spec.
Nothing waits for the discarded step: the copies back and any later launch are ordered after it on the stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy as cp

from engine.cuda.trace import Tracer


@dataclass
class Ahead:
    """The step launched before the previous pick was read: its position, pick mode, and the token it was fed (the
    previous step's pick, known once that pick is read; None until then)."""
    pos: int
    pick: str
    token: int | None = None


@dataclass
class PipelineCounts:
    """Steps launched ahead, kept (their pick used) and discarded, since the backend started."""
    ahead: int = 0
    kept: int = 0
    discarded: int = 0


def watches_steps(tracer) -> bool:
    """A tracer that overrides a step hook (bench.prefetch_oracle replays graphs in after_step) expects each step's
    launch and read in turn: no step runs ahead for it."""
    t = type(tracer)
    return any(getattr(t, h) is not getattr(Tracer, h) for h in ("before_step", "launched", "after_step"))


class DeviceCopy:
    """A device buffer a step changes besides K/V, and a spare of its size: save() copies it there, restore() back,
    each one memcpy ordered on `stream`."""

    def __init__(self, live, stream):
        self.live, self.stream = live, stream
        with stream:
            self.spare = cp.empty_like(live)
        self.nbytes = int(live.nbytes)

    def _copy(self, dst, src) -> None:
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, self.nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                    self.stream.ptr)

    def save(self) -> None:
        self._copy(self.spare, self.live)

    def restore(self) -> None:
        self._copy(self.live, self.spare)
