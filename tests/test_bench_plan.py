"""The planner (bench/plan.py) on the recorded routing trace of the tiny preset's model, in hand-checkable cases; the
trace format (bench/routing_trace.py) and bench.routing's --trace-out."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from bench import plan, routing_trace
from engine import cpu_share

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "tests" / "fixtures" / "routing" / "tiny-qwen3moe.json"
EXPERT = 110_592            # a tiny-preset expert: gate, up, down of 256 x 256 Q4_K (144 bytes a 256-value block)
# costs that make the arithmetic easy: 10 us a layer, dense reads free, a resident expert 1 us, a miss 10 us over an
# 11.0592 GB/s link, 5 us on a 22.1184 GB/s CPU with no fixed cost
COSTS = dict(plan.DEFAULT_COSTS, layer_us=10.0, dense_gbps=1e12, expert_gbps=110.592, vram_misc_mib=0.0,
             cpu_overhead_us=0.0, prompt_tflops=1.0)
LINK, CPU = 11.0592, 22.1184
CTX = 64


@pytest.fixture(scope="module")
def trace():
    return routing_trace.read(TRACE)


@pytest.fixture(scope="module")
def shape():
    return plan.shape_from_preset("tiny")


def budget_gib(shape, slots: float, embd_in_vram=False) -> float:
    fixed = shape.dense_bytes + shape.kv_bytes_token * CTX + (shape.embd_bytes if embd_in_vram else 0)
    return (fixed + slots * EXPERT) / 2 ** 30


def run(shape, trace, vram, share=0.0, prefetch="off", cpu=CPU, costs=COSTS):
    return plan.plan(shape, trace, costs, vram, cpu_share.Rates(LINK, cpu, costs["cpu_overhead_us"]), CTX, share,
                     prefetch)


def test_the_recorded_trace(trace):
    assert (trace.n_layer, trace.n_expert, trace.n_expert_used) == (4, 8, 2)
    assert len(trace.sequences) == 4 and all(s.shape == (64, 4, 2) for s in trace.sequences)
    assert all(len(set(tok)) == 2 for s in trace.sequences for t in s for tok in t.tolist())


def test_the_tiny_shape(shape, tmp_path):
    assert (shape.n_layer, shape.n_expert, shape.n_expert_used) == (4, 8, 2)
    assert list(shape.expert_bytes) == [EXPERT] * 4 and list(shape.expert_stride) == [EXPERT] * 4
    assert shape.kv_bytes_token == 4 * 2 * 2 * 2 * 64           # layers, K and V, fp16, 2 KV heads of 64
    path = tmp_path / "tiny.gguf"
    r = subprocess.run([sys.executable, "-m", "tools.make_moe", "--preset", "tiny", "--out", str(path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    from_file = plan.shape_from_gguf(path)
    for f in ("n_layer", "n_expert", "n_expert_used", "dense_bytes", "embd_bytes", "tied", "kv_bytes_token",
              "active_params"):
        assert getattr(from_file, f) == getattr(shape, f), f
    assert list(from_file.expert_bytes) == list(shape.expert_bytes)


def test_everything_resident(shape, trace):
    row = run(shape, trace, budget_gib(shape, 32, embd_in_vram=True) + 1e-6)
    assert row.hit_rate == 1.0 and row.slots == 32
    assert row.decode_tok_s == pytest.approx(1e6 / (4 * (10 + 2 * 1)), rel=1e-6)        # 48 us a step
    assert row.link_mb_token == 0 and row.cpu_mb_token == 0
    compute = COSTS["prompt_chunk"] * 2 * shape.active_params / 1e12
    assert row.prompt_tok_s == pytest.approx(COSTS["prompt_chunk"] / compute)


def test_nothing_resident_over_the_link(shape, trace):
    row = run(shape, trace, budget_gib(shape, 0.5))
    assert row.slots == 0 and row.hit_rate == 0.0 and row.notes == ["token embedding in host memory"]
    assert row.decode_tok_s == pytest.approx(1e6 / (4 * (10 + 2 * 10)), rel=1e-6)       # 120 us a step
    assert row.link_mb_token == pytest.approx(8 * EXPERT / 1e6)
    stream = 32 * EXPERT / (LINK * 1e9)
    compute = COSTS["prompt_chunk"] * 2 * shape.active_params / 1e12
    assert row.prompt_tok_s == pytest.approx(COSTS["prompt_chunk"] / max(stream, compute))


@pytest.mark.parametrize("share", [None, 0.5])
def test_nothing_resident_with_the_cpu(shape, trace, share):
    # a layer's 2 misses: one on the link (10 us), one on the CPU (5 us) beside it; auto ties c = 1 and c = 2 (10 us)
    # and takes the fewer on the CPU
    row = run(shape, trace, budget_gib(shape, 0.5), share=share)
    assert row.decode_tok_s == pytest.approx(1e6 / (4 * (10 + 10)), rel=1e-6)
    assert row.cpu_experts_token == 4 and row.cpu_mb_token == pytest.approx(4 * EXPERT / 1e6)
    assert row.link_mb_token == pytest.approx(4 * EXPERT / 1e6)
    assert row.cpu_share == ("auto" if share is None else "0.5")


def test_a_slow_cpu_is_left_out(shape, trace):
    row = run(shape, trace, budget_gib(shape, 0.5), share=None, cpu=0.5)     # 221 us an expert
    assert row.cpu_experts_token == 0 and row.decode_tok_s == pytest.approx(1e6 / 120, rel=1e-6)


def test_the_prefetch_overlaps_the_link_with_the_compute(shape, trace):
    costs = dict(COSTS, prefetch_waste=0.5, prefetch_link_share=0.5)
    # a miss: 1.5 x its bytes at half the link, 30 us; a layer max(10, 2 x 30) = 60 us
    row = run(shape, trace, budget_gib(shape, 0.5), prefetch="on", costs=costs)
    assert row.prefetch and row.decode_tok_s == pytest.approx(1e6 / 240, rel=1e-6)
    assert row.link_mb_token == pytest.approx(8 * EXPERT * 1.5 / 1e6)
    assert plan._prefetch_on("auto", COSTS, shape, 0.5) and not plan._prefetch_on("auto", COSTS, shape, 0.96)


@pytest.mark.parametrize("slots", [5, 12, 20])
def test_a_partial_cache_by_hand(shape, trace, slots):
    """Each sequence's first half ranks the (layer, expert) pairs by count (ties: layer, then expert id); the top
    `slots` are resident for its second half; hits cost 1 us, misses 10 us, a layer 10 us."""
    row = run(shape, trace, budget_gib(shape, slots + 0.5))
    steps, hits, looks = [], 0, 0
    for seq in trace.sequences:
        counts = Counter()
        for tok in seq[:32]:
            for il in range(4):
                counts.update((il, int(e)) for e in tok[il])
        ranked = sorted(((il, e) for il in range(4) for e in range(8)), key=lambda p: (-counts[p], p))
        resident = set(ranked[:slots])
        for tok in seq[32:]:
            us = 0
            for il in range(4):
                hit = sum((il, int(e)) in resident for e in tok[il])
                hits, looks = hits + hit, looks + 2
                us += 10 + hit * 1 + (2 - hit) * 10
            steps.append(us)
    assert row.slots == slots
    assert row.hit_rate == pytest.approx(hits / looks)
    assert row.decode_tok_s == pytest.approx(1e6 / np.mean(steps), rel=1e-9)


def test_more_vram_and_a_cpu_never_slow_the_plan(shape, trace):
    rows = [run(shape, trace, budget_gib(shape, s + 0.5), share=sh) for s in (0, 8, 16, 24) for sh in (0.0, None)]
    decode = [r.decode_tok_s for r in rows]
    assert all(b >= a - 1e-9 for a, b in zip(decode[::2], decode[2::2]))        # more slots, cpu_share off
    assert all(auto >= off - 1e-9 for off, auto in zip(decode[::2], decode[1::2]))


def test_a_budget_too_small_and_a_foreign_trace_are_refused(shape, trace, tmp_path):
    with pytest.raises(plan.PlanError, match="does not hold"):
        run(shape, trace, 1e-4)
    wide = routing_trace.Trace(4, 16, 2, trace.sequences, "other")
    with pytest.raises(plan.PlanError, match="record a trace of this model's routing"):
        run(shape, wide, 1.0)


def test_costs_files(tmp_path):
    good = tmp_path / "c.json"
    good.write_text(json.dumps({"layer_us": 12, "expert_gbps": 700}))
    costs = plan.load_costs(good)
    assert costs["layer_us"] == 12 and costs["expert_gbps"] == 700
    assert costs["dense_gbps"] == plan.DEFAULT_COSTS["dense_gbps"]
    for text, msg in (('{"layr_us": 1}', "unknown cost 'layr_us'"), ('{"layer_us": -1}', "must be a number >= 0"),
                      ('{"expert_gbps": 0}', "expert_gbps must be above 0"), ("[1]", "JSON object"),
                      ("{", "cannot read the costs")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(plan.PlanError, match=msg):
            plan.load_costs(bad)


def test_every_default_cost_says_where_it_came_from():
    src = (ROOT / "bench" / "plan.py").read_text()
    block = src[src.index("DEFAULT_COSTS = {"):src.index("}\n", src.index("DEFAULT_COSTS = {"))]
    for key in plan.DEFAULT_COSTS:
        line = next(ln for ln in block.splitlines() if f'"{key}"' in ln)
        assert "#" in line or key == "cpu_overhead_us", key


def test_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.plan", "--preset", "tiny", "--trace", str(TRACE), "--vram-gib",
                        "0.045,1", "--cpu-gbps", "20", "--link-gbps", "10", "--ctx", "64", "--prefetch", "off"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("| 0.045") or ln.startswith("| 1 ")]
    assert len(lines) == 4 and "| off |" in lines[0] and "| auto |" in lines[1]
    for args, msg in ((["--preset", "qwen3-30b-a3b"], "record a trace of this model's routing"),
                      (["--preset", "tiny", "--cpu-share", "2"], "--cpu-share: cpu_share takes auto, off"),
                      (["--preset", "tiny", "--vram-gib", "x"], "--vram-gib takes positive numbers"),
                      (["--preset", "nope"], "no make_moe preset 'nope'")):
        r = subprocess.run([sys.executable, "-m", "bench.plan", "--trace", str(TRACE), *args], cwd=ROOT,
                           capture_output=True, text=True)
        assert r.returncode != 0 and msg in r.stderr, (args, r.stderr)


# --- trace files --------------------------------------------------------------------------------------------------

def test_traces_round_trip(trace, tmp_path):
    for name in ("t.json", "t.json.gz"):
        routing_trace.write(trace, tmp_path / name)
        back = routing_trace.read(tmp_path / name)
        assert (back.n_layer, back.n_expert, back.n_expert_used, back.source) == \
               (trace.n_layer, trace.n_expert, trace.n_expert_used, trace.source)
        assert all(np.array_equal(a, b) for a, b in zip(back.sequences, trace.sequences))
    assert gzip.decompress((tmp_path / "t.json.gz").read_bytes()).startswith(b'{"format":"strata-routing-trace"')


@pytest.mark.parametrize("doc, msg", [
    ("not json", "is not a routing trace"),
    ('{"format": "other", "version": 1}', "is not a strata-routing-trace version 1 file"),
    ('{"format": "strata-routing-trace", "version": 1, "n_layer": 2, "n_expert": 4, "n_expert_used": 2, '
     '"sequences": [[[[0, 1]]]]}', "a token lists 1 layers, not 2"),
    ('{"format": "strata-routing-trace", "version": 1, "n_layer": 1, "n_expert": 4, "n_expert_used": 2, '
     '"sequences": [[[[0, 9]]]]}', "expert ids outside 0..3"),
    ('{"format": "strata-routing-trace", "version": 1, "n_layer": 1, "n_expert": 4, "n_expert_used": 2, '
     '"sequences": [[[[0]]]]}', "lists 1 experts, not 2"),
    ('{"format": "strata-routing-trace", "version": 1, "n_layer": 1, "n_expert": 4, "n_expert_used": 2, '
     '"sequences": []}', "holds no tokens"),
])
def test_bad_traces_are_named(tmp_path, doc, msg):
    p = tmp_path / "bad.json"
    p.write_text(doc)
    with pytest.raises(routing_trace.TraceError, match=msg):
        routing_trace.read(p)
    with pytest.raises(routing_trace.TraceError, match="cannot read"):
        routing_trace.read(tmp_path / "missing.json")


def test_bench_routing_records_a_trace(tmp_path):
    out = tmp_path / "r.json.gz"
    r = subprocess.run([sys.executable, "-m", "bench.routing", "--preset", "tiny", "--prompts", "2", "--prompt-len",
                        "6", "--trace-out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    t = routing_trace.read(out)
    assert (t.n_layer, t.n_expert, t.n_expert_used, len(t.sequences)) == (4, 8, 2, 2)
    assert all(s.shape == (6, 4, 2) for s in t.sequences) and "preset tiny" in t.source
