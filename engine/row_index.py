"""Table row -> slab slot for engine/row_cache.py: an open-addressing hash table in numba, a call's rows at once.

The row cache looked its rows up in a dict, one Python call a row under the GIL (~0.5 us: 30 ms of a 4K chunk's
65,536 rows, and the prompt pass's worker held the GIL from the thread that enqueues the layers all that time). Here
a call's rows are looked up, put in and taken out by numba loops that hold no GIL: linear probing over a power-of-two
table at most half full, deleted keys left as tombstones until they fill a quarter of it, then rebuilt in place.
Without numba the same class runs on a dict.
"""
from __future__ import annotations

import numpy as np

try:
    from numba import njit
except ImportError:
    njit = None

EMPTY, TOMB = -1, -2
_MUL = np.uint64(0x9E3779B97F4A7C15)        # Fibonacci hashing: the top bits of row * 2^64 / phi


if njit is not None:
    @njit(nogil=True, cache=True)
    def _home(row, shift):
        return np.int64((np.uint64(row) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(shift))

    @njit(nogil=True, cache=True)
    def _lookup(keys, vals, shift, rows, out):
        mask = len(keys) - 1
        for i in range(len(rows)):
            r = rows[i]
            j = _home(r, shift)
            out[i] = -1
            while True:
                k = keys[j]
                if k == r:
                    out[i] = vals[j]
                    break
                if k == -1:
                    break
                j = (j + 1) & mask

    @njit(nogil=True, cache=True)
    def _insert(keys, vals, shift, rows, slots):
        """Put rows (not held) with their slots; returns the tombstones reused."""
        mask = len(keys) - 1
        reused = 0
        for i in range(len(rows)):
            j = _home(rows[i], shift)
            while keys[j] >= 0:
                j = (j + 1) & mask
            reused += keys[j] == -2
            keys[j] = rows[i]
            vals[j] = slots[i]
        return reused

    @njit(nogil=True, cache=True)
    def _delete(keys, shift, rows):
        """Take rows (all held) out, leaving tombstones."""
        mask = len(keys) - 1
        for i in range(len(rows)):
            r = rows[i]
            j = _home(r, shift)
            while keys[j] != r:
                j = (j + 1) & mask
            keys[j] = -2


class RowIndex:
    """row (int64 >= 0) -> slot (int64 >= 0) for up to `capacity` rows."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        size = 1
        while size < 2 * max(1, self.capacity):
            size *= 2
        self._shift = 64 - (size.bit_length() - 1)
        self.size = size
        self._dict: dict[int, int] | None = None if njit is not None else {}
        self._keys = np.full(size, EMPTY, np.int64)
        self._vals = np.zeros(size, np.int64)
        self.n = 0              # rows held
        self._tombs = 0
        if self._dict is None:      # compiled (or loaded from numba's cache) now, not at the first prompt
            none = np.zeros(0, np.int64)
            _lookup(self._keys, self._vals, self._shift, none, none.copy())
            _insert(self._keys, self._vals, self._shift, none, none)
            _delete(self._keys, self._shift, none)

    def __len__(self) -> int:
        return self.n

    def lookup(self, rows: np.ndarray) -> np.ndarray:
        """Each row's slot, -1 where not held."""
        rows = np.ascontiguousarray(rows, np.int64)
        if self._dict is not None:
            get = self._dict.get
            return np.fromiter((get(r, -1) for r in rows.tolist()), np.int64, len(rows))
        out = np.empty(len(rows), np.int64)
        _lookup(self._keys, self._vals, self._shift, rows, out)
        return out

    def insert(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Put rows (distinct, none held) at slots."""
        rows, slots = np.ascontiguousarray(rows, np.int64), np.ascontiguousarray(slots, np.int64)
        if self.n + len(rows) > self.capacity:
            raise ValueError(f"{self.n} + {len(rows)} rows in an index of {self.capacity}")
        self.n += len(rows)
        if self._dict is not None:
            self._dict.update(zip(rows.tolist(), slots.tolist()))
            return
        self._tombs -= int(_insert(self._keys, self._vals, self._shift, rows, slots))

    def delete(self, rows: np.ndarray) -> None:
        """Take rows (distinct, all held) out."""
        rows = np.ascontiguousarray(rows, np.int64)
        self.n -= len(rows)
        if self._dict is not None:
            pop = self._dict.pop
            for r in rows.tolist():
                pop(r)
            return
        _delete(self._keys, self._shift, rows)
        self._tombs += len(rows)
        if self._tombs > self.size // 4:        # probes would lengthen: the live keys again, no tombstones
            live = self._keys >= 0
            rows, slots = self._keys[live], self._vals[live]
            self._keys.fill(EMPTY)
            self._tombs = 0
            _insert(self._keys, self._vals, self._shift, rows, slots)

    def items(self) -> dict[int, int]:
        """Every held row and its slot (for tests)."""
        if self._dict is not None:
            return dict(self._dict)
        live = self._keys >= 0
        return dict(zip(self._keys[live].tolist(), self._vals[live].tolist()))
