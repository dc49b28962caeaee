"""Gated DeltaNet kernels (cuda_src/gdn.cu through engine/cuda/families/gdn.py) against the NumPy reference in
float64, on fresh random data at the tiny test models' and the published models' head shapes, every output poisoned
first.

Decode is fp32 throughout (tight tolerance); the prompt's chunked rule takes fp16 mma inputs with fp32 accumulators
and state, so its outputs and state are held to a relative (Frobenius) error of PROMPT_TOL; the measured errors are
printed (pytest -s) for the notes."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine.cuda.families.gdn import GdnKernels, GdnShape, ref_conv_act, ref_layer  # noqa: E402

DECODE_TOL = 2e-5
PROMPT_TOL = 3e-3      # measured up to 5.6e-4 (outputs) and 4.8e-4 (state): docs/experiments.md, the GDN kernels

# (n_k, n_v, D, grouped[, sigmoid gate]): the tiny models', Qwen3-Next-80B-A3B's (grouped), Qwen3.5-35B-A3B's
# (tiled) heads, and Qwen3.8-Flash-Next's (qwen4exp: tiled, 3 value heads a key head, the sigmoid output gate)
SHAPES = [(2, 4, 64, True), (2, 4, 64, False), (4, 4, 128, False), (16, 32, 128, True), (16, 32, 128, False),
          (16, 48, 128, False, True)]
IDS = ["tiny-next", "tiny-35", "r1-128", "next-80b", "q35-35b", "q38-flash-sigmoid"]

_kernels = {}


def kern(shape: GdnShape) -> GdnKernels:
    if shape not in _kernels:
        _kernels[shape] = GdnKernels(shape)
    return _kernels[shape]


def rel(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30))


class Layer:
    """One GDN layer's random weights and state (float64 on the host, fp32 copies on the device), values as a real
    model's: A_log in log(1..16), softplus(dt_bias) in 0.001..0.1 (so exp(g) spans about 0.2 .. 1 per token)."""

    def __init__(self, shape: GdnShape, rng):
        self.shape = sh = shape
        C, Hv, D = sh.channels, sh.n_v_heads, sh.head_dim
        self.conv_w = rng.standard_normal((C, sh.conv_kernel)) * 0.5
        self.dt_bias = np.log(np.expm1(rng.uniform(0.001, 0.1, Hv)))
        self.ssm_a = -rng.uniform(1.0, 16.0, Hv)
        self.norm_w = 1.0 + 0.1 * rng.standard_normal(D)
        self.conv_state = rng.standard_normal((sh.conv_kernel - 1, C))
        self.S = 0.1 * rng.standard_normal((Hv, D, D))
        self.dev = {k: cp.asarray(getattr(self, k), cp.float32)
                    for k in ("conv_w", "dt_bias", "ssm_a", "norm_w", "conv_state", "S")}

    def inputs(self, T: int, rng):
        """(qkv, z, b, a) for T tokens: b is ssm_ba (T, 2 n_v) and a None when grouped (qwen3next), else both (T, n_v)
        as views of one (T, 2 n_v) buffer. qkv and z are views of one (T, C + n_v D) buffer, as one GEMM gives them."""
        sh = self.shape
        both = rng.standard_normal((T, sh.channels + sh.n_v_heads * sh.head_dim))
        ba = rng.standard_normal((T, 2 * sh.n_v_heads))
        dev_both, dev_ba = cp.asarray(both, cp.float32), cp.asarray(ba, cp.float32)
        C, Hv = sh.channels, sh.n_v_heads
        host = (both[:, :C], both[:, C:], ba, None) if sh.grouped else (both[:, :C], both[:, C:], ba[:, :Hv], ba[:, Hv:])
        dev = ((dev_both[:, :C], dev_both[:, C:], dev_ba, None) if sh.grouped
               else (dev_both[:, :C], dev_both[:, C:], dev_ba[:, :Hv], dev_ba[:, Hv:]))
        # the reference sees the fp32 values the GPU sees
        host = tuple(None if x is None else np.asarray(x, np.float32).astype(np.float64) for x in host)
        return host, dev

    def reference(self, host, chunked=False):
        qkv, z, b, a = host
        out, self.conv_state, self.S = ref_layer(self.shape, qkv, z, b, a, self.dt_bias, self.ssm_a, self.conv_w,
                                                 self.norm_w, self.conv_state, self.S, chunked)
        return out


def shape_of(p) -> GdnShape:
    n_k, n_v, D, grouped, *sig = p
    return GdnShape(n_k, n_v, D, 4, grouped, 1e-6, bool(sig and sig[0]))


def as64(lay: Layer):
    """The layer's float64 weights rounded as the device holds them (fp32)."""
    for k in ("conv_w", "dt_bias", "ssm_a", "norm_w", "conv_state", "S"):
        setattr(lay, k, np.asarray(getattr(lay, k), np.float32).astype(np.float64))
    return lay


@pytest.mark.parametrize("p", SHAPES, ids=IDS)
def test_conv_decode(p):
    sh = shape_of(p)
    rng = np.random.default_rng()
    lay = as64(Layer(sh, rng))
    k = kern(sh)
    for _ in range(3):
        host, dev = lay.inputs(1, rng)
        want, lay.conv_state = ref_conv_act(sh, host[0], lay.conv_state, lay.conv_w)
        act = cp.full(sh.channels, cp.nan, cp.float32)
        k.conv_decode(dev[0][0], lay.dev["conv_state"], lay.dev["conv_w"], act)
        assert rel(act.get(), want[0]) < DECODE_TOL
        assert rel(lay.dev["conv_state"].get(), lay.conv_state) < DECODE_TOL


@pytest.mark.parametrize("p", SHAPES, ids=IDS)
def test_decode_steps_match_the_recurrence(p):
    sh = shape_of(p)
    rng = np.random.default_rng()
    lay = as64(Layer(sh, rng))
    k = kern(sh)
    act = cp.full(sh.channels, cp.nan, cp.float32)
    for step in range(4):
        host, dev = lay.inputs(1, rng)
        want = lay.reference(host)
        out = cp.full(sh.n_v_heads * sh.head_dim, cp.nan, cp.float32)
        qkv, z, b, a = dev
        k.decode(qkv[0], z[0], b[0], None if a is None else a[0], lay.dev["dt_bias"], lay.dev["ssm_a"],
                 lay.dev["conv_w"], lay.dev["norm_w"], lay.dev["conv_state"], lay.dev["S"], out, act)
        assert rel(out.get(), want[0]) < DECODE_TOL, f"step {step}"
        assert rel(lay.dev["S"].get(), lay.S) < DECODE_TOL, f"step {step}"
        assert rel(lay.dev["conv_state"].get(), lay.conv_state) < DECODE_TOL


def poisoned_scratch(k: GdnKernels, T: int):
    s = k.scratch(T)
    for a in (s.act16, s.gcum, s.tcat, s.qkm):
        a.fill(np.nan)
    return s


def run_prefill(k, lay, dev, T, scratch):
    qkv, z, b, a = dev
    out = cp.full((T, lay.shape.n_v_heads * lay.shape.head_dim), cp.nan, cp.float32)
    k.prefill(qkv, z, b, a, lay.dev["dt_bias"], lay.dev["ssm_a"], lay.dev["conv_w"], lay.dev["norm_w"],
              lay.dev["conv_state"], lay.dev["S"], out, scratch, T)
    return out


@pytest.mark.parametrize("T", [1, 2, 37, 64, 65, 200])
@pytest.mark.parametrize("p", SHAPES, ids=IDS)
def test_prefill_matches_the_recurrence(p, T):
    sh = shape_of(p)
    rng = np.random.default_rng()
    lay = as64(Layer(sh, rng))
    k = kern(sh)
    host, dev = lay.inputs(T, rng)
    want = lay.reference(host)               # token by token, float64
    out = run_prefill(k, lay, dev, T, poisoned_scratch(k, T))
    e_out, e_S = rel(out.get(), want), rel(lay.dev["S"].get(), lay.S)
    print(f"\ngdn prompt {IDS[SHAPES.index(p)]} T={T}: out rel err {e_out:.2e}, state {e_S:.2e}")
    assert e_out < PROMPT_TOL and e_S < PROMPT_TOL
    assert rel(lay.dev["conv_state"].get(), lay.conv_state) < DECODE_TOL


@pytest.mark.parametrize("T", [1, 2, 3, 31, 33, 100])
@pytest.mark.parametrize("p", SHAPES[:2] + SHAPES[3:4], ids=IDS[:2] + IDS[3:4])
def test_conv_prefill(p, T):
    """The prompt's conv alone (fp16 activations, so fp16's rounding bounds the error), and its carried state."""
    sh = shape_of(p)
    rng = np.random.default_rng()
    lay = as64(Layer(sh, rng))
    k = kern(sh)
    host, dev = lay.inputs(T, rng)
    want, state = ref_conv_act(sh, host[0], lay.conv_state, lay.conv_w)
    scratch = poisoned_scratch(k, T + 5)
    k.conv_prefill(dev[0], T, lay.dev["conv_state"], lay.dev["conv_w"], scratch)
    got = scratch.act16[:T].get().astype(np.float64)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 1e-3 * max(1.0, np.abs(want).max())
    assert rel(lay.dev["conv_state"].get(), state) < DECODE_TOL
    assert np.isnan(scratch.act16[T:].get().astype(np.float32)).all()      # nothing past T written


@pytest.mark.parametrize("split", [(70, 130), (64, 64), (1, 150), (129, 3)])
@pytest.mark.parametrize("p", SHAPES[:2] + SHAPES[3:4], ids=IDS[:2] + IDS[3:4])
def test_prompt_chunks_carry_the_state(p, split):
    """Two prompt chunks in a row (conv and delta state carried on the device) end where one pass of both ends, and
    both agree with the reference."""
    sh = shape_of(p)
    rng = np.random.default_rng()
    lay = as64(Layer(sh, rng))
    k = kern(sh)
    T = sum(split)
    host, dev = lay.inputs(T, rng)
    want = lay.reference(host)
    S0, c0 = lay.dev["S"].copy(), lay.dev["conv_state"].copy()
    scratch = poisoned_scratch(k, T)
    one = run_prefill(k, lay, dev, T, scratch).get()
    S1, c1 = lay.dev["S"].get(), lay.dev["conv_state"].get()
    lay.dev["S"][...], lay.dev["conv_state"][...] = S0, c0
    parts, t0 = [], 0
    for n in split:
        piece = tuple(None if x is None else x[t0:t0 + n] for x in dev)
        parts.append(run_prefill(k, lay, piece, n, poisoned_scratch(k, n)).get())
        t0 += n
    two = np.concatenate(parts)
    assert rel(two, one) < PROMPT_TOL and rel(lay.dev["S"].get(), S1) < PROMPT_TOL
    assert np.array_equal(lay.dev["conv_state"].get(), c1)
    assert rel(two, want) < PROMPT_TOL and rel(lay.dev["S"].get(), lay.S) < PROMPT_TOL


@pytest.mark.parametrize("p", SHAPES, ids=IDS)
def test_decode_after_prefill(p):
    """A prompt on the device, then decode steps: the same as the reference's recurrence over all the tokens."""
    sh = shape_of(p)
    rng = np.random.default_rng()
    lay = as64(Layer(sh, rng))
    k = kern(sh)
    T = 150
    host, dev = lay.inputs(T, rng)
    lay.reference(host)
    run_prefill(k, lay, dev, T, poisoned_scratch(k, T))
    act = cp.full(sh.channels, cp.nan, cp.float32)
    for step in range(3):
        host, dev = lay.inputs(1, rng)
        want = lay.reference(host)
        out = cp.full(sh.n_v_heads * sh.head_dim, cp.nan, cp.float32)
        qkv, z, b, a = dev
        k.decode(qkv[0], z[0], b[0], None if a is None else a[0], lay.dev["dt_bias"], lay.dev["ssm_a"],
                 lay.dev["conv_w"], lay.dev["norm_w"], lay.dev["conv_state"], lay.dev["S"], out, act)
        assert rel(out.get(), want[0]) < PROMPT_TOL, f"step {step}"
    assert rel(lay.dev["S"].get(), lay.S) < PROMPT_TOL


@pytest.fixture(scope="module")
def mv_table():
    """The engine's kernel table for the projections of test_decode_in_the_engines_launches."""
    from engine.cuda.kernels import Kernels
    from engine.cuda.quant_types import qtype
    return Kernels({qtype(n).id for n in ("Q8_0", "F16")})


@pytest.mark.parametrize("qts", [("Q8_0",) * 4, ("F16", "Q8_0", "Q8_0", "Q8_0")], ids=["one-type", "two-types"])
@pytest.mark.parametrize("p", SHAPES, ids=IDS)
def test_decode_in_the_engines_launches(mv_table, p, qts):
    """The decode step's GDN mixer as engine/cuda/families/hybrid.py launches it: the four projections of the normed x
    in one launch through Launcher.mv_many (two types: mv_mixed.cu) with the conv in attn_qkv's epilogue, then
    gdn_delta_decode with the q/k l2 norms (qk_norm), against the two-launch path (separate mat-vecs, conv_decode,
    delta_decode) on a copy of the state, and both against the float64 recurrence on the same projections; every
    output poisoned first, four tokens."""
    from types import SimpleNamespace

    from engine.cuda.launch import Launcher, load_mixed, mixed_pairs
    from engine.cuda.quant_types import qtype, random_rows
    from engine.cuda.weights import DevMatrix
    from engine.gguf_model import dequantize

    sh = shape_of(p)
    rng = np.random.default_rng()
    lay = as64(Layer(sh, rng))
    k, n_embd, eps = kern(sh), 512, 1e-6
    mv = Launcher(mv_table, SimpleNamespace(rms_eps=eps))
    C, Hv, D = sh.channels, sh.n_v_heads, sh.head_dim
    rows = (C, Hv * D, 2 * Hv if sh.grouped else Hv, 0 if sh.grouped else Hv)
    mats, host = [], []
    for name, r in zip(qts, rows):
        if not r:
            mats.append(None)
            host.append(None)
            continue
        raw = random_rows(name, r, n_embd, rng)
        mats.append(DevMatrix(cp.asarray(raw), qtype(name).id, r, n_embd, raw.shape[1]))
        host.append(dequantize(raw, qtype(name).ggml).reshape(r, n_embd).astype(np.float64))
    # projections of about unit size (the weights' entries are about 1.5 (Q8_0) or 1 (F16)), as a model's: beta and
    # the decay then neither saturate nor vanish
    norm_w = rng.uniform(0.01, 0.03, n_embd).astype(np.float32)
    load_mixed(mv_table, mixed_pairs([mats]))
    dnorm = cp.asarray(norm_w)
    two = {n: lay.dev[n].copy() for n in ("conv_state", "S")}        # the two-launch path's own state
    for step in range(4):
        x = rng.standard_normal(n_embd).astype(np.float32)
        dx = cp.asarray(x)
        xn = x / np.sqrt((x.astype(np.float64) ** 2).mean() + eps) * norm_w
        proj = [None if W is None else (W @ xn)[None] for W in host]
        want = lay.reference((proj[0], proj[1], proj[2], proj[3]))
        ys = [cp.full(r + 3, cp.nan, cp.float32) for r in rows]
        out = cp.full(Hv * D, cp.nan, cp.float32)
        mv.mv_many(mats, dx, ys, norm=dnorm, conv=(lay.dev["conv_state"], lay.dev["conv_w"], sh.conv_kernel),
                   mixed=True)
        k.delta_decode(ys[0], ys[2][:rows[2]], None if sh.grouped else ys[3][:rows[3]], lay.dev["dt_bias"],
                       lay.dev["ssm_a"], lay.dev["S"], ys[1], lay.dev["norm_w"], out, qk_norm=True)
        zs = [cp.full(r, cp.nan, cp.float32) for r in rows]
        for W, y in zip(mats, zs):
            if W is not None:
                mv.mv(W, dx, y, norm=dnorm)
        act, out2 = cp.full(C, cp.nan, cp.float32), cp.full(Hv * D, cp.nan, cp.float32)
        k.decode(zs[0], zs[1], zs[2], None if sh.grouped else zs[3], lay.dev["dt_bias"], lay.dev["ssm_a"],
                 lay.dev["conv_w"], lay.dev["norm_w"], two["conv_state"], two["S"], out2, act)
        got = out.get()
        assert np.isfinite(got).all() and all(np.isnan(y[r:].get()).all() for y, r in zip(ys, rows))
        assert rel(got, want[0]) < DECODE_TOL, f"step {step}"
        assert rel(got, out2.get()) < DECODE_TOL, f"step {step}"
        assert rel(lay.dev["S"].get(), lay.S) < DECODE_TOL, f"step {step}"
        assert rel(lay.dev["conv_state"].get(), lay.conv_state) < DECODE_TOL
        assert rel(lay.dev["S"].get(), two["S"].get()) < DECODE_TOL
        assert rel(lay.dev["conv_state"].get(), two["conv_state"].get()) < DECODE_TOL


@pytest.mark.slow
@pytest.mark.parametrize("p", SHAPES[3:], ids=IDS[3:])
def test_long_prompt_at_the_published_shapes(p):
    """1000 tokens (not a multiple of the chunk) at the 80B's and the 35B's head shapes: the error stays bounded over
    16 chunks of state carried in fp32."""
    sh = shape_of(p)
    rng = np.random.default_rng()
    lay = as64(Layer(sh, rng))
    k = kern(sh)
    T = 1000
    host, dev = lay.inputs(T, rng)
    want = lay.reference(host, chunked=True)      # the float64 chunk form (tests/test_hybrid.py: = the recurrence)
    out = run_prefill(k, lay, dev, T, poisoned_scratch(k, T))
    e_out, e_S = rel(out.get(), want), rel(lay.dev["S"].get(), lay.S)
    print(f"\ngdn prompt {IDS[SHAPES.index(p)]} T={T}: out rel err {e_out:.2e}, state {e_S:.2e}")
    assert e_out < PROMPT_TOL and e_S < PROMPT_TOL


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="64 and 128"):
        GdnShape(2, 4, 96, 4, True, 1e-6)
    with pytest.raises(ValueError, match="do not group"):
        GdnShape(3, 4, 64, 4, True, 1e-6)
    sh = shape_of(SHAPES[0])
    k = kern(sh)
    with pytest.raises(ValueError, match="scratch"):
        k.conv_prefill(cp.zeros((10, sh.channels), cp.float32), 10, cp.zeros((3, sh.channels), cp.float32),
                       cp.zeros((sh.channels, 4), cp.float32), k.scratch(8))
