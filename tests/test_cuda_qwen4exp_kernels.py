"""cuda_src/qwen4exp.cu's kernels (through engine/cuda/families/q4ops.py where it launches them) against their NumPy
references (q4ops.ref_*, themselves checked against engine/arch/qwen4exp.py on the CPU: tests/test_cuda_qwen4exp_host.py)
on fresh random data at several sizes, every output buffer NaN-poisoned first. (The HC and QSA kernels are
cuda_src/hc.cu and qsa.cu: tests/test_cuda_hc.py, tests/test_cuda_qsa.py.)"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine.cuda import kernels  # noqa: E402
from engine.cuda.families import q4ops  # noqa: E402
from engine.cuda.launch import F32, I32, I64, ptr  # noqa: E402


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


@pytest.mark.parametrize("rows,N,H", [(1, 256, 4), (3, 2560, 4), (5, 64, 2)])
def test_group_rmsnorm_and_broadcast(rows, N, H):
    rng = np.random.default_rng(rows * N)
    D = N * H
    x = rng.standard_normal((rows, D)).astype(np.float32) * 3
    gamma = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    e = rng.standard_normal((rows, N)).astype(np.float32)
    u = poisoned(rows * D)
    # the device copies are named: a temporary's memory returns to the pool once ptr() has read it, and the next
    # cp.asarray would reuse it before the kernel runs
    xd, gd = cp.asarray(x), cp.asarray(gamma)
    fn("q4_group_rmsnorm")((rows * H,), (256,), (ptr(xd), ptr(gd), ptr(u), I32(N), I32(H), F32(1e-6)))
    close(u.get().reshape(rows, D), q4ops.ref_group_rmsnorm(x.astype(np.float64), gamma, H, 1e-6))
    b = poisoned(rows * D)
    ed = cp.asarray(e)
    fn("q4_broadcast")((max(1, rows * D // 256),), (256,), (ptr(ed), ptr(b), I32(N), I32(H), I64(rows)))
    close(b.get().reshape(rows, D), np.tile(e, (1, H)))


@pytest.mark.parametrize("T,n_k,n_v,D,K", [(1, 2, 6, 128, 4), (7, 2, 6, 128, 4), (70, 16, 48, 128, 4),
                                           (130, 1, 3, 128, 2)])
def test_gdn_prompt_matches_the_token_by_token_reference(T, n_k, n_v, D, K):
    """Gdn.prompt on gdn.cu's sigmoid build (tiled value heads, beta and alpha apart) against ref_gdn over T tokens,
    across chunks of 64; conv state and S carried in place."""
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
    cfg = NS(arch="qwen4exp", ssm_k_heads=n_k, ssm_v_heads=n_v, ssm_state=D, ssm_conv=K, ssm_inner=n_v * D,
             rms_eps=1e-6)
    g = q4ops.Gdn(kern, None, q4ops.Q4Shape(8, 2, 8, 1e-6, cfg), prompt_chunk=T)
    # proj(W, y) hands back each projection's rows: the weights here are names
    rows = {name: cp.asarray(v) for name, v in (("qkv", qkv), ("z", z), ("beta", b), ("alpha", a))}
    gw = NS(qkv="qkv", z="z", beta="beta", alpha="alpha", conv=cp.asarray(conv_w), dt_bias=cp.asarray(dt),
            a=cp.asarray(ssm_a), norm=cp.asarray(norm_w))
    conv, S = cp.asarray(conv0), cp.asarray(S0)
    out = g.prompt(gw, None, conv, S, T, lambda W, y: rows[W])
    # fp16 mma inputs in the chunked rule: tests/test_cuda_gdn.py's relative (Frobenius) bound
    rel = lambda got, ref: float(np.linalg.norm(got - ref) / np.linalg.norm(ref))     # noqa: E731
    got = out.get()
    assert np.isfinite(got).all()
    assert rel(got, want) < 3e-3 and rel(S.get(), S1) < 3e-3
    close(conv.get(), conv1)


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
