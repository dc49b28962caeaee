"""cuda_src/qwen4exp.cu's kernels (through engine/cuda/families/q4ops.py where it launches them) against their NumPy
references (q4ops.ref_*, themselves checked against engine/arch/qwen4exp.py on the CPU: tests/test_cuda_qwen4exp_host.py)
on fresh random data at several sizes, every output buffer NaN-poisoned first."""
import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine.cuda import kernels  # noqa: E402
from engine.cuda.families import q4ops  # noqa: E402
from engine.cuda.launch import F32, I32, I64, NULL, ptr  # noqa: E402
from engine.arch import qwen4exp as ref  # noqa: E402


def fn(name):
    return kernels.function("qwen4exp", name)


def kern(name, qt=None, kind=None):
    return fn(name)


def poisoned(shape, dtype=np.float32):
    return cp.full(shape, np.nan, dtype=dtype)


def close(got, want, tol=2e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))


def shape(N, H, R, eps=1e-6):
    from types import SimpleNamespace as NS
    return q4ops.Q4Shape(N, H, R, eps, NS())


@pytest.mark.parametrize("rows,N,H", [(1, 256, 4), (3, 2560, 4), (5, 64, 2)])
def test_group_rmsnorm_mix_write_broadcast(rows, N, H):
    rng = np.random.default_rng(rows * N)
    D = N * H
    x = rng.standard_normal((rows, D)).astype(np.float32) * 3
    gamma = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    s = rng.standard_normal((rows, D)).astype(np.float32)
    o = rng.standard_normal((rows, N)).astype(np.float32)
    inj = rng.standard_normal((rows, H)).astype(np.float32) * 2
    hc = q4ops.Hc(kern, None, shape(N, H, 16))
    u = poisoned(rows * D)
    hc.group_norm(cp.asarray(x), cp.asarray(gamma), u, rows)
    close(u.get().reshape(rows, D), q4ops.ref_group_rmsnorm(x.astype(np.float64), gamma, H, 1e-6))
    y = poisoned(rows * N)
    hc._mix(cp.asarray(x), cp.asarray(s), y, rows)
    close(y.get().reshape(rows, N), q4ops.ref_hc_mix(x.astype(np.float64), s.astype(np.float64), H))
    dx = cp.asarray(x)
    hc.write(dx, cp.asarray(o), cp.asarray(inj), rows)
    close(dx.get(), q4ops.ref_hc_write(x.astype(np.float64), o, inj, H))
    b = poisoned(rows * D)
    hc.broadcast(cp.asarray(o), b, rows)
    close(b.get().reshape(rows, D), np.tile(o, (1, H)))
    a = cp.asarray(s.reshape(-1).copy())
    hc._silu(a, a.size)
    sv = s.reshape(-1).astype(np.float64) / H
    close(a.get(), sv / (1 + np.exp(-sv)))


@pytest.mark.parametrize("T,n_k,n_v,D,K", [(1, 2, 4, 16, 4), (7, 2, 6, 64, 4), (70, 16, 48, 128, 4), (3, 1, 1, 32, 2)])
def test_gdn_matches_the_token_by_token_reference(T, n_k, n_v, D, K):
    rng = np.random.default_rng(T + D)
    C = (2 * n_k + n_v) * D
    qkv = rng.standard_normal((T, C)).astype(np.float32)
    conv0 = rng.standard_normal((K - 1, C)).astype(np.float32)
    conv_w = (0.5 * rng.standard_normal((C, K))).astype(np.float32)
    b = rng.standard_normal((T, n_v)).astype(np.float32)
    a = rng.standard_normal((T, n_v)).astype(np.float32)
    dt = rng.standard_normal(n_v).astype(np.float32)
    ssm_a = -np.exp(rng.standard_normal(n_v)).astype(np.float32)
    S0 = (0.1 * rng.standard_normal((n_v, D, D))).astype(np.float32)
    z = rng.standard_normal((T, n_v * D)).astype(np.float32)
    norm_w = (1 + 0.2 * rng.standard_normal(D)).astype(np.float32)
    want, conv1, S1 = q4ops.ref_gdn(qkv.astype(np.float64), conv0, conv_w, b, a, dt, ssm_a, S0, z, norm_w, n_k, D,
                                    1e-6)
    from types import SimpleNamespace as NS
    cfg = NS(ssm_k_heads=n_k, ssm_v_heads=n_v, ssm_state=D, ssm_conv=K, ssm_inner=n_v * D)
    g = q4ops.Gdn(kern, None, q4ops.Q4Shape(8, 2, 8, 1e-6, cfg))
    gw = NS(conv=cp.asarray(conv_w), dt_bias=cp.asarray(dt), a=cp.asarray(ssm_a), norm=cp.asarray(norm_w))
    conv, S = cp.asarray(conv0), cp.asarray(S0)
    act, out = poisoned((T, C)), poisoned((T, n_v * D))
    g._core(cp.asarray(qkv), act, cp.asarray(z), cp.asarray(b), cp.asarray(a), gw, conv, S, out, T)
    close(out.get(), want, 1e-4)
    close(conv.get(), conv1)
    close(S.get(), S1, 1e-4)


@pytest.mark.parametrize("T,N,H,K,dil", [(1, 256, 4, 4, 3), (9, 64, 4, 4, 3), (13, 2560, 4, 4, 3), (4, 32, 2, 3, 2)])
def test_ple_gate_and_conv(T, N, H, K, dil):
    rng = np.random.default_rng(T * N)
    D = N * H
    x = rng.standard_normal((T, D)).astype(np.float32)
    kp = rng.standard_normal((T, D)).astype(np.float32)
    v = rng.standard_normal((T, N)).astype(np.float32)
    gk, gq, gc = ((1 + 0.2 * rng.standard_normal(D)).astype(np.float32) for _ in range(3))
    w = (0.5 * rng.standard_normal((D, K))).astype(np.float32)
    hist = rng.standard_normal((dil * (K - 1), D)).astype(np.float32)
    want, hist1 = q4ops.ref_ple(x.astype(np.float64), kp, v, gk, gq, gc, w, hist, H, dil, 1e-6)
    from types import SimpleNamespace as NS
    sh = q4ops.Q4Shape(N, H, 8, 1e-6, NS(family_params=NS(ple_conv=K, ngram_size=dil)))
    ple = q4ops.Ple(kern, None, sh)
    sc = q4ops.PleScratch(cp.asarray(kp), cp.asarray(v), poisoned((T, D)), poisoned((T, D)), poisoned((T, D)))
    dx, dh = cp.asarray(x), cp.asarray(hist)
    ple._tail(NS(norm_key=cp.asarray(gk), norm_query=cp.asarray(gq), norm_conv=cp.asarray(gc), conv=cp.asarray(w)),
              dx, dh, sc, T)
    close(dx.get(), want, 1e-4)
    close(dh.get(), hist1, 1e-4)


def _rope(n_pos, n_rot, base=1e7):
    half = n_rot // 2
    inv = base ** (-2.0 * np.arange(half) / n_rot)
    ang = np.arange(n_pos)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@pytest.mark.parametrize("T,pos0,heads,d,n_rot", [(1, 0, 4, 32, 8), (5, 37, 4, 128, 64), (3, 2, 2, 256, 64)])
def test_norm_rope_and_pool(T, pos0, heads, d, n_rot):
    rng = np.random.default_rng(d + T)
    cos, sin = _rope(512, n_rot)
    table = cp.asarray(np.stack([cos, sin], -1))
    x = rng.standard_normal((T, heads * d)).astype(np.float32)
    gamma = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    dx = cp.asarray(x)
    fn("q4_norm_rope")((heads, T), (32,), (ptr(dx), I64(heads * d), I32(d), ptr(cp.asarray(gamma)), ptr(table),
                                          I32(n_rot), F32(1e-6), NULL, I32(pos0)))
    from engine.arch.base import rms_norm
    want = ref.imrope(rms_norm(x.reshape(T, heads, d).astype(np.float64), gamma, 1e-6), cos[pos0:pos0 + T],
                      sin[pos0:pos0 + T], n_rot)
    close(dx.get(), want.reshape(T, -1), 1e-4)
    # pooled keys of blocks lo..hi (r = 4)
    r, lo, hi = 4, 1, 5
    keys = rng.standard_normal((hi * r + 3, d)).astype(np.float32)
    pooled = poisoned((hi + 1, d))
    fn("q4_qsa_pool")((hi - lo,), (32,), (ptr(cp.asarray(keys)), ptr(pooled), I32(d), I32(r), ptr(cp.asarray(gamma)),
                                          ptr(table), I32(n_rot), F32(1e-6), NULL, I32(lo)))
    want = ref.pooled_block_keys(keys[lo * r:hi * r].astype(np.float64), gamma, cos[lo * r:hi * r:r],
                                 sin[lo * r:hi * r:r], n_rot, r, 1e-6)
    got = pooled.get()
    close(got[lo:hi], want, 1e-4)
    assert np.isnan(got[:lo]).all() and np.isnan(got[hi:]).all()


@pytest.mark.parametrize("T,pos0,B,hq,hkv,hd", [(1, 7, 4, 4, 2, 32), (1, 40, 4, 4, 2, 32), (9, 30, 3, 24, 2, 256),
                                                (17, 0, 4, 4, 1, 64), (6, 100, 16, 8, 2, 128)])
def test_scores_select_attend(T, pos0, B, hq, hkv, hd):
    rng = np.random.default_rng(pos0 * 7 + T)
    r, Hi, di, rows = 4, 4, 32, 256
    S = pos0 + T
    nb_all = S // r
    n_cols = max(nb_all, 1)
    qi = rng.standard_normal((T, Hi * di)).astype(np.float32)
    pooled = rng.standard_normal((rows // r + 1, di)).astype(np.float32)
    scores, sel = poisoned((T, n_cols)), cp.full((T, n_cols), 7, dtype=cp.uint8)
    fn("q4_qsa_scores")(((n_cols + 3) // 4, T), (128,),
                        (ptr(cp.asarray(qi)), I64(Hi * di), I32(Hi), I32(di), ptr(cp.asarray(pooled)), ptr(scores),
                         I64(n_cols), I32(n_cols), I32(r), NULL, I32(pos0)))
    pos = pos0 + np.arange(T)
    want = np.full((T, n_cols), -np.inf)
    for t, p in enumerate(pos):
        nb = (p + 1) // r
        want[t, :nb] = ref.block_scores(qi[t:t + 1].reshape(1, Hi, di).astype(np.float64), pooled[:nb])[0]
    got = scores.get()
    assert np.array_equal(np.isinf(got), np.isinf(want))
    close(np.where(np.isinf(want), 0, got), np.where(np.isinf(want), 0, want), 1e-4)
    fn("q4_qsa_select")(((n_cols + 255) // 256, T), (256,),
                        (ptr(scores), I64(n_cols), ptr(sel), I64(n_cols), I32(n_cols), I32(B), I32(r), NULL,
                         I32(pos0)))
    got_sel = sel.get()
    np.testing.assert_array_equal(got_sel, q4ops.ref_qsa_select(got, pos, r, B, n_cols))
    # attention over the kept positions, K/V in kv.py's fp16 layout
    q = rng.standard_normal((T, hq * hd)).astype(np.float32)
    K = rng.standard_normal((hkv, rows, hd)).astype(np.float16)
    V = rng.standard_normal((hkv, rows, hd)).astype(np.float16)
    out = poisoned((T, hq * hd))
    scale = 1 / math.sqrt(hd)
    fn("q4_qsa_attend")((hq, T), (32,),
                        (ptr(cp.asarray(q)), I64(hq * hd), ptr(cp.asarray(K)), ptr(cp.asarray(V)), I32(rows), ptr(sel),
                         I64(n_cols), ptr(out), I64(hq * hd), I32(hq), I32(hkv), I32(hd), F32(scale), I32(r), I32(B),
                         NULL, I32(pos0)))
    want = q4ops.ref_qsa_attend(q.reshape(T, hq, hd).astype(np.float64), K[:, :S].astype(np.float64),
                                V[:, :S].astype(np.float64), got_sel, pos, r, B, scale)
    close(out.get(), want, 1e-4)


def test_decode_reads_the_position_from_the_state():
    """state[1] in place of pos0 + t: the store, the pool (only when the token completes a block) and the scores."""
    d, r = 32, 4
    rng = np.random.default_rng(3)
    keys = poisoned((64, d))
    kraw = rng.standard_normal(d).astype(np.float32)
    state = cp.asarray(np.array([0, 11, 0, 0, 0, 0, 0, 0], np.int32))
    fn("q4_qsa_store_keys")((1,), (128,), (ptr(cp.asarray(kraw)), ptr(keys), I32(d), ptr(state), I32(0)))
    got = keys.get()
    close(got[11], kraw)
    assert np.isnan(np.delete(got, 11, axis=0)).all()
    pooled = poisoned((17, d))
    gamma, table = cp.ones(d, cp.float32), cp.asarray(np.stack(_rope(64, 8), -1))
    dk = cp.asarray(rng.standard_normal((64, d)).astype(np.float32))
    for p, completes in ((10, False), (11, True)):
        state[1] = p
        fn("q4_qsa_pool")((1,), (32,), (ptr(dk), ptr(pooled), I32(d), I32(r), ptr(gamma), ptr(table), I32(8),
                                        F32(1e-6), ptr(state), I32(0)))
        assert np.isfinite(pooled.get()[p // r]).all() == completes
