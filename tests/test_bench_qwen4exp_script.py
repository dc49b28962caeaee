"""tools/gpu_bench_qwen4exp.sh on the CPU: its syntax, the steps DRY_RUN=1 prints for its two device calls (short:
every budget's decode and 4K prompt on one backend, llama-bench's probes; long: one budget at the 32K and 128K
contexts with the 4K and 32K prompts, llama-bench at those depths), its step limits inside the deadline, and bad
arguments; bench.vs_llama_ctx's table from rows as the benches write them."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bench import vs_llama_ctx

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_bench_qwen4exp.sh"


def _run(args, tmp_path, **env):
    e = dict(os.environ, OUT=str(tmp_path / "out"), DRY_RUN="1", **env)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=e, cwd=tmp_path,
                          timeout=60)


def _steps(p):
    assert p.returncode == 0, p.stdout + p.stderr
    return {ln.split()[1]: ln for ln in p.stdout.splitlines() if ln.startswith("DRY ")}


def _limit(step):
    return int(step.split("limit ")[1].split("s)")[0])


def test_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_short_call_makes_the_pack_and_benches_every_budget(tmp_path):
    s = _steps(_run(["short"], tmp_path))
    assert list(s) == ["make", "strata", "llama-bench"]
    model = "/dev/shm/qwen3.8-flash-next-q2_0-ple14400000.gguf"
    assert "--preset qwen3.8-flash-next --pack q2_0 --ple-rows 14400000 --out " + model in s["make"]
    for want in ("bench.decode", f"--model {model}", "--budgets all,12,8,24", "--prompt 512", "--prefill-prompts 4096",
                 "--prefill-out"):
        assert want in s["strata"]
    for want in ("--budgets all,12,8,24", "--prompt 4096", "--gen 128", "--probe --reps 1"):
        assert want in s["llama-bench"]
    assert "--depth" not in s["llama-bench"] and "--routing" not in s["make"]
    # llama-bench keeps the last 230 s but for the clean-up's 15
    assert _limit(s["strata"]) <= 540 - 230 and _limit(s["llama-bench"]) <= 540 - 15


def test_long_call_is_one_budget_at_the_deep_contexts(tmp_path):
    s = _steps(_run(["long"], tmp_path, PACK="iq2_xs", PLE_ROWS="4000000", DEADLINE="500", ROUTING="trained"))
    assert list(s) == ["make", "strata-32k", "strata-128k", "llama-bench-d32768", "llama-bench-d131072"]
    assert "--pack iq2_xs --ple-rows 4000000 --routing trained --out " in s["make"]
    assert "/dev/shm/qwen3.8-flash-next-iq2_xs-ple4000000-trained.gguf" in s["strata-128k"]
    assert "--budgets 12 --prompt 32768 --prefill-prompts 4096,32768" in s["strata-32k"]
    assert "--budgets 12 --prompt 131072" in s["strata-128k"]
    assert "--budgets all" in s["llama-bench-d131072"] and "--depth 131072" in s["llama-bench-d131072"]
    assert "--budgets all" in s["llama-bench-d32768"] and "--depth 32768" in s["llama-bench-d32768"]
    # Strata's two rows keep 140 s for llama.cpp; the 32K depth 70 s of it
    assert _limit(s["strata-32k"]) + _limit(s["strata-128k"]) <= 500 - 140 and _limit(s["llama-bench-d32768"]) <= 70
    assert all(_limit(v) <= 500 for v in s.values())


def test_bad_arguments(tmp_path):
    for args, env, msg in ((["medium"], {}, "short or long"), (["long", "12,8"], {}, "one budget"),
                           (["short"], {"PACK": "q4_k_m"}, "PACK is q2_0 or iq2_xs"),
                           (["short"], {"PLE_ROWS": "many"}, "PLE_ROWS is a row count"),
                           (["short"], {"ROUTING": "sticky"}, "ROUTING is trained or spread")):
        p = _run(args, tmp_path, **env)
        assert p.returncode == 2 and msg in p.stdout


def test_vs_llama_ctx_table(tmp_path, capsys):
    dec = tmp_path / "d.json"
    dec.write_text(json.dumps({"facts": {}, "rows": [{"budget": "12", "tok_s": 80.0, "hit_rate": 0.9,
                                                                "pcie_ceiling_tok_s": 150.0, "hbm_ceiling_tok_s": 1300.0}]}))
    deep = tmp_path / "d2.json"
    deep.write_text(json.dumps({"facts": {}, "rows": [{"budget": "12", "tok_s": 70.0, "hit_rate": 0.88}]}))
    l32 = tmp_path / "l32.jsonl"
    l32.write_text("\n".join(json.dumps(r) for r in (
        {"budget": "all", "ncmoe": 0, "vram_gib": 40.0, "tg_tok_s": 60.0, "pp_tok_s": 0.0},
        {"budget": "12", "ncmoe": 40, "vram_gib": 11.5, "tg_tok_s": 20.0, "pp_tok_s": 0.0})) + "\n")
    l128 = tmp_path / "l128.jsonl"
    l128.write_text(json.dumps({"budget": "all", "ncmoe": 0, "vram_gib": 44.0, "tg_tok_s": 50.0}) + "\n")
    pre = tmp_path / "p.json"
    pre.write_text(json.dumps({"rows": [{"budget": "12", "prompt": 32768, "tok_s": 5100.0}]}))
    assert vs_llama_ctx.main(["--budget", "12", "--decode", f"32768={dec}", "--decode", f"131072={deep}",
                              "--llama", f"32768={l32}", "--llama", f"131072={l128}", "--prefill", str(pre)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| decode at 32,768 | 80.0 | 150 | 0.900 | 20.0 | 12 | 40 | 11.5 | 4.00x |"
    # llama.cpp only reached the 128K depth with everything in VRAM: beside it, no ratio
    assert out[3] == "| decode at 131,072 | 70.0 | - | 0.880 | 50.0 | all | 0 | 44.0 | - |"
    assert out[4] == "| prompt 32,768 | 5,100 | - | - | - | - | - | - | - |"
