"""Decode speed at one VRAM budget for several prefetch copy grids (engine/cuda/prefetch.py's COPY_BLOCKS,
COPY_THREADS, MISS_BLOCKS and cuda_src/prefetch.cu's PF_LOADS), all in one process.

    python -m bench.prefetch_grid [--budget 12] [--passes 3] [--grids 8x256,32x256,8x256:64:8]

A grid is BLOCKSxTHREADS for the side-stream prefetch copy, optionally :MISS_BLOCKS (the late-miss copy's blocks,
default the engine's) and :LOADS (16-byte loads in flight a thread, default the engine's). The copy blocks share the
SMs with the decode step's kernels, so what they cost the step is measured here, not derived: bench.decode's model
and passes (a learning pass with every expert resident, then per grid a backend filled from the profile it saved, a
learning pass at the budget and --passes measured passes on fresh random prompts; ~2 tok/s of noise between passes
on the H200). Prints tok/s per pass and their mean, and the hit rate.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from bench.decode import DEFAULT_MODEL, free_vram, fresh_backend, make_model, run_pass


def parse_grid(text: str, miss: int, loads: int) -> tuple[int, int, int, int]:
    """'8x256' or '8x256:128' or '8x256:128:8' -> (blocks, threads, miss blocks, loads)."""
    try:
        parts = text.split(":")
        blocks, threads = (int(v) for v in parts[0].split("x"))
        miss = int(parts[1]) if len(parts) > 1 and parts[1] else miss
        loads = int(parts[2]) if len(parts) > 2 else loads
    except ValueError:
        raise SystemExit(f"bench.prefetch_grid: bad grid {text!r}; expected BLOCKSxTHREADS[:MISS_BLOCKS[:LOADS]], "
                         "e.g. 8x256 or 8x256:128:8") from None
    if min(blocks, threads, miss, loads) <= 0 or threads % 32 or len(parts) > 3:
        raise SystemExit(f"bench.prefetch_grid: bad grid {text!r}: positive numbers, threads a multiple of 32")
    return blocks, threads, miss, loads


def main(argv=None):
    from engine.cuda import prefetch as pf
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--budget", type=float, default=12.0, help="GiB")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--grids", default=f"{pf.COPY_BLOCKS}x{pf.COPY_THREADS},32x256")
    a = ap.parse_args(argv)
    grids = [parse_grid(g, pf.MISS_BLOCKS, pf.COPY_LOADS) for g in a.grids.split(",")]

    import shutil
    import tempfile
    from pathlib import Path

    from engine.gguf_model import open_model

    loads_now = [pf.COPY_LOADS]
    engine_load = pf.load_module

    def load_module(qtypes):       # the engine's, with PF_LOADS as a define when a grid asks for other loads
        return engine_load(qtypes, {"PF_LOADS": loads_now[0]} if loads_now[0] != pf.COPY_LOADS else None)

    pf.load_module = load_module
    model_path = Path(a.model)
    if not model_path.is_file():
        make_model(model_path)
    model = open_model(model_path)
    ctx = 512 + 256 + 16
    learned = Path(tempfile.mkdtemp(prefix="bench-grid-")) / "learned.profile"
    rng = np.random.default_rng(1)
    be = fresh_backend(model, ctx, "all", learned, adapt_every=32)
    run_pass(be, rng, 512, 256)                   # the routing every grid starts from
    be.close()
    first = learned.read_bytes()
    rows = []
    for blocks, threads, miss, loads in grids:
        pf.COPY_BLOCKS, pf.COPY_THREADS, pf.MISS_BLOCKS, loads_now[0] = blocks, threads, miss, loads
        learned.write_bytes(first)                # each grid from the same profile
        be = fresh_backend(model, ctx, str(a.budget), learned, adapt_every=32)
        run_pass(be, rng, 512, 256)
        ms = [run_pass(be, rng, 512, 256) for _ in range(a.passes)]
        be.close()
        tps = [m["steps"] / m["decode_s"] for m in ms]
        hit = sum(m["hits"] for m in ms) / max(sum(m["lookups"] for m in ms), 1)
        rows.append((blocks, threads, miss, loads, tps, hit))
        print(f"bench.prefetch_grid: {blocks}x{threads} miss {miss} loads {loads}: "
              + " ".join(f"{t:.1f}" for t in tps), file=sys.stderr, flush=True)
    free_vram()
    shutil.rmtree(learned.parent, ignore_errors=True)
    print(f"decode at {a.budget:g} GiB, {a.passes} passes a grid (512-token prompt, 256 new tokens)")
    print("| prefetch copy | miss copy blocks | loads a thread | KiB in flight | hit rate | tok/s per pass | mean |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for blocks, threads, miss, loads, tps, hit in rows:
        print(f"| {blocks} x {threads} | {miss} | {loads} | {blocks * threads * loads * 16 // 1024} | {hit:.3f} | "
              f"{' '.join(f'{t:.1f}' for t in tps)} | {np.mean(tps):.1f} |")


if __name__ == "__main__":
    main()
