"""qwen3next (Qwen3-Next-80B-A3B) and qwen35moe (Qwen3.5/3.6-35B-A3B): Gated DeltaNet hybrids, as llama.cpp runs them.

Three of every four layers are Gated DeltaNet (GDN) linear attention, the fourth gated full attention; every layer
ends in routed experts (top-k of a softmax, renormalized) plus a shared expert behind a sigmoid gate. A layer is
    h = x + mixer(rms_norm(x, attn_norm));   x' = h + moe(rms_norm(h, post_attention_norm))
GDN mixer, per token t (value head h reads key head kh(h)):
    qkv = x @ attn_qkv, z = x @ attn_gate; a causal conv1d (width d_conv) over qkv's time axis, then silu
    q, k = l2-normed per head; q /= sqrt(head_dim); beta = sigmoid(x @ W_b); g = softplus(x @ W_a + dt) * ssm_a
    S_h <- exp(g_h) S_h;  S_h <- S_h + beta_h (v_h - S_h k) k^T;  o_h = S_h q       (the gated delta rule)
    out = (rms_norm(o_h, ssm_norm) * silu(z_h)) @ ssm_out
Gated attention: attn_q gives each head [query | gate]; q and k are RMS-normed per head, RoPE turns the first n_rot
dimensions (neox pairs); the attention output is multiplied by sigmoid(gate) before attn_output.

The two differ in three places, each where llama.cpp's converter put them:
- qwen3next's beta and alpha come from one tensor ssm_ba, grouped per key head ([b x r, a x r] for each of the
  n_k heads, r = n_v / n_k); qwen35moe has ssm_beta and ssm_alpha apart.
- value head h reads key head h // r in qwen3next (grouped, HF's order) and h % n_k in qwen35moe (its converter
  reorders the value heads so that ggml's tiled broadcast applies).
- qwen35moe's RoPE is IMRoPE (rope_multi, sections s): text positions are (p, p, p, 0), so a rotary pair whose
  sector falls in the fourth section stays still; with the published sections every pair turns as in neox.
The recurrent state (each GDN layer's last d_conv-1 conv inputs and its n_v x S x S delta matrices) lives in
HybridCache beside the attention layers' K/V; engine/backend.py says how the session snapshots and restores it, and
how a verify window is cut back (HybridCache.track / rewind: the state after each of the window's positions).
MTP (nextn) blocks after the trunk are not run by the main pass (nor by llama.cpp's): engine/drafters/mtp.py drafts
with them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.arch import tensors
from engine.arch.base import KVCache, Transformer, apply_rope, moe_ffn, rms_norm, route, silu, swiglu
from engine.model_config import ModelError

ARCHS = ("qwen3next", "qwen35moe")
EXPERTS = True
FUSED_QKV = False       # a GDN layer's attn_qkv is its mixing projection, not attention's q, k and v

CHUNK = 64      # tokens per chunk of the prompt-side delta rule


@dataclass(frozen=True)
class GdnLayout:
    """How the two converters lay out a GDN layer (cfg.family_params): the places the architectures differ."""
    tiled_heads: bool        # value head h reads key head h % n_k (qwen35moe); else h // r (qwen3next, HF's order)
    split_beta_alpha: bool   # ssm_beta and ssm_alpha apart (qwen35moe); else one ssm_ba grouped per key head
    legacy_ssm_in: bool      # the first qwen3next converter's fused ssm_in (q, k, v and z) is read too


LAYOUTS = {"qwen3next": GdnLayout(tiled_heads=False, split_beta_alpha=False, legacy_ssm_in=True),
           "qwen35moe": GdnLayout(tiled_heads=True, split_beta_alpha=True, legacy_ssm_in=False)}

# --- configuration and tensors ---------------------------------------------------------------------------------


def configure(cfg, get, model) -> None:
    """Fill the hybrid fields of cfg from the GGUF keys llama.cpp's loader reads for these architectures."""
    name, arch = model.path.name, cfg.arch
    cfg.expert_weights_norm = True      # top-k of a softmax, renormalized (llama.cpp: norm_w = true)
    cfg.family_params = LAYOUTS[arch]
    n_all = cfg.n_layer
    nextn = int(get("nextn_predict_layers", 0) or 0)
    if not 0 <= nextn < n_all:
        raise ModelError(f"{name}: {arch}.nextn_predict_layers={nextn} with block_count {n_all}; the file is damaged")
    cfg.n_layer = n_all - nextn
    cfg.n_layer_nextn = nextn
    for field, key in (("ssm_conv", "ssm.conv_kernel"), ("ssm_inner", "ssm.inner_size"),
                       ("ssm_state", "ssm.state_size"), ("ssm_v_heads", "ssm.time_step_rank"),
                       ("ssm_k_heads", "ssm.group_count")):
        v = get(key, required=True)
        if not isinstance(v, int) or v <= 0:
            raise ModelError(f"{name}: {arch}.{key}={v!r} is not a positive count; the file is damaged")
        setattr(cfg, field, int(v))
    if cfg.ssm_v_heads % cfg.ssm_k_heads or cfg.ssm_inner != cfg.ssm_v_heads * cfg.ssm_state:
        raise ModelError(f"{name}: {cfg.ssm_v_heads} GDN value heads of {cfg.ssm_state} do not fit "
                         f"ssm.inner_size={cfg.ssm_inner} and {cfg.ssm_k_heads} key heads; the file is damaged")
    flags = model.metadata.get(f"{arch}.attention.recurrent_layers")
    if flags is not None:
        if not isinstance(flags, list) or len(flags) < cfg.n_layer:
            raise ModelError(f"{name}: {arch}.attention.recurrent_layers has {len(flags) if isinstance(flags, list) else 1} "
                             f"entries for {cfg.n_layer} layers; the file is damaged")
        rec = tuple(bool(f) for f in flags[:cfg.n_layer])
    else:   # llama.cpp's default: every full_attention_interval-th layer attends
        every = int(get("full_attention_interval", 4) or 4)
        rec = tuple((i + 1) % every != 0 for i in range(cfg.n_layer))
    if all(rec):
        raise ModelError(f"{name}: none of its {cfg.n_layer} layers attends; this engine needs at least one")
    cfg.recurrent_layers = rec
    if arch == "qwen35moe":
        sections = model.metadata.get(f"{arch}.rope.dimension_sections")
        if not isinstance(sections, list) or len(sections) < 3 or sum(sections[:3]) <= 0:
            raise ModelError(f"{name} lacks {arch}.rope.dimension_sections (IMRoPE); the file is incomplete")
        cfg.rope_sections = tuple(int(s) for s in (list(sections) + [0])[:4])


def expected_tensors(cfg, il: int) -> dict[str, tuple[int, ...]]:
    """Numpy shapes of trunk layer il's tensors (without the 'blk.N.' prefix), as llama.cpp's loader creates them."""
    E, X, F, Fs = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
    t = {"attn_norm.weight": (E,), "post_attention_norm.weight": (E,),
         "ffn_gate_inp.weight": (X, E), "ffn_gate_exps.weight": (X, F, E), "ffn_up_exps.weight": (X, F, E),
         "ffn_down_exps.weight": (X, E, F), "ffn_gate_inp_shexp.weight": (E,),
         "ffn_gate_shexp.weight": (Fs, E), "ffn_up_shexp.weight": (Fs, E), "ffn_down_shexp.weight": (E, Fs)}
    if cfg.recurrent_layers[il]:
        Hv, S = cfg.ssm_v_heads, cfg.ssm_state
        conv = 2 * cfg.ssm_k_heads * S + cfg.ssm_inner
        t.update({"attn_qkv.weight": (conv, E), "attn_gate.weight": (cfg.ssm_inner, E),
                  "ssm_conv1d.weight": (conv, cfg.ssm_conv), "ssm_dt.bias": (Hv,), "ssm_a": (Hv,),
                  "ssm_norm.weight": (S,), "ssm_out.weight": (E, cfg.ssm_inner)})
        if cfg.family_params.split_beta_alpha:
            t.update({"ssm_beta.weight": (Hv, E), "ssm_alpha.weight": (Hv, E)})
        else:
            t["ssm_ba.weight"] = (2 * Hv, E)
    else:
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        t.update({"attn_q.weight": (2 * H * D, E), "attn_k.weight": (Hkv * D, E), "attn_v.weight": (Hkv * D, E),
                  "attn_output.weight": (E, H * D), "attn_q_norm.weight": (D,), "attn_k_norm.weight": (D,)})
    return t


def check_tensors(model) -> None:
    """Every trunk layer's tensors in the shapes cfg implies (its GDN or gated attention ones), and the output."""
    cfg, name = model.config, model.path.name
    if cfg.head_dim != cfg.head_dim_v:
        raise ModelError(f"{name}: {cfg.arch} needs key and value heads of one width, not {cfg.head_dim} and "
                         f"{cfg.head_dim_v}; the file is damaged")
    for n in ("token_embd.weight", "output_norm.weight"):
        model.tensor(n)
    for il in range(cfg.n_layer):
        # (a fused ffn_gate_up_exps is split on loading, engine/gguf_model.py; a gated attention layer's fused
        # attn_qkv is not, since a GDN layer's attn_qkv means something else)
        if not cfg.recurrent_layers[il] and model.has(f"blk.{il}.attn_qkv.weight"):
            raise ModelError(f"{name} fuses attention layer {il}'s q, k and v into attn_qkv, which this engine reads "
                             f"apart only for plain attention; convert it without fusing")
        want_all = expected_tensors(cfg, il)
        if cfg.recurrent_layers[il] and model.has(f"blk.{il}.ssm_in.weight"):
            if not cfg.family_params.legacy_ssm_in:
                raise ModelError(f"{name}: {cfg.arch} has no legacy ssm_in tensor, but blk.{il} holds one; damaged?")
            q, g = want_all.pop("attn_qkv.weight"), want_all.pop("attn_gate.weight")
            want_all["ssm_in.weight"] = (q[0] + g[0], cfg.n_embd)
        for suffix, want in want_all.items():
            t = model.tensor(f"blk.{il}.{suffix}")
            shape = t.shape[1:] if suffix == "ffn_gate_inp_shexp.weight" and t.shape[:1] == (1,) else t.shape
            if shape != want:
                raise ModelError(f"{name}: tensor {t.name} has shape {t.shape}, but the metadata implies {want}; "
                                 f"the file is damaged or made for another program")
    tensors.check_output(model)


# --- the cache: K/V of the attention layers, conv and delta state of the GDN layers ------------------------------

class HybridCache:
    # A verify window (engine/backend.py): while tracking, each GDN layer keeps its conv inputs and its delta state
    # after every position of the window (its one-token forwards), so rewind(n) finds the state after any of them.
    per_position = True

    def __init__(self, cfg, max_context: int, dtype=np.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.gdn_layers = [i for i, r in enumerate(cfg.recurrent_layers) if r]
        self.kv = KVCache(cfg, max_context, [i for i, r in enumerate(cfg.recurrent_layers) if not r], dtype)
        self.conv_dim = 2 * cfg.ssm_k_heads * cfg.ssm_state + cfg.ssm_inner
        self.window = None      # while tracking: layer -> (past + the window's conv inputs, [delta after 0..T])
        self.reset_state()

    def track(self, on: bool) -> None:
        """Keep every position's state during the next forward (on), or nothing (off)."""
        self.window = {} if on else None

    def rewind(self, n: int) -> None:
        """The state after the first n positions of the tracked forward (0: the state before it)."""
        d = self.cfg.ssm_conv - 1
        for il, (seq, states) in self.window.items():
            self.conv[il] = seq[n:n + d].copy()
            self.delta[il] = states[n].copy()
        self.window = None

    def ensure(self, n: int) -> None:
        self.kv.ensure(n)

    def reset_state(self) -> None:
        cfg = self.cfg
        self.conv = {i: np.zeros((cfg.ssm_conv - 1, self.conv_dim), self.dtype) for i in self.gdn_layers}
        self.delta = {i: np.zeros((cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_state), self.dtype)
                      for i in self.gdn_layers}

    def state_bytes(self) -> int:
        return sum(a.nbytes for a in self.conv.values()) + sum(a.nbytes for a in self.delta.values())

    def copy_state(self):
        return ({i: a.copy() for i, a in self.conv.items()}, {i: a.copy() for i, a in self.delta.items()})

    def load_state(self, state) -> None:
        conv, delta = state
        self.conv = {i: a.copy() for i, a in conv.items()}
        self.delta = {i: a.copy() for i, a in delta.items()}
        self.window = None


# --- the forward pass --------------------------------------------------------------------------------------------

def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x).astype(x.dtype)


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """llama.cpp's build_gdn_l2_norm: x / sqrt(sum(x^2) + eps) along the last axis."""
    return x / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True) + np.float32(eps))


def causal_conv(x: np.ndarray, past: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (T, C) new inputs, past (d_conv-1, C) the ones before, w (C, d_conv): out[t] = sum_i seq[t+i] * w[:, i].

    Returns (out (T, C), the new past: the last d_conv-1 rows of past + x).
    """
    seq = np.concatenate([past, x], axis=0)
    d_conv = w.shape[1]
    out = np.zeros_like(x)
    for i in range(d_conv):
        out += seq[i:i + len(x)] * w[:, i]
    return out, seq[len(seq) - (d_conv - 1):].copy()


def delta_rule(q, k, v, g, beta, S, states=None):
    """The gated delta rule, token by token. q, k, v (T, H, D) (q already scaled), g, beta (T, H), S (H, D, D).

    S maps keys to values (o = S q); each step decays it by exp(g), then moves its answer for k toward v by beta.
    Returns (o (T, H, D), the new S); a list `states` gets a copy of S after each token.
    """
    S = S.copy()
    o = np.empty_like(v)
    for t in range(len(q)):
        S *= np.exp(g[t])[:, None, None]
        err = v[t] - np.einsum("hij,hj->hi", S, k[t])
        S += (beta[t][:, None] * err)[:, :, None] * k[t][:, None, :]
        o[t] = np.einsum("hij,hj->hi", S, q[t])
        if states is not None:
            states.append(S.copy())
    return o, S


def delta_rule_chunk(q, k, v, g, beta, S):
    """The same recurrence over a whole chunk at once (tests show it equal to delta_rule), with matrix products.

    Unrolled, the state after token t is S_t = G_t S + sum_{s<=t} (G_t/G_s) u_s k_s^T, G_t = exp(g_1 + ... + g_t),
    where u_s = beta_s (v_s - S~ k_s) is what token s writes, S~ the decayed state it reads. Those u solve one
    unit lower-triangular system, (I + A) u = beta (v - G S k) with A[t,s] = beta_t (G_t/G_s) k_t.k_s for s < t,
    and then o_t = G_t S q_t + sum_{s<=t} (G_t/G_s) (q_t.k_s) u_s. Every G_t/G_s used has s <= t, so it is <= 1.
    """
    qh, kh, vh = (a.transpose(1, 0, 2) for a in (q, k, v))          # (H, T, D)
    cg = np.cumsum(g.T, axis=1)                                      # (H, T): log G_t
    T = qh.shape[1]
    lower = np.tril(np.ones((T, T), dtype=bool))
    decay = np.exp(np.where(lower, cg[:, :, None] - cg[:, None, :], -np.inf))    # (H, T, T): G_t/G_s, s <= t
    b = beta.T[:, :, None]
    A = b * decay * (kh @ kh.transpose(0, 2, 1)) * ~np.eye(T, dtype=bool)
    rhs = b * (vh - np.exp(cg)[:, :, None] * (kh @ S.transpose(0, 2, 1)))
    u = np.linalg.solve(np.eye(T) + A, rhs)
    o = np.exp(cg)[:, :, None] * (qh @ S.transpose(0, 2, 1)) + (decay * (qh @ kh.transpose(0, 2, 1))) @ u
    tail = np.exp(cg[:, -1:] - cg)[:, :, None]                       # G_T/G_s
    S = np.exp(cg[:, -1])[:, None, None] * S + (tail * u).transpose(0, 2, 1) @ kh
    return o.transpose(1, 0, 2).astype(v.dtype), S.astype(v.dtype)


def gated_delta_net(w, b: str, cfg, qkv, z, pre_b, pre_a, conv, delta, tiled: bool, gate, states=None):
    """A Gated DeltaNet layer after its projections (qwen3next, qwen35moe, qwen4exp's spec 4.5 steps 2-7): the causal
    conv and SiLU over qkv (T, channels), per-head L2-normed q and k, beta = sigmoid(pre_b), g = softplus(pre_a +
    dt) * ssm_a, the delta rule (one token at a time, per position into `states` for a verify window, else in
    chunks of CHUNK), the gated RMS norm with gate(z) (z: (T, n_v, D)) and ssm_out. Value head h reads key head
    h % n_k when `tiled` (the GGUF order of qwen35moe and qwen4exp), else h // r. Returns (out, conv, delta)."""
    T, Hk, Hv, D = len(qkv), cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state
    beta = sigmoid(pre_b)
    g = softplus(pre_a + w.get(b + "ssm_dt.bias")) * w.get(b + "ssm_a")   # ssm_a = -exp(A_log): g < 0
    qkv, conv = causal_conv(qkv, conv, w.get(b + "ssm_conv1d.weight"))
    qkv = silu(qkv)
    q = l2_norm(qkv[:, :Hk * D].reshape(T, Hk, D), cfg.rms_eps)
    k = l2_norm(qkv[:, Hk * D:2 * Hk * D].reshape(T, Hk, D), cfg.rms_eps)
    v = qkv[:, 2 * Hk * D:].reshape(T, Hv, D)
    r = Hv // Hk
    if tiled:
        q, k = np.tile(q, (1, r, 1)), np.tile(k, (1, r, 1))
    else:
        q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)
    q = q * np.asarray(1.0 / math.sqrt(D), q.dtype)
    if T == 1 or states is not None:
        o, delta = delta_rule(q, k, v, g, beta, delta, states)
    else:   # prompts: chunks of CHUNK tokens (llama.cpp's own size), each a few matrix products
        outs = []
        for s in range(0, T, CHUNK):
            part, delta = delta_rule_chunk(q[s:s + CHUNK], k[s:s + CHUNK], v[s:s + CHUNK], g[s:s + CHUNK],
                                           beta[s:s + CHUNK], delta)
            outs.append(part)
        o = np.concatenate(outs)
    o = rms_norm(o, w.get(b + "ssm_norm.weight"), cfg.rms_eps) * gate(z)
    return o.reshape(T, Hv * D) @ w.get(b + "ssm_out.weight").T, conv, delta


def imrope_still(cfg) -> np.ndarray | None:
    """qwen35moe's IMRoPE for text: which rotary pairs (n_rot/2 bools) stay at position 0's angle. Sectors of the
    t/h/w sections turn with p; the fourth section's position is 0. None for plain neox RoPE (qwen3next)."""
    if not cfg.rope_sections:
        return None
    s = cfg.rope_sections
    sector = np.arange(cfg.n_rot // 2) % sum(s)
    return ~(((sector % 3 == 0) & (sector < 3 * s[0])) | ((sector % 3 == 1) & (sector < 3 * s[1]))
             | ((sector % 3 == 2) & (sector < 3 * s[2])))


class Qwen3Next(Transformer):
    recurrent = True
    ffn_norm = "post_attention_norm.weight"

    def __init__(self, model, weights, max_context, observer=None):
        super().__init__(model, weights, max_context, observer)
        cfg = self.cfg
        # The smallest gap between the k-th and (k+1)-th router logit seen so far. Where it is tiny, another
        # engine's rounding (llama.cpp's fp16 or 8-bit activations) may pick the other expert, and a recurrent
        # state carries that difference to every later token: reference tests pick prompts without such ties.
        self.min_route_gap = math.inf
        still = imrope_still(cfg)
        if still is not None:
            self.cos[:, still], self.sin[:, still] = self.cos[0, still], self.sin[0, still]

    def new_cache(self, max_context: int, dtype=np.float32) -> HybridCache:
        """dtype float64: a forward in float64 throughout (the exact-arithmetic check of the tests)."""
        return HybridCache(self.cfg, max_context, dtype)

    def forward(self, tokens, pos0, cache: HybridCache, all_logits):
        cfg, w = self.cfg, self.w
        x = w.rows("token_embd.weight", tokens).astype(cache.dtype)
        cache.ensure(pos0 + len(tokens))
        decoding = len(tokens) == 1
        for il in range(cfg.n_layer):
            b = f"blk.{il}."
            h = rms_norm(x, w.get(b + "attn_norm.weight"), cfg.rms_eps)
            self.observer.attention_input(il, h)
            if cfg.recurrent_layers[il]:
                x = x + self.gdn(il, h, cache)
            else:
                x = x + self.gated_attention(il, h, pos0, cache.kv)
            h = rms_norm(x, w.get(b + self.ffn_norm), cfg.rms_eps)
            self.observer.ffn_input(il, h)
            x = x + self.ffn(il, h, decoding)
        return self.head(x, all_logits)

    # --- Gated DeltaNet ---
    def qkv_z(self, il, x):
        """(qkv (T, conv channels: q of every key head, then k, then v), z (T, n_v, D)).

        Files from llama.cpp's first Qwen3-Next converter fuse all four in ssm_in, grouped per key head:
        [q, k, v of its r value heads, z of them] for each of the n_k heads. llama.cpp 0c1e570 still reads them.
        """
        cfg, w, b = self.cfg, self.w, f"blk.{il}."
        T, Hk, Hv, D = len(x), cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state
        if self.model.has(b + "ssm_in.weight"):
            r = Hv // Hk
            m = (x @ w.get(b + "ssm_in.weight").T).reshape(T, Hk, 2 * D + 2 * r * D)
            q, k, v, z = np.split(m, [D, 2 * D, 2 * D + r * D], axis=-1)
            return np.concatenate([a.reshape(T, -1) for a in (q, k, v)], axis=1), z.reshape(T, Hv, D)
        return x @ w.get(b + "attn_qkv.weight").T, (x @ w.get(b + "attn_gate.weight").T).reshape(T, Hv, D)

    def beta_alpha(self, il, x):
        """(b, a), each (T, n_v): the pre-sigmoid beta and the pre-softplus alpha of every value head."""
        cfg, b = self.cfg, f"blk.{il}."
        if cfg.family_params.split_beta_alpha:
            return x @ self.w.get(b + "ssm_beta.weight").T, x @ self.w.get(b + "ssm_alpha.weight").T
        r = cfg.ssm_v_heads // cfg.ssm_k_heads
        ba = (x @ self.w.get(b + "ssm_ba.weight").T).reshape(len(x), cfg.ssm_k_heads, 2 * r)
        return ba[:, :, :r].reshape(len(x), -1), ba[:, :, r:].reshape(len(x), -1)

    def gdn(self, il, x, cache: HybridCache):
        qkv, z = self.qkv_z(il, x)
        pre_b, pre_a = self.beta_alpha(il, x)
        states = None
        if cache.window is not None:        # a verify window: the state after each position (HybridCache.rewind),
            seen = cache.window.get(il)     # gathered over its one-token forwards (engine/backend_cpu.py)
            if seen is None:
                seen = (cache.conv[il], [cache.delta[il]])
            states = seen[1]
            cache.window[il] = (np.concatenate([seen[0], qkv]), states)
        out, cache.conv[il], cache.delta[il] = gated_delta_net(
            self.w, f"blk.{il}.", self.cfg, qkv, z, pre_b, pre_a, cache.conv[il], cache.delta[il],
            self.cfg.family_params.tiled_heads, silu, states)
        return out

    # --- gated full attention ---
    def gated_attention(self, il, x, pos0, kv: KVCache):
        cfg, w, b = self.cfg, self.w, f"blk.{il}."
        T, H, Hkv, D = len(x), cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qg = (x @ w.get(b + "attn_q.weight").T).reshape(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
        k = (x @ w.get(b + "attn_k.weight").T).reshape(T, Hkv, D)
        v = (x @ w.get(b + "attn_v.weight").T).reshape(T, Hkv, D)
        q = rms_norm(q, w.get(b + "attn_q_norm.weight"), cfg.rms_eps)
        k = rms_norm(k, w.get(b + "attn_k_norm.weight"), cfg.rms_eps)
        cos, sin = self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T]
        q = apply_rope(q, cos, sin, cfg.n_rot, neox=True)
        k = apply_rope(k, cos, sin, cfg.n_rot, neox=True)
        return (self.attend(il, q, k, v, pos0, kv) * sigmoid(gate)) @ w.get(b + "attn_output.weight").T

    # --- routed experts plus the gated shared expert ---
    def ffn(self, il, x, decoding):
        cfg, w, b = self.cfg, self.w, f"blk.{il}."
        logits = x @ w.get(b + "ffn_gate_inp.weight").T
        if cfg.n_expert_used < cfg.n_expert:
            top = -np.sort(-logits, axis=-1)
            gap = float(np.min(top[:, cfg.n_expert_used - 1] - top[:, cfg.n_expert_used]))
            self.min_route_gap = min(self.min_route_gap, gap)
        ids, weights = route(logits, cfg.n_expert_used, True, cfg.expert_weights_scale)
        out = moe_ffn(w, il, x, ids, weights, decoding)
        shared = swiglu(x, w.get(b + "ffn_gate_shexp.weight"), w.get(b + "ffn_up_shexp.weight"),
                        w.get(b + "ffn_down_shexp.weight"))
        g = x @ w.get(b + "ffn_gate_inp_shexp.weight").reshape(-1, cfg.n_embd).T     # (T, 1)
        return out + shared * sigmoid(g)


MODEL = Qwen3Next
