"""Quantized mat-vec bandwidth on the GPU: GB/s of weights (+ activations) read per launch, against HBM's ceiling.

    python bench/matvec.py [--quick] [--out results.json]

Each case cycles through enough copies of its matrix (>= 400 MB together) that the 50 MB L2 cannot serve them, and is
timed as a replayed CUDA graph of launches, so neither the L2 nor Python's launch cost flatters the figure.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.cuda.kernels import quant_function  # noqa: E402
from engine.cuda.quant_types import NAMES, qtype, random_rows  # noqa: E402

MATVEC_ROWS = {1: (1, 2, 4), 2: (1, 2), 3: (1, 2), 4: (1, 2), 5: (1, 2), 6: (1, 2), 7: (1, 2), 8: (1, 2)}
MATVEC_WARPS = 4  # warps per block in matvec.cu


# Types whose mat-vec ran faster with two rows per warp on 8192 x 8192 (docs/experiments.md, "Rows per warp"); the
# K-quants and the 2-bit i-quants, with more registers per row, ran fastest with one.
_TWO_ROW_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q6_K", "IQ4_NL", "IQ3_S", "MXFP4"}


def matvec_plan(nrows: int, nv: int = 1, rows_per_warp: int | None = None, qtype_=None,
                ncols: int | None = None) -> tuple[str, tuple[int], tuple[int], int]:
    """(kernel name, grid, block, rows per warp) for matvec.cu. Without rows_per_warp, the choice follows the H200
    measurements: several vectors or short rows (<= 1024 columns, many rows) gain from sharing each x chunk across
    rows; single vectors over long rows gain only for the simple types; small matrices need one row per warp so that
    enough warps run."""
    if nv not in MATVEC_ROWS:
        raise ValueError(f"matvec takes 1 to 8 vectors at once, got {nv}")
    if rows_per_warp is None:
        name = qtype(qtype_).name if qtype_ is not None else None
        if nv > 1:
            rows_per_warp = 2 if nrows >= 8192 else 1
        elif ncols is not None and ncols <= 1024 and nrows >= 32768:
            rows_per_warp = 4
        elif name in _TWO_ROW_TYPES and nrows >= 8192:
            rows_per_warp = 2
        else:
            rows_per_warp = 1
    r = max(x for x in MATVEC_ROWS[nv] if x <= rows_per_warp)
    per_block = MATVEC_WARPS * r
    return f"matvec_r{r}_nv{nv}", ((nrows + per_block - 1) // per_block,), (32 * MATVEC_WARPS,), r

HBM_CEILING = 4.4e12  # bytes/s (docs/design.md "Measured facts": 4,454 GB/s HBM read)

# (type, rows, cols, vectors, what)
SHAPES = [
    ("Q6_K", 151936, 2048, 1, "Qwen3 output head"),
    ("Q4_K", 151936, 2048, 1, "Qwen3 output head at Q4_K"),
    ("Q4_K", 4096, 2048, 1, "Qwen3-30B q_proj"),
    ("Q4_K", 2048, 4096, 1, "Qwen3-30B o_proj"),
    ("Q4_K", 768, 2048, 1, "one expert's gate"),
    ("Q4_K", 2048, 768, 1, "one expert's down"),
    ("Q4_K", 16384, 8192, 1, "large Q4_K"),
    ("Q4_K", 16384, 8192, 4, "large Q4_K, 4 vectors"),
    ("Q4_K", 16384, 8192, 8, "large Q4_K, 8 vectors"),
    ("Q8_0", 49152, 576, 1, "SmolLM2 embeddings as head"),
    ("Q4_1", 49152, 576, 1, "SmolLM2 head at Q4_1"),
]
SWEEP = (8192, 8192)  # every type at this shape


def measure_copy(cp, nbytes=1 << 30) -> float:
    """Device-to-device copy, read + write bytes per second (the practical HBM figure on this card)."""
    a = cp.empty(nbytes, dtype=cp.uint8)
    b = cp.empty_like(a)
    b[...] = a
    cp.cuda.Device().synchronize()
    t0, t1 = cp.cuda.Event(), cp.cuda.Event()
    t0.record()
    for _ in range(10):
        b[...] = a
    t1.record()
    t1.synchronize()
    return 2 * nbytes * 10 / (cp.cuda.get_elapsed_time(t0, t1) / 1e3)


def bench_case(cp, name, nrows, ncols, nv, rng, min_total=400e6, reps=5):
    """Time every rows-per-warp variant of matvec_r*_nv<nv> on one random matrix; a row dict per variant."""
    q = qtype(name)
    row_bytes = q.row_bytes(ncols)
    mat_bytes = nrows * row_bytes
    copies = max(1, math.ceil(min_total / mat_bytes))
    w_one = cp.asarray(random_rows(name, nrows, ncols, rng))
    ws = [w_one] + [w_one.copy() for _ in range(copies - 1)]
    x = cp.asarray(rng.standard_normal((nv, ncols), dtype=np.float32))
    y = cp.empty((nv, nrows), dtype=cp.float32)
    launches = max(copies, 20)
    moved = mat_bytes + nv * (ncols + nrows) * 4
    _, _, _, planned = matvec_plan(nrows, nv, qtype_=name, ncols=ncols)
    out = []
    for r in MATVEC_ROWS[nv]:
        kernel, grid, block, _ = matvec_plan(nrows, nv, r)
        fn = quant_function("matvec", kernel, name)
        args = lambda w: (w, np.int64(row_bytes), x, np.int32(ncols), y, np.int32(nrows),  # noqa: E731
                          np.int32(nrows), np.int32(ncols))
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            for w in ws:
                fn(grid, block, args(w))
            stream.synchronize()
            graph = None
            try:
                stream.begin_capture()
                for i in range(launches):
                    fn(grid, block, args(ws[i % copies]))
                graph = stream.end_capture()
            except Exception as e:  # capture unsupported: time plain launches (host launch cost included)
                print(f"  (no CUDA graph: {type(e).__name__}: {e}; timing plain launches)", file=sys.stderr)
            t0, t1 = cp.cuda.Event(), cp.cuda.Event()
            best = float("inf")
            for _ in range(reps):
                t0.record(stream)
                if graph is not None:
                    graph.launch(stream)
                else:
                    for i in range(launches):
                        fn(grid, block, args(ws[i % copies]))
                t1.record(stream)
                t1.synchronize()
                best = min(best, cp.cuda.get_elapsed_time(t0, t1) / 1e3 / launches)
        out.append({"type": name, "rows": nrows, "cols": ncols, "nv": nv, "rows_per_warp": r,
                    "planned": r == planned, "mb": mat_bytes / 1e6, "us": best * 1e6,
                    "gbps": moved / best / 1e9, "of_hbm": moved / best / HBM_CEILING})
    del ws, w_one
    cp.get_default_memory_pool().free_all_blocks()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the named shapes, no sweep over every type")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here too")
    args = ap.parse_args(argv)
    import cupy as cp

    rng = np.random.default_rng(0)
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    t0 = time.perf_counter()
    cases = [(n, r, c, v, what) for n, r, c, v, what in SHAPES]
    if not args.quick:
        cases += [(n, *SWEEP, 1, "sweep") for n in NAMES]
    # compile first so the timings below are kernels only
    for n in sorted({c[0] for c in cases}):
        quant_function("matvec", "matvec_r1_nv1", n)
    print(f"# {dev['name'].decode() if isinstance(dev['name'], bytes) else dev['name']}: "
          f"compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    copy_bps = measure_copy(cp)
    print(f"# device copy (read+write): {copy_bps / 1e9:,.0f} GB/s; HBM ceiling used below: "
          f"{HBM_CEILING / 1e9:,.0f} GB/s", flush=True)
    print("# GB/s of rows/warp 1 | 2 | 4 ; '*' marks the variant matvec_plan() picks for that shape")
    hdr = f"{'type':8s} {'rows x cols':>14s} {'nv':>2s} {'MB':>7s} {'r=1':>7s} {'r=2':>7s} {'r=4':>7s}" \
          f" {'us*':>8s} {'of 4.4 TB/s*':>12s}  what"
    print(hdr)
    rows = []
    for n, r, c, v, what in cases:
        res = bench_case(cp, n, r, c, v, rng)
        for x in res:
            x["what"] = what
        rows += res
        by_r = {x["rows_per_warp"]: x for x in res}
        pick = next(x for x in res if x["planned"])
        cells = " ".join((f"{by_r[k]['gbps']:6.0f}" + ("*" if by_r[k]["planned"] else " ")) if k in by_r
                         else f"{'-':>6s} " for k in (1, 2, 4))
        print(f"{n:8s} {r:>6d} x {c:<6d} {v:>2d} {res[0]['mb']:7.1f} {cells} {pick['us']:8.1f} "
              f"{pick['of_hbm'] * 100:11.0f}%  {what}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device_copy_gbps": copy_bps / 1e9, "hbm_ceiling_gbps": HBM_CEILING / 1e9,
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
