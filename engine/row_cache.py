"""Rows of a GGUF matrix read where they lie, through a bounded LRU of raw rows: for tables far bigger than memory.

qwen4exp's n-gram table (per_layer_token_embd, ~95 GiB in BF16) is read 16 rows a token and never loaded. Rows
come from the file by positioned reads (pread into the caller's buffer), not through the model's memory map: pages
touched through a map count in the process's RSS until the kernel drops them, positioned reads leave them in the
page cache only, so RSS stays the slab's size whatever the table's.

A call is vectorized (docs/experiments.md, "qwen4exp's prompt-pass host time": the per-row Python loop cost 3-5 us
a row): its distinct rows once (np.unique), the cached ones looked up at once (engine/row_index.py, a numba hash
table) and copied from the slab by one fancy index, the misses sorted and read one pread per run of adjacent rows
by a numba loop that holds no GIL (engine/row_read.py; a prompt chunk's misses split over a few threads), then
every row placed by one take.

Counts, per look-up: a row asked for in a call is a hit when the cache held it before the call or it came earlier
in the same call (a row asked for twice in one call is a miss, then a hit), so `lookups - hits` is the number of
rows read from the file. The LRU order is the order of last use, look-up by look-up; when the slab is full the
least recent rows go, in batches of at least EVICT_SHARE of the slab (one partial sort per batch instead of one a
call: a token's 16 rows would otherwise pay a sort of the whole slab). A call with more distinct rows than the
slab holds keeps its most recent ones. Thread-safe (one lock): the prompt pass gathers a chunk's rows ahead on a
worker thread while the decode path may ask for a token's.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from engine.quant_types import dequantize
from engine.row_index import RowIndex
from engine.row_read import read_rows

EVICT_SHARE = 1 / 64        # the least part of the slab one eviction frees
_FREE = np.iinfo(np.int64).max   # a free slot's use stamp: never the least recent


class RowCache:
    def __init__(self, tensor, capacity_bytes: int):
        """tensor: an engine.gguf_model.TensorInfo (its file, offset, row bytes and quant type)."""
        self._fd = -1
        if tensor.fused_from or len(tensor.shape) != 2:
            raise ValueError(f"{tensor.name}: a row cache reads whole rows of a plain matrix")
        self.tensor = tensor
        self.n_rows, self.width = tensor.shape
        self.row_bytes = int(tensor.data.shape[-1])
        self.capacity = max(1, int(capacity_bytes) // self.row_bytes)
        self._slab = np.empty((self.capacity, self.row_bytes), np.uint8)
        self._index = RowIndex(self.capacity)                       # row -> slab slot
        self._row = np.full(self.capacity, -1, np.int64)            # slot -> row (-1: free)
        self._used = np.full(self.capacity, _FREE, np.int64)   # slot -> last use (free: max)
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)   # free slots: a stack of n_free
        self.n_free = self.capacity
        self._clock = 0                                             # look-ups so far: the use stamps' time
        self._lock = threading.Lock()
        self._fd = os.open(tensor.path, os.O_RDONLY)
        self.hits = 0
        self.lookups = 0
        read_rows(self._fd, 0, self.row_bytes, np.zeros(0, np.int64), np.zeros(0, np.int64),
                  self._slab[:0])     # compiled now, not at the first prompt

    @property
    def nbytes(self) -> int:
        return self._slab.nbytes

    def reset_counts(self) -> None:
        self.hits = self.lookups = 0

    def count(self, lookups: int, hits: int) -> None:
        """Add a gather()'s counts (the prompt pass counts a chunk gathered ahead once it is used)."""
        self.lookups += int(lookups)
        self.hits += int(hits)

    def raw(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The raw bytes of rows ids (any shape of ints): uint8 (*ids.shape, row_bytes), into out when given (any
        C-contiguous uint8 array of that many bytes, e.g. a pinned buffer's view; returned reshaped)."""
        ids = np.asarray(ids)
        got, hits = self.gather(ids, out)
        self.count(ids.size, hits)
        return got

    def gather(self, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """raw() without counting: (the rows, how many of the look-ups were hits)."""
        ids = np.asarray(ids)
        flat = ids.reshape(-1).astype(np.int64, copy=False)
        n = len(flat)
        if n and (flat.min() < 0 or flat.max() >= self.n_rows):
            bad = flat[(flat < 0) | (flat >= self.n_rows)][0]
            raise IndexError(f"row {bad} of {self.tensor.name}, which has {self.n_rows}")
        if out is None:
            out = np.empty((n, self.row_bytes), np.uint8)
        elif out.dtype != np.uint8 or not out.flags.c_contiguous or out.size != n * self.row_bytes:
            raise ValueError(f"out: a C-contiguous uint8 array of {n * self.row_bytes} bytes for {n} rows, got "
                             f"{out.dtype} {out.shape}")
        rows_out = out.reshape(n, self.row_bytes)
        if n == 0:
            return out.reshape(*ids.shape, self.row_bytes), 0
        # distinct rows, each one's last look-up (the LRU's order) and where each look-up's row sits among them
        u, last_rev, inv_rev = np.unique(flat[::-1], return_index=True, return_inverse=True)
        last = (n - 1 - last_rev).astype(np.int64)
        inv = inv_rev.reshape(-1)[::-1]
        with self._lock:
            slots = self._index.lookup(u)
            held = slots >= 0
            miss = np.flatnonzero(~held)
            data = np.empty((len(u), self.row_bytes), np.uint8)
            data[held] = self._slab[slots[held]]
            if len(miss):
                self._read(u[miss], data, miss)
            self._keep(u, last, slots, held, miss, data)
            self._clock += n
        np.take(data, inv, axis=0, out=rows_out)
        return out.reshape(*ids.shape, self.row_bytes), n - len(miss)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ids dequantized: float32 (*ids.shape, width)."""
        ids = np.asarray(ids)
        raw = self.raw(ids.reshape(-1))
        return dequantize(raw, self.tensor.qtype).reshape(*ids.shape, self.width)

    def _keep(self, u, last, slots, held, miss, data) -> None:
        """The slab after a call: its rows' use stamps, its misses put in slots (the least recent rows evicted)."""
        stamp = self._clock + last
        self._used[slots[held]] = stamp[held]
        if len(u) > self.capacity:        # more distinct rows than the slab holds: its most recent ones only
            keep = np.zeros(len(u), bool)
            keep[np.argpartition(stamp, len(u) - self.capacity)[len(u) - self.capacity:]] = True
            self._drop(slots[held & ~keep])
            miss, n_held = miss[keep[miss]], int((held & keep).sum())
        else:
            n_held = int(held.sum())
        k = len(miss)
        if k > self.n_free:
            # evict the least recent (this call's hits are the most recent: never among them while it fits)
            evictable = self.capacity - self.n_free - n_held
            e = min(evictable, max(k - self.n_free, int(self.capacity * EVICT_SHARE)))
            if e > 0:
                self._drop(np.argpartition(self._used, e - 1)[:e] if e < self.capacity else np.arange(self.capacity))
        self.n_free -= k
        to = self._free[self.n_free:self.n_free + k].copy()
        rows = u[miss]
        self._slab[to] = data[miss]
        self._row[to] = rows
        self._used[to] = stamp[miss]
        self._index.insert(rows, to)

    def _drop(self, slots: np.ndarray) -> None:
        """Free these occupied slots."""
        self._index.delete(self._row[slots])
        self._row[slots] = -1
        self._used[slots] = _FREE
        self._free[self.n_free:self.n_free + len(slots)] = slots
        self.n_free += len(slots)

    def _read(self, rows: np.ndarray, dst: np.ndarray, at: np.ndarray) -> None:
        """dst[at[i]] = row rows[i] from the file (rows sorted, distinct)."""
        bad = read_rows(self._fd, self.tensor.offset, self.row_bytes, rows, at, dst)
        if bad >= 0:
            row = int(rows[bad])
            at_byte = self.tensor.offset + row * self.row_bytes
            raise OSError(f"{self.tensor.path}: a read of row {row} of {self.tensor.name} at byte {at_byte:,} "
                          f"came back short; the file was cut short after it was opened")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()
