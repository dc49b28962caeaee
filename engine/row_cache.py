"""Rows of a GGUF matrix read where they lie, through a bounded LRU of raw rows: for tables far bigger than memory.

qwen4exp's n-gram table (per_layer_token_embd, ~95 GiB in BF16) is read 16 rows a token and never loaded. Rows
come from the file by positioned reads (os.preadv into a slot of a preallocated slab), not through the model's
memory map: pages touched through a map count in the process's RSS until the kernel drops them, positioned reads
leave them in the page cache only, so RSS stays the slab's size whatever the table's. Hits and misses are counted
per look-up (a row asked for twice in one call is a miss, then a hit).
"""
from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

from engine.quant_types import dequantize


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
        self._slot: OrderedDict[int, int] = OrderedDict()     # row -> slab slot, least recently used first
        self._free = list(range(self.capacity - 1, -1, -1))
        self._fd = os.open(tensor.path, os.O_RDONLY)
        self.hits = 0
        self.lookups = 0

    @property
    def nbytes(self) -> int:
        return self._slab.nbytes

    def reset_counts(self) -> None:
        self.hits = self.lookups = 0

    def raw(self, ids: np.ndarray) -> np.ndarray:
        """The raw bytes of rows ids (any shape of ints): uint8 (*ids.shape, row_bytes)."""
        ids = np.asarray(ids)
        flat = ids.reshape(-1).astype(np.int64)
        if len(flat) and (flat.min() < 0 or flat.max() >= self.n_rows):
            bad = flat[(flat < 0) | (flat >= self.n_rows)][0]
            raise IndexError(f"row {bad} of {self.tensor.name}, which has {self.n_rows}")
        out = np.empty((len(flat), self.row_bytes), np.uint8)
        for i, row in enumerate(flat.tolist()):
            slot = self._slot.get(row)
            if slot is None:
                slot = self._free.pop() if self._free else self._slot.popitem(last=False)[1]
                self._read(row, self._slab[slot])
                self._slot[row] = slot
            else:
                self._slot.move_to_end(row)
                self.hits += 1
            out[i] = self._slab[slot]
        self.lookups += len(flat)
        return out.reshape(*ids.shape, self.row_bytes)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ids dequantized: float32 (*ids.shape, width)."""
        ids = np.asarray(ids)
        raw = self.raw(ids.reshape(-1))
        return dequantize(raw, self.tensor.qtype).reshape(*ids.shape, self.width)

    def _read(self, row: int, dst: np.ndarray) -> None:
        at = self.tensor.offset + row * self.row_bytes
        got = os.preadv(self._fd, [memoryview(dst)], at)
        if got != self.row_bytes:
            raise OSError(f"{self.tensor.path}: a read of row {row} of {self.tensor.name} at byte {at:,} returned "
                          f"{got} of {self.row_bytes} bytes; the file was cut short after it was opened")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()
