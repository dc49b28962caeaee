"""make_moe's plan for the Gated DeltaNet hybrids: qwen3next (Qwen3-Next) and qwen35moe (Qwen3.5/3.6 MoE).

Every tensor and key llama.cpp 0c1e570's loader reads for them (src/models/qwen3next.cpp, qwen35moe.cpp): trunk
layers whose (i+1) % full_attention_interval != 0 are GDN (attn_qkv, attn_gate, ssm_conv1d, ssm_dt.bias, ssm_a,
ssm_ba or ssm_beta + ssm_alpha, ssm_norm, ssm_out), the others gated attention (attn_q twice as wide: query and
gate per head; q/k norms); every layer has post_attention_norm, routed experts, a shared expert and its one-row
sigmoid gate. n_nextn MTP blocks follow the trunk (block_count counts them): a gated-attention block with the same
FFN plus nextn.eh_proj / enorm / hnorm / shared_head_norm, as the converter writes them for Qwen's MTP heads.

make_moe --recipe (tools/recipes.py) gives llama-quantize's per-tensor types: for Q4_K_M, output Q6_K; attn_v and
the GDN attn_qkv (both "attention-v-like", one per block) Q6_K on more-bits blocks; ffn_down_exps and
ffn_down_shexp Q6_K on more-bits layers, counted over block_count (MTP blocks included); norms, routers,
ssm_conv1d, ssm_a, ssm_dt and the shared-expert gate stay F32 (1-D, or never quantized).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFValueType

HYBRID_ARCHS = ("qwen3next", "qwen35moe")


@dataclass(frozen=True)
class Hybrid:
    ssm_conv: int               # conv1d kernel width
    ssm_state: int              # GDN head width (key and value)
    ssm_k_heads: int
    ssm_v_heads: int
    n_rot: int                  # rotary dimensions of the attention heads (partial_rotary_factor * head_dim)
    n_nextn: int = 0            # MTP blocks after the trunk
    full_attn_interval: int = 4
    rope_sections: tuple = ()   # qwen35moe's IMRoPE sections
    n_vocab: int = 0            # pad the vocabulary to this size (0: as it is), as the converter pads HF's
    pre: str | None = None      # tokenizer.ggml.pre to write instead of the vocabulary's


def is_recurrent(h: Hybrid, n_layer: int, il: int) -> bool:
    return il < n_layer and (il + 1) % h.full_attn_interval != 0


def plan(shape, types: dict, n_vocab: int, spec_cls) -> list:
    """Every tensor of the hybrid model in file order, as spec_cls (make_moe's TensorSpec)."""
    s, h = shape, shape.hybrid
    E, H, Hkv, D = s.n_embd, s.n_head, s.n_head_kv, s.head_dim
    key_dim, inner = h.ssm_k_heads * h.ssm_state, h.ssm_v_heads * h.ssm_state
    n_all = s.n_layer + h.n_nextn
    specs = [spec_cls("token_embd.weight", (n_vocab, E), types["embd"], "embd", "head"),
             spec_cls("output_norm.weight", (E,), types["norm"], "norm", "norm")]
    if not s.tied:
        specs.append(spec_cls("output.weight", (n_vocab, E), types["output"], "output", "head"))
    for il in range(n_all):
        mtp = il >= s.n_layer

        def add(suffix, shp, group, init, qtype=None):
            if qtype is None:   # routers stay F32 (llama.cpp never quantizes them); GDN projections follow --attn
                qtype = Q.F32 if group == "router" else types["attn" if group == "ssm" else group]
            specs.append(spec_cls(f"blk.{il}.{suffix}", shp, qtype, "mtp" if mtp else group, init, il))

        add("attn_norm.weight", (E,), "norm", "norm")
        add("post_attention_norm.weight", (E,), "norm", "norm")
        if is_recurrent(h, s.n_layer, il):
            add("attn_qkv.weight", (2 * key_dim + inner, E), "ssm", "matrix")
            add("attn_gate.weight", (inner, E), "ssm", "matrix")
            add("ssm_conv1d.weight", (2 * key_dim + inner, h.ssm_conv), "ssm", "matrix", Q.F32)
            add("ssm_dt.bias", (h.ssm_v_heads,), "ssm", "ssm_dt", Q.F32)
            add("ssm_a", (h.ssm_v_heads,), "ssm", "ssm_a", Q.F32)
            if s.arch == "qwen3next":
                add("ssm_ba.weight", (2 * h.ssm_v_heads, E), "ssm", "matrix")
            else:
                add("ssm_beta.weight", (h.ssm_v_heads, E), "ssm", "matrix")
                add("ssm_alpha.weight", (h.ssm_v_heads, E), "ssm", "matrix")
            add("ssm_norm.weight", (h.ssm_state,), "norm", "norm")
            add("ssm_out.weight", (E, inner), "ssm", "matrix")
        else:
            add("attn_q.weight", (2 * H * D, E), "attn", "matrix")
            add("attn_k.weight", (Hkv * D, E), "attn", "matrix")
            add("attn_v.weight", (Hkv * D, E), "attn", "matrix")
            add("attn_output.weight", (E, H * D), "attn", "matrix")
            add("attn_q_norm.weight", (D,), "norm", "norm")
            add("attn_k_norm.weight", (D,), "norm", "norm")
        add("ffn_gate_inp.weight", (s.n_expert, E), "router", "router")
        add("ffn_gate_exps.weight", (s.n_expert, s.n_ff_exp, E), "experts", "matrix")
        add("ffn_up_exps.weight", (s.n_expert, s.n_ff_exp, E), "experts", "matrix")
        add("ffn_down_exps.weight", (s.n_expert, E, s.n_ff_exp), "experts", "matrix")
        add("ffn_gate_inp_shexp.weight", (E,), "router", "shexp_gate")
        add("ffn_gate_shexp.weight", (s.n_ff_shexp, E), "shexp", "matrix")
        add("ffn_up_shexp.weight", (s.n_ff_shexp, E), "shexp", "matrix")
        add("ffn_down_shexp.weight", (E, s.n_ff_shexp), "shexp", "matrix")
        if mtp:
            add("nextn.eh_proj.weight", (E, 2 * E), "attn", "matrix")
            add("nextn.enorm.weight", (E,), "norm", "norm")
            add("nextn.hnorm.weight", (E,), "norm", "norm")
            add("nextn.shared_head_norm.weight", (E,), "norm", "norm")
    return specs


def init_values(init: str, n: int, rng: np.random.Generator) -> np.ndarray | None:
    """The GDN's per-head scalars as Qwen's initializers draw them; None for inits make_moe does itself.

    ssm_a = -A with A ~ U(1, 16) (the converter stores -exp(A_log)); ssm_dt.bias = softplus^-1(dt) with
    log dt ~ U(log 0.001, log 0.1). With unit-RMS inputs the decay exp(g) then averages ~0.8 a token: the state
    remembers tens of tokens, which is what a recurrence test needs.
    """
    if init == "ssm_a":
        return -rng.uniform(1.0, 16.0, n).reshape(1, n)
    if init == "ssm_dt":
        dt = np.exp(rng.uniform(np.log(0.001), np.log(0.1), n))
        return np.log(np.expm1(dt)).reshape(1, n)
    return None


def metadata(w, shape) -> None:
    """The hybrid keys make_moe's common metadata does not write."""
    s, h = shape, shape.hybrid
    arch = s.arch
    w.add_uint32(f"{arch}.ssm.conv_kernel", h.ssm_conv)
    w.add_uint32(f"{arch}.ssm.state_size", h.ssm_state)
    w.add_uint32(f"{arch}.ssm.group_count", h.ssm_k_heads)
    w.add_uint32(f"{arch}.ssm.time_step_rank", h.ssm_v_heads)
    w.add_uint32(f"{arch}.ssm.inner_size", h.ssm_v_heads * h.ssm_state)
    w.add_uint32(f"{arch}.full_attention_interval", h.full_attn_interval)
    if h.n_nextn:
        w.add_uint32(f"{arch}.nextn_predict_layers", h.n_nextn)
    if h.rope_sections:
        w.add_array(f"{arch}.rope.dimension_sections", list(h.rope_sections))


def adjust_vocab(vocab: list, h: Hybrid) -> list:
    """Pad the tokens to h.n_vocab with [PAD<i>] (the converter's padding) and set h.pre; the rest as it is."""
    out = []
    for key, value, types in vocab:
        if key == "tokenizer.ggml.pre" and h.pre:
            value = h.pre
        elif h.n_vocab and key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            if len(value) > h.n_vocab:
                raise SystemExit(f"make_moe: the vocabulary has {len(value)} tokens, more than the preset's "
                                 f"{h.n_vocab}; pass another --vocab")
            n = h.n_vocab - len(value)
            pad = [f"[PAD{i}]" for i in range(len(value), h.n_vocab)] if key.endswith("tokens") else [4] * n
            value = list(value) + pad     # token type 4: USER_DEFINED, as the converter marks padding
        out.append((key, value, types))
    if h.pre and not any(k == "tokenizer.ggml.pre" for k, _, _ in out):
        out.append(("tokenizer.ggml.pre", h.pre, [GGUFValueType.STRING]))
    return out
