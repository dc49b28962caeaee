"""engine/row_cache.py: rows of a GGUF matrix by positioned reads through a bounded LRU, counted per look-up."""
from __future__ import annotations

from collections import OrderedDict

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.gguf_model import TensorInfo, dequantize, read_header
from engine.row_cache import EVICT_SHARE, RowCache
from tools.make_moe import random_rows


def table(tmp_path, qtype: Q, n_rows: int, width: int, seed: int = 0) -> TensorInfo:
    """A file with one matrix of random rows of qtype after another tensor (so its offset is not the data start)."""
    rng = np.random.default_rng(seed)
    raw = random_rows(rng, qtype, n_rows, width, 0.1)
    path = tmp_path / f"t-{qtype.name}.gguf"
    w = gguf.GGUFWriter(str(path), "x")
    w.add_tensor("pad", np.arange(40, dtype=np.float32))
    w.add_tensor("rows", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    h = read_header(path)
    t = next(t for t in h.tensors if t.name == "rows")
    data = np.memmap(path, np.uint8, mode="r")[h.data_offset + t.offset:][:raw.nbytes].reshape(raw.shape)
    return TensorInfo("rows", qtype, (n_rows, width), data, path, h.data_offset + t.offset)


@pytest.mark.parametrize("qtype,width", [(Q.F32, 16), (Q.BF16, 160), (Q.F16, 48), (Q.Q8_0, 160), (Q.Q4_0, 64)])
def test_rows_equal_the_mapped_rows_dequantized(tmp_path, qtype, width):
    t = table(tmp_path, qtype, 300, width, seed=width)
    cache = RowCache(t, 64 * t.data.shape[1])
    ids = np.random.default_rng(1).integers(0, 300, (7, 16))
    got = cache.rows(ids)
    assert got.shape == (7, 16, width) and got.dtype == np.float32
    np.testing.assert_array_equal(got, dequantize(np.asarray(t.data)[ids.reshape(-1)], qtype).reshape(7, 16, width))


def test_hits_and_lookups_are_counted_per_look_up(tmp_path):
    cache = RowCache(table(tmp_path, Q.F16, 50, 32), 1 << 20)
    cache.raw(np.array([3, 4, 3]))            # 3 misses, then a hit
    assert (cache.lookups, cache.hits) == (3, 1)
    cache.raw(np.array([4, 5]))
    assert (cache.lookups, cache.hits) == (5, 2)
    cache.reset_counts()
    assert (cache.lookups, cache.hits) == (0, 0)


def test_the_cache_holds_its_bound_and_drops_the_least_recent(tmp_path):
    t = table(tmp_path, Q.F32, 100, 16)
    cache = RowCache(t, 4 * t.data.shape[1])   # four rows
    assert cache.capacity == 4 and cache.nbytes == 4 * 64
    cache.raw(np.array([0, 1, 2, 3]))
    cache.raw(np.array([0]))                   # 0 is now the most recent
    cache.raw(np.array([4]))                   # evicts 1
    cache.reset_counts()
    cache.raw(np.array([0, 2, 3, 4]))
    assert cache.hits == 4
    cache.raw(np.array([1]))
    assert cache.hits == 4
    # more distinct rows in one call than the cache holds: each still comes back right
    ids = np.arange(30)
    np.testing.assert_array_equal(cache.raw(ids), np.asarray(t.data)[ids])


def test_a_row_outside_the_table_is_refused(tmp_path):
    cache = RowCache(table(tmp_path, Q.F16, 10, 32), 1 << 16)
    with pytest.raises(IndexError, match="row 10 of rows, which has 10"):
        cache.rows(np.array([1, 10]))
    with pytest.raises(IndexError, match="row -1"):
        cache.rows(np.array([-1]))


def test_a_file_cut_after_opening_gives_a_clear_error(tmp_path):
    t = table(tmp_path, Q.F16, 10, 32)
    cache = RowCache(t, 1 << 16)
    with open(t.path, "r+b") as f:
        f.truncate(t.offset + 3 * t.data.shape[1])
    with pytest.raises(OSError, match="cut short"):
        cache.raw(np.array([5]))


class LruModel:
    """The counting and LRU rule the module docstring gives, one look-up at a time in plain Python: a look-up hits
    when its row was held before the call or came earlier in it; after the call its distinct rows are the most
    recent in the order of their last look-up and the least recent rows beyond the capacity go."""

    def __init__(self, capacity: int):
        self.capacity, self.order, self.hits, self.lookups = capacity, OrderedDict(), 0, 0

    def call(self, ids) -> None:
        seen = set()
        for r in ids:
            self.hits += r in self.order or r in seen
            seen.add(r)
        self.lookups += len(ids)
        last = {r: i for i, r in enumerate(ids)}
        for r in sorted(last, key=last.get):
            self.order.pop(r, None)
            self.order[r] = True
        while len(self.order) > self.capacity:
            self.order.popitem(last=False)


@pytest.mark.parametrize("capacity", [1, 2, 7, 63])
def test_calls_agree_with_the_lru_rule_and_the_file(tmp_path, capacity):
    """Random calls (duplicates, all-miss, all-hit, more distinct rows than the slab): the rows are the file's, the
    counts and the held rows the rule's (capacities below 1 / EVICT_SHARE evict exactly the least recent)."""
    t = table(tmp_path, Q.Q4_0, 400, 64, seed=capacity)
    want = np.asarray(t.data)
    cache, model = RowCache(t, capacity * t.data.shape[1]), LruModel(capacity)
    assert cache.capacity == capacity and capacity < 1 / EVICT_SHARE
    rng = np.random.default_rng(capacity)
    calls = [rng.integers(0, 400, int(rng.integers(0, 40))) for _ in range(60)]
    calls += [np.arange(400), np.arange(400)[::-1], np.full(9, 17), np.array([17, 17, 3, 17])]
    for ids in calls:
        got = cache.raw(ids)
        model.call(ids.tolist())
        np.testing.assert_array_equal(got, want[ids])
        assert (cache.lookups, cache.hits) == (model.lookups, model.hits)
        assert set(cache._index.items()) == set(model.order)
    held = np.array(list(model.order))
    before = cache.hits
    cache.raw(held)
    assert cache.hits - before == len(held)                                  # all hits


def test_a_full_slab_evicts_in_batches_and_stays_right(tmp_path):
    """A slab of 1 / EVICT_SHARE rows or more frees at least that share at once: the rows still come back right,
    a look-up of a held row is a hit, and the slab never holds more than its capacity."""
    t = table(tmp_path, Q.F16, 3000, 32)
    want = np.asarray(t.data)
    cache = RowCache(t, 1000 * t.data.shape[1])
    rng = np.random.default_rng(3)
    for _ in range(200):
        ids = rng.integers(0, 3000, int(rng.integers(1, 50)))
        held = np.isin(ids, np.array(list(cache._index.items()), np.int64))
        h0 = cache.hits
        np.testing.assert_array_equal(cache.raw(ids), want[ids])
        first = np.zeros(len(ids), bool)
        first[np.unique(ids, return_index=True)[1]] = True
        assert cache.hits - h0 == len(ids) - int((first & ~held).sum())
        slots = cache._index.items()
        assert len(slots) == len(cache._index) <= cache.capacity
        assert len(slots) + cache.n_free == cache.capacity
        assert all(cache._row[s] == r for r, s in slots.items())


def test_rows_go_into_a_given_buffer_and_uncounted_gathers_count_later(tmp_path):
    t = table(tmp_path, Q.BF16, 200, 160)
    cache = RowCache(t, 1 << 20)
    ids = np.array([[5, 6, 5], [199, 0, 6]])
    out = np.full(ids.size * t.data.shape[1], 7, np.uint8)
    got, hits = cache.gather(ids, out)
    assert got.shape == (2, 3, t.data.shape[1]) and np.shares_memory(got, out) and hits == 2
    np.testing.assert_array_equal(got, np.asarray(t.data)[ids])
    assert (cache.lookups, cache.hits) == (0, 0)
    cache.count(ids.size, hits)
    assert (cache.lookups, cache.hits) == (6, 2)
    with pytest.raises(ValueError, match="C-contiguous uint8 array of 1920 bytes"):
        cache.raw(ids, np.empty(5, np.uint8))


def test_reads_split_over_threads_give_the_same_rows(tmp_path, monkeypatch):
    from engine import row_read
    t = table(tmp_path, Q.Q8_0, 5000, 32)
    ids = np.random.default_rng(4).permutation(5000)[:3000]
    whole = RowCache(t, 1 << 20).raw(ids)
    monkeypatch.setattr(row_read, "SPLIT_ROWS", 50)
    monkeypatch.setattr(row_read, "_threads", lambda: 3)
    np.testing.assert_array_equal(RowCache(t, 1 << 20).raw(ids), whole)
    np.testing.assert_array_equal(whole, np.asarray(t.data)[ids])


def test_the_python_read_loop_reads_the_same(tmp_path, monkeypatch):
    """Without numba the reads are an os.preadv loop: the same bytes, and a cut file still says so."""
    from engine import row_read
    t = table(tmp_path, Q.F16, 300, 48)
    monkeypatch.setattr(row_read, "njit", None)
    ids = np.array([3, 4, 5, 9, 299, 4, 0])
    np.testing.assert_array_equal(RowCache(t, 1 << 20).raw(ids), np.asarray(t.data)[ids])
    cache = RowCache(t, 1 << 16)
    with open(t.path, "r+b") as f:
        f.truncate(t.offset + 3 * t.data.shape[1])
    with pytest.raises(OSError, match="cut short"):
        cache.raw(np.array([5]))
