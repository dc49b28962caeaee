"""The optional observer of the CUDA backend: benches and tests pass one (CUDABackend(..., tracer=...)) instead of
setting attributes on the engine's classes. Every hook here does nothing; a tracer overrides what it needs.

- Decode, around each step the backend runs: before_step(backend), launched(backend) once the step is enqueued,
  after_step(backend, token, pos) once its pick is read and before the position advances (bench.prefetch_oracle
  replays other graphs of the same step there).
- A decode graph recorded with a tracer (DecodeStep.record(pick, tracer)): keeps(kind) filters the launches by kind
  (KindFilter: bench.decode's per-kind profile); pred_sink, when set, receives the prefetch's predictions instead of
  its own buffer (bench.prefetch_oracle's graph).
- The prompt pass: prefill_chunk(facts) once per chunk, after its last launch (ChunkFacts keeps the last one:
  ring depth, lent slots, bytes streamed, tokens, host ms; with copy_timing the ring's "runner" and the streamed
  layers' "window" carry timed events, with phase_timing "phases" the GPU time per phase); prefill_routes(pos0, layer,
  ids) per chunk and MoE layer (ids: the (T, top-k) device array of the routes taken; tests/route_ties.py follows
  them).
"""
from __future__ import annotations


class Tracer:
    copy_timing = False
    phase_timing = False
    pred_sink = None

    def keeps(self, kind: str) -> bool:
        return True

    def before_step(self, backend) -> None:
        pass

    def launched(self, backend) -> None:
        pass

    def forget(self) -> None:
        """Drop whatever the tracer keeps of the backend it served (a tracer may serve several in turn)."""

    def after_step(self, backend, token: int, pos: int) -> None:
        pass

    def prefill_routes(self, pos0: int, layer: int, ids) -> None:
        pass

    def prefill_chunk(self, facts: dict) -> None:
        pass


class ChunkFacts(Tracer):
    """Keeps the prompt pass's facts about its last chunk in `last` (None before the first)."""

    def __init__(self, copy_timing: bool = False, phase_timing: bool = False):
        self.copy_timing, self.phase_timing = copy_timing, phase_timing
        self.last: dict | None = None

    def prefill_chunk(self, facts: dict) -> None:
        self.last = facts

    def forget(self) -> None:
        """Drop the last chunk's facts: they hold its ring runner, and through it the backend's VRAM, so a tracer
        that outlives its backend (the benches pass one to each backend in turn) must let go before the next."""
        self.last = None


class KindFilter(Tracer):
    """Keeps the launches of one kind of kernel (only=None: every kind) and records the kinds it sees."""

    def __init__(self, only: str | None = None):
        self.only = only
        self.seen: set[str] = set()

    def keeps(self, kind: str) -> bool:
        self.seen.add(kind)
        return self.only is None or kind == self.only
