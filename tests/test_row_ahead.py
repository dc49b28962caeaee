"""engine/row_ahead.py: a chunk's rows gathered ahead on a worker are the rows gathered when asked, byte for byte;
the counts are the taken chunks'; a buffer is written again only after its fence."""
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.arch import qwen4exp as ref
from engine.gguf_model import open_model
from engine.quant_types import dequantize
from engine.row_ahead import RowsAhead
from engine.row_cache import RowCache
from tests.test_row_cache import table

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "qwen4exp" / "tiny-qwen4exp-iq2_xs.gguf"
HEADS = 16


def ids_of(n_rows):
    """A stand-in hash: each token's HEADS rows, dependent on the context ids before it (as the n-gram hash is)."""
    def f(tokens, before):
        hist = np.concatenate([before, tokens])
        ctx = hist[len(before):] * 7 + hist[len(before) - 1:-1] * 3
        ids = (ctx[:, None] * 31 + np.arange(HEADS)) % n_rows
        return ids.astype(np.int64), hist[-len(before):]
    return f


@pytest.mark.parametrize("capacity", [1, 3, 500, 1 << 20])
def test_rows_ahead_are_the_rows_asked_for(tmp_path, capacity):
    t = table(tmp_path, Q.Q4_0, 997, 64, seed=capacity)
    want = np.asarray(t.data)
    rows = RowCache(t, capacity * t.data.shape[1])
    f = ids_of(997)
    ahead = RowsAhead(rows, f)
    rng = np.random.default_rng(capacity)
    chunks = [rng.integers(0, 50_000, int(rng.integers(1, 300))) for _ in range(6)]
    chunks += [np.full(40, 5), chunks[0], chunks[0]]        # duplicates; the same chunk again (all hits, if held)
    before, looked = np.array([2, 2]), 0
    try:
        for i, c in enumerate(chunks):
            g = ahead.take(c, before)
            ids, after = f(c, before)
            assert g.ahead == (i > 0)
            np.testing.assert_array_equal(g.raw, want[ids.reshape(-1)])
            np.testing.assert_array_equal(g.after, after)
            rows.count(g.lookups, g.hits)
            looked += ids.size
            assert rows.lookups == looked
            before = g.after
            if i + 1 < len(chunks):
                ahead.ahead(chunks[i + 1], before)
        assert ahead.taken_ahead == len(chunks) - 1 and ahead.taken_now == 1
    finally:
        ahead.close()
        rows.close()


def test_a_chunk_not_named_ahead_is_gathered_when_asked(tmp_path):
    t = table(tmp_path, Q.F16, 300, 32)
    rows = RowCache(t, 1 << 20)
    f = ids_of(300)
    ahead = RowsAhead(rows, f)
    try:
        ahead.ahead(np.arange(10), np.array([1, 1]))
        for tokens, before in ((np.arange(10), np.array([1, 2])), (np.arange(11), np.array([1, 1]))):
            g = ahead.take(tokens, before)      # another context, then other tokens: not the gather ahead
            assert not g.ahead
            np.testing.assert_array_equal(g.raw, np.asarray(t.data)[f(tokens, before)[0].reshape(-1)])
        assert (ahead.taken_ahead, ahead.taken_now) == (0, 2)
        assert rows.lookups == 0        # counted by the caller (RowCache.count) once used
    finally:
        ahead.close()


def test_a_buffer_is_written_again_only_after_its_fence(tmp_path):
    t = table(tmp_path, Q.F16, 300, 32)
    rows = RowCache(t, 1 << 20)
    ahead = RowsAhead(rows, ids_of(300))
    log = []
    try:
        gs = []
        for k in range(5):
            g = ahead.take(np.arange(k, k + 20), np.array([0, 0]))
            assert [x.buffer for x in gs[-1:]] != [g.buffer]        # two buffers in turn
            raw = g.raw.copy()
            ahead.fence(g, lambda k=k, raw=raw, g=g: log.append((k, np.array_equal(g.raw, raw))))
            gs.append(g)
        # each fence ran before its buffer's next gather, the rows untouched until then
        assert log == [(k, True) for k in range(3)]
    finally:
        ahead.close()


def test_the_family_hash_through_rows_ahead_gives_the_references_rows():
    """The qwen4exp fixture's n-gram rows chunk by chunk through RowsAhead (with ple_ids, the family's hash),
    dequantized: the reference's embedding of the whole sequence."""
    pytest.importorskip("cupy")
    from engine.cuda.families.qwen4exp import ple_ids
    model = open_model(FIXTURE)
    p = model.config.family_params
    rows = RowCache(model.tensor(ref.PLE_TABLE), 1 << 12)
    ahead = RowsAhead(rows, lambda tk, bf: ple_ids(p, tk, bf))
    try:
        toks = np.array([650, 730, p.ple_eos, p.ple_eos, 741, 205, 315, p.ple_eos, 42, 583, 38, 650, 730], np.int64)
        start = np.full(p.ngram_size - 1, p.ple_eos, np.int64)
        ids = ref.ple_row_ids(ref.ple_context(toks, start, p.ple_eos), p.multipliers, p.head_sizes, p.head_offsets,
                              p.heads_per_ngram)
        want = model.dequant(ref.PLE_TABLE)[ids].reshape(len(toks), -1)
        cuts = [(0, 3), (3, 4), (4, 9), (9, 13)]
        got, before = [], start
        for j, (a, b) in enumerate(cuts):
            g = ahead.take(toks[a:b], before)
            got.append(dequantize(g.raw, rows.tensor.qtype).reshape(b - a, -1))
            before = g.after
            if j + 1 < len(cuts):
                ahead.ahead(toks[cuts[j + 1][0]:cuts[j + 1][1]], before)
        np.testing.assert_array_equal(np.concatenate(got), want.astype(np.float32))
    finally:
        ahead.close()
        rows.close()
