"""The qwen4exp reference fixtures (tests/fixtures/qwen4exp/): a tiny random Qwen4Exp made in transformers, converted
by llama.cpp's own converter, quantized by llama-quantize, and run by both references.

    python -m tools.qwen4exp_refs venv                    # data/cache/q4venv: torch 2.13.0 CPU + transformers 5.24.0
    data/cache/q4venv/bin/python -m tools.qwen4exp_refs all [--out tests/fixtures/qwen4exp]

`all` makes, from nothing but the seed: the transformers model (TINY below, weights rounded to fp16 so that the F16
GGUF holds them exactly), its tokenizer files (tiny-bpe-1024's tokens and merges, Qwen3.5's pre-tokenizer regex
and chat template), the F16 GGUF (vendor/llama.cpp/convert_hf_to_gguf.py of the llama-cpp-python 0.3.36 sdist,
its gguf-py first on the path), Q2_0 / IQ2_XS / Q4_K_M files (tools.llama_ref.quantize; IQ2_XS with the imatrix
of tools.imatrix's format, computed here by transformers in float64), and per file a JSON in the shape of
../shared/fixtures/reference/: llama.cpp's greedy ids, top-10 and margins (tools.llama_ref.record), then
- F16: transformers (float32, eager) teacher-forced along llama.cpp's ids (`hf_top`, `hf_at_top`) and its own
  greedy run (`hf_greedy_ids`); per step the QSA regime (`qsa`: dense / sparse / differs, spec section 5 item 1);
- quantized: exact arithmetic (`exact_top`, `exact_at_top`): transformers in float64 over the file's dequantized
  weights mapped back to the HF layout (the converter's transforms undone), the selection as transformers makes it.
tokenizer/llama-cpp.json is llama_tokenize's ids on the F16 file (python -m tools.tokenizer_reference
--vocab tests/fixtures/qwen4exp/tiny-qwen4exp-f16.gguf --pre qwen35 --out ...). Only the llama.cpp side needs the
anchor wheel; the rest runs in the venv (torch, transformers, the sdist). CI never
runs this module: the tests read what it wrote.

The converter detects a BPE pre-tokenizer by hashing a test string's ids; a new vocabulary is unknown to it, so it
is told the name the tokenizer declares (`qwen35`, the published model's) instead of raising. Nothing else of the
converter is changed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "data" / "cache"
VENV = CACHE / "q4venv"          # torch + transformers 5.24.0: the model and its reference forward
CONV_VENV = CACHE / "q4conv"     # torch + transformers 4.57.6, the converter's own pin (see convert())
SRC = CACHE / "q4src"
WORK = CACHE / "qwen4exp"
OUT = ROOT / "tests" / "fixtures" / "qwen4exp"
SDIST = "llama_cpp_python-0.3.36"
LLAMA_DIR = SRC / SDIST / "vendor" / "llama.cpp"
VOCAB = ROOT.parent / "shared" / "fixtures" / "vocab" / "tiny-bpe-1024.gguf"
TEMPLATE = ROOT.parent / "shared" / "fixtures" / "templates" / "Qwen3.5-4B.jinja"
TORCH_WHEEL = "/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
SEED = 29

# The tiny model: every part of the published one (spec section 1) at a size whose F16 file stays a few MB.
# QSA budget 16 tokens in blocks of 4 (B = 4 blocks), so dense attention ends at position 18 and llama.cpp's
# 19-cell width first differs from transformers' 4 blocks + tail at position 19 (spec section 5 item 1).
TINY = dict(
    vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    eos_token_id=1021, bos_token_id=None, pad_token_id=None,
    hc_count=4, hc_lowrank=16, ple_layer_ids=[2], ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=8,
    ngram_vocab_size_base=256, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=4, seed=1234,
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=16, indexer_compress_ratio=4,
    output_gate_type="sigmoid",
)
BUDGET, RATIO = TINY["indexer_budget"], TINY["indexer_compress_ratio"]
RECIPES = ("q2_0", "iq2_xs", "q4_k_m")
N_PREDICT = 12


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --- the venv and the sources ---------------------------------------------------------------------------------

def make_venvs() -> None:
    """data/cache/q4venv: torch (the CPU wheel on this machine's disk) and transformers 5.24.0 from PyPI;
    data/cache/q4conv: the same torch with requirements-convert_hf_to_gguf.txt's transformers 4.57.6."""
    for venv, pins in ((VENV, ["transformers==5.24.0", "gguf==0.19.0", "sentencepiece", "jinja2", "psutil"]),
                       (CONV_VENV, ["transformers==4.57.6", "numpy~=2.2.6", "sentencepiece>=0.1.98,<0.3.0",
                                    "protobuf>=4.21.0,<5.0.0"])):
        py = venv / "bin" / "python"
        if not py.is_file():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", TORCH_WHEEL, "numpy", *pins], check=True)


def llama_sources() -> Path:
    """vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist (converter, gguf-py), unpacked once into the cache."""
    if (LLAMA_DIR / "convert_hf_to_gguf.py").is_file():
        return LLAMA_DIR
    SRC.mkdir(parents=True, exist_ok=True)
    tgz = SRC / f"{SDIST}.tar.gz"
    if not tgz.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python==0.3.36", "-d", str(SRC)], check=True)
    with tarfile.open(tgz) as t:
        keep = [m for m in t.getmembers() if m.name.startswith(f"{SDIST}/vendor/llama.cpp/")
                and "/vendor/llama.cpp/ggml/" not in m.name and "/vendor/llama.cpp/tools/" not in m.name]
        t.extractall(SRC, members=keep)
    return LLAMA_DIR


# --- the transformers model -----------------------------------------------------------------------------------

# Qwen3.5's pre-tokenizer as its tokenizer.json writes it (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35 quotes it)
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def write_tokenizer(out: Path) -> None:
    """tokenizer.json / tokenizer_config.json: tiny-bpe-1024's tokens and merges (its three ChatML specials at
    1021..1023), Qwen3.5's split regex then byte-level BPE, and Qwen3.5's chat template."""
    import gguf
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    r = gguf.GGUFReader(VOCAB)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ")) for m in r.fields["tokenizer.ggml.merges"].contents()]
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 1}
    specials = [t for t, ty in zip(tokens, types) if ty != 1]
    assert list(normal.values()) == list(range(len(normal))) and len(normal) + len(specials) == len(tokens)
    tk = Tokenizer(models.BPE(vocab=normal, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    assert [tk.token_to_id(t) for t in specials] == [tokens.index(t) for t in specials]
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=TINY["max_position_embeddings"])
    fast.chat_template = TEMPLATE.read_text()
    fast.save_pretrained(out)
    # transformers 5 names its class TokenizersBackend; the converter's transformers 4.57 knows the fast class
    # by its older name, and reads the template from tokenizer_config.json
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=fast.chat_template)
    cfg.pop("backend", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _init_weights(model, seed: int) -> None:
    """Random weights at scales that keep activations near unit size through the layers, rounded to fp16."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):          # A in [0.5, 4]: decays the state noticeably without erasing it
                v = torch.log(0.5 + 3.5 * torch.rand(p.shape, generator=g))
            elif name.endswith("dt_bias"):
                v = torch.randn(p.shape, generator=g) * 0.5
            elif name.endswith("linear_attn.norm.weight"):   # RMSNormGated: a plain weight around 1
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif p.ndim == 1 or "norm" in name.rsplit(".", 2)[-2]:   # zero-centred (1 + w) norms
                v = 0.1 * torch.randn(p.shape, generator=g)
            elif name.endswith("embed_tokens.weight"):
                v = 0.3 * torch.randn(p.shape, generator=g)
            elif "ngram_embedding" in name:
                v = torch.randn(p.shape, generator=g)
            elif name.endswith("ple.conv1d.weight") or name.endswith("linear_attn.conv1d.weight"):
                v = 0.5 * torch.randn(p.shape, generator=g)
            else:                                # nn.Linear and the expert stacks: [.., out, in]
                v = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
                # block outputs 3x the unit scale: with the weaker residual the embedding no longer dominates the
                # tied head, whose greedy run otherwise repeats the last token
                if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj", "down_proj.weight")):
                    v = 3.0 * v
            p.copy_(v.to(p.dtype).half().float())


def build_hf_model(out: Path) -> Path:
    """The tiny Qwen4ExpForCausalLM saved in out/ (float32 safetensors holding fp16 values), with its tokenizer."""
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    config = Qwen4ExpTextConfig(**TINY)
    config._attn_implementation = "eager"
    model = Qwen4ExpForCausalLM(config).float()
    _init_weights(model, SEED)
    model.save_pretrained(out, safe_serialization=True)
    # the released checkpoint names its QSA layers "full_attention" (configuration_qwen4_exp.py maps them to
    # "indexed_attention" on load, save_pretrained writes the latter), and llama.cpp's converter writes the
    # compress ratio only where layer_types says "full_attention": restore the published spelling
    cfg = json.loads((out / "config.json").read_text())
    cfg["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in cfg["layer_types"]]
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tokenizer(out)
    return out


# --- llama.cpp's converter ------------------------------------------------------------------------------------

_CONVERT = """
import runpy, sys
sys.path[:0] = [{gguf_py!r}, {llama!r}]
import conversion.base as base
def declared_pre(self, tokenizer):
    return {pre!r}   # the converter knows tokenizers by a hash of their ids; this vocabulary is new to it
base.TextModel.get_vocab_base_pre = declared_pre
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def convert(hf_dir: Path, out: Path, outtype: str = "f16", pre: str = "qwen35") -> Path:
    """convert_hf_to_gguf.py HF_DIR --outtype OUTTYPE --outfile OUT in the converter's own environment.

    Its requirements pin transformers 4.57.6, which has no qwen4_exp: AutoConfig fails and the converter reads
    config.json as written. Under transformers 5.24 AutoConfig succeeds and turns "full_attention" into
    "indexed_attention", and the converter then writes compress ratio 0 on every layer (llama.cpp: dense QSA)."""
    llama = llama_sources()
    out.unlink(missing_ok=True)
    code = _CONVERT.format(gguf_py=str(llama / "gguf-py"), llama=str(llama), pre=pre,
                           script=str(llama / "convert_hf_to_gguf.py"),
                           args=[str(hf_dir), "--outtype", outtype, "--outfile", str(out)])
    r = subprocess.run([str(CONV_VENV / "bin" / "python"), "-c", code], capture_output=True, text=True)
    if r.returncode != 0 or not out.is_file():
        raise SystemExit(f"qwen4exp_refs: the converter failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return out


# --- transformers as the reference ----------------------------------------------------------------------------

def hf_load(hf_dir: Path, dtype="float32"):
    import torch
    from transformers import Qwen4ExpForCausalLM
    m = Qwen4ExpForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype), attn_implementation="eager",
                                            experts_implementation="eager")
    return m.eval()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    """(len(ids), n_vocab) float64: one causal forward, no cache (each query selects its own QSA set)."""
    import torch
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].double().numpy()


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' own greedy continuation (each step a fresh forward over everything so far) and its margins."""
    ids, margins = [], []
    for _ in range(n):
        row = hf_logits(model, prompt + ids)[-1]
        a, b = np.sort(row)[-2:][::-1]
        ids.append(int(np.argmax(row)))
        margins.append(float(a - b))
    return ids, margins


class Gaps:
    """The smallest router gap (k-th minus (k+1)-th expert logit) and QSA block-score gap (B-th minus (B+1)-th,
    relative to the best) a transformers forward saw: where either is tiny, fp16 rounding in llama.cpp can pick
    another expert or block, and the references then differ by more than rounding."""

    def __init__(self, model):
        self.model, self.router, self.block, self._hooks = model, np.inf, np.inf, []

    def __enter__(self):
        import torch
        from transformers.models.qwen4_exp import modeling_qwen4_exp as mq
        k = self.model.config.num_experts_per_tok

        def on_router(mod, inp, out):
            s = torch.sort(out[0].double(), dim=-1, descending=True).values
            self.router = min(self.router, float((s[:, k - 1] - s[:, k]).min()))

        for m in self.model.modules():
            if isinstance(m, mq.Qwen4ExpTextTopKRouter):
                self._hooks.append(m.register_forward_hook(on_router))
        self._topk = torch.Tensor.topk
        gaps = self

        def topk(t, k, *a, **kw):     # the indexer's scores.topk(min(B, n_b), dim=0); the router calls torch.topk
            if t.ndim == 1 and k < t.numel():
                s = torch.sort(t.double(), descending=True).values
                gaps.block = min(gaps.block, float((s[k - 1] - s[k]) / max(abs(float(s[0])), 1e-12)))
            return gaps._topk(t, k, *a, **kw)
        torch.Tensor.topk = topk
        return self

    def __exit__(self, *exc):
        import torch
        torch.Tensor.topk = self._topk
        for h in self._hooks:
            h.remove()


def n_blocks(pos: int) -> int:
    return (pos + 1) // RATIO


def regime(pos: int) -> str:
    """'dense' while at most B = budget/r complete blocks are visible; past that 'sparse', where llama.cpp's top
    min(n_kv, budget + r - 1) cells differ from transformers' B blocks + tail (first at n_b = B + 1, tail empty),
    and every later position inherits the difference through the caches and recurrent states."""
    return "dense" if n_blocks(pos) <= BUDGET // RATIO else "sparse"


# --- a GGUF back in the transformers layout (exact arithmetic) -------------------------------------------------

def _gguf():
    """llama.cpp's own gguf-py (it knows Q2_0, type 42; PyPI's gguf 0.19 does not)."""
    path = str(llama_sources() / "gguf-py")
    if path not in sys.path:
        sys.path.insert(0, path)
    import gguf
    import gguf.quants
    if not str(gguf.__file__).startswith(path):
        raise SystemExit(f"qwen4exp_refs: imported {gguf.__file__}, not llama.cpp's gguf-py: run it as a program")
    return gguf


def dequant_q2_0(raw: np.ndarray, n: int) -> np.ndarray:
    """Q2_0 (ggml 42): blocks of 64 in 18 bytes, fp16 d then 2-bit codes q (bits 2(j%4) of byte j/4): (q - 1) d."""
    b = np.asarray(raw, np.uint8).reshape(-1, 18)
    d = b[:, :2].copy().view("<f2").astype(np.float64)
    q = (b[:, 2:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
    return ((q.reshape(-1, 64).astype(np.float64) - 1.0) * d).reshape(-1)[:n]


def gguf_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float64, numpy order (the ggml shape reversed)."""
    gguf = _gguf()
    r = gguf.GGUFReader(path)
    out = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        if int(t.tensor_type) == 42:
            x = dequant_q2_0(t.data, int(np.prod(shape)))
        else:
            x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        out[t.name] = np.asarray(x, np.float64).reshape(shape)
    return out


def tensor_types(path: Path) -> dict[str, str]:
    gguf = _gguf()
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def _untile(x: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
    """The converter's _reorder_v_heads undone: GGUF value head r*K + g back to transformers' g*R + r."""
    K, Vh = TINY["linear_num_key_heads"], TINY["linear_num_value_heads"]
    R = Vh // K
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(R, K, head_dim, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest))).reshape(Vh * head_dim, *rest)
    return np.moveaxis(x, 0, axis)


def hf_state_from_gguf(path: Path) -> dict[str, np.ndarray]:
    """transformers' parameter names -> values, from a GGUF the converter wrote (its transforms undone: norms'
    folded +1, -exp(A_log), tiled value heads, split indexer q/k, split gate/up experts, squeezed convs)."""
    w = gguf_tensors(path)
    hd = TINY["linear_value_head_dim"]
    kd = TINY["linear_key_head_dim"] * TINY["linear_num_key_heads"]
    sd = {"model.embed_tokens.weight": w["token_embd.weight"]}
    if "output.weight" in w:
        sd["lm_head.weight"] = w["output.weight"]

    def hc(prefix, g, inject=True):
        sd[f"{prefix}.hc_norm.weight"] = w[f"{g}_norm.weight"].reshape(-1) - 1.0
        sd[f"{prefix}.input_mix_weight_down.weight"] = w[f"{g}_down.weight"]
        sd[f"{prefix}.input_mix_weight_up.weight"] = w[f"{g}_up.weight"]
        if inject:
            sd[f"{prefix}.block_inject_weight.weight"] = w[f"{g}_inject.weight"]

    hc("model.hyper_connection_mixer", "output_hc", inject=False)
    for il, kind in enumerate(TINY["layer_types"]):
        b, m = f"blk.{il}.", f"model.layers.{il}."
        hc(m + "attn_hyper_connection", b + "hc_attn")
        hc(m + "mlp_hyper_connection", b + "hc_ffn")
        if kind == "linear_attention":
            a = m + "linear_attn."
            qkv = w[b + "attn_qkv.weight"]
            sd[a + "in_proj_qkv.weight"] = np.concatenate([qkv[:2 * kd], _untile(qkv[2 * kd:], 0, hd)])
            sd[a + "in_proj_z.weight"] = _untile(w[b + "attn_gate.weight"], 0, hd)
            sd[a + "in_proj_b.weight"] = _untile(w[b + "ssm_beta.weight"], 0, 1)
            sd[a + "in_proj_a.weight"] = _untile(w[b + "ssm_alpha.weight"], 0, 1)
            conv = w[b + "ssm_conv1d.weight"]
            sd[a + "conv1d.weight"] = np.concatenate([conv[:2 * kd], _untile(conv[2 * kd:], 0, hd)])[:, None, :]
            sd[a + "dt_bias"] = _untile(w[b + "ssm_dt.bias"][:, None], 0, 1)[:, 0]
            sd[a + "A_log"] = np.log(-_untile(w[b + "ssm_a"][:, None], 0, 1)[:, 0])
            sd[a + "norm.weight"] = w[b + "ssm_norm.weight"]
            sd[a + "out_proj.weight"] = _untile(w[b + "ssm_out.weight"], 1, hd)
        else:
            a = m + "self_attn."
            for g, h in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
                sd[a + h + ".weight"] = w[b + g + ".weight"]
            sd[a + "q_norm.weight"] = w[b + "attn_q_norm.weight"] - 1.0
            sd[a + "k_norm.weight"] = w[b + "attn_k_norm.weight"] - 1.0
            sd[a + "indexer.index_qk_proj.weight"] = np.concatenate([w[b + "indexer.q_proj.weight"],
                                                                     w[b + "indexer.k_proj.weight"]])
            sd[a + "indexer.q_layernorm.weight"] = w[b + "indexer.q_norm.weight"] - 1.0
            sd[a + "indexer.k_layernorm.weight"] = w[b + "indexer.k_norm.weight"] - 1.0
        if il + 1 in TINY["ple_layer_ids"]:
            p = m + "ple."
            sd[p + "key_proj.weight"] = w[b + "ple_key.weight"]
            sd[p + "value_proj.weight"] = w[b + "ple_value.weight"]
            for n in ("key", "query", "conv"):
                sd[p + f"norm_{n}.weight"] = w[b + f"ple_norm_{n}.weight"].reshape(-1) - 1.0
            sd[p + "conv1d.weight"] = w[b + "ple_conv1d.weight"][:, None, :]
            sd[p + "ple_embedding.ngram_embedding.weight"] = w["per_layer_token_embd.weight"]
        f = m + "mlp."
        sd[f + "gate.weight"] = w[b + "ffn_gate_inp.weight"]
        sd[f + "experts.gate_up_proj"] = np.concatenate([w[b + "ffn_gate_exps.weight"], w[b + "ffn_up_exps.weight"]],
                                                        axis=1)
        sd[f + "experts.down_proj"] = w[b + "ffn_down_exps.weight"]
        for n in ("gate", "up", "down"):
            sd[f + f"shared_expert.{n}_proj.weight"] = w[b + f"ffn_{n}_shexp.weight"]
        sd[f + "shared_expert_gate.weight"] = w[b + "ffn_gate_inp_shexp.weight"].reshape(1, -1)
    return sd


def exact_model(path: Path, hf_dir: Path):
    """The transformers model in float64 holding a GGUF's dequantized weights: exact arithmetic for that file."""
    import torch
    model = hf_load(hf_dir, "float64")
    params = dict(model.named_parameters())
    sd = hf_state_from_gguf(path)
    missing = sorted(set(params) - set(sd) - ({"lm_head.weight"} if TINY["tie_word_embeddings"] else set()))
    extra = sorted(set(sd) - set(params))
    if missing or extra:
        raise SystemExit(f"qwen4exp_refs: the GGUF -> transformers map is incomplete: missing {missing}, extra {extra}")
    with torch.no_grad():
        for name, v in sd.items():
            if tuple(params[name].shape) != v.shape:
                raise SystemExit(f"qwen4exp_refs: {name}: GGUF gives {v.shape}, transformers has "
                                 f"{tuple(params[name].shape)}")
            params[name].copy_(torch.from_numpy(v))
    return model


def _tile(x: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
    """The converter's _reorder_v_heads: transformers' value head g*R + r to GGUF head r*K + g."""
    K, Vh = TINY["linear_num_key_heads"], TINY["linear_num_value_heads"]
    R = Vh // K
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(K, R, head_dim, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest))).reshape(Vh * head_dim, *rest)
    return np.moveaxis(x, 0, axis)


_LINEAR_NAMES = {   # transformers module (under model.layers.L.) -> the GGUF tensors it feeds
    "attn_hyper_connection.input_mix_weight_down": ["hc_attn_down"],
    "attn_hyper_connection.input_mix_weight_up": ["hc_attn_up"],
    "attn_hyper_connection.block_inject_weight": ["hc_attn_inject"],
    "mlp_hyper_connection.input_mix_weight_down": ["hc_ffn_down"],
    "mlp_hyper_connection.input_mix_weight_up": ["hc_ffn_up"],
    "mlp_hyper_connection.block_inject_weight": ["hc_ffn_inject"],
    "linear_attn.in_proj_qkv": ["attn_qkv"], "linear_attn.in_proj_z": ["attn_gate"],
    "linear_attn.in_proj_b": ["ssm_beta"], "linear_attn.in_proj_a": ["ssm_alpha"], "linear_attn.out_proj": ["ssm_out"],
    "self_attn.q_proj": ["attn_q"], "self_attn.k_proj": ["attn_k"], "self_attn.v_proj": ["attn_v"],
    "self_attn.o_proj": ["attn_output"], "self_attn.indexer.index_qk_proj": ["indexer.q_proj", "indexer.k_proj"],
    "ple.key_proj": ["ple_key"], "ple.value_proj": ["ple_value"],
    "mlp.gate": ["ffn_gate_inp"], "mlp.shared_expert_gate": ["ffn_gate_inp_shexp"],
    "mlp.shared_expert.gate_proj": ["ffn_gate_shexp"], "mlp.shared_expert.up_proj": ["ffn_up_shexp"],
    "mlp.shared_expert.down_proj": ["ffn_down_shexp"],
}


def hf_imatrix(model, prompt_ids: list[list[int]]):
    """tools.imatrix's statistics (per input column, sum of squares and token count; per expert for the expert
    stacks), collected from transformers' forward and named and ordered as the GGUF's tensors."""
    import torch
    from tools.imatrix import IMatrix, Stat
    from transformers.models.qwen4_exp import modeling_qwen4_exp as mq
    im = IMatrix(chunk_size=max(len(p) for p in prompt_ids))
    hd = TINY["linear_value_head_dim"]

    def add(name, x, expert=0, n_mat=1):
        x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        st = im.stats.setdefault(name, Stat(np.zeros((n_mat, x.shape[-1])), np.zeros(n_mat, np.int64)))
        st.sums[expert] += np.sum(x * x, axis=0)
        st.counts[expert] += len(x)

    hooks = []
    for mname, mod in model.named_modules():
        parts = mname.split(".")
        if isinstance(mod, torch.nn.Linear) and mname.startswith("model.layers."):
            targets = _LINEAR_NAMES.get(".".join(parts[3:]))
            if targets:
                gg = [f"blk.{parts[2]}.{t}.weight" for t in targets]
                tile = targets == ["ssm_out"]

                def pre(m, inp, gg=gg, tile=tile):
                    x = inp[0].detach().double().numpy()
                    for g in gg:
                        add(g, _tile(x, -1, hd) if tile else x)
                hooks.append(mod.register_forward_pre_hook(pre))
        elif isinstance(mod, torch.nn.Linear) and mname.startswith("model.hyper_connection_mixer."):
            g = {"input_mix_weight_down": "output_hc_down.weight", "input_mix_weight_up": "output_hc_up.weight"}[parts[-1]]
            hooks.append(mod.register_forward_pre_hook(lambda m, inp, g=g: add(g, inp[0].detach().double().numpy())))
        elif isinstance(mod, mq.Qwen4ExpTextExperts):
            b = f"blk.{parts[2]}."

            def pre(m, inp, b=b):
                x, idx = inp[0].detach().double(), inp[1]
                for e in range(m.num_experts):
                    rows = (idx == e).any(dim=-1).nonzero().flatten()
                    if len(rows) == 0:
                        continue
                    xe = x[rows]
                    g, u = (xe @ m.gate_up_proj[e].detach().double().T).chunk(2, dim=-1)
                    for n in ("gate", "up"):
                        add(b + f"ffn_{n}_exps.weight", xe.numpy(), e, m.num_experts)
                    add(b + "ffn_down_exps.weight", (torch.nn.functional.silu(g) * u).numpy(), e, m.num_experts)
                for n in ("gate", "up", "down"):   # an expert no token reached still needs its row of the table
                    name = b + f"ffn_{n}_exps.weight"
                    if name not in im.stats:
                        width = m.intermediate_dim if n == "down" else m.hidden_dim
                        im.stats[name] = Stat(np.zeros((m.num_experts, width)), np.zeros(m.num_experts, np.int64))
            hooks.append(mod.register_forward_pre_hook(pre))
    try:
        for p in prompt_ids:
            hf_logits(model, p)
            im.n_tokens += len(p)
    finally:
        for h in hooks:
            h.remove()
    return im


# llama_ftype (include/llama.h of 0c1e570) of the recipes made here
FTYPES = {"q2_0": 41, "iq2_xs": 20, "q4_k_m": 15}


def quantize(src: Path, dst: Path, recipe: str, imatrix: Path | None) -> Path:
    """llama-quantize SRC DST RECIPE [--imatrix FILE], the anchor wheel's llama_model_quantize."""
    from tools import llama_ref
    tmp = dst.with_name(dst.name + ".part")
    llama_ref._call({"op": "quantize", "src": str(src), "dst": str(tmp), "ftype": FTYPES[recipe], "nthread": 2,
                     "imatrix": str(imatrix) if imatrix else None, "overrides": []})
    os.replace(tmp, dst)
    return dst


# --- the fixtures ---------------------------------------------------------------------------------------------

# (name, prompt length, tokens to predict, positions set to the PLE reset token): shorter than the budget and
# dense throughout; exactly the budget (its continuation crosses into the sparse regime); ending just before the
# crossing so that decode crosses it one token at a time; longer (the prompt batch crosses it); one with EOS
# inside, for the n-gram reset (two in a row, and one a single token before another).
CASES = (("short", 8, 8, ()), ("at_budget", 16, 12, ()), ("crossing", 18, 12, ()), ("long", 40, 12, ()),
         ("ple_eos", 24, 8, (5, 6, 12, 14)))
MIN_ROUTER_GAP = 2e-3      # tools.hybrid_refs: below this llama.cpp's fp16 activations can flip an expert
MIN_BLOCK_GAP = 1e-3       # relative; the same for the QSA block ranking
TOP = 10


def _r(x: float) -> float:
    return round(float(x), 5)


def _case_prompt(name: str, length: int, eos_at, seed: int) -> list[int]:
    rng = np.random.default_rng([seed, length, len(name)])
    ids = rng.integers(0, TINY["eos_token_id"], length).tolist()   # 0..1020: no special token but the ones put in
    for p in eos_at:
        ids[p] = TINY["eos_token_id"]
    return ids


def choose_cases(f16: Path, model, tries: int = 50) -> list[dict]:
    """For each CASES entry the first seed whose prompt, teacher-forced along llama.cpp's greedy run, keeps every
    router and block-ranking gap clear: llama.cpp's greedy ids, top-10 and margins, with the prompt's seed."""
    from tools import llama_ref
    chosen = []
    for name, length, n_predict, eos_at in CASES:
        for seed in range(tries):
            prompt = _case_prompt(name, length, eos_at, seed)
            case = llama_ref.record(f16, [prompt], n_predict)[0]
            with Gaps(model) as g:
                hf_logits(model, prompt + case["greedy_ids"][:-1])
            if g.router >= MIN_ROUTER_GAP and g.block >= MIN_BLOCK_GAP:
                case.update(name=name, seed=seed, min_router_gap=_r(g.router),
                            min_block_gap=_r(g.block) if np.isfinite(g.block) else None)
                chosen.append(case)
                print(f"qwen4exp_refs: case {name}: seed {seed}, router gap {g.router:.4f}, block gap {g.block:.4f}",
                      file=sys.stderr)
                break
        else:
            raise SystemExit(f"qwen4exp_refs: no prompt for case {name} with clear gaps in {tries} seeds")
    return chosen


def _steps(case: dict, rows: np.ndarray, key: str) -> None:
    """Per step: <key>_top (this reference's own top-10 [id, logit]) and <key>_at_top (its logits at llama.cpp's)."""
    for s, row in zip(case["steps"], rows, strict=True):
        best = np.argsort(-row, kind="stable")[:TOP]
        s[f"{key}_top"] = [[int(i), _r(row[i])] for i in best]
        s[f"{key}_at_top"] = [_r(row[i]) for i, _ in s["top"]]


def _diff(cases, key: str, which: str) -> dict | None:
    d = [abs(v - w) for c in cases for s in c["steps"] if s["qsa"] == which or which == "all"
         for (_, v), w in zip(s["top"], s[f"{key}_at_top"])]
    if not d:
        return None
    return {"median_abs_diff": _r(np.median(d)), "max_abs_diff": _r(np.max(d)), "n_logits": len(d)}


MADE_WITH = {
    "llama.cpp": "0c1e570 as vendored by llama-cpp-python 0.3.36, CPU build (../shared/anchors wheel), 2 threads, "
                 "n_batch 512: prompt in one batch, then one token at a time (greedy)",
    "transformers": "5.24.0 modeling_qwen4_exp.Qwen4ExpForCausalLM, torch 2.13.0+cpu, eager attention and experts, "
                    "no cache: one causal forward over prompt + greedy_ids[:-1] (hf_*), a fresh forward per "
                    "step for hf_greedy_ids",
    "exact": "the same transformers forward in float64 over the file's dequantized weights mapped back to the HF "
             "layout (float32 where modeling_qwen4_exp casts: RMSNorm, router softmax, GDN recurrence, attention "
             "softmax; ~1e-5 on the logits)",
    "converter": "vendor/llama.cpp/convert_hf_to_gguf.py --outtype f16 under its pinned transformers 4.57.6",
}


def reference(path: Path, cases: list[dict], recipe: str, hf_dir: Path, model) -> dict:
    """The fixture JSON of one file: llama.cpp on it (re-recorded), and transformers (F16) or exact (quantized)."""
    from tools import llama_ref
    rec = llama_ref.record(path, [c["prompt_ids"] for c in cases], N_PREDICT_MAX)
    out = []
    ref_model = model if recipe == "f16" else exact_model(path, hf_dir)
    key = "hf" if recipe == "f16" else "exact"
    for c, r in zip(cases, rec, strict=True):
        n = len(c["greedy_ids"])
        case = {"name": c["name"], "seed": c["seed"], "prompt_ids": c["prompt_ids"],
                "greedy_ids": r["greedy_ids"][:n], "steps": r["steps"][:n]}
        n_p = len(case["prompt_ids"])
        for i, s in enumerate(case["steps"]):
            s["top"] = [[int(t), _r(v)] for t, v in s["top"]]
            s["margin"] = _r(s["margin"])
            s["pos"] = n_p - 1 + i
            s["qsa"] = regime(s["pos"])
            # cells of the (B+1)-th best block llama.cpp attends and transformers does not: its width is
            # B*r + r - 1, transformers' B*r + |tail|
            s["llama_extra_cells"] = (RATIO - 1 - (s["pos"] + 1) % RATIO) if s["qsa"] == "sparse" else 0
        rows = hf_logits(ref_model, case["prompt_ids"] + case["greedy_ids"][:-1])[n_p - 1:]
        _steps(case, rows, key)
        if recipe == "f16":
            case["min_router_gap"], case["min_block_gap"] = c["min_router_gap"], c["min_block_gap"]
            case["hf_greedy_ids"], margins = hf_greedy(model, case["prompt_ids"], n)
            case["hf_greedy_margins"] = [_r(m) for m in margins]
        out.append(case)
    ref = {"fixture": "tiny-qwen4exp", "recipe": recipe, "model_file": path.name, "model_sha256": sha256(path),
           "made_with": MADE_WITH, "qsa": {"budget_tokens": BUDGET, "block": RATIO, "budget_blocks": BUDGET // RATIO,
                                           "first_sparse_pos": min(p for p in range(4096) if regime(p) == "sparse"),
                                           "llama_cpp_width": BUDGET + RATIO - 1},
           "tensor_types": tensor_types(path), "cases": out}
    if recipe == "f16":
        ref["llama_vs_hf"] = {w: _diff(out, "hf", w) for w in ("dense", "sparse")}
    else:
        ref["llama_vs_exact"] = {w: _diff(out, "exact", w) for w in ("all", "dense", "sparse")}
    return ref


N_PREDICT_MAX = max(c[2] for c in CASES)


def write_all(out: Path, work: Path = WORK) -> list[Path]:
    from tools import llama_ref
    from tools.imatrix import write_imatrix
    out.mkdir(parents=True, exist_ok=True)
    hf_dir = build_hf_model(work / "hf")
    f16 = convert(hf_dir, out / "tiny-qwen4exp-f16.gguf")
    model = hf_load(hf_dir)
    imatrix = write_imatrix(out / "tiny-qwen4exp.imatrix",
                            hf_imatrix(model, llama_ref.prompts(TINY["vocab_size"], seed=1, lengths=(64,) * 4)))
    files = {"f16": f16}
    for recipe in RECIPES:
        files[recipe] = quantize(f16, out / f"tiny-qwen4exp-{recipe}.gguf", recipe,
                                 imatrix if recipe == "iq2_xs" else None)
    cases = choose_cases(f16, model)
    written = [imatrix]
    for recipe, path in files.items():
        ref = reference(path, cases, recipe, hf_dir, model)
        dst = out / f"tiny-qwen4exp-{recipe}.json"
        dst.write_text(json.dumps(ref, separators=(",", ":")) + "\n")
        written += [path, dst]
        print(f"qwen4exp_refs: {dst.name}: {ref.get('llama_vs_hf') or ref.get('llama_vs_exact')}", file=sys.stderr)
    # sha256sum's format (sha256sum -c SHA256SUMS checks it); not a .json: the fixture folders' *.json are references
    (out / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.name}\n" for p in sorted(written)))
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.qwen4exp_refs", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("venv", help="make data/cache/q4venv and data/cache/q4conv (torch CPU, transformers)")
    a = sub.add_parser("all", help="the model, its GGUFs and every reference JSON (run with data/cache/q4venv)")
    a.add_argument("--out", type=Path, default=OUT)
    a.add_argument("--workdir", type=Path, default=WORK)
    args = ap.parse_args(argv)
    if args.cmd == "venv":
        make_venvs()
        return 0
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit(f"qwen4exp_refs: run it with {VENV / 'bin' / 'python'} (python -m tools.qwen4exp_refs venv "
                         f"makes it)") from None
    _gguf()
    for p in write_all(args.out, args.workdir):
        print(f"{p.name}\t{p.stat().st_size}\t{sha256(p)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
