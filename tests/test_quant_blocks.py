"""engine.quant_blocks (Q2_0, Q1_0, NVFP4) against llama.cpp itself, and against the formats' own definitions.

tests/fixtures/quants/llama_blocks.npz (python -m tools.quant_fixtures, from the anchor wheel's libggml-base.so)
holds float rows with llama.cpp's blocks of them (ggml_quantize_chunk) and its floats of those blocks and of random
ones (to_float): ours must give the same bytes and the same float32 bits. Then fresh random data at several sizes:
round trips, every code at every position decoded by a scalar reading of the layout, and edge cases.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine import quant_blocks as qb
from engine import quant_types
from engine.quant_types import QT

FIXTURE = Path(__file__).parent / "fixtures" / "quants" / "llama_blocks.npz"
CODEC = {"Q2_0": (qb.quantize_q2_0, qb.dequantize_q2_0), "Q1_0": (qb.quantize_q1_0, qb.dequantize_q1_0),
         "NVFP4": (qb.quantize_nvfp4, qb.dequantize_nvfp4)}
NAMES = sorted(CODEC)


@pytest.fixture(scope="module")
def llama():
    f = np.load(FIXTURE)
    return {k: f[k] for k in f.files}, json.loads(f["facts"].tobytes())


def _cases(llama, name):
    arrays, facts = llama
    at = {"x": 0, "blocks": 0, "y": 0}
    block, nbytes = facts["sizes"][name]
    for case, rows, n in facts["cases"][name]:
        sizes = {"x": rows * n, "blocks": rows * n // block * nbytes, "y": rows * n}
        got = {}
        for k, size in sizes.items():
            got[k] = arrays[f"{name}_{k}"][at[k]:at[k] + size]
            at[k] += size
        yield case, got["x"].reshape(rows, n), got["blocks"].reshape(rows, -1), got["y"].reshape(rows, n)
    assert all(at[k] == arrays[f"{name}_{k}"].size for k in at)   # the index covers the arrays exactly


def _bits(y):
    return np.ascontiguousarray(y, dtype=np.float32).view(np.uint32)


# --- llama.cpp's own bytes and floats -------------------------------------------------------------------------

def test_fixture_states_the_types_as_the_engine_table_does(llama):
    _, facts = llama
    for name in NAMES:
        assert QT[name] == facts["ggml_type"][name]
        assert quant_types.SIZES[QT[name]] == tuple(facts["sizes"][name])
    # llama.h's file types (the issue's "ftypes 41/40/39"); NVFP4's has no default type in llama-quant.cpp
    assert facts["llama_ftype"] == {"NVFP4": 39, "Q1_0": 40, "Q2_0": 41}
    assert all(facts["imatrix_changes_nothing"].values())


@pytest.mark.parametrize("name", NAMES)
def test_quantizer_gives_llama_cpps_bytes(llama, name):
    quantize, _ = CODEC[name]
    seen = []
    for case, x, want, _ in _cases(llama, name):
        got = quantize(x).reshape(want.shape)
        assert np.array_equal(got, want), f"{name} {case}: blocks differ at {np.argwhere(got != want)[:4].tolist()}"
        seen.append(case)
    assert {"zeros", "negzeros", "over_f16_max", "f32_subnormal", "with_nan", "any_bits_2x1"} <= set(seen)


@pytest.mark.parametrize("name", NAMES)
def test_dequantizer_gives_llama_cpps_floats(llama, name):
    _, dequantize = CODEC[name]
    arrays, _ = llama
    for case, _, blocks, want in _cases(llama, name):
        got = dequantize(blocks).reshape(want.shape)
        assert np.array_equal(_bits(got), _bits(want)), f"{name} {case}: floats differ"
    blocks, want = arrays[f"{name}_dequant_blocks"], arrays[f"{name}_dequant_y"]
    got = dequantize(blocks)
    bad = np.argwhere(_bits(got) != _bits(want))
    assert not len(bad), f"{name}: random blocks differ at {bad[:4].tolist()}"
    # through the engine's table too, as a (rows, bytes a row) tensor
    got = quant_types.dequantize(blocks.reshape(2, -1), QT[name])
    assert got.shape == (2, want.size // 2) and np.array_equal(_bits(got), _bits(want.reshape(2, -1)))


def test_gguf_nvfp4_decoder_is_llama_cpps(llama):
    """The engine dequantizes NVFP4 through gguf.quants (quant_types' docstring says why): it must stay exact."""
    import gguf.quants
    arrays, _ = llama
    got = gguf.quants.dequantize(arrays["NVFP4_dequant_blocks"], QT.NVFP4)
    assert np.array_equal(_bits(got), _bits(arrays["NVFP4_dequant_y"]))


# --- the formats by their definitions, on fresh data ----------------------------------------------------------

def _fp16(v) -> float:
    return float(np.float32(v).astype(np.float16))


def _scalar_decode(name: str, block: bytes) -> list[float]:
    """One block, read value by value as ggml-common.h lays it out (independent of quant_blocks' vector code)."""
    if name in ("Q2_0", "Q1_0"):
        d = float(np.frombuffer(block[:2], "<f2")[0])
        qs = block[2:]
        if name == "Q2_0":
            return [((qs[j // 4] >> (2 * (j % 4))) & 3) * d - d for j in range(64)]
        return [d if (qs[j // 8] >> (j % 8)) & 1 else -d for j in range(128)]
    out = []
    for s in range(4):
        e = block[s]
        ex, man = (e >> 3) & 15, e & 7
        d = 0.0 if e in (0, 0x7F) else (man * 2.0 ** -9 if ex == 0 else (1 + man / 8) * 2.0 ** (ex - 7))
        sub = [0.0] * 16
        for j in range(8):
            byte = block[4 + 8 * s + j]
            for k, code in ((j, byte & 15), (j + 8, byte >> 4)):
                sign = -1.0 if code & 8 else 1.0
                sub[k] = sign * [0, 0.5, 1, 1.5, 2, 3, 4, 6][code & 7] * d   # E2M1, scale as UE4M3
        out += sub
    return out


@pytest.mark.parametrize("name", NAMES)
def test_every_code_at_every_position(name):
    rng = np.random.default_rng(1)
    nbytes = quant_types.SIZES[QT[name]][1]
    n = 256 if name != "NVFP4" else 64
    blocks = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    if name == "NVFP4":
        blocks[:, :4] = np.arange(256, dtype=np.uint8).reshape(64, 4)            # every scale byte
    else:
        blocks[:, :2] = (rng.standard_normal(n) * 0.1).astype("<f2").view(np.uint8).reshape(n, 2)
        blocks[:, 2:] = (np.arange(n)[:, None] + np.arange(16)) % 256    # every byte at every position
    got = CODEC[name][1](blocks)
    want = np.array([_scalar_decode(name, bytes(b)) for b in blocks], dtype=np.float64)
    assert np.array_equal(got.astype(np.float64), want)


@pytest.mark.parametrize("rows,blocks", [(1, 1), (3, 2), (7, 5), (40, 3)])
def test_round_trips_on_fresh_data(rows, blocks):
    rng = np.random.default_rng(rows * 100 + blocks)
    # Q2_0: d = fp16(max|x|) and every value to the nearest of {-d, 0, d} (the code for +2d never comes out)
    x = (rng.standard_normal((rows, 64 * blocks)) * rng.uniform(1e-3, 10, (rows, 1))).astype(np.float32)
    q = quant_types.quantize(x, QT.Q2_0)
    assert q.shape == (rows, 18 * blocks)
    y = quant_types.dequantize(q, QT.Q2_0)
    xb, yb = x.reshape(-1, 64).astype(np.float64), y.reshape(-1, 64).astype(np.float64)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    d = amax.astype(np.float32).astype(np.float16).astype(np.float64)
    assert set(np.unique(yb / d)) <= {-1.0, 0.0, 1.0}
    assert np.all(np.abs(xb / amax - yb / d) <= 0.5 + 1e-6)
    np.testing.assert_array_equal(quant_types.quantize(y, QT.Q2_0), q)      # its own floats give its own bytes
    # Q1_0: sign times one scale a block, fp16(mean|x|)
    x = (rng.standard_normal((rows, 128 * blocks)) * 0.02).astype(np.float32)
    q = quant_types.quantize(x, QT.Q1_0)
    y = quant_types.dequantize(q, QT.Q1_0).reshape(-1, 128)
    xb = x.reshape(-1, 128)
    d = np.abs(y).max(axis=1)
    np.testing.assert_array_equal(y, np.where(xb >= 0, 1, -1) * d[:, None])
    np.testing.assert_allclose(d, np.abs(xb.astype(np.float64)).mean(axis=1), rtol=2.0 ** -11 + 1e-6)
    np.testing.assert_array_equal(quant_types.quantize(y.reshape(x.shape), QT.Q1_0), q)
    # NVFP4: each value on the nearest point of its sub-block's grid; the grid's step UE4M3(max|x| / 6)
    x = (rng.standard_normal((rows, 64 * blocks)) * rng.uniform(1e-3, 100, (rows, 1))).astype(np.float32)
    q = quant_types.quantize(x, QT.NVFP4)
    y = quant_types.dequantize(q, QT.NVFP4).reshape(-1, 16).astype(np.float64)
    xs = x.reshape(-1, 16).astype(np.float64)
    scale = qb.UE4M3[q.reshape(-1, 36)[:, :4].reshape(-1)].astype(np.float64)   # half the E4M3 value
    grid = qb.FP4_VALUES.astype(np.float64)[None, :] * scale[:, None]
    best = np.abs(grid[:, None, :] - xs[:, :, None]).min(axis=2)
    np.testing.assert_allclose(np.abs(y - xs), best, rtol=1e-6, atol=0)
    target = np.abs(xs).max(axis=1) / 6
    normal = target >= 2.0 ** -6
    assert normal.any()
    np.testing.assert_allclose(2 * scale[normal], target[normal], rtol=1 / 16)


def test_edge_blocks():
    z = np.zeros((1, 128), np.float32)
    for name in NAMES:
        quantize, dequantize = CODEC[name]
        blk = quantize(z[:, :quant_types.block_size(QT[name])])
        assert not blk[:, :4 if name == "NVFP4" else 2].any()                   # a zero scale
        assert np.all(dequantize(blk) == 0)
    # negative zero is >= 0: Q1_0 sets its bit; Q2_0 gives it code 1 (zero), NVFP4 code 0
    nz = -np.zeros((1, 128), np.float32)
    assert np.all(qb.quantize_q1_0(nz)[:, 2:] == 0xFF)
    assert np.all(qb.quantize_q2_0(nz[:, :64])[:, 2:] == 0x55)
    assert np.all(qb.quantize_nvfp4(nz[:, :64]) == 0)
    # a scale beyond fp16 is inf: Q2_0's zero code then decodes to NaN (0 * inf), as in llama.cpp
    x = np.full((1, 64), 7e4, np.float32)
    x[0, 1] = 0.0
    blk = qb.quantize_q2_0(x)
    assert np.isinf(np.frombuffer(blk[0, :2].tobytes(), "<f2")[0])
    with np.errstate(invalid="ignore"):
        y = qb.dequantize_q2_0(blk)
    assert np.isnan(y[0, 1]) and np.all(np.isposinf(np.delete(y[0], 1)))
    # tiny scales: fp16's smallest subnormal still decodes; below it the block is all zeros
    x = np.full((1, 64), 6e-8, np.float32)
    assert np.all(qb.dequantize_q2_0(qb.quantize_q2_0(x)) == np.float32(2.0 ** -24))
    assert np.all(qb.dequantize_q2_0(qb.quantize_q2_0(x * 1e-3)) == 0)
    # NVFP4's scale: rounded half up, saturating at 448 (0x7E) from 256 up, subnormal below 2^-6; a scale byte's
    # top bit is ignored, except that 0xFF is not 0x7F (zero)
    x = np.array([240, 255, 256, 448, 1e9, -1, np.nan, 2.0 ** -6, 2.0 ** -6 * (1 - 2.0 ** -10), 2.0 ** -10,
                  2.0 ** -11], np.float32)
    assert qb.fp32_to_ue4m3(x).tolist() == [0x77, 0x7E, 0x7E, 0x7E, 0x7E, 0, 0, 0x08, 0x07, 0x01, 0x00]
    assert qb.UE4M3[0x80 | 0x38] == qb.UE4M3[0x38] == 0.5 and qb.UE4M3[0x7F] == 0 and qb.UE4M3[0xFF] == 240.0


def test_shapes_must_be_whole_blocks():
    for name in NAMES:
        quantize, dequantize = CODEC[name]
        with pytest.raises(ValueError, match="whole number"):
            quantize(np.zeros(quant_types.block_size(QT[name]) + 1, np.float32))
        with pytest.raises(ValueError, match="whole number"):
            dequantize(np.zeros(quant_types.SIZES[QT[name]][1] - 1, np.uint8))


# --- files llama-quantize makes (the anchor wheel; skipped without it) ------------------------------------------

def test_llama_quantize_files_hold_our_quantizers_bytes(tmp_path):
    """llama_model_quantize with the Q2_0 and Q1_0 recipes (ftypes 41, 40), and NVFP4 through --tensor-type (its
    ftype 39 is refused), writes every such tensor as our quantizer does from the F16 source's values."""
    from engine.gguf_model import open_model
    from tools import llama_ref as lr
    why = lr.available()
    if why:
        pytest.skip(f"needs llama.cpp's CPU wheel: {why}")
    src = lr.make_source(tmp_path / "f16.gguf", ["--preset", "tiny", "--n-layer", "1", "--n-expert", "4",
                                                  "--n-expert-used", "2"])
    runs = {"q2_0": [], "q1_0": [], "q8_0": [(r"ffn_(gate|up|down)_exps", "NVFP4"), (r"attn_q", "Q2_0")]}
    f16 = open_model(src)
    for recipe, overrides in runs.items():
        m = open_model(lr.quantize(src, tmp_path / f"{recipe}.gguf", recipe, overrides=overrides))
        checked = set()
        for name in m.tensor_names():
            t = m.tensor(name)
            if t.qtype.name in CODEC:
                want = quant_types.quantize(f16.dequant(name), t.qtype)
                assert np.array_equal(np.asarray(t.data), want), f"{recipe}: {name} ({t.qtype.name})"
                checked.add(t.qtype.name)
        assert checked == {"q2_0": {"Q2_0"}, "q1_0": {"Q1_0"}, "q8_0": {"NVFP4", "Q2_0"}}[recipe]
