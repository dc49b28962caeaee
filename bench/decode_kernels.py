"""The gpt-oss-20b decode step's non-expert kernels one at a time, this tree's build against another's (an A/B).

    python -m bench.decode_kernels [--before DIR] [--define NAME=VALUE ...] [--only mv_wo,mv3,router,head]

Each case is the launch the decode step makes for one layer of gpt-oss-20b (Q8_0 attention weights, the F32
router): dense.cu's mv (attn_output, 4096 -> 2880, its bias added to x), mv3 (q/k/v 2880 -> 4096/512/512, biases,
attn_norm fused), router.cu's router_fused_bias (32 x 2880, top 4) and mv on the output head (201088 x 2880, the
output norm fused). Timed as bench/matvec.py times: a replayed CUDA graph cycling through copies of the weights
(>= 400 MB together, so that the 50 MB L2 serves none of them), best of five. --before DIR compiles the same
kernels from DIR (a cuda_src/ of an earlier commit: `git archive <commit> cuda_src | tar -x -C DIR/..`) and prints
both, with the largest difference between their outputs (0 where the change keeps the arithmetic). --define builds
this tree's variant with a define (e.g. ROUTER_F4=16), never the --before build.
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
CASES = ("mv_wo", "mv3", "router", "head")


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
        else:
            raise ValueError(which)
        self.block = (32 * MV_WARPS,)

    def fn(self, mods):
        mod = mods["router" if self.kernel.startswith("router") else "dense"]
        f = mod.get_function(f"{self.kernel}<{self.qt.id}>")
        if self.smem > 48 * 1024:
            f.max_dynamic_shared_size_bytes = self.smem
        return f

    def run(self, f, i):
        f(self.grid, self.block, self.args(self.ws[i % len(self.ws)]), shared_mem=self.smem)

    def out(self, f):
        """The output of one launch on copy 0 (an accumulating launch starts from the same y each time)."""
        if self.which == "mv_wo":
            self.y[...] = self.y0
        self.run(f, 0)
        self.cp.cuda.Device().synchronize()
        if self.which == "mv3":
            return np.concatenate([y.get() for y in self.ys])
        if self.which == "router":
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
    qt_ids = [qtype("Q8_0").id, qtype("F32").id]
    builds = {"after": {n: build(cp, CUDA_SRC, n, qt_ids, a.defines) for n in ("dense", "router")}}
    if a.before:
        builds = {"before": {n: build(cp, a.before, n, qt_ids, {}) for n in ("dense", "router")}, **builds}
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
