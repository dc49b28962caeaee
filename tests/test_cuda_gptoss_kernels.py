"""gpt-oss's kernel features against NumPy (engine/arch/gptoss.py's pieces) on fresh random data at several sizes, every
output poisoned first: the decode attention with sinks, windows and a KV ring (attention.cu attn_gqa_rope_oss_*,
replayed position by position past the ring's wrap), the prompt pass's flash attention with the same (prefill_attn.cu
flash_attn_oss_*, chunk after chunk through KVCache.store's ring), the biased router (router.cu router_fused_bias),
the decode experts with biases and SWIGLU_OAI (moe_oss.cu) and the grouped GEMMs' OAI/BIAS variants (moe_gemm.cu).
The host-side ring rules run without a GPU."""
import numpy as np
import pytest

from engine.arch import gptoss
from engine.cuda.kv import KVCache, ring_rows

cp = pytest.importorskip("cupy")

from engine.cuda.launch import F32, I32, I64, NULL, U64, ptr  # noqa: E402
from engine.cuda.quant_types import qtype, random_rows  # noqa: E402
from engine.gguf_model import dequantize  # noqa: E402
from gpu_compare import rel  # noqa: E402


class Cfg:
    """The ModelConfig fields the attention pieces read."""

    def __init__(self, n_kv, group, hd, n_swa, swa_layers=(False, True)):
        self.n_head, self.n_head_kv, self.head_dim = n_kv * group, n_kv, hd
        self.n_layer, self.n_rot, self.rope_type, self.rms_eps = len(swa_layers), hd, "neox", 1e-5
        self.n_swa, self.swa_layers, self.arch = n_swa, tuple(swa_layers), "gpt-oss"

    def is_swa(self, il):
        return self.swa_layers[il]


# ---- host side (no GPU) ------------------------------------------------------------------------------------------
def test_ring_rows_hold_the_window_and_a_chunk():
    c = Cfg(8, 8, 64, 128, [True, False] * 12)
    rows = ring_rows(c, 32768, 4096)
    assert rows[0] == 4224 and rows[1] == 32768 and rows[0] >= 128 + 4096 - 1
    assert ring_rows(c, 1000, 4096) == [1000] * 24            # never more than the context
    # gpt-oss-20b at 32K, fp16: 12 window layers of 8 heads x 64 keep 4224 rows instead of 32768
    full, ring = KVCache.nbytes(c, 32768), KVCache.nbytes(c, 32768, rows=rows)
    assert full - ring == 2 * 12 * 8 * (32768 - 4224) * 128


# ---- on the GPU --------------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def K():  # noqa: N802
    from engine.cuda.families.gptoss import GptOssFamily
    from engine.cuda.kernels import ENGINE_FILES, Kernels
    return Kernels({qtype(t).id for t in ("F16", "F32", "Q8_0", "MXFP4")}, ENGINE_FILES + GptOssFamily.kernel_files)


def rope_table(n_pos, n_rot, rng):
    ang = rng.uniform(0, 2 * np.pi, (n_pos, n_rot // 2))
    return np.stack([np.cos(ang), np.sin(ang)], -1).astype(np.float32)


def rope(x, cs, pos):
    """neox RoPE of x (..., hd) at positions pos (...,) by the table cs (n_pos, hd/2, 2), float64."""
    half = x.shape[-1] // 2
    c, s = cs[pos, :, 0].astype(np.float64), cs[pos, :, 1].astype(np.float64)
    if x.ndim == 3:         # (T, heads, hd)
        c, s = c[:, None], s[:, None]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, a * s + b * c], -1)


def ref_attend(q, Ks, Vs, sinks, lo, hi, scale):
    """One query (n_head, hd) over keys lo..hi-1 of Ks/Vs (n_pos, n_kv, hd) with gpt-oss's sinks, float64."""
    n_head, hd = q.shape
    G = n_head // Ks.shape[1]
    out = np.empty((n_head, hd))
    for h in range(n_head):
        s = Ks[lo:hi, h // G] @ q[h] * scale
        p = gptoss.sink_softmax(s[None, None, :], sinks[h:h + 1].astype(np.float64))[0, 0]
        out[h] = p @ Vs[lo:hi, h // G]
    return out


def poison_kv(kv):
    for a in (kv.k, kv.v):
        if a.dtype == cp.float16:
            a.fill(np.nan)
    for a in (kv.k_scale, kv.v_scale):
        if a is not None:
            a.fill(np.nan)


@gpu
@pytest.mark.parametrize("dtype", ["f16", "int8"])
@pytest.mark.parametrize("n_kv,group,hd,n_swa,chunk,n_split", [(2, 4, 64, 16, 40, None), (1, 8, 64, 5, 20, 1),
                                                               (2, 2, 128, 40, 30, 4), (4, 8, 64, 128, 64, None)])
def test_decode_attention_sinks_window_ring(K, dtype, n_kv, group, hd, n_swa, chunk, n_split):
    """Step after step (as decode does), each new K/V written at its ring row and the token's attention over the window
    (layer 1) or everything (layer 0), with sinks, against NumPy at every position; the ring wraps twice."""
    from engine.cuda.families.gptoss import attn_variant
    from engine.cuda.kv import DecodeAttention
    rng = np.random.default_rng()
    c = Cfg(n_kv, group, hd, n_swa)
    max_ctx = 2048
    rows = ring_rows(c, max_ctx, chunk)
    kv = KVCache(c, max_ctx, dtype, rows)
    poison_kv(kv)
    sinks = [cp.asarray((rng.standard_normal(c.n_head) * 2).astype(np.float32)) for _ in range(2)]
    att = DecodeAttention(K, c, kv, n_split=n_split, variant=attn_variant(c, sinks))
    cs = rope_table(max_ctx, hd, rng)
    rope_d = cp.asarray(cs)
    scale = 1.0 / np.sqrt(hd)
    n_pos = 2 * rows[1] + 7
    tol = 2e-3 if dtype == "f16" else 3e-2
    for li in (1, 0):
        Ks = np.zeros((n_pos, n_kv, hd))
        Vs = np.zeros((n_pos, n_kv, hd))
        state = cp.zeros(8, cp.int32)
        worst = 0.0
        for pos in range(n_pos):
            q = rng.standard_normal(c.n_head * hd).astype(np.float32)
            k = rng.standard_normal(n_kv * hd).astype(np.float32)
            v = rng.standard_normal(n_kv * hd).astype(np.float32)
            Ks[pos] = rope(k.reshape(n_kv, hd).astype(np.float64), cs, np.full(n_kv, pos))
            Vs[pos] = v.reshape(n_kv, hd)
            state[1] = pos
            out = cp.full(c.n_head * hd, np.nan, cp.float32)
            att.part.fill(np.nan)
            if att.split:
                att.part_ml.fill(np.nan)
            att.step(K, li, cp.asarray(q), cp.asarray(k), cp.asarray(v), None, None, rope_d, out, state, F32(scale))
            if pos % 7 and pos < n_pos - 3:       # every position is written; most are checked
                continue
            qr = rope(q.reshape(c.n_head, hd).astype(np.float64), cs, np.full(c.n_head, pos))
            lo = max(0, pos + 1 - n_swa) if li == 1 else 0
            want = ref_attend(qr, Ks, Vs, sinks[li].get(), lo, pos + 1, scale)
            got = out.get().reshape(c.n_head, hd)
            assert np.isfinite(got).all(), (li, pos)
            worst = max(worst, rel(got, want))
        assert worst < tol, (li, worst)
        if not att.split:                         # attention.cu's last-block counters
            assert not att.counters.get().any()


@gpu
@pytest.mark.parametrize("dtype", ["f16", "int8"])
@pytest.mark.parametrize("n_kv,group,hd,n_swa,chunks", [(2, 4, 64, 16, (37, 64, 5, 100, 90)),
                                                         (1, 8, 64, 128, (150, 200, 1, 180)),
                                                         (2, 2, 128, 33, (70, 129, 128, 3))])
def test_prompt_attention_sinks_window_ring(dtype, n_kv, group, hd, n_swa, chunks):
    """Chunk after chunk: KVCache.store rotates q and k and writes K/V at their ring rows (a chunk that wraps in two
    pieces), flash_attn_oss_* attends each query to its window (layer 1) or all keys (layer 0) with the sinks."""
    from engine.cuda.kernels import Kernels
    from engine.cuda.prefill import attn_kernel, attn_module
    Kt = Kernels({qtype("F16").id})
    rng = np.random.default_rng()
    c = Cfg(n_kv, group, hd, n_swa)
    max_ctx = sum(chunks) + 64
    rows = ring_rows(c, max_ctx, max(chunks))
    assert rows[1] < sum(chunks)                   # the ring wraps
    kv = KVCache(c, max_ctx, dtype, rows)
    poison_kv(kv)
    fn = attn_kernel(attn_module(hd), dtype == "int8", oss=True)
    cs = rope_table(max_ctx, hd, rng)
    rope_d = cp.asarray(cs)
    scale = 1.0 / np.sqrt(hd)
    sinks = [(rng.standard_normal(c.n_head) * 2).astype(np.float32) for _ in range(2)]
    tol = 5e-3 if dtype == "f16" else 3e-2
    for li in (1, 0):
        Ks = np.zeros((max_ctx, n_kv, hd))
        Vs = np.zeros((max_ctx, n_kv, hd))
        pos0 = 0
        for T in chunks:
            q = rng.standard_normal((T, c.n_head * hd)).astype(np.float32)
            k = rng.standard_normal((T, n_kv * hd)).astype(np.float32)
            v = rng.standard_normal((T, n_kv * hd)).astype(np.float32)
            pos = np.arange(pos0, pos0 + T)
            Ks[pos0:pos0 + T] = rope(k.reshape(T, n_kv, hd).astype(np.float64), cs, pos)
            Vs[pos0:pos0 + T] = v.reshape(T, n_kv, hd)
            qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
            kv.store(Kt, c, li, qd, kd, vd, None, None, rope_d, None, pos0, T)
            qr = rope(q.reshape(T, c.n_head, hd).astype(np.float64), cs, pos)
            assert rel(qd.get().reshape(T, c.n_head, hd), qr) < 1e-5          # rotated in place
            out = cp.full((T, c.n_head * hd), np.nan, cp.float32)
            addrs = kv.layer(li) if dtype == "f16" else kv.layer_i8(li)
            if dtype == "int8":
                addrs = (addrs[0], addrs[2], addrs[1], addrs[3])      # flash_attn_*_i8: K, V, then their scales
            fn(T, c.n_head, n_kv, (qd, *(U64(a) for a in addrs), out, I32(T), I32(pos0), I32(c.n_head), I32(n_kv),
                                  I32(hd), I32(rows[li]), F32(scale), cp.asarray(sinks[li]),
                                  I32(n_swa if li == 1 else 0)))
            got = out.get().reshape(T, c.n_head, hd)
            assert np.isfinite(got).all(), (li, pos0, T)
            want = np.stack([ref_attend(qr[t], Ks, Vs, sinks[li], max(0, p + 1 - n_swa) if li == 1 else 0, p + 1,
                                        scale) for t, p in enumerate(pos)])
            assert rel(got, want) < tol, (li, pos0, T, rel(got, want))
            pos0 += T


@gpu
# F32 at gpt-oss-20b's own shape (32 x 2880: router.cu's ROUTER_F4 batch covers the row), at its boundary (3072) and
# past it (4000: the rest of the row through row_dot's loop)
@pytest.mark.parametrize("qt,E,k,n_embd", [("F32", 32, 4, 256), ("Q8_0", 128, 4, 2880), ("F32", 16, 4, 64),
                                          ("F32", 32, 4, 2880), ("F32", 32, 4, 3072), ("F32", 40, 4, 4000)])
def test_router_with_bias_softmaxes_the_chosen(K, qt, E, k, n_embd):
    from engine.cuda.launch import MV_WARPS, staged_bytes
    rng = np.random.default_rng()
    raw = random_rows(qt, E, n_embd, rng, 0.05)
    W = dequantize(raw, qtype(qt).ggml).reshape(E, n_embd).astype(np.float64)
    x = rng.standard_normal(n_embd).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, n_embd).astype(np.float32)
    bias = rng.standard_normal(E).astype(np.float32)
    logits = cp.full(E, np.nan, cp.float32)
    ids = cp.full(k, -1, cp.int32)
    wts = cp.full(k, np.nan, cp.float32)
    counter = cp.zeros(1, cp.int32)
    f = K("router_fused_bias", qtype(qt).id)
    nb = staged_bytes(n_embd)
    if nb > 48 * 1024:
        f.max_dynamic_shared_size_bytes = nb
    f(((E + MV_WARPS - 1) // MV_WARPS,), (32 * MV_WARPS,),
      (cp.asarray(raw), I64(raw.shape[1]), cp.asarray(x), cp.asarray(norm), F32(1e-5), I32(n_embd), logits, I32(E),
       I32(k), I32(1), F32(1.0), ids, wts, NULL, U64(0), U64(0), NULL, NULL, counter, cp.asarray(bias)),
      shared_mem=nb)
    xn = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5) * norm
    want_logits = W @ xn + bias
    got_logits = logits.get()
    assert rel(got_logits, want_logits) < 1e-5
    want_ids = gptoss.route_softmax_weight(want_logits[None], k)[0][0]
    assert ids.get().tolist() == want_ids.tolist()
    # the weights are exp of logit differences in the tens: judged on the kernel's own logits (fp32 sums' rounding
    # moves a weight by its logit's absolute error); the kernels flush subnormal floats to zero (fast math), so a
    # weight below FLT_MIN (~1.2e-38; a logit ~87 under the top one) may read 0
    np.testing.assert_allclose(wts.get(), gptoss.route_softmax_weight(got_logits[None], k)[1][0], rtol=1e-5,
                               atol=1.2e-38)


def expert_set(rng, qt, E, n_embd, n_ff):
    from test_cuda_prefill_kernels import expert_blobs
    blobs, stride, up_off, down_off, rb_gu, rb_d, Ws = expert_blobs(rng, qt, E, n_embd, n_ff, gain=3.0)
    bg, bu = (rng.standard_normal((E, n_ff)).astype(np.float32) * 2 for _ in range(2))
    bd = rng.standard_normal((E, n_embd)).astype(np.float32)
    return blobs, stride, up_off, down_off, rb_gu, rb_d, Ws, (bg, bu, bd)


def ref_experts(x, ids, w, Ws, biases, h_f16=False):
    bg, bu, bd = biases
    out = np.zeros((len(x), Ws[0][2].shape[0]))
    for t in range(len(x)):
        for j, e in enumerate(ids[t]):
            G, U, D = (a.astype(np.float64) for a in Ws[e])
            h = gptoss.swiglu_oai(G @ x[t] + bg[e], U @ x[t] + bu[e])
            if h_f16:
                h = h.astype(np.float16).astype(np.float64)
            out[t] += w[t, j] * (D @ h + bd[e])
    return out


@gpu
@pytest.mark.parametrize("qt", ["MXFP4", "Q8_0", "F16"])
@pytest.mark.parametrize("E,k,n_embd,n_ff", [(8, 4, 256, 128), (6, 4, 2880, 768), (16, 2, 512, 64)])
def test_decode_experts_with_biases_and_swiglu_oai(K, qt, E, k, n_embd, n_ff):
    """moe_gate_up_oai then moe_down_bias for one token, the experts through a pointer table, against NumPy."""
    from engine.cuda.launch import MV_WARPS, Launcher
    rng = np.random.default_rng()
    blobs, stride, up_off, down_off, rb_gu, rb_d, Ws, biases = expert_set(rng, qt, E, n_embd, n_ff)
    table = cp.asarray(np.array([int(blobs.data.ptr) + e * stride for e in range(E)], np.uint64))
    ids = rng.choice(E, k, replace=False).astype(np.int32)
    w = rng.uniform(0.1, 1.0, k).astype(np.float32)
    x = rng.standard_normal(n_embd).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, n_embd).astype(np.float32)
    h = cp.full(k * n_ff, np.nan, cp.float32)
    x0 = rng.standard_normal(n_embd).astype(np.float32)
    out = cp.asarray(x0)
    bg, bu, bd = (cp.asarray(b) for b in biases)
    mv = Launcher(K, type("C", (), {"rms_eps": 1e-5})())
    f = K("moe_gate_up_oai", qtype(qt).id)
    f(((n_ff + MV_WARPS - 1) // MV_WARPS, k, 1), (32 * MV_WARPS,),
      (table, cp.asarray(ids), I64(up_off), I64(rb_gu), cp.asarray(x), cp.asarray(norm), F32(1e-5), h, I32(n_ff),
       I32(n_embd), I32(k), bg, bu), shared_mem=mv.smem(f, n_embd, True))
    for stage in (True, False):
        o = cp.asarray(x0)
        f = K("moe_down_bias", qtype(qt).id)
        sm = mv.smem(f, k * n_ff, False, optional_max=100 * 1024 if stage else 0)
        f(((n_embd + MV_WARPS - 1) // MV_WARPS, 1), (32 * MV_WARPS,),
          (table, cp.asarray(ids), cp.asarray(w), I64(down_off), I64(rb_d), h, o, I32(n_embd), I32(n_ff), I32(k),
           I32(1 if sm else 0), bd), shared_mem=sm)
        xn = (x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5) * norm)
        want = ref_experts(xn[None], ids[None], w[None], Ws, biases)[0]
        assert rel(o.get() - x0, want) < 2e-3, (stage, rel(o.get() - x0, want))
    del out


@gpu
@pytest.mark.parametrize("qt", ["MXFP4", "Q8_0"])
@pytest.mark.parametrize("T,k,E,n_embd,n_ff", [(1, 4, 8, 256, 128), (300, 4, 16, 512, 256), (97, 2, 4, 2880, 64)])
def test_grouped_gemms_with_biases_and_swiglu_oai(qt, T, k, E, n_embd, n_ff):
    """The prompt pass's moe_gemm_gate_up_oai / moe_gemm_down_bias over two disjoint expert groups (resident and a
    ring batch), against NumPy with fp16 activations as the GEMMs take them."""
    from engine.cuda.prefill import expert_row_blocks, moe_module
    from test_cuda_prefill_kernels import f16, route, sort
    mod = moe_module([qt])
    rng = np.random.default_rng()
    blobs, stride, up_off, down_off, rb_gu, rb_d, Ws, biases = expert_set(rng, qt, E, n_embd, n_ff)
    ids, w = route(rng, T, k, E)
    x = rng.standard_normal((T, n_embd)).astype(np.float32)
    x0 = rng.standard_normal((T, n_embd)).astype(np.float32)
    offsets, rows, row_w = sort(mod, ids, w, E)
    xh = cp.full(T * n_embd, 0xFFFF, dtype=cp.uint16)
    mod.get_function("to_half")((64,), (256,), (cp.asarray(x), xh, I64(T * n_embd)))
    h = cp.full(T * k * n_ff, 0xFFFF, dtype=cp.uint16)
    out = cp.asarray(x0)
    bg, bu, bd = (cp.asarray(b) for b in biases)
    base = int(blobs.data.ptr)
    for part, grid_y in ((list(range(0, E, 2)), 1), (list(range(1, E, 2)), expert_row_blocks(T, k, E))):
        sel = cp.asarray(np.array(part, np.int32))
        ptrs = cp.asarray(np.array([base + e * stride for e in part], np.uint64))
        mod.get_function(f"moe_gemm_gate_up_oai<{qtype(qt).id}>")(
            ((n_ff + 63) // 64, grid_y, len(part)), (256,),
            (sel, ptrs, offsets, rows, xh, h, I64(up_off), I64(rb_gu), I32(n_ff), I32(n_embd), bg, bu))
        mod.get_function(f"moe_gemm_down_bias<{qtype(qt).id}>")(
            ((n_embd + 63) // 64, grid_y, len(part)), (256,),
            (sel, ptrs, offsets, rows, row_w, h, out, I64(down_off), I64(rb_d), I32(n_embd), I32(n_ff), bd))
    assert np.isfinite(h.view(cp.float16).get()).all()
    want = ref_experts(f16(x).astype(np.float64), ids, w, Ws, biases, h_f16=True)
    assert rel(out.get() - x0, want) < 5e-3
