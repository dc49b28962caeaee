"""Positioned reads of many runs of rows from one file, without the GIL (engine/row_cache.py's misses).

A numba loop calls libc's pread once per run: ~0.5 us a row of 90 bytes from the page cache on the 2-core dev box,
against ~1.2 us for os.preadv from a Python loop and ~4 us for the row cache's old per-row path
(docs/experiments.md, "The PLE row gather, vectorized"). Calls of many runs are split over a few threads (a
prompt chunk's 65,536 rows; a decode token's 16 stay on the caller's thread). Without numba (the CPU backend's
requirement, so normally present) the same reads run as an os.preadv loop.
"""
from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

SPLIT_RUNS = 8192           # runs a thread takes at least before a call is split
MAX_THREADS = 4

try:
    from numba import njit
except ImportError:          # the os.preadv loop below
    njit = None

_pool: ThreadPoolExecutor | None = None


def _threads() -> int:
    return max(1, min(MAX_THREADS, os.cpu_count() or 1))


if njit is not None:
    _libc = ctypes.CDLL(None, use_errno=True)
    _pread = _libc.pread
    _pread.restype = ctypes.c_ssize_t
    _pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]

    @njit(nogil=True, cache=False)
    def _read_runs_nb(fd, base, row_bytes, first, lens, dst, at, lo, hi):
        for j in range(lo, hi):
            n = lens[j] * row_bytes
            got = _pread(fd, dst[at[j]:].ctypes.data, n, base + first[j] * row_bytes)
            if got != n:
                return j
        return -1


def _read_runs_py(fd, base, row_bytes, first, lens, dst, at, lo, hi) -> int:
    flat = memoryview(dst.reshape(-1))
    for j in range(lo, hi):
        n = int(lens[j]) * row_bytes
        o = int(at[j]) * row_bytes
        if os.preadv(fd, [flat[o:o + n]], base + int(first[j]) * row_bytes) != n:
            return j
    return -1


def read_runs(fd: int, base: int, row_bytes: int, first: np.ndarray, lens: np.ndarray, dst: np.ndarray,
              at: np.ndarray) -> int:
    """For each run j: rows first[j] .. first[j] + lens[j] - 1 of the table at byte `base` of file fd into
    dst[at[j] ..] (dst: C-contiguous uint8 (rows, row_bytes)). Returns the first run whose read came back short
    (the file was cut), else -1."""
    global _pool
    if not dst.flags.c_contiguous or dst.dtype != np.uint8 or dst.ndim != 2 or dst.shape[1] != row_bytes:
        raise ValueError(f"dst: C-contiguous uint8 rows of {row_bytes} bytes, got {dst.dtype} {dst.shape}")
    first, lens, at = (np.ascontiguousarray(a, np.int64) for a in (first, lens, at))
    if len(lens) and int((at + lens).max()) > dst.shape[0]:
        raise ValueError(f"runs past dst's {dst.shape[0]} rows")
    fn = _read_runs_nb if njit is not None else _read_runs_py
    n = len(first)
    parts = min(_threads(), n // SPLIT_RUNS)
    if parts < 2:
        return int(fn(fd, base, row_bytes, first, lens, dst, at, 0, n))
    if _pool is None:
        _pool = ThreadPoolExecutor(_threads(), thread_name_prefix="row-read")
    cut = np.linspace(0, n, parts + 1).astype(int)
    bad = [f.result() for f in [_pool.submit(fn, fd, base, row_bytes, first, lens, dst, at, int(a), int(b))
                                for a, b in zip(cut[:-1], cut[1:])]]
    return min((int(b) for b in bad if b >= 0), default=-1)
