"""Where a quant type's CUDA logits part from the CPU backend's: one tiny qwen3moe per case, the type in one tensor
class (experts or attention), teacher-forced through the prompt pass and through the decode step, and beside each
GPU figure the same figure of tools/cuda_roundings.py's model (the backend's fp16 roundings, no kernel error): a GPU
figure well above its model's is a bug, one near it the roundings and routing near-ties.

Columns: `pass` / `decode` the largest relative row distance from the CPU backend's own logits (a near-tie the two
route apart moves a row by 10-60%); `routed` the prompt pass against the CPU backend following the pass's routes at
its near-ties (tests/route_ties.py's rule; with --model-only the model's decode steps too); `step-model` the GPU
decode steps against the model's (both fp32 with fp16 K/V: apart by fp32 summation order unless a kernel errs; a
1e-6 relative perturbation of the weights moves the model's steps at most 6e-4 on the whole-model test's files).
--attn-gain 3 gives the first table's files (docs/experiments.md, 2026-12-02), where the roundings alone part rows by
up to 20%; the default is the whole-model test's gain (tests/new_quant_models.py). GPU machine:
`python -m tools.new_quant_diag [CASE ...]`; `--model-only` prints the model's columns on any machine.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path

import numpy as np

from tools import make_moe
from tools.cuda_roundings import DECODE, PASS, RoundedModel, rel_rows

ROOT = Path(__file__).resolve().parent.parent
# where tests/conftest.py looks for the fixtures: $STRATA_FIXTURES, ../shared beside the checkout, .fixtures/ in it
FIXTURES = [Path(p) for p in (os.environ.get("STRATA_FIXTURES"), ROOT.parent / "shared" / "fixtures",
                              ROOT / ".fixtures") if p]
CASES = {"control": [], "q2_0_exp": ["--experts", "Q2_0"], "q2_0_attn": ["--attn", "Q2_0"],
         "q1_0_exp": ["--experts", "Q1_0"], "q1_0_attn": ["--attn", "Q1_0"], "nvfp4_exp": ["--experts", "NVFP4"],
         "nvfp4_attn": ["--attn", "NVFP4"], "q2_0_recipe": ["--recipe", "q2_0"]}
ATTN_GAIN = 1.4             # tests/new_quant_models.py's
CTX, CHUNK, N_TOKENS = 128, 64, 40


def vocab() -> Path:
    for d in FIXTURES:
        if (d / "vocab" / "tiny-bpe-1024.gguf").is_file():
            return d / "vocab" / "tiny-bpe-1024.gguf"
    raise SystemExit(f"new_quant_diag: no vocab/tiny-bpe-1024.gguf under {', '.join(map(str, FIXTURES))}; set "
                     f"STRATA_FIXTURES to the fixtures folder")


def make(name: str, gain: float, out: Path) -> Path:
    """Case `name` as a tiny qwen3moe (make_moe's default type, Q4_K, in every other class: the control's)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        make_moe.main(["--preset", "tiny", "--arch", "qwen3moe", *CASES[name], "--seed", "3", "--attn-gain",
                       str(gain), "--threads", "8", "--vocab", str(vocab()), "--out", str(out)])
    return out


def routed_reference(model, tokens, routes) -> np.ndarray:
    """The CPU backend's logits following `routes` at its near-ties (the model without roundings is it, bit for bit:
    tests/test_cuda_roundings.py)."""
    return RoundedModel(model, CTX, CHUNK).forward(tokens, all_logits=True, follow=routes)


def model_figures(model, tokens, want) -> dict:
    rm = RoundedModel(model, CTX, CHUNK)
    passed = rm.forward(tokens, all_logits=True, roundings=PASS)
    routed = routed_reference(model, tokens, dict(rm.routes))
    rm.truncate(0)
    stepped = np.stack([rm.forward([t], roundings=DECODE) for t in tokens])
    step_routed = routed_reference(model, tokens, dict(rm.routes))
    return {"pass": rel_rows(passed, want).max(), "routed": rel_rows(passed, routed).max(),
            "decode": rel_rows(stepped, want).max(), "decode routed": rel_rows(stepped, step_routed).max(),
            "steps": stepped}


def gpu_figures(model, tokens, want, model_steps) -> dict:
    from engine.cuda.args import CudaOptions
    from engine.cuda.backend import CUDABackend
    from engine.cuda.trace import Tracer

    class Routes(Tracer):
        def __init__(self):
            self.taken = {}

        def prefill_routes(self, pos0, layer, ids):
            for t, row in enumerate(ids.get().reshape(len(ids), -1)):
                self.taken[(pos0 + t, layer)] = frozenset(int(e) for e in row)

    tracer = Routes()
    be = CUDABackend(model, CTX, CudaOptions(prefill_chunk=CHUNK, stream_min=1), tracer=tracer)
    try:
        passed = be.forward(tokens, all_logits=True)
        be.truncate(0)
        stepped = np.stack([be.forward([t]) for t in tokens])
    finally:
        be.close()
    return {"pass": rel_rows(passed, want).max(),
            "routed": rel_rows(passed, routed_reference(model, tokens, tracer.taken)).max(),
            "decode": rel_rows(stepped, want).max(), "step-model": rel_rows(stepped, model_steps).max()}


def main(argv=None) -> int:
    from engine.backend_cpu import CPUBackend
    from engine.gguf_model import open_model
    ap = argparse.ArgumentParser(prog="python -m tools.new_quant_diag", description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", metavar="CASE", help=f"of {', '.join(CASES)} (default: all)")
    ap.add_argument("--attn-gain", type=float, default=ATTN_GAIN, help=f"make_moe's (default {ATTN_GAIN})")
    ap.add_argument("--model-only", action="store_true", help="the rounding model's columns only (no GPU needed)")
    args = ap.parse_args(argv)
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        ap.error(f"unknown case {bad[0]!r}; the cases are {', '.join(CASES)}")
    tokens = np.random.default_rng(5).integers(3, 1000, N_TOKENS).tolist()
    print(f"attention gain {args.attn_gain}" + ("; the rounding model" if args.model_only else "; GPU / model"))
    for name in args.cases or list(CASES):
        model = open_model(make(name, args.attn_gain, Path(f"/tmp/new_quant_diag_{name}.gguf")))
        cpu = CPUBackend(model, CTX, chunk=CHUNK)
        try:
            want = cpu.forward(tokens, all_logits=True)
        finally:
            cpu.close()
        m = model_figures(model, tokens, want)
        if args.model_only:
            print(f"{name:12s} pass {m['pass']:.4f}  routed {m['routed']:.4f}  decode {m['decode']:.4f}  "
                  f"decode routed {m['decode routed']:.4f}", flush=True)
            continue
        g = gpu_figures(model, tokens, want, m["steps"])
        print(f"{name:12s} pass {g['pass']:.4f} / {m['pass']:.4f}  routed {g['routed']:.4f} / {m['routed']:.4f}  "
              f"decode {g['decode']:.4f} / {m['decode']:.4f}  step-model {g['step-model']:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
