"""bench.ple_rows on the tiny qwen4exp fixture: every figure is there, the gathers ahead are taken."""
import json
from pathlib import Path

import pytest

pytest.importorskip("cupy")     # the family module (ple_ids) imports CuPy; no GPU needed

from bench import ple_rows  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "qwen4exp" / "tiny-qwen4exp-iq2_xs.gguf"


def test_the_bench_measures_each_chunk_and_a_decode_token(tmp_path, capsys):
    out = tmp_path / "r.json"
    ple_rows.main(["--model", str(FIXTURE), "--tokens", "8,64", "--reps", "2", "--busy-ms", "1",
                   "--decode-tokens", "20", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [c["tokens"] for c in res["chunks"]] == [8, 64] and res["chunks"][1]["rows"] == 64 * 16
    for c in res["chunks"]:
        for k in ("hash_ms", "gather_ms", "gather_cpu_ms", "ahead_wait_ms", "ahead_gather_ms"):
            assert c[k]["min"] <= c[k]["median"]
    assert res["decode_token_us"]["median"] > 0
    assert "| 64 | 1024 |" in capsys.readouterr().out
