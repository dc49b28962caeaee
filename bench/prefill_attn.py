"""The streamed prompt pass's causal flash attention (cuda_src/prefill_attn.cu) alone, at the Qwen3-30B-A3B shape:
time and TFLOP/s of flash_attn_f16 and flash_attn_i8 beside the tensor cores' ceiling.

    python -m bench.prefill_attn [--tokens 1024,4096,8192] [--chunks 3584,31744] [--reps 20] [--kv f16,int8]

One layer's call per size: a whole prompt of T tokens as one chunk (pos0 0), then the last 512-token chunk of a
4K and of a 32K prompt (pos0 3584, 31744: a chunk that reads the whole cache before it). The cache holds random
values (the kernels' speed does not depend on them). bench.prefill times the same kernel inside the whole pass (its
attention phase); this isolates it, for `ncu --kernel-name regex:flash_attn --launch-count 2 python -m
bench.prefill_attn --reps 1`, and for an A/B: copy the old prefill_attn.cu to cuda_src/NAME.cu (untracked) and run
with --module NAME. FLOPs count only the visible (causal) key-query pairs: 4 per pair per head-dim element (Q K^T and
P V); cuBLAS's fp16 GEMM (749 TFLOP/s, docs/design.md "Measured facts") is the ceiling.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.variant import CUBLAS_TFLOPS, add_args, defines



def causal_flops(T: int, pos0: int, n_head: int, head_dim: int) -> int:
    """Q K^T and P V over the visible pairs: token t (at position pos0 + t) sees pos0 + t + 1 keys."""
    pairs = T * pos0 + T * (T + 1) // 2
    return 4 * pairs * n_head * head_dim


def cases(tokens: str, chunks: str, chunk_len: int) -> list[tuple[int, int]]:
    """(T, pos0): each --tokens size from position 0, then a chunk_len chunk at each --chunks position."""
    out = [(int(t), 0) for t in tokens.split(",") if t]
    out += [(chunk_len, int(p)) for p in chunks.split(",") if p]
    if not out or any(T < 1 or p < 0 for T, p in out):
        raise SystemExit("bench.prefill_attn: --tokens and --chunk-len need positive sizes, --chunks positions >= 0")
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024,4096,8192", help="whole prompts as one chunk (pos0 0), comma-separated")
    ap.add_argument("--chunks", default="3584,31744",
                    help="positions of a --chunk-len chunk after earlier ones, comma-separated ('' for none)")
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--kv", default="f16,int8", help="KV cache formats: f16, int8 or both")
    ap.add_argument("--n-head", type=int, default=32)
    ap.add_argument("--n-head-kv", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=48, help="for the per-prompt column: ms x layers")
    ap.add_argument("--reps", type=int, default=20)
    add_args(ap, "prefill_attn", "FA_WARPS=4")
    a = ap.parse_args(argv)
    kvs = [k for k in a.kv.split(",") if k]
    if not kvs or set(kvs) - {"f16", "int8"}:
        ap.error(f"--kv takes f16, int8 or f16,int8, got {a.kv!r}")
    if a.n_head % a.n_head_kv or a.head_dim % 32:
        ap.error("--n-head must be a multiple of --n-head-kv and --head-dim a multiple of 32")
    a.defines = defines(ap, a)
    a.kvs = kvs
    a.cases = cases(a.tokens, a.chunks, a.chunk_len)
    return a


def launcher(mod, int8: bool):
    """The kernel launched as the engine launches it when the module has the engine's shape query; an older copy
    (--module, before flash_attn_shape) gets its fixed 64-row, 4-warp launch with static shared memory."""
    from engine.cuda.prefill import AttnKernel, attn_kernel
    try:
        mod.get_function("flash_attn_shape")
    except Exception as e:    # the driver's error class moved between CuPy versions (cupy.cuda.driver is gone in 14)
        if "NOT_FOUND" not in str(e):
            raise
        # a copy from before the shape query
        fn = mod.get_function("flash_attn_i8" if int8 else "flash_attn_f16")
        return AttnKernel(fn, 64, 128, 0)
    return attn_kernel(mod, int8)


def main(argv=None):
    a = parse(argv)
    import cupy as cp

    from engine.cuda import kernels
    from engine.cuda.launch import F32, I32
    from engine.cuda.prefill import attn_module

    H, KV, hd = a.n_head, a.n_head_kv, a.head_dim
    t0 = time.perf_counter()
    if a.define or a.module != "prefill_attn":
        defs = dict(a.defines)
        if hd != 128:
            defs.setdefault("FA_HD", str(hd))
        mod = kernels.load(a.module, defs or None)
    else:
        mod = attn_module(hd)
    rng = np.random.default_rng(1)
    max_ctx = max(T + p for T, p in a.cases)
    scale = F32(1.0 / np.sqrt(hd))
    # one layer's cache, random: fp16 values; int8 values with per-32 scales
    kc = cp.asarray(rng.standard_normal((KV, max_ctx, hd)).astype(np.float16))
    vc = cp.asarray(rng.standard_normal((KV, max_ctx, hd)).astype(np.float16))
    kq = cp.asarray(rng.integers(-127, 128, (KV, max_ctx, hd), dtype=np.int8))
    vq = cp.asarray(rng.integers(-127, 128, (KV, max_ctx, hd), dtype=np.int8))
    ks = cp.asarray(rng.uniform(0.005, 0.02, (KV, max_ctx, hd // 32)).astype(np.float32))
    vs = cp.asarray(rng.uniform(0.005, 0.02, (KV, max_ctx, hd // 32)).astype(np.float32))
    kerns = {kv: launcher(mod, kv == "int8") for kv in a.kvs}
    shape = next(iter(kerns.values()))
    print(f"bench.prefill_attn: {a.module} {' '.join(a.define) or 'default build'}: {H} heads, {KV} KV heads, "
          f"head_dim {hd}, {shape.rows} rows x {shape.threads} threads a block, shared "
          + ", ".join(f"{kv} {k.smem / 1024:.1f} KiB" for kv, k in kerns.items())
          + f" (set up in {time.perf_counter() - t0:.1f} s)", flush=True)
    rows_out = []
    for T, pos0 in a.cases:
        q = cp.asarray(rng.standard_normal((T, H * hd)).astype(np.float32))
        out = cp.zeros((T, H * hd), cp.float32)
        tail = (out, I32(T), I32(pos0), I32(H), I32(KV), I32(hd), I32(max_ctx), scale)
        for kv, k in kerns.items():
            args = (q, kq, vq, ks, vs, *tail) if kv == "int8" else (q, kc, vc, *tail)
            k(T, H, KV, args)                          # warm-up (and the one launch ncu sees with --reps 1)
            ev = [cp.cuda.Event() for _ in range(2)]
            ev[0].record()
            for _ in range(a.reps):
                k(T, H, KV, args)
            ev[1].record()
            ev[1].synchronize()
            s = cp.cuda.get_elapsed_time(ev[0], ev[1]) / a.reps / 1e3
            assert bool(cp.isfinite(out).all()), f"non-finite output ({kv}, T {T}, pos0 {pos0})"
            tf = causal_flops(T, pos0, H, hd) / s / 1e12
            rows_out.append((T, pos0, kv, s * 1e3, tf))
    print(f"| tokens | pos0 | kv | ms | ms x {a.layers} layers | TFLOP/s | of {CUBLAS_TFLOPS:.0f} (cuBLAS fp16) |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for T, pos0, kv, ms, tf in rows_out:
        print(f"| {T} | {pos0} | {kv} | {ms:.3f} | {ms * a.layers:.1f} | {tf:.0f} | {tf / CUBLAS_TFLOPS:.2f} |")


if __name__ == "__main__":
    main()
