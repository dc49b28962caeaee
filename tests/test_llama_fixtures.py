"""The CPU backend on files made by llama.cpp itself, in the recipes users download (docs/design.md: correct).

tests/fixtures/llama_ref/ holds, per architecture the engine runs and per recipe (F16, Q8_0, Q6_K, Q5_K_M, Q4_K_M,
Q4_K_S, Q3_K_M, Q2_K, IQ4_XS, IQ3_XXS and IQ2_XXS with the committed imatrix, and "dynamic": Q4_K_M with per-tensor
overrides as community quants have them), llama.cpp's greedy ids, top-10 and
margins and exact arithmetic's logits (`python -m tools.llama_ref fixtures` made them). The GGUFs are not committed:
they are rebuilt here, byte for byte (sha256 checked), with tools.make_moe and the anchor wheel's llama-quantize;
without the wheel those tests skip. Checked:
- every file: the CPU backend equals exact arithmetic (teacher-forced, median |diff| <= 0.05);
- F16 sources: the CPU backend agrees with llama.cpp (median <= 0.05) and its greedy tokens are llama.cpp's up to
  the first near-tie; quantized files: llama.cpp only within its own recorded distance from exact (+0.05);
- every recipe file's tensor types are what make_moe --recipe writes (no wheel needed: the JSON records them).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import llama_ref as lr
from tools import recipes

REF_DIR = Path(__file__).resolve().parent / "fixtures" / "llama_ref"
REFS = {p.stem: json.loads(p.read_text()) for p in sorted(REF_DIR.glob("*.json"))}
ENGINE_ARCHS = {"llama": ("llama", "mixtral"), "qwen2": ("qwen2",), "qwen3": ("qwen3",), "qwen2moe": ("qwen2moe",),
                "qwen3moe": ("qwen3moe",)}
MODELS_DIR = lr.CACHE / "fixture-models"
# The families with fixtures of their own (made through tools.llama_ref by tools/hybrid_refs.py,
# tools/gptoss_ref.py and tools/qwen4exp_refs.py, and checked by tests/test_hybrid.py, tests/test_gptoss.py and
# tests/test_qwen4exp_refs.py; qwen4exp's come with branch s6/q4refs): llama_ref's exact forward has
# no graph for them, so they record F16 and the recipes their issue names (Q4_K_M among them) beside their own exact
# arithmetic, not llama_ref's whole recipe list.
FAMILY_FIXTURES = {"gpt-oss": ("gptoss", "gpt-oss-tiny"), "qwen3next": ("hybrid", "tiny-qwen3next"),
                   "qwen35moe": ("hybrid", "tiny-qwen35moe"), "qwen4exp": ("qwen4exp", "tiny-qwen4exp")}


def test_every_engine_architecture_has_recipe_fixtures():
    from engine.gguf_model import SUPPORTED_ARCHS
    have = {(r["fixture"], r["recipe"]) for r in REFS.values()}
    for folder, _ in FAMILY_FIXTURES.values():
        have |= {(r["fixture"], r["recipe"]) for r in
                 (json.loads(p.read_text()) for p in (REF_DIR.parent / folder).glob("*.json"))}
    for arch in SUPPORTED_ARCHS:
        if arch in FAMILY_FIXTURES:
            fixture = FAMILY_FIXTURES[arch][1]
            for recipe in ("f16", "q4_k_m"):
                assert (fixture, recipe) in have, f"no {recipe} fixture for {fixture} ({arch})"
            continue
        for fixture in ENGINE_ARCHS[arch]:
            for recipe in ("f16", *lr.DEFAULT_RECIPES):
                assert (fixture, recipe) in have, f"no {recipe} fixture for {fixture} ({arch})"


@pytest.fixture(scope="module")
def built():
    """{fixture name: {recipe: path}}, rebuilt into the ignored cache; a stale file (another make_moe) is remade."""
    why = lr.available()
    if why:
        pytest.skip(f"rebuilding the fixture GGUFs needs llama.cpp's CPU wheel: {why}")
    out = {}
    for name in sorted({r["fixture"] for r in REFS.values()}):
        want = {r["recipe"]: r["model_sha256"] for r in REFS.values() if r["fixture"] == name}
        files = lr.build_model_set(name, lr.FIXTURE_MODELS[name], MODELS_DIR, tuple(want), imatrix_dir=REF_DIR)
        stale = [r for r, p in files.items() if lr.sha256(p) != want[r]]
        if stale:
            for p in MODELS_DIR.glob(f"{name}-*.gguf"):
                p.unlink()
            files = lr.build_model_set(name, lr.FIXTURE_MODELS[name], MODELS_DIR, tuple(want), imatrix_dir=REF_DIR)
        for r, p in files.items():
            assert lr.sha256(p) == want[r], (f"{p.name} rebuilt differs from the one the reference was recorded on: "
                                             f"tools/make_moe, the recipe or the wheel changed; re-record with "
                                             f"python -m tools.llama_ref fixtures --model {name}")
        out[name] = files
    return out


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(REFS))
def test_cpu_backend_on_llama_cpp_files(built, key):
    from engine.backend_cpu import CPUBackend
    from engine.gguf_model import open_model
    ref = REFS[key]
    be = CPUBackend(open_model(built[ref["fixture"]][ref["recipe"]]), 256)
    logits = [lr.teacher_forced(be, case) for case in ref["cases"]]
    c = lr.compare(ref, logits)
    assert c.vs_exact_median <= 0.05, f"CPU backend vs exact arithmetic: {c}"
    if ref["recipe"] == "f16":
        assert c.vs_llama_median <= 0.05, f"CPU backend vs llama.cpp on the F16 source: {c}"
        for case, rows in zip(ref["cases"], logits):
            for step, row, tok in zip(case["steps"], rows, case["greedy_ids"]):
                if step["margin"] < 0.5:
                    break
                assert int(row.argmax()) == tok, f"greedy differs from llama.cpp's where its margin is clear: {c}"
    else:
        allowed = ref["llama_vs_exact"]["median_abs_diff"] + 0.05
        assert c.vs_llama_median <= allowed, f"CPU backend vs llama.cpp beyond llama.cpp's own distance: {c}"


@pytest.mark.parametrize("key", sorted(k for k, r in REFS.items() if r["recipe"] in recipes.RECIPES))
def test_make_moe_recipe_writes_llama_quantize_types(tmp_path, key):
    from tools import make_moe
    ref = REFS[key]
    out = tmp_path / "m.gguf"
    make_moe.main([*lr.FIXTURE_MODELS[ref["fixture"]], *lr.F16_TYPES, "--recipe", ref["recipe"], "--threads", "1",
                   "--out", str(out)])
    ours = lr.tensor_types(out)
    theirs = ref["tensor_types"]
    assert list(ours) == [n for n in ours if n in theirs] and set(ours) == set(theirs)
    wrong = {n: (ours[n], theirs[n]) for n in ours if ours[n] != theirs[n]}
    assert not wrong, f"make_moe --recipe {ref['recipe']} differs from llama-quantize: {wrong}"


def test_dynamic_files_mix_types_within_layers():
    # what the GPU expert layouts must handle (issue 22): gate and up apart, whole layers at Q8_0 and BF16
    for key, ref in REFS.items():
        t = ref["tensor_types"]
        if ref["recipe"] != "dynamic" or "blk.0.ffn_gate_exps.weight" not in t:   # dense: attn_output only
            continue
        assert t["blk.0.ffn_gate_exps.weight"] == "Q4_K" and t["blk.0.ffn_up_exps.weight"] == "Q5_K", key
        assert t["blk.3.ffn_down_exps.weight"] == "Q8_0" and t["blk.5.ffn_gate_exps.weight"] == "BF16", key
        assert t["blk.6.ffn_down_exps.weight"] == "IQ4_XS" and t["blk.7.ffn_down_exps.weight"] == "Q6_K", key


def test_reference_files_are_complete():
    for key, ref in REFS.items():
        assert ref["model_file"] == f"{key}.gguf" and len(ref["model_sha256"]) == 64
        assert ref["cases"] and all(len(c["steps"]) == len(c["greedy_ids"]) for c in ref["cases"]), key
        step = ref["cases"][0]["steps"][0]
        assert len(step["top"]) == 10 and len(step["exact_top"]) == 10 and len(step["exact_at_top"]) == 10, key
