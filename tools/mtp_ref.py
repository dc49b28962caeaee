"""Reference outputs of llama.cpp's MTP draft head for the hybrids' tiny models (tests/fixtures/mtp/*.json).

    python -m tools.mtp_ref [--out tests/fixtures/mtp]

For tiny-qwen3next and tiny-qwen35moe at F16 (written again by make_moe with the arguments of
tests/fixtures/hybrid/tiny-<arch>-f16.json, whose prompts it reuses), tools/llama_mtp_worker.py runs llama.cpp
0c1e570's draft-mtp path: the MTP block's top-10 logits at every prompt position, reading the target's hidden rows
(teacher-forced), and 4 chained drafts after the target's first pick. tests/test_mtp.py holds engine/drafters/mtp.py
to them. llama.cpp runs in tools.llama_ref's venv (STRATA_LLAMA_PYTHON overrides it).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

from tools import llama_ref, make_moe

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hybrid"       # the F16 references whose models and prompts it reuses
OUT = ROOT / "tests" / "fixtures" / "mtp"
WORKER = Path(__file__).resolve().parent / "llama_mtp_worker.py"
ARCHS = ("qwen3next", "qwen35moe")
N_DRAFT = 4


def make_f16(arch: str, out: Path) -> tuple[Path, dict]:
    """The F16 model of tiny-<arch>-f16.json, at out; (path, that JSON)."""
    ref = json.loads((FIXTURES / f"tiny-{arch}-f16.json").read_text())
    if ref["source"][0] != "python -m tools.make_moe":
        raise SystemExit(f"mtp_ref: tiny-{arch}-f16.json was not made by make_moe")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        make_moe.main([*ref["source"][1:], "--out", str(out)])
    if llama_ref.sha256(out) != ref["model_sha256"]:
        raise SystemExit(f"mtp_ref: make_moe no longer writes tiny-{arch}-f16.json's model")
    return out, ref


def record(model: Path, prompts: list[list[int]], n_draft: int = N_DRAFT) -> dict:
    req = {"model": str(model), "cases": [{"prompt_ids": p, "n_draft": n_draft} for p in prompts], "top": 10}
    r = subprocess.run([str(llama_ref.llama_python()), str(WORKER)], input=json.dumps(req), capture_output=True,
                       text=True, cwd=WORKER.parent)
    try:
        ans = json.loads(r.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"mtp_ref: llama.cpp's MTP worker died (exit {r.returncode}): {r.stderr[-800:]}") from None
    if "error" in ans:
        raise SystemExit(f"mtp_ref: llama.cpp: {ans['error']}")
    return ans


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--workdir", type=Path, default=ROOT / "data" / "cache" / "mtp_ref")
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    for arch in ARCHS:
        path, ref = make_f16(arch, args.workdir / f"tiny-{arch}-f16.gguf")
        ans = record(path, [c["prompt_ids"] for c in ref["cases"]])
        for case in ans["cases"]:
            for rows in (case["teacher"], case["draft_steps"]):
                for top in rows:
                    for pair in top:
                        pair[1] = round(pair[1], 5)
        out = {"model_file": path.name, "model_sha256": ref["model_sha256"], "source": ref["source"],
               "made_with": llama_ref.MADE_WITH.replace("then one token at a time (greedy)",
                                                        "its MTP context (draft-mtp), tools/llama_mtp_worker.py"),
               "fixture": f"tiny-{arch}-f16.json's prompts: the MTP's top-10 at every prompt position "
                          f"(teacher-forced on the target's rows), {N_DRAFT} chained drafts after the first pick",
               **ans}
        dst = args.out / f"tiny-{arch}-f16-mtp.json"
        dst.write_text(json.dumps(out, separators=(",", ":")) + "\n")
        print(f"mtp_ref: wrote {dst}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
