"""engine.gguf_model: configs per architecture, tensors and expert slabs, split sets, and the errors that name the
problem (not a GGUF, truncated, unknown architecture, missing tensor, unsupported quant type)."""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from engine import quant_types
from engine.gguf_model import ModelError, open_model, read_header

REF = "reference"


# --- a tiny model writer (also used by tests/test_cpu_forward.py and tests/test_dequant.py) -----------------------

def tiny_tensors(arch: str, *, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=96, n_vocab=80,
                 n_expert=0, n_ff_exp=32, shexp=False, qk_norm=None, bias=None, tied=False, seed=0):
    """Random float32 weights with llama.cpp's names, numpy shapes (rows = outputs)."""
    rng = np.random.default_rng(seed)
    qk_norm = arch in ("qwen3", "qwen3moe") if qk_norm is None else qk_norm
    bias = arch in ("qwen2", "qwen2moe") if bias is None else bias

    def mat(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)

    t = {"token_embd.weight": mat(n_vocab, n_embd, scale=1.0),
         "output_norm.weight": (1 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32)}
    if not tied:
        t["output.weight"] = mat(n_vocab, n_embd)
    for i in range(n_layer):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = (1 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32)
        t[b + "ffn_norm.weight"] = (1 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32)
        t[b + "attn_q.weight"] = mat(n_head * head_dim, n_embd)
        t[b + "attn_k.weight"] = mat(n_head_kv * head_dim, n_embd)
        t[b + "attn_v.weight"] = mat(n_head_kv * head_dim, n_embd)
        t[b + "attn_output.weight"] = mat(n_embd, n_head * head_dim)
        if qk_norm:
            t[b + "attn_q_norm.weight"] = (1 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32)
            t[b + "attn_k_norm.weight"] = (1 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32)
        if bias:
            for n, rows in (("q", n_head), ("k", n_head_kv), ("v", n_head_kv)):
                t[b + f"attn_{n}.bias"] = (0.5 * rng.standard_normal(rows * head_dim)).astype(np.float32)
        if n_expert:
            t[b + "ffn_gate_inp.weight"] = mat(n_expert, n_embd, scale=0.5)
            t[b + "ffn_gate_exps.weight"] = mat(n_expert, n_ff_exp, n_embd)
            t[b + "ffn_up_exps.weight"] = mat(n_expert, n_ff_exp, n_embd)
            t[b + "ffn_down_exps.weight"] = mat(n_expert, n_embd, n_ff_exp)
            if shexp:
                t[b + "ffn_gate_inp_shexp.weight"] = mat(1, n_embd)
                t[b + "ffn_gate_shexp.weight"] = mat(n_ff_exp, n_embd)
                t[b + "ffn_up_shexp.weight"] = mat(n_ff_exp, n_embd)
                t[b + "ffn_down_shexp.weight"] = mat(n_embd, n_ff_exp)
        else:
            t[b + "ffn_gate.weight"] = mat(n_ff, n_embd)
            t[b + "ffn_up.weight"] = mat(n_ff, n_embd)
            t[b + "ffn_down.weight"] = mat(n_embd, n_ff)
    hp = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_ff=n_ff,
              n_expert=n_expert, n_ff_exp=n_ff_exp)
    return t, hp


def write_gguf(path, arch: str, tensors: dict, hp: dict | None = None, extra_kv: dict | None = None,
               raw: dict | None = None):
    """Write a GGUF. tensors: name -> float32 array (stored F32); raw: name -> (uint8 bytes (..., bytes per row), QT)."""
    w = gguf.GGUFWriter(str(path), arch)
    if hp:
        w.add_uint32(f"{arch}.block_count", hp["n_layer"])
        w.add_uint32(f"{arch}.context_length", 512)
        w.add_uint32(f"{arch}.embedding_length", hp["n_embd"])
        w.add_uint32(f"{arch}.feed_forward_length", hp["n_ff"])
        w.add_uint32(f"{arch}.attention.head_count", hp["n_head"])
        w.add_uint32(f"{arch}.attention.head_count_kv", hp["n_head_kv"])
        w.add_uint32(f"{arch}.attention.key_length", hp["head_dim"])
        w.add_uint32(f"{arch}.attention.value_length", hp["head_dim"])
        w.add_uint32(f"{arch}.rope.dimension_count", hp["head_dim"])
        w.add_float32(f"{arch}.rope.freq_base", 10000.0)
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
        if hp["n_expert"]:
            w.add_uint32(f"{arch}.expert_count", hp["n_expert"])
            w.add_uint32(f"{arch}.expert_used_count", 2)
            w.add_uint32(f"{arch}.expert_feed_forward_length", hp["n_ff_exp"])
    for k, v in (extra_kv or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, v)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    for name, (data, qt) in (raw or {}).items():
        quant_types.add_tensor(w, name, data, qt)   # every engine type, Q2_0 too (gguf's own table lacks it)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_model(tmp_path, arch="llama", name="m.gguf", extra_kv=None, drop=(), **kw):
    tensors, hp = tiny_tensors(arch, **kw)
    for d in drop:
        tensors.pop(d)
    return write_gguf(tmp_path / name, arch, tensors, hp, extra_kv)


# --- configs --------------------------------------------------------------------------------------------------------

def test_reference_configs(fixtures_dir):
    q3 = open_model(fixtures_dir / REF / "tiny-qwen3moe-q4k.gguf").config
    assert (q3.arch, q3.n_layer, q3.n_embd, q3.n_head, q3.n_head_kv, q3.head_dim) == ("qwen3moe", 4, 256, 4, 2, 64)
    assert (q3.n_expert, q3.n_expert_used, q3.n_ff_exp, q3.rope_type) == (8, 2, 256, "neox")
    assert q3.qk_norm and q3.tied_embeddings and q3.expert_weights_norm and q3.norm_topk_prob
    q2 = open_model(fixtures_dir / REF / "tiny-qwen2moe-mixed.gguf").config
    assert q2.attn_bias and q2.shared_expert and q2.shared_expert_gate and q2.n_ff_shexp == 256
    assert not q2.expert_weights_norm and not q2.tied_embeddings
    ll = open_model(fixtures_dir / REF / "tiny-llama-legacy.gguf").config
    assert (ll.rope_type, ll.n_vocab, ll.tied_embeddings, ll.is_moe, ll.n_ff) == ("norm", 1024, True, False, 512)


def test_dense_and_mixtral_configs(tmp_path):
    q2 = open_model(tiny_model(tmp_path, "qwen2", "q2.gguf")).config
    assert q2.rope_type == "neox" and q2.attn_bias and not q2.qk_norm and not q2.is_moe
    q3 = open_model(tiny_model(tmp_path, "qwen3", "q3.gguf", tied=True, head_dim=32)).config
    assert q3.qk_norm and q3.tied_embeddings and q3.head_dim == 32 and q3.n_head * q3.head_dim != q3.n_embd
    mx = open_model(tiny_model(tmp_path, "llama", "mx.gguf", n_expert=4)).config
    assert mx.arch == "llama" and mx.is_moe and mx.expert_weights_norm and mx.rope_type == "norm"
    assert (mx.n_expert, mx.n_expert_used, mx.n_ff_exp) == (4, 2, 32)


def test_rope_scaling_is_read(tmp_path):
    lin = open_model(tiny_model(tmp_path, name="lin.gguf", extra_kv={
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})).config
    assert lin.rope_scaling == "linear" and lin.rope_freq_scale == pytest.approx(0.25)
    yarn = open_model(tiny_model(tmp_path, name="yarn.gguf", extra_kv={
        "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 2.0,
        "llama.rope.scaling.original_context_length": 256})).config
    assert (yarn.rope_scaling, yarn.rope_n_ctx_orig, yarn.yarn_ext_factor) == ("yarn", 256, 1.0)
    with pytest.raises(ModelError, match="longrope"):
        open_model(tiny_model(tmp_path, name="lr.gguf", extra_kv={"llama.rope.scaling.type": "longrope",
                                                                 "llama.rope.scaling.factor": 2.0}))


# --- tensors ----------------------------------------------------------------------------------------------------------

def test_tensors_read_back_exactly(tmp_path):
    tensors, hp = tiny_tensors("qwen3moe", n_expert=4)
    m = open_model(write_gguf(tmp_path / "m.gguf", "qwen3moe", tensors, hp))
    assert set(m.tensor_names()) == set(tensors)
    for name, arr in tensors.items():
        t = m.tensor(name)
        assert t.qtype == QT.F32 and t.shape == arr.shape and t.data.dtype == np.uint8
        np.testing.assert_array_equal(m.dequant(name), arr)
    gate = tensors["blk.1.ffn_gate_exps.weight"]
    for e in range(4):
        raw = m.expert_bytes(1, "gate", e)
        assert raw.shape == (gate.shape[1], gate.shape[2] * 4)
        np.testing.assert_array_equal(raw.view(np.float32), gate[e])
        np.testing.assert_array_equal(m.dequant_expert(1, "down", e), tensors["blk.1.ffn_down_exps.weight"][e])
    with pytest.raises(IndexError):
        m.expert_bytes(0, "up", 4)
    assert m.metadata["general.architecture"] == "qwen3moe" and m.metadata["qwen3moe.expert_count"] == 4


@pytest.mark.parametrize("path", ["reference/tiny-qwen2moe-mixed.gguf", "vocab/tiny-bpe-1024.gguf",
                                  "vocab/ggml-vocab-llama-spm.gguf"])
def test_read_header_matches_gguf_reader(fixtures_dir, path):
    # The one header reader (the model's, the tokenizer's and make_moe's) against gguf-py's, on a model and on
    # vocabulary-only files: the same keys in the same order, values, value types, tensor infos and data offsets.
    path = fixtures_dir / path
    reader = gguf.GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    ref = {}
    for k, f in fields.items():
        v = f.contents()
        ref[k] = v.item() if isinstance(v, np.generic) else v
    header = read_header(path)
    assert header.metadata == ref and list(header.metadata) == list(ref)
    assert header.types == {k: f.types for k, f in fields.items()}
    assert [(t.name, t.dims, t.type_id, header.data_offset + t.offset) for t in header.tensors] == \
        [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset)) for t in reader.tensors]
    assert header.file_size == path.stat().st_size
    if "reference" in path.parts:
        assert open_model(path).metadata == ref


def test_split_set_opens_as_one_model(tmp_path):
    tensors, hp = tiny_tensors("llama")
    names = list(tensors)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        kv = {"split.no": i, "split.count": 2, "split.tensors.count": len(names)}
        write_gguf(tmp_path / f"sp-{i + 1:05d}-of-00002.gguf", "llama", {n: tensors[n] for n in part},
                   hp if i == 0 else None, kv)
    m = open_model(tmp_path / "sp-00001-of-00002.gguf")
    assert len(m.paths) == 2 and set(m.tensor_names()) == set(names)
    np.testing.assert_array_equal(m.dequant(names[-1]), tensors[names[-1]])
    (tmp_path / "sp-00002-of-00002.gguf").unlink()
    with pytest.raises(ModelError, match="sp-00002-of-00002.gguf"):
        open_model(tmp_path / "sp-00001-of-00002.gguf")


# --- errors -------------------------------------------------------------------------------------------------------------

def test_text_file_named_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("<html>not found</html>\n")
    with pytest.raises(ModelError, match="not a GGUF file"):
        open_model(p)


def test_missing_file(tmp_path):
    with pytest.raises(ModelError, match="no model file"):
        open_model(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [0.999, 0.6, 0.02, 0.002])
def test_truncated(fixtures_dir, tmp_path, keep):
    src = (fixtures_dir / REF / "tiny-qwen3moe-q4k.gguf").read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(src[:max(8, int(len(src) * keep))])
    with pytest.raises(ModelError, match="truncated") as e:
        open_model(p)
    assert "\n" not in str(e.value)


def test_unknown_architecture(tmp_path):
    p = write_gguf(tmp_path / "x.gguf", "mamba9", {"token_embd.weight": np.zeros((8, 4), np.float32)})
    with pytest.raises(ModelError, match="'mamba9'.*supported: llama, qwen2, qwen3, qwen2moe, qwen3moe"):
        open_model(p)


def test_missing_tensor_is_named(tmp_path):
    with pytest.raises(ModelError, match=r"blk\.1\.attn_k\.weight"):
        open_model(tiny_model(tmp_path, drop=["blk.1.attn_k.weight"]))
    with pytest.raises(ModelError, match=r"blk\.0\.ffn_up_exps\.weight"):
        open_model(tiny_model(tmp_path, "qwen3moe", "moe.gguf", n_expert=4, drop=["blk.0.ffn_up_exps.weight"]))


def test_unsupported_quant_type_is_named(tmp_path):
    tensors, hp = tiny_tensors("llama")
    w = tensors.pop("blk.0.ffn_up.weight")
    block, size = gguf.GGML_QUANT_SIZES[QT.TQ2_0]
    raw = np.zeros((w.shape[0], size), np.uint8)   # one 256-value block per row: shapes are not what is tested
    p = write_gguf(tmp_path / "tq.gguf", "llama", tensors, hp, raw={"blk.0.ffn_up.weight": (raw, QT.TQ2_0)})
    with pytest.raises(ModelError, match=r"blk\.0\.ffn_up\.weight is TQ2_0"):
        open_model(p)


def test_vocabulary_only_gguf(fixtures_dir):
    with pytest.raises(ModelError, match="no tensors"):
        open_model(fixtures_dir / "vocab" / "tiny-bpe-1024.gguf")


def test_copy_of_reference_still_opens(fixtures_dir, tmp_path):
    # The error tests above cut copies; an intact copy must open, so they fail for the reason they name.
    p = tmp_path / "ok.gguf"
    shutil.copy(fixtures_dir / REF / "tiny-qwen3moe-q4k.gguf", p)
    assert open_model(p).config.n_layer == 4


def test_tensor_shape_against_metadata(tmp_path):
    tensors, hp = tiny_tensors("qwen3", head_dim=16)
    hp["head_dim"] = 32
    with pytest.raises(ModelError, match=r"blk\.0\.attn_q\.weight has shape \(64, 64\).*\(128, 64\)"):
        open_model(write_gguf(tmp_path / "bad.gguf", "qwen3", tensors, hp))
