"""tools/batch.py: JSONL prompts through one real worker (CPU backend), results as they finish, --resume."""
import io
import json

import pytest

from engine.protocol import DONE_FIELDS
from tools import batch

MODEL = "tiny-llama-legacy.gguf"
P = [1021, 1022, 87, 301, 45, 600, 12, 999, 250, 77]


@pytest.fixture
def model(fixtures_dir):
    return fixtures_dir / "reference" / MODEL


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def read_jsonl(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def test_batch_results_errors_and_resume(model, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, [
        {"id": "a", "prompt": P, "max_new": 5},
        {"id": "b", "prompt": P + [5], "max_new": 5},
        {"id": "bad-id", "prompt": [1, 5000], "max_new": 3},
        "{not json",
        {"id": "typo", "prompt": [1, 2], "max_new": 3, "temprature": 1.0},
        {"id": "s1", "prompt": P, "max_new": 6, "temperature": 1.2, "seed": 3},
        {"id": "s2", "prompt": P, "max_new": 6, "temperature": 1.2, "seed": 3},
        {"id": "a-again", "prompt": P, "max_new": 5},
    ])
    log = io.StringIO()
    errors = batch.run_batch(model, inp, out, ["--backend", "cpu"], log=log)
    res = read_jsonl(out)
    by_id = {r["id"]: r for r in res}
    assert [r["id"] for r in res] == ["a", "b", "bad-id", None, "typo", "s1", "s2", "a-again"]
    assert errors == 3
    for rid in ("a", "b", "s1", "s2", "a-again"):
        r = by_id[rid]
        assert "error" not in r and set(DONE_FIELDS) <= set(r)
        assert r["generated"] == len(r["tokens"]) and r["finish"] in ("length", "stop")
    assert "outside this model's vocabulary" in by_id["bad-id"]["error"]
    assert "line 4 is not JSON" in by_id[None]["error"]
    assert "temprature" in by_id["typo"]["error"]
    # one worker for all: later prompts reuse the cached prefix, and reuse does not change the answer
    assert by_id["b"]["reused"] > 0 and by_id["a-again"]["reused"] > 0
    assert by_id["a-again"]["tokens"] == by_id["a"]["tokens"]
    assert by_id["s1"]["tokens"] == by_id["s2"]["tokens"]
    assert "[8/8]" in log.getvalue()

    # --resume: drop the last result (as if the run had been killed) and only that prompt runs again
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:-1]) + "\n")
    batch.run_batch(model, inp, out, ["--backend", "cpu"], resume=True, log=io.StringIO())
    again = read_jsonl(out)
    assert [r["id"] for r in again][:7] == [r["id"] for r in res][:7]
    # the entries without a usable id (None) are retried too; the rest are not run twice
    assert [r["id"] for r in again].count("a") == 1 and again[-1]["id"] == "a-again"
    assert again[-1]["tokens"] == by_id["a"]["tokens"]


def test_cli_exit_status(model, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, [{"id": 1, "prompt": P, "max_new": 2}])
    assert batch.main(["--model", str(model), "--backend", "cpu", str(inp), str(out)]) == 0
    assert read_jsonl(out)[0]["id"] == 1
    write_jsonl(inp, [{"id": 1, "prompt": [99999], "max_new": 2}])
    assert batch.main(["--model", str(model), "--backend", "cpu", str(inp), str(out)]) == 1


def test_a_bad_model_stops_the_batch_with_the_workers_reason(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_text("nope")
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [{"id": 1, "prompt": P, "max_new": 2}])
    assert batch.main(["--model", str(bad), str(inp), str(tmp_path / "out.jsonl")]) == 2
    assert "did not start" in capsys.readouterr().err
