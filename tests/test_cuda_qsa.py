"""qwen4exp's QSA kernels (cuda_src/qsa.cu through engine/cuda/qsa.py) against engine/arch/qwen4exp.py's reference
(rms_norm + imrope, pooled_block_keys, block_scores, select_tokens, masked_attention) in float64, on fresh random data
at the tiny fixture's shape (4/2 heads of 32, budget 16), make_moe's tiny-qwen4exp (4/2 heads of 64, budget 32) and
the published one (24/2 heads of 256, indexer 4 x 128, budget 2048), contexts below, at and above the budget, decode
and prompt chunks of several lengths; every output poisoned first (floats NaN, ints -7) and the cache past the
written positions NaN, so a read past the query shows.

The selection is compared exactly: the reference selects from the kernel's own scores (a near-tie at fp32 rounding
could otherwise pick another block), and the scores are compared to block_scores apart."""
import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine.arch.base import rms_norm  # noqa: E402
from engine.arch.qwen4exp import block_scores, imrope, masked_attention, pooled_block_keys  # noqa: E402
from engine.arch.qwen3next import sigmoid  # noqa: E402
from engine.cuda.qsa import QsaKernels, QsaNorms, QsaShape, ref_units, units_mask  # noqa: E402

SHAPES = {
    "tiny-fixture": QsaShape(4, 2, 32, 8, 4, 32, 4, 16, 1e-6, 1 / math.sqrt(32)),
    "tiny-preset": QsaShape(4, 2, 64, 16, 4, 32, 4, 32, 1e-6, 1 / 8),
    "published": QsaShape(24, 2, 256, 64, 4, 128, 4, 2048, 1e-6, 1 / 16),
}
TOL = 2e-4            # relative (Frobenius) error of fp32 kernels against float64 on the same fp16 K/V

_kern: dict = {}


def kern(name) -> QsaKernels:
    if name not in _kern:
        _kern[name] = QsaKernels(SHAPES[name])
    return _kern[name]


def rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def rope_tables(s: QsaShape, n_pos: int, base: float = 1e7):
    half = s.n_rot // 2
    freq = base ** (-2.0 * np.arange(half) / max(s.n_rot, 1))
    ang = np.arange(n_pos)[:, None] * freq[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    return cos.astype(np.float64), sin.astype(np.float64), cp.asarray(np.stack([cos, sin], -1))


class Layer:
    """Random norms, a rope table and a cache of max_ctx cells whose first `hist` positions hold random K/V and raw
    indexer keys (the pooled keys of their complete blocks by the reference), the rest NaN."""

    def __init__(self, name: str, max_ctx: int, hist: int, rng):
        self.name, self.s = name, SHAPES[name]
        s = self.s
        self.k = kern(name)
        self.max_ctx = max_ctx
        r32 = lambda a: np.asarray(a, np.float32).astype(np.float64)     # noqa: E731
        self.norms_h = [r32(1 + 0.1 * rng.standard_normal(n)) for n in (s.head_dim, s.head_dim, s.idx_dim, s.idx_dim)]
        self.norms = QsaNorms(*(cp.asarray(n, cp.float32) for n in self.norms_h))
        self.cos, self.sin, self.rope = rope_tables(s, max_ctx)
        self.cache = c = self.k.cache(max_ctx)
        c.kc[...] = cp.nan
        c.vc[...] = cp.nan
        c.kraw[...] = cp.nan
        c.kbar[...] = cp.nan
        if hist:
            c.kc[:, :hist] = cp.random.standard_normal((s.n_head_kv, hist, s.head_dim)).astype(cp.float16)
            c.vc[:, :hist] = cp.random.standard_normal((s.n_head_kv, hist, s.head_dim)).astype(cp.float16)
            raw = r32(rng.standard_normal((hist, s.idx_dim)))
            c.kraw[:hist] = cp.asarray(raw, cp.float32)
            nb = hist // s.r
            if nb:
                kb = pooled_block_keys(raw[:nb * s.r], self.norms_h[3], self.cos[0:nb * s.r:s.r],
                                       self.sin[0:nb * s.r:s.r], s.n_rot, s.r, s.eps)
                c.kbar[:nb] = cp.asarray(kb, cp.float32)

    def inputs(self, T: int, rng):
        """Random projections (host float64 rounded to fp32, device fp32): q with [q_h | gate_h] interleaved, k, v,
        qi, ki, as views of one (T, W) buffer (row strides of the wider buffer)."""
        s = self.s
        widths = (2 * s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_head_kv * s.head_dim,
                  s.idx_heads * s.idx_dim, s.idx_dim)
        both = np.asarray(rng.standard_normal((T, sum(widths))), np.float32)
        dev = cp.asarray(both)
        offs = np.cumsum([0, *widths])
        host = [both[:, a:b].astype(np.float64) for a, b in zip(offs[:-1], offs[1:])]
        return host, [dev[:, a:b] for a, b in zip(offs[:-1], offs[1:])]

    def ref_prep(self, host, pos):
        """(q, gate, k, v, qi, ki) as the reference's qsa computes them at positions pos."""
        s, T = self.s, len(pos)
        q, k, v, qi, ki = host
        qg = q.reshape(T, s.n_head, 2 * s.head_dim)
        cos, sin = self.cos[pos], self.sin[pos]
        qn, kn, iqn, _ = self.norms_h
        qr = imrope(rms_norm(qg[..., :s.head_dim], qn, s.eps), cos, sin, s.n_rot)
        kr = imrope(rms_norm(k.reshape(T, s.n_head_kv, s.head_dim), kn, s.eps), cos, sin, s.n_rot)
        qir = imrope(rms_norm(qi.reshape(T, s.idx_heads, s.idx_dim), iqn, s.eps), cos, sin, s.n_rot)
        return qr, qg[..., s.head_dim:].reshape(T, -1), kr, v.reshape(T, s.n_head_kv, s.head_dim), qir, ki

    def ref_pooled(self, b0: int, nb: int):
        s = self.s
        raw = self.cache.kraw[b0 * s.r:(b0 + nb) * s.r].get().astype(np.float64)
        lo, hi = b0 * s.r, (b0 + nb) * s.r
        return pooled_block_keys(raw, self.norms_h[3], self.cos[lo:hi:s.r], self.sin[lo:hi:s.r], s.n_rot, s.r, s.eps)

    def kv(self, n: int):
        c = self.cache
        return c.kc[:, :n].get().astype(np.float64), c.vc[:, :n].get().astype(np.float64)


def decode_case(lay: Layer, p: int, rng, units_per_split=None, state=None):
    """One decode step at p; returns (out, scratch, reference pieces) after checking prep, pooling, scores and units."""
    s, k, c = lay.s, lay.k, lay.cache
    sc = k.decode_scratch(lay.max_ctx, **({} if units_per_split is None else {"units_per_split": units_per_split}))
    for a in (sc.q, sc.qi, sc.scores) + ((sc.part,) if sc.part is not None else ()):
        a[...] = cp.nan
    sc.units[...] = -7
    sc.n_units[...] = -7
    host, dev = lay.inputs(1, rng)
    qr, gate, kr, v, qir, ki = lay.ref_prep(host, np.array([p]))
    out = cp.full(s.n_head * s.head_dim, cp.nan, cp.float32)
    st = cp.asarray([0, p, 0, 0], cp.int32) if state is None else state
    q, kk, vv, qi, kin = (a[0] for a in dev)
    k.decode(st, q, kk, vv, qi, kin, lay.norms, lay.rope, c, sc, out, gate=q[s.head_dim:])
    assert rel(sc.q.get(), qr[0]) < 1e-5 and rel(sc.qi.get(), qir[0]) < 1e-5
    np.testing.assert_allclose(c.kc[:, p].get().astype(np.float64), kr[0], rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(c.vc[:, p].get(), v[0].astype(np.float16))
    np.testing.assert_array_equal(c.kraw[p].get(), ki[0].astype(np.float32))
    if (p + 1) % s.r == 0:
        assert rel(c.kbar[p // s.r].get(), lay.ref_pooled(p // s.r, 1)[0]) < 1e-5
    n_b = (p + 1) // s.r
    scores = sc.scores[:n_b].get().astype(np.float64)
    if n_b > s.budget_blocks:
        want = block_scores(qir, c.kbar[:n_b].get().astype(np.float64))[0]
        assert rel(scores, want) < 1e-5
    units = ref_units(scores[None], [p], s.r, s.budget_blocks)[0]
    n = int(sc.n_units.get()[0])
    np.testing.assert_array_equal(sc.units[:n].get(), units)
    K, V = lay.kv(p + 1)
    mask = units_mask(units, p, s.r, p + 1)[None]
    want = masked_attention(qr, K, V, mask, s.scale) * sigmoid(gate)
    return out, want[0], sc


@pytest.mark.parametrize("name", list(SHAPES))
def test_decode_across_the_budget(name):
    """Decode steps at contexts below, at and above the budget (and the positions where a block completes: the
    inline pooling), with the default splits and with one split (no combine)."""
    s = SHAPES[name]
    rng = np.random.default_rng()
    B = s.budget
    for p in (0, 5, B - 2, B - 1, B, B + 2, B + 3, B + 4, 3 * B + 1, 4 * B + 3):
        for ups in (None, s.max_units):
            lay = Layer(name, p + 8, p, rng)
            out, want, sc = decode_case(lay, p, rng, ups)
            e = rel(out.get(), want)
            assert e < TOL, f"p={p} ups={ups}: rel err {e:.2e}"


@pytest.mark.parametrize("name", ["tiny-preset", "published"])
def test_decode_steps_chain(name):
    """Several steps in a row on one cache, each writing its K/V, raw key and (at block ends) pooled key for the
    next: across the dense/sparse crossing; the position only in the state array (as a captured graph reads it)."""
    s = SHAPES[name]
    rng = np.random.default_rng()
    p0 = s.budget - 3
    lay = Layer(name, p0 + 16, p0, rng)
    state = cp.zeros(8, cp.int32)
    for p in range(p0, p0 + 10):
        state[1] = p
        out, want, _ = decode_case(lay, p, rng, state=state)
        assert rel(out.get(), want) < TOL, f"p={p}"


def test_decode_at_128k():
    """The published shape at a 131,072-cell cache, context 131,000: 32,750 blocks for the radix select, the
    attention still over 2,048 + tail cells."""
    rng = np.random.default_rng()
    p = 131_000 + 1          # (p + 1) % 4 = 2: the tail is cells 131,000 and 131,001
    lay = Layer("published", 131_072, p, rng)
    out, want, sc = decode_case(lay, p, rng)
    assert int(sc.n_units.get()[0]) == SHAPES["published"].budget_blocks + 1
    assert rel(out.get(), want) < TOL


def prompt_case(name, pos0, T, q_rows, rng):
    s = SHAPES[name]
    lay = Layer(name, pos0 + T + 8, pos0, rng)
    k, c = lay.k, lay.cache
    sc = k.prompt_scratch(T + 3, lay.max_ctx, q_rows)
    for a in (sc.q, sc.qi, sc.scores):
        a[...] = cp.nan
    sc.units[...] = -7
    sc.n_units[...] = -7
    host, dev = lay.inputs(T, rng)
    pos = pos0 + np.arange(T)
    qr, gate, kr, v, qir, ki = lay.ref_prep(host, pos)
    out = cp.full((T, s.n_head * s.head_dim + 5), cp.nan, cp.float32)
    k.prompt(pos0, T, *dev, lay.norms, lay.rope, c, sc, out[:, :s.n_head * s.head_dim], gate=dev[0][:, s.head_dim:])
    assert rel(sc.q[:T].get(), qr) < 1e-5 and rel(sc.qi[:T].get(), qir) < 1e-5
    assert rel(c.kc[:, pos0:pos0 + T].get().transpose(1, 0, 2), kr) < 1e-3
    np.testing.assert_array_equal(c.vc[:, pos0:pos0 + T].get().transpose(1, 0, 2), v.astype(np.float16))
    lo, hi = pos0 // s.r, (pos0 + T) // s.r
    if hi > lo:
        assert rel(c.kbar[lo:hi].get(), lay.ref_pooled(lo, hi - lo)) < 1e-5
    assert np.isnan(c.kbar[hi:].get()).all(), "a block pooled before it was complete"
    # every query's scores in one pass (bitwise the same per (query, block) as the sub-batches: same loop order)
    nb = (pos0 + T) // s.r
    full = cp.full((T, s.n_blocks(lay.max_ctx)), cp.nan, cp.float32)
    if nb > s.budget_blocks:
        k.scores_rows(sc.qi, 0, T, c, full, pos0)
    scores = full.get().astype(np.float64)
    kbar = c.kbar[:max(nb, 1)].get().astype(np.float64)
    for t in range(T):
        n_b = (pos0 + t + 1) // s.r
        if n_b > s.budget_blocks:
            assert rel(scores[t, :n_b], block_scores(qir[t:t + 1], kbar[:n_b])[0]) < 1e-5, f"t={t}"
    K, V = lay.kv(pos0 + T)
    units = ref_units(np.nan_to_num(scores, nan=-1.0), pos, s.r, s.budget_blocks)
    got_n = sc.n_units[:T].get()
    mask = np.zeros((T, pos0 + T), bool)
    for t in range(T):
        np.testing.assert_array_equal(sc.units[t, :got_n[t]].get(), units[t], err_msg=f"t={t}")
        mask[t] = units_mask(units[t], pos0 + t, s.r, pos0 + T)
    want = masked_attention(qr, K, V, mask, s.scale) * sigmoid(gate)
    got = out.get()
    assert np.isnan(got[:, s.n_head * s.head_dim:]).all()
    return got[:, :s.n_head * s.head_dim], want


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("where,T,q_rows", [("start", 1, None), ("start", 37, None), ("below", 64, None),
                                            ("crossing", 40, None), ("crossing", 300, 128), ("above", 7, None),
                                            ("above", 200, 64), ("far", 129, None)])
def test_prompt_chunks(name, where, T, q_rows):
    """A prompt chunk of T tokens after pos0 cached ones: from the start, below the budget, crossing it (queries of
    one chunk on both sides), above it, far above it; sub-batches of q_rows queries for the scores."""
    s = SHAPES[name]
    B = s.budget
    pos0 = {"start": 0, "below": max(0, B // 2 - 64) if B > 64 else 0, "crossing": max(0, B - T // 2 - 1),
            "above": B + 5, "far": 3 * B + 2}[where]
    got, want = prompt_case(name, pos0, T, q_rows, np.random.default_rng())
    e = rel(got, want)
    assert e < TOL, f"pos0={pos0} T={T}: rel err {e:.2e}"


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("n_b_over", [-1, 0, 1, 2, 50, 1000])
def test_select_ties_exactly(name, n_b_over):
    """qsa_select on given scores full of ties (a few distinct values, zeros, -0.0), for decode (state) and prompt
    rows: the reference's stable order (ties to the lower block) exactly, the tail appended, dense lists below."""
    s = SHAPES[name]
    k = kern(name)
    rng = np.random.default_rng()
    Bb = s.budget_blocks
    n_b = Bb + n_b_over
    T = 6
    offsets = ((0, 0), (0, 1), (0, 3), (1, 2), (-1, 2), (0, 2))         # (blocks, cells) around n_b complete blocks
    pos = np.array([max(0, (n_b + dt) * s.r - 1 + off) for dt, off in offsets])
    nmax = int((pos.max() + 1) // s.r) + 1
    vals = rng.choice(np.array([0.0, -0.0, 0.5, 1.0, 1.5, 2.0], np.float32), size=(T, nmax))
    vals[:, ::7] = rng.standard_normal((T, len(range(0, nmax, 7)))).astype(np.float32) ** 2
    scores = cp.asarray(vals)
    units = cp.full((T, s.max_units + 2), -7, cp.int32)
    n_units = cp.full(T, -7, cp.int32)
    # per query: the prompt form (pos0 + t, t0 = 0) needs consecutive positions, so each row runs as its own t0
    for t, p in enumerate(pos):
        k.select(scores[t:t + 1], t, 1, units, n_units, pos0=int(p) - t)
    want = ref_units(vals.astype(np.float64), pos, s.r, Bb)
    got_n = n_units.get()
    for t in range(T):
        np.testing.assert_array_equal(units[t, :got_n[t]].get(), want[t], err_msg=f"p={pos[t]}")
        assert (units[t, got_n[t]:].get() == -7).all()
    st = cp.asarray([0, int(pos[2]), 0, 0], cp.int32)      # decode: the position from the state array
    u1, n1 = cp.full(s.max_units, -7, cp.int32), cp.full(1, -7, cp.int32)
    k.select(scores[2], 0, 1, u1, n1, state=st)
    np.testing.assert_array_equal(u1[:int(n1.get()[0])].get(), want[2])


@pytest.mark.parametrize("name", ["tiny-preset", "published"])
def test_decode_replays_in_a_captured_graph(name):
    """The decode block captured once in a CUDA graph (the position only in state[1], the projections in fixed
    buffers) and replayed step after step across the budget equals the eager launches on a copy of the cache,
    bitwise, and the eager ones the reference (test_decode_steps_chain)."""
    from engine.cuda.qsa import QsaCache
    s = SHAPES[name]
    rng = np.random.default_rng()
    p0 = s.budget - 3
    lay = Layer(name, p0 + 16, p0, rng)
    k, c1 = lay.k, lay.cache
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with stream:
        c2 = QsaCache(lay.max_ctx, c1.kc.copy(), c1.vc.copy(), c1.kraw.copy(), c1.kbar.copy())
        sc1, sc2 = k.decode_scratch(lay.max_ctx), k.decode_scratch(lay.max_ctx)
        _, dev = lay.inputs(1, rng)
        fixed = [a[0].copy() for a in dev]                 # the graph's input buffers
        out1 = cp.full(s.n_head * s.head_dim, cp.nan, cp.float32)
        out2 = cp.full(s.n_head * s.head_dim, cp.nan, cp.float32)
        state = cp.zeros(8, cp.int32)
        stream.begin_capture()
        k.decode(state, *fixed, lay.norms, lay.rope, c2, sc2, out2, gate=fixed[0][s.head_dim:])
        graph = stream.end_capture()
        for p in range(p0, p0 + 9):
            _, dev = lay.inputs(1, rng)
            for f, a in zip(fixed, dev):
                f[...] = a[0]
            state[1] = p
            k.decode(state, *fixed, lay.norms, lay.rope, c1, sc1, out1, gate=fixed[0][s.head_dim:])
            graph.launch()
            stream.synchronize()
            assert bool(cp.isfinite(out1).all()), f"p={p}"
            assert bool((out1 == out2).all()), f"p={p}: the graph's output differs from the eager launches'"
    for a, b in ((c1.kc, c2.kc), (c1.vc, c2.vc), (c1.kbar, c2.kbar)):
        assert bool(cp.array_equal(a, b, equal_nan=True))
