"""engine/row_cache.py: rows of a GGUF matrix by positioned reads through a bounded LRU, counted per look-up."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.gguf_model import TensorInfo, dequantize, read_header
from engine.row_cache import RowCache
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
