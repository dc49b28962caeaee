"""A two-layer gpt-oss GGUF whose greedy answers follow a script, to test the harmony chat format end to end.

A random-weight model writes no harmony, so this one is built by hand, and it runs through the same engine code as
any gpt-oss file (window, sinks, RoPE with YaRN, biases, routing). Given conversations (prompt ids, the answer ids
wanted), it answers each with its script, one token at a time, by looking up a key of the context:
- the last three tokens: layer 0 (a window of 3) has two heads whose constant q and k (their biases) meet, through
  RoPE's fastest pair (one radian a position), at offset 1 and at offset 2, copying those tokens' codes;
- flags, "token X occurs in the context": layer 1 (full attention) has one head per flag whose key is large only
  on X; with a sink logit of 0 the head returns X's value where X occurs and exactly 0 where it does not. The flags
  are chosen (choose_flags) until no two steps with different next tokens share a key;
- layer 1's router has one expert per key (top 1, so its weight is 1): the row scores each matching component,
  the expert's down bias writes the next token's code, and the output head reads it.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tools import gptoss_plan
from tools import make_moe

N_EMBD, N_HEAD, N_KV, D_HEAD, N_FF, WINDOW = 512, 16, 2, 128, 4, 3
MAX_FLAGS = N_HEAD - N_HEAD // N_KV          # heads 8..15 read KV head 1, the flag heads
PREV_AMP, FLAG_QK, ROUTER_AMP, OUT_AMP = 300.0, 20.0, 4.0, 10.0


def steps_of(convs):
    """(context tuple, next id) for every answer token of every conversation."""
    out = []
    for prompt, answer in convs:
        ctx = list(prompt)
        for tok in answer:
            out.append((tuple(ctx), int(tok)))
            ctx.append(int(tok))
    return out


def key_of(ctx, flags):
    seen = set(ctx)
    return (ctx[-1], ctx[-2], ctx[-3]) + tuple(f in seen for f in flags)


def choose_flags(steps) -> tuple[list[int], dict]:
    """Flag tokens until every key leads to one next token: each time the token that splits the most clashes."""
    flags: list[int] = []
    while True:
        table, clashes = {}, []
        for ctx, nxt in steps:
            k = key_of(ctx, flags)
            if k in table and table[k][1] != nxt:
                clashes.append((set(table[k][0]), set(ctx)))
            table.setdefault(k, (ctx, nxt))
        if not clashes:
            return flags, {k: nxt for k, (_, nxt) in table.items()}
        votes: dict[int, int] = {}
        for a, b in clashes:
            for t in a ^ b:
                votes[t] = votes.get(t, 0) + 1
        if not votes:
            raise ValueError("two steps with the same context want different tokens; the script is contradictory")
        flags.append(max(sorted(votes), key=votes.get))
        if len(flags) > MAX_FLAGS:
            raise ValueError(f"the script needs more than {MAX_FLAGS} flags")


def _slow_pair(f: int) -> tuple[int, int]:
    # RoPE's slowest pairs (neox: i and i + D/2) turn ~1e-6 rad a position after YaRN: a flag's score stays put
    i = D_HEAD // 2 - 1 - f
    return i, i + D_HEAD // 2


def build(path: Path, convs, seed_vocab: Path | None = None) -> dict:
    """Write the model to path; returns {"flags": [...], "keys": n} for the record."""
    steps = steps_of(convs)
    flags, table = choose_flags(steps)
    syms = sorted({t for k in table for t in k[:3]} | set(table.values()) | set(flags))
    code = {t: i for i, t in enumerate(syms)}
    nS, nF = len(syms), len(flags)
    A, B, C, F, Dd, G = 0, nS, 2 * nS, 3 * nS, 3 * nS + nF, 4 * nS + nF
    if G + 1 > N_EMBD or nS > D_HEAD:
        raise ValueError(f"{nS} distinct tokens do not fit hidden {N_EMBD} / head {D_HEAD}")
    shape = make_moe.PRESETS["gpt-oss-tiny"].shape
    vocab = gptoss_plan.harmony_vocab(shape, make_moe.read_vocab(seed_vocab or make_moe.VOCAB_DIR /
                                                                   gptoss_plan.BASE_VOCAB))
    n_vocab = len(next(v for k, v, _ in vocab if k == "tokenizer.ggml.tokens"))
    n_exp = len(table)

    emb = np.zeros((n_vocab, N_EMBD), np.float32)
    out = np.zeros((n_vocab, N_EMBD), np.float32)
    for t in range(n_vocab):
        if t in code:
            emb[t, A + code[t]] = 1.0
            out[t, Dd + code[t]] = 1.0
        else:
            emb[t, G] = 1.0
    hd, qd, kvd = D_HEAD, N_HEAD * D_HEAD, N_KV * D_HEAD
    layers = []
    for il in range(2):
        L = {"attn_q.weight": np.zeros((qd, N_EMBD)), "attn_k.weight": np.zeros((kvd, N_EMBD)),
             "attn_v.weight": np.zeros((kvd, N_EMBD)), "attn_q.bias": np.zeros(qd), "attn_k.bias": np.zeros(kvd),
             "attn_v.bias": np.zeros(kvd), "attn_output.weight": np.zeros((N_EMBD, qd)),
             "attn_output.bias": np.zeros(N_EMBD), "attn_sinks.weight": np.full(N_HEAD, -100.0),
             "ffn_gate_inp.weight": np.zeros((n_exp, N_EMBD)), "ffn_gate_inp.bias": np.zeros(n_exp),
             "ffn_gate_exps.weight": np.zeros((n_exp, N_FF, N_EMBD)), "ffn_gate_exps.bias": np.zeros((n_exp, N_FF)),
             "ffn_up_exps.weight": np.zeros((n_exp, N_FF, N_EMBD)), "ffn_up_exps.bias": np.zeros((n_exp, N_FF)),
             "ffn_down_exps.weight": np.zeros((n_exp, N_EMBD, N_FF)), "ffn_down_exps.bias": np.zeros((n_exp, N_EMBD)),
             "attn_norm.weight": np.ones(N_EMBD), "post_attention_norm.weight": np.ones(N_EMBD)}
        layers.append(L)

    # layer 0: heads 0 and 1 copy the codes of the tokens 1 and 2 back into B and C
    L = layers[0]
    unit = 1.0 / np.sqrt(N_EMBD)          # a one-hot row comes out of the RMSNorm as sqrt(N_EMBD)
    L["attn_k.bias"][0] = 1.0             # KV head 0, pair (0, D/2): k = (1, 0) everywhere
    for h, offset, dest in ((0, 1, B), (1, 2, C)):
        L["attn_q.bias"][h * hd] = PREV_AMP * np.cos(-offset)    # score ~ cos(phi + (t - s)), top at t - s = offset
        L["attn_q.bias"][h * hd + hd // 2] = PREV_AMP * np.sin(-offset)
        for t, c in code.items():
            L["attn_output.weight"][dest + c, h * hd + c] = 1.0
    for c in range(nS):
        L["attn_v.weight"][c, A + c] = unit
    # layer 1: flag heads N_HEAD - MAX_FLAGS + f (KV head 1); present: their value ~2 (+ bias -1), absent: -1
    L = layers[1]
    rms3 = np.sqrt(3.0 / N_EMBD)          # a context row past the start holds three unit codes (A, B, C)
    for f, tok in enumerate(flags):
        h = N_HEAD - MAX_FLAGS + f
        i, _ = _slow_pair(f)
        L["attn_q.bias"][h * hd + i] = FLAG_QK
        L["attn_k.weight"][hd + i, A + code[tok]] = 1.0
        L["attn_v.weight"][hd + f, A + code[tok]] = 2.0 * rms3
        L["attn_output.weight"][F + f, h * hd + f] = 1.0
        L["attn_output.bias"][F + f] = -1.0
        L["attn_sinks.weight"][h] = 0.0
    for e, (k, nxt) in enumerate(sorted(table.items(), key=lambda kv: str(kv[0]))):
        row = L["ffn_gate_inp.weight"][e]
        for base, t in zip((A, B, C), k[:3]):
            row[base + code[t]] = ROUTER_AMP
        for f, present in enumerate(k[3:]):
            row[F + f] = ROUTER_AMP if present else -ROUTER_AMP
        L["ffn_down_exps.bias"][e, Dd + code[nxt]] = OUT_AMP

    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_name("strata-harmony-script")
    w.add_block_count(2)
    w.add_context_length(4096)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_key_length(D_HEAD)
    w.add_value_length(D_HEAD)
    w.add_rope_dimension_count(D_HEAD)
    w.add_rope_freq_base(150000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(1)
    w.add_expert_feed_forward_length(N_FF)
    w.add_sliding_window(WINDOW)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, value, types in vocab:
        w.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)
    w.add_tensor("token_embd.weight", emb)
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, np.float32))
    w.add_tensor("output.weight", out)
    for il, L in enumerate(layers):
        for name, arr in L.items():
            w.add_tensor(f"blk.{il}.{name}", np.asarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"flags": flags, "keys": n_exp, "symbols": nS}
