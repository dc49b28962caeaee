"""The worker's --draft (strata_worker.py, CPU backend): the same T lines with every drafter as without, DONE's
drafts fields filled, the drafter named on the INFO line, and bad choices refused at start with one line."""
import subprocess
import sys
from pathlib import Path

import pytest

from engine import protocol

ROOT = Path(__file__).resolve().parent.parent
HYBRID = ROOT / "tests" / "fixtures" / "hybrid" / "tiny-qwen35moe-q4_k_m.gguf"


def serve(model, flags, gens):
    """stdout lines of a worker that answers `gens` (GenRequests) and quits; its exit status and stderr."""
    text = "".join(protocol.format_gen(g) + "\n" for g in gens) + "QUIT\n"
    r = subprocess.run([sys.executable, str(ROOT / "strata_worker.py"), "--model", str(model), "--backend", "cpu",
                        "--ctx", "256", *flags], input=text, capture_output=True, text=True, timeout=300, cwd=ROOT)
    return r.returncode, r.stdout.splitlines(), r.stderr


def answers(lines):
    """[(T ids, Done)] per request, and the INFO facts."""
    out, toks, info = [], [], {}
    for ln in lines:
        if ln.startswith("T "):
            toks.append(int(ln.split()[1]))
        elif ln.startswith("DONE "):
            out.append((toks, protocol.parse_done(ln)))
            toks = []
        elif ln.startswith("INFO "):
            info.update(protocol.parse_info(ln))
    return out, info


@pytest.mark.parametrize("model,drafts", [("ref:tiny-llama-legacy", ("ngram", "auto")),
                                          ("hybrid", ("ngram", "mtp", "auto"))])
def test_every_drafter_gives_the_same_tokens_and_counts_its_drafts(fixtures_dir, model, drafts):
    path = HYBRID if model == "hybrid" else fixtures_dir / "reference" / f"{model[4:]}.gguf"
    gens = [protocol.GenRequest(40, [5, 9, 13, 5, 9, 13, 5, 9]),
            protocol.GenRequest(20, [5, 9, 13, 5, 9, 13, 5, 9, 17], {"temperature": 0.8, "seed": 4})]
    rc, lines, err = serve(path, ["--draft", "off"], gens)
    assert rc == 0, err
    plain, info = answers(lines)
    assert info["draft"] == "off" and all(d.drafts_offered == 0 for _, d in plain)
    for name in drafts:
        # fixed windows: the CPU backend's exact windows cost a step a token, so the rule would offer no drafts
        rc, lines, err = serve(path, ["--draft", name, "--draft-window", "6", "--draft-fixed"], gens)
        assert rc == 0, err
        got, info = answers(lines)
        used = "mtp" if name == "auto" and model == "hybrid" else "ngram" if name == "auto" else name
        assert info["draft"] == used
        assert [t for t, _ in got] == [t for t, _ in plain], name
        for _, d in got:
            assert 0 <= d.drafts_accepted <= d.drafts_offered
        if used == "mtp" or model != "hybrid":      # (the hybrid's answers repeat no n-gram: nothing to look up)
            assert sum(d.drafts_offered for _, d in got) > 0, name


def test_sampled_mtp_drafts_keep_greedy_requests_and_count_sampled_ones():
    """--draft-sampled: a sampled request's drafts are draws from the MTP block (judged by the speculative rule, so
    its tokens follow the model's distribution, not the seed's plain path); a greedy one's stay the argmax."""
    gens = [protocol.GenRequest(30, [5, 9, 13, 5, 9]), protocol.GenRequest(30, [5, 9, 13, 5, 9, 17],
                                                                         {"temperature": 0.7, "seed": 8})]
    rc, lines, err = serve(HYBRID, ["--draft", "off"], gens)
    assert rc == 0, err
    plain, _ = answers(lines)
    runs = []
    for _ in range(2):
        rc, lines, err = serve(HYBRID, ["--draft", "mtp", "--draft-sampled", "--draft-fixed"], gens)
        assert rc == 0, err
        runs.append(answers(lines)[0])
    assert runs[0][0][0] == plain[0][0]
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]]         # a seeded request is still reproducible
    assert len(runs[0][1][0]) == 30 and runs[0][1][1].drafts_offered > 0


def test_bad_draft_flags_are_refused_at_start(fixtures_dir):
    llama = fixtures_dir / "reference" / "tiny-llama-legacy.gguf"
    rc, lines, err = serve(llama, ["--draft", "mtp"], [])
    assert rc == 2 and "--draft mtp: llama has no MTP block" in err and "use --draft ngram" in err
    assert not any(ln.startswith("READY") for ln in lines)
    rc, _, err = serve(llama, ["--draft-window", "9"], [])
    assert rc == 2 and "--draft-window must be 2 to 8 tokens" in err
    rc, _, err = serve(llama, ["--draft", "eagle"], [])
    assert rc == 2 and "invalid choice" in err
