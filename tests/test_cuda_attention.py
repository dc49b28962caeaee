"""The decode step's attention of attention.cu (attn_gqa_f16 / attn_gqa_i8 through engine/cuda/kv.py's
DecodeAttention with split=False; the default split kernels are tests/test_cuda_attn_split.py's) against NumPy: fresh random caches, every output and the split buffers poisoned (NaN) before each
launch, cache rows past the live positions poisoned too (NaN fp16 values, NaN int8 scales), so a row read that should
not be read shows. Then the way decode uses it: store + attend captured once as a CUDA graph and replayed at increasing
positions. The host-side sizing rules run without a GPU."""
import re
import types
from pathlib import Path

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from engine.cuda import kv as kvmod  # noqa: E402
from engine.cuda.kv import DecodeAttention, KVCache  # noqa: E402
from gpu_compare import rel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def cfg_of(n_head_kv, group, head_dim, n_layer=2, n_rot=None, rope_type="neox"):
    return types.SimpleNamespace(n_head=n_head_kv * group, n_head_kv=n_head_kv, head_dim=head_dim, n_layer=n_layer,
                                 n_rot=n_rot or head_dim, rope_type=rope_type, rms_eps=1e-6)


# ---- host side (no GPU) ------------------------------------------------------------------------------------------
def test_constants_match_the_kernel_source():
    src = (ROOT / "cuda_src" / "attention.cu").read_text()
    for name in ("AT_T", "AT_MAX_SPLITS", "AT_MAX_G"):
        m = re.search(rf"#define {name} (\d+)", src)
        assert m and int(m.group(1)) == getattr(kvmod, name), name


def test_split_rule():
    assert kvmod.attn_splits(4, 4096, 132) == 33          # one wave of blocks on an H200
    assert kvmod.attn_splits(4, 100, 132) == 4            # never more splits than tiles
    assert kvmod.attn_splits(1, 1 << 20, 132) == kvmod.AT_MAX_SPLITS
    assert kvmod.attn_splits(64, 1 << 20, 132) == 2
    assert kvmod.attn_splits(200, 1 << 20, 132) == 1


def test_block_and_shared_memory():
    assert [kvmod.attn_block(g) for g in (1, 2, 4, 5, 8, 16)] == [128, 128, 128, 160, 256, 256]
    # the common shapes fit the default 48 KiB with the kernel's ~4 KiB of static shared memory
    for dtype in ("f16", "int8"):
        for g in (1, 4, 8, 16):
            for hd in (64, 96, 128):
                assert kvmod.attn_smem(dtype, g, hd) + 4200 <= 48 * 1024, (dtype, g, hd)
    # head_dim 256 opts in; still within the H200's 227 KiB
    assert kvmod.attn_smem("f16", 16, 256) <= 227 * 1024
    assert kvmod.attn_smem("f16", 8, 128) == 8 * 128 * 4 + 2 * 2 * 32 * (256 + 16)


def test_kv_sizes_and_checks():
    c = cfg_of(4, 8, 128, n_layer=48)
    f16, i8 = KVCache.nbytes(c, 4096), KVCache.nbytes(c, 4096, "int8")
    assert f16 == 2 * 48 * 4 * 4096 * 128 * 2
    assert i8 * 16 == f16 * 9                      # 128 + 16 bytes a row instead of 256
    with pytest.raises(ValueError, match="--kv takes one of f16, int8"):
        kvmod.check_dtype(c, "fp8")
    with pytest.raises(ValueError, match="multiple of 32"):
        kvmod.check_dtype(cfg_of(1, 1, 80), "int8")
    kvmod.check_dtype(cfg_of(1, 1, 80), "f16")


def test_kv_flag():
    from cuda_flags import options, parse
    assert options().kv == "f16" and options("--kv", "int8").kv == "int8"
    with pytest.raises(SystemExit):
        parse("--kv", "fp8")


# ---- on the GPU --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def K():
    from engine.cuda.kernels import Kernels
    from engine.cuda.quant_types import qtype
    return Kernels({qtype("F16").id})


def fill_cache(kv, li, n_pos, rng):
    """Random K/V in layer li at positions < n_pos, NaN poison at the rest (fp16 values, int8 scales)."""
    n_kv, max_ctx, hd = kv.k.shape[1:]
    if kv.dtype == "f16":
        for a in (kv.k, kv.v):
            h = np.full((n_kv, max_ctx, hd), np.nan, dtype=np.float16)
            h[:, :n_pos] = rng.standard_normal((n_kv, n_pos, hd))
            a[li] = cp.asarray(h)
    else:
        for a, s in ((kv.k, kv.k_scale), (kv.v, kv.v_scale)):
            a[li] = cp.asarray(rng.integers(-127, 128, size=(n_kv, max_ctx, hd), dtype=np.int8))
            sc = np.full((n_kv, max_ctx, hd // 32), np.nan, dtype=np.float32)
            sc[:, :n_pos] = rng.uniform(0.2, 1.5, size=(n_kv, n_pos, hd // 32)) / 127
            s[li] = cp.asarray(sc)


def cache_rows(kv, li, n):
    """Layer li's K and V at positions < n as float64 (n_kv, n, hd), dequantized as the kernels do."""
    if kv.dtype == "f16":
        return (kv.k[li, :, :n].get().astype(np.float64), kv.v[li, :, :n].get().astype(np.float64))
    out = []
    for a, s in ((kv.k, kv.k_scale), (kv.v, kv.v_scale)):
        q = a[li, :, :n].get().astype(np.float64)
        sc = np.repeat(s[li, :, :n].get().astype(np.float64), 32, axis=-1)
        out.append(q * sc)
    return tuple(out)


def ref_attention(q, Kc, Vc, group, scale):
    """q (n_head * hd,), Kc/Vc (n_kv, n, hd) -> (n_head, hd) in float64."""
    n_kv, _, hd = Kc.shape
    qg = np.asarray(q, np.float64).reshape(n_kv, group, hd) * scale
    s = np.einsum("kgd,knd->kgn", qg, Kc)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("kgn,knd->kgd", p, Vc).reshape(n_kv * group, hd)


def run_attend(K, dtype, hd, group, n_pos, n_kv=2, max_ctx=None, n_split=None, use_state=True, q_gain=1.0):
    rng = np.random.default_rng()
    cfg = cfg_of(n_kv, group, hd)
    max_ctx = max_ctx or n_pos + 37
    kv = KVCache(cfg, max_ctx, dtype)
    li = 1                                            # not the first layer: the layer offsets count
    fill_cache(kv, li, n_pos, rng)
    att = DecodeAttention(K, cfg, kv, n_split=n_split, split=False)
    q = (rng.standard_normal(cfg.n_head * hd) * q_gain).astype(np.float32)
    out = cp.full(cfg.n_head * hd, np.nan, dtype=cp.float32)
    att.part.fill(np.nan)
    state = cp.asarray(np.array([0, n_pos - 1, 0, 0, 0, 0, 0, 0], dtype=np.int32)) if use_state else None
    scale = 1.0 / np.sqrt(hd)
    att.attend(K, li, cp.asarray(q), out, state, scale, n_fixed=0 if use_state else n_pos)
    Kc, Vc = cache_rows(kv, li, n_pos)
    got = out.get().reshape(cfg.n_head, hd)
    assert np.isfinite(got).all()
    assert rel(got, ref_attention(q, Kc, Vc, group, scale)) < 2e-4
    assert not att.counters.get().any()               # reset for the next launch


CASES = [(dt, hd, g, n) for dt in ("f16", "int8") for hd in (64, 96, 128) for g in (1, 4, 8)
         for n in (1, 2, 17, 512, 777, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hd,group,n_pos", CASES, ids=[f"{d}-hd{h}-g{g}-n{n}" for d, h, g, n in CASES])
def test_attend(K, dtype, hd, group, n_pos):
    run_attend(K, dtype, hd, group, n_pos)


# the fixture models (G 2, hd 64), SmolLM2 (G 3), wide groups, head_dim 256 (opts in to > 48 KiB shared memory)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "int8"])
@pytest.mark.parametrize("hd,group,n_pos", [(64, 2, 255), (64, 3, 100), (64, 16, 700), (128, 16, 2049),
                                            (256, 8, 33), (256, 16, 1500), (96, 5, 64)])
def test_attend_other_shapes(K, dtype, hd, group, n_pos):
    run_attend(K, dtype, hd, group, n_pos)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "int8"])
def test_attend_32k(K, dtype):
    run_attend(K, dtype, 128, 8, 32768, n_kv=4, max_ctx=32768)


@pytest.mark.gpu
@pytest.mark.parametrize("n_split", [1, 3, 64])
@pytest.mark.parametrize("n_pos", [1, 33, 777, 4096])
def test_attend_split_counts(K, n_split, n_pos):
    run_attend(K, "f16", 128, 8, n_pos, n_split=n_split, q_gain=4.0)   # peaky softmax: the merge's max matters


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "int8"])
def test_attend_fixed_count(K, dtype):
    run_attend(K, dtype, 64, 4, 300, use_state=False)


# ---- store + attend as decode runs them: one captured graph, replayed at increasing positions --------------------
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


GRAPH_CASES = [(dt, hd, g, neox, norm, n_rot) for dt in ("f16", "int8")
               for hd, g, neox, norm, n_rot in ((128, 8, 1, True, 128), (64, 2, 0, False, 64), (96, 4, 1, True, 64),
                                                (256, 16, 0, True, 256), (64, 1, 1, True, 32))]


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "store+attend"])
@pytest.mark.parametrize("dtype,hd,group,neox,norm,n_rot", GRAPH_CASES)
def test_graph_replayed_at_increasing_positions(K, dtype, hd, group, neox, norm, n_rot, fused):
    """DecodeAttention.step as the decode step runs it, fused (attn_gqa_rope_*) or as two launches."""
    rng = np.random.default_rng()
    n_kv, max_ctx, li = 2, 1100, 1
    cfg = cfg_of(n_kv, group, hd, n_rot=n_rot, rope_type="neox" if neox else "norm")
    nq, nk = cfg.n_head * hd, n_kv * hd
    kv = KVCache(cfg, max_ctx, dtype)
    fill_cache(kv, li, max_ctx, rng)                  # earlier positions hold valid rows; each step writes its own
    att = DecodeAttention(K, cfg, kv, fused=fused, split=False)
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
    for pos in (0, 1, 2, 31, 32, 33, 100, 511, 512, 777, max_ctx - 1):
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
        graph.launch(stream)
        stream.synchronize()
        qr = _norm_rope(hq.reshape(-1, hd), qn.get() if norm else None, cs[pos], n_rot, neox)
        kr = _norm_rope(hk.reshape(-1, hd), kn.get() if norm else None, cs[pos], n_rot, neox)
        if not fused:                               # the fused launch leaves q as it was
            assert rel(q.get().reshape(-1, hd), qr) < 1e-5, pos
        else:
            assert (q.get() == hq).all()
        Kc, Vc = cache_rows(kv, li, pos + 1)
        tol = 2e-3 if dtype == "f16" else 1.5e-2
        assert rel(Kc[:, pos], kr) < tol, pos
        assert rel(Vc[:, pos], hv.reshape(-1, hd)) < tol, pos
        got = out.get().reshape(cfg.n_head, hd)
        assert rel(got, ref_attention(qr.reshape(-1), Kc, Vc, group, scale)) < 2e-4, pos
    assert not att.counters.get().any()


@pytest.mark.gpu
@pytest.mark.parametrize("hd,n_rot,neox,norm", [(64, 64, 0, True), (96, 64, 1, False), (128, 128, 1, True),
                                                (256, 128, 0, True)])
def test_int8_store_of_a_chunk(K, hd, n_rot, neox, norm):
    """KVCache.store (qk_rope_store_kv8) of T tokens at pos0 + t, no device position: as a prompt pass calls it."""
    rng = np.random.default_rng()
    n_kv, group, T, pos0, max_ctx, li = 2, 3, 5, 7, 16, 1
    cfg = cfg_of(n_kv, group, hd, n_rot=n_rot, rope_type="neox" if neox else "norm")
    kv = KVCache(cfg, max_ctx, "int8")
    kv.k.fill(0x55)
    kv.v.fill(0x55)
    kv.k_scale.fill(np.nan)
    kv.v_scale.fill(np.nan)
    hq = rng.standard_normal((T, cfg.n_head * hd)).astype(np.float32)
    hk = rng.standard_normal((T, n_kv * hd)).astype(np.float32)
    hv = (rng.standard_normal((T, n_kv * hd)) * rng.uniform(0.01, 10, size=(T, 1))).astype(np.float32)
    qn = rng.standard_normal(hd).astype(np.float32) if norm else None
    kn = rng.standard_normal(hd).astype(np.float32) if norm else None
    cs = np.stack([np.cos(a := rng.uniform(0, 6, size=(max_ctx, n_rot // 2))), np.sin(a)], -1).astype(np.float32)
    q = cp.asarray(hq)
    kv.store(K, cfg, li, q, cp.asarray(hk), cp.asarray(hv), None if qn is None else cp.asarray(qn),
             None if kn is None else cp.asarray(kn), cp.asarray(cs), None, pos0=pos0, T=T)
    for t in range(T):
        p = pos0 + t
        qr = _norm_rope(hq[t].reshape(-1, hd), qn, cs[p], n_rot, neox)
        assert rel(q.get()[t].reshape(-1, hd), qr) < 1e-5
        kr = _norm_rope(hk[t].reshape(-1, hd), kn, cs[p], n_rot, neox)
        for a, s, want in ((kv.k, kv.k_scale, kr), (kv.v, kv.v_scale, hv[t].reshape(-1, hd))):
            blocks = want.reshape(n_kv, hd // 32, 32)
            sc = np.abs(blocks).max(-1) / 127
            assert np.allclose(s[li, :, p].get(), sc, rtol=1e-5)
            qv = np.rint(blocks / sc[..., None]).reshape(n_kv, hd)
            assert np.abs(a[li, :, p].get().astype(np.int32) - qv).max() <= 1       # a rounding tie may go either way
    untouched = np.ones(max_ctx, bool)
    untouched[pos0:pos0 + T] = False
    assert (kv.k[li][:, untouched].get() == 0x55).all() and np.isnan(kv.k_scale[li][:, untouched].get()).all()
    assert (kv.k[0].get() == 0x55).all()
