"""gpt-oss on the CPU: its pieces against plain formulas, the forward against llama.cpp and exact arithmetic.

The fixtures (tests/fixtures/gptoss/*.json, made by python -m tools.gptoss_ref) hold llama.cpp's outputs and exact
arithmetic's (tools/gptoss_exact.py, float64) for make_moe's gpt-oss-tiny preset at seed 1, which the tests make
again byte for byte (the JSON's sha256 says which): in F16 (the architecture check, docs/design.md: median |logit diff|
<= 0.05 and the same greedy tokens), in the published files' types (MXFP4 experts, Q8_0 elsewhere) and in
llama-quantize's Q4_K_M (that one only where llama.cpp runs: tools.llama_ref quantizes it again). Quantized files
must equal exact arithmetic; llama.cpp sits its own measured distance from it. Prompts of 40, 90 and 150 tokens, past
the tiny model's window of 16.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from engine.arch import gptoss
from engine.arch.base import softmax
from engine.backend_cpu import CPUBackend
from engine.gguf_model import open_model
from tools import make_moe

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gptoss"
F16_TYPES = ["--experts", "F16", "--attn", "F16", "--embd", "F16", "--output", "F16"]


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

def fixture(kind):
    return json.loads((FIXTURES / f"gpt-oss-tiny-{kind}.json").read_text())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{kind: (path, reference)} for the files that can be made here."""
    from tools import gptoss_ref, llama_ref
    d = tmp_path_factory.mktemp("gptoss")
    out = {}
    for kind, types in (("f16", F16_TYPES), ("mxfp4", [])):
        path = d / f"gpt-oss-tiny-{kind}.gguf"
        assert make_moe.main([*gptoss_ref.PRESET, "--norm", "F32", "--out", str(path), *types]) == 0
        out[kind] = path
    if llama_ref.available() is None:
        out["q4_k_m"] = llama_ref.quantize(out["f16"], d / "gpt-oss-tiny-q4_k_m.gguf", "q4_k_m")
    for kind, path in out.items():
        ref = fixture(kind)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["model_sha256"], (
            f"gpt-oss-tiny-{kind} is no longer the fixture's file; remake them (python -m tools.gptoss_ref)")
        out[kind] = (path, ref)
    return out


def teacher_forced(be, case) -> np.ndarray:
    """Our logits at each of llama.cpp's steps: the prompt in one call, its greedy ids fed back."""
    be.truncate(0)
    p, g = case["prompt_ids"], case["greedy_ids"]
    return be.forward(p + g[:-1], all_logits=True)[len(p) - 1:]


def distances(ref, be) -> tuple[np.ndarray, np.ndarray]:
    """|ours - llama.cpp| at its top-10 ids and |ours - exact| there, one row per step of every case."""
    ll, ex = [], []
    for case in ref["cases"]:
        for st, row in zip(case["steps"], teacher_forced(be, case), strict=True):
            ids = [i for i, _ in st["top"]]
            ll.append(np.abs(row[ids] - [v for _, v in st["top"]]))
            ex.append(np.abs(row[ids] - st["exact_at_top"]))
    return np.array(ll), np.array(ex)


def test_f16_agrees_with_llama_cpp(models):
    path, ref = models["f16"]
    model = open_model(path)
    cfg = model.config
    assert (cfg.n_swa, cfg.swa_layers, cfg.rope_scaling) == (16, (True, False, True, False), "yarn")
    assert (cfg.rope_freq_scale, cfg.rope_n_ctx_orig, cfg.yarn_ext_factor, cfg.yarn_attn_factor) == (1 / 32, 4096, 1, 1)
    assert all(len(c["prompt_ids"]) > cfg.n_swa for c in ref["cases"])
    be = CPUBackend(model, 512, chunk=64)     # chunks of 64: the 150-token prompt crosses chunks and the window
    ll, ex = distances(ref, be)
    assert np.median(ll) <= 0.05, f"median |logit diff| from llama.cpp {np.median(ll):.4f}"
    assert ex.max() < 1e-3, f"|ours - exact| up to {ex.max():.2e}"
    for case in ref["cases"]:
        # our own greedy continuation, one token at a time through the KV cache, is llama.cpp's
        be.truncate(0)
        logits, ours = be.forward(case["prompt_ids"]), []
        for _ in case["greedy_ids"]:
            ours.append(int(np.argmax(logits)))
            logits = be.forward([ours[-1]])
        assert ours == case["greedy_ids"]


@pytest.mark.parametrize("kind", ["mxfp4", "q4_k_m"])
def test_quantized_equals_exact_arithmetic(models, kind):
    if kind not in models:
        from tools import llama_ref
        pytest.skip(f"the {kind} file is made by llama.cpp: {llama_ref.available()}")
    path, ref = models[kind]
    assert set(ref["tensor_types"].values()) > {"F32"}
    be = CPUBackend(open_model(path), 512, chunk=64)
    ll, ex = distances(ref, be)
    scale = max(abs(v) for c in ref["cases"] for st in c["steps"] for v in st["exact_at_top"])
    assert ex.max() < 1e-4 * scale, f"|ours - exact| up to {ex.max():.2e}"
    # so from llama.cpp we sit where exact arithmetic does (its 8-bit activations before quantized dot products)
    theirs = ref["llama_vs_exact"]
    assert np.median(ll) <= theirs["median_abs_diff"] + 0.01
    assert np.mean(ll.mean(axis=1) > 1.0) <= theirs["share_of_steps_over_1"] + 0.01


@pytest.mark.parametrize("chunk", [1, 5, 16, 17])
def test_prompt_chunks_across_the_window_change_nothing(models, chunk):
    """Chunks shorter than, equal to and just past the window of 16 (each chunk's keys start at its first query's
    window) give the logits one pass gives, and so does decoding on from a reused prefix."""
    path, ref = models["f16"]
    model = open_model(path)
    toks = ref["cases"][1]["prompt_ids"][:70]
    whole = CPUBackend(model, 128, chunk=512).forward(toks, all_logits=True)
    be = CPUBackend(model, 128, chunk=chunk)
    np.testing.assert_allclose(be.forward(toks, all_logits=True), whole, rtol=0, atol=2e-4)
    be.truncate(33)
    np.testing.assert_allclose(be.forward(toks[33:], all_logits=True), whole[33:], rtol=0, atol=2e-4)
