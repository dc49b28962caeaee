"""The engine's decode kernels (cuda_src: dense, norm_rope, attention, router, moe, sample) against NumPy on fresh
random data at several sizes, every output poisoned (NaN) before the launch."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine.cuda.launch import F32, I32, I64, NULL, U64, MappedInts, ptr  # noqa: E402
from engine.cuda.launch import staged_bytes  # noqa: E402
from engine.cuda.quant_types import qtype, random_rows  # noqa: E402
from engine.gguf_model import dequantize  # noqa: E402
from gpu_compare import rel  # noqa: E402

# Types whose blocks keep the loads quant.cuh makes aligned at any row length; every type's dot product and
# dequantization is tests/test_cuda_quant.py's subject, these tests are about the kernels around them. NEW: issue 35's
# types (64- and 128-value blocks, 18 and 36 bytes), in every kernel that reads a quantized row.
NEW = ("Q2_0", "Q1_0", "NVFP4")
QTS = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_K", "Q4_K", "Q6_K", *NEW)


@pytest.fixture(scope="module")
def K():
    from engine.cuda.kernels import Kernels
    return Kernels({qtype(n).id for n in QTS})


def poisoned(shape, dtype=np.float32):
    return cp.full(shape, np.nan, dtype=dtype)


def rel_to(a, b, scale):
    """|a - b| relative to a scale that cannot cancel (|W| @ |x| for a mat-vec): a result near zero from large
    terms (one output row of -0.008) is as accurate as its terms, not as its own size."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(scale), 1e-30))


def rms_ref(x, w, eps=1e-6):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w


def rand_matrix(name, rows, cols, rng):
    raw = random_rows(name, rows, cols, rng)
    ref = dequantize(raw, qtype(name).ggml).reshape(rows, cols)
    return raw, ref


@pytest.mark.parametrize("name", QTS)
@pytest.mark.parametrize("rows,cols,rpw", [(1, 256, 1), (37, 512, 3), (300, 2048, 1), (70, 4096, 2), (3, 6144, 1)])
def test_mv_epilogues(K, name, rows, cols, rpw):
    """x read from global memory, staged in shared memory, and staged with the RMSNorm applied per block."""
    rng = np.random.default_rng()
    raw, W = rand_matrix(name, rows, cols, rng)
    x = rng.standard_normal(cols).astype(np.float32) * 2
    nw = rng.standard_normal(cols).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    y0 = rng.standard_normal(rows).astype(np.float32)
    g = np.float32(rng.standard_normal())
    d_raw, d_x, d_b, d_g, d_nw = (cp.asarray(a) for a in (raw, x, bias, np.array([g]), nw))
    f = K("mv", qtype(name).id)
    rb = raw.shape[1]
    grid = ((rows + 4 * rpw - 1) // (4 * rpw),)
    Wd = W.astype(np.float64)
    for stage, norm in ((0, False), (1, False), (1, True)):
        xin = rms_ref(x, nw) if norm else x.astype(np.float64)
        ref = Wd @ xin
        scale = np.abs(Wd) @ np.abs(xin)
        y = poisoned(rows)
        f(grid, (128,), (ptr(d_raw), I64(rb), ptr(d_x), ptr(y), NULL, NULL, I32(rows), I32(cols), I32(0),
                         ptr(d_nw) if norm else NULL, F32(1e-6), I32(stage), I32(rpw)),
          shared_mem=staged_bytes(cols) if stage else 0)
        assert rel_to(y.get(), ref, scale) < 1e-5, (stage, norm)
        # accumulate, bias and the sigmoid gate
        y = cp.asarray(y0)
        f(grid, (128,), (ptr(d_raw), I64(rb), ptr(d_x), ptr(y), ptr(d_b), ptr(d_g), I32(rows), I32(cols), I32(1),
                         ptr(d_nw) if norm else NULL, F32(1e-6), I32(stage), I32(rpw)),
          shared_mem=staged_bytes(cols) if stage else 0)
        gate = 1 / (1 + np.exp(-np.float64(g)))
        assert rel_to(y.get(), y0 + (ref + bias) * gate, np.abs(y0) + (scale + np.abs(bias)) * gate) < 1e-5


@pytest.mark.parametrize("name", ("Q4_K", "Q8_0", "Q6_K", *NEW))
@pytest.mark.parametrize("rows,cols,norm", [(5, 256, False), (200, 1024, True), (9, 4096, True)])
def test_swiglu_mv(K, name, rows, cols, norm):
    rng = np.random.default_rng()
    rg, Wg = rand_matrix(name, rows, cols, rng)
    ru, Wu = rand_matrix(name, rows, cols, rng)
    x = rng.standard_normal(cols).astype(np.float32)
    nw = rng.standard_normal(cols).astype(np.float32)
    h = poisoned(rows)
    K("swiglu_mv", qtype(name).id)(((rows + 3) // 4,), (128,),
                                   (cp.asarray(rg), cp.asarray(ru), I64(rg.shape[1]), cp.asarray(x),
                                    cp.asarray(nw) if norm else NULL, F32(1e-6), ptr(h), I32(rows), I32(cols)),
                                   shared_mem=staged_bytes(cols))
    xin = rms_ref(x, nw) if norm else x.astype(np.float64)
    g, u = Wg.astype(np.float64) @ xin, Wu.astype(np.float64) @ xin
    assert rel(h.get(), g / (1 + np.exp(-g)) * u) < 1e-4


@pytest.mark.parametrize("name", QTS)
def test_embed_and_dequant_rows(K, name):
    rng = np.random.default_rng()
    rows, cols = 50, 512
    raw, W = rand_matrix(name, rows, cols, rng)
    d_raw = cp.asarray(raw)
    toks = rng.integers(0, rows, size=7).astype(np.int32)
    out = poisoned((7, cols))
    K("embed", qtype(name).id)((7,), (256,), (ptr(d_raw), I64(raw.shape[1]), cp.asarray(toks), NULL, NULL,
                                             ptr(out), I32(cols)))
    np.testing.assert_allclose(out.get(), W[toks], rtol=1e-6, atol=1e-6)
    full = poisoned((rows, cols))
    K("dequant_rows", qtype(name).id)((64,), (256,), (ptr(d_raw), I64(raw.shape[1]), ptr(full), I32(rows),
                                                      I32(cols)))
    np.testing.assert_allclose(full.get(), W, rtol=1e-6, atol=1e-6)


def test_embed_decode_params(K):
    """In a decode step the token comes from mapped host memory and the step state is reset."""
    rng = np.random.default_rng()
    raw, W = rand_matrix("Q8_0", 20, 256, rng)
    params = MappedInts(2)
    params.view[:] = [13, 41]
    state = cp.full(8, -5, dtype=cp.int32)
    out = poisoned(256)
    K("embed", qtype("Q8_0").id)((1,), (256,), (cp.asarray(raw), I64(raw.shape[1]), NULL, params.dptr,
                                               ptr(state), ptr(out), I32(256)))
    np.testing.assert_allclose(out.get(), W[13], rtol=1e-6)
    assert list(state.get()[:5]) == [13, 41, 0, 0, 0]
    params.close()


@pytest.mark.parametrize("rows,n", [(1, 256), (9, 2048), (3, 1000)])
def test_rmsnorm(K, rows, n):
    rng = np.random.default_rng()
    x = rng.standard_normal((rows, n)).astype(np.float32) * 3
    w = rng.standard_normal(n).astype(np.float32)
    out = poisoned((rows, n))
    K("rmsnorm")((rows,), (256,), (cp.asarray(x), cp.asarray(w), ptr(out), I32(n), F32(1e-6)))
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    assert rel(out.get(), ref) < 1e-5


def _rope_ref(x, cos, sin, n_rot, neox):
    x = x.astype(np.float64).copy()
    if neox:
        h = n_rot // 2
        a, b = x[..., :h].copy(), x[..., h:n_rot].copy()
        x[..., :h] = a * cos - b * sin
        x[..., h:n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2].copy(), x[..., 1:n_rot:2].copy()
        x[..., 0:n_rot:2] = a * cos - b * sin
        x[..., 1:n_rot:2] = a * sin + b * cos
    return x


@pytest.mark.parametrize("neox", [0, 1])
@pytest.mark.parametrize("head_dim,n_rot,norm", [(64, 64, True), (128, 128, False), (128, 64, True)])
def test_qk_rope_store(K, neox, head_dim, n_rot, norm):
    rng = np.random.default_rng()
    n_head, n_kv, T, max_ctx, pos0 = 4, 2, 3, 16, 5
    q = rng.standard_normal((T, n_head, head_dim)).astype(np.float32)
    k = rng.standard_normal((T, n_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((T, n_kv, head_dim)).astype(np.float32)
    qn = rng.standard_normal(head_dim).astype(np.float32) if norm else None
    kn = rng.standard_normal(head_dim).astype(np.float32) if norm else None
    ang = rng.uniform(0, 6, size=(max_ctx, n_rot // 2))
    cs = np.stack([np.cos(ang), np.sin(ang)], -1).astype(np.float32)
    dq = cp.asarray(q)
    kc = cp.full((n_kv, max_ctx, head_dim), np.nan, dtype=cp.float16)
    vc = cp.full((n_kv, max_ctx, head_dim), np.nan, dtype=cp.float16)
    K("qk_rope_store")((n_head + 2 * n_kv, T), (head_dim,),
                       (ptr(dq), cp.asarray(k), cp.asarray(v), (cp.asarray(qn) if norm else NULL),
                        (cp.asarray(kn) if norm else NULL), cp.asarray(cs), NULL, I32(pos0), ptr(kc),
                        ptr(vc), I32(n_head), I32(n_kv), I32(head_dim), I32(n_rot), I32(neox), F32(1e-6),
                        I32(max_ctx)))

    def nrm(a, w):
        return a / np.sqrt((a.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w if norm else a

    c, s = cs[pos0:pos0 + T, :, 0][:, None, :], cs[pos0:pos0 + T, :, 1][:, None, :]
    assert rel(dq.get(), _rope_ref(nrm(q, qn), c, s, n_rot, neox)) < 1e-5
    kk = kc.get().astype(np.float32).transpose(1, 0, 2)[pos0:pos0 + T]
    assert rel(kk, _rope_ref(nrm(k, kn), c, s, n_rot, neox)) < 2e-3
    vv = vc.get().astype(np.float32).transpose(1, 0, 2)[pos0:pos0 + T]
    assert rel(vv, v) < 2e-3


@pytest.mark.parametrize("spread", [2.0, 300.0])       # 300: most exp(logit - max) underflow to 0 in fp32
@pytest.mark.parametrize("n_expert,k,renorm", [(8, 2, 1), (128, 8, 1), (60, 4, 0), (512, 10, 1)])
def test_router_topk(K, n_expert, k, renorm, spread):
    rng = np.random.default_rng()
    T = 5
    logits = (rng.standard_normal((T, n_expert)) * spread).astype(np.float32)
    ids = cp.full((T, k), -1, dtype=cp.int32)
    wts = poisoned((T, k))
    counts = cp.zeros(n_expert, dtype=cp.int32)
    stats = cp.zeros(2, dtype=cp.uint64)
    slot_lo, slot_hi = 1000, 2000
    table = rng.choice([1500, 5000], size=n_expert).astype(np.uint64)   # 1500: inside the slot range
    K("router_topk")((T,), (32,), (cp.asarray(logits), I32(n_expert), I32(k), I32(renorm), F32(1.5),
                                    ptr(ids), ptr(wts), cp.asarray(table), U64(slot_lo), U64(slot_hi),
                                    ptr(counts), ptr(stats)))
    lg = logits.astype(np.float64)
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref_ids = np.argsort(-lg, axis=-1, kind="stable")[:, :k]      # by logit: probabilities may underflow to ties
    ref_w = np.take_along_axis(p, ref_ids, -1)
    if renorm:
        ref_w = ref_w / ref_w.sum(-1, keepdims=True)
    ref_w *= 1.5
    np.testing.assert_array_equal(ids.get(), ref_ids)
    np.testing.assert_allclose(wts.get(), ref_w, rtol=1e-5, atol=1e-30)
    np.testing.assert_array_equal(counts.get(), np.bincount(ref_ids.ravel(), minlength=n_expert))
    assert int(stats.get()[0]) == int((table[ref_ids] == 1500).sum())
    assert int(stats.get()[1]) == T * k


@pytest.mark.parametrize("qg,qd", [("Q4_K", "Q4_K"), ("Q4_K", "Q6_K"), ("Q8_0", "Q5_K"), ("Q2_0", "Q2_0"),
                                   ("Q1_0", "Q1_0"), ("NVFP4", "NVFP4"), ("Q2_0", "Q4_K")])
@pytest.mark.parametrize("n_embd,n_ff,k,T", [(256, 256, 2, 1), (512, 768, 8, 1), (256, 512, 4, 3),
                                             (4096, 256, 2, 1), (256, 1024, 8, 1)])
def test_moe_through_table(K, qg, qd, n_embd, n_ff, k, T):
    """Experts in VRAM and in mapped pinned host memory, read through one pointer table; gate/up on the FFN-normed
    x (the norm applied per block); down with h from global memory and staged in shared memory."""
    from engine.cuda.arena import HOST_ALLOC_MAPPED, HOST_ALLOC_PORTABLE
    rng = np.random.default_rng()
    n_expert = 16
    raws, refs = [], []
    for e in range(n_expert):
        g, Wg = rand_matrix(qg, n_ff, n_embd, rng)
        u, Wu = rand_matrix(qg, n_ff, n_embd, rng)
        d, Wd = rand_matrix(qd, n_embd, n_ff, rng)
        raws.append(np.concatenate([g.ravel(), u.ravel(), d.ravel()]))
        refs.append((Wg, Wu, Wd))
    nb = raws[0].size
    stride = (nb + 255) // 256 * 256
    dev = cp.zeros(n_expert * stride, dtype=cp.uint8)
    hp = cp.cuda.runtime.hostAlloc(n_expert * stride, HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED)
    try:
        import ctypes
        host = np.ctypeslib.as_array((ctypes.c_uint8 * (n_expert * stride)).from_address(hp))
        from engine.cuda.arena import device_address
        dp = device_address(hp)
        table = np.zeros(n_expert, dtype=np.uint64)
        for e in range(n_expert):
            if e % 2:
                host[e * stride:e * stride + nb] = raws[e]
                table[e] = dp + e * stride
            else:
                dev[e * stride:e * stride + nb] = cp.asarray(raws[e])
                table[e] = dev.data.ptr + e * stride
        ids = np.stack([rng.choice(n_expert, size=k, replace=False) for _ in range(T)]).astype(np.int32)
        w = rng.uniform(0.1, 1, size=(T, k)).astype(np.float32)
        x = rng.standard_normal((T, n_embd)).astype(np.float32)
        nw = rng.standard_normal(n_embd).astype(np.float32)
        up_off = n_ff * random_rows(qg, 1, n_embd, rng).shape[1]
        rb_g = up_off // n_ff
        rb_d = random_rows(qd, 1, n_ff, rng).shape[1]
        h = poisoned((T, k, n_ff))
        d_table, d_ids = cp.asarray(table), cp.asarray(ids)
        K("moe_gate_up", qtype(qg).id)(((n_ff + 3) // 4, k, T), (128,),
                                       (ptr(d_table), ptr(d_ids), I64(up_off), I64(rb_g), cp.asarray(x),
                                        cp.asarray(nw), F32(1e-6), ptr(h), I32(n_ff), I32(n_embd), I32(k)),
                                       shared_mem=staged_bytes(n_embd))
        xn = rms_ref(x, nw)
        ref_h = np.zeros((T, k, n_ff))
        for t in range(T):
            for j in range(k):
                Wg, Wu, _ = refs[ids[t, j]]
                g, u = Wg.astype(np.float64) @ xn[t], Wu.astype(np.float64) @ xn[t]
                ref_h[t, j] = g / (1 + np.exp(-g)) * u
        assert rel(h.get(), ref_h) < 1e-4
        out0 = rng.standard_normal((T, n_embd)).astype(np.float32)
        ref = out0.astype(np.float64).copy()
        scale = np.abs(out0).astype(np.float64)
        h_in = h.get()
        for t in range(T):
            for j in range(k):
                Wd = refs[ids[t, j]][2].astype(np.float64)
                ref[t] += w[t, j] * (Wd @ h_in[t, j])
                scale[t] += w[t, j] * (np.abs(Wd) @ np.abs(h_in[t, j]))
        for stage in (0, 1):
            out = cp.asarray(out0)
            K("moe_down", qtype(qd).id)(((n_embd + 3) // 4, T), (128,),
                                        (ptr(d_table), ptr(d_ids), cp.asarray(w), I64(2 * up_off), I64(rb_d), ptr(h),
                                         ptr(out), I32(n_embd), I32(n_ff), I32(k), I32(stage)),
                                        shared_mem=staged_bytes(k * n_ff) if stage else 0)
            assert rel_to(out.get(), ref, scale) < 1e-5, stage
    finally:
        cp.cuda.runtime.freeHost(hp)


def q6k_down_ref(n_expert, n_embd, n_ff, k, T, rng):
    """Random Q6_K ffn_down blobs (behind a gate | up region of random bytes, as a Q4_K_M recipe's blob lies) and
    the NumPy result of out0 + sum_j w_j * down_{ids_j} @ h_j: (device pool, table, ids, w, h, out0, ref, scale,
    down_off, row_bytes)."""
    # gate and up as a recipe lays them: Q4_K rows where n_embd allows, else F16 (the small test widths)
    down_off = 2 * n_ff * (qtype("Q4_K").row_bytes(n_embd) if n_embd % 256 == 0 else 2 * n_embd)
    rb = qtype("Q6_K").row_bytes(n_ff)
    stride = (down_off + n_embd * rb + 255) // 256 * 256
    pool = rng.integers(0, 256, size=(n_expert, stride), dtype=np.uint8)     # gate/up and padding: noise
    Wds = []
    for e in range(n_expert):
        raw, Wd = rand_matrix("Q6_K", n_embd, n_ff, rng)
        pool[e, down_off:down_off + raw.size] = raw.ravel()
        Wds.append(Wd.astype(np.float64))
    ids = np.stack([rng.choice(n_expert, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1, size=(T, k)).astype(np.float32)
    h = (rng.standard_normal((T, k, n_ff)) * rng.uniform(0.1, 3)).astype(np.float32)
    out0 = rng.standard_normal((T, n_embd)).astype(np.float32)
    ref, scale = out0.astype(np.float64), np.abs(out0).astype(np.float64)
    for t in range(T):
        for j in range(k):
            Wd = Wds[ids[t, j]]
            ref[t] += w[t, j] * (Wd @ h[t, j])
            scale[t] += w[t, j] * (np.abs(Wd) @ np.abs(h[t, j]))
    return pool, ids, w, h, out0, ref, scale, down_off, rb


@pytest.mark.parametrize("n_embd,n_ff,k,T", [(8, 256, 1, 1), (256, 256, 2, 1), (2048, 768, 8, 1),
                                             (512, 1536, 8, 2), (136, 512, 4, 3), (1024, 768, 16, 1)])
def test_moe_down_q6k_tiles(K, n_embd, n_ff, k, T):
    """moe_down_q6k (Q6_K ffn_down through shared-memory tiles) against NumPy, through the pointer table; out starts
    from a random residual (it adds), the tiles' shared memory poisoned (NaN bytes) by an earlier launch's h."""
    from engine.cuda.launch import MOE_DOWN_TILE_ROWS, moe_down_tiled_bytes, moe_down_tiled_fits
    assert moe_down_tiled_fits("Q6_K", n_embd, n_ff, k)
    rng = np.random.default_rng()
    n_expert = max(k, 12)
    pool, ids, w, h, out0, ref, scale, down_off, rb = q6k_down_ref(n_expert, n_embd, n_ff, k, T, rng)
    dev = cp.asarray(pool)
    table = cp.asarray(np.uint64(dev.data.ptr) + np.arange(n_expert, dtype=np.uint64) * np.uint64(pool.shape[1]))
    f = K("moe_down_q6k")
    sm = moe_down_tiled_bytes(k, n_ff, rb)
    if sm > 48 * 1024:
        f.max_dynamic_shared_size_bytes = sm
    out = cp.asarray(out0)
    d_ids, d_w, d_h = cp.asarray(ids), cp.asarray(w), cp.asarray(h)
    args = (ptr(table), ptr(d_ids), ptr(d_w), I64(down_off), I64(rb), ptr(d_h), ptr(out), I32(n_embd), I32(n_ff),
            I32(k))
    grid = (n_embd // MOE_DOWN_TILE_ROWS, T)
    nan_h = poisoned((T, k, n_ff))           # a first launch on NaN h leaves NaN in shared memory and in scratch
    scratch = poisoned((T, n_embd))
    f(grid, (256,), (*args[:5], ptr(nan_h), ptr(scratch), *args[7:]), shared_mem=sm)
    f(grid, (256,), args, shared_mem=sm)
    got = out.get()
    assert np.isfinite(got).all()
    assert rel_to(got, ref, scale) < 1e-5
    # bit for bit the same on a second run (a fixed order of sums)
    out2 = cp.asarray(out0)
    f(grid, (256,), (*args[:6], ptr(out2), *args[7:]), shared_mem=sm)
    assert np.array_equal(out2.get(), got)


@pytest.mark.parametrize("qg,qu", [("Q4_K", "Q5_K"), ("Q6_K", "Q4_K"), ("F16", "Q6_K"), ("Q8_0", "Q4_K"),
                                   ("Q2_0", "NVFP4"), ("Q1_0", "Q2_0")])
@pytest.mark.parametrize("n_embd,n_ff,k,T", [(256, 256, 2, 1), (512, 768, 8, 1), (256, 512, 4, 3)])
def test_moe_proj_gate_and_up_of_two_types(K, qg, qu, n_embd, n_ff, k, T):
    """moe_proj's two launches (gate: h = g, then up: h = silu(h) * u) for a layer whose gate and up differ in quant
    type, each staging x for its own type, through the pointer table; h poisoned first."""
    rng = np.random.default_rng()
    n_expert = 10
    refs, raws = [], []
    for e in range(n_expert):
        g, Wg = rand_matrix(qg, n_ff, n_embd, rng)
        u, Wu = rand_matrix(qu, n_ff, n_embd, rng)
        raws.append(np.concatenate([g.ravel(), u.ravel()]))
        refs.append((Wg, Wu))
    nb = raws[0].size
    stride = (nb + 255) // 256 * 256
    dev = cp.zeros(n_expert * stride, dtype=cp.uint8)
    for e in range(n_expert):
        dev[e * stride:e * stride + nb] = cp.asarray(raws[e])
    table = cp.asarray(np.array([dev.data.ptr + e * stride for e in range(n_expert)], dtype=np.uint64))
    ids = np.stack([rng.choice(n_expert, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    x = rng.standard_normal((T, n_embd)).astype(np.float32)
    nw = rng.standard_normal(n_embd).astype(np.float32)
    rb_g, rb_u = qtype(qg).row_bytes(n_embd), qtype(qu).row_bytes(n_embd)
    h = poisoned((T, k, n_ff))
    d_ids, d_x, d_nw = cp.asarray(ids), cp.asarray(x), cp.asarray(nw)
    for qt, off, rb, mul in ((qg, 0, rb_g, 0), (qu, n_ff * rb_g, rb_u, 1)):
        K("moe_proj", qtype(qt).id)(((n_ff + 3) // 4, k, T), (128,),
                                    (ptr(table), ptr(d_ids), I64(off), I64(rb), d_x, d_nw, F32(1e-6), ptr(h),
                                     I32(n_ff), I32(n_embd), I32(k), I32(mul)),
                                    shared_mem=staged_bytes(n_embd))
    xn = rms_ref(x, nw)
    ref_h = np.zeros((T, k, n_ff))
    for t in range(T):
        for j in range(k):
            Wg, Wu = refs[ids[t, j]]
            g, u = Wg.astype(np.float64) @ xn[t], Wu.astype(np.float64) @ xn[t]
            ref_h[t, j] = g / (1 + np.exp(-g)) * u
    assert rel(h.get(), ref_h) < 1e-4


@pytest.mark.parametrize("n", [10, 1024, 151936])
def test_argmax(K, n):
    rng = np.random.default_rng()
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.integers(0, n)] = 50.0
    if n > 100:
        x[rng.integers(0, n, size=3)] = -np.inf
    state = cp.full(8, 7, dtype=cp.int32)
    state[2:5] = 0
    out = MappedInts(2)
    out.view[:] = -1
    K("argmax_word")((264,), (256,), (cp.asarray(x), I32(n), ptr(state)))
    K("argmax_finish")((1,), (1,), (ptr(state), out.dptr))
    cp.cuda.runtime.deviceSynchronize()
    assert int(out.view[0]) == int(np.argmax(x)) and int(out.view[1]) == 0
    x[5] = np.nan
    state[2:5] = 0
    K("argmax_word")((264,), (256,), (cp.asarray(x), I32(n), ptr(state)))
    K("argmax_finish")((1,), (1,), (ptr(state), out.dptr))
    cp.cuda.runtime.deviceSynchronize()
    assert int(out.view[1]) > 0
    out.close()


@pytest.mark.parametrize("name", ("Q4_K", "Q8_0", "Q5_K", *NEW))
@pytest.mark.parametrize("n0,n1,n2,bias,cols", [(256, 64, 64, False, 512), (4096, 512, 512, True, 2048),
                                                (33, 7, 5, True, 512)])
@pytest.mark.parametrize("norm", [False, True])
def test_mv3(K, name, n0, n1, n2, bias, cols, norm):
    rng = np.random.default_rng()
    mats = [rand_matrix(name, n, cols, rng) for n in (n0, n1, n2)]
    x = cp.asarray(rng.standard_normal(cols).astype(np.float32))
    nw = cp.asarray(rng.standard_normal(cols).astype(np.float32))
    ds = [cp.asarray(raw) for raw, _ in mats]
    bs = [cp.asarray(rng.standard_normal(n).astype(np.float32)) if bias else None for n in (n0, n1, n2)]
    ys = [poisoned(n) for n in (n0, n1, n2)]
    n = n0 + n1 + n2
    K("mv3", qtype(name).id)(((n + 3) // 4,), (128,),
                             (*ds, I64(mats[0][0].shape[1]), x, nw if norm else NULL, F32(1e-6), *ys,
                              *((b if bias else NULL) for b in bs), I32(n0), I32(n1), I32(n2), I32(cols)),
                             shared_mem=staged_bytes(cols))
    xin = rms_ref(x.get(), nw.get()) if norm else x.get().astype(np.float64)
    for (raw, W), y, b in zip(mats, ys, bs):
        Wd = W.astype(np.float64)
        ref = Wd @ xin + (b.get() if bias else 0)
        assert rel_to(y.get(), ref, np.abs(Wd) @ np.abs(xin) + (np.abs(b.get()) if bias else 0)) < 1e-5


@pytest.mark.parametrize("name", ("F32", "Q8_0", "Q4_K", *NEW))
@pytest.mark.parametrize("n_expert,k,ncols,renorm", [(8, 2, 256, 1), (128, 8, 2048, 1), (60, 4, 512, 0),
                                                     (512, 16, 1024, 1), (128, 8, 4608, 0), (512, 10, 2560, 1),
                                                     (256, 8, 2048, 0), (129, 4, 256, 1)])
def test_router_fused(K, name, n_expert, k, ncols, renorm):
    """Router logits of the FFN-normed x (norm per block) and the routing in one launch (the last block routes);
    twice, so the last-block counter must be back at zero and the counts add up."""
    rng = np.random.default_rng()
    raw, W = rand_matrix(name, n_expert, ncols, rng)
    x = rng.standard_normal(ncols).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, ncols).astype(np.float32)
    logits = poisoned(n_expert)
    ids = cp.full(k, -1, dtype=cp.int32)
    wts = poisoned(k)
    counts = cp.zeros(n_expert, dtype=cp.int32)
    stats = cp.zeros(2, dtype=cp.uint64)
    counter = cp.zeros(1, dtype=cp.int32)
    slot_lo, slot_hi = 1000, 2000
    table = rng.choice([1500, 5000], size=n_expert).astype(np.uint64)   # 1500: inside the slot range
    for _ in range(2):
        K("router_fused", qtype(name).id)(((n_expert + 3) // 4,), (128,),
                                          (cp.asarray(raw), I64(raw.shape[1]), cp.asarray(x), cp.asarray(nw),
                                           F32(1e-6), I32(ncols), ptr(logits), I32(n_expert), I32(k), I32(renorm),
                                           F32(1.5), ptr(ids), ptr(wts), cp.asarray(table), U64(slot_lo),
                                           U64(slot_hi), ptr(counts), ptr(stats), ptr(counter)),
                                          shared_mem=staged_bytes(ncols))
    xn = rms_ref(x, nw)
    Wd = W.astype(np.float64)
    lg = Wd @ xn
    assert rel_to(logits.get(), lg, np.abs(Wd) @ np.abs(xn)) < 1e-5
    lg = logits.get().astype(np.float64)       # the ranking is checked on the kernel's own logits
    p = np.exp(lg - lg.max())
    p /= p.sum()
    ref_ids = np.argsort(-lg, kind="stable")[:k]     # by logit: probabilities far below the max underflow to ties
    np.testing.assert_array_equal(ids.get(), ref_ids)
    ref_w = p[ref_ids] / (p[ref_ids].sum() if renorm else 1.0) * 1.5
    np.testing.assert_allclose(wts.get(), ref_w, rtol=1e-4, atol=1e-30)   # fp32 underflows where fp64 has 1e-45
    np.testing.assert_array_equal(counts.get(), 2 * np.bincount(ref_ids, minlength=n_expert))
    assert list(stats.get()) == [2 * int((table[ref_ids] == 1500).sum()), 2 * k]
    assert int(counter.get()[0]) == 0


def _dev(name, raw, rows, cols):
    from engine.cuda.weights import DevMatrix
    return DevMatrix(cp.asarray(raw), qtype(name).id, rows, cols, raw.shape[1])


def conv_ref(s, state, w):
    """The decode step's causal conv of channel outputs s (C,) over state (d - 1, C) with taps w (C, d): (silu of
    the conv, the shifted state), float64."""
    acc = (state * w[:, :-1].T).sum(0) + s * w[:, -1]
    return acc / (1 + np.exp(-acc)), np.concatenate([state[1:], s[None]])


# (types, rows, cols, conv width): the 35B shape's gated attention (q, k, v, gate) and GDN projections (qkv, z, beta,
# alpha; the 80B's have no alpha) in one type and in the Q4_K_M recipe's mixes, and odd sizes
MANY = [(("Q4_K",) * 4, (4096, 512, 512, 4096), 2048, 0),
        (("Q4_K", "Q4_K", "Q6_K", "Q4_K"), (4096, 512, 512, 4096), 2048, 0),
        (("Q4_K",) * 4, (8192, 4096, 32, 32), 2048, 4),
        (("Q6_K", "Q4_K", "Q4_K", "Q4_K"), (8192, 4096, 32, 32), 2048, 4),
        (("Q5_K", "Q5_K", "Q5_K", None), (12288, 4096, 64, 0), 2048, 4),
        (("Q8_0", "F16", "Q8_0", "Q8_0"), (33, 7, 5, 3), 512, 2),
        (("Q4_K", "Q6_K", "Q4_K", "Q4_K"), (130, 6, 64, 3), 256, 4),      # mixed: the conv's matrix second
        (("Q4_K", "Q4_K", "Q6_K", "Q4_K"), (8192, 4096, 32, 32), 2048, 4),
        (("F32", "F32", "F32", "F32"), (1, 130, 2, 9), 256, 8),
        (("Q2_0", "Q8_0", "Q2_0", "Q2_0"), (4096, 512, 512, 4096), 2048, 0),    # the q2_0 recipe's attention
        (("Q8_0", "Q2_0", "Q2_0", "Q2_0"), (130, 6, 64, 3), 256, 4),
        (("NVFP4", "Q1_0", "Q1_0", None), (33, 7, 5, 0), 1024, 2),
        (("Q1_0", "NVFP4", "NVFP4", "NVFP4"), (8192, 4096, 32, 32), 2048, 4)]


@pytest.mark.parametrize("names,rows,cols,d_conv", MANY)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("mixed", [False, True], ids=["per-type", "mixed"])
def test_mv_many(K, names, rows, cols, d_conv, norm, mixed):
    """Launcher.mv_many against NumPy: dense.cu mv4 a launch per quant type, or (mixed) a single matrix of another
    type in the same launch (mv_mixed.cu mv4_mixed, also with the conv's matrix second in the launch); every output,
    and with a conv the conv of matrix 0's outputs and its state shifted in place; twice, so the second step reads
    the first's state."""
    from types import SimpleNamespace

    from engine.cuda.launch import Launcher, load_mixed, mixed_pairs, plan_shared_input
    rng = np.random.default_rng()
    mv = Launcher(K, SimpleNamespace(rms_eps=1e-6))
    mats = [None if n is None else rand_matrix(n, r, cols, rng) for n, r in zip(names, rows)]
    Ws = [None if n is None else _dev(n, m[0], r, cols) for n, m, r in zip(names, mats, rows)]
    if mixed:
        load_mixed(K, mixed_pairs([Ws]))
        assert len(plan_shared_input(Ws, True)) == 1
    nw = cp.asarray(rng.uniform(0.5, 1.5, cols).astype(np.float32))
    C = rows[0]
    if d_conv:
        state = rng.standard_normal((d_conv - 1, C)).astype(np.float32)
        taps = rng.standard_normal((C, d_conv)).astype(np.float32) * 0.5
        dstate, dtaps = cp.asarray(state), cp.asarray(taps)
        state = state.astype(np.float64)
    for _ in range(2):
        x = cp.asarray(rng.standard_normal(cols).astype(np.float32))
        ys = [poisoned(r + 5) for r in rows]                # the 5 past each output stay poisoned
        mv.mv_many(Ws, x, ys, norm=nw if norm else None, conv=(dstate, dtaps, d_conv) if d_conv else None,
                   mixed=mixed)
        xin = rms_ref(x.get(), nw.get()) if norm else x.get().astype(np.float64)
        for i, (m, y, r) in enumerate(zip(mats, ys, rows)):
            got = y.get()
            assert np.isnan(got[r:]).all()
            if m is None:
                assert np.isnan(got).all()
                continue
            Wd = m[1].astype(np.float64)
            ref, scale = Wd @ xin, np.abs(Wd) @ np.abs(xin)
            if i == 0 and d_conv:
                want, new_state = conv_ref(ref, state, taps.astype(np.float64))
                tap_scale = np.abs(taps[:, -1]) * scale + (np.abs(state) * np.abs(taps[:, :-1]).T).sum(0)
                assert rel_to(got[:r], want, tap_scale) < 1e-5
                got_state = dstate.get()
                np.testing.assert_array_equal(got_state[:-1], state[1:].astype(np.float32))
                assert rel_to(got_state[-1], ref, scale) < 1e-5
                state = got_state.astype(np.float64)
            else:
                assert rel_to(got[:r], ref, scale) < 1e-5


def test_mv_many_refuses_a_conv_of_the_wrong_shape(K):
    from types import SimpleNamespace

    from engine.cuda.launch import Launcher
    rng = np.random.default_rng(1)
    raw, _ = rand_matrix("Q8_0", 64, 256, rng)
    W = _dev("Q8_0", raw, 64, 256)
    with pytest.raises(ValueError, match="conv"):
        Launcher(K, SimpleNamespace(rms_eps=1e-6)).mv_many(
            [W], cp.zeros(256, cp.float32), [poisoned(64)],
            conv=(cp.zeros((3, 63), cp.float32), cp.zeros((64, 4), cp.float32), 4))


@pytest.mark.parametrize("name", QTS)
@pytest.mark.parametrize("rows,cols", [(2048, 4096), (37, 512), (5, 8192), (300, 256)])
def test_mv_gated(K, name, rows, cols):
    """Launcher.mv_gated (dense.cu): y += W @ (x * sigmoid(gate)), the gated attention's output projection; the
    values past the rows stay as they were."""
    from types import SimpleNamespace

    from engine.cuda.launch import Launcher
    rng = np.random.default_rng()
    raw, Wd = rand_matrix(name, rows, cols, rng)
    x = rng.standard_normal(cols).astype(np.float32)
    g = (rng.standard_normal(cols) * 3).astype(np.float32)
    y0 = rng.standard_normal(rows + 3).astype(np.float32)
    y0[rows:] = np.nan
    y = cp.asarray(y0)
    Launcher(K, SimpleNamespace(rms_eps=1e-6)).mv_gated(_dev(name, raw, rows, cols), cp.asarray(x), cp.asarray(g), y)
    xg = x.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))
    Wd = Wd.astype(np.float64)
    got = y.get()
    assert rel_to(got[:rows], y0[:rows] + Wd @ xg, np.abs(y0[:rows]) + np.abs(Wd) @ np.abs(xg)) < 1e-5
    assert np.isnan(got[rows:]).all()
