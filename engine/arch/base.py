"""The parts every family shares: float32 weights, RoPE, GQA attention with a KV cache, RMSNorm, the standard layer.

Transformer is a pre-norm decoder. The families built on it (dense.py, qwen3moe.py, qwen2moe.py) differ only in
their feed-forward block; the attention variants (q/k norms, biases) follow the tensors the GGUF holds, as in
llama.cpp. gpt-oss (gptoss.py) also replaces the attention (sinks, a sliding window) and names its FFN norm
post_attention_norm. The hybrids (qwen3next.py) override forward itself: three layers of four run a recurrent mixer
in place of the attention, over a cache that holds their state.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from engine.backend import ExpertStats
from engine.model_config import ModelConfig


class Weights:
    """float32 weights from the GGUF: dense ones dequantized once and kept; experts through a bounded LRU.

    model: an engine.gguf_model.GGUFModel, which dequantizes (dequant, dequant_rows, dequant_expert)."""

    def __init__(self, model, expert_cache_mb: float = 256.0):
        self.model = model
        self._dense: dict[str, np.ndarray] = {}
        self._experts: OrderedDict[tuple[int, int], tuple[np.ndarray, ...]] = OrderedDict()
        self._expert_bytes = 0
        self.expert_cache_bytes = int(expert_cache_mb * 2**20)
        self.stats = ExpertStats()

    def get(self, name: str) -> np.ndarray:
        w = self._dense.get(name)
        if w is None:
            w = self.model.dequant(name)
            self._dense[name] = w
        return w

    def opt(self, name: str) -> np.ndarray | None:
        return self.get(name) if self.model.has(name) else None

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows of a matrix (the embedding lookup) without dequantizing all of it, unless it is kept anyway."""
        if name in self._dense:
            return self._dense[name][ids]
        return self.model.dequant_rows(name, ids)

    def expert(self, layer: int, e: int, decoding: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate, up, down) of one expert as float32; the least recently used ones are dropped past the budget."""
        key = (layer, e)
        if decoding:
            self.stats.lookups += 1
        hit = self._experts.get(key)
        if hit is not None:
            self._experts.move_to_end(key)
            if decoding:
                self.stats.hits += 1
            return hit
        kinds = ("gate", "up", "down")
        mats = tuple(self.model.dequant_expert(layer, kind, e) for kind in kinds)
        self.stats.file_blobs += 1
        self.stats.file_mb += sum(self.model.expert_bytes(layer, kind, e).nbytes for kind in kinds) / 2**20
        size = sum(m.nbytes for m in mats)
        self._experts[key] = mats
        self._expert_bytes += size
        while self._expert_bytes > self.expert_cache_bytes and len(self._experts) > 1:
            _, old = self._experts.popitem(last=False)
            self._expert_bytes -= sum(m.nbytes for m in old)
        return mats


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def rope_tables(cfg: ModelConfig, n_pos: int, freq_factors: np.ndarray | None = None):
    """cos and sin (n_pos, n_rot/2) as ggml's rope computes them, with linear or YaRN scaling applied.

    freq_factors (n_rot/2): the `rope_freqs.weight` tensor of Llama 3.1-style GGUFs, dividing each frequency.
    """
    half = cfg.n_rot // 2
    i = np.arange(half, dtype=np.float64)
    freq = cfg.rope_base ** (-2.0 * i / cfg.n_rot)
    if freq_factors is not None:
        freq = freq / np.asarray(freq_factors, dtype=np.float64)
    theta_extrap = np.arange(n_pos, dtype=np.float64)[:, None] * freq[None, :]
    theta = theta_extrap * cfg.rope_freq_scale
    mscale = 1.0
    if cfg.rope_scaling == "yarn" and cfg.yarn_ext_factor != 0.0:
        # YaRN: dimensions that turn fast keep their original frequency, slow ones are interpolated, and a
        # ramp blends the two; attention is rescaled to make up for the lost entropy.
        def corr_dim(n_rot_turns):
            return cfg.n_rot * math.log(cfg.rope_n_ctx_orig / (n_rot_turns * 2 * math.pi)) / (2 * math.log(cfg.rope_base))
        low = max(0.0, math.floor(corr_dim(cfg.yarn_beta_fast)))
        high = min(cfg.n_rot - 1.0, math.ceil(corr_dim(cfg.yarn_beta_slow)))
        ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
        mix = ramp * cfg.yarn_ext_factor
        theta = theta * (1.0 - mix) + theta_extrap * mix
        mscale = cfg.yarn_attn_factor * (1.0 + 0.1 * math.log(1.0 / cfg.rope_freq_scale))
    elif cfg.rope_scaling == "yarn":
        mscale = cfg.yarn_attn_factor
    return (np.cos(theta) * mscale).astype(np.float32), (np.sin(theta) * mscale).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, neox: bool) -> np.ndarray:
    """x (T, heads, head_dim); cos/sin (T, n_rot/2). Only the first n_rot dimensions of each head turn."""
    c, s = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    if neox:   # pairs (i, i + n_rot/2)
        half = n_rot // 2
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * c - b * s
        out[..., half:n_rot] = a * s + b * c
    else:      # pairs (2i, 2i+1)
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * c - b * s
        out[..., 1:n_rot:2] = a * s + b * c
    return out


class KVCache:
    """float32 K and V per layer, (n_head_kv, capacity, head_dim), grown by doubling up to max_context.

    kv_layers: the layers that attend (default all); the others (a hybrid's recurrent layers) keep empty arrays.
    """

    def __init__(self, cfg: ModelConfig, max_context: int, kv_layers=None, dtype=np.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.max_context = max_context
        self.capacity = 0
        self.kv_layers = frozenset(range(cfg.n_layer) if kv_layers is None else kv_layers)
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []

    def ensure(self, n: int) -> None:
        if n > self.max_context:
            raise ValueError(f"{n} positions exceed the context of {self.max_context}")
        if n <= self.capacity:
            return
        cap = min(self.max_context, max(n, 2 * self.capacity, 256))
        cfg = self.cfg
        for lst, d in ((self.k, cfg.head_dim), (self.v, cfg.head_dim_v)):
            for i in range(cfg.n_layer):
                new = np.zeros((cfg.n_head_kv, cap if i in self.kv_layers else 0, d), dtype=self.dtype)
                if self.capacity:
                    new[:, :self.capacity] = lst[i]
                if len(lst) > i:
                    lst[i] = new
                else:
                    lst.append(new)
        self.capacity = cap


class Observer:
    """What a bench may watch of the forward (bench.routing, bench.prefetch_predictors): each layer's normed input to
    its attention (or other mixer) and to its feed-forward block, (T, n_embd). This one watches nothing."""

    def attention_input(self, il: int, x: np.ndarray) -> None:
        pass

    def ffn_input(self, il: int, x: np.ndarray) -> None:
        pass

    def window(self, n: int) -> None:
        """The next n forwards, of one row each, are one verify window's tokens (engine/backend_cpu.py)."""


class Transformer:
    """A pre-norm decoder: attention then a feed-forward block per layer. Families override ffn()."""

    recurrent = False    # True: the cache also holds a recurrent state (engine/backend.py says what follows)
    last_hidden = None   # head()'s normed rows of the last forward (None: a family whose head keeps none)
    ffn_norm = "ffn_norm.weight"   # the norm before the feed-forward block (llama.cpp's name, without blk.N.)

    def __init__(self, model, weights: Weights, max_context: int, observer: Observer | None = None):
        self.model = model
        self.observer = observer or Observer()
        self.cfg = model.config
        self.w = weights
        self.cos, self.sin = rope_tables(self.cfg, max_context, weights.opt("rope_freqs.weight"))
        cfg = self.cfg
        self.attn_scale = cfg.attn_scale or 1.0 / math.sqrt(cfg.head_dim)
        self.output_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"

    def new_cache(self, max_context: int) -> KVCache:
        return KVCache(self.cfg, max_context)

    # What a family counts beyond the experts (qwen4exp: its n-gram row cache), for the backend's INFO lines.
    def info(self) -> dict:
        return {}

    def request_info(self) -> dict:
        return {}

    def reset_stats(self) -> None:
        pass

    def warm(self) -> None:
        """Dequantize every dense weight now, so that the first request does not pay for it."""
        for name in self.model.tensor_names():
            if "_exps." not in name and name != "token_embd.weight":
                self.w.get(name)
        self.w.get(self.output_name)

    def forward(self, tokens: np.ndarray, pos0: int, kv: KVCache, all_logits: bool) -> np.ndarray:
        cfg = self.cfg
        x = self.w.rows("token_embd.weight", tokens)
        T = len(tokens)
        kv.ensure(pos0 + T)
        decoding = T == 1
        for il in range(cfg.n_layer):
            b = f"blk.{il}."
            h = rms_norm(x, self.w.get(b + "attn_norm.weight"), cfg.rms_eps)
            self.observer.attention_input(il, h)
            x = x + self.attention(il, h, pos0, kv)
            h = rms_norm(x, self.w.get(b + self.ffn_norm), cfg.rms_eps)
            self.observer.ffn_input(il, h)
            x = x + self.ffn(il, h, decoding)
        return self.head(x, all_logits)

    def head(self, x: np.ndarray, all_logits: bool) -> np.ndarray:
        """The output norm and the vocabulary projection: logits of every row, or of the last one. The normed rows of
        every token stay in last_hidden (what an MTP drafter reads: engine/backend.py hidden())."""
        h = rms_norm(x, self.w.get("output_norm.weight"), self.cfg.rms_eps)
        self.last_hidden = h
        logits = (h if all_logits else h[-1:]) @ self.w.get(self.output_name).T
        return logits if all_logits else logits[0]

    def attention(self, il: int, x: np.ndarray, pos0: int, kv: KVCache) -> np.ndarray:
        cfg, w, b = self.cfg, self.w, f"blk.{il}."
        T, H, Hkv, D, Dv = len(x), cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v
        q, k, v = (x @ w.get(b + f"attn_{n}.weight").T for n in "qkv")
        if cfg.attn_bias:
            q, k, v = q + w.get(b + "attn_q.bias"), k + w.get(b + "attn_k.bias"), v + w.get(b + "attn_v.bias")
        q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, Dv)
        if cfg.qk_norm:
            q = rms_norm(q, w.get(b + "attn_q_norm.weight"), cfg.rms_eps)
            k = rms_norm(k, w.get(b + "attn_k_norm.weight"), cfg.rms_eps)
        cos, sin = self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T]
        neox = cfg.rope_type == "neox"
        q = apply_rope(q, cos, sin, cfg.n_rot, neox)
        k = apply_rope(k, cos, sin, cfg.n_rot, neox)
        out = self.attend(il, q, k, v, pos0, kv) @ w.get(b + "attn_output.weight").T
        bo = w.opt(b + "attn_output.bias")
        return out + bo if bo is not None else out

    def attend(self, il: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, kv: KVCache) -> np.ndarray:
        """Causal attention of q (T, H, D) over the cache after appending k, v (T, Hkv, D|Dv): (T, H * Dv)."""
        T, H, Hkv, D = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
        Dv = v.shape[2]
        S = pos0 + T
        kv.k[il][:, pos0:S] = k.transpose(1, 0, 2)
        kv.v[il][:, pos0:S] = v.transpose(1, 0, 2)
        K, V = kv.k[il][:, :S], kv.v[il][:, :S]
        G = H // Hkv
        # Query head h reads KV head h // G: group the queries of one KV head into one matmul.
        qg = q.reshape(T, Hkv, G, D).transpose(1, 2, 0, 3).reshape(Hkv, G * T, D)
        scores = (qg @ K.transpose(0, 2, 1)) * np.float32(self.attn_scale)
        scores = scores.reshape(Hkv, G, T, S)
        if T > 1:
            future = np.arange(S)[None, :] > (pos0 + np.arange(T))[:, None]
            scores[:, :, future] = -np.inf
        p = softmax(scores).reshape(Hkv, G * T, S)
        return (p @ V).reshape(Hkv, G, T, Dv).transpose(2, 0, 1, 3).reshape(T, H * Dv)

    def ffn(self, il: int, x: np.ndarray, decoding: bool) -> np.ndarray:
        raise NotImplementedError


def dense_ffn(w: Weights, prefix: str, x: np.ndarray, suffix: str = "") -> np.ndarray:
    return swiglu(x, w.get(f"{prefix}ffn_gate{suffix}.weight"), w.get(f"{prefix}ffn_up{suffix}.weight"),
                  w.get(f"{prefix}ffn_down{suffix}.weight"))


def route(logits: np.ndarray, k: int, renormalize: bool, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts, then the top k: (ids (T, k), weights (T, k)), as llama.cpp's build_moe_ffn."""
    logits = logits.astype(np.float32)
    probs = softmax(logits)
    # ranked on the logits: the same order as the probabilities, except where those underflow to ties at 0 (weight 0
    # either way); the CUDA routers rank the same way, so the two pick the same experts there too
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if renormalize:
        weights = weights / np.sum(weights, axis=-1, keepdims=True)
    if scale != 1.0:
        weights = weights * np.float32(scale)
    return ids, weights


def moe_ffn(w: Weights, il: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, decoding: bool) -> np.ndarray:
    """Each used expert once, on the rows routed to it; experts come dequantized from the LRU."""
    out = np.zeros_like(x)
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        gate, up, down = w.expert(il, int(e), decoding)
        out[rows] += weights[rows, slot][:, None] * swiglu(x[rows], gate, up, down)
    return out
