"""engine.quant_types: QT is gguf's enum by value (comparisons, dict keys, gguf.quants calls), plus Q2_0; every type
the engine reads has sizes and a dequantizer; files of the new types open, and unknown ids are refused by name."""
from __future__ import annotations

import json
import struct

import gguf
import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as G

from engine import quant_types
from engine.gguf_model import ModelError, open_model, read_header
from engine.quant_types import QT, READ_TYPES, SIZES
from test_gguf_model import tiny_tensors, write_gguf


def test_qt_is_ggufs_enum_by_value():
    assert {m.name: m.value for m in G}.items() <= {m.name: m.value for m in QT}.items()
    assert set(QT.__members__) - set(G.__members__) == {"Q2_0"} and QT.Q2_0 == 42
    for m in G:
        q = QT[m.name]
        assert q == m and m == q and hash(q) == hash(m) == hash(m.value) and q == m.value
        assert QT(m) is q and QT(m.value) is q and quant_types.qtype(m) is q
    theirs = {G.Q4_K: "k", G.MXFP4: "mx"}
    assert theirs[QT.Q4_K] == "k" and QT.MXFP4 in theirs and {QT.Q6_K: 1}[G.Q6_K] == 1
    assert gguf.GGML_QUANT_SIZES[QT.Q8_0] == SIZES[G.Q8_0] == (32, 34)
    assert sorted([QT.Q2_0, G.Q4_K, QT.F32, G.F16]) == [0, 1, 12, 42]
    assert struct.pack("<I", QT.Q2_0) == struct.pack("<I", 42)          # how GGUFWriter writes a type id
    assert json.dumps([QT.Q1_0]) == "[41]" and isinstance(QT.NVFP4, int)
    # what the engine converts ids for: gguf's own enum and its writer's table stop short of Q2_0
    with pytest.raises(ValueError):
        G(42)
    assert QT.Q2_0 not in gguf.GGML_QUANT_SIZES


def test_gguf_quants_take_qt_members():
    rng = np.random.default_rng(0)
    for name in ("Q4_K", "IQ2_XS", "MXFP4", "Q8_0", "NVFP4"):
        block, size = SIZES[QT[name]]
        blocks = rng.integers(0, 256, (3, 2 * size), dtype=np.uint8)
        blocks[:, :2] = 0x30 if name != "NVFP4" else 0x38    # finite scales
        with np.errstate(all="ignore"):
            ours, theirs = gguf.quants.dequantize(blocks, QT[name]), gguf.quants.dequantize(blocks, G[name])
            np.testing.assert_array_equal(ours, theirs)
            np.testing.assert_array_equal(quant_types.dequantize(blocks, QT[name]), theirs)


def test_every_read_type_has_sizes_and_decodes():
    rng = np.random.default_rng(1)
    for t in READ_TYPES:
        block, size = SIZES[t]
        n = 2 * max(block, 256)
        data = rng.integers(0, 256, (2, quant_types.row_bytes(t, n)), dtype=np.uint8)
        with np.errstate(all="ignore"):
            y = quant_types.dequantize(data, t)
        assert y.shape == (2, n) and y.dtype == np.float32, t.name
        assert quant_types.value_shape(data.shape, t) == (2, n) and quant_types.byte_shape((2, n), t) == data.shape
    with pytest.raises(ValueError, match="multiple of 64"):
        quant_types.row_bytes(QT.Q2_0, 96)


def test_writer_helpers_write_what_gguf_writes(tmp_path):
    """quant_types.add_tensor / add_tensor_info: for a type gguf knows, the same file as GGUFWriter's uint8 call."""
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, (4, 2 * 144), dtype=np.uint8)
    files = []
    for how in ("gguf", "ours"):
        w = gguf.GGUFWriter(str(tmp_path / f"{how}.gguf"), "llama")
        if how == "gguf":
            w.add_tensor("t", data, raw_shape=data.shape, raw_dtype=G.Q4_K)
        else:
            quant_types.add_tensor(w, "t", data, QT.Q4_K)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        files.append((tmp_path / f"{how}.gguf").read_bytes())
    assert files[0] == files[1]
    # and a Q2_0 tensor declared first, its bytes written after
    p = tmp_path / "q2.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    quant_types.add_tensor_info(w, "t", (3, 128), QT.Q2_0)
    q = quant_types.quantize(rng.standard_normal((3, 128)), QT.Q2_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.write_tensor_data(q)
    w.close()
    (t,) = read_header(p).tensors
    assert t.dims == (128, 3) and t.type_id == 42


@pytest.mark.parametrize("name", ["Q2_0", "Q1_0", "NVFP4"])
def test_model_with_new_types_opens_and_dequantizes(tmp_path, name):
    tensors, hp = tiny_tensors("qwen3moe", n_layer=1, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
                               n_vocab=16, n_expert=2, n_ff_exp=128)
    raw = {}
    for n in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight", "blk.0.attn_q.weight"):
        x = tensors.pop(n)
        raw[n] = (quant_types.quantize(x, QT[name]), QT[name])
    m = open_model(write_gguf(tmp_path / "m.gguf", "qwen3moe", tensors, hp, raw=raw))
    for n, (data, qt) in raw.items():
        t = m.tensor(n)
        assert t.qtype is QT[name] and t.data.shape == data.shape
        np.testing.assert_array_equal(m.dequant(n), quant_types.dequantize(data, qt))


def test_unknown_type_id_is_named(tmp_path):
    tensors, hp = tiny_tensors("llama")
    w = tensors.pop("blk.0.ffn_up.weight")
    p = write_gguf(tmp_path / "x.gguf", "llama", tensors, hp, raw={"blk.0.ffn_up.weight": (
        np.zeros((w.shape[0], 18 * w.shape[1] // 64), np.uint8), QT.Q2_0)})
    data = bytearray(p.read_bytes())
    # the one tensor info naming type 42: make it 43, an id ggml does not have
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name) + 4 + 8 * 2
    assert struct.unpack_from("<I", data, at)[0] == 42
    struct.pack_into("<I", data, at, 43)
    p.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=r"blk\.0\.ffn_up\.weight has quant type id 43.*NVFP4, Q1_0, Q2_0"):
        open_model(p)


def test_nvfp4_with_modelopt_scales_is_refused(tmp_path):
    tensors, hp = tiny_tensors("llama")
    w = tensors.pop("blk.0.ffn_up.weight")
    raw = {"blk.0.ffn_up.weight": (quant_types.quantize(w, QT.NVFP4), QT.NVFP4)}
    ok = write_gguf(tmp_path / "ok.gguf", "llama", dict(tensors), hp, raw=raw)
    assert open_model(ok).tensor("blk.0.ffn_up.weight").qtype is QT.NVFP4     # llama-quantize's kind: no scales
    tensors["blk.0.ffn_up.scale"] = np.ones(1, np.float32)
    p = write_gguf(tmp_path / "modelopt.gguf", "llama", tensors, hp, raw=raw)
    with pytest.raises(ModelError, match=r"blk\.0\.ffn_up\.scale scales the NVFP4 tensor blk\.0\.ffn_up\.weight"):
        open_model(p)
