"""A prompt chunk's table rows hashed and gathered on a worker thread while the chunk before runs (issue 35 item 4).

qwen4exp's prompt pass needs a chunk's n-gram rows (16 a token) before its PLE layer; read when the chunk starts they
hold the host for ~50-150 ms a 4K chunk even vectorized (docs/experiments.md, "qwen4exp's prompt-pass host time").
RowsAhead gathers the raw rows of the chunk that comes next (ahead()) into one of two host buffers (pinned where the
CUDA pass uploads from them) while the GPU runs this one; take() hands them over when they are the rows asked for (the same
tokens after the same context), else gathers now. Either way the bytes are RowCache's for the same ids, so what the
pass computes does not change. A buffer is written again only after its fence (the consumer's upload finished).

Counts: a chunk's look-ups and hits go into the RowCache when its rows are taken; rows gathered for a chunk that
never came (the prompt was cut, the context moved) are not counted, though the LRU keeps them.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.row_cache import RowCache


@dataclass
class Gathered:
    """One chunk's rows: raw (rows, row_bytes) uint8 in buffer `buffer` (valid until its fence is set and the next
    gather there), the context ids after the chunk, the look-ups and hits, the seconds the gather took and the
    seconds take() waited for it; ahead: gathered on the worker before it was asked for."""
    raw: np.ndarray
    after: np.ndarray
    lookups: int
    hits: int
    buffer: int
    gather_s: float
    wait_s: float = 0.0
    ahead: bool = False


def _key(tokens: np.ndarray, before: np.ndarray) -> tuple[bytes, bytes]:
    return tokens.tobytes(), before.tobytes()


class RowsAhead:
    """ids_of(tokens, before) -> (row ids (T, heads) int64, the context after): the family's hash. alloc(nbytes) ->
    a uint8 host buffer (cupyx.empty_pinned for the CUDA pass; np.empty by default)."""

    def __init__(self, rows: RowCache, ids_of: Callable, alloc: Callable | None = None, buffers: int = 2):
        if buffers < 2:
            raise ValueError("rows ahead need two buffers at least: one being uploaded, one being written")
        self.rows, self.ids_of = rows, ids_of
        self.alloc = alloc or (lambda n: np.empty(n, np.uint8))
        self._bufs: list[np.ndarray | None] = [None] * buffers
        self._fence: list[Callable | None] = [None] * buffers
        self._next = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rows-ahead")
        self._pending: tuple[tuple[bytes, bytes], Future] | None = None
        self.taken_ahead = self.taken_now = 0      # chunks served from a gather ahead / gathered when asked

    def ahead(self, tokens, before) -> None:
        """Start gathering the rows of the chunk `tokens` that follows context `before` (a gather ahead not yet taken
        is dropped first)."""
        tokens, before = np.asarray(tokens, np.int64).reshape(-1), np.asarray(before, np.int64).reshape(-1)
        self._drop()
        i = self._turn()
        self._pending = (_key(tokens, before), self._pool.submit(self._gather, tokens, before, i))

    def take(self, tokens, before) -> Gathered:
        """The rows of chunk `tokens` after context `before`: the gather ahead when it was for them, else now."""
        tokens, before = np.asarray(tokens, np.int64).reshape(-1), np.asarray(before, np.int64).reshape(-1)
        if self._pending is not None and self._pending[0] == _key(tokens, before):
            fut = self._pending[1]
            self._pending = None
            t0 = time.perf_counter()
            g = fut.result()
            g.wait_s, g.ahead = time.perf_counter() - t0, True
            self.taken_ahead += 1
            return g
        self._drop()
        g = self._gather(tokens, before, self._turn())
        self.taken_now += 1
        return g

    def fence(self, g: Gathered, done: Callable) -> None:
        """done() returns once g's buffer may be written again (e.g. its upload's CUDA event synchronize)."""
        self._fence[g.buffer] = done

    def _turn(self) -> int:
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        return i

    def _drop(self) -> None:
        """Wait for a gather ahead that will not be taken (it writes a buffer) and forget it; its error, if any, is
        about rows nobody asked for."""
        if self._pending is not None:
            fut = self._pending[1]
            self._pending = None
            fut.exception()

    def _gather(self, tokens: np.ndarray, before: np.ndarray, i: int) -> Gathered:
        t0 = time.perf_counter()
        ids, after = self.ids_of(tokens, before)
        n, rb = ids.size, self.rows.row_bytes
        if self._fence[i] is not None:
            self._fence[i]()
            self._fence[i] = None
        buf = self._bufs[i]
        if buf is None or buf.size < n * rb:
            buf = self._bufs[i] = None        # let the old one go before the bigger one is taken
            buf = self._bufs[i] = self.alloc(n * rb)
        raw, hits = self.rows.gather(ids.reshape(-1), buf[:n * rb])
        return Gathered(raw, np.asarray(after, np.int64), n, hits, i, time.perf_counter() - t0)

    def close(self) -> None:
        self._drop()
        self._pool.shutdown(wait=True)
        self._bufs = [None] * len(self._bufs)
