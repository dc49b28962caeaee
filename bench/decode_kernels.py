"""Decode kernels one at a time on realistic shapes, this tree's build against another's (an A/B).

    python -m bench.decode_kernels [--before DIR] [--define NAME=VALUE ...] [--only mv_wo,mv3,router,head,...]

Each case is the launch the decode step makes for one layer of gpt-oss-20b (Q8_0 attention weights, the F32
router): dense.cu's mv (attn_output, 4096 -> 2880, its bias added to x), mv3 (q/k/v 2880 -> 4096/512/512, biases,
attn_norm fused), router.cu's router_fused_bias (32 x 2880, top 4) and mv on the output head (201088 x 2880, the
output norm fused). Timed as bench/matvec.py times: a replayed CUDA graph cycling through copies of the weights
(>= 400 MB together, so that the 50 MB L2 serves none of them), best of five. --before DIR compiles the same
kernels from DIR (a cuda_src/ of an earlier commit: `git archive <commit> cuda_src | tar -x -C DIR/..`) and prints
both, with the largest difference between their outputs (0 where the change keeps the arithmetic). --define builds
this tree's variant with a define (e.g. ROUTER_F4=16, or MOE_GU_RPW=2: moe_gate_up's rows a warp, the q3_gate_up
grid following it), never the --before build.

The q3_* cases are Qwen3-30B-A3B's (the Q4_K_M recipe: n_embd 2048, 128 experts of n_ff 768, top 8): q3_gate_up
(moe.cu moe_gate_up, Q4_K gate and up, the FFN norm fused), q3_down (moe_down, or moe_down_q6k where the
tree has it, as the family picks: Q6_K ffn_down, the weighted sum added to x) and q3_router (router.cu router_fused,
128 x 2048 F32, top 8 renormalized); q4_router is Qwen3.8-Flash-Next's (512 x 2560 F32, top 10 renormalized),
q4_router_bf16 the same in BF16 (the published packs' type) and q35_router Qwen3.5-35B-A3B's (256 x 2048 F32, top
8). The q3 experts are 128 blobs laid out as the engine's (gate | up | down, 256-byte stride), 392 MB; launch i
routes to the eight experts 8i..8i+7 (mod 128), so consecutive launches read disjoint experts and the L2 serves
none of them.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.variant import defines as parse_defines  # noqa: E402
from engine.cuda.kernels import CUDA_SRC, STD, parse_builds  # noqa: E402
from engine.cuda.quant_types import qtype, random_rows  # noqa: E402

HBM = 4.4e12     # bytes/s (docs/design.md "Measured facts")
N_EMBD, N_HEAD, N_KV, HEAD_DIM, N_VOCAB, N_EXPERT, K = 2880, 64, 8, 64, 201088, 32, 4
CASES = ("mv_wo", "mv3", "router", "head", "q3_gate_up", "q3_down", "q3_router", "q4_router", "q4_router_bf16",
         "q35_router")
# (experts, n_embd, top k, row type) of the routers beside q3_router's; the qwen4exp packs store theirs in BF16
# (tools/qwen4exp_plan.py)
ROUTERS = {"q3_router": (128, 2048, 8, "F32"), "q4_router": (512, 2560, 10, "F32"),
           "q4_router_bf16": (512, 2560, 10, "BF16"), "q35_router": (256, 2048, 8, "F32")}
Q3_EMBD, Q3_FF, Q3_EXPERT, Q3_K = 2048, 768, 128, 8
MODULE = {"mv": "dense", "mv3": "dense", "router_fused_bias": "router", "router_fused": "router",
          "moe_gate_up": "moe", "moe_down": "moe"}
QTS = ("Q8_0", "F32", "Q4_K", "Q6_K", "BF16")


def expert_pool(cp, rng, qt_gu: str, qt_down: str):
    """Q3_EXPERT expert blobs as engine/cuda/expert_layout.py lays them out (gate | up | down, 256-byte stride):
    (the pool, its pointer table, up_off, down_off, gate/up row bytes, down row bytes, one blob's bytes)."""
    from engine.cuda.expert_layout import ALIGN
    rb_g, rb_d = qtype(qt_gu).row_bytes(Q3_EMBD), qtype(qt_down).row_bytes(Q3_FF)
    up_off = Q3_FF * rb_g
    down_off = 2 * up_off
    nbytes = down_off + Q3_EMBD * rb_d
    stride = (nbytes + ALIGN - 1) // ALIGN * ALIGN
    pool = np.zeros((Q3_EXPERT, stride), np.uint8)
    for e in range(Q3_EXPERT):
        blob = np.concatenate([random_rows(qt_gu, 2 * Q3_FF, Q3_EMBD, rng).ravel(),
                               random_rows(qt_down, Q3_EMBD, Q3_FF, rng).ravel()])
        pool[e, :nbytes] = blob
    dev = cp.asarray(pool)
    table = cp.asarray(np.uint64(dev.data.ptr) + np.arange(Q3_EXPERT, dtype=np.uint64) * np.uint64(stride))
    return dev, table, up_off, down_off, rb_g, rb_d, nbytes


def build(cp, src: Path, name: str, qt_ids, defines: dict):
    """cupy.RawModule of src/<name>.cu with its QT templates for qt_ids: the engine's options, the source folder's
    digest as STRATA_SRC (CuPy's cache keys on the file's own text, not on the headers it includes)."""
    path = src / f"{name}.cu"
    if not path.is_file():
        raise SystemExit(f"no {path}: give --before a cuda_src folder (git archive <commit> cuda_src | tar -x)")
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sorted(src.glob("*.cu*"))))
    instances = parse_builds(path, qt_ids)[0].instances
    opts = (STD, f"-I{src}", f"-DSTRATA_SRC={digest.hexdigest()[:16]}",
            *(f"-D{k}={v}" for k, v in sorted(defines.items())))
    mod = cp.RawModule(code=path.read_text(), options=opts, name_expressions=instances)
    mod.compile()
    return mod


def kernel_names(src: Path) -> set:
    """The kernels the .cu files of a cuda_src folder define (a newer kernel is timed where the folder has it)."""
    from engine.cuda.kernels import _GLOBAL_RE
    return {n for p in sorted(src.glob("*.cu")) for n in _GLOBAL_RE.findall(p.read_text())}


def graph_time(cp, launch, n, reps=5):
    from bench.matvec import _graph_time
    return _graph_time(cp, launch, n, reps)


def copies_for(nbytes: int, min_total: float = 400e6) -> int:
    return max(1, math.ceil(min_total / nbytes))


class Case:
    """One decode launch over `copies` weight copies; run(mods, i) launches it on copy i, out() its output."""

    def __init__(self, cp, which: str, rng):
        from engine.cuda.launch import MV_WARPS, NULL, staged_bytes
        self.cp, self.which = cp, which
        q8, f32 = qtype("Q8_0"), qtype("F32")
        a = lambda v: cp.asarray(np.asarray(v, np.float32))      # noqa: E731
        i64, i32, f = np.int64, np.int32, np.float32
        if which == "mv_wo":
            rows, cols = N_EMBD, N_HEAD * HEAD_DIM
            self.what, self.qt, self.kernel = "attn_output 4096 -> 2880 Q8_0, bias, += x", q8, "mv"
            one = cp.asarray(random_rows("Q8_0", rows, cols, rng))
            self.nbytes = one.nbytes
            self.ws = [one] + [one.copy() for _ in range(copies_for(one.nbytes) - 1)]
            x, bias = a(rng.standard_normal(cols)), a(rng.standard_normal(rows) * 0.1)
            self.y0 = a(rng.standard_normal(rows))
            self.y = self.y0.copy()
            rb = one.shape[1]
            self.grid, self.smem = ((rows + MV_WARPS - 1) // MV_WARPS,), staged_bytes(cols)
            self.args = lambda w: (w, i64(rb), x, self.y, bias, NULL, i32(rows), i32(cols), i32(1), NULL, f(1e-5),
                                   i32(1), i32(1))
        elif which == "head":
            rows, cols = N_VOCAB, N_EMBD
            self.what, self.qt, self.kernel = "output head 201088 x 2880 Q8_0, norm fused", q8, "mv"
            one = cp.asarray(random_rows("Q8_0", rows, cols, rng))
            self.nbytes = one.nbytes
            self.ws = [one]
            x, nw = a(rng.standard_normal(cols)), a(rng.uniform(0.5, 1.5, cols))
            self.y = a(np.zeros(rows))
            rb, rpw = one.shape[1], 8          # launch.py: min(8, rows // BIG_ROWS)
            self.grid, self.smem = ((rows + MV_WARPS * rpw - 1) // (MV_WARPS * rpw),), staged_bytes(cols)
            self.args = lambda w: (w, i64(rb), x, self.y, NULL, NULL, i32(rows), i32(cols), i32(0), nw, f(1e-5),
                                   i32(1), i32(rpw))
        elif which == "mv3":
            ns, cols = (N_HEAD * HEAD_DIM, N_KV * HEAD_DIM, N_KV * HEAD_DIM), N_EMBD
            self.what, self.qt, self.kernel = "q/k/v 2880 -> 4096/512/512 Q8_0, biases, norm fused", q8, "mv3"
            one = [cp.asarray(random_rows("Q8_0", n, cols, rng)) for n in ns]
            self.nbytes = sum(m.nbytes for m in one)
            self.ws = [one] + [[m.copy() for m in one] for _ in range(copies_for(self.nbytes) - 1)]
            x, nw = a(rng.standard_normal(cols)), a(rng.uniform(0.5, 1.5, cols))
            bs = [a(rng.standard_normal(n) * 0.1) for n in ns]
            self.ys = [a(np.zeros(n)) for n in ns]
            rb = one[0].shape[1]
            self.grid, self.smem = ((sum(ns) + MV_WARPS - 1) // MV_WARPS,), staged_bytes(cols)
            self.args = lambda w: (*w, i64(rb), x, nw, f(1e-5), *self.ys, *bs, *(i32(n) for n in ns), i32(cols))
        elif which == "router":
            self.what, self.qt, self.kernel = "router 32 x 2880 F32 + bias, top 4", f32, "router_fused_bias"
            one = cp.asarray(random_rows("F32", N_EXPERT, N_EMBD, rng, 0.05))
            self.nbytes = one.nbytes
            self.ws = [one] + [one.copy() for _ in range(copies_for(one.nbytes) - 1)]
            x, nw = a(rng.standard_normal(N_EMBD)), a(rng.uniform(0.5, 1.5, N_EMBD))
            bias = a(rng.standard_normal(N_EXPERT))
            self.logits = a(np.zeros(N_EXPERT))
            self.ids, self.wts = cp.zeros(K, cp.int32), a(np.zeros(K))
            self.counter = cp.zeros(1, cp.int32)
            rb = one.shape[1]
            self.grid, self.smem = ((N_EXPERT + MV_WARPS - 1) // MV_WARPS,), staged_bytes(N_EMBD)
            self.args = lambda w: (w, i64(rb), x, nw, f(1e-5), i32(N_EMBD), self.logits, i32(N_EXPERT), i32(K), i32(1),
                                   f(1.0), self.ids, self.wts, NULL, np.uint64(0), np.uint64(0), NULL, NULL,
                                   self.counter, bias)
        elif which in ("q3_gate_up", "q3_down"):
            self.qt = qtype("Q4_K") if which == "q3_gate_up" else qtype("Q6_K")
            self.pool, table, up_off, down_off, rb_g, rb_d, blob = expert_pool(cp, rng, "Q4_K", "Q6_K")
            n_sets = Q3_EXPERT // Q3_K
            self.ws = [cp.asarray((np.arange(Q3_K) + Q3_K * i) % Q3_EXPERT, dtype=cp.int32) for i in range(n_sets)]
            x, nw = a(rng.standard_normal(Q3_EMBD)), a(rng.uniform(0.5, 1.5, Q3_EMBD))
            if which == "q3_gate_up":
                self.what, self.kernel = "8 experts' gate+up 768 x 2048 Q4_K, SwiGLU, norm fused", "moe_gate_up"
                self.nbytes = Q3_K * down_off
                self.y = a(np.zeros(Q3_K * Q3_FF))
                self.grid, self.smem = ((Q3_FF + MV_WARPS - 1) // MV_WARPS, Q3_K, 1), staged_bytes(Q3_EMBD)
                self.args = lambda ids: (table, ids, i64(up_off), i64(rb_g), x, nw, f(1e-6), self.y, i32(Q3_FF),
                                         i32(Q3_EMBD), i32(Q3_K))
            else:
                self.what, self.kernel = "8 experts' down 2048 x 768 Q6_K, weighted, += x", "moe_down"
                self.nbytes = Q3_K * (blob - down_off)
                h = a(rng.standard_normal(Q3_K * Q3_FF))
                wts = a(rng.dirichlet(np.ones(Q3_K)))
                self.y0 = a(rng.standard_normal(Q3_EMBD))
                self.y = self.y0.copy()
                self.grid, self.smem = ((Q3_EMBD + MV_WARPS - 1) // MV_WARPS, 1), staged_bytes(Q3_K * Q3_FF)
                self.args = lambda ids: (table, ids, wts, i64(down_off), i64(rb_d), h, self.y, i32(Q3_EMBD),
                                         i32(Q3_FF), i32(Q3_K), i32(1))
                # a tree whose moe.cu has moe_down_q6k launches that (as the family does), with its own geometry
                from engine.cuda.launch import MOE_DOWN_TILE_ROWS, moe_down_tiled_bytes
                self.tiled = ("moe_down_q6k", (Q3_EMBD // MOE_DOWN_TILE_ROWS, 1), (256,),
                              moe_down_tiled_bytes(Q3_K, Q3_FF, rb_d),
                              lambda ids: (table, ids, wts, i64(down_off), i64(rb_d), h, self.y, i32(Q3_EMBD),
                                           i32(Q3_FF), i32(Q3_K)))
        elif which in ROUTERS:
            n_e, n_in, k, rt = ROUTERS[which]
            self.qt, self.kernel = qtype(rt), "router_fused"
            self.what = f"router {n_e} x {n_in} {rt}, top {k} renormalized"
            one = cp.asarray(random_rows(rt, n_e, n_in, rng, 0.05))
            self.nbytes = one.nbytes
            self.ws = [one] + [one.copy() for _ in range(copies_for(one.nbytes) - 1)]
            x, nw = a(rng.standard_normal(n_in)), a(rng.uniform(0.5, 1.5, n_in))
            self.logits = a(np.zeros(n_e))
            self.ids, self.wts = cp.zeros(k, cp.int32), a(np.zeros(k))
            self.counter = cp.zeros(1, cp.int32)
            rb = one.shape[1]
            self.grid, self.smem = ((n_e + MV_WARPS - 1) // MV_WARPS,), staged_bytes(n_in)
            self.args = lambda w: (w, i64(rb), x, nw, f(1e-6), i32(n_in), self.logits, i32(n_e), i32(k),
                                   i32(1), f(1.0), self.ids, self.wts, NULL, np.uint64(0), np.uint64(0), NULL, NULL,
                                   self.counter)
        else:
            raise ValueError(which)
        self.block = (32 * MV_WARPS,)

    tiled = None        # (kernel, grid, block, shared memory, args) of a newer kernel for the same launch

    def fn(self, mods):
        """The launch in the build mods: (function, grid, block, shared memory, args of a copy)."""
        mod = mods[MODULE[self.kernel]]
        if self.tiled is not None and self.tiled[0] in mods["_kernels"]:
            name, grid, block, smem, args = self.tiled
            f = mod.get_function(name)
        else:
            f = mod.get_function(f"{self.kernel}<{self.qt.id}>")
            grid, block, smem, args = self.grid, self.block, self.smem, self.args
            if self.kernel == "moe_gate_up":     # MOE_GU_RPW rows a warp (moe.cu): the grid shrinks with it
                rpw = int(mods["_defines"].get("MOE_GU_RPW", 1))
                grid = ((Q3_FF + block[0] // 32 * rpw - 1) // (block[0] // 32 * rpw), *grid[1:])
        if smem > 48 * 1024:
            f.max_dynamic_shared_size_bytes = smem
        return f, grid, block, smem, args

    def run(self, launch, i):
        f, grid, block, smem, args = launch
        f(grid, block, args(self.ws[i % len(self.ws)]), shared_mem=smem)

    def out(self, f):
        """The output of one launch on copy 0 (an accumulating launch starts from the same y each time)."""
        if self.which in ("mv_wo", "q3_down"):
            self.y[...] = self.y0
        self.run(f, 0)
        self.cp.cuda.Device().synchronize()
        if self.which == "mv3":
            return np.concatenate([y.get() for y in self.ys])
        if self.which == "router" or self.which in ROUTERS:
            return np.concatenate([self.logits.get(), self.wts.get(), self.ids.get().astype(np.float32)])
        return self.y.get()


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="a cuda_src folder of an earlier commit, timed beside this tree's")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a define for this tree's build (e.g. ROUTER_F4=16); repeatable")
    ap.add_argument("--only", default=",".join(CASES), help=f"comma-separated cases of {', '.join(CASES)}")
    a = ap.parse_args(argv)
    a.defines = parse_defines(ap, a)
    a.cases = [c for c in a.only.split(",") if c]
    bad = [c for c in a.cases if c not in CASES]
    if bad or not a.cases:
        ap.error(f"--only takes cases of {', '.join(CASES)}, got {a.only!r}")
    return a


def main(argv=None):
    a = parse(argv)
    import cupy as cp
    qt_ids = [qtype(t).id for t in QTS]
    mods = sorted(set(MODULE.values()))
    builds = {"after": {n: build(cp, CUDA_SRC, n, qt_ids, a.defines) for n in mods}}
    builds["after"].update(_kernels=kernel_names(CUDA_SRC), _defines=a.defines)
    if a.before:
        builds = {"before": {n: build(cp, a.before, n, qt_ids, {}) for n in mods}, **builds}
        builds["before"].update(_kernels=kernel_names(a.before), _defines={})
    rng = np.random.default_rng(0)
    print(f"# this tree's defines: {a.defines or 'none'}; before: {a.before or '-'}")
    print(f"{'case':8s} {'MB':>7s} " + " ".join(f"{k + ' us':>10s}" for k in builds) + f" {'of HBM':>7s}"
          + (f" {'speed-up':>8s} {'max |diff|':>10s}" if a.before else "") + "  what")
    for which in a.cases:
        c = Case(cp, which, rng)
        fs = {k: c.fn(m) for k, m in builds.items()}
        n = max(len(c.ws), 20)
        us = {k: graph_time(cp, lambda i, f=f, c=c: c.run(f, i), n) * 1e6 for k, f in fs.items()}
        line = f"{which:8s} {c.nbytes / 1e6:7.1f} " + " ".join(f"{us[k]:10.2f}" for k in builds)
        line += f" {c.nbytes / (us['after'] * 1e-6) / HBM * 100:6.0f}%"
        if a.before:
            diff = float(np.max(np.abs(c.out(fs["after"]) - c.out(fs["before"]))))
            line += f" {us['before'] / us['after']:7.2f}x {diff:10.3g}"
        print(line + "  " + c.what, flush=True)
        del c
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
