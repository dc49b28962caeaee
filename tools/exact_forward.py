"""Exact arithmetic for a GGUF: a float64 forward over dequantized weights (docs/design.md's yardstick).

    logits = exact_logits(path, token_ids)          # (len(token_ids), n_vocab) float64, causal, all positions

Written apart from the engine (its own loops and tensor layouts) so that it checks the CPU backend rather than
repeating it. It shares the engine's header reader and dequantizer (engine.quant_types: gguf.quants, and for Q2_0
and Q1_0, which gguf.GGUFReader cannot even list, engine.quant_blocks, checked against llama.cpp's own floats).
It follows llama.cpp's graphs for the architectures the engine runs: llama (dense, or mixtral-style with
experts), qwen2, qwen3, qwen2moe, qwen3moe; fused attn_qkv and ffn_gate_up_exps tensors and 1-D router rows load
as llama.cpp loads them. Other architectures raise ExactError: add theirs here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.gguf_model import read_header
from engine.quant_types import QT, byte_shape, dequantize

ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")


class ExactError(Exception):
    pass


@dataclass
class _Tensor:
    name: str
    tensor_type: QT
    shape: tuple[int, ...]     # ggml order (ne0 first), as gguf.GGUFReader gives it
    data: np.ndarray           # raw bytes, (..., bytes a row)


class _Weights:
    def __init__(self, path: Path):
        h = read_header(path)
        self.metadata = h.metadata
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        self.t = {}
        for r in h.tensors:
            q = QT(r.type_id)
            shape = byte_shape(tuple(reversed(r.dims)), q)
            start = h.data_offset + r.offset
            data = mm[start:start + int(np.prod(shape, dtype=np.int64))].reshape(shape)
            self.t[r.name] = _Tensor(r.name, q, r.dims, data)
        self.cache: dict[str, np.ndarray] = {}

    def meta(self, key: str, default=None):
        return self.metadata.get(key, default)

    def has(self, name: str) -> bool:
        return name in self.t

    def get(self, name: str) -> np.ndarray:
        """float64, numpy order (rows first), with llama.cpp's ggml shape (trailing unit dims dropped)."""
        if name not in self.cache:
            t = self.t[name]
            x = dequantize(np.asarray(t.data), t.tensor_type)
            shape = tuple(int(d) for d in reversed(t.shape))
            self.cache[name] = np.asarray(x, dtype=np.float64).reshape(shape)
        return self.cache[name]


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _rope(x, pos, n_rot, base, neox):
    """x (T, heads, d): llama.cpp's rope; neox turns pairs (i, i + n_rot/2), norm turns (2i, 2i+1)."""
    half = n_rot // 2
    theta = pos[:, None] * base ** (-2.0 * np.arange(half) / n_rot)[None, :]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half], out[..., half:n_rot] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2], out[..., 1:n_rot:2] = a * c - b * s, a * s + b * c
    return out


def _none(name, x, expert=None):
    pass


def exact_logits(path, tokens, collect=None) -> np.ndarray:
    """collect(tensor name, input rows (n, n_in), expert or None) sees every matrix product's input (imatrix)."""
    seen = collect or _none
    w = _Weights(Path(path))
    arch = w.meta("general.architecture")
    if arch not in ARCHS:
        raise ExactError(f"exact_forward has no graph for architecture {arch!r}; it knows {', '.join(ARCHS)}")
    if w.meta(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise ExactError("exact_forward applies no RoPE scaling; the fixtures use none")

    def hp(key, default=None):
        return w.meta(f"{arch}.{key}", default)

    n_layer, n_embd = int(hp("block_count")), int(hp("embedding_length"))
    H = int(hp("attention.head_count"))
    Hkv = int(hp("attention.head_count_kv", H))
    D = int(hp("attention.key_length", n_embd // H))
    Dv = int(hp("attention.value_length", D))
    eps = float(hp("attention.layer_norm_rms_epsilon", 1e-5))
    base = float(hp("rope.freq_base", 10000.0))
    n_rot = int(hp("rope.dimension_count", D))
    n_used = int(hp("expert_used_count", 0) or 0)
    scale = float(hp("attention.scale", 0.0) or 0.0) or 1.0 / np.sqrt(D)
    neox = arch != "llama"

    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    x = w.get("token_embd.weight")[tokens]
    for il in range(n_layer):
        b = f"blk.{il}."
        h = _rms(x, w.get(b + "attn_norm.weight"), eps)
        for n in ("attn_qkv", "attn_q", "attn_k", "attn_v"):
            if w.has(b + n + ".weight"):
                seen(b + n + ".weight", h)
        if w.has(b + "attn_qkv.weight"):
            qkv = h @ w.get(b + "attn_qkv.weight").T
            if w.has(b + "attn_qkv.bias"):
                qkv = qkv + w.get(b + "attn_qkv.bias")
            q, k, v = np.split(qkv, [H * D, H * D + Hkv * D], axis=-1)
        else:
            q, k, v = (h @ w.get(b + f"attn_{n}.weight").T for n in "qkv")
        if w.has(b + "attn_q.bias"):
            q, k, v = q + w.get(b + "attn_q.bias"), k + w.get(b + "attn_k.bias"), v + w.get(b + "attn_v.bias")
        q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, Dv)
        if w.has(b + "attn_q_norm.weight"):
            q = _rms(q, w.get(b + "attn_q_norm.weight"), eps)
            k = _rms(k, w.get(b + "attn_k_norm.weight"), eps)
        q, k = _rope(q, pos, n_rot, base, neox), _rope(k, pos, n_rot, base, neox)
        att = np.empty((T, H, Dv))
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for hh in range(H):
            kh = hh // (H // Hkv)
            p = _softmax(q[:, hh] @ k[:, kh].T * scale + mask)
            att[:, hh] = p @ v[:, kh]
        seen(b + "attn_output.weight", att.reshape(T, H * Dv))
        o = att.reshape(T, H * Dv) @ w.get(b + "attn_output.weight").T
        if w.has(b + "attn_output.bias"):
            o = o + w.get(b + "attn_output.bias")
        x = x + o
        h = _rms(x, w.get(b + "ffn_norm.weight"), eps)
        x = x + (_moe(w, b, h, n_used, arch != "qwen2moe", seen) if w.has(b + "ffn_gate_inp.weight")
                 else _swiglu(h, w, b, "ffn_{}.weight", seen))
    x = _rms(x, w.get("output_norm.weight"), eps)
    seen("output.weight" if w.has("output.weight") else "token_embd.weight", x)
    head = w.get("output.weight") if w.has("output.weight") else w.get("token_embd.weight")
    return x @ head.T


def _swiglu(x, w, b, pattern, seen, e=None):
    """down(silu(gate x) * up x); pattern names the tensors, e picks one expert of a 3-D stack."""
    def mat(kind):
        m = w.get(b + pattern.format(kind))
        return m if e is None else m[e]
    if w.has(b + pattern.format("gate_up")):   # fused experts: gate rows first, then up rows, per expert
        gu = mat("gate_up")
        gate, up = np.split(gu, 2, axis=0)
        seen(b + pattern.format("gate_up"), x, e)
    else:
        gate, up = mat("gate"), mat("up")
        seen(b + pattern.format("gate"), x, e)
        seen(b + pattern.format("up"), x, e)
    a = _silu(x @ gate.T) * (x @ up.T)
    seen(b + pattern.format("down"), a, e)
    return a @ mat("down").T


def _moe(w: _Weights, b: str, x, k: int, renorm: bool, seen):
    seen(b + "ffn_gate_inp.weight", x)
    probs = _softmax(x @ w.get(b + "ffn_gate_inp.weight").T)
    out = np.zeros_like(x)
    for t in range(len(x)):
        ids = np.argsort(-probs[t], kind="stable")[:k]
        wt = probs[t, ids]
        if renorm:
            wt = wt / wt.sum()
        for e, we in zip(ids, wt):
            out[t] += we * _swiglu(x[t:t + 1], w, b, "ffn_{}_exps.weight", seen, int(e))[0]
    if w.has(b + "ffn_up_shexp.weight"):
        shared = _swiglu(x, w, b, "ffn_{}_shexp.weight", seen)
        if w.has(b + "ffn_gate_inp_shexp.weight"):
            seen(b + "ffn_gate_inp_shexp.weight", x)
            g = x @ w.get(b + "ffn_gate_inp_shexp.weight").reshape(-1, x.shape[-1]).T   # (T, 1), 1-D or [1, n]
            shared = shared / (1.0 + np.exp(-g))
        out = out + shared
    return out
