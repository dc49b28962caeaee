"""The expert ring of the streamed prompt pass: every non-resident expert of every layer goes through a ring of VRAM
slots in one fixed order (layer by layer, expert id order), whatever the routing, on a copy stream that runs ahead of
the compute stream by the ring's depth.

The schedule is plain data (`schedule()`): items in that order, item i in slot i % depth, cut into batches that never
cross a layer and hold at most `batch` items. Per batch there is one "copied" event (copy stream) and one "free
again" event (compute stream), and each stream waits once per batch:
  copy stream:    wait(free of the latest batch that used any of these slots); copy each item; record(copied)
  compute stream: wait(copied); the grouped GEMMs of this batch's experts; record(free)
Free events are recorded on one stream in batch order, so waiting on the latest one covers every earlier user.

CUDA's wait binds to the event's most recent record *already enqueued*, so the host must not enqueue a batch's copies
before the free event they depend on has been recorded: `RingRunner.pump()` enqueues every batch whose slots are all
released, and runs after each release. A slot whose expert the routing did not need is released all the same.

The streams and events are behind a tiny interface (`Device`) so tests/test_ring.py drives the logic with fake
streams and checks its ordering invariants; `CupyDevice` is the real one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

BATCH_MAX = 64


# A NamedTuple, not a frozen dataclass: a 12 GiB chunk schedules ~3,200 items while the GPU waits for the chunk's
# first kernels (frozen dataclasses construct through object.__setattr__: 9 ms for the schedule, 1-2 ms as tuples).
class Item(NamedTuple):
    index: int              # position in the chunk's copy order
    layer: int
    expert: int
    slot: int


@dataclass(frozen=True)
class Batch:
    index: int
    layer: int
    items: tuple[Item, ...]

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(it.slot for it in self.items)

    @property
    def experts(self) -> tuple[int, ...]:
        return tuple(it.expert for it in self.items)


def batch_size(depth: int) -> int:
    """Half the ring (the copy stream fills one half while the other is read), at most BATCH_MAX."""
    return max(1, min(BATCH_MAX, depth // 2))


def schedule(resident, depth: int, batch: int | None = None) -> list[Batch]:
    """Batches for one chunk. resident: (n_layer, n_expert) booleans (anything indexable as resident[l][e])."""
    if depth < 1:
        raise ValueError(f"the ring needs at least one slot, got {depth}")
    b = batch_size(depth) if batch is None else int(batch)
    if not 1 <= b <= depth:
        raise ValueError(f"a ring batch holds 1 to {depth} items (the depth), got {b}")
    out: list[Batch] = []
    i = 0
    for layer, row in enumerate(resident):
        todo = np.flatnonzero(~np.asarray(row, dtype=bool)).tolist()
        for j in range(0, len(todo), b):
            items = tuple(Item(i + n, layer, e, (i + n) % depth) for n, e in enumerate(todo[j:j + b]))
            out.append(Batch(len(out), layer, items))
            i += len(items)
    return out


def overlap_ms(spans, lo: float, hi: float) -> float:
    """Total length of the parts of intervals `spans` ((start, end) pairs that do not overlap one another: one copy
    stream) inside [lo, hi]."""
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in spans)


class Device:
    """What the runner needs from CUDA. Streams are opaque values; events are what event() returns."""
    copy_stream = None
    compute_stream = None

    def event(self, timing: bool = False):
        raise NotImplementedError

    def elapsed_ms(self, a, b) -> float:
        raise NotImplementedError

    def record(self, stream, ev) -> None:
        raise NotImplementedError

    def wait(self, stream, ev) -> None:
        raise NotImplementedError

    def copy(self, stream, dst: int, src: int, nbytes: int) -> None:
        raise NotImplementedError


class CupyDevice(Device):
    def __init__(self, compute_stream, copy_stream=None):
        import cupy as cp
        self._cp = cp
        self.compute_stream = compute_stream
        self.copy_stream = copy_stream or cp.cuda.Stream(non_blocking=True)

    def event(self, timing=False):
        return self._cp.cuda.Event(disable_timing=not timing)

    def elapsed_ms(self, a, b):
        b.synchronize()
        return self._cp.cuda.get_elapsed_time(a, b)

    def record(self, stream, ev):
        ev.record(stream)

    def wait(self, stream, ev):
        stream.wait_event(ev)

    def copy(self, stream, dst, src, nbytes):
        rt = self._cp.cuda.runtime
        rt.memcpyAsync(dst, src, nbytes, rt.memcpyDefault, stream.ptr)


class RingRunner:
    """Drives one ring (slot addresses `slots`, `stride` bytes each) through chunks. Slot state lives across chunks:
    the next chunk's first copies wait only for the slots still in use. layer_bytes: the bytes an item of each layer
    copies (a file whose layers' blobs differ in size; each at most `stride`), else `stride`."""

    def __init__(self, dev: Device, slots: list[int], stride: int, timing: bool = False, layer_bytes=None):
        if not slots:
            raise ValueError("the ring has no slots")
        if layer_bytes is not None and max(layer_bytes, default=0) > stride:
            raise ValueError(f"a layer's blobs ({max(layer_bytes)} bytes) do not fit the ring's {stride}-byte slots")
        self.dev = dev
        self.slots = list(slots)
        self.stride = stride
        self.layer_bytes = None if layer_bytes is None else [int(b) for b in layer_bytes]
        self._seq = 0
        self._slot_free: list[tuple[int, object] | None] = [None] * len(slots)   # (seq, event) of the last release
        self._held: list[int | None] = [None] * len(slots)                        # batch holding the slot
        self.batches: list[Batch] = []
        self._next = 0
        self._copied: dict[int, object] = {}
        self._acquired = -1
        self.bytes_copied = 0
        self.timing = timing
        self.spans: list[tuple[object, object]] = []     # (start, copied) per batch when timing: copy-engine busy

    @property
    def depth(self) -> int:
        return len(self.slots)

    def begin_chunk(self, batches: list[Batch], src_of) -> None:
        """Start a chunk: src_of(layer, expert) -> source address. Copies begin at once, as far as slots allow."""
        if self._next < len(self.batches):
            raise RuntimeError("the previous chunk's ring batches were not all enqueued")
        for b in batches:
            if max(b.slots, default=-1) >= self.depth:
                raise ValueError(f"batch {b.index} uses slot {max(b.slots)} of a ring of {self.depth}")
        self.batches = batches
        self._src_of = src_of
        self._next = 0
        self._copied = {}
        self._acquired = -1
        self.pump()

    def pump(self) -> int:
        """Enqueue the copies of every next batch whose slots are all released; returns how many batches."""
        n = 0
        while self._next < len(self.batches):
            b = self.batches[self._next]
            if any(self._held[s] is not None for s in b.slots):
                break
            last = max((self._slot_free[s] for s in b.slots if self._slot_free[s] is not None),
                       default=None, key=lambda t: t[0])
            cs = self.dev.copy_stream
            if last is not None:
                self.dev.wait(cs, last[1])
            if self.timing:           # recorded after the wait: start to copied is copying only
                start = self.dev.event(True)
                self.dev.record(cs, start)
            nbytes = self.stride if self.layer_bytes is None else self.layer_bytes[b.layer]
            for it in b.items:
                self.dev.copy(cs, self.slots[it.slot], self._src_of(it.layer, it.expert), nbytes)
                self._held[it.slot] = b.index
            ev = self.dev.event(self.timing)
            self.dev.record(cs, ev)
            if self.timing:
                self.spans.append((start, ev))
            self._copied[b.index] = ev
            self.bytes_copied += len(b.items) * nbytes
            self._next += 1
            n += 1
        return n

    def acquire(self, b: Batch) -> list[int]:
        """The compute stream waits until batch b's experts have landed; returns their slot addresses."""
        if b.index != self._acquired + 1:
            raise RuntimeError(f"ring batch {b.index} taken out of order (after {self._acquired})")
        if b.index not in self._copied:
            self.pump()
        if b.index not in self._copied:
            raise RuntimeError(f"ring batch {b.index} cannot be copied: its slots are still held")
        self.dev.wait(self.dev.compute_stream, self._copied.pop(b.index))
        self._acquired = b.index
        return [self.slots[s] for s in b.slots]

    def release(self, b: Batch) -> None:
        """Everything that reads batch b's slots is enqueued on the compute stream: free them, then copy on."""
        if b.index != self._acquired:
            raise RuntimeError(f"ring batch {b.index} released but {self._acquired} is the one acquired")
        ev = self.dev.event()
        self.dev.record(self.dev.compute_stream, ev)
        self._seq += 1
        for s in b.slots:
            self._slot_free[s] = (self._seq, ev)
            self._held[s] = None
        self.pump()

    def busy_ms(self) -> float:
        """Milliseconds the copy stream spent copying (timing runners; waits for the last copy)."""
        return sum(self.dev.elapsed_ms(a, b) for a, b in self.spans)

    def busy_within_ms(self, ref, lo, hi) -> tuple[float, float]:
        """(copying, window): milliseconds the copy stream spent copying between timing events lo and hi, and the
        window's length. ref: a timing event that completed before any of them (times are measured from it, so
        every difference is of events in order)."""
        t = lambda ev: self.dev.elapsed_ms(ref, ev)      # noqa: E731
        a, b = t(lo), t(hi)
        return overlap_ms([(t(s), t(e)) for s, e in self.spans], a, b), max(0.0, b - a)

    def of_layer(self, layer: int) -> list[Batch]:
        return [b for b in self.batches if b.layer == layer]

    def end_chunk(self) -> None:
        if self._acquired != len(self.batches) - 1:
            raise RuntimeError(f"the chunk ended with ring batch {self._acquired + 1} of {len(self.batches)} unused")
