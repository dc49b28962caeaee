"""The streamed prompt pass's grouped expert GEMMs (cuda_src/moe_gemm.cu) alone, at the Qwen3-30B-A3B shape: time and
TFLOP/s of gate/up (SwiGLU fused) and down (routing weight, atomics) beside the tensor cores' ceiling.

    python -m bench.moe_gemm [--tokens 4096] [--qtype Q4_K] [--reps 20] [--row-tiles 2]

One layer's worth: T tokens routed top-k over E experts (uniformly at random: every expert gets about T*k/E rows, as
a prompt chunk does), every expert's blob resident in VRAM. bench.prefill times the same kernels inside the whole
pass (its phase table); this isolates them so a kernel change is measured in seconds, and so `ncu` can be pointed at
one launch of each (`ncu --kernel-name regex:moe_gemm --launch-count 2 python -m bench.moe_gemm --reps 1`).
Ceilings: cuBLAS's fp16 GEMM (749 TFLOP/s at 8192^3, docs/design.md "Measured facts") and the expert bytes over
HBM's 4.4 TB/s.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.variant import CUBLAS_TFLOPS, add_args, defines

HBM_BPS = 4.4e12
ALIGN = 256


def blobs(cp, q, E: int, n_embd: int, n_ff: int, rng):
    """E expert blobs (gate | up | down) of random rows at a real model's scale, one device array."""
    from engine.cuda.quant_types import random_rows
    rb_gu, rb_d = q.row_bytes(n_embd), q.row_bytes(n_ff)
    up_off, down_off = n_ff * rb_gu, 2 * n_ff * rb_gu
    stride = -(-(down_off + n_embd * rb_d) // ALIGN) * ALIGN
    # one expert's random rows, repeated: the kernels' speed does not depend on the values, and quantizing 128
    # experts here would take longer than the measurement
    one = np.zeros(stride, np.uint8)
    for raw, off in ((random_rows(q.name, n_ff, n_embd, rng, 1 / np.sqrt(n_embd)), 0),
                     (random_rows(q.name, n_ff, n_embd, rng, 1 / np.sqrt(n_embd)), up_off),
                     (random_rows(q.name, n_embd, n_ff, rng, 1 / np.sqrt(n_ff)), down_off)):
        one[off:off + raw.size] = raw.reshape(-1)
    return cp.asarray(np.tile(one, E)), stride, up_off, down_off, rb_gu, rb_d


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024,4096,8192", help="chunk sizes, comma-separated")
    ap.add_argument("--qtype", default="Q4_K")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--n-ff", type=int, default=768)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--row-tiles", type=int, default=None, help="moe_gemm.cu MG_MT (default: the engine's)")
    add_args(ap, "moe_gemm", "MG_MT=1")
    a = ap.parse_args(argv)
    defs = defines(ap, a)

    import cupy as cp

    from engine.cuda.launch import I32, I64
    from engine.cuda.prefill import expert_row_blocks, moe_module
    from engine.cuda.quant_types import qtype

    q = qtype(a.qtype)
    E, k, n_embd, n_ff = a.experts, a.k, a.n_embd, a.n_ff
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    if a.define or a.module != "moe_gemm":
        from engine.cuda import kernels
        if a.row_tiles:
            defs["MG_MT"] = str(a.row_tiles)
        mod = kernels.load(a.module, defs or None, qtypes=[q.id])
    else:
        mod = moe_module([q.id], a.row_tiles)
    sort, gu, dn = (mod.get_function(n) for n in ("moe_sort", f"moe_gemm_gate_up<{q.id}>", f"moe_gemm_down<{q.id}>"))
    dev, stride, up_off, down_off, rb_gu, rb_d = blobs(cp, q, E, n_embd, n_ff, rng)
    print(f"bench.moe_gemm: {a.module} {' '.join(a.define) or 'default build'}: {a.qtype}, {E} experts of "
          f"{stride / 1e6:.2f} MB, top-{k}, n_embd {n_embd}, n_ff {n_ff} (set up in {time.perf_counter() - t0:.1f} s)",
          flush=True)
    sel = cp.arange(E, dtype=cp.int32)
    ptrs = cp.asarray(np.array([int(dev.data.ptr) + e * stride for e in range(E)], np.uint64))
    rows_out = []
    for T in (int(t) for t in a.tokens.split(",")):
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)
        w = rng.random((T, k)).astype(np.float32)
        offsets = cp.zeros(E + 1, cp.int32)
        rows, row_w = cp.zeros(T * k, cp.int32), cp.zeros(T * k, cp.float32)
        sort((1,), (1024,), (cp.asarray(ids), cp.asarray(w), I32(T * k), I32(k), I32(E), offsets, rows, row_w))
        xh = cp.asarray(rng.standard_normal((T, n_embd)).astype(np.float16)).view(cp.uint16)
        h = cp.zeros(T * k * n_ff, cp.uint16)
        out = cp.zeros((T, n_embd), cp.float32)
        gy = expert_row_blocks(T, k, E, a.row_tiles)

        def gate_up():
            gu(((n_ff + 63) // 64, gy, E), (256,),
               (sel, ptrs, offsets, rows, xh, h, I64(up_off), I64(rb_gu), I32(n_ff), I32(n_embd)))

        def down():
            dn(((n_embd + 63) // 64, gy, E), (256,),
               (sel, ptrs, offsets, rows, row_w, h, out, I64(down_off), I64(rb_d), I32(n_embd), I32(n_ff)))

        times = {}
        for name, fn in (("gate_up", gate_up), ("down", down)):
            fn()                                   # warm-up (and the one launch ncu sees with --reps 1)
            ev = [cp.cuda.Event() for _ in range(2)]
            ev[0].record()
            for _ in range(a.reps):
                fn()
            ev[1].record()
            ev[1].synchronize()
            times[name] = cp.cuda.get_elapsed_time(ev[0], ev[1]) / a.reps / 1e3
        pairs = T * k
        flops = {"gate_up": 2 * pairs * 2 * n_ff * n_embd, "down": 2 * pairs * n_embd * n_ff}
        wbytes = {"gate_up": E * 2 * n_ff * rb_gu, "down": E * n_embd * rb_d}
        for name in ("gate_up", "down"):
            s = times[name]
            rows_out.append((T, name, s * 1e3, flops[name] / s / 1e12, wbytes[name] / s / 1e9))
        assert bool(cp.isfinite(out).all()), "non-finite output"
    print(f"| tokens | kernel | ms | TFLOP/s | of {CUBLAS_TFLOPS:.0f} (cuBLAS fp16) | weight GB/s | of 4,400 |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for T, name, ms, tf, gbs in rows_out:
        print(f"| {T} | {name} | {ms:.3f} | {tf:.0f} | {tf / CUBLAS_TFLOPS:.2f} | {gbs:.0f} "
              f"| {gbs * 1e9 / HBM_BPS:.2f} |")


if __name__ == "__main__":
    main()
