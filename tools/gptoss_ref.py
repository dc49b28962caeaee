"""The gpt-oss fixtures (tests/fixtures/gptoss/): llama.cpp's outputs and exact arithmetic's, through tools.llama_ref.

    STRATA_LLAMA_PYTHON=/tmp/llamavenv/bin/python python -m tools.gptoss_ref --out tests/fixtures/gptoss

Three files of make_moe's gpt-oss-tiny preset at seed 1: `f16` (every matrix F16: the architecture check),
`mxfp4` (the published GGUFs' types: MXFP4 experts, Q8_0 elsewhere) and `q4_k_m` (llama-quantize's recipe on the
F16 file, as the re-quantized downloads are made). Prompts of 40, 90 and 150 text tokens, past the window of 16;
24 greedy steps each. Exact arithmetic is tools/gptoss_exact.py (tools/exact_forward.py has no gpt-oss).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

from tools import llama_ref as lr
from tools.gptoss_exact import exact_logits

PRESET = ["--preset", "gpt-oss-tiny", "--seed", "1"]
N_TEXT = 1021          # ids below this are tiny-bpe-1024's text tokens (the harmony controls follow)
LENGTHS = (40, 90, 150)
N_PREDICT = 24


def make_models(workdir: Path) -> dict[str, Path]:
    """{"f16", "mxfp4", "q4_k_m": path}, made again only where missing (q4_k_m needs llama.cpp)."""
    from tools import make_moe
    workdir.mkdir(parents=True, exist_ok=True)
    out = {"f16": workdir / "gpt-oss-tiny-f16.gguf", "mxfp4": workdir / "gpt-oss-tiny-mxfp4.gguf",
           "q4_k_m": workdir / "gpt-oss-tiny-q4_k_m.gguf"}
    if not out["f16"].is_file():
        lr.make_source(out["f16"], PRESET)
    if not out["mxfp4"].is_file():
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            make_moe.main([*PRESET, "--threads", "1", "--out", str(out["mxfp4"])])
    if not out["q4_k_m"].is_file():
        lr.quantize(out["f16"], out["q4_k_m"], "q4_k_m")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gptoss_ref", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for the JSON files")
    ap.add_argument("--workdir", type=Path, default=Path("data/cache/gptoss"), help="where the models are made")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ps = lr.prompts(N_TEXT, seed=0, lengths=LENGTHS)
    for kind, path in make_models(args.workdir).items():
        ref = lr.reference(path, ps, N_PREDICT, exact=exact_logits, fixture="gpt-oss-tiny", recipe=kind)
        (args.out / f"gpt-oss-tiny-{kind}.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n")
        print(f"gpt-oss-tiny-{kind}: llama.cpp vs exact {ref['llama_vs_exact']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
