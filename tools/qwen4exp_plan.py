"""make_moe's plan for qwen4exp (Qwen3.8-Flash-Next): every tensor and key of ../shared/qwen4exp.md, sections 1-2.

Per layer two hyper-connection modules (hc_attn_*, hc_ffn_*) instead of norms; GDN layers as qwen35moe's (attn_qkv,
attn_gate, ssm_beta/alpha, ssm_conv1d, ssm_dt.bias, ssm_a, ssm_norm, ssm_out), QSA layers ((i+1) % 4 == 0) with
attn_q twice as wide (query and gate per head), q/k norms and the indexer (indexer.{q,k}_proj, .{q,k}_norm); on
layer 1 the PLE projections; every layer the routed experts and the gated shared expert. Global: token_embd, the
final mixer output_hc_*, output, and last in the file the n-gram table per_layer_token_embd (so that a file whose
table is a sparse hole is the others' bytes plus a truncate, and the writer streams it in chunks).

The table has head_vocab_sizes: 16 primes >= base (20,000,000 in the published model). --ple-rows N picks the
largest base whose table fits N rows: every head's modulus changes, so every n-gram hashes to other rows (a random
model's table is no less random for it) and more n-grams share a row; each token still reads 16 rows and every
other tensor is the same. What a smaller table changes for a run: the disk it takes, and (with fewer distinct
rows) the row cache's hit rate. The multipliers depend only on the vocabulary size, so they stay the published ones.

Published packs (unsloth/Qwen3.8-Flash-Next-GGUF; their per-tensor types are not listed anywhere we can read, so
they are inferred from the file sizes, docs/experiments.md "Qwen3.8-Flash-Next's packs"): PACKS below.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGUFValueType as VT

from engine.arch.qwen4exp import head_offsets, head_vocab_sizes, layer_multipliers, table_rows
from engine.quant_types import QT as Q

ARCH = "qwen4exp"
PUBLISHED_NGRAM_BASE = 20_000_000


@dataclass(frozen=True)
class Qwen4ExpShape:
    """What a qwen4exp file has beyond make_moe.Shape."""
    hc_rank: int                  # R
    ssm_state: int
    ssm_k_heads: int
    ssm_v_heads: int
    n_rot: int
    indexer_heads: int
    indexer_dim: int
    qsa_budget: int               # tokens
    ple_eos: int
    ple_rows: int | None = None   # None: the published base, 20,000,000
    ple_image: int = -1           # -1: no ple.image_token_id key
    hc_count: int = 4
    ssm_conv: int = 4
    compress_ratio: int = 4
    full_attn_interval: int = 4
    rope_sections: tuple = (11, 11, 10, 0)
    ple_layer: int = 1
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ple_conv: int = 4
    n_vocab: int = 0              # pad the vocabulary to this size (0: as it is)
    pre: str | None = None        # tokenizer.ggml.pre to write instead of the vocabulary's

    @property
    def n_ple_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram


def quant_type(name: str):
    """The engine's quant type of that name (engine/quant_types.py: gguf's, and Q2_0 which gguf lacks)."""
    return Q[name]


def ple_heads(q4: Qwen4ExpShape) -> tuple[int, ...]:
    """head_vocab_sizes: the published base's primes, or with ple_rows the largest base whose table fits."""
    n = q4.n_ple_heads
    if q4.ple_rows is None:
        return head_vocab_sizes(PUBLISHED_NGRAM_BASE, n)
    lo, hi = 2, max(2, q4.ple_rows // n)
    if table_rows(head_vocab_sizes(lo, n)) > q4.ple_rows:
        raise SystemExit(f"make_moe: --ple-rows {q4.ple_rows} is too small for {n} hash heads; "
                         f"give at least {table_rows(head_vocab_sizes(2, n))}")
    while lo < hi:      # table_rows grows with base
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if table_rows(head_vocab_sizes(mid, n)) <= q4.ple_rows else (lo, mid - 1)
    return head_vocab_sizes(lo, n)


def is_recurrent(q4: Qwen4ExpShape, il: int) -> bool:
    return (il + 1) % q4.full_attn_interval != 0


# --- tensors ----------------------------------------------------------------------------------------------------

_FLOAT = (Q.F32, Q.F16, Q.BF16)


def plan(shape, types: dict, n_vocab: int, spec_cls) -> list:
    """Every tensor in file order as spec_cls (make_moe's TensorSpec).

    types: make_moe's per-class types (experts, shexp, attn, embd, output, norm) plus hc and ple (the table); a
    pack may add experts_down / shexp_down (rows of n_ff: another block), router, keep (ssm_alpha/beta, the PLE
    projections). Without those: down as the rest; routers F32; keep, the indexer and ple_conv1d in --attn's type
    if that is a float type, else BF16 (llama-quantize never quantises the indexer; ple_conv1d's rows of 4 fit no
    quant block)."""
    s, q4 = shape, shape.q4exp
    N, H, R = s.n_embd, q4.hc_count, q4.hc_rank
    D, P = N * H, N
    attn_float = types["attn"] if types["attn"] in _FLOAT else Q.BF16
    keep = types.get("keep", attn_float)
    t_of = {"router": types.get("router", Q.F32), "keep": keep, "indexer": attn_float, "conv": attn_float,
            "experts_down": types.get("experts_down", types["experts"]),
            "shexp_down": types.get("shexp_down", types["shexp"])}
    specs = [spec_cls("token_embd.weight", (n_vocab, N), types["embd"], "embd", "head")]

    def add(name, shp, group, init, qtype, layer=-1):
        specs.append(spec_cls(name, shp, qtype, group, init, layer))

    def hc(prefix, inject, layer=-1):
        add(f"{prefix}_norm.weight", (D,), "norm", "norm", types["norm"], layer)
        add(f"{prefix}_down.weight", (R, D), "hc", "matrix", types["hc"], layer)
        add(f"{prefix}_up.weight", (D, R), "hc", "matrix", types["hc"], layer)
        if inject:
            add(f"{prefix}_inject.weight", (H, D), "hc", "matrix", types["hc"], layer)

    hc("output_hc", False)
    if not s.tied:
        add("output.weight", (n_vocab, N), "output", "head", types["output"])
    for il in range(s.n_layer):
        b = f"blk.{il}."

        def lay(suffix, shp, group, init, qtype):
            add(b + suffix, shp, group, init, qtype, il)

        hc(b + "hc_attn", True, il)
        hc(b + "hc_ffn", True, il)
        if il == q4.ple_layer:
            lay("ple_key.weight", (D, P), "attn", "matrix", keep)
            lay("ple_value.weight", (N, P), "attn", "matrix", keep)
            for n in ("key", "query", "conv"):
                lay(f"ple_norm_{n}.weight", (D,), "norm", "norm", types["norm"])
            lay("ple_conv1d.weight", (D, q4.ple_conv), "attn", "matrix", t_of["conv"])
        if is_recurrent(q4, il):
            Hv, S = q4.ssm_v_heads, q4.ssm_state
            inner, conv = q4.ssm_v_heads * q4.ssm_state, 2 * q4.ssm_k_heads * q4.ssm_state + Hv * S
            lay("attn_qkv.weight", (conv, N), "ssm", "matrix", types["attn"])
            lay("attn_gate.weight", (inner, N), "ssm", "matrix", types["attn"])
            lay("ssm_beta.weight", (Hv, N), "ssm", "matrix", keep)
            lay("ssm_alpha.weight", (Hv, N), "ssm", "matrix", keep)
            lay("ssm_conv1d.weight", (conv, q4.ssm_conv), "ssm", "matrix", Q.F32)
            lay("ssm_dt.bias", (Hv,), "ssm", "ssm_dt", Q.F32)
            lay("ssm_a", (Hv,), "ssm", "ssm_a", Q.F32)
            lay("ssm_norm.weight", (S,), "norm", "norm", types["norm"])
            lay("ssm_out.weight", (N, inner), "ssm", "matrix", types["attn"])
        else:
            Hq, Hkv, hd, Hi, di = s.n_head, s.n_head_kv, s.head_dim, q4.indexer_heads, q4.indexer_dim
            lay("attn_q.weight", (2 * Hq * hd, N), "attn", "matrix", types["attn"])
            lay("attn_k.weight", (Hkv * hd, N), "attn", "matrix", types["attn"])
            lay("attn_v.weight", (Hkv * hd, N), "attn", "matrix", types["attn"])
            lay("attn_output.weight", (N, Hq * hd), "attn", "matrix", types["attn"])
            lay("attn_q_norm.weight", (hd,), "norm", "norm", types["norm"])
            lay("attn_k_norm.weight", (hd,), "norm", "norm", types["norm"])
            lay("indexer.q_proj.weight", (Hi * di, N), "attn", "matrix", t_of["indexer"])
            lay("indexer.k_proj.weight", (di, N), "attn", "matrix", t_of["indexer"])
            lay("indexer.q_norm.weight", (di,), "norm", "norm", types["norm"])
            lay("indexer.k_norm.weight", (di,), "norm", "norm", types["norm"])
        lay("ffn_gate_inp.weight", (s.n_expert, N), "router", "router", t_of["router"])
        lay("ffn_gate_exps.weight", (s.n_expert, s.n_ff_exp, N), "experts", "matrix", types["experts"])
        lay("ffn_up_exps.weight", (s.n_expert, s.n_ff_exp, N), "experts", "matrix", types["experts"])
        lay("ffn_down_exps.weight", (s.n_expert, N, s.n_ff_exp), "experts", "matrix", t_of["experts_down"])
        lay("ffn_gate_inp_shexp.weight", (N,), "router", "shexp_gate", t_of["router"])
        lay("ffn_gate_shexp.weight", (s.n_ff_shexp, N), "shexp", "matrix", types["shexp"])
        lay("ffn_up_shexp.weight", (s.n_ff_shexp, N), "shexp", "matrix", types["shexp"])
        lay("ffn_down_shexp.weight", (N, s.n_ff_shexp), "shexp", "matrix", t_of["shexp_down"])
    rows = table_rows(ple_heads(q4))
    add("per_layer_token_embd.weight", (rows, P // q4.n_ple_heads), "ple", "ple_rows", types["ple"])
    return specs


# --- keys -------------------------------------------------------------------------------------------------------

def metadata(w, shape, n_vocab: int) -> None:
    """The qwen4exp keys make_moe's common metadata does not write (spec 1.1)."""
    s, q4 = shape, shape.q4exp
    a = ARCH + "."

    def arr(key, values, vtype):
        w.add_key_value(a + key, list(values), VT.ARRAY, sub_type=vtype)

    for key, v in (("ssm.conv_kernel", q4.ssm_conv), ("ssm.state_size", q4.ssm_state),
                   ("ssm.group_count", q4.ssm_k_heads), ("ssm.time_step_rank", q4.ssm_v_heads),
                   ("ssm.inner_size", q4.ssm_v_heads * q4.ssm_state),
                   ("full_attention_interval", q4.full_attn_interval), ("hyper_connection.count", q4.hc_count),
                   ("hyper_connection.low_rank", q4.hc_rank), ("attention.indexer.head_count", q4.indexer_heads),
                   ("attention.indexer.key_length", q4.indexer_dim), ("attention.indexer.top_k", q4.qsa_budget),
                   ("ple.ngram_size", q4.ngram_size), ("ple.heads_per_ngram", q4.heads_per_ngram),
                   ("ple.conv_kernel", q4.ple_conv), ("ple.eos_token_id", q4.ple_eos),
                   ("embedding_length_per_layer_input", s.n_embd // q4.n_ple_heads)):
        w.add_uint32(a + key, v)
    if q4.ple_image >= 0:
        w.add_uint32(a + "ple.image_token_id", q4.ple_image)
    rec = [is_recurrent(q4, il) for il in range(s.n_layer)]
    arr("attention.recurrent_layers", rec, VT.BOOL)
    arr("attention.compress_ratios", [0 if r else q4.compress_ratio for r in rec], VT.UINT32)
    arr("rope.dimension_sections", q4.rope_sections, VT.INT32)
    arr("ple.layers", [q4.ple_layer], VT.UINT32)
    sizes = ple_heads(q4)
    arr("ple.layer_multipliers", layer_multipliers(n_vocab, q4.ngram_size), VT.UINT64)
    arr("ple.head_offsets", head_offsets(sizes), VT.UINT64)
    arr("ple.head_vocab_sizes", sizes, VT.UINT64)


# --- the published packs ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pack:
    published_gb: float
    types: dict            # plan class -> type name (BF16 where a class is not named)


# Inferred from the sizes (docs/experiments.md, "Qwen3.8-Flash-Next's packs"). The expert weights (121B) and the
# table (51B) are 96% of the parameters, and their rows decide the types: ffn_down's rows of 640 take no 256-wide
# block (llama-quantize falls back from IQ2_XS/IQ3_* to IQ4_NL, which no pack's size leaves room for), so the IQ
# packs' down experts are Q2_0 (blocks of 64) and UD-Q4_K_XL's Q5_0 (llama-quantize's Q4_K fallback); the table's
# rows of 160 take only 32-wide blocks, Q4_0 (4.5 bpw) or Q5_0 in UD-Q4_K_XL. HC, ssm_alpha/beta, the indexer, the
# router, the shared-expert gate and the PLE projections are BF16 as the prior engine's packs kept them (HC's
# rows of 320 take no K-quant either); what remains (4.2B parameters) is what the packs' sizes leave room for.
_Q = {"hc": "BF16", "keep": "BF16", "router": "BF16", "ple": "Q4_0"}
PACKS = {
    "q2_0": Pack(66.4, _Q | {"experts": "Q2_0", "experts_down": "Q2_0", "shexp": "Q4_K", "shexp_down": "Q5_0",
                             "attn": "Q4_K", "embd": "Q4_K", "output": "Q6_K"}),
    "iq2_xs": Pack(68.0, _Q | {"experts": "IQ2_XS", "experts_down": "Q2_0", "shexp": "Q6_K", "shexp_down": "Q8_0",
                               "attn": "Q6_K", "embd": "Q4_K", "output": "Q6_K"}),
    "iq3_xxs": Pack(75.8, _Q | {"experts": "IQ3_XXS", "experts_down": "Q2_0", "shexp": "Q6_K", "shexp_down": "Q8_0",
                                "attn": "Q6_K", "embd": "Q4_K", "output": "Q6_K"}),
    "iq3_s": Pack(83.6, _Q | {"experts": "IQ3_S", "experts_down": "Q2_0", "shexp": "BF16", "attn": "BF16",
                              "embd": "Q8_0", "output": "Q8_0"}),
    "ud-q4_k_xl": Pack(111.3, _Q | {"experts": "Q4_K", "experts_down": "Q5_0", "shexp": "Q4_K", "shexp_down": "Q5_0",
                                    "attn": "Q4_K", "embd": "Q4_K", "output": "Q6_K", "ple": "Q5_0"}),
}
DEFAULT_PACK = "q2_0"       # the pack the original Strata ran
PACK_ONLY = ("experts_down", "shexp_down", "router", "keep")     # plan classes make_moe has no flag for


def pack_types(name: str) -> dict:
    """{plan class: type} of a published pack, BF16 for each class it does not name."""
    types = {c: Q.BF16 for c in ("experts", "shexp", "attn", "embd", "output", "hc", "ple")}
    types.update({c: quant_type(t) for c, t in PACKS[name].types.items()})
    return types
