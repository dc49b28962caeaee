"""The streamed prompt pass's kernels (cuda_src/moe_gemm.cu, cuda_src/prefill_attn.cu) against NumPy on fresh random
data at several sizes (chunks crossing the kernels' row and key tiles), every output poisoned first."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine.cuda import kernels  # noqa: E402
from engine.cuda.launch import F32, I32, I64, NULL  # noqa: E402
from engine.cuda.quant_types import NAMES, qtype, random_rows  # noqa: E402
from engine.gguf_model import dequantize  # noqa: E402
from engine.quant_blocks import UE4M3, fp32_to_ue4m3  # noqa: E402
from gpu_compare import rel  # noqa: E402

QTS = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q2_0", "Q1_0", "NVFP4")
ALIGN = 256


def f16(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def silu(g):
    return g / (1.0 + np.exp(-g))


@pytest.fixture(scope="module")
def moe_mod():
    return kernels.load("moe_gemm", qtypes=list(QTS))


@pytest.fixture(scope="module")
def moe_mod_all():
    return kernels.load("moe_gemm", qtypes=list(NAMES))


def att_mod(hd):
    from engine.cuda.prefill import attn_module
    return attn_module(hd)


def route(rng, T, k, E):
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    return ids, w


def sort(mod, ids, w, E):
    T, k = ids.shape
    offsets = cp.full(E + 1, -7, dtype=cp.int32)
    rows = cp.full(T * k, -7, dtype=cp.int32)
    row_w = cp.full(T * k, np.nan, dtype=cp.float32)
    mod.get_function("moe_sort")((1,), (1024,), (cp.asarray(ids), cp.asarray(w), I32(T * k), I32(k), I32(E),
                                                  offsets, rows, row_w))
    return offsets, rows, row_w


@pytest.mark.parametrize("T,k,E", [(1, 1, 4), (37, 2, 8), (700, 8, 128), (3000, 8, 128)])
def test_moe_sort(moe_mod, T, k, E):
    rng = np.random.default_rng()
    ids, w = route(rng, T, k, E)
    offsets, rows, row_w = (a.get() for a in sort(moe_mod, ids, w, E))
    counts = np.bincount(ids.reshape(-1), minlength=E)
    assert (offsets == np.concatenate([[0], np.cumsum(counts)])).all()
    for e in range(E):
        t_idx, j_idx = np.nonzero(ids == e)
        got = sorted(zip(rows[offsets[e]:offsets[e + 1]].tolist(), row_w[offsets[e]:offsets[e + 1]].tolist()))
        assert got == sorted(zip(t_idx.tolist(), w[t_idx, j_idx].tolist()))


def scaled_rows(name, n_rows, ncols, rng, rms):
    """Random valid rows of type `name` whose dequantized values have about this root mean square: random_rows' fp16
    block scales (or float values, MXFP4's power-of-two exponents, NVFP4's UE4M3 scales) rescaled after measuring.
    Raw random K-quant
    blocks reach |w| ~ 50 (6-bit sub-scales times 4-bit quants), which no real model has and which overflows the fp16
    SwiGLU output; real expert weights have an RMS near 1/sqrt(n_in)."""
    q = qtype(name)
    raw = random_rows(name, n_rows, ncols, rng, 0.05)
    s = float(rms) / float(np.sqrt(np.mean(dequantize(raw, q.ggml).astype(np.float64) ** 2)))
    if name in ("F32", "F16", "BF16"):
        if name == "BF16":
            vals = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32) * s
            raw = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            dt = np.float32 if name == "F32" else np.float16
            raw = (raw.view(dt).astype(np.float32) * s).astype(dt).view(np.uint8)
    else:
        blocks = raw.reshape(-1, q.block_bytes).copy()
        if name == "MXFP4":
            shift = int(np.round(np.log2(s)))
            blocks[:, 0] = np.clip(blocks[:, 0].astype(np.int64) + shift, 1, 254).astype(np.uint8)
        if name == "NVFP4":     # UE4M3 holds the raw scale, UE4M3 (the table) its half: 3 mantissa bits, rounded
            blocks[:, :4] = fp32_to_ue4m3(2 * UE4M3[blocks[:, :4]] * np.float32(s))
        for off in q.f16_offsets:
            d = blocks[:, off:off + 2].copy().view(np.float16).astype(np.float32) * s
            blocks[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        raw = blocks.reshape(raw.shape)
    got = float(np.sqrt(np.mean(dequantize(raw, q.ggml).astype(np.float64) ** 2)))
    assert abs(got / rms - 1) < {"MXFP4": 0.5, "NVFP4": 0.1}.get(name, 0.05), (name, got, rms)
    return raw


def expert_blobs(rng, name, E, n_embd, n_ff, gain=1.0, up=None, down=None):
    """E expert blobs (gate | up | down) in one device array, and their dequantized weights rounded to fp16. Weights
    at a real model's scale (RMS gain / sqrt(n_in)), so gate, up and the SwiGLU output are O(gain^2). up, down: their
    quant types when they differ from gate's (name); rb_gu is then gate's row bytes."""
    qs = [qtype(t) for t in (name, up or name, down or name)]
    rb_gu, rb_u, rb_d = qs[0].row_bytes(n_embd), qs[1].row_bytes(n_embd), qs[2].row_bytes(n_ff)
    up_off, down_off = n_ff * rb_gu, n_ff * (rb_gu + rb_u)
    stride = -(-(down_off + n_embd * rb_d) // ALIGN) * ALIGN
    host = np.zeros(E * stride, np.uint8)
    Ws = []
    for e in range(E):
        g = scaled_rows(qs[0].name, n_ff, n_embd, rng, gain / np.sqrt(n_embd))
        u = scaled_rows(qs[1].name, n_ff, n_embd, rng, gain / np.sqrt(n_embd))
        d = scaled_rows(qs[2].name, n_embd, n_ff, rng, 1 / np.sqrt(n_ff))
        o = e * stride
        for raw, off in ((g, 0), (u, up_off), (d, down_off)):
            host[o + off:o + off + raw.size] = raw.reshape(-1)
        Ws.append(tuple(f16(dequantize(raw, q.ggml).reshape(raw.shape[0], -1)) for raw, q in zip((g, u, d), qs)))
    return cp.asarray(host), stride, up_off, down_off, rb_gu, rb_d, Ws


@pytest.mark.parametrize("name", QTS)
@pytest.mark.parametrize("T,k,E,n_embd,n_ff", [(1, 2, 4, 256, 256), (45, 2, 4, 512, 256),
                                                (300, 4, 8, 256, 768), (150, 2, 3, 768, 512)])
def test_grouped_expert_gemms(moe_mod, name, T, k, E, n_embd, n_ff):
    rng = np.random.default_rng()
    blobs, stride, up_off, down_off, rb_gu, rb_d, Ws = expert_blobs(rng, name, E, n_embd, n_ff)
    ids, w = route(rng, T, k, E)
    x = rng.standard_normal((T, n_embd)).astype(np.float32)
    x0 = rng.standard_normal((T, n_embd)).astype(np.float32)
    offsets, rows, row_w = sort(moe_mod, ids, w, E)
    xh = cp.full(T * n_embd, 0xFFFF, dtype=cp.uint16)          # NaN bits until converted
    moe_mod.get_function("to_half")((64,), (256,), (cp.asarray(x), xh, I64(T * n_embd)))
    assert (xh.view(cp.float16).get().astype(np.float32) == f16(x).reshape(-1)).all()
    h = cp.full(T * k * n_ff, 0xFFFF, dtype=cp.uint16)
    out = cp.asarray(x0)
    base = int(blobs.data.ptr)
    # two launches over disjoint expert sets, as the resident group and a ring batch run: one with a single block
    # per expert along the rows (it loops over every row tile), one with the pass's own count
    from engine.cuda.prefill import expert_row_blocks
    for part, grid_y in ((list(range(0, E, 2)), 1), (list(range(1, E, 2)), expert_row_blocks(T, k, E))):
        sel = cp.asarray(np.array(part, np.int32))
        ptrs = cp.asarray(np.array([base + e * stride for e in part], np.uint64))
        moe_mod.get_function(f"moe_gemm_gate_up<{qtype(name).id}>")(
            ((n_ff + 63) // 64, grid_y, len(part)), (256,),
            (sel, ptrs, offsets, rows, xh, h, I64(up_off), I64(rb_gu), I32(n_ff), I32(n_embd)))
        moe_mod.get_function(f"moe_gemm_down<{qtype(name).id}>")(
            ((n_embd + 63) // 64, grid_y, len(part)), (256,),
            (sel, ptrs, offsets, rows, row_w, h, out, I64(down_off), I64(rb_d), I32(n_embd), I32(n_ff)))
    ref = x0.astype(np.float64).copy()
    xr = f16(x).astype(np.float64)
    for t in range(T):
        for j in range(k):
            G, U, D = Ws[ids[t, j]]
            hh = f16(silu(G @ xr[t]) * (U @ xr[t]))
            ref[t] += w[t, j] * (D @ hh)
    assert np.isfinite(h.view(cp.float16).get()).all()
    assert rel(out.get() - x0, ref - x0) < 5e-3


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_grouped_expert_gemms_one_row_tile_per_pass(name):
    """moe_gemm.cu built with MG_MT=1 (bench.prefill --moe-row-tiles 1): one 64-row tile per dequantized weight tile."""
    from engine.cuda.prefill import moe_module
    test_grouped_expert_gemms(moe_module([name], row_tiles=1), name, 300, 4, 8, 256, 768)


MIXED = (("Q4_K", "Q5_K", "Q4_K"), ("Q6_K", "Q4_K", "Q6_K"), ("F16", "Q6_K", "F16"), ("Q8_0", "Q4_0", "Q4_K"),
         ("Q2_0", "NVFP4", "Q1_0"), ("Q1_0", "Q2_0", "Q2_0"))


@pytest.fixture(scope="module")
def moe_mod_mixed():
    from engine.cuda.prefill import moe_module
    return moe_module(QTS, pairs=[(g, u) for g, u, _ in MIXED])


@pytest.mark.parametrize("gate,up,down", MIXED)
@pytest.mark.parametrize("T,k,E,n_embd,n_ff", [(45, 2, 4, 512, 256), (300, 4, 8, 256, 768)])
def test_grouped_gate_up_of_two_types(moe_mod_mixed, gate, up, down, T, k, E, n_embd, n_ff):
    """moe_gemm_gate_up_mixed<QG, QU>: a layer whose gate and up differ in quant type (and in row bytes), poisoned h,
    against NumPy; then down of a third type over it."""
    mod = moe_mod_mixed
    rng = np.random.default_rng()
    blobs, stride, up_off, down_off, rb_g, rb_d, Ws = expert_blobs(rng, gate, E, n_embd, n_ff, up=up, down=down)
    rb_u = qtype(up).row_bytes(n_embd)
    ids, w = route(rng, T, k, E)
    x = rng.standard_normal((T, n_embd)).astype(np.float32)
    x0 = rng.standard_normal((T, n_embd)).astype(np.float32)
    offsets, rows, row_w = sort(mod, ids, w, E)
    xh = cp.asarray(f16(x).astype(np.float16)).view(cp.uint16).reshape(-1)
    h = cp.full(T * k * n_ff, 0xFFFF, dtype=cp.uint16)
    out = cp.asarray(x0)
    sel = cp.arange(E, dtype=cp.int32)
    ptrs = cp.asarray(np.array([int(blobs.data.ptr) + e * stride for e in range(E)], np.uint64))
    mod.get_function(f"moe_gemm_gate_up_mixed<{qtype(gate).id}, {qtype(up).id}>")(
        ((n_ff + 63) // 64, 2, E), (256,),
        (sel, ptrs, offsets, rows, xh, h, I64(up_off), I64(rb_g), I64(rb_u), I32(n_ff), I32(n_embd)))
    mod.get_function(f"moe_gemm_down<{qtype(down).id}>")(
        ((n_embd + 63) // 64, 2, E), (256,),
        (sel, ptrs, offsets, rows, row_w, h, out, I64(down_off), I64(rb_d), I32(n_embd), I32(n_ff)))
    ref = x0.astype(np.float64).copy()
    xr = f16(x).astype(np.float64)
    for t in range(T):
        for j in range(k):
            G, U, D = Ws[ids[t, j]]
            ref[t] += w[t, j] * (D @ f16(silu(G @ xr[t]) * (U @ xr[t])))
    assert np.isfinite(h.view(cp.float16).get()).all()
    assert rel(out.get() - x0, ref - x0) < 5e-3


def test_swiglu_output_saturates_in_fp16(moe_mod):
    """h is fp16: a SwiGLU output past 65504 is kept as +-65504 (not inf, which would make the token's down
    projection inf/NaN); the others are as computed."""
    rng = np.random.default_rng()
    T, k, E, n_embd, n_ff = 64, 2, 2, 256, 256
    blobs, stride, up_off, down_off, rb_gu, rb_d, Ws = expert_blobs(rng, "F16", E, n_embd, n_ff, gain=400.0)
    ids, w = route(rng, T, k, E)
    x = rng.standard_normal((T, n_embd)).astype(np.float32)
    offsets, rows, row_w = sort(moe_mod, ids, w, E)
    xh = cp.asarray(f16(x).astype(np.float16)).view(cp.uint16).reshape(-1)
    h = cp.full(T * k * n_ff, 0xFFFF, dtype=cp.uint16)
    sel = cp.arange(E, dtype=cp.int32)
    ptrs = cp.asarray(np.array([int(blobs.data.ptr) + e * stride for e in range(E)], np.uint64))
    moe_mod.get_function(f"moe_gemm_gate_up<{qtype('F16').id}>")(
        ((n_ff + 63) // 64, (T + 63) // 64, E), (256,),
        (sel, ptrs, offsets, rows, xh, h, I64(up_off), I64(rb_gu), I32(n_ff), I32(n_embd)))
    got = h.view(cp.float16).get().astype(np.float64).reshape(T * k, n_ff)
    offs, rws = offsets.get(), rows.get()
    ref = np.zeros_like(got)
    xr = f16(x).astype(np.float64)
    for e in range(E):
        G, U, _ = Ws[e]
        for o in range(offs[e], offs[e + 1]):
            ref[o] = silu(G @ xr[rws[o]]) * (U @ xr[rws[o]])
    big = np.abs(ref) > 65504 * 1.01
    assert big.any() and (~big).any()                    # the data reaches past fp16 and stays inside it too
    assert np.isfinite(got).all()
    assert (got[big] == np.sign(ref[big]) * 65504).all()
    small = np.abs(ref) < 60000
    assert np.allclose(got[small], ref[small], rtol=5e-3, atol=1e-2 * np.abs(ref[small]).max())


def attention_ref(q, K, V, pos0, n_head, n_kv, hd, scale):
    """q: (T, n_head*hd); K, V: (n_kv, n, hd) float; causal from pos0."""
    T = q.shape[0]
    G = n_head // n_kv
    out = np.zeros((T, n_head * hd))
    for h in range(n_head):
        kh = h // G
        S = (q[:, h * hd:(h + 1) * hd].astype(np.float64) * scale) @ K[kh, :pos0 + T].T
        S[np.arange(T)[:, None] + pos0 < np.arange(pos0 + T)[None, :]] = -np.inf
        P = np.exp(S - S.max(1, keepdims=True))
        out[:, h * hd:(h + 1) * hd] = (P / P.sum(1, keepdims=True)) @ V[kh, :pos0 + T]
    return out


# hd 96: a lane's values cross a 32-value int8 scale block. The tensor-core kernel's tiles: 128 query rows (8 warps
# x 16 of the T * G rows per KV head), 64 keys (32 for hd > 128, where Q waits in shared memory); G 3 leaves tokens
# straddling row tiles and warps. Rows not a multiple of 128 leave idle warps in the last block; pos0 > 0 with
# T * G > 128 puts several diagonal tiles, and tiles no warp masks, after the earlier chunks' keys (the int8 path's
# raw tiles run two ahead: chunks of 1 to 6+ key tiles). The last two: a 4K context (a whole 4K prompt as one chunk,
# and the last 512 tokens of one).
SHAPES = [(1, 0, 4, 2, 64), (37, 5, 8, 2, 128), (100, 250, 32, 4, 128), (70, 0, 8, 8, 256), (33, 31, 16, 2, 32),
          (33, 31, 6, 2, 96), (41, 90, 12, 4, 128), (130, 7, 16, 2, 256), (200, 61, 6, 2, 128),
          (300, 129, 16, 2, 128), (150, 300, 4, 4, 64), (97, 200, 24, 2, 256)]
SHAPES_4K = [(4096, 0, 8, 1, 128), (512, 3584, 32, 4, 128)]


def attend(mod, int8, T, n_head, n_kv, args):
    """Launch as the engine does (its AttnKernel: the build's own rows per block, threads, shared memory)."""
    from engine.cuda.prefill import attn_kernel
    attn_kernel(mod, int8)(T, n_head, n_kv, args)


@pytest.mark.parametrize("T,pos0,n_head,n_kv,hd", SHAPES + SHAPES_4K)
def test_flash_attn_f16(T, pos0, n_head, n_kv, hd):
    check_f16(att_mod(hd), T, pos0, n_head, n_kv, hd)


def check_f16(mod, T, pos0, n_head, n_kv, hd):
    rng = np.random.default_rng()
    max_ctx = pos0 + T + 40
    kc = np.full((n_kv, max_ctx, hd), np.nan, np.float16)         # past the chunk: never read
    vc = kc.copy()
    kc[:, :pos0 + T] = rng.standard_normal((n_kv, pos0 + T, hd))
    vc[:, :pos0 + T] = rng.standard_normal((n_kv, pos0 + T, hd))
    q = rng.standard_normal((T, n_head * hd)).astype(np.float32)
    out = cp.full((T, n_head * hd), np.nan, cp.float32)
    scale = 1.0 / np.sqrt(hd)
    attend(mod, False, T, n_head, n_kv, (cp.asarray(q), cp.asarray(kc), cp.asarray(vc), out, I32(T), I32(pos0),
                                         I32(n_head), I32(n_kv), I32(hd), I32(max_ctx), F32(scale)))
    ref = attention_ref(q, kc.astype(np.float64), vc.astype(np.float64), pos0, n_head, n_kv, hd, scale)
    # fp16 operands on tensor cores: q (scaled) and the softmax weights are rounded to fp16, ~2^-11 each
    got = out.get()
    assert np.isfinite(got).all()
    assert rel(got, ref) < 1e-3
    assert np.abs(got - ref).max() < 1e-2 * np.abs(ref).max()


def rope_ref(x, cs, pos, n_rot, neox):
    out = x.copy()
    half = n_rot // 2
    for d in range(n_rot):
        if neox:
            i, partner, sign = (d, d + half, -1.0) if d < half else (d - half, d - half, 1.0)
        else:
            i, partner, sign = d // 2, d ^ 1, (1.0 if d & 1 else -1.0)
        out[d] = x[d] * cs[pos, i, 0] + sign * x[partner] * cs[pos, i, 1]
    return out


def dequant_i8(q, s):
    n_kv, n, hd = q.shape
    return (q.astype(np.float64).reshape(n_kv, n, hd // 32, 32) * s[..., None]).reshape(n_kv, n, hd)


@pytest.mark.parametrize("T,pos0,n_head,n_kv,hd", SHAPES)
def test_int8_kv_store_and_attention(T, pos0, n_head, n_kv, hd):
    mod = att_mod(hd)
    rng = np.random.default_rng()
    max_ctx = pos0 + T + 40
    eps = 1e-6
    n_rot = hd
    cs = rng.standard_normal((max_ctx, n_rot // 2, 2)).astype(np.float32)
    qn, kn = (rng.uniform(0.5, 1.5, hd).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((T, n_head * hd)).astype(np.float32)
    k = rng.standard_normal((T, n_kv * hd)).astype(np.float32)
    v = rng.standard_normal((T, n_kv * hd)).astype(np.float32)
    # earlier positions: already in the cache (quantized by the same kernel in an earlier call in real use)
    kq = cp.zeros((n_kv, max_ctx, hd), cp.int8)
    vq = cp.zeros((n_kv, max_ctx, hd), cp.int8)
    ks = cp.full((n_kv, max_ctx, hd // 32), np.nan, cp.float32)
    vs = cp.full((n_kv, max_ctx, hd // 32), np.nan, cp.float32)
    old_k = rng.integers(-127, 128, (n_kv, pos0, hd), dtype=np.int8)
    old_v = rng.integers(-127, 128, (n_kv, pos0, hd), dtype=np.int8)
    kq[:, :pos0], vq[:, :pos0] = cp.asarray(old_k), cp.asarray(old_v)
    ks[:, :pos0] = cp.asarray(rng.uniform(0.001, 0.02, (n_kv, pos0, hd // 32)).astype(np.float32))
    vs[:, :pos0] = cp.asarray(rng.uniform(0.001, 0.02, (n_kv, pos0, hd // 32)).astype(np.float32))
    d_q = cp.asarray(q)
    neox = 1
    # the chunk's K/V through the engine's int8 store (attention.cu's qk_rope_store_kv8, what KVCache.store launches)
    kernels.load("attention").get_function("qk_rope_store_kv8")((n_head + 2 * n_kv, T), (hd,),
                                             (d_q, cp.asarray(k), cp.asarray(v), cp.asarray(qn), cp.asarray(kn),
                                              cp.asarray(cs), NULL, I32(pos0), kq, ks, vq, vs, I32(n_head),
                                              I32(n_kv), I32(hd), I32(n_rot), I32(neox), F32(eps), I32(max_ctx)))

    def normed(x, w):
        return x / np.sqrt((x.astype(np.float64) ** 2).mean() + eps) * w

    q_ref = np.stack([np.concatenate([rope_ref(normed(q[t, h * hd:(h + 1) * hd], qn), cs, pos0 + t, n_rot, neox)
                                      for h in range(n_head)]) for t in range(T)])
    k_ref = np.stack([[rope_ref(normed(k[t, h * hd:(h + 1) * hd], kn), cs, pos0 + t, n_rot, neox)
                       for t in range(T)] for h in range(n_kv)])
    v_ref = v.reshape(T, n_kv, hd).transpose(1, 0, 2)
    assert rel(d_q.get(), q_ref) < 1e-5
    K8, V8 = dequant_i8(kq.get(), ks.get()), dequant_i8(vq.get(), vs.get())
    # int8 with a per-32 absmax scale: each value within half a step of the truth
    for got, want in ((K8[:, pos0:pos0 + T], k_ref), (V8[:, pos0:pos0 + T], v_ref)):
        step = np.abs(want).reshape(n_kv, T, hd // 32, 32).max(-1, keepdims=True) / 127
        assert (np.abs(got - want).reshape(n_kv, T, hd // 32, 32) <= step * 0.501 + 1e-5).all()
    out = cp.full((T, n_head * hd), np.nan, cp.float32)
    scale = 1.0 / np.sqrt(hd)
    attend(mod, True, T, n_head, n_kv, (d_q, kq, vq, ks, vs, out, I32(T), I32(pos0), I32(n_head), I32(n_kv),
                                        I32(hd), I32(max_ctx), F32(scale)))
    # the tile is held as fp16 in shared memory: the reference rounds the dequantized values the same way (and the
    # tensor cores round q and the softmax weights to fp16)
    ref = attention_ref(d_q.get(), f16(K8), f16(V8), pos0, n_head, n_kv, hd, scale)
    assert rel(out.get(), ref) < 1e-3


# The builds bench.prefill_attn --define can A/B against the default (32 rows a warp; 4 warps of 16 rows; two fp16
# stages), at shapes with partial blocks and diagonal tiles after earlier chunks, so a variant is known correct
# before it is timed.
VARIANTS = [{"FA_MT": 2, "FA_WARPS": 4}, {"FA_WARPS": 4}, {"FA_STAGES": 2}]
VARIANT_SHAPES = [(37, 5, 8, 2, 128), (300, 129, 16, 2, 128), (150, 300, 4, 4, 64), (33, 31, 6, 2, 96),
                  (512, 3584, 32, 4, 128)]


@pytest.mark.parametrize("defs", VARIANTS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("T,pos0,n_head,n_kv,hd", VARIANT_SHAPES)
def test_flash_attn_variant_builds(defs, T, pos0, n_head, n_kv, hd):
    mod = kernels.load("prefill_attn", {**defs, **({} if hd == 128 else {"FA_HD": hd})})
    check_f16(mod, T, pos0, n_head, n_kv, hd)
    # int8: a cache quantized here (the store kernel has its own test above), NaN scales past the chunk
    rng = np.random.default_rng()
    max_ctx = pos0 + T + 40
    kq, vq = (rng.integers(-127, 128, (n_kv, max_ctx, hd), dtype=np.int8) for _ in range(2))
    ks, vs = (np.full((n_kv, max_ctx, hd // 32), np.nan, np.float32) for _ in range(2))
    for sc in (ks, vs):
        sc[:, :pos0 + T] = rng.uniform(0.005, 0.02, (n_kv, pos0 + T, hd // 32))
    q = rng.standard_normal((T, n_head * hd)).astype(np.float32)
    out = cp.full((T, n_head * hd), np.nan, cp.float32)
    scale = 1.0 / np.sqrt(hd)
    attend(mod, True, T, n_head, n_kv, (cp.asarray(q), cp.asarray(kq), cp.asarray(vq), cp.asarray(ks),
                                        cp.asarray(vs), out, I32(T), I32(pos0), I32(n_head), I32(n_kv), I32(hd),
                                        I32(max_ctx), F32(scale)))
    n = pos0 + T
    K8, V8 = dequant_i8(kq[:, :n], ks[:, :n]), dequant_i8(vq[:, :n], vs[:, :n])
    ref = attention_ref(q, f16(K8), f16(V8), pos0, n_head, n_kv, hd, scale)
    got = out.get()
    assert np.isfinite(got).all()
    assert rel(got, ref) < 1e-3


# Every other type the decode path reads, at one size, after the rest (a misaligned load would poison the context for
# the tests after it; the decode kernels read the same blobs through the same dequant8).
OTHER_QTS = tuple(n for n in NAMES if n not in QTS)


@pytest.mark.parametrize("name", OTHER_QTS)
def test_grouped_expert_gemms_other_types(moe_mod_all, name):
    test_grouped_expert_gemms(moe_mod_all, name, 45, 2, 4, 512, 256)


@pytest.mark.parametrize("name", NAMES)
def test_dequant_rows_f16(moe_mod_all, name):
    """The dense projections' weights as fp16 for cuBLAS: every type, rows and columns as gguf dequantizes them."""
    rng = np.random.default_rng()
    rows, cols = 37, 512
    raw = scaled_rows(name, rows, cols, rng, 0.05)
    want = f16(dequantize(raw, qtype(name).ggml).reshape(rows, cols))
    out = cp.full(rows * cols, 0xFFFF, dtype=cp.uint16)
    moe_mod_all.get_function(f"dequant_rows_f16<{qtype(name).id}>")(
        (7,), (256,), (cp.asarray(raw), I64(raw.shape[1]), out, I32(rows), I32(cols)))
    got = out.view(cp.float16).get().astype(np.float32).reshape(rows, cols)
    assert np.isfinite(got).all()
    assert np.allclose(got, want, rtol=1e-3, atol=1e-6)
