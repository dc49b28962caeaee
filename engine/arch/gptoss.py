"""gpt-oss (gpt-oss-20b, gpt-oss-120b): llama.cpp's LLM_ARCH_OPENAI_MOE, src/models/openai-moe.cpp.

Per layer: RMSNorm -> attention -> residual -> RMSNorm (`post_attention_norm`) -> MoE -> residual. What differs
from the other families, each in a function of its own so that the CUDA kernels can mirror them one by one:
- attention: biases on q, k, v and o; RoPE (neox) with YaRN as ggml applies it (base.rope_tables); scale
  1/sqrt(head_dim); one learned sink logit per query head that joins the softmax's denominator and carries no value
  (sink_softmax); layers with is_swa(il) (llama.cpp: the even ones) see only the last n_swa positions (window_mask).
- router: logits plus a bias; the top k by logit, then a softmax over those k alone (route_softmax_weight:
  LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT).
- experts: gate/up/down each with a bias, and SWIGLU_OAI between (swiglu_oai: gate clamped above at 7, up clamped
  to +-7, gate * sigmoid(1.702 gate) * (up + 1)).
"""
from __future__ import annotations

import numpy as np

from engine.arch import tensors
from engine.arch.base import Transformer, apply_rope
from engine.model_config import ModelError

ARCHS = ("gpt-oss",)
EXPERTS = True
FUSED_QKV = False

# llama.cpp's build_moe_ffn, case LLM_FFN_SWIGLU_OAI_MOE (constants there, not GGUF keys)
SWIGLU_ALPHA = np.float32(1.702)
SWIGLU_LIMIT = np.float32(7.0)


def configure(cfg, get, model) -> None:
    """The gpt-oss keys llama.cpp reads (llama_model_openai_moe::load_arch_hparams)."""
    name, md = model.path.name, model.metadata
    n_swa = md.get("gpt-oss.attention.sliding_window")
    if not isinstance(n_swa, int) or n_swa <= 0:
        raise ModelError(f"{name} lacks gpt-oss.attention.sliding_window (a positive window); the file is incomplete")
    cfg.n_swa = n_swa
    pattern = md.get("gpt-oss.attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):           # one flag per layer
        if len(pattern) != cfg.n_layer:
            raise ModelError(f"{name}: gpt-oss.attention.sliding_window_pattern has {len(pattern)} entries for "
                             f"{cfg.n_layer} layers; the file is damaged")
        cfg.swa_layers = tuple(bool(p) for p in pattern)
    else:                                    # every n-th layer dense, the others windowed (llama_hparams::set_swa_pattern)
        n = int(pattern)
        cfg.swa_layers = tuple(n == 0 or il % n < n - 1 for il in range(cfg.n_layer))
    if cfg.rope_scaling == "yarn":
        # llama.cpp reads no yarn_* key for gpt-oss: ext factor 1, betas 32 and 1, and the attention factor is
        # rope.scaling.attn_factor alone (llama_context cancels get_mscale's factor, ggml's rope_yarn applies it)
        cfg.yarn_ext_factor, cfg.yarn_beta_fast, cfg.yarn_beta_slow = 1.0, 32.0, 1.0
        cfg.yarn_attn_factor = float(md.get("gpt-oss.rope.scaling.attn_factor", 1.0) or 1.0)
    base_swa = md.get("gpt-oss.rope.freq_base_swa")
    if base_swa is not None and float(base_swa) != cfg.rope_base:
        raise ModelError(f"{name}: gpt-oss.rope.freq_base_swa={base_swa} differs from rope.freq_base="
                         f"{cfg.rope_base}, which this engine does not support")


def check_tensors(model) -> None:
    """The standard layer's tensors (post_attention_norm before the experts), then gpt-oss's sinks and biases."""
    tensors.check_standard(model, GptOss.ffn_norm)
    cfg, name = model.config, model.path.name
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        for t, shape in ((b + "attn_sinks.weight", (cfg.n_head,)), (b + "attn_output.bias", (cfg.n_embd,)),
                         (b + "attn_q.bias", (cfg.n_head * cfg.head_dim,)),
                         (b + "attn_k.bias", (cfg.n_head_kv * cfg.head_dim,)),
                         (b + "attn_v.bias", (cfg.n_head_kv * cfg.head_dim_v,)),
                         (b + "ffn_gate_inp.bias", (cfg.n_expert,)),
                         (b + "ffn_gate_exps.bias", (cfg.n_expert, cfg.n_ff_exp)),
                         (b + "ffn_up_exps.bias", (cfg.n_expert, cfg.n_ff_exp)),
                         (b + "ffn_down_exps.bias", (cfg.n_expert, cfg.n_embd))):
            got = model.tensor(t).shape
            if got != shape:
                raise ModelError(f"{name}: tensor {t} has shape {got}, expected {shape}; the file is damaged")


# --- the pieces the GPU kernels mirror ----------------------------------------------------------------------------

def window_mask(pos0: int, n_new: int, n_ctx: int, n_swa: int) -> np.ndarray:
    """(n_new, n_ctx) True where query pos0+i must not see key j: the future, and with n_swa > 0 keys n_swa or more
    positions back (llama_hparams::is_masked_swa, LLAMA_SWA_TYPE_STANDARD: masked when p1 - p0 >= n_swa)."""
    q = pos0 + np.arange(n_new)[:, None]
    k = np.arange(n_ctx)[None, :]
    masked = k > q
    if n_swa > 0:
        masked |= q - k >= n_swa
    return masked


def sink_softmax(scores: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """Softmax over the last axis with one extra logit per head that takes probability mass but adds no value.

    scores (H, T, S), masked entries -inf; sinks (H,). As ggml's soft_max with sinks: the max includes the sink and
    the denominator adds exp(sink - max); the returned rows sum to less than 1.
    """
    s = sinks.astype(np.float32)[:, None, None]
    m = np.maximum(np.max(scores, axis=-1, keepdims=True), s)
    e = np.exp(scores - m)
    return e / (np.sum(e, axis=-1, keepdims=True) + np.exp(s - m))


def route_softmax_weight(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top k experts by logit, weighted by a softmax over their k logits only: (ids (T, k), weights (T, k))."""
    logits = logits.astype(np.float32)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    chosen = np.take_along_axis(logits, ids, axis=-1)
    e = np.exp(chosen - chosen.max(axis=-1, keepdims=True))
    return ids, e / e.sum(axis=-1, keepdims=True)


def swiglu_oai(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """ggml's SWIGLU_OAI: x = min(gate, limit), y = clamp(up, -limit, limit), x * sigmoid(alpha x) * (y + 1)."""
    x = np.minimum(gate, SWIGLU_LIMIT)
    y = np.clip(up, -SWIGLU_LIMIT, SWIGLU_LIMIT)
    return x / (np.float32(1.0) + np.exp(-SWIGLU_ALPHA * x)) * (y + np.float32(1.0))


# --- the model ----------------------------------------------------------------------------------------------------

class GptOss(Transformer):
    ffn_norm = "post_attention_norm.weight"

    def qkv(self, il: int, x: np.ndarray, pos0: int):
        """q (T, H, D), k and v (T, Hkv, D): projections plus biases, q and k turned by RoPE at pos0.."""
        cfg, w, b = self.cfg, self.w, f"blk.{il}."
        T = len(x)
        q, k, v = (x @ w.get(b + f"attn_{n}.weight").T + w.get(b + f"attn_{n}.bias") for n in "qkv")
        q = q.reshape(T, cfg.n_head, cfg.head_dim)
        k = k.reshape(T, cfg.n_head_kv, cfg.head_dim)
        v = v.reshape(T, cfg.n_head_kv, cfg.head_dim_v)
        cos, sin = self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T]
        return apply_rope(q, cos, sin, cfg.n_rot, True), apply_rope(k, cos, sin, cfg.n_rot, True), v

    def attention(self, il: int, x: np.ndarray, pos0: int, kv) -> np.ndarray:
        cfg, w, b = self.cfg, self.w, f"blk.{il}."
        T, H, Hkv, Dv = len(x), cfg.n_head, cfg.n_head_kv, cfg.head_dim_v
        q, k, v = self.qkv(il, x, pos0)
        S = pos0 + T
        kv.k[il][:, pos0:S] = k.transpose(1, 0, 2)
        kv.v[il][:, pos0:S] = v.transpose(1, 0, 2)
        # Only the keys some query of this chunk may see: with a window, the older ones are all masked.
        lo = max(0, pos0 - cfg.n_swa + 1) if cfg.is_swa(il) else 0
        K, V = kv.k[il][:, lo:S], kv.v[il][:, lo:S]
        G = H // Hkv
        qg = q.reshape(T, Hkv, G, cfg.head_dim).transpose(1, 2, 0, 3).reshape(Hkv, G * T, cfg.head_dim)
        scores = (qg @ K.transpose(0, 2, 1)) * np.float32(self.attn_scale)
        scores = scores.reshape(Hkv * G, T, S - lo)      # query head h = kv head h // G, as the sinks are indexed
        masked = window_mask(pos0 - lo, T, S - lo, cfg.n_swa if cfg.is_swa(il) else 0)
        scores[:, masked] = -np.inf
        p = sink_softmax(scores, w.get(b + "attn_sinks.weight")).reshape(Hkv, G * T, S - lo)
        out = (p @ V).reshape(Hkv, G, T, Dv).transpose(2, 0, 1, 3).reshape(T, H * Dv)
        return out @ w.get(b + "attn_output.weight").T + w.get(b + "attn_output.bias")

    def router(self, il: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b = f"blk.{il}."
        logits = x @ self.w.get(b + "ffn_gate_inp.weight").T + self.w.get(b + "ffn_gate_inp.bias")
        return route_softmax_weight(logits, self.cfg.n_expert_used)

    def ffn(self, il: int, x: np.ndarray, decoding: bool) -> np.ndarray:
        ids, weights = self.router(il, x)
        b = f"blk.{il}."
        bg, bu, bd = (self.w.get(b + f"ffn_{n}_exps.bias") for n in ("gate", "up", "down"))
        out = np.zeros_like(x)
        for e in np.unique(ids):
            rows, slot = np.nonzero(ids == e)
            gate, up, down = self.w.expert(il, int(e), decoding)
            xe = x[rows]
            h = swiglu_oai(xe @ gate.T + bg[e], xe @ up.T + bu[e])
            out[rows] += weights[rows, slot][:, None] * (h @ down.T + bd[e])
        return out


MODEL = GptOss
