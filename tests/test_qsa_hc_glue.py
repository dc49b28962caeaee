"""The CPU side of engine/cuda/qsa.py and engine/cuda/hc.py: the unit lists the QSA tests hold the kernels to
(ref_units, units_mask) are the reference's selection (select_tokens), a NumPy model of qsa_select's radix select
gives them on tie-heavy scores, and the shapes read from the tiny fixture and refuse what the kernels are not built
for."""
from pathlib import Path

import numpy as np
import pytest

from engine.arch.qwen4exp import select_tokens
from engine.cuda.hc import HcShape
from engine.cuda.qsa import (QsaShape, cache_bytes, decode_splits, prompt_scratch_bytes, ref_units,
                             units_mask)

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "qwen4exp" / "tiny-qwen4exp-f16.gguf"


def stable_top(scores, p, r, nb_budget):
    """The definition (spec 4.6.8, transformers' order): the nb_budget best complete blocks, ties to the lower."""
    n_b = (p + 1) // r
    if n_b <= nb_budget:
        return list(range((p + r) // r))
    order = sorted(range(n_b), key=lambda b: (-float(scores[b]), b))[:nb_budget]
    return sorted(order) + ([n_b] if (p + 1) % r else [])


def radix_select(s, p, r, nb_budget):
    """qsa_select's algorithm in NumPy: the nb_budget-th largest key by 8 bits a pass from the top, then the keys
    above it and the first equals to it in block order, then the tail."""
    n_b = (p + 1) // r
    if n_b <= nb_budget:
        return list(range((p + r) // r))
    f = np.asarray(s[:n_b], np.float32)
    keys = np.where(f > 0, f.view(np.uint32), 0).astype(np.int64)
    prefix, mask, remaining = 0, 0, nb_budget
    for shift in (24, 16, 8, 0):
        cand = keys[(keys & mask) == prefix]
        c = np.bincount((cand >> shift) & 255, minlength=256)[::-1]       # thread i: digit 255 - i
        incl = np.cumsum(c)
        (i,) = np.nonzero((incl - c < remaining) & (remaining <= incl))[0]
        prefix |= (255 - int(i)) << shift
        remaining -= int(incl[i] - c[i])
        mask |= 255 << shift
    eq = np.nonzero(keys == prefix)[0][:remaining]
    out = sorted(np.nonzero(keys > prefix)[0].tolist() + eq.tolist())
    assert len(out) == nb_budget
    return out + ([n_b] if (p + 1) % r else [])


@pytest.mark.parametrize("kind", ["few-values", "continuous", "zeros-and-signed-zeros", "tiny"])
def test_units_are_the_references_selection(kind):
    rng = np.random.default_rng()
    for _ in range(60):
        r, nb_budget = int(rng.choice([2, 4, 8])), int(rng.integers(1, 30))
        n = int(rng.integers(1, 120))
        if kind == "few-values":
            s = rng.choice(np.array([0.5, 1.0, 1.5, 2.0], np.float32), n)
        elif kind == "continuous":
            s = (rng.standard_normal(n) ** 2).astype(np.float32)
        elif kind == "zeros-and-signed-zeros":
            s = rng.choice(np.array([0.0, -0.0, 1.0], np.float32), n)
        else:
            s = (rng.integers(0, 3, n) * 1e-30).astype(np.float32)
        pos = rng.integers(0, n * r, 5)
        got = ref_units(np.tile(s, (len(pos), 1)), pos, r, nb_budget)
        mask = select_tokens(np.tile(s, (len(pos), 1)), pos, int(pos.max()) + 1, r, nb_budget)
        for i, p in enumerate(pos):
            want = stable_top(s, int(p), r, nb_budget)
            assert list(got[i]) == want
            assert radix_select(s, int(p), r, nb_budget) == want
            assert np.array_equal(units_mask(got[i], int(p), r, int(pos.max()) + 1), mask[i])


def test_shapes_from_the_fixture():
    from engine.gguf_model import open_model
    cfg = open_model(FIXTURE).config
    il = cfg.recurrent_layers.index(False)
    s = QsaShape.from_config(cfg, il)
    assert (s.n_head, s.n_head_kv, s.head_dim, s.n_rot, s.idx_heads, s.idx_dim, s.r, s.budget) == \
        (4, 2, 32, 8, 4, 32, 4, 16)
    assert s.scale == pytest.approx(1 / np.sqrt(32)) and s.budget_blocks == 4 and s.max_units == 5
    h = HcShape.from_config(cfg)
    assert (h.N, h.H, h.R, h.D) == (256, 4, 16, 1024)


def test_published_sizes():
    s = QsaShape(24, 2, 256, 64, 4, 128, 4, 2048, 1e-6, 1 / 16)
    assert s.budget_blocks == 512 and s.max_units == 513
    n_split, ups = decode_splits(s)
    assert n_split * ups >= s.max_units and (n_split - 1) * ups < s.max_units and (n_split, ups) == (33, 16)
    assert decode_splits(s, 1000) == (1, 513)
    # K and V fp16 (2 heads of 256), raw and pooled indexer keys fp32: 2,560 B a cell, 640 MiB at 256K cells
    assert cache_bytes(s, 262144) == 262144 * (2 * 2 * 256 * 2 + 128 * 4 + 128 * 4 // 4)
    assert prompt_scratch_bytes(s, 4096, 131072, 1024) == 4 * (4096 * (24 * 256 + 4 * 128 + 514) + 1024 * 32768)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="@build QSA_HD=128 QSA_G=8"):
        QsaShape(16, 2, 128, 64, 4, 128, 4, 2048, 1e-6, 0.1)
    with pytest.raises(ValueError, match="do not group"):
        QsaShape(24, 5, 256, 64, 4, 128, 4, 2048, 1e-6, 0.1)
    with pytest.raises(ValueError, match="indexer heads"):
        QsaShape(24, 2, 256, 64, 16, 128, 4, 2048, 1e-6, 0.1)
    with pytest.raises(ValueError, match="budget"):
        QsaShape(24, 2, 256, 64, 4, 128, 4, 2050, 1e-6, 0.1)
    with pytest.raises(ValueError, match="rotary"):
        QsaShape(24, 2, 256, 130, 4, 128, 4, 2048, 1e-6, 0.1)
    with pytest.raises(ValueError, match="more than one"):
        HcShape(2560, 1, 320, 1e-6)
    with pytest.raises(ValueError, match="multiples of 8"):
        HcShape(2560, 4, 321, 1e-6)
