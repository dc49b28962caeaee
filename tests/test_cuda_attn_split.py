"""The flash-decoding attention (cuda_src/attn_split.cu through engine/cuda/kv.py's DecodeAttention, split=True)
against NumPy (tests/attn_split_ref.py): fresh random caches at contexts 1 .. 33000, the three head shapes the engine
serves (Qwen3 32/4 x 128; gpt-oss 64/8 x 64 with sinks, full and with a 128 window over a KV ring; qwen35 16/2 x 256),
fp16 and int8 K/V, windows of n_q = 1..8 tokens. Outputs and the chunk scratch are poisoned (NaN) before every launch,
cache rows the window must not read are NaN too, and two launches give the same bits (the merge's order is fixed).
Then the decode step's use: the fused launch (rope + K/V store + attention) captured once as a CUDA graph and
replayed at increasing positions. The host-side sizing rules run without a GPU."""
import re
import types
from pathlib import Path

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from attn_split_ref import dequant_i8, ref_window  # noqa: E402
from engine.cuda import kv as kvmod  # noqa: E402
from engine.cuda.kv import AttnVariant, DecodeAttention, KVCache, ring_rows  # noqa: E402
from gpu_compare import rel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
U64, I32 = np.uint64, np.int32

# name: (n_head_kv, group, head_dim, window of the gpt-oss window layer or None)
SHAPES = {"qwen3": (4, 8, 128, None), "gptoss": (8, 8, 64, 128), "qwen35": (2, 8, 256, None)}
CTX = (1, 5, 31, 32, 33, 1000, 4097, 33000)


def cfg_of(n_head_kv, group, head_dim, n_swa=0, n_rot=None, rope_type="neox"):
    swa = (False, n_swa > 0)
    return types.SimpleNamespace(n_head=n_head_kv * group, n_head_kv=n_head_kv, head_dim=head_dim, n_layer=2,
                                 n_rot=n_rot or head_dim, rope_type=rope_type, rms_eps=1e-6, n_swa=n_swa,
                                 is_swa=lambda i: swa[i])


# ---- host side (no GPU) ------------------------------------------------------------------------------------------
def test_constants_match_the_kernel_source():
    src = (ROOT / "cuda_src" / "attn_split.cu").read_text()
    for name in ("AS_CMIN", "AS_MAX_CHUNKS", "AS_MAX_ROWS", "AS_MAX_WARPS"):
        m = re.search(rf"#define {name} (\d+)", src)
        assert m and int(m.group(1)) == getattr(kvmod, name), name
    assert "#define AS_BN (AS_HD > 128 ? 32 : 64)" in src
    assert [kvmod.split_tile(h) for h in (64, 128, 256)] == [64, 64, 32]


def test_warps_per_block():
    assert [kvmod.split_warps(8, n, 128) for n in (1, 2, 3, 4, 8)] == [(1, 4), (2, 2), (3, 1), (4, 1), (8, 1)]
    assert kvmod.split_warps(8, 1, 256) == (1, 2)          # 32-key tiles: two 16-key slices
    assert kvmod.split_warps(1, 1, 64) == (1, 4)
    assert kvmod.split_warps(16, 4, 128) == (8, 1)
    with pytest.raises(ValueError, match="1 to 64 query rows"):
        kvmod.split_warps(16, 5, 128)


def test_chunk_rule():
    assert kvmod.split_chunks(4, 32768, 132) == 33         # one block an SM
    assert kvmod.split_chunks(4, 300, 132) == 3            # never more than the context's AS_CMIN spans
    assert kvmod.split_chunks(1, 1 << 20, 132) == kvmod.AS_MAX_CHUNKS
    assert kvmod.split_chunks(4, 32768, 132, per_sm=2) == 66
    # short contexts: one chunk (no merge); the chunks then grow with the context, whole tiles of at least AS_CMIN
    assert kvmod.split_range(0, 1, 0, 66, 128) == (0, 1, 64, 1)
    assert kvmod.split_range(127, 1, 0, 66, 128)[3] == 1
    assert kvmod.split_range(599, 1, 0, 66, 128) == (0, 600, 128, 5)
    assert kvmod.split_range(32767, 1, 0, 66, 128) == (0, 32768, 512, 64)
    for P0 in (0, 5, 127, 128, 999, 4096, 32999, 131071):
        for n_q in (1, 3, 8):
            for swa in (0, 128):
                kb, kend, clen, n = kvmod.split_range(P0, n_q, swa, 66, 64)
                assert kend == P0 + n_q and kb == (max(0, P0 - swa + 1) if swa else 0)
                assert 1 <= n <= 66 and clen % 64 == 0 and (n - 1) * clen < kend - kb <= n * clen
                assert n == 1 or clen >= kvmod.AS_CMIN


def test_reference_matches_the_plain_formula():
    """ref_window at n_q = 1 without window or sinks is softmax(q K^T * scale) V."""
    rng = np.random.default_rng(0)
    Kc, Vc = rng.standard_normal((2, 9, 16)), rng.standard_normal((2, 9, 16))
    q = rng.standard_normal((1, 2 * 3 * 16))
    got = ref_window(q, Kc, Vc, 3, 0.25, 8, 1)
    s = np.einsum("kgd,knd->kgn", q.reshape(2, 3, 16) * 0.25, Kc)
    p = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
    assert np.allclose(got, np.einsum("kgn,knd->kgd", p, Vc).reshape(1, -1))
    # a window of 2 at n_q = 2: token 1 sees positions 8, 9 only
    Kc2, Vc2 = rng.standard_normal((2, 10, 16)), rng.standard_normal((2, 10, 16))
    q2 = rng.standard_normal((2, 2 * 3 * 16))
    w = ref_window(q2, Kc2, Vc2, 3, 0.25, 8, 2, n_swa=2)
    assert np.allclose(w[1], ref_window(q2[1:], Kc2[:, 8:], Vc2[:, 8:], 3, 0.25, 1, 1)[0])


# ---- on the GPU --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def K():
    from engine.cuda.kernels import Kernels
    from engine.cuda.quant_types import qtype
    return Kernels({qtype("F16").id})


def layer_view(kv, a, li):
    """Layer li of cache array a (values or scales) as (n_head_kv, rows, width)."""
    if kv._off is None:
        return a[li]
    return a[kv._off[li]:kv._off[li + 1]].reshape(-1, kv.rows[li], a.shape[-1])


def fill_cache(kv, li, L, rng):
    """Random K/V at positions < L of layer li (a ring layer: the last `rows` of them, at row p % rows), NaN at
    every other row (fp16 values, int8 scales). Returns the logical K, V (n_kv, L, hd) float64 (dequantized)."""
    hd, R = kv.head_dim, kv.rows[li]
    n_kv = layer_view(kv, kv.k, li).shape[0]
    first = max(0, L - R)
    pos = np.arange(first, L)
    rows = pos % R
    logical = []
    if kv.dtype == "f16":
        for a in (kv.k, kv.v):
            vals = rng.standard_normal((n_kv, L - first, hd)).astype(np.float16)
            h = np.full((n_kv, R, hd), np.nan, np.float16)
            h[:, rows] = vals
            layer_view(kv, a, li)[...] = cp.asarray(h)
            full = np.zeros((n_kv, L, hd))
            full[:, first:] = vals
            logical.append(full)
    else:
        for a, s in ((kv.k, kv.k_scale), (kv.v, kv.v_scale)):
            qv = rng.integers(-127, 128, size=(n_kv, L - first, hd), dtype=np.int8)
            sc = (rng.uniform(0.2, 1.5, size=(n_kv, L - first, hd // 32)) / 127).astype(np.float32)
            hq = np.zeros((n_kv, R, hd), np.int8)
            hs = np.full((n_kv, R, hd // 32), np.nan, np.float32)
            hq[:, rows], hs[:, rows] = qv, sc
            layer_view(kv, a, li)[...] = cp.asarray(hq)
            layer_view(kv, s, li)[...] = cp.asarray(hs)
            full = np.zeros((n_kv, L, hd))
            full[:, first:] = dequant_i8(qv, sc)
            logical.append(full)
    return logical


def oss_variant(sinks, n_swa):
    return AttnVariant("_oss", True, lambda li: (U64(sinks.data.ptr), I32(n_swa if li == 1 else 0)))


def run_window(K, shape, dtype, L, n_q, layer="plain", n_split=None, q_gain=1.0, use_state=True):
    """attend() of n_q tokens whose last sees L positions, against ref_window; then the same launch again: same bits."""
    rng = np.random.default_rng()
    n_kv, G, hd, win = SHAPES[shape]
    oss = shape == "gptoss"
    n_swa = win if layer == "window" else 0
    cfg = cfg_of(n_kv, G, hd, n_swa=win or 0)
    max_ctx = L + 5
    rows = ring_rows(cfg, max_ctx, 8) if layer == "window" else None
    kv = KVCache(cfg, max_ctx, dtype, rows)
    li = 1 if layer in ("plain", "window") else 0          # "full": gpt-oss's full layer 0 (sinks, no window)
    Kc, Vc = fill_cache(kv, li, L, rng)
    sinks = cp.asarray((rng.standard_normal(cfg.n_head) * 2).astype(np.float32)) if oss else None
    variant = oss_variant(sinks, n_swa) if oss else kvmod.PLAIN
    att = DecodeAttention(K, cfg, kv, n_split=n_split, variant=variant, n_q_max=8, split=True)
    P0 = L - n_q
    q = (rng.standard_normal((n_q, cfg.n_head * hd)) * q_gain).astype(np.float32)
    qd = cp.asarray(q)
    state = cp.asarray(np.array([0, P0, 0, 0, 0, 0, 0, 0], np.int32)) if use_state else None
    scale = 1.0 / np.sqrt(hd)
    outs = []
    for _ in range(2):
        out = cp.full((n_q, cfg.n_head * hd), np.nan, dtype=cp.float32)
        att.part.fill(np.nan)
        att.part_ml.fill(np.nan)
        att.attend(K, li, qd, out, state, scale, n_fixed=0 if use_state else P0 + 1, n_q=n_q)
        outs.append(out.get())
    want = ref_window(q, Kc, Vc, G, scale, P0, n_q, sinks=None if sinks is None else sinks.get(), n_swa=n_swa)
    got = outs[0]
    assert np.isfinite(got).all()
    err = rel(got, want)
    assert err < 1e-3, err
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    return err


WINDOW_CASES = [(s, dt, L, n_q, lay) for s in SHAPES for dt in ("f16", "int8") for L in CTX
                for n_q in (range(1, 9) if L <= 1000 else (1, 4, 8)) if n_q <= L
                for lay in (("full", "window") if s == "gptoss" else ("plain",))]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,L,n_q,layer", WINDOW_CASES,
                         ids=[f"{s}-{d}-L{L}-q{n}-{y}" for s, d, L, n, y in WINDOW_CASES])
def test_window(K, shape, dtype, L, n_q, layer):
    run_window(K, shape, dtype, L, n_q, layer)


@pytest.mark.gpu
@pytest.mark.parametrize("n_split", [1, 2, 7, 128])
@pytest.mark.parametrize("L,n_q", [(1, 1), (300, 8), (4097, 1), (33000, 3)])
def test_chunk_counts(K, n_split, L, n_q):
    """Any chunk limit gives the same answer; a peaky softmax (q x 4) makes the merge's max matter."""
    run_window(K, "qwen3", "f16", L, n_q, n_split=n_split, q_gain=4.0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,layer", [("qwen3", "plain"), ("gptoss", "window")])
def test_fixed_position(K, shape, layer):
    """state None: the position from n_fixed (the host's count), as the prompt pass's tests call it."""
    run_window(K, shape, "f16", 777, 4, layer, use_state=False)


# ---- the decode step: fused rope + store + attention, one captured graph replayed at increasing positions --------
def _norm_rope(x, w, cs, n_rot, neox):
    """x (n, hd) float64: optional RMSNorm with w, then RoPE with cs (n_rot/2, 2) at one position."""
    x = np.array(x, np.float64)
    if w is not None:
        x = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * w
    c, s = cs[:, 0], cs[:, 1]
    h = n_rot // 2
    if neox:
        a, b = x[:, :h].copy(), x[:, h:n_rot].copy()
        x[:, :h], x[:, h:n_rot] = a * c - b * s, a * s + b * c
    else:
        a, b = x[:, 0:n_rot:2].copy(), x[:, 1:n_rot:2].copy()
        x[:, 0:n_rot:2], x[:, 1:n_rot:2] = a * c - b * s, a * s + b * c
    return x


GRAPH_CASES = [(dt, n_kv, g, hd, neox, norm, n_rot) for dt in ("f16", "int8")
               for n_kv, g, hd, neox, norm, n_rot in ((4, 8, 128, 1, True, 128), (8, 8, 64, 0, False, 64),
                                                      (2, 8, 256, 1, True, 64), (2, 4, 96, 1, True, 64),
                                                      (1, 1, 64, 1, True, 32), (2, 16, 128, 0, True, 128))]


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "store+attend"])
@pytest.mark.parametrize("dtype,n_kv,group,hd,neox,norm,n_rot", GRAPH_CASES)
def test_graph_replayed_at_increasing_positions(K, dtype, n_kv, group, hd, neox, norm, n_rot, fused):
    rng = np.random.default_rng()
    max_ctx, li = 1100, 1
    cfg = cfg_of(n_kv, group, hd, n_rot=n_rot, rope_type="neox" if neox else "norm")
    nq, nk = cfg.n_head * hd, n_kv * hd
    kv = KVCache(cfg, max_ctx, dtype)
    Kc, Vc = fill_cache(kv, li, max_ctx, rng)           # earlier positions hold valid rows; each step writes its own
    att = DecodeAttention(K, cfg, kv, fused=fused, split=True)
    qn = cp.asarray(rng.standard_normal(hd).astype(np.float32)) if norm else None
    kn = cp.asarray(rng.standard_normal(hd).astype(np.float32)) if norm else None
    ang = rng.uniform(0, 6, size=(max_ctx, n_rot // 2))
    cs = np.stack([np.cos(ang), np.sin(ang)], -1).astype(np.float32)
    rope = cp.asarray(cs)
    q, k, v = (cp.zeros(n, dtype=cp.float32) for n in (nq, nk, nk))
    out = cp.zeros(nq, dtype=cp.float32)
    state = cp.zeros(8, dtype=cp.int32)
    scale = 1.0 / np.sqrt(hd)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()                  # the set-up above ran on the null stream
    stream.begin_capture()
    try:
        with stream:
            att.step(K, li, q, k, v, qn, kn, rope, out, state, scale)
    finally:
        graph = stream.end_capture()
    for pos in (0, 1, 2, 31, 32, 33, 63, 64, 100, 127, 128, 511, 512, 777, max_ctx - 1):
        hq = rng.standard_normal(nq).astype(np.float32)
        hk = rng.standard_normal(nk).astype(np.float32)
        hv = rng.standard_normal(nk).astype(np.float32)
        with stream:
            q.set(hq, stream)
            k.set(hk, stream)
            v.set(hv, stream)
            state[1] = pos
            out.fill(np.nan)
            att.part.fill(np.nan)
            att.part_ml.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        qr = _norm_rope(hq.reshape(-1, hd), qn.get() if norm else None, cs[pos], n_rot, neox)
        kr = _norm_rope(hk.reshape(-1, hd), kn.get() if norm else None, cs[pos], n_rot, neox)
        if fused:
            assert (q.get() == hq).all()            # the fused launch leaves q as it was
        # the row the step wrote, read back from the cache
        if dtype == "f16":
            k_row = layer_view(kv, kv.k, li)[:, pos].get().astype(np.float64)
            v_row = layer_view(kv, kv.v, li)[:, pos].get().astype(np.float64)
        else:
            k_row = dequant_i8(layer_view(kv, kv.k, li)[:, pos].get(), layer_view(kv, kv.k_scale, li)[:, pos].get())
            v_row = dequant_i8(layer_view(kv, kv.v, li)[:, pos].get(), layer_view(kv, kv.v_scale, li)[:, pos].get())
        tol = 2e-3 if dtype == "f16" else 1.5e-2
        assert rel(k_row, kr) < tol, pos
        assert rel(v_row, hv.reshape(-1, hd)) < tol, pos
        Kc[:, pos], Vc[:, pos] = k_row, v_row
        got = out.get().reshape(1, -1)
        assert np.isfinite(got).all(), pos
        err = rel(got, ref_window(qr.reshape(1, -1), Kc, Vc, group, scale, pos, 1))
        assert err < 1e-3, (pos, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "int8"])
@pytest.mark.parametrize("n_q,P0", [(1, 0), (4, 0), (8, 13), (5, 1000)])
def test_verify_window_store_then_attend(K, dtype, n_q, P0):
    """A speculative verify window as the step would run it: store() of n_q tokens at state[1] + t (qk_rope_store),
    then one attend(n_q) over the cache, each token seeing the window's earlier tokens and not its later ones."""
    rng = np.random.default_rng()
    n_kv, G, hd = 4, 8, 128
    cfg = cfg_of(n_kv, G, hd)
    max_ctx, li = P0 + n_q + 3, 1
    kv = KVCache(cfg, max_ctx, dtype)
    if P0:
        fill_cache(kv, li, P0, rng)                   # the earlier positions; the rest NaN until stored
    att = DecodeAttention(K, cfg, kv, n_q_max=8, split=True)
    nq, nk = cfg.n_head * hd, n_kv * hd
    hq = rng.standard_normal((n_q, nq)).astype(np.float32)
    hk = rng.standard_normal((n_q, nk)).astype(np.float32)
    hv = rng.standard_normal((n_q, nk)).astype(np.float32)
    qn, kn = (rng.standard_normal(hd).astype(np.float32) for _ in range(2))
    ang = rng.uniform(0, 6, size=(max_ctx, hd // 2))
    cs = np.stack([np.cos(ang), np.sin(ang)], -1).astype(np.float32)
    q = cp.asarray(hq)
    state = cp.asarray(np.array([0, P0, 0, 0, 0, 0, 0, 0], np.int32))
    att.store(K, li, q, cp.asarray(hk), cp.asarray(hv), cp.asarray(qn), cp.asarray(kn), cp.asarray(cs), state, T=n_q)
    out = cp.full((n_q, nq), np.nan, dtype=cp.float32)
    att.part.fill(np.nan)
    att.part_ml.fill(np.nan)
    scale = 1.0 / np.sqrt(hd)
    att.attend(K, li, q, out, state, scale, n_q=n_q)
    # the cache as the store left it (the int8 rounding included), then the reference over it
    lv = lambda a: layer_view(kv, a, li)[:, :P0 + n_q].get()       # noqa: E731
    if dtype == "f16":
        Kall, Vall = lv(kv.k).astype(np.float64), lv(kv.v).astype(np.float64)
    else:
        Kall, Vall = dequant_i8(lv(kv.k), lv(kv.k_scale)), dequant_i8(lv(kv.v), lv(kv.v_scale))
    for t in range(n_q):
        kr = _norm_rope(hk[t].reshape(-1, hd), kn, cs[P0 + t], hd, 1)
        assert rel(Kall[:, P0 + t], kr) < (2e-3 if dtype == "f16" else 1.5e-2)
    qr = np.stack([_norm_rope(hq[t].reshape(-1, hd), qn, cs[P0 + t], hd, 1).reshape(-1) for t in range(n_q)])
    got = out.get()
    assert np.isfinite(got).all()
    assert rel(got, ref_window(qr, Kall, Vall, G, scale, P0, n_q)) < 1e-3
