"""qwen4exp against its two references (tests/fixtures/qwen4exp/, made by tools/qwen4exp_refs.py; issue 29 item 4).

The tiny model was made in transformers (modeling_qwen4_exp, the authors' forward), converted by llama.cpp's own
converter (the F16 GGUF is the file layout's ground truth) and quantized by llama-quantize (Q2_0, IQ2_XS with the
committed imatrix, Q4_K_M). Its QSA budget is 16 tokens in blocks of 4: attention is dense up to position 18, and
from 19 on llama.cpp attends 19 cells where transformers attends 4 blocks + the tail (docs/qwen4exp-notes.md). So:
- F16, dense steps: the CPU backend agrees with llama.cpp (DESIGN section 7: median |logit diff| <= 0.05, argmax
  equal where llama.cpp's margin is clear);
- F16, every step: it follows transformers (median <= 0.05, and on the sparse steps nearer transformers than
  llama.cpp is), and its own greedy run is transformers' up to the first near-tie;
- quantized: it equals exact arithmetic (transformers in float64 over the file's dequantized weights), and
  llama.cpp sits within its own recorded distance from that.
The CPU-backend checks skip until engine/arch/qwen4exp.py imports; the fixture checks always run.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from tools import llama_ref as lr

HERE = Path(__file__).resolve().parent / "fixtures" / "qwen4exp"
RECIPES = ("f16", "q2_0", "iq2_xs", "q4_k_m")
REFS = {r: json.loads((HERE / f"tiny-qwen4exp-{r}.json").read_text()) for r in RECIPES}
CASES = ("short", "at_budget", "crossing", "long", "ple_eos")
MEDIAN = 0.05                 # DESIGN section 7
CLEAR_LLAMA = 0.5             # llama.cpp's argmax is compared where its margin is at least this
CLEAR_HF = 0.05               # transformers' (float32, the same weights: it differs from ours by ~1e-4)
EXACT_MEDIAN = 0.01           # float32 against the float64 forward over the same weights


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _top(step: dict) -> tuple[list[int], np.ndarray]:
    return [i for i, _ in step["top"]], np.array([v for _, v in step["top"]])


# --- the fixtures themselves ----------------------------------------------------------------------------------

def test_files_are_the_ones_recorded():
    sums = dict(reversed(line.split("  ")) for line in (HERE / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {p.name for p in HERE.iterdir() if p.is_file()} - {"SHA256SUMS"}
    for name, digest in sums.items():
        assert sha256(HERE / name) == digest, name
        assert (HERE / name).stat().st_size < 5 << 20, f"{name}: keep committed fixtures under 5 MB"
    for recipe, ref in REFS.items():
        assert ref["model_sha256"] == sums[ref["model_file"]], recipe


def test_cases_cover_both_regimes_and_the_crossing():
    q = REFS["f16"]["qsa"]
    assert q == {"budget_tokens": 16, "block": 4, "budget_blocks": 4, "first_sparse_pos": 19, "llama_cpp_width": 19}
    for ref in REFS.values():
        cases = {c["name"]: c for c in ref["cases"]}
        assert tuple(cases) == CASES
        assert len(cases["short"]["prompt_ids"]) < 16 and {s["qsa"] for s in cases["short"]["steps"]} == {"dense"}
        assert len(cases["at_budget"]["prompt_ids"]) == 16
        assert len(cases["long"]["prompt_ids"]) > 19 and {s["qsa"] for s in cases["long"]["steps"]} == {"sparse"}
        # the crossing happens one decoded token at a time: dense, then sparse from position 19 on
        cross = [(s["pos"], s["qsa"]) for s in cases["crossing"]["steps"]]
        assert cross[:3] == [(17, "dense"), (18, "dense"), (19, "sparse")]
        assert [s["llama_extra_cells"] for s in cases["crossing"]["steps"][2:6]] == [3, 2, 1, 0]
        assert sum(t == 1021 for t in cases["ple_eos"]["prompt_ids"]) >= 3   # the n-gram reset token inside
        for c in ref["cases"]:
            assert len(c["steps"]) == len(c["greedy_ids"])
            key = "hf" if ref["recipe"] == "f16" else "exact"
            assert all(len(s["top"]) == 10 and len(s[f"{key}_top"]) == 10 and len(s[f"{key}_at_top"]) == 10
                       for s in c["steps"])


def test_references_agree_where_their_selection_is_the_same():
    """llama.cpp against transformers on the F16 file: as close as fp16 rounding allows while attention is dense,
    further once llama.cpp's wider selection starts (the spec's section 5 item 1, shown on every case past 18)."""
    d = REFS["f16"]["llama_vs_hf"]
    assert d["dense"]["median_abs_diff"] <= MEDIAN
    assert d["sparse"]["median_abs_diff"] > 2 * d["dense"]["median_abs_diff"]
    at = {c["name"]: c for c in REFS["f16"]["cases"]}["at_budget"]
    jump = [np.median(np.abs(_top(s)[1] - np.array(s["hf_at_top"]))) for s in at["steps"]]
    assert max(jump[:4]) < jump[4], "the references should part at position 19, where the selections first differ"


def _splitmix64(v: int) -> int:
    m = (1 << 64) - 1
    v = (v + 0x9E3779B97F4A7C15) & m
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & m
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & m
    return (v ^ (v >> 31)) & m


def _primes_after(start: int, n: int) -> list[int]:
    out, p = [], start
    while len(out) < n:
        p += 1
        if all(p % d for d in range(2, math.isqrt(p) + 1)):
            out.append(p)
    return out


def test_header_holds_the_published_keys_exactly():
    """The converter's keys (spec section 1.1), the u64 hash constants bit-exact (spec section 4.8's derivation)."""
    from engine.gguf_model import read_header
    md = read_header(HERE / "tiny-qwen4exp-f16.gguf").metadata
    assert md["general.architecture"] == "qwen4exp" and md["tokenizer.ggml.pre"] == "qwen35"
    assert md["qwen4exp.attention.recurrent_layers"] == [True, True, True, False]
    assert md["qwen4exp.attention.compress_ratios"] == [0, 0, 0, 4]
    assert md["qwen4exp.attention.indexer.top_k"] == 16 and md["qwen4exp.ple.layers"] == [1]
    assert md["qwen4exp.ple.eos_token_id"] == 1021 and md["tokenizer.ggml.eos_token_id"] == 1023
    v = 1024
    half = ((2 ** 63 - 1) // v) // 2
    mult = [2 * (_splitmix64((1234 + 0x9E3779B97F4A7C15 * (i + 1)) % 2 ** 64) % half) + 1 for i in range(3)]
    assert md["qwen4exp.ple.layer_multipliers"] == mult
    sizes = _primes_after(255, 16)
    assert md["qwen4exp.ple.head_vocab_sizes"] == sizes
    assert md["qwen4exp.ple.head_offsets"] == [sum(sizes[:i]) for i in range(16)]
    assert "tokenizer.chat_template" in md and "<tool_call>" in md["tokenizer.chat_template"]


def test_quantized_files_hold_the_types_asked_for():
    t = {r: REFS[r]["tensor_types"] for r in RECIPES}
    assert t["q2_0"]["blk.0.ffn_gate_exps.weight"] == "Q2_0" and t["q2_0"]["blk.0.ffn_up_exps.weight"] == "Q2_0"
    assert t["iq2_xs"]["blk.0.ffn_gate_exps.weight"] == "IQ2_XS"
    assert t["q4_k_m"]["blk.0.ffn_gate_exps.weight"] == "Q4_K"
    assert all(v in ("F16", "F32") for v in t["f16"].values())
    for r in RECIPES:   # llama-quantize leaves norms, routers, convs and the indexer projections alone
        assert t[r]["blk.3.indexer.q_proj.weight"] == "F16" and t[r]["blk.1.ssm_conv1d.weight"] == "F32"


def test_llama_quantize_remakes_the_quantized_files(tmp_path):
    why = lr.available()
    if why:
        pytest.skip(f"needs llama.cpp's CPU wheel: {why}")
    from tools.qwen4exp_refs import quantize
    for recipe in RECIPES[1:]:
        dst = quantize(HERE / "tiny-qwen4exp-f16.gguf", tmp_path / f"{recipe}.gguf", recipe,
                       HERE / "tiny-qwen4exp.imatrix" if recipe == "iq2_xs" else None)
        assert sha256(dst) == REFS[recipe]["model_sha256"], f"llama-quantize {recipe} no longer writes the fixture"


# --- the CPU backend against them -----------------------------------------------------------------------------

def _backend(recipe: str):
    try:
        import engine.arch.qwen4exp  # noqa: F401
    except ImportError as e:
        pytest.skip(f"engine/arch/qwen4exp.py does not import yet ({e}): the qwen4exp forward is issue 29 item 2")
    from engine.backend_cpu import CPUBackend
    from engine.gguf_model import open_model
    return CPUBackend(open_model(HERE / f"tiny-qwen4exp-{recipe}.gguf"), 128)


@pytest.fixture(scope="module")
def forced():
    """{recipe: [teacher-forced logits per case]}: the prompt in one call, then llama.cpp's greedy ids one by one."""
    out = {}
    for recipe in RECIPES:
        be = _backend(recipe)
        out[recipe] = [lr.teacher_forced(be, c) for c in REFS[recipe]["cases"]]
    return out


def _diffs(ref, logits, key, which):
    d = []
    for case, rows in zip(ref["cases"], logits, strict=True):
        for s, row in zip(case["steps"], rows, strict=True):
            if which in (s["qsa"], "all"):
                ids, vals = _top(s) if key == "llama" else ([i for i, _ in s[f"{key}_top"]],
                                                            np.array([v for _, v in s[f"{key}_top"]]))
                d.append(np.abs(row[ids] - vals))
                if key != "llama":
                    d.append(np.abs(row[_top(s)[0]] - np.array(s[f"{key}_at_top"])))
    return np.concatenate(d)


@pytest.mark.slow
def test_f16_agrees_with_llama_cpp_while_attention_is_dense(forced):
    ref, logits = REFS["f16"], forced["f16"]
    d = _diffs(ref, logits, "llama", "dense")
    assert np.median(d) <= MEDIAN, f"CPU backend vs llama.cpp on dense steps: median {np.median(d):.4f}"
    for case, rows in zip(ref["cases"], logits):
        for s, row, tok in zip(case["steps"], rows, case["greedy_ids"]):
            if s["qsa"] != "dense" or s["margin"] < CLEAR_LLAMA:
                break
            assert int(np.argmax(row)) == tok, f"{case['name']} pos {s['pos']}: argmax differs from llama.cpp's"


@pytest.mark.slow
def test_f16_follows_transformers_on_every_step(forced):
    ref, logits = REFS["f16"], forced["f16"]
    d = _diffs(ref, logits, "hf", "all")
    assert np.median(d) <= MEDIAN, f"CPU backend vs transformers: median {np.median(d):.4f}"
    sparse = np.median(_diffs(ref, logits, "hf", "sparse"))
    llama = ref["llama_vs_hf"]["sparse"]["median_abs_diff"]
    assert sparse <= llama / 2, (f"on the sparse steps the CPU backend sits {sparse:.4f} from transformers, llama.cpp "
                                 f"{llama:.4f}: it should select as transformers does (B blocks + tail)")
    for case, rows in zip(ref["cases"], logits):
        for s, row in zip(case["steps"], rows):
            hf_ids = [i for i, _ in s["hf_top"]]
            if s["hf_top"][0][1] - s["hf_top"][1][1] >= CLEAR_HF:
                assert int(np.argmax(row)) == hf_ids[0], f"{case['name']} pos {s['pos']}: argmax is not transformers'"


@pytest.mark.slow
def test_f16_greedy_run_is_transformers_own():
    be = _backend("f16")
    for case in REFS["f16"]["cases"]:
        be.truncate(0)
        row = be.forward(case["prompt_ids"])
        for i, (tok, margin) in enumerate(zip(case["hf_greedy_ids"], case["hf_greedy_margins"])):
            if margin < CLEAR_HF:
                break
            assert int(np.argmax(row)) == tok, f"{case['name']}: greedy token {i} differs from transformers'"
            row = be.forward([tok])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES[1:])
def test_quantized_equals_exact_arithmetic(forced, recipe):
    ref, logits = REFS[recipe], forced[recipe]
    d = _diffs(ref, logits, "exact", "all")
    assert np.median(d) <= EXACT_MEDIAN, f"CPU backend vs exact arithmetic on {recipe}: median {np.median(d):.5f}"
    allowed = ref["llama_vs_exact"]["all"]["median_abs_diff"] + MEDIAN
    ll = np.median(_diffs(ref, logits, "llama", "all"))
    assert ll <= allowed, f"CPU backend vs llama.cpp on {recipe}: {ll:.4f}, beyond llama.cpp's own distance {allowed}"
