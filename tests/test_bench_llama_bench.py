"""bench.llama_bench on the CPU: the expert bytes -ncmoe moves, the layer count per budget, and a whole run against a
fake llama-bench and nvidia-smi (the real ones run on the GPU machine)."""
from __future__ import annotations

import gzip
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from bench import llama_bench as lb

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tools import make_moe
    out = tmp_path_factory.mktemp("lb") / "tiny.gguf"
    make_moe.main(["--preset", "tiny", "--out", str(out), "--threads", "1"])
    return out


def test_expert_bytes_are_the_exps_tensors(tiny):
    from engine.gguf_model import open_model
    m = open_model(tiny)
    per = lb.expert_bytes(tiny)
    assert len(per) == m.config.n_layer
    for il, n in enumerate(per):
        want = sum(m.tensor(f"blk.{il}.ffn_{k}_exps.weight").nbytes for k in ("gate", "up", "down"))
        assert n == want > 0


def test_layers_for_a_budget():
    per = [lb.GIB] * 10                              # 1 GiB of experts a layer
    assert lb.layers_for(20.0, 15.0, per) == 0       # fits as it is
    assert lb.layers_for(12.0, 15.0, per) == 3
    assert lb.layers_for(11.5, 15.0, per) == 4       # 3.5 GiB to move: four layers
    assert lb.layers_for(5.0, 15.0, per) == 10
    assert lb.layers_for(4.9, 15.0, per) is None     # the rest of the model alone is over


def _script(path: Path, body: str) -> None:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_a_run_picks_layers_measures_and_corrects(tiny, tmp_path, monkeypatch, capsys):
    """A fake llama-bench holds VRAM as a file the fake nvidia-smi reads: 6 GiB less 1 GiB per layer whose experts
    are on the CPU (the file's expert bytes are faked to 1 GiB a layer), plus 0.5 GiB of prompt buffers once any
    is: at a 3.2 GiB budget the estimate (3 layers) lands 0.3 GiB over, and the correction takes a fourth."""
    state = tmp_path / "vram"
    state.write_text("1000")
    monkeypatch.setattr(lb, "expert_bytes", lambda path: [lb.GIB] * 8)
    _script(tmp_path / "nvidia-smi", f"print(open({str(state)!r}).read())\n")
    _script(tmp_path / "llama-bench", f"""import sys, json, time
a = sys.argv
n = int(a[a.index("-ncmoe") + 1])
used = (6 - n) * 1024 + (512 if n else 0)
open({str(state)!r}, "w").write(str(1000 + used))
time.sleep(0.6)
open({str(state)!r}, "w").write("1000")
print(json.dumps([{{"n_prompt": 4096, "n_gen": 0, "avg_ts": 1000.0 - n}}, {{"n_prompt": 0, "n_gen": 128, "avg_ts": 50.0 - n}}]))
""")
    gz = tmp_path / "fake-llama-bench.gz"
    with open(tmp_path / "llama-bench", "rb") as src, gzip.open(gz, "wb") as dst:
        dst.write(src.read())
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    out = tmp_path / "rows.jsonl"
    unpacked = Path("/tmp") / "fake-llama-bench"
    unpacked.unlink(missing_ok=True)
    try:
        assert lb.main(["--model", str(tiny), "--bench", str(gz), "--budgets", "all,3.2,30",
                        "--out", str(out)]) == 0
        assert unpacked.is_file()
    finally:
        unpacked.unlink(missing_ok=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["budget"] for r in rows] == ["all", "3.2", "30"]
    assert rows[0]["ncmoe"] == 0 and rows[0]["pp_tok_s"] == 1000.0 and rows[0]["tg_tok_s"] == 50.0
    assert rows[0]["vram_gib"] == pytest.approx(6.0, abs=0.01)
    assert rows[1]["ncmoe"] == 4 and rows[1]["vram_gib"] == pytest.approx(2.5, abs=0.01)
    assert rows[1]["pp_tok_s"] == 996.0
    assert rows[2]["ncmoe"] == 0                      # a budget above the whole model: as "all"
    assert "| 3.2 | 4 | 2.5 |" in capsys.readouterr().out


@pytest.mark.parametrize("depth", [0, 32768])
def test_probe_picks_layers_by_short_runs_then_measures_once(tiny, tmp_path, monkeypatch, depth):
    """--probe: the VRAM peaks come from one-batch runs (-p 512 -n 0 -r 1 --no-warmup) and each budget gets one
    measured run at the layer count they picked, whose own peak is the row's; rows reach --out as they are
    measured. The fake's VRAM model is the test above's (3.2 GiB: 3 layers over, 4 under). --depth: the measured
    run alone gets -d (the probes pick layers by the experts' bytes) and its row says the depth."""
    state, calls = tmp_path / "vram", tmp_path / "calls"
    state.write_text("1000")
    monkeypatch.setattr(lb, "expert_bytes", lambda path: [lb.GIB] * 8)
    _script(tmp_path / "nvidia-smi", f"print(open({str(state)!r}).read())\n")
    _script(tmp_path / "llama-bench", f"""import sys, json, time
a = sys.argv
open({str(calls)!r}, "a").write(" ".join(a[1:]) + "\\n")
n = int(a[a.index("-ncmoe") + 1])
p, g = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
used = (6 - n) * 1024 + (512 if n else 0)
open({str(state)!r}, "w").write(str(1000 + used))
time.sleep(0.6)
open({str(state)!r}, "w").write("1000")
rows = [{{"n_prompt": p, "n_gen": 0, "avg_ts": 1000.0 - n}}] + ([{{"n_prompt": 0, "n_gen": g, "avg_ts": 50.0 - n}}] if g else [])
print(json.dumps(rows))
""")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    out = tmp_path / "rows.jsonl"
    assert lb.main(["--model", str(tiny), "--bench", str(tmp_path / "llama-bench"), "--budgets", "3.2",
                    "--probe", "--reps", "1", "--out", str(out)] + (["--depth", str(depth)] if depth else [])) == 0
    runs = calls.read_text().splitlines()
    probes = [r for r in runs if "--no-warmup" in r]
    assert len(probes) == 3 and all("-p 512 -n 0 -r 1" in r and " -d " not in r for r in probes)
    assert [r.split("-ncmoe ")[1].split()[0] for r in probes] == ["0", "3", "4"]     # 3 lands over: 4
    measured = [r for r in runs if "--no-warmup" not in r]
    assert len(measured) == 1 and "-ncmoe 4 -p 4096 -n 128 -r 1" in measured[0]
    assert measured[0].endswith(f" -d {depth}") if depth else " -d " not in measured[0]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0].get("depth") == (depth or None)
    assert len(rows) == 1 and rows[0]["budget"] == "3.2" and rows[0]["ncmoe"] == 4
    assert "probe" not in rows[0] and rows[0]["tg_tok_s"] == 46.0
    assert rows[0]["vram_gib"] == pytest.approx(2.5, abs=0.01)


def test_missing_model_says_what_to_do(tmp_path):
    with pytest.raises(SystemExit, match="make it with tools.make_moe"):
        lb.main(["--model", str(tmp_path / "none.gguf")])


def test_vs_llama_puts_the_rows_side_by_side(tmp_path):
    from bench import vs_llama
    (tmp_path / "d.json").write_text(json.dumps({"facts": {}, "rows": [
        {"budget": "all", "tok_s": 300.0, "hit_rate": 1.0}, {"budget": "12", "tok_s": 200.0, "hit_rate": 0.9}]}))
    (tmp_path / "p.json").write_text(json.dumps({"facts": {}, "rows": [
        {"budget": "all", "prompt": 4096, "tok_s": 20000.0}, {"budget": "all", "prompt": 1024, "tok_s": 1.0},
        {"budget": "12", "prompt": 4096, "tok_s": 18000.0}]}))
    (tmp_path / "l.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"budget": "all", "ncmoe": 0, "vram_gib": 17.7, "pp_tok_s": 6786.0, "tg_tok_s": 308.0},
        {"budget": "12", "ncmoe": 18, "vram_gib": 11.9, "pp_tok_s": 619.0, "tg_tok_s": 87.1}]))
    text = vs_llama.table(vs_llama.load(tmp_path / "d.json", tmp_path / "p.json", tmp_path / "l.jsonl"))
    lines = text.splitlines()
    assert lines[2] == "| all | 300.0 | 1.000 | 308.0 | 0.97x | 20,000 | 6,786 | 2.95x | 0 | 17.7 |"
    assert lines[3] == "| 12 | 200.0 | 0.900 | 87.1 | 2.30x | 18,000 | 619 | 29.08x | 18 | 11.9 |"
    # a missing side prints dashes, not a made-up figure
    rows = vs_llama.load(tmp_path / "d.json", tmp_path / "none.json", tmp_path / "none.jsonl")
    assert vs_llama.table(rows).splitlines()[3] == "| 12 | 200.0 | 0.900 | - | - | - | - | - | - | - |"


def test_vs_llama_says_when_strata_ran_in_a_memory_mode(tmp_path, capsys):
    from bench import vs_llama
    d = tmp_path / "d.json"
    d.write_text(json.dumps({"facts": {"memory": "pinned"}, "rows": []}))
    assert vs_llama.memory_note(d) is None
    d.write_text(json.dumps({"facts": {"memory": "budget", "experts_pinned": 4130, "arena_gib": 52.0}, "rows": [
        {"budget": "12", "tok_s": 30.0, "hit_rate": 0.34}]}))
    assert vs_llama.main([str(d), str(tmp_path / "p.json"), str(tmp_path / "l.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "| 12 | 30.0 | 0.340 |" in out
    assert "memory mode budget, 4130 experts pinned (52.0 GiB)" in out
