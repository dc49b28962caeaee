"""Where a quant type's CUDA logits part from the CPU backend's: one tiny qwen3moe per case, the type in one tensor
class (experts or attention), teacher-forced through the prompt pass and through the decode step, each beside the
NumPy backend's rows (relative max over rows, no route following: a plain Q8_0 file is the control that shows the
routing near-ties' share). GPU machine only: `python -m tools.new_quant_diag [CASE ...]` (docs/experiments.md,
2026-12-02, has its first table)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VOCAB = ROOT.parent / "shared" / "fixtures" / "vocab" / "tiny-bpe-1024.gguf"
CASES = {"q8_all": [], "q2_0_exp": ["--experts", "Q2_0"], "q2_0_attn": ["--attn", "Q2_0"],
         "q1_0_exp": ["--experts", "Q1_0"], "q1_0_attn": ["--attn", "Q1_0"], "nvfp4_exp": ["--experts", "NVFP4"],
         "nvfp4_attn": ["--attn", "NVFP4"], "q2_0_recipe": ["--recipe", "q2_0"]}


def rel(a, b) -> float:
    return float((np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).max())


def main(argv=None) -> int:
    from engine.backend_cpu import CPUBackend
    from engine.cuda.args import CudaOptions
    from engine.cuda.backend import CUDABackend
    from engine.gguf_model import open_model
    from tools import make_moe
    names = (argv if argv is not None else sys.argv[1:]) or list(CASES)
    prompt = np.random.default_rng(5).integers(3, 1000, 40).tolist()
    for name in names:
        path = Path(f"/tmp/new_quant_diag_{name}.gguf")
        make_moe.main(["--preset", "tiny", "--arch", "qwen3moe", *CASES[name], "--seed", "3", "--routing", "spread",
                       "--threads", "8", "--vocab", str(VOCAB), "--out", str(path)])
        model = open_model(path)
        cpu = CPUBackend(model, 128)
        want = cpu.forward(prompt, all_logits=True)
        cpu.close()
        be = CUDABackend(model, 128, CudaOptions(prefill_chunk=64, stream_min=1))
        try:
            passed = be.forward(prompt, all_logits=True)
            be.truncate(0)
            stepped = np.stack([be.forward([t]) for t in prompt])
        finally:
            be.close()
        print(f"{name}: prompt pass {rel(passed, want):.4f}  decode {rel(stepped, want):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
