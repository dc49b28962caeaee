"""Quantized mat-vec bandwidth on the GPU: GB/s of weights (+ activations) read per launch, against HBM's ceiling.

    python bench/matvec.py [--quick] [--gpt-oss] [--out results.json]

Each case cycles through enough copies of its matrix (>= 400 MB together) that the 50 MB L2 cannot serve them, and is
timed as a replayed CUDA graph of launches, so neither the L2 nor Python's launch cost flatters the figure.
--gpt-oss: only gpt-oss-20b's shapes (MXFP4 2880 x 2880, with Q8_0 and Q4_K beside) and one token's routed experts
(moe_oss.cu's gate/up + down at gpt-oss-20b's shape, moe.cu's at Qwen3-30B-A3B's Q4_K shape), a fresh choice of
experts each launch.
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
GPTOSS_SHAPES = [
    ("MXFP4", 2880, 2880, 1, "gpt-oss-20b expert down / gate / up"),
    ("MXFP4", 5760, 2880, 1, "gpt-oss-20b expert gate+up rows"),
    ("MXFP4", 2880, 2880, 4, "gpt-oss-20b expert, 4 vectors"),
    ("Q8_0", 2880, 2880, 1, "gpt-oss shape at Q8_0"),
    ("Q4_K", 2880, 3072, 1, "gpt-oss-like at Q4_K (columns a multiple of 256)"),
    ("MXFP4", 16384, 8192, 1, "large MXFP4"),
    ("Q4_K", 16384, 8192, 1, "large Q4_K"),
]
# (type, n_embd, n_ff, experts, routed per token, gpt-oss kernels with biases, what)
EXPERT_SHAPES = [
    ("MXFP4", 2880, 2880, 32, 4, True, "gpt-oss-20b experts (moe_oss.cu)"),
    ("Q8_0", 2880, 2880, 32, 4, True, "the same at Q8_0"),
    ("Q4_K", 2048, 768, 128, 8, False, "Qwen3-30B-A3B experts (moe.cu)"),
]


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


def _graph_time(cp, launch, n, reps):
    """Best seconds per call of launch(i) over reps replays of a CUDA graph of n calls (plain launches if capture
    fails)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(n):
            launch(i)
        stream.synchronize()
        graph = None
        try:
            stream.begin_capture()
            for i in range(n):
                launch(i)
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
                for i in range(n):
                    launch(i)
            t1.record(stream)
            t1.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(t0, t1) / 1e3 / n)
    return best


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
        best = _graph_time(cp, lambda i: fn(grid, block, (ws[i % copies], np.int64(row_bytes), x, np.int32(ncols),
                                                          y, np.int32(nrows), np.int32(nrows), np.int32(ncols))),
                           launches, reps)
        out.append({"type": name, "rows": nrows, "cols": ncols, "nv": nv, "rows_per_warp": r,
                    "planned": r == planned, "mb": mat_bytes / 1e6, "us": best * 1e6,
                    "gbps": moved / best / 1e9, "of_hbm": moved / best / HBM_CEILING})
    del ws, w_one
    cp.get_default_memory_pool().free_all_blocks()
    return out


def bench_experts(cp, name, n_embd, n_ff, n_expert, k, oss, rng, launches=64, reps=5):
    """One token's routed experts as the decode step runs them (gate/up kernel, then down), k of n_expert experts
    picked afresh for each of `launches` layers, none of the previous launch's, so that the L2 holds none of them
    (copies of one random expert: the kernels' speed does not depend on the values); a row dict."""
    from engine.cuda.kernels import load
    from engine.cuda.launch import MV_WARPS, Launcher
    q = qtype(name)
    rb_gu, rb_d = q.row_bytes(n_embd), q.row_bytes(n_ff)
    up_off, down_off = n_ff * rb_gu, 2 * n_ff * rb_gu
    nbytes = down_off + n_embd * rb_d
    stride = (nbytes + 255) // 256 * 256
    one = cp.asarray(np.concatenate([random_rows(name, n_ff, n_embd, rng).reshape(-1),
                                     random_rows(name, n_ff, n_embd, rng).reshape(-1),
                                     random_rows(name, n_embd, n_ff, rng).reshape(-1)]))
    blob = cp.zeros(n_expert * stride, dtype=cp.uint8)
    for e in range(n_expert):
        blob[e * stride:e * stride + nbytes] = one
    table = cp.asarray(np.array([int(blob.data.ptr) + e * stride for e in range(n_expert)], np.uint64))
    sets, prev = [], set()
    for _ in range(launches):  # consecutive launches share no expert (the L2 holds about one token's experts)
        sets.append(rng.choice(sorted(set(range(n_expert)) - prev), k, replace=False))
        prev = set(sets[-1].tolist())
    ids = cp.asarray(np.stack(sets).astype(np.int32))
    wts = cp.asarray(rng.uniform(0.1, 1.0, k).astype(np.float32))
    x = cp.asarray(rng.standard_normal(n_embd).astype(np.float32))
    norm = cp.asarray(rng.uniform(0.5, 1.5, n_embd).astype(np.float32))
    h = cp.zeros(k * n_ff, dtype=cp.float32)
    out = cp.zeros(n_embd, dtype=cp.float32)
    mod = load("moe_oss" if oss else "moe", qtypes=[q.id])
    fg = mod.get_function(f"moe_gate_up_oai<{q.id}>" if oss else f"moe_gate_up<{q.id}>")
    fd = mod.get_function(f"moe_down_bias<{q.id}>" if oss else f"moe_down<{q.id}>")
    sm_g = Launcher.smem(fg, n_embd, True)
    sm_d = Launcher.smem(fd, k * n_ff, False, optional_max=100 * 1024)   # as families/moe.py launches them
    bias = [cp.asarray((rng.standard_normal((n_expert, n)) * 0.1).astype(np.float32)) for n in (n_ff, n_ff, n_embd)]
    grid_g = ((n_ff + MV_WARPS - 1) // MV_WARPS, k, 1)
    grid_d = ((n_embd + MV_WARPS - 1) // MV_WARPS, 1)
    i64, i32, f32 = np.int64, np.int32, np.float32

    def launch(i):
        ids_i = ids[i]
        fg(grid_g, (32 * MV_WARPS,), (table, ids_i, i64(up_off), i64(rb_gu), x, norm, f32(1e-5), h, i32(n_ff),
                                      i32(n_embd), i32(k)) + ((bias[0], bias[1]) if oss else ()), shared_mem=sm_g)
        fd(grid_d, (32 * MV_WARPS,), (table, ids_i, wts, i64(down_off), i64(rb_d), h, out, i32(n_embd), i32(n_ff),
                                      i32(k), i32(1 if sm_d else 0)) + ((bias[2],) if oss else ()), shared_mem=sm_d)

    best = _graph_time(cp, launch, launches, reps)
    assert bool(cp.isfinite(out).all()), f"{name} experts gave a non-finite output"
    moved = k * nbytes + (2 * n_embd + 2 * k * n_ff) * 4
    row = {"type": name, "n_embd": n_embd, "n_ff": n_ff, "experts": n_expert, "k": k, "mb": k * nbytes / 1e6,
           "us": best * 1e6, "gbps": moved / best / 1e9, "of_hbm": moved / best / HBM_CEILING}
    if oss:
        row.update(_oss_variants(cp, fg, fd, sm_g, sm_d, grid_g, grid_d, launch_args(table, ids, wts, x, norm, h, out,
                                                                                      bias, up_off, down_off, rb_gu,
                                                                                      rb_d, n_embd, n_ff, k),
                                 x, norm, launches, reps))
    del blob, one
    cp.get_default_memory_pool().free_all_blocks()
    return row


def launch_args(table, ids, wts, x, norm, h, out, bias, up_off, down_off, rb_gu, rb_d, n_embd, n_ff, k):
    """moe_oss.cu's gate/up and down arguments for launch i, with x and its norm weights (None: x is normed)."""
    i64, i32, f32 = np.int64, np.int32, np.float32

    def gate_up(i, xv=x, nw=norm):
        return (table, ids[i], i64(up_off), i64(rb_gu), xv, nw if nw is not None else np.uint64(0), f32(1e-5), h,
                i32(n_ff), i32(n_embd), i32(k), bias[0], bias[1])

    def down(i, stage):
        return (table, ids[i], wts, i64(down_off), i64(rb_d), h, out, i32(n_embd), i32(n_ff), i32(k),
                i32(1 if stage else 0), bias[2])
    return gate_up, down


def _oss_variants(cp, fg, fd, sm_g, sm_d, grid_g, grid_d, args, x, norm, launches, reps) -> dict:
    """gpt-oss's expert kernels apart, and the two launch-side alternatives to the decode step's way: down reading h
    from global memory (no 46 KiB of staged h a block, so more blocks an SM), and x normed once by rmsnorm (the
    gate/up blocks then stage x without each reducing its norm). Microseconds a token's layer."""
    from engine.cuda.kernels import load
    from engine.cuda.launch import MV_WARPS
    gate_up, down = args
    blk = (32 * MV_WARPS,)
    xn = cp.empty_like(x)
    rms = load("norm_rope").get_function("rmsnorm")

    def t(launch):
        return round(_graph_time(cp, launch, launches, reps) * 1e6, 2)

    def prenormed(i):
        rms((1,), (256,), (x, norm, xn, np.int32(x.size), np.float32(1e-5)))
        fg(grid_g, blk, gate_up(i, xn, None), shared_mem=sm_g)
        fd(grid_d, blk, down(i, sm_d > 0), shared_mem=sm_d)

    def unstaged(i):
        fg(grid_g, blk, gate_up(i), shared_mem=sm_g)
        fd(grid_d, blk, down(i, False), shared_mem=0)
    return {"us_gate_up": t(lambda i: fg(grid_g, blk, gate_up(i), shared_mem=sm_g)),
            "us_down": t(lambda i: fd(grid_d, blk, down(i, sm_d > 0), shared_mem=sm_d)),
            "us_down_unstaged": t(lambda i: fd(grid_d, blk, down(i, False), shared_mem=0)),
            "us_with_down_unstaged": t(unstaged), "us_prenormed": t(prenormed)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the named shapes, no sweep over every type")
    ap.add_argument("--gpt-oss", action="store_true",
                    help="only gpt-oss-20b's mat-vec shapes (Q8_0 and Q4_K beside) and one token's routed experts")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here too")
    args = ap.parse_args(argv)
    import cupy as cp

    rng = np.random.default_rng(0)
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    t0 = time.perf_counter()
    cases = list(GPTOSS_SHAPES if args.gpt_oss else SHAPES)
    if not args.quick and not args.gpt_oss:
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
    experts = []
    if args.gpt_oss:
        print("# one token's routed experts (gate/up + down kernels), a fresh choice of experts each launch")
        print(f"{'type':8s} {'n_embd x n_ff':>14s} {'k/E':>7s} {'MB':>7s} {'us':>8s} {'GB/s':>7s} {'of 4.4 TB/s':>11s}  what")
        for n, n_embd, n_ff, n_expert, k, oss, what in EXPERT_SHAPES:
            x = bench_experts(cp, n, n_embd, n_ff, n_expert, k, oss, rng)
            x["what"] = what
            experts.append(x)
            print(f"{n:8s} {n_embd:>6d} x {n_ff:<6d} {f'{k}/{n_expert}':>7s} {x['mb']:7.1f} {x['us']:8.1f} "
                  f"{x['gbps']:7.0f} {x['of_hbm'] * 100:10.0f}%  {what}", flush=True)
            if oss:
                print(f"#   {n}: gate/up alone {x['us_gate_up']} us, down alone {x['us_down']} (h from global memory: "
                      f"{x['us_down_unstaged']}); both with down unstaged {x['us_with_down_unstaged']}, with x "
                      f"normed once by rmsnorm {x['us_prenormed']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device_copy_gbps": copy_bps / 1e9, "hbm_ceiling_gbps": HBM_CEILING / 1e9,
                                        "rows": rows, "experts": experts}, indent=1))


if __name__ == "__main__":
    main()
