"""The CPU backend against a deliberately naive float64 forward written here from the definitions (one token, one
head, one rotation pair at a time), on small random models of every family: qwen2 (biases), qwen3 (q/k norms,
wide heads), mixtral-style llama MoE, qwen3moe, qwen2moe (shared expert), and RoPE with linear and YaRN scaling.
llama.cpp itself is the reference in test_reference.py; this covers what its fixtures do not."""
from __future__ import annotations

import math

import numpy as np
import pytest

from engine.arch.base import apply_rope, rope_tables
from engine.backend_cpu import CPUBackend
from engine.gguf_model import open_model
from test_gguf_model import tiny_model, tiny_tensors, write_gguf

RENORMALIZE = {"llama": True, "qwen3moe": True, "qwen2moe": False}   # llama.cpp's build_moe_ffn arguments


def naive_rope(vec, pos, cfg, freq_factors=None):
    out = vec.copy()
    half = cfg.n_rot // 2
    for i in range(half):
        freq = cfg.rope_base ** (-2.0 * i / cfg.n_rot) / (1.0 if freq_factors is None else freq_factors[i])
        theta_ext = pos * freq
        theta = theta_ext * cfg.rope_freq_scale
        mscale = 1.0
        if cfg.rope_scaling == "yarn":
            dim = lambda beta: cfg.n_rot * math.log(cfg.rope_n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(cfg.rope_base))
            lo, hi = max(0, math.floor(dim(cfg.yarn_beta_fast))), min(cfg.n_rot - 1, math.ceil(dim(cfg.yarn_beta_slow)))
            y = (i - lo) / max(0.001, hi - lo)
            mix = (1 - min(1, max(0, y))) * cfg.yarn_ext_factor
            theta = theta * (1 - mix) + theta_ext * mix
            mscale = cfg.yarn_attn_factor * (1 + 0.1 * math.log(1 / cfg.rope_freq_scale))
        a, b = (i, i + half) if cfg.rope_type == "neox" else (2 * i, 2 * i + 1)
        c, s = math.cos(theta) * mscale, math.sin(theta) * mscale
        out[a] = vec[a] * c - vec[b] * s
        out[b] = vec[a] * s + vec[b] * c
    return out


def naive_logits(model, tokens):
    cfg = model.config
    W = lambda n: model.dequant(n).astype(np.float64)
    has = model.has
    rms = lambda v, w: v / np.sqrt(np.mean(v * v) + cfg.rms_eps) * w
    silu = lambda v: v / (1 + np.exp(-v))
    ffn = lambda v, g, u, d: d @ (silu(g @ v) * (u @ v))
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    ff = W("rope_freqs.weight") if has("rope_freqs.weight") else None
    x = W("token_embd.weight")[tokens]
    for il in range(cfg.n_layer):
        b = f"blk.{il}."
        ks, vs, out = [], [], []
        for t in range(len(tokens)):
            h = rms(x[t], W(b + "attn_norm.weight"))
            q, k, v = (W(b + f"attn_{n}.weight") @ h + (W(b + f"attn_{n}.bias") if has(b + f"attn_{n}.bias") else 0)
                       for n in "qkv")
            q, k, v = q.reshape(H, D), k.reshape(Hkv, D), v.reshape(Hkv, D)
            if has(b + "attn_q_norm.weight"):
                q = np.array([rms(r, W(b + "attn_q_norm.weight")) for r in q])
                k = np.array([rms(r, W(b + "attn_k_norm.weight")) for r in k])
            q = np.array([naive_rope(r, t, cfg, ff) for r in q])
            k = np.array([naive_rope(r, t, cfg, ff) for r in k])
            ks.append(k)
            vs.append(v)
            heads = []
            for hh in range(H):
                g = hh // (H // Hkv)
                sc = np.array([q[hh] @ ks[s][g] for s in range(t + 1)]) / math.sqrt(D)
                p = np.exp(sc - sc.max())
                p /= p.sum()
                heads.append(sum(p[s] * vs[s][g] for s in range(t + 1)))
            out.append(W(b + "attn_output.weight") @ np.concatenate(heads))
        x = x + np.array(out)
        y = []
        for t in range(len(tokens)):
            h = rms(x[t], W(b + "ffn_norm.weight"))
            if not cfg.is_moe:
                y.append(ffn(h, W(b + "ffn_gate.weight"), W(b + "ffn_up.weight"), W(b + "ffn_down.weight")))
                continue
            logit = W(b + "ffn_gate_inp.weight") @ h
            prob = np.exp(logit - logit.max())
            prob /= prob.sum()
            top = np.argsort(-prob)[:cfg.n_expert_used]
            wts = prob[top] / (prob[top].sum() if RENORMALIZE[cfg.arch] else 1.0)
            acc = sum(w * ffn(h, *(W(b + f"ffn_{k}_exps.weight")[e] for k in ("gate", "up", "down")))
                      for e, w in zip(top, wts))
            if has(b + "ffn_up_shexp.weight"):
                gate = 1 / (1 + np.exp(-(W(b + "ffn_gate_inp_shexp.weight") @ h)[0]))
                acc = acc + gate * ffn(h, *(W(b + f"ffn_{k}_shexp.weight") for k in ("gate", "up", "down")))
            y.append(acc)
        x = x + np.array(y)
    out_w = W("output.weight") if has("output.weight") else W("token_embd.weight")
    return np.array([out_w @ rms(r, W("output_norm.weight")) for r in x])


CASES = {
    "qwen2": dict(arch="qwen2"),
    "qwen3-wide-heads-tied": dict(arch="qwen3", head_dim=32, tied=True),
    "llama-partial-rope": dict(arch="llama", extra_kv={"llama.rope.dimension_count": 8}),
    "mixtral": dict(arch="llama", n_expert=4),
    "qwen3moe": dict(arch="qwen3moe", n_expert=6),
    "qwen2moe-shared": dict(arch="qwen2moe", n_expert=4, shexp=True),
    "llama3-rope-freqs": dict(arch="llama"),
    "rope-linear": dict(arch="llama", extra_kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}),
    "rope-yarn": dict(arch="qwen3", extra_kv={"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0,
                                              "qwen3.rope.scaling.original_context_length": 64}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_naive(tmp_path, case):
    kw = dict(CASES[case])
    if case == "llama3-rope-freqs":
        kw.pop("arch")
        tensors, hp = tiny_tensors("llama", **kw)
        tensors["rope_freqs.weight"] = np.linspace(1.0, 8.0, hp["head_dim"] // 2).astype(np.float32)
        model = open_model(write_gguf(tmp_path / "rf.gguf", "llama", tensors, hp))
    else:
        model = open_model(tiny_model(tmp_path, kw.pop("arch"), seed=len(case), **kw))
    tokens = [3, 17, 42, 8, 8, 61, 0, 29, 77]
    want = naive_logits(model, tokens)
    be = CPUBackend(model, 32, chunk=4)
    got = be.forward(tokens, all_logits=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
    be.truncate(6)     # the decode path, continuing from a kept prefix
    last = [be.forward([t]) for t in tokens[6:]]
    np.testing.assert_allclose(np.array(last), want[6:], rtol=0, atol=2e-3 * np.abs(want).max())
    assert be.n_cached == len(tokens)


@pytest.mark.parametrize("n_pos", [1, 37])
def test_rope_tables_and_orderings(tmp_path, n_pos):
    cfg = open_model(tiny_model(tmp_path, "qwen3", head_dim=32, extra_kv={"qwen3.rope.dimension_count": 24})).config
    rng = np.random.default_rng(n_pos)
    x = rng.standard_normal((n_pos, 3, 32)).astype(np.float32)
    cos, sin = rope_tables(cfg, n_pos)
    for order in ("neox", "norm"):
        cfg.rope_type = order
        got = apply_rope(x, cos, sin, cfg.n_rot, order == "neox")
        want = np.array([[naive_rope(x[t, h].astype(np.float64), t, cfg) for h in range(3)] for t in range(n_pos)])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
        np.testing.assert_array_equal(got[..., cfg.n_rot:], x[..., cfg.n_rot:])


def test_context_and_vocabulary_limits(tmp_path):
    be = CPUBackend(open_model(tiny_model(tmp_path)), 8)
    be.forward([1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="context"):
        be.forward([1, 2, 3])
    assert be.n_cached == 6
    with pytest.raises(ValueError, match="outside the vocabulary"):
        be.forward([80])
    with pytest.raises(ValueError, match="cannot truncate"):
        be.truncate(7)


def test_blas_thread_switch_round_trips():
    from engine.backend_cpu import BlasThreads
    blas = BlasThreads()
    if blas.default is None:
        pytest.skip("NumPy's BLAS is not an OpenBLAS reachable here")
    blas.use(1)
    assert BlasThreads().default == 1     # a fresh reader sees what the last use() set
    blas.use(None)
    assert BlasThreads().default == blas.default
