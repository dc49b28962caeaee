"""llama-quantize's recipes: which quant type each tensor gets in a Q4_K_M (Q5_K_M, Q3_K_M, ...) file.

A port, in our words, of llama.cpp 0c1e570's src/llama-quant.cpp (llama_tensor_get_type and its helpers) for the
recipes users download and the tensors our architectures have. tests/test_recipes.py checks it tensor by tensor
against llama_model_quantize on small models. The rules that make files non-uniform:
- "more bits" layers: the first and last eighth of the layers and every third one between (use_more_bits).
- ffn_down (routed and shared experts alike, by layer index): Q4_K_M -> Q6_K on more-bits layers; Q5_K_M the same;
  Q3_K_M -> Q5_K in the first 16th, else Q4_K; Q2_K -> Q3_K; Q4_K_S and IQ4_XS (no imatrix) -> Q5_K in the first
  eighth; IQ3_XXS without an imatrix -> Q4_K / Q3_K; the IQ2 family -> Q2_K for the first eighth of the
  ffn_down tensors counted in llama.cpp's order (two a layer where a shared expert has one too).
- attn_v is counted the same way (i-th attn_v of n), and output.weight / tied token_embd get Q6_K (Q5_K for IQ2/3).
- with 8 experts (Mixtral-like), attn_v and attn_k become Q8_0 and attn_output Q5_K in the low-bit recipes.
- Q2_0 and Q1_0 put every other weight in their type, except an untied token_embd in Q2_0 (Q4_K there).
llama.cpp walks tensors by layer number, then name (llama_model_loader's weight_name_comparer); counters follow it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import gguf

from engine.quant_types import QT as Q, SIZES as GGML_QUANT_SIZES

# recipe -> (llama.cpp's LlamaFileType name, the default type of a quantized tensor)
RECIPES: dict[str, tuple[str, Q]] = {
    "q8_0": ("MOSTLY_Q8_0", Q.Q8_0), "q6_k": ("MOSTLY_Q6_K", Q.Q6_K), "q5_k_m": ("MOSTLY_Q5_K_M", Q.Q5_K),
    "q4_k_m": ("MOSTLY_Q4_K_M", Q.Q4_K), "q4_k_s": ("MOSTLY_Q4_K_S", Q.Q4_K), "q3_k_m": ("MOSTLY_Q3_K_M", Q.Q3_K),
    "q2_k": ("MOSTLY_Q2_K", Q.Q2_K), "iq4_xs": ("MOSTLY_IQ4_XS", Q.IQ4_XS), "iq3_xxs": ("MOSTLY_IQ3_XXS", Q.IQ3_XXS),
    "iq2_xxs": ("MOSTLY_IQ2_XXS", Q.IQ2_XXS), "q2_0": ("MOSTLY_Q2_0", Q.Q2_0), "q1_0": ("MOSTLY_Q1_0", Q.Q1_0),
}
# llama.h's file types that gguf 0.19's LlamaFileType lacks. NVFP4 (39) has one but no recipe: llama-quantize
# refuses it ("invalid output file type 39": llama_ftype_get_default_type has no case for it); NVFP4 tensors come
# from --tensor-type overrides or converters only.
_FTYPES = {"MOSTLY_Q2_0": 41}


def ftype_id(name: str) -> int:
    """llama.h's LLAMA_FTYPE_<name> (general.file_type), e.g. "MOSTLY_Q4_K_M" -> 15, "MOSTLY_Q2_0" -> 41."""
    return _FTYPES[name] if name in _FTYPES else int(gguf.LlamaFileType[name])
_LOW_IQ2 = ("iq2_xxs",)   # llama.cpp's IQ2_XXS / IQ2_XS / IQ2_S / IQ2_M / IQ1 branch; we port the recipe we offer
# Where a type's block does not divide a row, llama.cpp falls back to one that does (tensor_type_fallback); it
# has none for Q1_0 (block 128) and stops there.
_FALLBACK = {Q.IQ2_XXS: Q.IQ4_NL, Q.IQ2_XS: Q.IQ4_NL, Q.IQ2_S: Q.IQ4_NL, Q.IQ3_XXS: Q.IQ4_NL, Q.IQ3_S: Q.IQ4_NL,
             Q.IQ4_XS: Q.IQ4_NL, Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0,
             Q.Q2_0: Q.Q4_0}


@dataclass(frozen=True)
class Hparams:
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int             # 0 for dense

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 1


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, and every third layer in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quantizable(name: str, n_dims: int) -> bool:
    """What llama-quantize quantizes at all: 2-D and 3-D weights, except norms, expert routers, the hybrids'
    short conv1d kernels (ssm_conv1d) and qwen4exp's QSA indexer projections."""
    return (n_dims >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name and "ssm_conv1d" not in name and ".indexer." not in name)


def category(name: str) -> str:
    # the first match wins, in llama.cpp's order (so ffn_gate_inp_shexp counts as ffn_gate)
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for key in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight", "attn_k.weight", "attn_q.weight",
                "attn_output.weight", "ffn_up", "ffn_gate", "ffn_down"):
        if key in name:
            return key.split(".")[0]
    return "other"


def _layer(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def llama_order(names) -> list[str]:
    """llama.cpp's walk: by layer number (non-layer tensors first), then by name."""
    return sorted(names, key=lambda n: (_layer(n), n))


def recipe_types(tensors: dict[str, tuple[tuple[int, ...], Q]], recipe: str, hp: Hparams,
                 has_imatrix: bool = False) -> dict[str, Q]:
    """{name: type} that llama-quantize RECIPE writes, given {name: (numpy shape, source type)}."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; one of {', '.join(RECIPES)}")
    default = RECIPES[recipe][1]
    tied = "output.weight" not in tensors
    n_attn_v = sum(category(n) in ("attn_v", "attn_qkv", "attn_kv_b") for n in tensors)
    count = {"attn_v": 0, "ffn_down": 0}
    out = {}
    for name in llama_order(tensors):
        shape, src = tensors[name]
        # a ggml tensor's dimension count ignores trailing unit dims: shape (1, n) is 1-D to llama.cpp
        n_dims = len(shape)
        while n_dims > 1 and shape[len(shape) - n_dims] == 1:
            n_dims -= 1
        if not quantizable(name, n_dims):
            out[name] = src
            continue
        t = _choose(name, shape, default, recipe, hp, tied, has_imatrix, count, n_attn_v)
        block = GGML_QUANT_SIZES[t][0]
        if shape[-1] % block:
            if t == Q.Q1_0:
                raise ValueError(f"llama-quantize cannot make {name} Q1_0: its rows of {shape[-1]} values are not "
                                 f"whole blocks of 128, and it has no fallback type for Q1_0")
            t = _FALLBACK.get(t, t)
            if shape[-1] % GGML_QUANT_SIZES[t][0]:
                t = Q.F16
        out[name] = t
    return out


def _choose(name, shape, t, recipe, hp, tied, has_imatrix, count, n_attn_v) -> Q:
    cat = category(name)
    L, n_exp = _layer(name), hp.n_expert
    if cat in ("output",) or (tied and cat == "token_embd"):
        if shape[-1] % GGML_QUANT_SIZES[t][0]:
            return Q.Q8_0
        if recipe in ("iq2_xxs", "iq3_xxs"):
            return Q.Q5_K
        return t if t == Q.Q8_0 else Q.Q6_K
    if cat == "token_embd":
        return {"iq2_xxs": Q.Q2_K, "iq3_xxs": Q.IQ3_S, "q2_0": Q.Q4_K}.get(recipe, t)
    if recipe in _LOW_IQ2:
        if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            count["attn_v"] += 1
            return Q.Q4_K if hp.n_gqa >= 4 or n_exp >= 4 else Q.Q2_K
        if n_exp == 8 and cat == "attn_k":
            return Q.Q4_K
        if cat == "ffn_down":
            i = count["ffn_down"]
            count["ffn_down"] += 1
            return Q.Q2_K if i < hp.n_layer // 8 else t
        if cat == "attn_output":
            return Q.Q5_K if n_exp == 8 else t
        return t
    if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
        i = count["attn_v"]
        count["attn_v"] += 1
        if recipe == "q2_k":
            t = Q.Q4_K if hp.n_gqa >= 4 else Q.Q3_K
        elif recipe == "iq3_xxs":
            t = Q.Q4_K if hp.n_gqa >= 4 else (Q.IQ3_XXS if has_imatrix else Q.IQ3_S)
        elif recipe == "q3_k_m":
            t = Q.Q5_K if i < 2 else Q.Q4_K
        elif recipe == "iq4_xs" and hp.n_gqa >= 4:
            t = Q.Q5_K
        elif recipe in ("q4_k_m", "q5_k_m") and more_bits(i, n_attn_v):
            t = Q.Q6_K
        elif recipe == "q4_k_s" and i < 4:
            t = Q.Q5_K
        # (llama.cpp also lifts Q3_K/Q4_K to Q5_K on 70B-class dense models: not a shape we make)
        if n_exp == 8:
            t = Q.Q8_0
        return t
    if cat == "attn_k":
        if n_exp == 8:
            return Q.Q8_0
        return Q.IQ2_S if recipe == "iq3_xxs" else t
    if cat == "attn_q":
        return Q.IQ2_S if recipe == "iq3_xxs" else t
    if cat == "ffn_down":
        # with experts llama.cpp reads the layer from the name; dense models count ffn_down tensors in walk order
        i, n = (L, hp.n_layer) if n_exp > 1 else (count["ffn_down"], hp.n_layer)
        count["ffn_down"] += 1
        if recipe == "q2_k":
            return Q.Q3_K
        if recipe == "iq3_xxs" and not has_imatrix:
            return Q.Q4_K if i < n // 8 else Q.Q3_K
        if recipe == "q3_k_m":
            return Q.Q5_K if i < n // 16 else Q.Q4_K
        if recipe == "q4_k_m":
            return Q.Q6_K if more_bits(i, n) else t
        if recipe == "iq4_xs" and i < n // 8 and not has_imatrix:
            return Q.Q5_K
        if recipe == "q5_k_m":
            return Q.Q6_K if more_bits(i, n) else t
        if recipe == "q4_k_s" and i < n // 8:
            return Q.Q5_K
        return t
    if cat == "attn_output":
        if n_exp == 8:
            return Q.Q5_K if recipe in ("q2_k", "iq3_xxs", "q3_k_m", "q4_k_s", "q4_k_m", "iq4_xs") else t
        return {"q2_k": Q.Q3_K, "iq3_xxs": Q.IQ3_S, "q3_k_m": Q.Q4_K}.get(recipe, t)
    # (llama.cpp has an attn_qkv branch after this one, but attn_qkv counts as attn_v above, so it never runs)
    return t


# llama-quantize refuses these without an importance matrix (IQ3_XXS / IQ2_* tensors require one), so every such
# file a user has was made with one, which changes some choices (IQ3_XXS's attn_v and ffn_down)
IMATRIX_RECIPES = ("iq2_xxs", "iq3_xxs")


def apply_recipe(specs: list, recipe: str, hp: Hparams) -> list:
    """make_moe's TensorSpecs with each tensor's type as llama-quantize RECIPE writes it (with an imatrix where
    the recipe needs one, as the files users download were made)."""
    types = recipe_types({s.name: (s.shape, s.qtype) for s in specs}, recipe, hp,
                         has_imatrix=recipe in IMATRIX_RECIPES)
    return [replace(s, qtype=types[s.name]) for s in specs]
