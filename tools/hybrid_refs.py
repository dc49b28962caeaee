"""The hybrid fixtures (tests/fixtures/hybrid/), made with tools.llama_ref on prompts without router near-ties.

    STRATA_LLAMA_PYTHON=/tmp/llamavenv/bin/python python -m tools.hybrid_refs [--out tests/fixtures/hybrid]

For tiny-qwen3next and tiny-qwen35moe: the F16 model (llama_ref.make_source), llama-quantize's files of the
RECIPES below, and for each file llama_ref.reference on prompts of 300 and 40 tokens (300: longer than the CPU
backend's prompt chunk), with exact arithmetic from exact_logits (this engine's hybrid forward in float64;
tools.exact_forward has no Gated DeltaNet). The F16 .gguf is not kept (13.9 MB: the tests write it again with the
`source` arguments and check its sha256); the quantized ones are.

Prompts: random ids (seed 0, 1, ...) until the engine's own greedy run of each sees no router near-tie, the k-th
and (k+1)-th expert logits closer than MIN_GAP. llama.cpp rounds activations to fp16 (F16 weights) or 8 bits
(quantized), which flips such a tie, and a recurrent state then carries the other expert's output into every later
token: a 1e-4 gap in layer 0 moved the tiny qwen3next's logits by 0.4 forty tokens later.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tools import llama_ref

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("qwen3next", "qwen35moe")
RECIPES = {"qwen3next": ("q4_k_m", "q3_k_m"), "qwen35moe": ("q4_k_m", "iq4_xs")}
LENGTHS = (300, 40)
N_PREDICT = 24
MIN_GAP = 2e-3


def source_args(arch: str) -> list[str]:
    return ["--preset", f"tiny-{arch}"]


def _backend(path: Path, n_ctx: int):
    from engine.backend_cpu import CPUBackend
    from engine.gguf_model import open_model
    return CPUBackend(open_model(path), n_ctx)


def exact_logits(path: Path, ids: list[int]) -> np.ndarray:
    """The hybrid forward in float64 throughout over the dequantized weights: logits (len(ids), n_vocab)."""
    be = _backend(path, len(ids) + 8)
    cache = be.net.new_cache(len(ids) + 8, np.float64)
    return be.net.forward(np.asarray(ids), 0, cache, True)


def choose_prompts(path: Path, lengths=LENGTHS, n_predict: int = N_PREDICT, min_gap: float = MIN_GAP,
                   tries: int = 200) -> list[list[int]]:
    be = _backend(path, max(lengths) + n_predict + 8)
    chosen = []
    for n in lengths:
        for seed in range(tries):
            prompt = np.random.default_rng([seed, n]).integers(0, be.config.n_vocab - 3, n).tolist()
            be.truncate(0)
            be.net.min_route_gap = float("inf")
            logits = be.forward(prompt)
            for _ in range(n_predict - 1):
                logits = be.forward([int(np.argmax(logits))])
            if be.net.min_route_gap >= min_gap:
                chosen.append(prompt)
                break
        else:
            raise SystemExit(f"hybrid_refs: no prompt of {n} tokens without a router gap under {min_gap} in {tries} "
                             f"tries on {path.name}")
    return chosen


def write_fixtures(out_dir: Path, workdir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    for arch in ARCHS:
        src = llama_ref.make_source(workdir / f"tiny-{arch}-f16.gguf", source_args(arch))
        files = {"f16": src}
        for recipe in RECIPES[arch]:
            files[recipe] = llama_ref.quantize(src, out_dir / f"tiny-{arch}-{recipe}.gguf", recipe)
        for recipe, path in files.items():
            ref = llama_ref.reference(
                path, choose_prompts(path), N_PREDICT, exact=exact_logits, fixture=f"tiny-{arch}", recipe=recipe,
                source=["python -m tools.make_moe", *source_args(arch), *llama_ref.F16_TYPES],
                prompts_chosen_by=f"tools.hybrid_refs.choose_prompts: no router gap under {MIN_GAP} in the "
                                  f"engine's own greedy run")
            dst = out_dir / f"tiny-{arch}-{recipe}.json"
            dst.write_text(json.dumps(ref, separators=(",", ":")) + "\n")
            print(f"hybrid_refs: {dst.name}: llama.cpp vs exact {ref['llama_vs_exact']}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.hybrid_refs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "hybrid")
    ap.add_argument("--workdir", type=Path, default=llama_ref.CACHE / "models")
    a = ap.parse_args(argv)
    try:
        write_fixtures(a.out, a.workdir)
    except llama_ref.LlamaRefError as e:
        raise SystemExit(f"hybrid_refs: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
