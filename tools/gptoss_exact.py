"""Exact arithmetic for a gpt-oss GGUF: a float64 forward over gguf.quants.dequantize'd weights (docs/design.md).

    logits = exact_logits(path, token_ids)          # (len(token_ids), n_vocab) float64, causal, all positions

tools/exact_forward.py's counterpart for gpt-oss, written apart from engine/arch/gptoss.py in the same spirit (its
own reader, gguf.GGUFReader, and its own loops: per head, per token, per chosen expert) from llama.cpp's graph
(src/models/openai-moe.cpp) and ggml's CPU ops (rope_yarn, soft_max with sinks, swiglu_oai).
"""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np

ARCH = "gpt-oss"


def _reader(path):
    r = gguf.GGUFReader(Path(path))
    meta = {k: f.contents() for k, f in r.fields.items()}
    if meta.get("general.architecture") != ARCH:
        raise ValueError(f"{path} is not a gpt-oss model")
    cache = {}
    tensors = {t.name: t for t in r.tensors}

    def w(name):
        if name not in cache:
            t = tensors[name]
            x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            cache[name] = x.reshape(tuple(int(d) for d in reversed(t.shape)))
        return cache[name]
    return meta, w


def _rope_cos_sin(pos: int, d: int, base: float, factor: float, n_orig: int):
    """ggml's rope_yarn for one position: (cos, sin) of each of the d/2 pairs, mscale included."""
    def corr_dim(n_rot):
        return d * math.log(n_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(0.0, math.floor(corr_dim(32.0))), min(d - 1.0, math.ceil(corr_dim(1.0)))
    freq_scale = 1.0 / factor
    cos, sin = np.empty(d // 2), np.empty(d // 2)
    for i in range(d // 2):
        extrap = pos * base ** (-2.0 * i / d)
        ramp = 1.0 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))
        theta = freq_scale * extrap * (1.0 - ramp) + extrap * ramp
        mscale = 1.0 + 0.1 * math.log(factor)
        cos[i], sin[i] = math.cos(theta) * mscale, math.sin(theta) * mscale
    return cos, sin


def _neox(v, cos, sin):
    h = len(v) // 2
    a, b = v[:h], v[h:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos])


def _rms(x, w, eps):
    return x / math.sqrt(float(np.mean(x * x)) + eps) * w


def exact_logits(path, tokens) -> np.ndarray:
    md, W = _reader(path)
    g = lambda k, d=None: md.get(f"{ARCH}.{k}", d)   # noqa: E731
    n_layer, n_head, n_kv = int(g("block_count")), int(g("attention.head_count")), int(g("attention.head_count_kv"))
    d = int(g("attention.key_length"))
    eps, base = float(g("attention.layer_norm_rms_epsilon")), float(g("rope.freq_base"))
    n_swa, k_used = int(g("attention.sliding_window")), int(g("expert_used_count"))
    pattern = int(g("attention.sliding_window_pattern", 2))
    factor = float(g("rope.scaling.factor", 1.0)) if g("rope.scaling.type") == "yarn" else 1.0
    n_orig = int(g("rope.scaling.original_context_length", g("context_length")))
    T = len(tokens)
    rot = [_rope_cos_sin(p, d, base, factor, n_orig) for p in range(T)]
    x = W("token_embd.weight")[list(tokens)].copy()
    for il in range(n_layer):
        b = f"blk.{il}."
        swa = il % pattern < pattern - 1
        h = np.array([_rms(r, W(b + "attn_norm.weight"), eps) for r in x])
        q = (h @ W(b + "attn_q.weight").T + W(b + "attn_q.bias")).reshape(T, n_head, d)
        k = (h @ W(b + "attn_k.weight").T + W(b + "attn_k.bias")).reshape(T, n_kv, d)
        v = (h @ W(b + "attn_v.weight").T + W(b + "attn_v.bias")).reshape(T, n_kv, d)
        for p in range(T):
            q[p] = [_neox(q[p, j], *rot[p]) for j in range(n_head)]
            k[p] = [_neox(k[p, j], *rot[p]) for j in range(n_kv)]
        sinks = W(b + "attn_sinks.weight")
        att = np.zeros((T, n_head * d))
        for p in range(T):
            seen = [s for s in range(p + 1) if not (swa and p - s >= n_swa)]
            for j in range(n_head):
                kv = j // (n_head // n_kv)
                scores = np.array([q[p, j] @ k[s, kv] for s in seen]) / math.sqrt(d)
                m = max(scores.max(), sinks[j])
                e = np.exp(scores - m)
                prob = e / (e.sum() + math.exp(sinks[j] - m))
                att[p, j * d:(j + 1) * d] = prob @ v[seen, kv]
        x = x + att @ W(b + "attn_output.weight").T + W(b + "attn_output.bias")
        h = np.array([_rms(r, W(b + "post_attention_norm.weight"), eps) for r in x])
        logits = h @ W(b + "ffn_gate_inp.weight").T + W(b + "ffn_gate_inp.bias")
        moe = np.zeros_like(x)
        for p in range(T):
            chosen = sorted(range(len(logits[p])), key=lambda e: (-logits[p, e], e))[:k_used]
            z = np.exp(logits[p, chosen] - logits[p, chosen].max())
            for wgt, e in zip(z / z.sum(), chosen):
                gate = W(b + "ffn_gate_exps.weight")[e] @ h[p] + W(b + "ffn_gate_exps.bias")[e]
                up = W(b + "ffn_up_exps.weight")[e] @ h[p] + W(b + "ffn_up_exps.bias")[e]
                xg, yu = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
                act = xg / (1.0 + np.exp(-1.702 * xg)) * (yu + 1.0)
                moe[p] += wgt * (W(b + "ffn_down_exps.weight")[e] @ act + W(b + "ffn_down_exps.bias")[e])
        x = x + moe
    h = np.array([_rms(r, W("output_norm.weight"), eps) for r in x])
    return h @ W("output.weight").T
