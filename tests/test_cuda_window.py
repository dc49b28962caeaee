"""The window kernels (cuda_src/window.cu, window_oss.cu: a decode step over 1-8 tokens) against NumPy on fresh
random data at several sizes and every window length 1-8, outputs poisoned (NaN) first, and against the one-token
kernels they stand for (dense.cu mv / mv3 / swiglu_mv, router.cu router_fused, moe.cu moe_gate_up / moe_down,
moe_oss.cu's gpt-oss experts) run for each token: within fp32 rounding of them (the H200 showed the Q4_K sums
contracted into FMAs differently in the window kernels, 3e-7 relative on whole tiny models; the other types came
out bit for bit), the router's routing exactly."""
import ctypes

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine.cuda.launch import F32, I32, I64, NULL, U64, ptr, staged_bytes  # noqa: E402
from engine.cuda.quant_types import qtype, random_rows  # noqa: E402
from engine.gguf_model import dequantize  # noqa: E402
from gpu_compare import rel  # noqa: E402

# A sample of the types (tests/test_cuda_compile.py compiles every type's window kernels) and of the window lengths a
# case (every length 1-8 in test_mv_win's first case and in the union test): the file has a GPU minute.
QTS = ("F32", "F16", "Q8_0", "Q4_K", "Q6_K", "Q2_0", "MXFP4")
WINDOWS = (1, 2, 3, 4, 5, 6, 7, 8)
SOME = (1, 3, 8)
SMEM_MAX = 227 * 1024


@pytest.fixture(scope="module")
def K():
    """The one-token kernels and the window kernels, in one lookup: K(name, qt)."""
    from engine.cuda.kernels import ENGINE_FILES, Kernels
    ids = {qtype(n).id for n in QTS}
    one = Kernels(ids, ENGINE_FILES + ("moe_oss.cu",))
    win = Kernels(ids, ("window.cu", "window_serial.cu", "window_oss.cu"))

    def get(name, qt=None):
        f = (win if name in win.file_of else one)(name, qt)
        return f
    return get


def poisoned(shape, dtype=np.float32):
    return cp.full(shape, np.nan, dtype=dtype)


def rel_to(a, b, scale):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(scale), 1e-30))


def rms_ref(x, w, eps=1e-6):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w


def rand_matrix(name, rows, cols, rng):
    raw = random_rows(name, rows, cols, rng)
    return raw, dequantize(raw, qtype(name).ggml).reshape(rows, cols)


def near(got, want, scale, msg):
    """got within fp32 rounding of the one-token kernel's want (relative to a scale that cannot cancel)."""
    assert rel_to(got, want, scale) < 1e-5, msg


def smem(f, n):
    if n > 48 * 1024:
        f.max_dynamic_shared_size_bytes = n
    return n


# --- NumPy references of the window's bookkeeping ------------------------------------------------------------------

def union_ref(ids: np.ndarray) -> list[tuple[int, list[int]]]:
    """win_union's records: (expert, its pairs t * k + j in token order), experts in order of first appearance."""
    flat = ids.ravel().tolist()
    order, pairs = [], {}
    for i, e in enumerate(flat):
        if e not in pairs:
            order.append(e)
            pairs[e] = []
        pairs[e].append(i)
    return [(e, pairs[e]) for e in order]


def read_union(uni: np.ndarray) -> list[tuple[int, list[int]]]:
    n, rec = int(uni[0]), 2 + 8
    out = []
    for s in range(n):
        r = uni[1 + s * rec:1 + (s + 1) * rec]
        out.append((int(r[0]), [int(p) for p in r[2:2 + int(r[1])]]))
    return out


# --- dense mat-vecs --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,rows,cols,rpw,Ts", [("Q4_K", 70, 4096, 2, WINDOWS), ("Q4_K", 300, 2048, 1, SOME),
                                                   ("Q6_K", 37, 512, 3, SOME), ("Q8_0", 9, 6144, 1, SOME),
                                                   ("F32", 1, 256, 1, SOME), ("F16", 5, 16384, 1, SOME),
                                                   ("Q2_0", 70, 4096, 2, SOME), ("MXFP4", 300, 2048, 1, SOME)])
def test_mv_win(K, name, rows, cols, rpw, Ts):
    """x staged (normed or not) and from global memory, plain and with bias, accumulate and per-token gates: NumPy,
    and the one-token mv token by token."""
    rng = np.random.default_rng()
    raw, W = rand_matrix(name, rows, cols, rng)
    Wd = W.astype(np.float64)
    d_raw = cp.asarray(raw)
    rb = raw.shape[1]
    nw = rng.standard_normal(cols).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    d_nw, d_b = cp.asarray(nw), cp.asarray(bias)
    grid = ((rows + 4 * rpw - 1) // (4 * rpw),)
    f_win, f_one = K("mv_win", qtype(name).id), K("mv", qtype(name).id)
    for T in Ts:
        ldx = cols + 4 * rng.integers(0, 3)        # rows of x need not be packed
        xb = rng.standard_normal((T, ldx)).astype(np.float32) * 2
        x = xb[:, :cols]
        y0 = rng.standard_normal((T, rows)).astype(np.float32)
        g = rng.standard_normal(T).astype(np.float32)
        d_x, d_g = cp.asarray(xb), cp.asarray(g)
        for stage, norm in ((0, False), (1, False), (1, True)):
            if stage and T * staged_bytes(cols) > SMEM_MAX:
                continue
            sm = T * staged_bytes(cols) if stage else 0
            xin = rms_ref(x, nw) if norm else x.astype(np.float64)
            ref, scale = xin @ Wd.T, np.abs(xin) @ np.abs(Wd).T
            for acc in (0, 1):
                y = cp.asarray(y0) if acc else poisoned((T, rows))
                f_win(grid, (128,), (ptr(d_raw), I64(rb), ptr(d_x), I32(ldx), ptr(y), I32(rows),
                                     ptr(d_b) if acc else NULL, ptr(d_g) if acc else NULL, I32(rows), I32(cols),
                                     I32(acc), ptr(d_nw) if norm else NULL, F32(1e-6), I32(stage), I32(rpw), I32(T)),
                      shared_mem=smem(f_win, sm))
                got = y.get()
                yt = cp.asarray(y0) if acc else poisoned((T, rows))       # the token-parallel mv_tok
                f_tok = K("mv_tok", qtype(name).id)
                f_tok((T, grid[0]), (128,), (ptr(d_raw), I64(rb), ptr(d_x), I32(ldx), ptr(yt), I32(rows),
                                             ptr(d_b) if acc else NULL, ptr(d_g) if acc else NULL, I32(rows),
                                             I32(cols), I32(acc), ptr(d_nw) if norm else NULL, F32(1e-6), I32(stage),
                                             I32(rpw)),
                      shared_mem=smem(f_tok, staged_bytes(cols) if stage else 0))
                got_tok = yt.get()
                if acc:
                    gate = (1 / (1 + np.exp(-g.astype(np.float64))))[:, None]
                    want = y0 + (ref + bias) * gate
                    assert rel_to(got, want, np.abs(y0) + (scale + np.abs(bias)) * gate) < 1e-5, (T, stage, norm)
                else:
                    assert rel_to(got, ref, scale) < 1e-5, (T, stage, norm)
                for t in range(T):           # the one-token kernel on token t
                    y1 = cp.asarray(y0[t]) if acc else poisoned(rows)
                    f_one(grid, (128,), (ptr(d_raw), I64(rb), ptr(d_x[t]), ptr(y1), ptr(d_b) if acc else NULL,
                                         U64(d_g.data.ptr + 4 * t) if acc else NULL, I32(rows), I32(cols), I32(acc),
                                         ptr(d_nw) if norm else NULL, F32(1e-6), I32(stage), I32(rpw)),
                          shared_mem=smem(f_one, staged_bytes(cols) if stage else 0))
                    sc = (np.abs(y0[t]) + (scale[t] + np.abs(bias)) * gate[t]) if acc else scale[t]
                    near(got[t], y1.get(), sc, f"T={T} t={t} stage={stage} norm={norm} acc={acc}")
                    near(got_tok[t], y1.get(), sc, f"mv_tok T={T} t={t} stage={stage} norm={norm} acc={acc}")


@pytest.mark.parametrize("name,n0,n1,n2,bias,cols,norm", [("Q4_K", 4096, 512, 512, True, 2048, True),
                                                          ("Q4_K", 64, 32, 32, False, 4096, False),
                                                          ("Q6_K", 33, 7, 5, True, 512, False),
                                                          ("Q8_0", 256, 64, 64, False, 512, True),
                                                          ("Q2_0", 64, 32, 32, False, 4096, True)])
def test_mv3_win(K, name, n0, n1, n2, bias, cols, norm):
    rng = np.random.default_rng()
    mats = [rand_matrix(name, n, cols, rng) for n in (n0, n1, n2)]
    ds = [cp.asarray(raw) for raw, _ in mats]
    nw = cp.asarray(rng.standard_normal(cols).astype(np.float32))
    bs = [cp.asarray(rng.standard_normal(n).astype(np.float32)) if bias else None for n in (n0, n1, n2)]
    n = n0 + n1 + n2
    rb = mats[0][0].shape[1]
    for T in SOME:
        x = cp.asarray(rng.standard_normal((T, cols)).astype(np.float32))
        ys = [poisoned((T, m)) for m in (n0, n1, n2)]
        K("mv3_win", qtype(name).id)(((n + 3) // 4,), (128,),
                                     (*ds, I64(rb), x, I32(cols), nw if norm else NULL, F32(1e-6), *ys,
                                      *((b if bias else NULL) for b in bs), I32(n0), I32(n1), I32(n2), I32(cols),
                                      I32(T)),
                                     shared_mem=smem(K("mv3_win", qtype(name).id), T * staged_bytes(cols)))
        xin = rms_ref(x.get(), nw.get()) if norm else x.get().astype(np.float64)
        for (raw, W), y, b in zip(mats, ys, bs):
            Wd = W.astype(np.float64)
            ref = xin @ Wd.T + (b.get() if bias else 0)
            assert rel_to(y.get(), ref, np.abs(xin) @ np.abs(Wd).T + (np.abs(b.get()) if bias else 0)) < 1e-5, T
        yt = [poisoned((T, m)) for m in (n0, n1, n2)]
        K("mv3_tok", qtype(name).id)((T, (n + 3) // 4), (128,),
                                     (*ds, I64(rb), x, I32(cols), nw if norm else NULL, F32(1e-6), *yt,
                                      *((b if bias else NULL) for b in bs), I32(n0), I32(n1), I32(n2), I32(cols)),
                                     shared_mem=staged_bytes(cols))
        for t in range(T):
            y1 = [poisoned(m) for m in (n0, n1, n2)]
            K("mv3", qtype(name).id)(((n + 3) // 4,), (128,),
                                     (*ds, I64(rb), x[t], nw if norm else NULL, F32(1e-6), *y1,
                                      *((b if bias else NULL) for b in bs), I32(n0), I32(n1), I32(n2), I32(cols)),
                                     shared_mem=staged_bytes(cols))
            for a, c, b in zip(ys, yt, y1):
                near(a.get()[t], b.get(), np.abs(b.get()), f"T={T} t={t}")
                near(c.get()[t], b.get(), np.abs(b.get()), f"mv3_tok T={T} t={t}")


@pytest.mark.parametrize("name,rows,cols,norm", [("Q4_K", 200, 1024, True), ("Q6_K", 64, 6144, True),
                                                 ("F32", 5, 256, False), ("Q2_0", 9, 4096, True)])
def test_swiglu_win(K, name, rows, cols, norm):
    rng = np.random.default_rng()
    rg, Wg = rand_matrix(name, rows, cols, rng)
    ru, Wu = rand_matrix(name, rows, cols, rng)
    nw = rng.standard_normal(cols).astype(np.float32)
    d_g, d_u, d_nw = cp.asarray(rg), cp.asarray(ru), cp.asarray(nw)
    f = K("swiglu_win", qtype(name).id)
    for T in SOME:
        if T * staged_bytes(cols) > SMEM_MAX:
            continue
        x = rng.standard_normal((T, cols)).astype(np.float32)
        d_x = cp.asarray(x)
        h = poisoned((T, rows))
        f(((rows + 3) // 4,), (128,), (d_g, d_u, I64(rg.shape[1]), d_x, I32(cols), d_nw if norm else NULL,
                                       F32(1e-6), ptr(h), I32(rows), I32(cols), I32(T)),
          shared_mem=smem(f, T * staged_bytes(cols)))
        xin = rms_ref(x, nw) if norm else x.astype(np.float64)
        g, u = xin @ Wg.astype(np.float64).T, xin @ Wu.astype(np.float64).T
        assert rel(h.get(), g / (1 + np.exp(-g)) * u) < 1e-4, T
        ht = poisoned((T, rows))
        K("swiglu_tok", qtype(name).id)((T, (rows + 3) // 4), (128,),
                                        (d_g, d_u, I64(rg.shape[1]), d_x, I32(cols), d_nw if norm else NULL,
                                         F32(1e-6), ptr(ht), I32(rows), I32(cols)),
                                        shared_mem=smem(K("swiglu_tok", qtype(name).id), staged_bytes(cols)))
        for t in range(T):
            h1 = poisoned(rows)
            K("swiglu_mv", qtype(name).id)(((rows + 3) // 4,), (128,),
                                           (d_g, d_u, I64(rg.shape[1]), d_x[t], d_nw if norm else NULL, F32(1e-6),
                                            ptr(h1), I32(rows), I32(cols)),
                                           shared_mem=smem(K("swiglu_mv", qtype(name).id), staged_bytes(cols)))
            near(h.get()[t], h1.get(), np.abs(h1.get()), f"T={T} t={t}")
            near(ht.get()[t], h1.get(), np.abs(h1.get()), f"swiglu_tok T={T} t={t}")


# --- the window's experts ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k,n_expert", [(1, 4), (2, 8), (8, 16), (8, 128), (16, 64)])
def test_win_union(K, k, n_expert):
    rng = np.random.default_rng()
    for T in WINDOWS:
        ids = np.stack([rng.choice(n_expert, size=k, replace=False) for _ in range(T)]).astype(np.int32)
        uni = cp.full(1 + 128 * 10, -7, dtype=cp.int32)
        K("win_union")((1,), (128,), (cp.asarray(ids), I32(T * k), ptr(uni)))
        assert read_union(uni.get()) == union_ref(ids), T


def test_win_setup(K):
    from engine.cuda.launch import MappedInts
    toks, params = MappedInts(8), MappedInts(2)
    try:
        for T in WINDOWS:
            toks.view[:] = np.arange(100, 108)
            params.view[1] = 37
            state = cp.full((8, 8), -5, dtype=cp.int32)
            K("win_setup")((1,), (32,), (toks.dptr, params.dptr, ptr(state), I32(T)))
            s = state.get()
            np.testing.assert_array_equal(s[:T, 0], np.arange(100, 100 + T))
            np.testing.assert_array_equal(s[:T, 1], 37 + np.arange(T))
            assert (s[:T, 2:5] == 0).all() and (s[T:] == -5).all() and (s[:T, 5:] == -5).all()
    finally:
        toks.close()
        params.close()


class Experts:
    """n_expert random experts (gate | up | down blobs), the even ones in VRAM and the odd ones in mapped pinned host
    memory, behind one pointer table (as the expert cache's)."""

    def __init__(self, qg, qd, n_expert, n_embd, n_ff, rng):
        from engine.cuda.arena import HOST_ALLOC_MAPPED, HOST_ALLOC_PORTABLE, device_address
        raws, self.refs = [], []
        for _ in range(n_expert):
            g, Wg = rand_matrix(qg, n_ff, n_embd, rng)
            u, Wu = rand_matrix(qg, n_ff, n_embd, rng)
            d, Wd = rand_matrix(qd, n_embd, n_ff, rng)
            raws.append(np.concatenate([g.ravel(), u.ravel(), d.ravel()]))
            self.refs.append((Wg.astype(np.float64), Wu.astype(np.float64), Wd.astype(np.float64)))
        nb = raws[0].size
        stride = (nb + 255) // 256 * 256
        self.dev = cp.zeros(n_expert * stride, dtype=cp.uint8)
        self.hp = cp.cuda.runtime.hostAlloc(n_expert * stride, HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED)
        host = np.ctypeslib.as_array((ctypes.c_uint8 * (n_expert * stride)).from_address(self.hp))
        dp = device_address(self.hp)
        table = np.zeros(n_expert, dtype=np.uint64)
        for e in range(n_expert):
            if e % 2:
                host[e * stride:e * stride + nb] = raws[e]
                table[e] = dp + e * stride
            else:
                self.dev[e * stride:e * stride + nb] = cp.asarray(raws[e])
                table[e] = self.dev.data.ptr + e * stride
        self.table = cp.asarray(table)
        self.up_off = n_ff * random_rows(qg, 1, n_embd, rng).shape[1]
        self.rb_g = self.up_off // n_ff
        self.rb_d = random_rows(qd, 1, n_ff, rng).shape[1]

    def close(self):
        cp.cuda.runtime.freeHost(self.hp)


@pytest.mark.parametrize("qg,qd,n_embd,n_ff,k,n_expert", [("Q4_K", "Q4_K", 512, 768, 8, 16),
                                                         ("Q4_K", "Q6_K", 256, 4096, 8, 12),
                                                         ("Q2_0", "Q4_K", 2048, 256, 8, 20),
                                                         ("Q8_0", "Q6_K", 256, 512, 4, 6)])
def test_moe_win(K, qg, qd, n_embd, n_ff, k, n_expert):
    """Gate/up and down over the window's union of experts (VRAM and pinned host memory through one table), every
    window length: NumPy, and the one-token moe_gate_up / moe_down over the same tokens, with h staged
    in moe_down and from global memory (k * n_ff of 4096 x 8 floats is beyond its staging limit)."""
    rng = np.random.default_rng()
    ex = Experts(qg, qd, n_expert, n_embd, n_ff, rng)
    try:
        nw = cp.asarray(rng.standard_normal(n_embd).astype(np.float32))
        stage = staged_bytes(k * n_ff) <= 100 * 1024
        f_gu, f_dn = K("moe_gate_up_win", qtype(qg).id), K("moe_down_win", qtype(qd).id)
        for T in SOME:
            # few experts, so that tokens share them: the union is smaller than T * k
            ids = np.stack([rng.choice(n_expert, size=k, replace=False) for _ in range(T)]).astype(np.int32)
            w = rng.uniform(0.1, 1, size=(T, k)).astype(np.float32)
            x = rng.standard_normal((T, n_embd)).astype(np.float32)
            d_ids, d_w, d_x = cp.asarray(ids), cp.asarray(w), cp.asarray(x)
            uni = cp.zeros(1 + 128 * 10, dtype=cp.int32)
            K("win_union")((1,), (128,), (d_ids, I32(T * k), ptr(uni)))
            h = poisoned((T, k, n_ff))
            f_gu(((n_ff + 3) // 4, T * k), (128,),
                 (ex.table, uni, I64(ex.up_off), I64(ex.rb_g), d_x, nw, F32(1e-6), ptr(h), I32(n_ff), I32(n_embd),
                  I32(k)),
                 shared_mem=smem(f_gu, T * staged_bytes(n_embd)))
            xn = rms_ref(x, nw.get())
            ref_h = np.zeros((T, k, n_ff))
            for t in range(T):
                for j in range(k):
                    Wg, Wu, _ = ex.refs[ids[t, j]]
                    g, u = Wg @ xn[t], Wu @ xn[t]
                    ref_h[t, j] = g / (1 + np.exp(-g)) * u
            got_h = h.get()
            assert rel(got_h, ref_h) < 1e-4, T
            h1 = poisoned((T, k, n_ff))
            K("moe_gate_up", qtype(qg).id)(((n_ff + 3) // 4, k, T), (128,),
                                           (ex.table, d_ids, I64(ex.up_off), I64(ex.rb_g), d_x, nw, F32(1e-6),
                                            ptr(h1), I32(n_ff), I32(n_embd), I32(k)),
                                           shared_mem=staged_bytes(n_embd))
            near(got_h, h1.get(), np.abs(ref_h), f"gate/up T={T}")
            out0 = rng.standard_normal((T, n_embd)).astype(np.float32)
            ref = out0.astype(np.float64).copy()
            scale = np.abs(out0).astype(np.float64)
            for t in range(T):
                for j in range(k):
                    Wd = ex.refs[ids[t, j]][2]
                    ref[t] += w[t, j] * (Wd @ got_h[t, j])
                    scale[t] += w[t, j] * (np.abs(Wd) @ np.abs(got_h[t, j]))
            out = cp.asarray(out0)
            pairs = stage and qd == "Q4_K"
            sm = 4 * T * k * (n_ff // 32 if pairs else 32) * 4
            f_dn(((n_embd + 3) // 4,), (128,),
                 (ex.table, uni, d_w, I64(2 * ex.up_off), I64(ex.rb_d), ptr(h), ptr(out), I32(n_embd), I32(n_ff),
                  I32(k), I32(T), I32(1 if stage else 0)),
                 shared_mem=smem(f_dn, sm))
            got = out.get()
            assert rel_to(got, ref, scale) < 1e-5, T
            out1 = cp.asarray(out0)
            f1 = K("moe_down", qtype(qd).id)
            f1(((n_embd + 3) // 4, T), (128,),
               (ex.table, d_ids, d_w, I64(2 * ex.up_off), I64(ex.rb_d), ptr(h), ptr(out1), I32(n_embd), I32(n_ff),
                I32(k), I32(1 if stage else 0)),
               shared_mem=smem(f1, staged_bytes(k * n_ff)) if stage else 0)
            near(got, out1.get(), scale, f"down T={T} stage={stage}")
    finally:
        ex.close()


@pytest.mark.parametrize("name,n_expert,k,ncols,renorm,biased", [("F32", 128, 8, 2048, 1, True),
                                                                 ("Q4_K", 512, 16, 1024, 1, False),
                                                                 ("Q8_0", 60, 4, 512, 0, True),
                                                                 ("F32", 128, 8, 4608, 0, False)])
def test_router_win(K, name, n_expert, k, ncols, renorm, biased):
    """The window's router logits, routing and expert union in one launch: NumPy's ranking on its logits, and
    router_fused (router_fused_bias with a bias) once per token, bit for bit (logits, ids, weights), with the same
    counts and hit statistics; twice, so the last-block counter must be back at zero."""
    rng = np.random.default_rng()
    raw, W = rand_matrix(name, n_expert, ncols, rng)
    Wd = W.astype(np.float64)
    d_raw = cp.asarray(raw)
    nw = cp.asarray(rng.uniform(0.5, 1.5, ncols).astype(np.float32))
    table = cp.asarray(rng.choice([1500, 5000], size=n_expert).astype(np.uint64))   # 1500: inside the slot range
    counter = cp.zeros(1, dtype=cp.int32)
    bias = cp.asarray(rng.standard_normal(n_expert).astype(np.float32))
    f = K("router_win", qtype(name).id)
    for T in (1, 2, 6, 8):
        if T * k > 128:
            continue
        x = cp.asarray(rng.standard_normal((T, ncols)).astype(np.float32))
        logits, ids, wts = poisoned((T, n_expert)), cp.full((T, k), -1, dtype=cp.int32), poisoned((T, k))
        counts, stats = cp.zeros(n_expert, dtype=cp.int32), cp.zeros(2, dtype=cp.uint64)
        uni = cp.full(1 + 128 * 10, -7, dtype=cp.int32)
        for _ in range(2):
            f(((n_expert + 3) // 4,), (128,),
              (d_raw, I64(raw.shape[1]), x, I32(ncols), nw, F32(1e-6), I32(ncols), ptr(logits), I32(n_expert),
               I32(k), I32(renorm), F32(1.5), ptr(ids), ptr(wts), table, U64(1000), U64(2000), ptr(counts),
               ptr(stats), ptr(counter), ptr(uni), I32(T), ptr(bias) if biased else NULL),
              shared_mem=smem(f, T * staged_bytes(ncols)))
        assert int(counter.get()[0]) == 0
        xn = rms_ref(x.get(), nw.get())
        b = bias.get() if biased else 0.0
        assert rel_to(logits.get(), xn @ Wd.T + b, np.abs(xn) @ np.abs(Wd).T + np.abs(b)) < 1e-5, T
        lg = logits.get().astype(np.float64)
        got_ids = ids.get()
        for t in range(T):
            np.testing.assert_array_equal(got_ids[t], np.argsort(-lg[t], kind="stable")[:k])
        assert read_union(uni.get()) == union_ref(got_ids), T
        # router_fused token by token: the same logits, routing, counts and statistics
        l1, i1, w1 = poisoned((T, n_expert)), cp.full((T, k), -1, dtype=cp.int32), poisoned((T, k))
        c1, s1 = cp.zeros(n_expert, dtype=cp.int32), cp.zeros(2, dtype=cp.uint64)
        for _ in range(2):
            for t in range(T):
                one = K("router_fused_bias" if biased else "router_fused", qtype(name).id)
                one(((n_expert + 3) // 4,), (128,),
                    (d_raw, I64(raw.shape[1]), x[t], nw, F32(1e-6), I32(ncols), ptr(l1[t]), I32(n_expert), I32(k),
                     I32(renorm), F32(1.5), ptr(i1[t]), ptr(w1[t]), table, U64(1000), U64(2000), ptr(c1), ptr(s1),
                     ptr(counter), *((bias,) if biased else ())),
                    shared_mem=smem(one, staged_bytes(ncols)))
        np.testing.assert_array_equal(logits.get(), l1.get())
        np.testing.assert_array_equal(got_ids, i1.get())
        np.testing.assert_array_equal(wts.get(), w1.get())
        np.testing.assert_array_equal(counts.get(), c1.get())
        np.testing.assert_array_equal(stats.get(), s1.get())



def swiglu_oai_ref(g, u):
    x, y = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
    return x / (1 + np.exp(-1.702 * x)) * (y + 1)


@pytest.mark.parametrize("qg,qd,n_embd,n_ff,k,n_expert", [("MXFP4", "MXFP4", 512, 768, 4, 12),
                                                         ("F16", "F16", 256, 8192, 4, 6),
                                                         ("Q4_K", "Q4_K", 1024, 256, 8, 20)])
def test_moe_oss_win(K, qg, qd, n_embd, n_ff, k, n_expert):
    """gpt-oss's experts over the window's union: biases and SWIGLU_OAI, NumPy and the one-token moe_gate_up_oai /
    moe_down_bias over the same tokens (h staged in the down projection, and from global memory at
    k * n_ff = 32768)."""
    rng = np.random.default_rng()
    ex = Experts(qg, qd, n_expert, n_embd, n_ff, rng)
    try:
        nw = cp.asarray(rng.standard_normal(n_embd).astype(np.float32))
        bg, bu = (rng.standard_normal((n_expert, n_ff)).astype(np.float32) for _ in range(2))
        bd = rng.standard_normal((n_expert, n_embd)).astype(np.float32)
        d_bg, d_bu, d_bd = cp.asarray(bg), cp.asarray(bu), cp.asarray(bd)
        stage = staged_bytes(k * n_ff) <= 100 * 1024
        f_gu, f_dn = K("moe_gate_up_oai_win", qtype(qg).id), K("moe_down_bias_win", qtype(qd).id)
        for T in SOME:
            ids = np.stack([rng.choice(n_expert, size=k, replace=False) for _ in range(T)]).astype(np.int32)
            w = rng.uniform(0.1, 1, size=(T, k)).astype(np.float32)
            x = rng.standard_normal((T, n_embd)).astype(np.float32)
            d_ids, d_w, d_x = cp.asarray(ids), cp.asarray(w), cp.asarray(x)
            uni = cp.zeros(1 + 128 * 10, dtype=cp.int32)
            K("win_union")((1,), (128,), (d_ids, I32(T * k), ptr(uni)))
            h = poisoned((T, k, n_ff))
            f_gu(((n_ff + 3) // 4, min(T * k, n_expert)), (128,),
                 (ex.table, uni, I64(ex.up_off), I64(ex.rb_g), d_x, nw, F32(1e-6), ptr(h), I32(n_ff), I32(n_embd),
                  I32(k), d_bg, d_bu),
                 shared_mem=smem(f_gu, T * staged_bytes(n_embd)))
            xn = rms_ref(x, nw.get())
            ref_h = np.zeros((T, k, n_ff))
            for t in range(T):
                for j in range(k):
                    e = ids[t, j]
                    Wg, Wu, _ = ex.refs[e]
                    ref_h[t, j] = swiglu_oai_ref(Wg @ xn[t] + bg[e], Wu @ xn[t] + bu[e])
            got_h = h.get()
            assert rel(got_h, ref_h) < 1e-4, T
            h1 = poisoned((T, k, n_ff))
            f1 = K("moe_gate_up_oai", qtype(qg).id)
            f1(((n_ff + 3) // 4, k, T), (128,),
               (ex.table, d_ids, I64(ex.up_off), I64(ex.rb_g), d_x, nw, F32(1e-6), ptr(h1), I32(n_ff), I32(n_embd),
                I32(k), d_bg, d_bu),
               shared_mem=smem(f1, staged_bytes(n_embd)))
            near(got_h, h1.get(), np.abs(ref_h), f"gate/up T={T}")
            out0 = rng.standard_normal((T, n_embd)).astype(np.float32)
            ref = out0.astype(np.float64).copy()
            scale = np.abs(out0).astype(np.float64)
            for t in range(T):
                for j in range(k):
                    e = ids[t, j]
                    Wd = ex.refs[e][2]
                    ref[t] += w[t, j] * (Wd @ got_h[t, j] + bd[e])
                    scale[t] += w[t, j] * (np.abs(Wd) @ np.abs(got_h[t, j]) + np.abs(bd[e]))
            out = cp.asarray(out0)
            per = n_ff // 32 if qd == "MXFP4" else 32
            f_dn(((n_embd + 3) // 4,), (128,),
                 (ex.table, uni, d_ids, d_w, I64(2 * ex.up_off), I64(ex.rb_d), ptr(h), ptr(out), I32(n_embd),
                  I32(n_ff), I32(k), I32(T), I32(1 if stage else 0), d_bd),
                 shared_mem=smem(f_dn, 4 * T * k * per * 4))
            got = out.get()
            assert rel_to(got, ref, scale) < 1e-5, T
            out1 = cp.asarray(out0)
            f1 = K("moe_down_bias", qtype(qd).id)
            f1(((n_embd + 3) // 4, T), (128,),
               (ex.table, d_ids, d_w, I64(2 * ex.up_off), I64(ex.rb_d), ptr(h), ptr(out1), I32(n_embd), I32(n_ff),
                I32(k), I32(1 if stage else 0), d_bd),
               shared_mem=smem(f1, staged_bytes(k * n_ff)) if stage else 0)
            near(got, out1.get(), scale, f"down T={T} stage={stage}")
    finally:
        ex.close()
