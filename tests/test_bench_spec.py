"""bench.spec's logic on the CPU backend with a tiny model (the figures themselves come from the GPU machine): every
oracle row exact, the acceptance following a, the real drafters' costs, the windows' expert unions."""
import json
from pathlib import Path

from bench import spec

HYBRID = Path(__file__).resolve().parent / "fixtures" / "hybrid" / "tiny-qwen35moe-q4_k_m.gguf"


def test_bench_spec_on_the_cpu_backend(tmp_path, capsys):
    out = tmp_path / "spec.json"
    rc = spec.main(["--backend", "cpu", "--model", str(HYBRID), "--prompt", "24", "--new", "20", "--windows", "1,2,4",
                    "--accept", "0.0,0.9,1.0", "--drafters", "ngram,mtp,eagle", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    (b,) = res["budgets"]
    rows = {(r["window"], r["accept"]): r for r in b["rows"]}
    assert set(rows) == {(1, None)} | {(w, a) for w in (2, 4) for a in (0.0, 0.9, 1.0)}
    assert all(r["exact"] for r in rows.values())
    for w in (2, 4):
        assert rows[(w, 0.0)]["acceptance"] == 0.0 and rows[(w, 0.0)]["tokens_per_window"] == 1.0
        assert rows[(w, 1.0)]["acceptance"] == 1.0 and rows[(w, 1.0)]["tokens_per_window"] > 1.5
        assert 0.0 < rows[(w, 0.9)]["acceptance"] < 1.0
        # a window's union of experts: at least one token's, at most every token's without sharing
        r = rows[(w, 1.0)]
        assert r["experts_unshared"] <= r["experts_per_window"] <= w * r["experts_unshared"]
    assert rows[(1, None)]["experts_per_token"] == rows[(1, None)]["experts_unshared"] == 8
    d = {x["drafter"]: x for x in b["drafters"]}
    assert d["mtp"]["offered"] > 0 and d["mtp"]["ms_per_draft"] > 0
    assert d["ngram"]["ms_per_token_followed"] >= 0 and "choose one of" in d["eagle"]["skipped"]
    assert "| window | a=0.0 | a=0.9 | a=1.0 |" in capsys.readouterr().out
