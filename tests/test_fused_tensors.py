"""Tensors stored as llama.cpp loads them: fused attn_qkv and ffn_gate_up_exps, and 1-D row matrices (qwen2moe's
ffn_gate_inp_shexp as llama-quantize writes it). The CPU backend gives the same logits as on the plain file, and so
does tools.exact_forward; with the anchor wheel, llama.cpp itself agrees on the fused-QKV file.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.backend_cpu import CPUBackend
from engine.gguf_model import ModelError, open_model, read_header
from tools import make_moe
from tools.exact_forward import exact_logits
from tools.fuse_tensors import fuse

TOKENS = [3, 141, 59, 265, 358, 979, 323, 84, 626]
MODELS = {
    "qwen3moe": ["--preset", "tiny", "--arch", "qwen3moe", "--n-layer", "2"],
    "qwen2moe": ["--preset", "tiny", "--arch", "qwen2moe", "--n-layer", "2"],
    "qwen2": ["--preset", "tiny", "--arch", "qwen2", "--n-layer", "2"],
    "mixtral": ["--preset", "tiny", "--arch", "llama", "--n-expert", "4", "--n-layer", "2"],
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def plain(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("fused") / f"{request.param}.gguf"
    make_moe.main([*MODELS[request.param], "--experts", "Q6_K", "--attn", "Q5_K", "--shexp", "Q4_K", "--threads",
                   "1", "--out", str(path)])
    return path


def _logits(path):
    return CPUBackend(open_model(path), 64).forward(TOKENS, all_logits=True)


def test_fused_and_unit_dim_files_give_the_same_logits(plain, tmp_path):
    fused = fuse(plain, tmp_path / "fused.gguf", qkv=True, gate_up=True, drop_unit_dims=True)
    names = {t.name: t for t in read_header(fused).tensors}
    assert "blk.0.attn_qkv.weight" in names and "blk.0.attn_q.weight" not in names
    moe = "blk.0.ffn_gate_inp.weight" in names
    assert ("blk.0.ffn_gate_up_exps.weight" in names) == moe and "blk.0.ffn_up_exps.weight" not in names
    if "blk.0.ffn_gate_inp_shexp.weight" in names:
        assert len(names["blk.0.ffn_gate_inp_shexp.weight"].dims) == 1
    want = _logits(plain)
    np.testing.assert_array_equal(_logits(fused), want)
    # float64 over the same weights: a view into a fused tensor is laid out differently, and BLAS may block it
    # differently (1.4e-14 apart seen here), so equal to float64 rounding rather than bit for bit
    np.testing.assert_allclose(exact_logits(fused, TOKENS), exact_logits(plain, TOKENS), rtol=1e-12, atol=1e-12)
    assert np.max(np.abs(exact_logits(plain, TOKENS) - want)) < 1e-3   # and both are exact arithmetic


def test_fused_views_are_marked_and_sized(plain, tmp_path):
    m = open_model(fuse(plain, tmp_path / "fused.gguf"))
    q, k, v = (m.tensor(f"blk.1.attn_{p}.weight") for p in "qkv")
    cfg = m.config
    assert q.shape == (cfg.n_head * cfg.head_dim, cfg.n_embd) and k.shape == v.shape == (
        cfg.n_head_kv * cfg.head_dim, cfg.n_embd)
    assert q.fused_from == "blk.1.attn_qkv.weight" and not m.tensor("blk.1.attn_norm.weight").fused_from
    if cfg.is_moe:
        g = m.tensor("blk.1.ffn_gate_exps.weight")
        assert g.shape == (cfg.n_expert, cfg.n_ff_exp, cfg.n_embd) and g.fused_from.endswith("gate_up_exps.weight")
        np.testing.assert_array_equal(m.dequant_expert(1, "up", 2), open_model(plain).dequant_expert(1, "up", 2))


def test_a_fused_qkv_of_the_wrong_height_is_refused(plain, tmp_path):
    import gguf
    fused = fuse(plain, tmp_path / "fused.gguf")
    h = read_header(fused)
    arch = h.metadata["general.architecture"]
    bad = tmp_path / "bad.gguf"
    # claim one KV head more than the fused tensor has rows for
    w = gguf.GGUFWriter(bad, arch)
    for key, value in h.metadata.items():
        if key in ("general.architecture",) or key.startswith("GGUF."):
            continue
        if key == f"{arch}.attention.head_count_kv":
            value += 1
        t = h.types[key]
        w.add_key_value(key, value, t[0], sub_type=t[1] if len(t) > 1 else None)
    mm = np.memmap(fused, dtype=np.uint8, mode="r")
    for t in h.tensors:
        q = gguf.GGMLQuantizationType(t.type_id)
        block, size = gguf.GGML_QUANT_SIZES[q]
        shape = tuple(reversed(t.dims))
        row = shape[-1] // block * size
        n = row * int(np.prod(shape[:-1], dtype=np.int64))
        data = np.asarray(mm[h.data_offset + t.offset:h.data_offset + t.offset + n]).reshape(*shape[:-1], row)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="attn_qkv"):
        open_model(bad)


def test_llama_cpp_reads_the_fused_qkv_file_as_we_do(plain, tmp_path):
    from tools import llama_ref as lr
    why = lr.available()
    if why:
        pytest.skip(f"needs llama.cpp's CPU wheel: {why}")
    fused = fuse(plain, tmp_path / "fused.gguf", qkv=True, gate_up=False)   # our archs load attn_qkv fused
    theirs_plain, theirs_fused = (lr.record(p, [TOKENS], n_predict=4)[0] for p in (plain, fused))
    assert theirs_fused["greedy_ids"] == theirs_plain["greedy_ids"]
    ours = _logits(fused)[-1]
    for (i, v), (j, u) in zip(theirs_fused["steps"][0]["top"], theirs_plain["steps"][0]["top"]):
        # ours within llama.cpp's 8-bit-activation distance of a Q5_K/Q6_K file (docs/design.md: correct)
        assert i == j and abs(v - u) < 1e-3 and abs(ours[i] - v) < 0.5
