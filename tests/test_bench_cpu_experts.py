"""bench.cpu_experts runs end to end on a small pool and prints its table beside the plain-read ceiling."""
from __future__ import annotations

import pytest

pytest.importorskip("numba", reason="bench.cpu_experts times the numba kernels")
from bench import cpu_experts  # noqa: E402


def test_the_table(capsys):
    assert cpu_experts.main(["--preset", "tiny", "--pool-gib", "0.02", "--reps", "2", "--threads", "1,999"]) == 0
    out = capsys.readouterr().out
    assert "tiny experts (256 x 256, Q4_K/Q4_K/Q4_K, swiglu), 2 a call" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| 1 |") or ln.startswith("| 999 |")]
    assert len(rows) == 2 and rows[0].count("|") == 6 and "skipped: numba allows" in rows[1]


def test_types_and_bad_arguments(capsys):
    assert cpu_experts.main(["--preset", "gpt-oss-tiny", "--types", "mxfp4,mxfp4,q8_0", "--pool-gib", "0.02",
                             "--reps", "1", "--threads", "1"]) == 0
    assert "MXFP4/MXFP4/Q8_0, swiglu_oai" in capsys.readouterr().out
    for argv, msg in ((["--types", "Q4_K"], "--types takes gate,up,down"), (["--types", "q9,q4_k,q4_k"], "unknown"),
                      (["--preset", "nope"], "no preset 'nope'"), (["--threads", "a"], "is not a list"),
                      (["--pool-gib", "0.000001"], "holds")):
        with pytest.raises(SystemExit, match=msg):
            cpu_experts.main(argv)


def test_prefetch_distances(capsys):
    assert cpu_experts.main(["--preset", "tiny", "--pool-gib", "0.02", "--reps", "1", "--threads", "1",
                             "--ahead", "0,8"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 1 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["0", "8"]
    for bad in ("x", "-1"):
        with pytest.raises(SystemExit, match="--ahead"):
            cpu_experts.main(["--preset", "tiny", "--ahead", bad])


def test_row_dots(capsys):
    assert cpu_experts.main(["--row-dots", "q4_k,mxfp4"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| Q4_K") or ln.startswith("| MXFP4")]
    assert len(rows) == 2 and all(float(r.split("|")[3]) > 0 for r in rows)
