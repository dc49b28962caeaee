"""engine/row_index.py: the numba hash table (and its dict fallback) agree with a dict over random insertions,
deletions and look-ups, through tombstone rebuilds and at full capacity."""
import numpy as np
import pytest

from engine import row_index
from engine.row_index import RowIndex


@pytest.mark.parametrize("numba", [True, False])
@pytest.mark.parametrize("capacity", [1, 2, 5, 1000])
def test_the_index_agrees_with_a_dict(monkeypatch, numba, capacity):
    if not numba:
        monkeypatch.setattr(row_index, "njit", None)
    idx, want = RowIndex(capacity), {}
    rng = np.random.default_rng(capacity)
    for step in range(400):
        held = np.array(list(want), np.int64)
        if len(want) < capacity and rng.random() < 0.6:
            new = np.setdiff1d(rng.integers(0, 10 * capacity + 50, int(rng.integers(1, capacity + 1))), held)
            new = rng.permutation(new)[:capacity - len(want)]
            slots = rng.integers(0, 1 << 40, len(new))
            idx.insert(new, slots)
            want.update(zip(new.tolist(), slots.tolist()))
        elif len(want):
            gone = rng.permutation(held)[:int(rng.integers(1, len(held) + 1))]
            idx.delete(gone)
            for r in gone.tolist():
                del want[r]
        q = np.concatenate([held, rng.integers(0, 10 * capacity + 50, 20)])
        np.testing.assert_array_equal(idx.lookup(q), [want.get(r, -1) for r in q.tolist()])
        assert len(idx) == len(want) and idx.items() == want
    with pytest.raises(ValueError, match="rows in an index of"):
        idx.insert(np.arange(10**9, 10**9 + capacity + 1), np.zeros(capacity + 1, np.int64))


def test_large_rows_and_an_empty_call():
    idx = RowIndex(8)
    rows = np.array([0, 320_001_535, 2**40 + 3, 7], np.int64)
    idx.insert(rows, np.arange(4))
    np.testing.assert_array_equal(idx.lookup(np.array([7, 2**40 + 3, 1, 0])), [3, 2, -1, 0])
    assert idx.lookup(np.zeros(0, np.int64)).shape == (0,)
    idx.delete(np.zeros(0, np.int64))
    assert len(idx) == 4
