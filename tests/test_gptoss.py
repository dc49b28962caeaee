"""gpt-oss on the CPU: its pieces against plain formulas, the forward against llama.cpp and exact arithmetic.

The fixtures (tests/fixtures/gptoss/*.json) hold llama.cpp's outputs (tools/gptoss_ref.py) for two models that
make_moe writes again here, byte for byte (the JSON's sha256 says which): `gpt-oss-tiny` at seed 1 in F16 (the
architecture check, DESIGN §7: median |logit diff| <= 0.05 and the same greedy tokens) and in the published files'
types (MXFP4 experts, Q8_0 elsewhere: equal to a float64 forward; llama.cpp only within its measured distance from
that). Prompts of 40, 90 and 150 tokens, past the tiny model's window of 16. To remake a fixture:

    python -m tools.make_moe --preset gpt-oss-tiny --seed 1 [--experts F16 --attn F16 --embd F16 --output F16] \\
        --out /tmp/gpt-oss-tiny-f16.gguf
    /tmp/llamavenv/bin/python -m tools.gptoss_ref /tmp/gpt-oss-tiny-f16.gguf tests/fixtures/gptoss/... \\
        --prompts 0:40,1:90,2:150 --steps 24
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from engine.arch import gptoss
from engine.arch.base import Weights, softmax
from engine.backend_cpu import CPUBackend
from engine.gguf_model import open_model
from tools import make_moe

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gptoss"
F16_TYPES = ["--experts", "F16", "--attn", "F16", "--embd", "F16", "--output", "F16"]
MODELS = {"gpt-oss-tiny-f16": F16_TYPES, "gpt-oss-tiny-mxfp4": []}


# --- the pieces, on fresh random data ---------------------------------------------------------------------------

@pytest.mark.parametrize("H,T,S", [(1, 1, 1), (4, 3, 17), (8, 16, 300)])
def test_sink_softmax_is_a_softmax_with_a_valueless_extra_logit(H, T, S):
    rng = np.random.default_rng(H * 1000 + S)
    scores = (rng.standard_normal((H, T, S)) * 3).astype(np.float32)
    scores[:, :, S // 2:] = np.where(rng.random((H, T, S - S // 2)) < 0.3, -np.inf, scores[:, :, S // 2:])
    sinks = (rng.standard_normal(H) * 4).astype(np.float32)
    out = np.full_like(scores, np.nan)      # poisoned: every entry must be written
    out[...] = gptoss.sink_softmax(scores, sinks)
    with_sink = np.concatenate([scores, np.broadcast_to(sinks[:, None, None], (H, T, 1))], axis=-1)
    want = softmax(with_sink.astype(np.float64))[..., :S]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-7)
    assert (out.sum(-1) <= 1 + 1e-6).all()    # the sink's share is missing from every row


def test_sink_softmax_survives_a_sink_far_above_the_scores():
    out = gptoss.sink_softmax(np.array([[[-50.0, -60.0]]], np.float32), np.array([80.0], np.float32))
    assert np.isfinite(out).all() and out.max() < 1e-30


@pytest.mark.parametrize("pos0,T,window", [(0, 5, 0), (0, 40, 16), (37, 1, 16), (100, 24, 16), (5, 9, 1)])
def test_window_mask_is_llama_cpps_rule(pos0, T, window):
    got = gptoss.window_mask(pos0, T, pos0 + T, window)
    for i in range(T):
        for j in range(pos0 + T):
            p1, p0 = pos0 + i, j
            assert got[i, j] == (p0 > p1 or (window > 0 and p1 - p0 >= window))


@pytest.mark.parametrize("n", [1, 7, 4096])
def test_swiglu_oai_is_ggmls_loop(n):
    rng = np.random.default_rng(n)
    gate = (rng.standard_normal(n) * 6).astype(np.float32)
    up = (rng.standard_normal(n) * 6).astype(np.float32)
    gate[:3], up[:3] = [50.0, -50.0, 7.0][:n], [-50.0, 50.0, -7.5][:n]
    got = gptoss.swiglu_oai(gate, up)
    # ggml_compute_forward_swiglu_oai_f32, one element at a time
    want = []
    for g, u in zip(gate.tolist(), up.tolist()):
        x = min(g, 7.0)
        y = min(max(u, -7.0), 7.0)
        want.append(x / (1.0 + np.exp(1.702 * -x)) * (y + 1.0))
    np.testing.assert_allclose(got, np.array(want), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("T,E,k", [(1, 8, 1), (5, 32, 4), (64, 128, 4)])
def test_router_softmaxes_only_the_chosen_logits(T, E, k):
    rng = np.random.default_rng(E + k)
    logits = (rng.standard_normal((T, E)) * 2).astype(np.float32)
    ids, w = gptoss.route_softmax_weight(logits, k)
    for t in range(T):
        top = sorted(range(E), key=lambda e: -logits[t, e])[:k]
        assert ids[t].tolist() == top
        z = np.exp(logits[t, top] - logits[t, top].max())
        np.testing.assert_allclose(w[t], z / z.sum(), rtol=1e-6)


# --- the model against llama.cpp and exact arithmetic -----------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("gptoss")
    out = {}
    for name, types in MODELS.items():
        path = d / f"{name}.gguf"
        assert make_moe.main(["--preset", "gpt-oss-tiny", "--seed", "1", "--out", str(path), *types]) == 0
        ref = json.loads((FIXTURES / f"{name}.json").read_text())
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert digest == ref["model_sha256"], (f"make_moe no longer writes the model of {name}.json; remake the "
                                              f"fixture (this module's docstring says how)")
        out[name] = (path, ref)
    return out


def teacher_forced(be, case) -> np.ndarray:
    """Our logits at each of llama.cpp's steps: the prompt in one call, its greedy ids fed back."""
    be.truncate(0)
    p, g = case["prompt_ids"], case["greedy_ids"]
    return be.forward(p + g[:-1], all_logits=True)[len(p) - 1:]


def diffs_at_their_top10(case, rows) -> np.ndarray:
    return np.array([np.abs(row[[i for i, _ in st["top"]]] - [v for _, v in st["top"]])
                     for st, row in zip(case["steps"], rows, strict=True)])


def test_f16_agrees_with_llama_cpp(models):
    path, ref = models["gpt-oss-tiny-f16"]
    model = open_model(path)
    cfg = model.config
    assert (cfg.n_swa, cfg.swa_layers, cfg.rope_scaling) == (16, (True, False, True, False), "yarn")
    be = CPUBackend(model, 512, chunk=64)     # chunks of 64: the 150-token prompt crosses chunks and the window
    for case in ref["cases"]:
        assert len(case["prompt_ids"]) > cfg.n_swa
        d = diffs_at_their_top10(case, teacher_forced(be, case))
        assert np.median(d) <= 0.05, f"median |logit diff| {np.median(d):.4f}"
        # our own greedy continuation, one token at a time through the KV cache, is llama.cpp's
        be.truncate(0)
        logits, ours = be.forward(case["prompt_ids"]), []
        for _ in case["greedy_ids"]:
            ours.append(int(np.argmax(logits)))
            logits = be.forward([ours[-1]])
        assert ours == case["greedy_ids"]


class _Weights64(Weights):
    """The same dequantized weights, held as float64."""

    def get(self, name):
        return super().get(name).astype(np.float64)

    def rows(self, name, ids):
        return super().rows(name, ids).astype(np.float64)

    def expert(self, layer, e, decoding):
        return tuple(m.astype(np.float64) for m in super().expert(layer, e, decoding))


class _KV64:
    def __init__(self, cfg, n):
        self.k = [np.zeros((cfg.n_head_kv, n, cfg.head_dim)) for _ in range(cfg.n_layer)]
        self.v = [np.zeros((cfg.n_head_kv, n, cfg.head_dim_v)) for _ in range(cfg.n_layer)]

    def ensure(self, n):
        assert n <= self.k[0].shape[1]


def exact_logits(model, tokens) -> np.ndarray:
    """A float64 forward over the gguf-dequantized weights: exact arithmetic for this file (DESIGN §7)."""
    net = gptoss.GptOss(model, _Weights64(model, expert_cache_mb=1024), len(tokens))
    return net.forward(np.asarray(tokens), 0, _KV64(model.config, len(tokens)), all_logits=True)


def test_mxfp4_equals_exact_arithmetic_and_llama_cpp_stays_within_its_distance(models):
    path, ref = models["gpt-oss-tiny-mxfp4"]
    tol = ref["tolerance"]
    model = open_model(path)
    be = CPUBackend(model, 512, chunk=64)
    theirs_from_exact = []
    for case in ref["cases"]:
        ours = teacher_forced(be, case)
        p, g = case["prompt_ids"], case["greedy_ids"]
        exact = exact_logits(model, p + g[:-1])[len(p) - 1:]
        # float32 activations over the same weights: equal to exact up to float32 rounding
        np.testing.assert_allclose(ours, exact, rtol=0, atol=1e-4 * np.abs(exact).max())
        theirs_from_exact.append(diffs_at_their_top10(case, exact))
    d = np.concatenate(theirs_from_exact)
    # llama.cpp rounds activations to 8 bits before its Q8_0 and MXFP4 dot products: its distance from exact
    assert np.median(d) <= tol["median_abs_logit_diff_at_most"], np.median(d)
    assert np.mean(d.mean(axis=1) > 1.0) <= tol["share_of_steps_over_1_at_most"]
