"""make_moe's gpt-oss presets (tools/gptoss_plan.py): the published files' shapes, types and sizes, llama.cpp's names
and keys, and a harmony vocabulary."""
import re

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.tokenizer import Tokenizer, eog_ids_from_metadata
from tools import gptoss_plan
from tools import make_moe as mm


def _total_gb(out: str) -> float:
    return float(re.search(r"^total\s+\d+\s+([\d.]+)", out, re.M).group(1)) / 1000


@pytest.mark.parametrize("preset,layers,experts,published_gb", [("gpt-oss-20b", 24, 32, 12.1),
                                                                 ("gpt-oss-120b", 36, 128, 63.4)])
def test_dry_run_is_the_published_files_size(capsys, preset, layers, experts, published_gb):
    assert mm.main(["--preset", preset, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"gpt-oss MoE {experts}x4, {layers} layers, hidden 2880, vocab 201088" in out
    # ggml-org/gpt-oss-{20b,120b}-GGUF: 12.1 GB and 63.4 GB (59.02 GiB as llama-bench prints it)
    assert _total_gb(out) == pytest.approx(published_gb, abs=0.06)
    assert re.search(rf"^experts\s+{3 * layers} MXFP4", out, re.M)
    for group in ("embd", "output", "attn"):
        assert re.search(rf"^{group}\s+\d+ Q8_0 ", out, re.M), group
    for group in ("norm", "bias", "router"):
        assert re.search(rf"^{group}\s+\d+ F32 ", out, re.M), group


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gptoss_plan") / "tiny.gguf"
    assert mm.main(["--preset", "gpt-oss-tiny", "--out", str(path), "--seed", "2"]) == 0
    return path


def test_tiny_has_every_tensor_and_key_llama_cpp_reads(tiny):
    assert tiny.stat().st_size < 8e6
    r = gguf.GGUFReader(tiny)
    kv = {k: f.contents() for k, f in r.fields.items()}
    a = "gpt-oss"
    assert kv["general.architecture"] == a
    for key, want in (("block_count", 4), ("embedding_length", 256), ("attention.head_count", 8),
                      ("attention.head_count_kv", 2), ("attention.key_length", 64), ("attention.value_length", 64),
                      ("expert_count", 16), ("expert_used_count", 4), ("expert_feed_forward_length", 128),
                      ("attention.sliding_window", 16), ("rope.scaling.type", "yarn"),
                      ("rope.scaling.original_context_length", 4096), ("rope.freq_base", 150000.0)):
        assert kv[f"{a}.{key}"] == pytest.approx(want) if isinstance(want, float) else kv[f"{a}.{key}"] == want, key
    assert kv[f"{a}.rope.scaling.factor"] == pytest.approx(32.0)
    assert kv[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GPT_OSS]}
    names = {t.name for t in r.tensors}
    for n in names:
        assert re.sub(r"\.(weight|bias)$", "", re.sub(r"^blk\.\d+\.", "blk.{bid}.", n)) in allowed, n
    # llama_model_openai_moe::load_arch_tensors, per layer (separate q/k/v: create_tensor_qkv's other form)
    per_layer = ["attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                 "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.weight", "attn_output.bias",
                 "attn_sinks.weight", "ffn_gate_inp.weight", "ffn_gate_inp.bias"] + \
        [f"ffn_{k}_exps.{s}" for k in ("gate", "up", "down") for s in ("weight", "bias")]
    assert names == {"token_embd.weight", "output_norm.weight", "output.weight"} | \
        {f"blk.{i}.{n}" for i in range(4) for n in per_layer}
    types = {t.name: t.tensor_type for t in r.tensors}
    for n, t in types.items():
        want = Q.MXFP4 if n.endswith("_exps.weight") else Q.Q8_0 if (
            n in ("token_embd.weight", "output.weight") or re.search(r"attn_[qkvo].*\.weight$|attn_output\.weight$", n)
        ) else Q.F32
        assert t == want, n
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in r.tensors}   # numpy order
    assert shapes["blk.0.attn_q.weight"] == (512, 256) and shapes["blk.0.attn_output.weight"] == (256, 512)
    assert shapes["blk.0.ffn_gate_exps.bias"] == (16, 128) and shapes["blk.0.ffn_down_exps.bias"] == (16, 256)
    assert shapes["blk.0.attn_sinks.weight"] == (8,)
    for t in r.tensors:
        assert np.isfinite(gguf.quants.dequantize(t.data, t.tensor_type)).all(), t.name
    biases = [gguf.quants.dequantize(t.data, t.tensor_type) for t in r.tensors if t.name.endswith("_exps.bias")]
    assert all(len(np.unique(b.round(6), axis=0)) == b.shape[0] for b in biases)   # one bias row per expert


def test_tiny_vocabulary_speaks_harmony(tiny):
    tok = Tokenizer.from_gguf(tiny)
    ids = {t: tok.encode(t, add_special=False, parse_special=True) for t in gptoss_plan.HARMONY_IDS}
    assert all(len(v) == 1 for v in ids.values()), ids
    # <|return|> and <|call|> end an answer, <|end|> only a message (llama.cpp's rule for harmony)
    names = {ids[t][0]: t for t in ("<|return|>", "<|call|>", "<|end|>")}
    assert {names.get(i) for i in tok.eog_ids} >= {"<|return|>", "<|call|>"} and ids["<|end|>"][0] not in tok.eog_ids
    text = "<|start|>assistant<|channel|>final<|message|>Hello world<|return|>"
    assert tok.decode(tok.encode(text, add_special=False, parse_special=True), special=True) == text
    assert "<|channel|>" in tok.chat_template and "reasoning_effort" in tok.chat_template


def test_real_vocabulary_puts_the_controls_at_their_o200k_ids():
    shape = mm.PRESETS["gpt-oss-20b"].shape
    vocab = gptoss_plan.harmony_vocab(shape, mm.read_vocab(mm.VOCAB_DIR / gptoss_plan.BASE_VOCAB))
    md = {k: v for k, v, _ in vocab}
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == 201088 and len(set(tokens)) == len(tokens)
    for t, i in gptoss_plan.HARMONY_IDS.items():
        assert tokens[i] == t
    assert md["tokenizer.ggml.eos_token_id"] == 200002 and md["tokenizer.ggml.bos_token_id"] == 199998
    assert eog_ids_from_metadata(md) == {199999, 200002, 200012}   # <|endoftext|>, <|return|>, <|call|>


def test_gpt_oss_presets_refuse_another_vocabulary_or_arch():
    for argv, message in ((["--preset", "gpt-oss-tiny", "--vocab", "tiny-bpe-1024.gguf"], "drop --vocab"),
                          (["--preset", "tiny", "--arch", "gpt-oss"], "gpt-oss preset only")):
        with pytest.raises(SystemExit) as e:
            mm.main(argv)
        assert message in str(e.value) and "\n" not in str(e.value)


def _copy_without(src, dst, drop_key=None, drop_tensor=None):
    """src written again to dst without one metadata key or one tensor."""
    from engine.gguf_model import read_header
    h = read_header(src)
    w = gguf.GGUFWriter(dst, h.metadata["general.architecture"])
    for key, value in h.metadata.items():
        if key in (drop_key, "general.architecture") or key.startswith("GGUF."):
            continue
        types = h.types[key]
        w.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)
    raw = np.memmap(src, dtype=np.uint8, mode="r")
    for t in h.tensors:
        if t.name == drop_tensor:
            continue
        q = Q(t.type_id)
        block, size = gguf.GGML_QUANT_SIZES[q]
        n = t.dims[0] // block * size * int(np.prod(t.dims[1:], dtype=np.int64))
        data = np.array(raw[h.data_offset + t.offset:h.data_offset + t.offset + n])
        shape = (*reversed(t.dims[1:]), t.dims[0] // block * size)
        w.add_tensor(t.name, data.reshape(shape), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("what,message", [
    (dict(drop_key="gpt-oss.attention.sliding_window"), "lacks gpt-oss.attention.sliding_window"),
    (dict(drop_tensor="blk.2.attn_sinks.weight"), "no tensor blk.2.attn_sinks.weight"),
    (dict(drop_tensor="blk.1.ffn_down_exps.bias"), "no tensor blk.1.ffn_down_exps.bias"),
    (dict(drop_tensor="blk.3.post_attention_norm.weight"), "no tensor blk.3.post_attention_norm.weight"),
])
def test_an_incomplete_gpt_oss_file_gives_one_clear_line(tiny, tmp_path, what, message):
    from engine.gguf_model import ModelError, open_model
    open_model(_copy_without(tiny, tmp_path / "same.gguf"))      # the copy itself is sound
    with pytest.raises(ModelError) as e:
        open_model(_copy_without(tiny, tmp_path / "bad.gguf", **what))
    assert message in str(e.value) and "\n" not in str(e.value)


# Run in llama.cpp's interpreter; tools/llama_worker.py imports the bindings there (its venv holds the wheel alone).
_LOAD = """
import json, sys
sys.path.insert(0, sys.argv[2])
from llama_worker import ll as L
L.llama_backend_init()
p = L.llama_model_default_params()
p.no_alloc, p.load_mode = True, 0      # shapes and keys only: no data read, no mapping
m = L.llama_model_load_from_file(sys.argv[1].encode(), p)
print(json.dumps({"params": L.llama_model_n_params(m), "bytes": L.llama_model_size(m)} if m else {}))
"""


@pytest.mark.parametrize("preset,params,gib", [("gpt-oss-20b", 20_914_757_184, 11.27),
                                               ("gpt-oss-120b", 116_829_156_672, 59.02)])
def test_llama_cpp_loads_the_real_shapes_as_the_published_files(tmp_path, preset, params, gib):
    """llama.cpp's loader checks every tensor's shape and key it reads; the parameter count and size it reports are
    the published files' (llama-bench on ggml-org's gpt-oss-120b: 59.02 GiB, 116.83 B)."""
    import json
    import subprocess
    from tools import llama_ref
    why = llama_ref.available()
    if why:
        pytest.skip(f"needs llama.cpp: {why}")
    path = tmp_path / f"{preset}.gguf"
    mm.write_preset_header(path, preset)      # sparse: a few MB on disk
    r = subprocess.run([str(llama_ref.llama_python()), "-c", _LOAD, str(path), str(llama_ref.WORKER.parent)],
                       capture_output=True, text=True, timeout=300)
    lines = r.stdout.strip().splitlines()
    got = json.loads(lines[-1]) if lines else {}
    assert got, f"llama.cpp refused the {preset} shapes: {r.stderr[-1500:]}"
    assert got["params"] == params
    assert got["bytes"] / 2**30 == pytest.approx(gib, abs=0.01)
