"""Every quant type the engine accepts dequantizes through our paths (whole tensor, embedding rows, one expert's
slab, the CPU backend's expert cache) exactly as the reference does on the bytes that were written: gguf.quants,
or for Q2_0 and Q1_0 (which gguf cannot decode) engine.quant_blocks, itself checked against llama.cpp's floats in
tests/test_quant_blocks.py."""
from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from engine import quant_blocks, quant_types
from engine.arch.base import Weights
from engine.gguf_model import QTYPE_NAMES, SUPPORTED_QTYPES, open_model
from test_gguf_model import tiny_tensors, write_gguf

N_EMBD = N_FF = 256   # one 256-value super-block per row for the K and IQ types
N_EXPERT = 3
QUANTIZABLE = {QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0}
Q = quant_types.QT
# llama.cpp's reference quantizers (engine.quant_blocks) and the decoders gguf lacks
OWN_QUANT = {Q.Q2_0, Q.Q1_0, Q.NVFP4}
OWN_DEQUANT = {Q.Q2_0: quant_blocks.dequantize_q2_0, Q.Q1_0: quant_blocks.dequantize_q1_0}


def reference(data: np.ndarray, qt) -> np.ndarray:
    own = OWN_DEQUANT.get(qt)
    if own is None:
        return gguf.quants.dequantize(data, QT(int(qt))).astype(np.float32)
    return own(data).reshape(quant_types.value_shape(data.shape, qt))


def encode(values: np.ndarray, qt: QT, rng) -> np.ndarray:
    """Bytes (..., bytes per row) of a tensor of the given type: real quantizations where gguf can make them,
    random blocks otherwise (every bit pattern is a block the dequantizer must read the same way)."""
    if qt == QT.F32:
        return values.astype(np.float32).view(np.uint8)
    if qt == QT.F16:
        return values.astype(np.float16).view(np.uint8)
    if qt in QUANTIZABLE:
        return gguf.quants.quantize(values, qt)
    if qt in OWN_QUANT:
        return quant_types.quantize(values, qt)
    block, size = quant_types.SIZES[qt]
    shape = (*values.shape[:-1], values.shape[-1] // block * size)
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


# Random blocks may hold inf/NaN scales; both sides must then agree bit for bit (NaN == NaN here), and the
# dequantizer's overflow warnings say nothing about our code.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("qt", sorted(SUPPORTED_QTYPES, key=lambda q: q.value), ids=lambda q: q.name)
def test_dequant_paths_match_gguf(tmp_path, qt):
    rng = np.random.default_rng(qt.value)
    tensors, hp = tiny_tensors("qwen3moe", n_layer=1, n_embd=N_EMBD, n_head=4, n_head_kv=2, head_dim=64,
                               n_vocab=16, n_expert=N_EXPERT, n_ff_exp=N_FF, tied=True)
    raw = {}
    for name in ("token_embd.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight",
                 "blk.0.ffn_down_exps.weight"):
        raw[name] = (encode(tensors.pop(name), qt, rng), qt)
    model = open_model(write_gguf(tmp_path / f"{qt.name}.gguf", "qwen3moe", tensors, hp, raw=raw))
    weights = Weights(model, expert_cache_mb=1)
    for name, (data, _) in raw.items():
        want = reference(data, qt)
        t = model.tensor(name)
        assert t.qtype == qt and t.shape == want.shape and t.data.shape == data.shape
        got = model.dequant(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)
        if name == "token_embd.weight":
            ids = np.array([5, 0, 15, 5])
            np.testing.assert_array_equal(weights.rows(name, ids), want[ids])
        else:
            kind = name.split("_")[1]
            for e in (2, 0):
                np.testing.assert_array_equal(model.expert_bytes(0, kind, e), data[e])
                np.testing.assert_array_equal(model.dequant_expert(0, kind, e), want[e])
    # the backend's LRU of dequantized experts, at a budget that forces evictions
    for e in (1, 2, 0, 1):
        gate, up, down = weights.expert(0, e, decoding=True)
        for mat, name in ((gate, "gate"), (up, "up"), (down, "down")):
            data = raw[f"blk.0.ffn_{name}_exps.weight"][0]
            np.testing.assert_array_equal(mat, reference(data[e], qt))
    assert weights.stats.lookups == 4 and weights.stats.file_blobs >= 3


def test_the_list_is_the_design_list():
    assert {q.name for q in SUPPORTED_QTYPES} == set(QTYPE_NAMES)
    assert set(QTYPE_NAMES) == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                     "Q6_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "MXFP4", "Q2_0",
                     "Q1_0", "NVFP4"}
