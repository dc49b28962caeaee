"""qwen4exp's hyper-connection kernels (cuda_src/hc.cu through engine/cuda/hc.py) against engine/arch/qwen4exp.py's
hc_read / hc_write / group_rms_norm in float64, on fresh random data at the tiny model's shape (N 256, 4 streams, rank
16), the published one (2560, 4, 320) and an odd one (2 streams), every output poisoned (NaN) first. The decode read
runs in the engine's launches (write_norm, Launcher.mv_many of W_down and W_inj, up_mix) on quantized weights; the
prompt's GEMMs are CuPy matmuls of the dequantized weights here (the engine's cuBLAS GEMM is tested apart)."""
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine.arch.qwen4exp import group_rms_norm  # noqa: E402
from engine.cuda.hc import HcKernels, HcScratch, HcShape, HcWeights, ref_read, ref_write  # noqa: E402

# (N, H, R, W_up types): the tiny fixture's shape (rank 16: float rows only, no 32-block fits), make_moe's
# tiny-qwen4exp (rank 64), the published shape in the packs' types, 2 streams
SHAPES = [(256, 4, 16, ("F32", "F16")), (256, 4, 64, ("F16", "Q8_0")), (2560, 4, 320, ("F16", "Q8_0", "Q4_0", "BF16")),
          (512, 2, 64, ("Q8_0",))]
IDS = ["tiny-fixture", "tiny-preset", "published", "two-streams"]
EPS = 1e-6
TOL = dict(rtol=2e-4, atol=2e-5)

_kern: dict = {}
_tables: dict = {}


def kern(sh: HcShape, qts) -> HcKernels:
    key = (sh, tuple(qts))
    if key not in _kern:
        _kern[key] = HcKernels(sh, qts)
    return _kern[key]


def launcher(qts):
    from engine.cuda.kernels import Kernels
    from engine.cuda.launch import Launcher
    from engine.cuda.quant_types import qtype
    key = tuple(sorted(qts))
    if key not in _tables:
        _tables[key] = Launcher(Kernels({qtype(n).id for n in key}), SimpleNamespace(rms_eps=EPS))
    return _tables[key]


def matrix(name, rows, cols, rng, scale):
    """(DevMatrix, float64 host copy) of random rows of quant type `name` whose entries have about `scale` as their
    standard deviation (random_rows' block scales are rescaled to get there; the float types are N(0, 1) scaled)."""
    from engine.cuda.quant_types import qtype, random_rows
    from engine.cuda.weights import DevMatrix
    from engine.gguf_model import dequantize
    q = qtype(name)
    if name in ("F32", "F16", "BF16"):
        host = rng.standard_normal((rows, cols)) * scale
        if name == "F32":
            raw = host.astype(np.float32).view(np.uint8)
        elif name == "F16":
            raw = host.astype(np.float16).view(np.uint8)
        else:
            raw = (host.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        probe = dequantize(random_rows(name, 4, cols, rng, scale=1.0), q.ggml)
        raw = random_rows(name, rows, cols, rng, scale=scale / max(float(np.std(probe)), 1e-30))
    raw = np.ascontiguousarray(raw.reshape(rows, -1))
    host = dequantize(raw, q.ggml).reshape(rows, cols).astype(np.float64)
    return DevMatrix(cp.asarray(raw), q.id, rows, cols, raw.shape[1]), host


def nan(*shape, dtype=None):
    return cp.full(shape, cp.nan, dtype or cp.float32)


def close(got, want, what, **tol):
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, err_msg=what, **{**TOL, **tol})


@pytest.mark.parametrize("p", SHAPES, ids=IDS)
@pytest.mark.parametrize("T", [1, 5, 37])
def test_write_norm(p, T):
    """x += iota o (+ add) in place, then u (fp32) and u16 (fp16) = GroupNorm_H(x), for T rows of a wider x buffer;
    also the plain write (no norm) and the plain norm (no write)."""
    N, H, R, _ = p
    sh = HcShape(N, H, R, EPS)
    k = kern(sh, ("F32",))
    rng = np.random.default_rng()
    D = sh.D
    x = rng.standard_normal((T + 2, D)) * rng.uniform(0.5, 4.0, (T + 2, 1))
    o = rng.standard_normal((T, N + 8))
    iota = rng.uniform(0.0, 2.0, (T, H))
    add = rng.standard_normal((T, D)) * 0.3
    gamma = 1.0 + 0.2 * rng.standard_normal(D)
    f32 = lambda a: cp.asarray(a, cp.float32)    # noqa: E731
    x32 = lambda a: a.astype(np.float32).astype(np.float64)   # noqa: E731
    for case in ("write+add+norm", "write+norm", "write", "norm"):
        dx = f32(x)
        u, u16 = nan(T, D), nan(T, D, dtype=cp.float16)
        want = x32(x)[:T]
        if "write" in case:
            want = ref_write(want, x32(o)[:, :N], x32(iota))
        if "add" in case:
            want = want + x32(add)
        has_norm = "norm" in case
        k.write_norm(dx, f32(gamma) if has_norm else None, u=u if has_norm else None,
                     u16=u16 if has_norm else None, o=f32(o) if "write" in case else None,
                     iota=f32(iota) if "write" in case else None, add=f32(add) if "add" in case else None, T=T)
        close(dx[:T], want, f"{case}: x")
        close(dx[T:], x32(x)[T:], f"{case}: rows past T", rtol=0, atol=0)
        if has_norm:
            un = group_rms_norm(want, x32(gamma), H, EPS)
            close(u, un, f"{case}: u")
            close(u16, un, f"{case}: u16", rtol=2e-3, atol=2e-3)
        else:
            assert bool(cp.isnan(u).all()), "the plain write wrote u"


@pytest.mark.parametrize("p", SHAPES, ids=IDS)
def test_read_decode(p):
    """The decode read in the engine's launches (read_decode: write_norm with the previous write and an add fused,
    mv_many of W_down and W_inj, up_mix) for every W_up type of the shape, then the head (no inject), four tokens each,
    against hc_write then hc_read on the dequantized weights."""
    N, H, R, qts = p
    sh = HcShape(N, H, R, EPS)
    rng = np.random.default_rng()
    D = sh.D
    for qt in qts:
        down_t = qt if qt not in ("Q4_0",) else "Q8_0"       # a pack's W_down / W_inj beside a Q4_0 W_up
        mv = launcher({qt, down_t})
        k = kern(sh, (qt,))
        down, down_h = matrix(down_t, R, D, rng, 1.0 / np.sqrt(D))
        inj, inj_h = matrix(down_t, H, D, rng, 1.0 / np.sqrt(D))
        up, up_h = matrix(qt, D, R, rng, 2.0 / np.sqrt(R))
        gamma = 1.0 + 0.2 * rng.standard_normal(D)
        w = HcWeights(cp.asarray(gamma, cp.float32), down, up, inj)
        head = HcWeights(cp.asarray(gamma, cp.float32), down, up, None)
        x = rng.standard_normal(D) * 2.0
        dx = cp.asarray(x, cp.float32)
        x = x.astype(np.float32).astype(np.float64)
        iota_prev = None
        for step in range(4):
            sc = HcScratch(nan(D), nan(R), nan(H))
            y, iota = nan(N), nan(H)
            o = add = None
            if step:
                o = rng.standard_normal(N).astype(np.float32).astype(np.float64)
                x = ref_write(x, o, iota_prev)[0]
            if step == 2:
                add = (0.5 * rng.standard_normal(D)).astype(np.float32).astype(np.float64)
                x = x + add
            want_y, want_iota = ref_read(sh, x, gamma.astype(np.float32), down_h, up_h, inj_h)
            k.read_decode(mv, dx, w, sc, y, iota, o=None if o is None else cp.asarray(o, cp.float32),
                          iota_prev=None if o is None else cp.asarray(iota_prev, cp.float32),
                          add=None if add is None else cp.asarray(add, cp.float32))
            close(dx, x, f"{qt} step {step}: x after the write")
            close(sc.u, group_rms_norm(x, gamma.astype(np.float32), H, EPS), f"{qt} step {step}: u")
            close(y, want_y[0], f"{qt} step {step}: y")
            close(iota, want_iota[0], f"{qt} step {step}: iota")
            iota_prev = cp.asnumpy(iota).astype(np.float64)
            x = cp.asnumpy(dx).astype(np.float64)        # carry the kernel's own residual (fp32 roundings)
        sc, y = HcScratch(nan(D), nan(R), nan(H)), nan(N)
        k.read_decode(mv, dx, head, sc, y)
        want_y, none = ref_read(sh, x, gamma.astype(np.float32), down_h, up_h, None)
        assert none is None
        close(y, want_y[0], f"{qt}: the head's y")
        assert bool(cp.isnan(sc.e).all()), "the head wrote the inject scratch"


@pytest.mark.parametrize("p", SHAPES, ids=IDS)
@pytest.mark.parametrize("T", [1, 7, 64, 300])
def test_read_prompt(p, T):
    """The prompt read: write_norm (u, u16), the [W_down; W_inj] GEMM (CuPy here), act_rows (fp32 and fp16), the
    W_up GEMM, mix_rows with inj a column view of the first GEMM's output; against hc_write then hc_read."""
    N, H, R, _ = p
    sh = HcShape(N, H, R, EPS)
    k = kern(sh, ("F32",))
    rng = np.random.default_rng()
    D = sh.D
    f32 = lambda a: cp.asarray(a, cp.float32)    # noqa: E731
    x = rng.standard_normal((T, D)) * 2.0
    o = rng.standard_normal((T, N))
    iota_prev = rng.uniform(0.0, 2.0, (T, H))
    gamma = 1.0 + 0.2 * rng.standard_normal(D)
    W_de = rng.standard_normal((R + H, D)) / np.sqrt(D)
    W_up = rng.standard_normal((D, R)) * 2.0 / np.sqrt(R)
    r32 = lambda a: a.astype(np.float32).astype(np.float64)   # noqa: E731
    x, o, iota_prev, gamma, W_de, W_up = map(r32, (x, o, iota_prev, gamma, W_de, W_up))
    dx = f32(x)
    U, U16 = nan(T, D), nan(T, D, dtype=cp.float16)
    k.write_norm(dx, f32(gamma), u=U, u16=U16, o=f32(o), iota=f32(iota_prev))
    xw = ref_write(x, o, iota_prev)
    close(dx, xw, "x after the write")
    close(U16, group_rms_norm(xw, gamma, H, EPS), "u16", rtol=2e-3, atol=2e-3)
    DE = U @ f32(W_de).T                            # (T, R + H)
    A, A16 = nan(T, R), nan(T, R, dtype=cp.float16)
    k.act_rows(DE, out=A, out16=A16)
    a_want = cp.asnumpy(DE).astype(np.float64)[:, :R] / H
    a_want = a_want / (1 + np.exp(-a_want))
    close(A, a_want, "a")
    close(A16, a_want, "a16", rtol=2e-3, atol=2e-3)
    S = A @ f32(W_up).T
    Y = nan(T, N + 5)
    iota = nan(T, H)
    k.mix_rows(S, U, Y[:, :N], inj=DE[:, R:], iota=iota)
    want_y, want_iota = ref_read(sh, xw, gamma, W_de[:R], W_up, W_de[R:])
    close(Y[:, :N], want_y, "y")
    close(iota, want_iota, "iota")
    assert bool(cp.isnan(Y[:, N:]).all()), "mix_rows wrote past N"
    Yh = nan(T, N)                                  # the head: no inject
    k.mix_rows(S, U, Yh)
    close(Yh, want_y, "the head's y")
