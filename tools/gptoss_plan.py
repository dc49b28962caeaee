"""gpt-oss for tools.make_moe: the tensor plan, the metadata keys and a harmony vocabulary.

Shapes from the published configs (openai/gpt-oss-20b and -120b config.json): hidden 2880, 64 query heads and 8 KV
heads of 64, experts of width 2880 (20b: 24 layers, 32 experts; 120b: 36 layers, 128 experts; 4 used), sliding
window 128 on alternate layers, RoPE base 150000 with YaRN factor 32 over 4096 original positions, vocabulary
201088. Types as ggml-org's published GGUFs hold them (convert_hf_to_gguf --outtype q8_0 keeping OpenAI's MXFP4
experts): experts MXFP4, token_embd / output / attention Q8_0, the router, biases, sinks and norms F32; which sums
to 12.1 GB and 63.4 GB, the published files' sizes.

Every tensor and key llama.cpp reads for LLM_ARCH_OPENAI_MOE (src/models/openai-moe.cpp): attn_sinks, biases on
q/k/v/o, the router and each expert matrix, post_attention_norm as the FFN's norm, attention.sliding_window and the
YaRN keys. The vocabulary is made here, deterministically: the real one (o200k_harmony) is not a fixture, but the
harmony control tokens are what the chat format needs, so the tiny preset gets tiny-bpe-1024's text tokens plus
them, and the real-shaped ones filler tokens up to the real size with the controls at their real ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as Q, GGUFValueType as VT, MODEL_TENSOR as MT

ARCH = "gpt-oss"
ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT.parent / "shared" / "fixtures"
TEMPLATE = FIXTURES / "templates" / "openai-gpt-oss-120b.jinja"   # the template the published GGUFs carry

# The published GGUFs' types (see the docstring); make_moe's --experts/--attn/... flags override them.
REAL_TYPES = {"experts": Q.MXFP4, "attn": Q.Q8_0, "embd": Q.Q8_0, "output": Q.Q8_0, "norm": Q.F32}

# o200k_harmony's control tokens at their ids in the real vocabulary; the ids between are <|reserved_N|>.
HARMONY_IDS = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002, "<|constrain|>": 200003,
               "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008,
               "<|call|>": 200012, "<|endofprompt|>": 200018}
REAL_VOCAB = 201088
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5


@dataclass(frozen=True)
class Extra:
    """What a gpt-oss file has beyond make_moe.Shape."""
    n_swa: int                 # attention.sliding_window
    yarn_factor: float         # rope.scaling.factor (type yarn)
    n_ctx_orig: int            # rope.scaling.original_context_length
    real_vocab: bool           # the real vocabulary's size and control ids, else the tiny harmony vocabulary


# Keyed by the presets' Shape.vocab, which names the vocabulary harmony_vocab makes (not a file).
EXTRA = {
    "harmony-o200k": Extra(128, 32.0, 4096, True),
    # a window of 16 so that the tests' prompts run past it within a few dozen tokens
    "harmony-tiny": Extra(16, 32.0, 4096, False),
}
BASE_VOCAB = "tiny-bpe-1024.gguf"    # the text tokens and merges of both


def extra_for(shape) -> Extra:
    return EXTRA[shape.vocab]


def _name(t: MT, bid: int | None = None, suffix: str = "weight") -> str:
    return gguf.TENSOR_NAMES[t].format(bid=bid) + "." + suffix


def plan(shape, types: dict, n_vocab: int, spec_cls) -> list:
    """Every tensor of a gpt-oss model in the converter's order; spec_cls is make_moe.TensorSpec."""
    s = shape
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    specs = [spec_cls(_name(MT.TOKEN_EMBD), (n_vocab, s.n_embd), types["embd"], "embd", "head"),
             spec_cls(_name(MT.OUTPUT_NORM), (s.n_embd,), types["norm"], "norm", "norm"),
             spec_cls(_name(MT.OUTPUT), (n_vocab, s.n_embd), types["output"], "output", "head")]
    for i in range(s.n_layer):
        def add(t, shp, group, init, suffix="weight"):
            qtype = Q.F32 if group in ("bias", "router") else types[group]
            specs.append(spec_cls(_name(t, i, suffix), shp, qtype, group, init, i))

        add(MT.ATTN_NORM, (s.n_embd,), "norm", "norm")
        add(MT.ATTN_POST_NORM, (s.n_embd,), "norm", "norm")
        for t, n in ((MT.ATTN_Q, q_dim), (MT.ATTN_K, kv_dim), (MT.ATTN_V, kv_dim)):
            add(t, (n, s.n_embd), "attn", "matrix")
            add(t, (n,), "bias", "bias", "bias")
        add(MT.ATTN_OUT, (s.n_embd, q_dim), "attn", "matrix")
        add(MT.ATTN_OUT, (s.n_embd,), "bias", "bias", "bias")
        # sink logits near 1 (norm init): a real share of each row's softmax mass, as trained sinks take
        add(MT.ATTN_SINKS, (s.n_head,), "bias", "norm")
        add(MT.FFN_GATE_INP, (s.n_expert, s.n_embd), "router", "router")
        add(MT.FFN_GATE_INP, (s.n_expert,), "bias", "bias", "bias")
        for t in (MT.FFN_GATE_EXP, MT.FFN_UP_EXP):
            add(t, (s.n_expert, s.n_ff_exp, s.n_embd), "experts", "matrix")
            add(t, (s.n_expert, s.n_ff_exp), "bias", "bias", "bias")
        add(MT.FFN_DOWN_EXP, (s.n_expert, s.n_embd, s.n_ff_exp), "experts", "matrix")
        add(MT.FFN_DOWN_EXP, (s.n_expert, s.n_embd), "bias", "bias", "bias")
    return specs


def add_metadata(w: gguf.GGUFWriter, shape) -> None:
    """The keys gpt-oss adds to make_moe.add_metadata's: the window and YaRN (llama.cpp reads no others)."""
    x = extra_for(shape)
    w.add_sliding_window(x.n_swa)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(x.yarn_factor)
    w.add_rope_scaling_orig_ctx_len(x.n_ctx_orig)


def harmony_vocab(shape, tiny_vocab: list) -> list:
    """(key, value, [type, sub_type]) entries for GGUFWriter, as make_moe.read_vocab returns them.

    tiny_vocab: tiny-bpe-1024's entries (its text tokens and merges are kept, its ChatML controls dropped). The tiny
    preset appends the harmony controls after the text tokens; the real-shaped ones pad with unused tokens so that
    each control sits at its o200k_harmony id and the vocabulary has 201088 entries.
    """
    md = {k: v for k, v, _ in tiny_vocab}
    tokens, ttypes = list(md["tokenizer.ggml.tokens"]), list(md["tokenizer.ggml.token_type"])
    keep = [i for i, t in enumerate(ttypes) if t == TOKEN_NORMAL]
    tokens, ttypes = [tokens[i] for i in keep], [ttypes[i] for i in keep]
    if extra_for(shape).real_vocab:
        by_id = {i: t for t, i in HARMONY_IDS.items()}
        for i in range(len(tokens), REAL_VOCAB):
            if i in by_id:
                tokens.append(by_id[i])
                ttypes.append(TOKEN_CONTROL)
            elif i >= min(by_id):
                tokens.append(f"<|reserved_{i}|>")
                ttypes.append(TOKEN_CONTROL)
            else:
                tokens.append(f"<|unused_{i}|>")
                ttypes.append(TOKEN_UNUSED)
    else:
        for t in sorted(HARMONY_IDS, key=HARMONY_IDS.get):
            tokens.append(t)
            ttypes.append(TOKEN_CONTROL)
    ids = {t: i for i, t in enumerate(tokens)}
    arr = [VT.ARRAY, VT.STRING]
    return [("tokenizer.ggml.model", "gpt2", [VT.STRING]),
            ("tokenizer.ggml.pre", md["tokenizer.ggml.pre"], [VT.STRING]),
            ("tokenizer.ggml.tokens", tokens, arr),
            ("tokenizer.ggml.token_type", ttypes, [VT.ARRAY, VT.INT32]),
            ("tokenizer.ggml.merges", list(md["tokenizer.ggml.merges"]), arr),
            ("tokenizer.ggml.bos_token_id", ids["<|startoftext|>"], [VT.UINT32]),
            ("tokenizer.ggml.eos_token_id", ids["<|return|>"], [VT.UINT32]),
            ("tokenizer.ggml.padding_token_id", ids["<|endoftext|>"], [VT.UINT32]),
            ("tokenizer.ggml.add_bos_token", False, [VT.BOOL]),
            ("tokenizer.chat_template", TEMPLATE.read_text(encoding="utf-8"), [VT.STRING])]

