"""Positioned reads of many runs of rows from one file, without the GIL (engine/row_cache.py's misses).

A numba loop calls libc's pread once per run of adjacent rows: ~0.5 us a row of 90 bytes from the page cache on
the 2-core dev box, against ~1.2 us for os.preadv from a Python loop and ~4 us for the row cache's old per-row path
(docs/experiments.md, "qwen4exp's prompt-pass host time"). Calls of many rows are split over a few threads (a
prompt chunk's 65,536 rows; a decode token's 16 stay on the caller's thread). Without numba (the CPU backend's
requirement, so normally present) the same reads run as an os.preadv loop.
"""
from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

SPLIT_ROWS = 8192           # rows a thread takes at least before a call is split
MAX_THREADS = 4

try:
    from numba import njit
except ImportError:          # the os.preadv loop below
    njit = None

_pool: ThreadPoolExecutor | None = None
_THREADS = max(1, min(MAX_THREADS, os.cpu_count() or 1))


def _threads() -> int:
    return _THREADS


if njit is not None:
    _libc = ctypes.CDLL(None, use_errno=True)
    _pread = _libc.pread
    _pread.restype = ctypes.c_ssize_t
    _pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]

    @njit(nogil=True, cache=False)      # not cached: the libc pointer is baked in
    def _read_nb(fd, base, row_bytes, rows, at, dst, lo, hi):
        j = lo
        while j < hi:
            n = 1
            while j + n < hi and rows[j + n] == rows[j] + n and at[j + n] == at[j] + n:
                n += 1
            got = _pread(fd, dst[at[j]:].ctypes.data, n * row_bytes, base + rows[j] * row_bytes)
            if got != n * row_bytes:
                return j
            j += n
        return -1


def _read_py(fd, base, row_bytes, rows, at, dst, lo, hi) -> int:
    flat = memoryview(dst.reshape(-1))
    rows, at = rows.tolist(), at.tolist()
    j = lo
    while j < hi:
        n = 1
        while j + n < hi and rows[j + n] == rows[j] + n and at[j + n] == at[j] + n:
            n += 1
        o = at[j] * row_bytes
        if os.preadv(fd, [flat[o:o + n * row_bytes]], base + rows[j] * row_bytes) != n * row_bytes:
            return j
        j += n
    return -1


def read_rows(fd: int, base: int, row_bytes: int, rows: np.ndarray, at: np.ndarray, dst: np.ndarray) -> int:
    """dst[at[i]] = row rows[i] of the table at byte `base` of file fd (rows ascending and distinct; dst C-contiguous
    uint8 (n, row_bytes)), one pread per run of rows adjacent in both. Returns the index of the first row whose
    read came back short (the file was cut), else -1."""
    global _pool
    if not dst.flags.c_contiguous or dst.dtype != np.uint8 or dst.ndim != 2 or dst.shape[1] != row_bytes:
        raise ValueError(f"dst: C-contiguous uint8 rows of {row_bytes} bytes, got {dst.dtype} {dst.shape}")
    rows, at = np.ascontiguousarray(rows, np.int64), np.ascontiguousarray(at, np.int64)
    n = len(rows)
    if n and (int(at.min()) < 0 or int(at.max()) >= dst.shape[0]):
        raise ValueError(f"rows placed outside dst's {dst.shape[0]}")
    fn = _read_nb if njit is not None else _read_py
    parts = min(_threads(), n // SPLIT_ROWS)
    if parts < 2:
        return int(fn(fd, base, row_bytes, rows, at, dst, 0, n))
    if _pool is None:
        _pool = ThreadPoolExecutor(_threads(), thread_name_prefix="row-read")
    cut = np.linspace(0, n, parts + 1).astype(int)
    bad = [f.result() for f in [_pool.submit(fn, fd, base, row_bytes, rows, at, dst, int(a), int(b))
                                for a, b in zip(cut[:-1], cut[1:])]]
    return min((int(b) for b in bad if b >= 0), default=-1)
