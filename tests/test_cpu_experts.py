"""CPU experts (engine/cpu_experts.py, the numba kernels of engine/cpu_expert_kernels.py and cpu_decode.py) against
the NumPy backend: the decoders bit for bit against engine.gguf_model.dequantize, every row dot and whole layers
exact to float32 rounding (against float64 over the same dequantized weights, where the NumPy backend's float32
lands too), for every quant type the kernels read, at several sizes, outputs poisoned first; the result's bits the
same for any thread count and for a kernel compiled afresh or loaded from numba's cache."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine import cpu_experts as ce
from engine.arch import base, gptoss
from engine.gguf_model import dequantize, open_model

try:
    import numba
    from engine import cpu_decode, cpu_expert_kernels as kern
except ImportError:         # the NumPy backend's tests still run
    numba = cpu_decode = kern = None
needs_numba = pytest.mark.skipif(numba is None, reason="the CPU expert kernels need numba (requirements.txt)")

ROOT = Path(__file__).resolve().parent.parent
NAMES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 10: "Q2_K",
         11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS", 16: "IQ2_XXS", 17: "IQ2_XS",
         22: "IQ2_S", 18: "IQ3_XXS", 21: "IQ3_S", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0", 42: "Q2_0"}
TYPES = sorted(NAMES)
# fp16 scale fields of each block (every other byte of a block is a valid code, grids included)
F16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2),
              14: (208,), 20: (0,), 23: (0,), 16: (0,), 17: (0,), 22: (0,), 18: (0,), 21: (0,), 41: (0,), 42: (0,)}
# a bound on float32 rounding against float64, relative to sum |w_i x_i|: ~100x the errors seen (1e-8 .. 8e-8), 10x
# under what one wrong code in a 2,880-value row gives (test_a_wrong_code_fails_the_check)
ROW_TOL = 2.0 ** -16


def ids(qt):
    return NAMES[qt]


def reference(data: np.ndarray, qt: int) -> np.ndarray:
    """engine.gguf_model.dequantize (the NumPy backend's), or a skip where this checkout has none for qt."""
    try:
        with np.errstate(all="ignore"):
            return dequantize(data, qt)
    except (KeyError, ValueError, NotImplementedError, AttributeError) as e:
        pytest.skip(f"{NAMES[qt]}: engine.gguf_model.dequantize has no reference for it here ({type(e).__name__}: "
                    f"{e}); engine.quant_types (the quants branch) brings it")


def random_rows(qt: int, n_rows: int, n: int, rng, scale: float | None = None) -> np.ndarray:
    """Valid rows (n_rows, row bytes) of type qt with weights of RMS ~ scale (default 1/sqrt(n)): tools.make_moe's
    where it makes the type, else random codes under finite scales of either sign."""
    scale = scale if scale is not None else 1.0 / np.sqrt(n)
    from tools import make_moe
    made = [t for t in make_moe.SUPPORTED_TYPES if int(t) == qt]       # its enum member (gguf's or engine's)
    if made:
        return make_moe.random_rows(rng, made[0], n_rows, n, scale)
    if qt == 0:
        return (rng.standard_normal((n_rows, n)) * scale).astype(np.float32).view(np.uint8)
    if qt == 1:
        return (rng.standard_normal((n_rows, n)) * scale).astype(np.float16).view(np.uint8)
    if qt == 30:
        f = (rng.standard_normal((n_rows, n)) * scale).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    values, nbytes = ce.QUANT_BLOCKS[qt]
    blocks = rng.integers(0, 256, (n_rows * n // values, nbytes), dtype=np.uint8)
    for off in F16_FIELDS.get(qt, ()):
        d = rng.uniform(0.3, 1.0, len(blocks)) * scale / 8 * rng.choice([-1.0, 1.0], len(blocks))
        blocks[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qt == 39:        # MXFP4's E8M0 exponent: half-scale 2^(e - 128)
        blocks[:, 0] = np.clip(np.round(np.log2(scale / 4)) + 128 + rng.integers(-1, 2, len(blocks)), 2, 250)
    if qt == 40:        # NVFP4's four UE4M3 scales
        blocks[:, :4] = np.clip(np.round(np.log2(scale / 4) + 8) * 8 + rng.integers(0, 8, (len(blocks), 4)), 1, 126)
    return blocks.reshape(n_rows, n // values * nbytes)


def sizes(qt: int) -> list[int]:
    block = max(ce.QUANT_BLOCKS[qt][0], 32)
    return [block, 3 * block] + ([2880] if 2880 % block == 0 else [2048])


# --- the decoders -------------------------------------------------------------------------------------------------

@needs_numba
@pytest.mark.parametrize("qt", TYPES, ids=ids)
def test_decoders_give_the_reference_bits(qt):
    rng = np.random.default_rng(qt)
    for n in sizes(qt)[:2]:
        for data in (random_rows(qt, 5, n, rng), rng.integers(0, 256, (3, ce.row_bytes(qt, n)), dtype=np.uint8)):
            want = reference(data, qt)
            got = np.full((len(data), n), np.nan, np.float32)
            cpu_decode.decode_rows(qt, data.ctypes.data, data.shape[1], len(data), n, got)
            assert np.array_equal(got, want, equal_nan=True), f"{NAMES[qt]}, {n} values a row"


@needs_numba
def test_every_type_the_engine_reads_is_decoded():
    from engine.gguf_model import SUPPORTED_QTYPES
    assert {int(t) for t in SUPPORTED_QTYPES} <= cpu_decode.DECODED_TYPES
    assert cpu_decode.DECODED_TYPES == set(NAMES) and cpu_decode.DECODED_TYPES <= set(ce.QUANT_BLOCKS)
    assert kern.FUSED_TYPES <= cpu_decode.DECODED_TYPES


# --- row dots -----------------------------------------------------------------------------------------------------

def row_errors(qt, data, n, x):
    """|kernel - float64| / sum |w x| per row, and the NumPy backend's float32 likewise."""
    w = reference(data, qt)
    exact = w.astype(np.float64) @ x.astype(np.float64)
    mag = np.abs(w).astype(np.float64) @ np.abs(x).astype(np.float64)
    got = np.full(len(data), np.nan, np.float32)
    kern.dot_rows(qt, data.ctypes.data, data.shape[1], len(data), n, x, got)
    return np.abs(got - exact) / mag, np.abs(w @ x - exact) / mag


@needs_numba
@pytest.mark.parametrize("qt", TYPES, ids=ids)
def test_row_dots_are_exact_to_float32_rounding(qt):
    rng = np.random.default_rng(100 + qt)
    for n in sizes(qt):
        data = random_rows(qt, 24, n, rng)
        x = rng.standard_normal(n).astype(np.float32)
        ours, numpy_f32 = row_errors(qt, data, n, x)
        assert ours.max() <= ROW_TOL, f"{NAMES[qt]} n={n}: {ours.max():.2e} (NumPy's float32: {numpy_f32.max():.2e})"


@needs_numba
@pytest.mark.parametrize("qt", [12, 39, 8, 17, 42], ids=ids)
def test_a_wrong_code_fails_the_check(qt):
    """The bound above is far below what a decoding error gives: one block's last 16 bytes changed in one row of
    2,048 or 2,880 values."""
    rng = np.random.default_rng(7)
    n = 2880 if 2880 % ce.QUANT_BLOCKS[qt][0] == 0 else 2048
    data = random_rows(qt, 4, n, rng)
    x = rng.standard_normal(n).astype(np.float32)
    bad = data.copy()
    nbytes = ce.QUANT_BLOCKS[qt][1]
    bad[2, nbytes - 16:nbytes] ^= 0x55       # the first block's codes
    w, wb = reference(data, qt), reference(bad, qt)
    exact = w.astype(np.float64) @ x
    mag = np.abs(w).astype(np.float64) @ np.abs(x)
    got = np.zeros(4, np.float32)
    kern.dot_rows(qt, bad.ctypes.data, bad.shape[1], 4, n, x, got)
    assert not np.array_equal(w, wb)
    assert (np.abs(got - exact) / mag)[2] > 10 * ROW_TOL
    assert (np.abs(got - exact) / mag)[[0, 1, 3]].max() <= ROW_TOL


# --- whole layers -------------------------------------------------------------------------------------------------

class _Weights:
    """The NumPy backend's engine.arch.base.Weights as moe_ffn reads it: expert(layer, e) -> float32 matrices."""

    def __init__(self, experts):
        self.experts = experts

    def expert(self, layer, e, decoding):
        return self.experts[e]


def blob_table(types, n_ff, n_embd, n_expert, rng, activation="swiglu", biases=False):
    """An ExpertTable over one layer of random experts packed as arena blobs, and their dequantized matrices."""
    t = ce.LayerTypes.of(*types, n_ff, n_embd)
    nbytes = t.expert_bytes(n_ff, n_embd)
    stride = (nbytes + 255) // 256 * 256
    buf = np.zeros(n_expert * stride + 256, np.uint8)
    start = (-buf.ctypes.data) % 256
    mats = []
    for e in range(n_expert):
        rows = [random_rows(types[0], n_ff, n_embd, rng), random_rows(types[1], n_ff, n_embd, rng),
                random_rows(types[2], n_embd, n_ff, rng)]
        o = start + e * stride
        buf[o:o + nbytes] = np.concatenate([r.reshape(-1) for r in rows])
        mats.append(tuple(reference(r, q) for r, q in zip(rows, types)))
    lay = ce.PackedLayout(t.gate, t.up, t.down, n_ff * t.rb_gate, n_ff * (t.rb_gate + t.rb_up), n_ff, n_embd, stride)
    ptr = buf.ctypes.data + start + np.arange(n_expert, dtype=np.uint64) * np.uint64(stride)
    b = None
    if biases:
        b = ((tuple((rng.standard_normal(s) * 0.1).astype(np.float32)
                    for s in ((n_expert, n_ff), (n_expert, n_ff), (n_expert, n_embd)))),)
    return ce.ExpertTable.from_blobs(ptr, [lay], n_expert, activation, b, (buf,)), mats


def numpy_backend(table, mats, ids, weights, x):
    """The NumPy backend's computation of these experts: moe_ffn, or gpt-oss's ffn body."""
    if table.activation == "swiglu":
        return base.moe_ffn(_Weights(mats), 0, x[None, :], np.asarray(ids)[None, :], weights[None, :], True)[0]
    bg, bu, bd = table.biases[0] if table.biases is not None else (np.zeros((len(mats), table.n_ff), np.float32),) * 2 \
        + (np.zeros((len(mats), table.n_embd), np.float32),)
    out = np.zeros(table.n_embd, np.float32)
    for e, w in sorted(zip(ids, weights)):
        gate, up, down = mats[e]
        h = gptoss.swiglu_oai(x @ gate.T + bg[e], x @ up.T + bu[e])
        out += w * (h @ down.T + bd[e])
    return out


def exact_ffn(table, mats, ids, weights, x):
    x64 = x.astype(np.float64)
    out = np.zeros(table.n_embd)
    for e, w in zip(ids, weights):
        gate, up, down = (m.astype(np.float64) for m in mats[e])
        g, u = gate @ x64, up @ x64
        if table.biases is not None:
            g, u = g + table.biases[0][0][e], u + table.biases[0][1][e]
        if table.activation == "swiglu":
            h = g / (1 + np.exp(-g)) * u
        else:
            g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
            h = g / (1 + np.exp(-1.702 * g)) * (u + 1)
        y = down @ h
        if table.biases is not None:
            y = y + table.biases[0][2][e]
        out += float(w) * y
    return out


def assert_exact_to_f32(got, exact, what):
    """Relative RMS and largest error against float64: float32 rounding sits ~3e-7; a wrong row, 1e-2."""
    scale = np.sqrt(np.mean(exact ** 2))
    err = got.astype(np.float64) - exact
    assert np.sqrt(np.mean(err ** 2)) <= 4e-6 * scale and np.abs(err).max() <= 2e-5 * np.abs(exact).max(), \
        f"{what}: rms {np.sqrt(np.mean(err ** 2)) / scale:.2e}, max {np.abs(err).max() / np.abs(exact).max():.2e}"


@needs_numba
@pytest.mark.parametrize("act", ["swiglu", "swiglu_oai"])
@pytest.mark.parametrize("qt", TYPES, ids=ids)
def test_layer_matches_the_numpy_backend(qt, act):
    rng = np.random.default_rng(1000 + qt)
    for n_ff, n_embd in ((sizes(qt)[0], sizes(qt)[1]), (sizes(qt)[1], sizes(qt)[0])):
        table, mats = blob_table((qt, qt, qt), n_ff, n_embd, 5, rng, act, biases=act == "swiglu_oai")
        x = rng.standard_normal(n_embd).astype(np.float32)
        eids, w = [4, 1, 3], rng.uniform(0.1, 0.6, 3).astype(np.float32)
        out = np.full(n_embd, np.nan, np.float32)
        ce.experts_ffn(table, 0, eids, w, x, out, "numba")
        exact = exact_ffn(table, mats, eids, w, x)
        assert_exact_to_f32(out, exact, f"{NAMES[qt]} {act} {n_ff}x{n_embd}")
        assert_exact_to_f32(numpy_backend(table, mats, eids, w, x), exact, "the NumPy backend itself")


@needs_numba
@pytest.mark.parametrize("types", [(12, 12, 14), (12, 13, 14), (17, 17, 20), (42, 42, 41), (39, 39, 8), (30, 1, 0)],
                         ids=lambda t: "-".join(NAMES[q] for q in t))
def test_mixed_types_in_a_layer(types):
    rng = np.random.default_rng(sum(types))
    n = max(max(ce.QUANT_BLOCKS[q][0] for q in types), 32) * 2
    table, mats = blob_table(types, n, n, 4, rng)
    x = rng.standard_normal(n).astype(np.float32)
    out = np.full(n, np.nan, np.float32)
    ce.experts_ffn(table, 0, [2, 0], np.array([0.7, 0.3], np.float32), x, out)
    assert_exact_to_f32(out, exact_ffn(table, mats, [2, 0], [0.7, 0.3], x), str(types))


def test_the_numpy_fallback_is_the_backends_arithmetic():
    rng = np.random.default_rng(3)
    table, mats = blob_table((12, 12, 14), 256, 512, 6, rng)
    x = rng.standard_normal(512).astype(np.float32)
    eids, w = [1, 2, 5], rng.uniform(0.1, 0.6, 3).astype(np.float32)
    out = np.full(512, np.nan, np.float32)
    ce.experts_ffn(table, 0, eids, w, x, out, "numpy")
    np.testing.assert_array_equal(out, numpy_backend(table, mats, eids, w, x))


@needs_numba
def test_bits_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(4)
    table, _ = blob_table((12, 12, 14), 512, 256, 8, rng)
    x = rng.standard_normal(256).astype(np.float32)
    w = rng.uniform(0.1, 0.6, 8).astype(np.float32)
    outs = []
    for nt in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(nt)
        out = np.full(256, np.nan, np.float32)
        ce.experts_ffn(table, 0, np.arange(8), w, x, out)
        outs.append(out)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert all(np.array_equal(outs[0], o) for o in outs)


@needs_numba
def test_the_prefetch_distance_does_not_change_the_bits():
    rng = np.random.default_rng(9)
    table, _ = blob_table((12, 12, 14), 256, 512, 6, rng)
    x = rng.standard_normal(512).astype(np.float32)
    w = rng.uniform(0.1, 0.6, 4).astype(np.float32)
    outs = []
    for ahead in (None, 0, 1, 8):
        out = np.full(512, np.nan, np.float32)
        outs.append(ce.experts_ffn(table, 0, [5, 0, 3, 1], w, x, out, "numba", ahead))
    assert all(np.array_equal(outs[0], o) for o in outs)


_FRESH = """
import numpy as np, sys
sys.path.insert(0, {root!r})
from engine.gguf_model import open_model
from engine import cpu_experts as ce
m = open_model({path!r})
t = ce.ExpertTable.from_model(m)
rng = np.random.default_rng(5)
x = rng.standard_normal(m.config.n_embd).astype(np.float32)
out = np.zeros(m.config.n_embd, np.float32)
ce.experts_ffn(t, 1, [3, 0], np.array([0.6, 0.4], np.float32), x, out, "numba")
sys.stdout.write(out.tobytes().hex())
"""


@needs_numba
@pytest.mark.slow
def test_a_fresh_compile_gives_the_cached_kernels_bits(tmp_path, tiny_models):
    """numba compiles afresh with an empty cache directory (its callees then inlined); the bits must not move."""
    path = tiny_models["qwen3moe"]
    code = _FRESH.format(root=str(ROOT), path=str(path))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
            for _ in range(2)]          # the first compiles into the empty cache, the second loads it
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout


# --- through a GGUF, against the CPU backend's own forward pieces -------------------------------------------------

@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpu_experts")
    out = {}
    for name, args in (("qwen3moe", ["--preset", "tiny"]), ("qwen2moe", ["--preset", "tiny", "--arch", "qwen2moe"]),
                       ("mixtral", ["--preset", "tiny", "--arch", "llama", "--n-expert", "8"]),
                       ("gpt-oss", ["--preset", "gpt-oss-tiny"]),
                       ("q4_k_m", ["--preset", "tiny", "--recipe", "q4_k_m"])):
        path = d / f"{name}.gguf"
        r = subprocess.run([sys.executable, "-m", "tools.make_moe", *args, "--out", str(path)], cwd=ROOT,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        out[name] = path
    from tools.fuse_tensors import fuse         # ffn_gate_up_exps: gate and up rows, views of one tensor
    out["fused"] = fuse(out["qwen3moe"], d / "fused.gguf", qkv=True, gate_up=True)
    return out


@pytest.mark.parametrize("backend", [pytest.param("numba", marks=needs_numba), "numpy"])
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe", "mixtral", "gpt-oss", "q4_k_m", "fused"])
def test_gguf_experts_match_the_cpu_backend(tiny_models, name, backend):
    model = open_model(tiny_models[name])
    cfg = model.config
    assert (name == "fused") == bool(model.tensor("blk.0.ffn_up_exps.weight").fused_from)
    weights = base.Weights(model)
    fam = __import__("engine.arch", fromlist=["build"]).build(model, weights, 64)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, cfg.n_embd)).astype(np.float32)
    by_model = ce.ExpertTable.from_model(model)
    buf, ptr, layouts = ce.pack_blobs(model)
    by_blobs = ce.ExpertTable.from_blobs(ptr, layouts, cfg.n_expert, by_model.activation, by_model.biases, (buf,))
    for il in range(cfg.n_layer):
        if name == "gpt-oss":
            eids, w = fam.router(il, x)
            want = fam.ffn(il, x, True)[0]                     # gpt-oss's ffn is its routed experts alone
        else:
            logits = x @ weights.get(f"blk.{il}.ffn_gate_inp.weight").T
            eids, w = base.route(logits, cfg.n_expert_used, cfg.expert_weights_norm, cfg.expert_weights_scale)
            want = base.moe_ffn(weights, il, x, eids, w, True)[0]
        for table in (by_model, by_blobs):
            out = np.full(cfg.n_embd, np.nan, np.float32)
            ce.experts_ffn(table, il, eids[0], w[0], x[0], out, backend)
            if backend == "numpy":      # the backend's own arithmetic, the experts perhaps in another order
                np.testing.assert_allclose(out, want, rtol=0, atol=1e-6 * np.abs(want).max())
            else:
                scale = np.sqrt(np.mean(want.astype(np.float64) ** 2))
                assert np.sqrt(np.mean((out - want.astype(np.float64)) ** 2)) <= 4e-6 * scale, (name, il)


def test_blobs_are_laid_out_as_the_arena_lays_them(tiny_models):
    from engine.cuda.expert_layout import blob_layout
    model = open_model(tiny_models["q4_k_m"])
    _, _, layouts = ce.pack_blobs(model)
    for ours, theirs in zip(layouts, blob_layout(model).layers):
        assert (ours.qt_gate_up, ours.up_type, ours.qt_down, ours.up_off, ours.down_off, ours.stride) == \
               (theirs.qt_gate_up, theirs.up_type, theirs.qt_down, theirs.up_off, theirs.down_off, theirs.stride)


# --- bad calls ----------------------------------------------------------------------------------------------------

def test_bad_calls_say_what_is_wrong():
    rng = np.random.default_rng(8)
    table, _ = blob_table((8, 8, 8), 64, 64, 4, rng)
    x, out = np.zeros(64, np.float32), np.zeros(64, np.float32)
    w2 = np.ones(2, np.float32)
    cases = [((1, [0, 1], w2, x, out), "layer 1 has no routed experts"),
             ((0, [0, 4], w2, x, out), "outside 0..3"),
             ((0, [1, 1], w2, x, out), "repeat"),
             ((0, [0, 1], np.ones(3), x, out), "2 expert ids but 3 weights"),
             ((0, [0, 1], w2, np.zeros(64), out), "x must be a contiguous float32"),
             ((0, [0, 1], w2, x, np.zeros(32, np.float32)), "out must be")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            ce.experts_ffn(table, *args)
    table.gate[0, 2] = 0
    with pytest.raises(ValueError, match=r"experts \[2\] are not in host memory"):
        ce.experts_ffn(table, 0, [2], [1.0], x, out)
    with pytest.raises(ValueError, match="backend"):
        ce.experts_ffn(table, 0, [0], [1.0], x, out, "cuda")


def test_without_numba_the_numpy_backend_is_chosen(monkeypatch):
    monkeypatch.setattr(ce, "_kernels", lambda: None)
    assert ce.default_backend() == "numpy" and ce.check_backend("auto") == "numpy"
    with pytest.raises(ValueError, match="pip install numba"):
        ce.check_backend("numba")
