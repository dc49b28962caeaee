"""The VRAM expert cache and the device pointer table.

table[g] (g = layer * n_expert + expert) is the device address the expert kernels read expert g from: its VRAM slot
when resident, else its blob in the mapped pinned arena. The router kernels count routing per expert into `counts`
and hits into `stats`. The adaptive tier decays the counts into `heat` (x0.7 per round) and swaps the hottest
non-resident experts into the slots of the coldest, on a copy stream, in this order:
  1. main stream: each victim's entry goes back to its arena address (kernels after this read the arena);
  2. copy stream, after 1 (an event): the newcomers' bytes are copied into the freed slots;
  3. main stream, once the copies have landed (polled, never waited on): the newcomers' entries point at their slots.
"""
from __future__ import annotations

import time

import cupy as cp
import numpy as np

DECAY = 0.7


class ExpertCache:
    def __init__(self, arena, n_slots: int, max_swaps: int = 64):
        self.arena = arena
        self.n_layer, self.n_expert, self.n_total = arena.n_layer, arena.n_expert, arena.n_total
        self.stride = arena.layout.stride
        self.n_slots = int(min(n_slots, self.n_total))
        self.slots = cp.empty(max(self.n_slots, 1) * self.stride, dtype=cp.uint8)
        self.slot_lo = int(self.slots.data.ptr)
        self.slot_hi = self.slot_lo + self.n_slots * self.stride
        self.table_host = arena.blob_ptr.copy()
        self.table = cp.asarray(self.table_host)
        self.slot_of = np.full(self.n_total, -1, dtype=np.int64)
        self.owner = np.full(self.n_slots, -1, dtype=np.int64)
        self.counts = cp.zeros(self.n_total, dtype=cp.int32)
        self.stats = cp.zeros(2, dtype=cp.uint64)          # hits, lookups (decode)
        self.heat = np.zeros(self.n_total, dtype=np.float64)
        self.prior = np.full(self.n_total, -1, dtype=np.int64)   # rank from a loaded profile
        self.max_swaps = max_swaps
        self.copy_stream = cp.cuda.Stream(non_blocking=True)
        self._pending = None          # (event, ids, slots)
        self.swaps = 0
        self.bytes_swapped = 0

    def slot_ptr(self, s: int) -> int:
        return self.slot_lo + int(s) * self.stride

    def resident(self) -> np.ndarray:
        return self.slot_of >= 0

    # --- filling ---------------------------------------------------------------------------------------------
    def fill(self, order, stream) -> int:
        """Load experts in `order` (global ids, hottest first) into free slots now; returns how many."""
        free = [s for s in range(self.n_slots) if self.owner[s] < 0]
        ids = [int(g) for g in order if self.slot_of[int(g)] < 0][:len(free)]
        for g, s in zip(ids, free):
            cp.cuda.runtime.memcpyAsync(self.slot_ptr(s), int(self.arena.blob_ptr[g]), self.stride,
                                        cp.cuda.runtime.memcpyDefault, stream.ptr)
            self.slot_of[g] = s
            self.owner[s] = g
            self.table_host[g] = self.slot_ptr(s)
        self._upload_table(stream)
        stream.synchronize()
        return len(ids)

    def _upload_table(self, stream):
        with stream:
            self.table.set(self.table_host, stream=stream)

    # --- the adaptive tier -----------------------------------------------------------------------------------
    def take_counts(self, stream) -> np.ndarray:
        with stream:
            c = self.counts.get(stream=stream)
            self.counts.fill(0)
        stream.synchronize()
        return c

    def adapt(self, stream) -> int:
        """One round: decay heat, add new counts, start swaps. Returns the number of swaps started."""
        self.poll(stream)
        c = self.take_counts(stream)
        self.heat *= DECAY
        self.heat += c
        if self._pending is not None or self.n_slots == 0:
            return 0
        res = self.slot_of >= 0
        cand = np.flatnonzero(~res & (self.heat > 0))
        if not len(cand):
            return 0
        cand = cand[np.argsort(-self.heat[cand], kind="stable")][:self.max_swaps]
        # victims: free slots first, then the coldest residents
        free = np.flatnonzero(self.owner < 0)
        occ = np.flatnonzero(self.owner >= 0)
        occ = occ[np.argsort(self.heat[self.owner[occ]], kind="stable")]
        victims = np.concatenate([free, occ])
        ids, slots, evicted = [], [], []
        for g, s in zip(cand, victims):
            old = self.owner[s]
            if old >= 0 and self.heat[g] <= self.heat[old] * 1.25 + 0.5:
                break          # no clear gain: keep what is there (hysteresis against thrashing)
            ids.append(int(g))
            slots.append(int(s))
            if old >= 0:
                evicted.append(int(old))
        if not ids:
            return 0
        for old in evicted:          # 1. victims back to the arena, in stream order
            self.table_host[old] = self.arena.blob_ptr[old]
            self.slot_of[old] = -1
        for s in slots:
            self.owner[s] = -1
        if evicted:
            self._upload_table(stream)
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(stream)
        self.copy_stream.wait_event(ev)
        for g, s in zip(ids, slots):         # 2. copies on the side stream
            cp.cuda.runtime.memcpyAsync(self.slot_ptr(s), int(self.arena.blob_ptr[g]), self.stride,
                                        cp.cuda.runtime.memcpyDefault, self.copy_stream.ptr)
        done = cp.cuda.Event(disable_timing=True)
        done.record(self.copy_stream)
        self._pending = (done, ids, slots)
        self.swaps += len(ids)
        self.bytes_swapped += len(ids) * self.stride
        return len(ids)

    def poll(self, stream, wait: bool = False) -> bool:
        """3. once the copies have landed, point the table at the new slots (on the main stream)."""
        if self._pending is None:
            return False
        ev, ids, slots = self._pending
        if wait:
            ev.synchronize()
        elif not ev.done:
            return False
        for g, s in zip(ids, slots):
            self.slot_of[g] = s
            self.owner[s] = g
            self.table_host[g] = self.slot_ptr(s)
        self._upload_table(stream)
        self._pending = None
        return True

    # --- reporting -------------------------------------------------------------------------------------------
    def read_stats(self, stream) -> tuple[int, int]:
        with stream:
            s = self.stats.get(stream=stream)
        return int(s[0]), int(s[1])

    def reset_stats(self, stream):
        with stream:
            self.stats.fill(0)

    def learned_order(self) -> np.ndarray:
        """Resident first (hottest first), then counted routing, then the prior order: the profile to save."""
        res = np.flatnonzero(self.slot_of >= 0)
        res = res[np.argsort(-self.heat[res], kind="stable")]
        rest = np.flatnonzero((self.slot_of < 0) & (self.heat > 0))
        rest = rest[np.argsort(-self.heat[rest], kind="stable")]
        seen = np.zeros(self.n_total, dtype=bool)
        seen[res] = True
        seen[rest] = True
        pri = np.flatnonzero((self.prior >= 0) & ~seen)
        pri = pri[np.argsort(self.prior[pri], kind="stable")]
        return np.concatenate([res, rest, pri]).astype(np.int64)

    def heat_u8(self) -> np.ndarray:
        """Heat scaled to 0..255 (the hottest expert 255), one byte per expert, for the CACHE line."""
        h = self.heat
        top = h.max() if len(h) and h.max() > 0 else 1.0
        return np.clip(np.round(255.0 * h / top), 0, 255).astype(np.uint8)
