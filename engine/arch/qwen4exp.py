"""qwen4exp (Qwen3.8-Flash-Next, HF qwen4_exp): the spec is ../shared/qwen4exp.md; section numbers below are its own.

The residual is H = 4 hyper-connection streams of N (D = 4N floats a token). Around every half-layer an HC read
(4.2) mixes the normalised streams into the block's input and an HC write (4.3) adds the block's output back to
each raw stream; there are no layer norms, and the final HC read (4.9) is the output norm. Layer i is Gated
DeltaNet (4.5: qwen35moe's, with a sigmoid output gate) or, where (i+1) % 4 == 0, QSA (4.6): gated attention that
reads, per query, the tokens of the top budget/r blocks of r = 4 cells by a learned indexer's score plus the
incomplete tail block, which is dense attention while no more than budget/r blocks are complete. Every layer ends
in 512 experts (top 10 of a softmax, renormalised) plus a sigmoid-gated shared expert (4.7). Layer 1 first adds a
per-layer n-gram embedding (PLE, 4.8): 16 rows hashed from the bigram and trigram ending at each token (exact
uint64 arithmetic; the context resets after EOS) from a table that is never loaded (engine/row_cache.py), then key
/ value projections, a gate per stream and a dilated causal conv with 9 vectors of history.

The math follows transformers' modeling_qwen4_exp where llama.cpp differs (spec section 5): QSA keeps exactly
budget/r whole blocks plus the tail; ties in block score go to the lower block. The MTP block is not run.
The cache (Qwen4ExpCache) holds per position the QSA layers' K/V and raw indexer keys (pooled block keys are derived
from them, so a rewind needs no copy of them), and as recurrent state, which checkpoints copy (engine/backend.py):
each GDN layer's conv window and delta matrices, the PLE conv history and the last ngram_size-1 token ids.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.arch.base import KVCache, Transformer, apply_rope, moe_ffn, rms_norm, route, silu, swiglu
from engine.arch.qwen3next import gated_delta_net, sigmoid
from engine.model_config import ModelConfig, ModelError
from engine.row_cache import RowCache

ARCHS = ("qwen4exp",)
EXPERTS = True
FUSED_QKV = False       # attn_qkv is a GDN layer's mixing projection (spec 2.3), never attention's q, k and v
PLE_TABLE = "per_layer_token_embd.weight"
# Bytes of raw n-gram rows kept in RAM (16 a token; 320 B each in BF16): a chat's repeated n-grams hit here.
PLE_CACHE_BYTES = 64 << 20

# --- the hash constants (4.8), as transformers derives them ------------------------------------------------------

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
SEED, LAYER_PRIME = 1234, 10007


def splitmix64(v: int) -> int:
    v = (v + GAMMA) & MASK64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & MASK64
    return v ^ (v >> 31)


def layer_multipliers(n_vocab: int, ngram_size: int, ple_index: int = 0, seed: int = SEED) -> tuple[int, ...]:
    """4.8 "Multipliers": odd, and small enough that m * token < 2^63 for every token of an n_vocab vocabulary."""
    half = max(1, ((1 << 63) - 1) // max(n_vocab, 1) // 2)
    base = seed + LAYER_PRIME * ple_index
    return tuple(2 * (splitmix64((base + GAMMA * (i + 1)) & MASK64) % half) + 1 for i in range(ngram_size))


def is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_vocab_sizes(base: int, n_heads: int, ple_index: int = 0) -> tuple[int, ...]:
    """4.8 "Head vocab sizes": head h (global index n_heads * ple_index + h) gets the (global+1)-th prime >= base."""
    primes, p = [], base - 1
    while len(primes) < n_heads * (ple_index + 1):
        p += 1
        while not is_prime(p):
            p += 1
        primes.append(p)
    return tuple(primes[-n_heads:])


def head_offsets(sizes) -> tuple[int, ...]:
    return tuple(int(x) for x in np.cumsum([0, *sizes[:-1]]))


def table_rows(sizes, divisor: int = 128) -> int:
    """Rows the table stores: the heads' sizes summed, padded to a multiple of divisor."""
    return -(-sum(sizes) // divisor) * divisor


# --- configuration and tensors ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Qwen4ExpParams:
    """What qwen4exp has beyond ModelConfig's generic fields (ModelConfig.family_params)."""
    hc_count: int               # H: residual streams
    hc_rank: int                # R: low rank of the HC read
    indexer_heads: int
    indexer_dim: int
    qsa_budget: int             # tokens (attention.indexer.top_k); budget // r whole blocks
    compress_ratios: tuple      # per layer: r on QSA layers, 0 on GDN layers
    ple_layers: tuple           # 0-based; exactly one
    ngram_size: int
    heads_per_ngram: int
    ple_conv: int               # taps of the PLE conv; its dilation is ngram_size (transformers' conv_dilation)
    ple_eos: int
    ple_image: int              # -1: absent
    ple_width: int              # one table row (embedding_length_per_layer_input)
    multipliers: tuple          # Python ints, read exactly from the u64 arrays
    head_offsets: tuple
    head_sizes: tuple

    @property
    def n_ple_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram


def _ints(md: dict, key: str, name: str, n: int | None = None) -> tuple[int, ...]:
    v = md.get(key)
    if v is None:
        raise ModelError(f"{name} lacks the metadata key {key}; the file is incomplete")
    v = v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ModelError(f"{name}: {key} holds {type(v[0]).__name__} values, not integers (a float array loses the "
                         f"hash constants' low bits); convert the model again")
    if n is not None and len(v) != n:
        raise ModelError(f"{name}: {key} has {len(v)} entries, not {n}; the file is damaged")
    return tuple(int(x) for x in v)


def configure(cfg: ModelConfig, get, model) -> None:
    """The registry's config step (engine/arch/__init__.py): qwen4exp reads its keys itself (u64 and bool arrays
    that `get` would fold)."""
    read_config(cfg, model.metadata, model)


def read_config(cfg: ModelConfig, md: dict, model) -> None:
    """Fill cfg's generic fields as qwen4exp means them and attach Qwen4ExpParams (spec section 1.1)."""
    name, a = model.path.name, "qwen4exp."

    def one(key, default=None):
        v = md.get(a + key, default)
        if v is None:
            raise ModelError(f"{name} lacks the metadata key {a}{key}; the file is incomplete")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ModelError(f"{name}: {a}{key}={v!r} is not a count; the file is damaged")
        return int(v)

    for field, key in (("ssm_conv", "ssm.conv_kernel"), ("ssm_inner", "ssm.inner_size"),
                       ("ssm_state", "ssm.state_size"), ("ssm_v_heads", "ssm.time_step_rank"),
                       ("ssm_k_heads", "ssm.group_count")):
        setattr(cfg, field, one(key))
    if not cfg.ssm_k_heads or cfg.ssm_v_heads % cfg.ssm_k_heads or cfg.ssm_inner != cfg.ssm_v_heads * cfg.ssm_state:
        raise ModelError(f"{name}: {cfg.ssm_v_heads} GDN value heads of {cfg.ssm_state} do not fit ssm.inner_size="
                         f"{cfg.ssm_inner} and {cfg.ssm_k_heads} key heads; the file is damaged")
    n = cfg.n_layer
    flags = md.get(a + "attention.recurrent_layers")
    if flags is not None:
        if not isinstance(flags, list) or len(flags) != n:
            raise ModelError(f"{name}: {a}attention.recurrent_layers has {len(flags) if isinstance(flags, list) else 1}"
                             f" entries for {n} layers; the file is damaged")
        cfg.recurrent_layers = tuple(bool(f) for f in flags)
    else:   # layer i is GDN iff (i+1) mod k != 0
        every = one("full_attention_interval", 4)
        cfg.recurrent_layers = tuple(every == 0 or (i + 1) % every != 0 for i in range(n))
    sections = md.get(a + "rope.dimension_sections")
    if not isinstance(sections, list) or len(sections) != 4:
        raise ModelError(f"{name} needs {a}rope.dimension_sections (4 IMRoPE sections); the file is incomplete")
    cfg.rope_sections = tuple(int(s) for s in sections)
    # fixed by the architecture, whatever keys a file holds: softmax routing renormalised, no scale, QK 1/sqrt(d)
    cfg.expert_weights_norm, cfg.expert_weights_scale, cfg.attn_scale, cfg.qk_norm = True, 1.0, 0.0, True
    ratios = _ints(md, a + "attention.compress_ratios", name, n)
    ple_layers = _ints(md, a + "ple.layers", name)
    ngram = one("ple.ngram_size")
    per = one("ple.heads_per_ngram")
    p = Qwen4ExpParams(
        hc_count=one("hyper_connection.count"), hc_rank=one("hyper_connection.low_rank"),
        indexer_heads=one("attention.indexer.head_count"), indexer_dim=one("attention.indexer.key_length"),
        qsa_budget=one("attention.indexer.top_k"), compress_ratios=ratios, ple_layers=ple_layers,
        ngram_size=ngram, heads_per_ngram=per, ple_conv=one("ple.conv_kernel"), ple_eos=one("ple.eos_token_id"),
        ple_image=int(md.get(a + "ple.image_token_id", -1)), ple_width=one("embedding_length_per_layer_input"),
        multipliers=_ints(md, a + "ple.layer_multipliers", name, ngram),
        head_offsets=_ints(md, a + "ple.head_offsets", name, (ngram - 1) * per),
        head_sizes=_ints(md, a + "ple.head_vocab_sizes", name, (ngram - 1) * per))
    _check_params(cfg, p, name)
    cfg.family_params = p


def _check_params(cfg: ModelConfig, p: Qwen4ExpParams, name: str) -> None:
    def bad(what):
        raise ModelError(f"{name}: {what}; the file is damaged or made for another program")

    if p.hc_count < 2 or not p.hc_rank:
        bad(f"hyper_connection.count={p.hc_count} (must be > 1) with low_rank {p.hc_rank}")
    if not cfg.n_expert or not cfg.n_ff_shexp:
        bad("qwen4exp needs expert_count and expert_shared_feed_forward_length")
    if cfg.head_dim != cfg.head_dim_v:
        bad(f"QSA key and value heads differ ({cfg.head_dim} and {cfg.head_dim_v})")
    if all(cfg.recurrent_layers):
        bad("no layer is a QSA layer")
    for il, (rec, r) in enumerate(zip(cfg.recurrent_layers, p.compress_ratios)):
        if not rec and r == 0:
            # convert_hf_to_gguf under transformers 5.x (which renames the checkpoint's layer types) writes 0 on
            # every QSA layer; llama.cpp then attends densely, which is not the model's attention
            raise ModelError(f"{name}: QSA layer {il} has attention.compress_ratios 0 (no indexer blocks): the "
                             f"converter ran under a transformers that renames the layer types; convert again with "
                             f"convert_hf_to_gguf's own pinned transformers (4.57)")
        if not rec and (r < 0 or not p.qsa_budget or p.qsa_budget % r):
            bad(f"QSA layer {il} has compress ratio {r} for a budget of {p.qsa_budget} tokens (a multiple of it)")
    if not p.indexer_heads or not cfg.n_rot <= p.indexer_dim:
        bad(f"{p.indexer_heads} indexer heads of {p.indexer_dim} for {cfg.n_rot} rotary dimensions")
    if len(p.ple_layers) != 1 or not 0 <= p.ple_layers[0] < cfg.n_layer or not cfg.recurrent_layers[p.ple_layers[0]]:
        bad(f"ple.layers={list(p.ple_layers)}: exactly one GDN layer is supported (llama.cpp's rule)")
    if p.ngram_size < 2 or not p.heads_per_ngram or not p.ple_conv or not 0 <= p.ple_eos < cfg.n_vocab:
        bad(f"PLE n-gram size {p.ngram_size}, {p.heads_per_ngram} heads per n-gram, conv {p.ple_conv}, "
            f"EOS {p.ple_eos} of {cfg.n_vocab} tokens")
    if any(m % 2 == 0 or m * (cfg.n_vocab - 1) >= 1 << 63 for m in p.multipliers):
        bad(f"ple.layer_multipliers {list(p.multipliers)} are not odd multipliers below 2^63 / {cfg.n_vocab}")
    if any(s <= 0 for s in p.head_sizes) or list(p.head_offsets) != list(head_offsets(p.head_sizes)):
        bad("ple.head_offsets are not the running sums of ple.head_vocab_sizes")


def expected_tensors(cfg: ModelConfig, il: int) -> dict[str, tuple[int, ...]]:
    """NumPy shapes of layer il's tensors, without 'blk.N.' (spec section 2)."""
    p: Qwen4ExpParams = cfg.family_params
    N, H, R = cfg.n_embd, p.hc_count, p.hc_rank
    D, X, F, Fs = N * H, cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
    t = {}
    for half in ("attn", "ffn"):
        t.update({f"hc_{half}_norm.weight": (D,), f"hc_{half}_down.weight": (R, D), f"hc_{half}_up.weight": (D, R),
                  f"hc_{half}_inject.weight": (H, D)})
    t.update({"ffn_gate_inp.weight": (X, N), "ffn_gate_exps.weight": (X, F, N), "ffn_up_exps.weight": (X, F, N),
              "ffn_down_exps.weight": (X, N, F), "ffn_gate_inp_shexp.weight": (1, N),
              "ffn_gate_shexp.weight": (Fs, N), "ffn_up_shexp.weight": (Fs, N), "ffn_down_shexp.weight": (N, Fs)})
    if cfg.recurrent_layers[il]:
        Hv, S, inner = cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_inner
        conv = 2 * cfg.ssm_k_heads * S + inner
        t.update({"attn_qkv.weight": (conv, N), "attn_gate.weight": (inner, N), "ssm_beta.weight": (Hv, N),
                  "ssm_alpha.weight": (Hv, N), "ssm_conv1d.weight": (conv, cfg.ssm_conv), "ssm_dt.bias": (Hv,),
                  "ssm_a": (Hv,), "ssm_norm.weight": (S,), "ssm_out.weight": (N, inner)})
    else:
        Hq, Hkv, hd, Hi, di = cfg.n_head, cfg.n_head_kv, cfg.head_dim, p.indexer_heads, p.indexer_dim
        t.update({"attn_q.weight": (2 * Hq * hd, N), "attn_k.weight": (Hkv * hd, N), "attn_v.weight": (Hkv * hd, N),
                  "attn_output.weight": (N, Hq * hd), "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,),
                  "indexer.q_proj.weight": (Hi * di, N), "indexer.k_proj.weight": (di, N),
                  "indexer.q_norm.weight": (di,), "indexer.k_norm.weight": (di,)})
    if il in p.ple_layers:
        P = p.n_ple_heads * p.ple_width
        t.update({"ple_key.weight": (D, P), "ple_value.weight": (N, P), "ple_norm_key.weight": (D,),
                  "ple_norm_query.weight": (D,), "ple_norm_conv.weight": (D,), "ple_conv1d.weight": (D, p.ple_conv)})
    return t


def check_tensors(model) -> None:
    cfg, name = model.config, model.path.name
    p: Qwen4ExpParams = cfg.family_params
    N, D, R = cfg.n_embd, cfg.n_embd * p.hc_count, p.hc_rank
    want = {"token_embd.weight": (cfg.n_vocab, N), "output_hc_norm.weight": (D,), "output_hc_down.weight": (R, D),
            "output_hc_up.weight": (D, R)}
    if model.has("output.weight"):
        want["output.weight"] = (cfg.n_vocab, N)
    for il in range(cfg.n_layer):
        if not cfg.recurrent_layers[il] and model.has(f"blk.{il}.attn_qkv.weight"):
            raise ModelError(f"{name}: QSA layer {il} holds attn_qkv, which qwen4exp has only on GDN layers; the file "
                             f"is damaged or fuses q, k and v, which this engine does not read for qwen4exp")
        want.update({f"blk.{il}.{k}": v for k, v in expected_tensors(cfg, il).items()})
    for tname, shape in want.items():
        got = model.tensor(tname).shape
        if got != shape:
            raise ModelError(f"{name}: tensor {tname} has shape {got}, but the metadata implies {shape}; the file is "
                             f"damaged or made for another program")
    table = model.tensor(PLE_TABLE)
    rows = p.head_offsets[-1] + p.head_sizes[-1]
    if len(table.shape) != 2 or table.shape[1] != p.ple_width or table.shape[0] < rows:
        raise ModelError(f"{name}: {PLE_TABLE} has shape {table.shape}, but the PLE keys hash into {rows} rows of "
                         f"{p.ple_width}; the file is damaged")


# --- shared pieces (spec section 3) -----------------------------------------------------------------------------

def group_rms_norm(x: np.ndarray, gamma: np.ndarray, H: int, eps: float) -> np.ndarray:
    """3 "GroupNorm_H": x (..., H*N) RMS-normed per stream x_c with that stream's slice of gamma (H*N,)."""
    shape = x.shape
    g = gamma.reshape(H, -1)
    return rms_norm(x.reshape(*shape[:-1], H, g.shape[1]), g, eps).reshape(shape)


def imrope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int) -> np.ndarray:
    """3 "IMRoPE" for text: x (T, heads, d), the first n_rot dims turned in NeoX pairs (d, d + n_rot/2).

    A text position is (p, p, p), so the t/h/w section interleave selects p for every pair: the sections matter
    only for image positions, which this engine does not take."""
    return apply_rope(x, cos, sin, n_rot, neox=True)


# --- hyper-connections (4.2, 4.3, 4.9) ---------------------------------------------------------------------------

def hc_read(x, gamma, w_down, w_up, w_inject, H: int, eps: float):
    """4.2 (and 4.9 with w_inject None): x (T, H*N) -> (block input y (T, N), inject weights iota (T, H) or None).

    u = GroupNorm_H(x); a = SiLU(W_down u / H); s = sigmoid(W_up a); y = (1/H) sum_c s_c * u_c;
    iota = 2 sigmoid(W_inj u / H)."""
    T = len(x)
    u = group_rms_norm(x, gamma, H, eps)
    a = silu((u @ w_down.T) / np.float32(H))
    s = sigmoid(a @ w_up.T)
    y = np.mean((s * u).reshape(T, H, -1), axis=1)
    if w_inject is None:
        return y, None
    return y, np.float32(2.0) * sigmoid((u @ w_inject.T) / np.float32(H))


def hc_write(x: np.ndarray, o: np.ndarray, iota: np.ndarray) -> np.ndarray:
    """4.3: x'_c = x_c + iota_c * o for each stream c of x (T, H*N); o (T, N), iota (T, H). No mixing of streams."""
    T, H = iota.shape
    return x + (iota[:, :, None] * o[:, None, :]).reshape(T, -1)


# --- QSA (4.6) ---------------------------------------------------------------------------------------------------

def pooled_block_keys(raw: np.ndarray, gamma: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, r: int,
                      eps: float) -> np.ndarray:
    """4.6.6: raw indexer keys (n_blocks * r, d) of whole blocks -> K-bar (n_blocks, d): pooled, normed, then
    rotated at each block's first position (cos, sin: (n_blocks, n_rot/2), the rows of positions r*b)."""
    pooled = raw.reshape(-1, r, raw.shape[-1]).mean(axis=1)
    k = rms_norm(pooled, gamma, eps)
    return imrope(k[:, None, :], cos, sin, n_rot)[:, 0, :]


def block_scores(q: np.ndarray, kbar: np.ndarray) -> np.ndarray:
    """4.6.7: q (T, heads, d) rotated indexer queries, kbar (n_blocks, d) -> (T, n_blocks): the sum over heads of
    ReLU(q_h . K-bar_b), divided by sqrt(d) as transformers does (the ranking is llama.cpp's)."""
    s = np.maximum(np.einsum("thd,bd->thb", q, kbar), 0).sum(axis=1)
    return s / np.sqrt(np.float32(q.shape[-1])).astype(s.dtype)


def select_tokens(scores: np.ndarray, pos: np.ndarray, n_keys: int, r: int, budget_blocks: int) -> np.ndarray:
    """4.6.5 and 4.6.8: which of n_keys positions each query attends, as a (T, n_keys) bool mask.

    scores (T, n_blocks): the block scores of the complete blocks (n_blocks >= (pos+1)//r for every query); pos
    (T,): the queries' positions. A query at p sees n_b = (p+1)//r complete blocks; with n_b <= budget_blocks it
    keeps every position 0..p (dense). Otherwise it keeps the budget_blocks highest-scoring complete blocks (ties
    to the lower block, as a stable sort gives) and always the tail r*n_b..p; its own block competes when complete.
    """
    keys = np.arange(n_keys)
    mask = keys[None, :] <= pos[:, None]
    n_b = (pos + 1) // r
    sparse = np.nonzero(n_b > budget_blocks)[0]
    if len(sparse):
        s = np.where(np.arange(scores.shape[1])[None, :] < n_b[sparse, None], scores[sparse], -np.inf)
        top = np.argsort(-s, axis=1, kind="stable")[:, :budget_blocks]
        chosen = np.zeros(s.shape, dtype=bool)
        np.put_along_axis(chosen, top, True, axis=1)
        block = np.minimum(keys // r, scores.shape[1] - 1)
        in_tail = (keys[None, :] >= r * n_b[sparse, None]) & mask[sparse]
        in_blocks = np.take_along_axis(chosen, np.broadcast_to(block, (len(sparse), n_keys)), axis=1)
        mask[sparse] = in_tail | (in_blocks & (keys[None, :] < r * n_b[sparse, None]))
    return mask


def masked_attention(q: np.ndarray, K: np.ndarray, V: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """4.6.9: q (T, Hq, d), K and V (Hkv, S, d), mask (T, S) -> (T, Hq * d); query head i reads KV head i // (Hq/Hkv)
    and softmaxes over its selected positions only."""
    T, Hq, d = q.shape
    Hkv, S = K.shape[0], K.shape[1]
    G = Hq // Hkv
    qg = q.reshape(T, Hkv, G, d).transpose(1, 2, 0, 3).reshape(Hkv, G * T, d)
    s = ((qg @ K.transpose(0, 2, 1)) * np.asarray(scale, q.dtype)).reshape(Hkv, G, T, S)
    s = np.where(mask[None, None], s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    p = (s / s.sum(axis=-1, keepdims=True)).reshape(Hkv, G * T, S)
    return (p @ V).reshape(Hkv, G, T, d).transpose(2, 0, 1, 3).reshape(T, Hq * d)


# --- PLE (4.8) ---------------------------------------------------------------------------------------------------

def ple_context(tokens: np.ndarray, before: np.ndarray, eos: int) -> np.ndarray:
    """4.8 "Context tokens": (T, n) ids ctx_0..ctx_{n-1} of each token; before: the n-1 ids ahead of tokens (EOS
    at the sequence start). Walking back from s = 1, an EOS met blanks itself and every older id to EOS; a token's
    own EOS does not reset its own context."""
    n = len(before) + 1
    hist = np.concatenate([np.asarray(before, np.int64), np.asarray(tokens, np.int64)])
    T = len(tokens)
    ctx = np.empty((T, n), np.int64)
    ctx[:, 0] = hist[n - 1:]
    blank = np.zeros(T, dtype=bool)
    for s in range(1, n):
        v = hist[n - 1 - s:n - 1 - s + T]
        ctx[:, s] = np.where(blank, eos, v)
        blank |= v == eos
    return ctx


def ple_row_ids(ctx: np.ndarray, multipliers, sizes, offsets, heads_per_ngram: int) -> np.ndarray:
    """4.8 "Row ids": ctx (T, n) -> (T, (n-1) * heads_per_ngram) rows of the table, in exact uint64 arithmetic.

    For the n-gram of order k (2..n), mu_k = XOR_{i<k} ctx_i * m_i; heads (k-2)*heads_per_ngram.. take
    (mu_k mod size_h) + offset_h."""
    c = ctx.astype(np.uint64)
    m = np.array([int(x) for x in multipliers], dtype=np.uint64)
    size = np.array([int(x) for x in sizes], dtype=np.uint64)
    off = np.array([int(x) for x in offsets], dtype=np.uint64)
    out = np.empty((len(ctx), len(size)), dtype=np.int64)
    mu = c[:, 0] * m[0]
    for k in range(2, ctx.shape[1] + 1):
        mu = mu ^ (c[:, k - 1] * m[k - 1])
        h = slice((k - 2) * heads_per_ngram, (k - 1) * heads_per_ngram)
        out[:, h] = (mu[:, None] % size[h] + off[h]).astype(np.int64)
    return out


def dilated_conv(x: np.ndarray, past: np.ndarray, w: np.ndarray, dilation: int) -> tuple[np.ndarray, np.ndarray]:
    """4.8 step 4 before its SiLU: out_t[c] = sum_k w[c][k] x_{t - dilation (K-1-k)}[c]; x (T, C), past the
    dilation*(K-1) inputs before (zeros at the start), w (C, K). Returns (out, the new past)."""
    K = w.shape[1]
    seq = np.concatenate([past, x], axis=0)
    out = np.zeros_like(x)
    for k in range(K):
        out += seq[dilation * k:dilation * k + len(x)] * w[:, k]
    return out, seq[len(seq) - len(past):].copy()


def ple_mix(x, eta, w_key, w_value, g_key, g_query, g_conv, w_conv, past, H: int, dilation: int, eps: float):
    """4.8 "Post-ops": x (T, H*N) the residual entering the layer, eta (T, P) the n-gram embedding -> (what is
    added to x: G + C, the new conv history of normalised G)."""
    T, D = x.shape
    N = D // H
    k = group_rms_norm(eta @ w_key.T, g_key, H, eps).reshape(T, H, N)
    v = eta @ w_value.T
    q = group_rms_norm(x, g_query, H, eps).reshape(T, H, N)
    lam = np.sum(k * q, axis=-1) / np.sqrt(np.float32(N)).astype(x.dtype)
    lam = np.sign(lam) * np.sqrt(np.maximum(np.abs(lam), np.asarray(1e-6, x.dtype)))
    g = (sigmoid(lam)[:, :, None] * v[:, None, :]).reshape(T, D)
    c, past = dilated_conv(group_rms_norm(g, g_conv, H, eps), past, w_conv, dilation)
    return g + silu(c), past


# --- the cache --------------------------------------------------------------------------------------------------

class Qwen4ExpCache:
    """Per position: the QSA layers' K/V (self.kv) and raw indexer keys; per complete block, derived and refilled
    from those: pooled keys. Recurrent (copy_state / load_state): GDN conv and delta, PLE conv history and ids."""

    def __init__(self, cfg: ModelConfig, max_context: int, dtype=np.float32):
        p: Qwen4ExpParams = cfg.family_params
        self.cfg, self.p, self.dtype = cfg, p, dtype
        self.gdn_layers = [i for i, r in enumerate(cfg.recurrent_layers) if r]
        self.qsa_layers = [i for i, r in enumerate(cfg.recurrent_layers) if not r]
        self.kv = KVCache(cfg, max_context, self.qsa_layers, dtype)
        self.conv_dim = 2 * cfg.ssm_k_heads * cfg.ssm_state + cfg.ssm_inner
        self.capacity = 0
        self.index_keys = {i: np.zeros((0, p.indexer_dim), dtype) for i in self.qsa_layers}
        self.pooled = {i: np.zeros((0, p.indexer_dim), dtype) for i in self.qsa_layers}
        self.n_pooled = {i: 0 for i in self.qsa_layers}
        self.reset_state()

    def ensure(self, n: int) -> None:
        self.kv.ensure(n)
        if self.kv.capacity > self.capacity:
            cap = self.kv.capacity
            for i in self.qsa_layers:
                r = self.p.compress_ratios[i]
                for store, rows in ((self.index_keys, cap), (self.pooled, cap // r)):
                    new = np.zeros((rows, self.p.indexer_dim), self.dtype)
                    new[:len(store[i])] = store[i]
                    store[i] = new
            self.capacity = cap

    def reset_state(self) -> None:
        cfg, p = self.cfg, self.p
        self.conv = {i: np.zeros((cfg.ssm_conv - 1, self.conv_dim), self.dtype) for i in self.gdn_layers}
        self.delta = {i: np.zeros((cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_state), self.dtype)
                      for i in self.gdn_layers}
        D = cfg.n_embd * p.hc_count
        self.ple_conv = np.zeros((p.ngram_size * (p.ple_conv - 1), D), self.dtype)
        self.ple_ids = np.full(p.ngram_size - 1, p.ple_eos, np.int64)

    def _state(self):
        return self.conv, self.delta, {"conv": self.ple_conv, "ids": self.ple_ids}

    def state_bytes(self) -> int:
        conv, delta, ple = self._state()
        return sum(a.nbytes for d in (conv, delta, ple) for a in d.values())

    def copy_state(self):
        return tuple({i: a.copy() for i, a in d.items()} for d in self._state())

    def load_state(self, state) -> None:
        conv, delta, ple = state
        self.conv = {i: a.copy() for i, a in conv.items()}
        self.delta = {i: a.copy() for i, a in delta.items()}
        self.ple_conv, self.ple_ids = ple["conv"].copy(), ple["ids"].copy()


# --- the model --------------------------------------------------------------------------------------------------

class Qwen4Exp(Transformer):
    recurrent = True

    def __init__(self, model, weights, max_context, observer=None, ple_cache_bytes: int = PLE_CACHE_BYTES):
        super().__init__(model, weights, max_context, observer)
        self.p: Qwen4ExpParams = self.cfg.family_params
        self.ple_rows = RowCache(model.tensor(PLE_TABLE), ple_cache_bytes)
        self.min_route_gap = math.inf    # as qwen3next's: where tiny, another engine's rounding may route otherwise

    def new_cache(self, max_context: int, dtype=np.float32) -> Qwen4ExpCache:
        """dtype float64: the same forward in float64 throughout (an exact-arithmetic yardstick)."""
        return Qwen4ExpCache(self.cfg, max_context, dtype)

    def warm(self) -> None:
        """Every dense weight dequantized now; never the n-gram table (read by rows) nor the experts (an LRU)."""
        for name in self.model.tensor_names():
            if "_exps." not in name and name not in ("token_embd.weight", PLE_TABLE):
                self.w.get(name)
        self.w.get(self.output_name)

    def reset_stats(self) -> None:
        self.ple_rows.reset_counts()

    def request_info(self) -> dict:
        return {"ple_row_lookups": self.ple_rows.lookups, "ple_row_hits": self.ple_rows.hits}

    def info(self) -> dict:
        return {"ple_row_cache_mib": round(self.ple_rows.nbytes / 2**20)}

    def _hc(self, prefix: str):
        w = self.w
        inject = w.get(prefix + "_inject.weight") if prefix != "output_hc" else None
        return (w.get(prefix + "_norm.weight"), w.get(prefix + "_down.weight"), w.get(prefix + "_up.weight"), inject,
                self.p.hc_count, self.cfg.rms_eps)

    def forward(self, tokens, pos0, cache: Qwen4ExpCache, all_logits):
        """4.1 and 4.4 over a chunk of tokens at positions pos0..; logits of every row or of the last one."""
        cfg, w, H = self.cfg, self.w, self.p.hc_count
        tokens = np.asarray(tokens, np.int64)
        cache.ensure(pos0 + len(tokens))
        decoding = len(tokens) == 1
        x = np.tile(w.rows("token_embd.weight", tokens).astype(cache.dtype), (1, H))
        for il in range(cfg.n_layer):
            b = f"blk.{il}."
            if il in self.p.ple_layers:
                x = x + self.ple(il, x, tokens, cache)
            y, iota = hc_read(x, *self._hc(b + "hc_attn"))
            self.observer.attention_input(il, y)
            o = self.gdn(il, y, cache) if cfg.recurrent_layers[il] else self.qsa(il, y, pos0, cache)
            x = hc_write(x, o, iota)
            y, iota = hc_read(x, *self._hc(b + "hc_ffn"))
            self.observer.ffn_input(il, y)
            x = hc_write(x, self.ffn(il, y, decoding), iota)
        return self.head(x, all_logits)

    def head(self, x, all_logits):
        """4.9: the final HC read (no inject) is the output norm, then the vocabulary projection."""
        if not all_logits:
            x = x[-1:]
        y, _ = hc_read(x, *self._hc("output_hc"))
        logits = y @ self.w.get(self.output_name).T
        return logits if all_logits else logits[0]

    def gdn(self, il, x, cache: Qwen4ExpCache):
        """4.5: qwen35moe's Gated DeltaNet (separate projections, value head h reads key head h % n_k in the GGUF's
        tiled order) with a sigmoid output gate."""
        cfg, w, b = self.cfg, self.w, f"blk.{il}."
        z = (x @ w.get(b + "attn_gate.weight").T).reshape(len(x), cfg.ssm_v_heads, cfg.ssm_state)
        out, cache.conv[il], cache.delta[il] = gated_delta_net(
            w, b, cfg, x @ w.get(b + "attn_qkv.weight").T, z, x @ w.get(b + "ssm_beta.weight").T,
            x @ w.get(b + "ssm_alpha.weight").T, cache.conv[il], cache.delta[il], True, sigmoid)
        return out

    def qsa(self, il, x, pos0, cache: Qwen4ExpCache):
        """4.6: gated attention over each query's selected tokens."""
        cfg, p, w, b = self.cfg, self.p, self.w, f"blk.{il}."
        T, Hq, Hkv, hd, n_rot, eps = len(x), cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_rot, cfg.rms_eps
        r, S = p.compress_ratios[il], pos0 + len(x)
        qg = (x @ w.get(b + "attn_q.weight").T).reshape(T, Hq, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, Hq * hd)
        k = (x @ w.get(b + "attn_k.weight").T).reshape(T, Hkv, hd)
        v = (x @ w.get(b + "attn_v.weight").T).reshape(T, Hkv, hd)
        cos, sin = self.cos[pos0:S], self.sin[pos0:S]
        q = imrope(rms_norm(q, w.get(b + "attn_q_norm.weight"), eps), cos, sin, n_rot)
        k = imrope(rms_norm(k, w.get(b + "attn_k_norm.weight"), eps), cos, sin, n_rot)
        cache.kv.k[il][:, pos0:S] = k.transpose(1, 0, 2)
        cache.kv.v[il][:, pos0:S] = v.transpose(1, 0, 2)
        qi = (x @ w.get(b + "indexer.q_proj.weight").T).reshape(T, p.indexer_heads, p.indexer_dim)
        qi = imrope(rms_norm(qi, w.get(b + "indexer.q_norm.weight"), eps), cos, sin, n_rot)
        cache.index_keys[il][pos0:S] = x @ w.get(b + "indexer.k_proj.weight").T
        # Pooled keys of blocks complete before this chunk stay valid (a rewind to pos0 keeps positions < pos0).
        lo, hi = min(cache.n_pooled[il], pos0 // r), S // r
        if hi > lo:
            cache.pooled[il][lo:hi] = pooled_block_keys(cache.index_keys[il][lo * r:hi * r],
                                                        w.get(b + "indexer.k_norm.weight"), self.cos[lo * r:hi * r:r],
                                                        self.sin[lo * r:hi * r:r], n_rot, r, eps)
        cache.n_pooled[il] = hi
        pos = pos0 + np.arange(T)
        mask = select_tokens(block_scores(qi, cache.pooled[il][:hi]), pos, S, r, p.qsa_budget // r)
        a = masked_attention(q, cache.kv.k[il][:, :S], cache.kv.v[il][:, :S], mask, self.attn_scale)
        return (a * sigmoid(gate)) @ w.get(b + "attn_output.weight").T

    def ffn(self, il, x, decoding):
        """4.7: softmax over the experts, the top k renormalised, plus the shared expert behind sigmoid(w_sg . y)."""
        cfg, w, b = self.cfg, self.w, f"blk.{il}."
        logits = x @ w.get(b + "ffn_gate_inp.weight").T
        if cfg.n_expert_used < cfg.n_expert:
            top = -np.sort(-logits, axis=-1)
            self.min_route_gap = min(self.min_route_gap,
                                     float(np.min(top[:, cfg.n_expert_used - 1] - top[:, cfg.n_expert_used])))
        ids, weights = route(logits, cfg.n_expert_used, True)
        out = moe_ffn(w, il, x, ids, weights.astype(x.dtype), decoding)
        shared = swiglu(x, w.get(b + "ffn_gate_shexp.weight"), w.get(b + "ffn_up_shexp.weight"),
                        w.get(b + "ffn_down_shexp.weight"))
        return out + shared * sigmoid(x @ w.get(b + "ffn_gate_inp_shexp.weight").T)

    def ple(self, il, x, tokens, cache: Qwen4ExpCache):
        """4.8: the n-gram rows of each token through the row cache, then the gated, convolved add-back."""
        p, w, b = self.p, self.w, f"blk.{il}."
        ctx = ple_context(tokens, cache.ple_ids, p.ple_eos)
        cache.ple_ids = np.concatenate([cache.ple_ids, tokens])[-(p.ngram_size - 1):]
        rows = ple_row_ids(ctx, p.multipliers, p.head_sizes, p.head_offsets, p.heads_per_ngram)
        eta = self.ple_rows.rows(rows).reshape(len(tokens), -1).astype(x.dtype)
        out, cache.ple_conv = ple_mix(x, eta, w.get(b + "ple_key.weight"), w.get(b + "ple_value.weight"),
                                      w.get(b + "ple_norm_key.weight"), w.get(b + "ple_norm_query.weight"),
                                      w.get(b + "ple_norm_conv.weight"), w.get(b + "ple_conv1d.weight"),
                                      cache.ple_conv, p.hc_count, p.ngram_size, self.cfg.rms_eps)
        return out


MODEL = Qwen4Exp
