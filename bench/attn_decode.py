"""The decode attention alone, attention.cu's attn_gqa_* ("old") against attn_split.cu's flash-decoding ("new"), at
long contexts, beside the HBM ceiling.

    python -m bench.attn_decode [--shape qwen3|gptoss|qwen35] [--kv f16,int8] [--ctx 1024,8192,32768,131072]
                                [--nq 1,8] [--chunks 33,66,132] [--reps 5]

Each call is one layer's DecodeAttention.attend (q already rotated, K/V in the cache; the fused step's store is not
timed) for n_q query tokens whose last sees ctx positions. Timed as bench/matvec.py times: a replayed CUDA graph of
calls cycling through enough layers (>= 400 MB of K/V together) that the 50 MB L2 serves none of them, best of
--reps. Bytes per call: the K and V rows the window reads (int8: values plus scales); GB/s beside the H200's measured
HBM read rate (docs/design.md "Measured facts") and its 4.8 TB/s nominal. The old kernels take n_q = 1 only; the new
ones run each n_q in one launch (a speculative verify window). The outputs of old and new are compared (max relative
difference) so a fast wrong kernel shows. --chunks times the new kernels at each given most-chunks-a-KV-head
(DecodeAttention's n_split) instead of the engine's rule (kv.split_chunks), to choose that rule by measurement.
"""
from __future__ import annotations

import argparse
import math
import sys
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HBM_READ = 4.454e12     # bytes/s, measured read (docs/design.md)
HBM_NOMINAL = 4.8e12
# name: (n_head_kv, group, head_dim), the models' attention shapes (gpt-oss: a full layer, sinks not timed apart)
SHAPES = {"qwen3": (4, 8, 128), "gptoss": (8, 8, 64), "qwen35": (2, 8, 256)}
MIN_TOTAL = 400e6


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.attn_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3")
    p.add_argument("--kv", default="f16,int8", help="comma-separated KV layouts: f16, int8")
    p.add_argument("--ctx", default="1024,8192,32768,131072", help="comma-separated context lengths")
    p.add_argument("--nq", default="1,8", help="comma-separated window sizes for the new kernels (1..8)")
    p.add_argument("--chunks", default="",
                   help="comma-separated most chunks a KV head for the new kernels (default: the engine's rule)")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    try:
        a.kv = [s for s in a.kv.split(",") if s]
        a.ctx = [int(s) for s in a.ctx.split(",") if s]
        a.nq = [int(s) for s in a.nq.split(",") if s]
        a.chunks = [int(s) for s in a.chunks.split(",") if s] or [None]
    except ValueError as e:
        p.error(f"--ctx, --nq and --chunks take comma-separated integers ({e})")
    if not a.kv or any(k not in ("f16", "int8") for k in a.kv):
        p.error("--kv takes f16 and/or int8")
    if not a.ctx or any(c < 1 for c in a.ctx):
        p.error("--ctx takes positive context lengths")
    if not a.nq or any(not 1 <= n <= 8 for n in a.nq):
        p.error("--nq takes window sizes 1..8")
    from engine.cuda.kv import AS_MAX_CHUNKS
    if any(c is not None and not 1 <= c <= AS_MAX_CHUNKS for c in a.chunks):
        p.error(f"--chunks takes 1..{AS_MAX_CHUNKS}")
    if a.reps < 1:
        p.error("--reps must be at least 1")
    return a


def bytes_per_call(n_head_kv: int, head_dim: int, ctx: int, kv: str) -> int:
    """K and V bytes one call reads: ctx positions of every KV head."""
    from engine.cuda.kv import row_bytes
    return 2 * n_head_kv * ctx * row_bytes(head_dim, kv)


def layers_for(nbytes: int) -> int:
    """Layers to cycle through so that together they defeat the L2."""
    return max(2, math.ceil(MIN_TOTAL / nbytes))


def run(a) -> None:
    import cupy as cp

    from engine.cuda.kernels import Kernels
    from engine.cuda.kv import DecodeAttention, KVCache
    from engine.cuda.quant_types import qtype
    K = Kernels({qtype("F16").id})
    n_kv, G, hd = SHAPES[a.shape]
    print(f"decode attention, {a.shape}: {n_kv * G} q / {n_kv} KV heads x {hd}; "
          f"GB/s beside {HBM_READ / 1e9:.0f} (measured HBM read) and {HBM_NOMINAL / 1e9:.0f} (nominal)")
    print(f"{'kv':>5} {'ctx':>7} {'n_q':>3} {'MB/call':>8} {'old us':>8} {'old GB/s':>9} {'new us':>8} "
          f"{'new GB/s':>9} {'% read':>7} {'speed-up':>8} {'max rel diff':>12} {'chunks':>6}")
    rng = np.random.default_rng(0)
    for kvt in a.kv:
        for ctx in a.ctx:
            nbytes = bytes_per_call(n_kv, hd, ctx, kvt)
            n_layer = layers_for(nbytes)
            cfg = types.SimpleNamespace(n_head=n_kv * G, n_head_kv=n_kv, head_dim=hd, n_layer=n_layer, n_rot=hd,
                                        rope_type="neox", rms_eps=1e-6)
            max_ctx = ctx + 8
            kv = KVCache(cfg, max_ctx, kvt)
            if kvt == "f16":
                for arr in (kv.k, kv.v):
                    arr[...] = cp.random.standard_normal(arr.shape, dtype=cp.float32).astype(cp.float16)
            else:
                for arr in (kv.k, kv.v):
                    arr[...] = cp.random.randint(-127, 128, size=arr.shape).astype(cp.int8)
                for arr in (kv.k_scale, kv.v_scale):
                    arr[...] = cp.random.uniform(0.2, 1.5, size=arr.shape, dtype=cp.float32) / 127
            scale = 1.0 / np.sqrt(hd)
            old = DecodeAttention(K, cfg, kv, split=False)
            olds = {}
            for chunks in a.chunks:
                new = DecodeAttention(K, cfg, kv, split=True, n_q_max=max(a.nq), n_split=chunks)
                time_new(a, K, cfg, kv, old, new, ctx, kvt, nbytes, n_layer, hd, scale, rng, olds)
            del kv, old, new
            cp.get_default_memory_pool().free_all_blocks()


def time_new(a, K, cfg, kv, old, new, ctx, kvt, nbytes, n_layer, hd, scale, rng, olds: dict) -> None:
    """One DecodeAttention's rows (each n_q), the old kernels beside at n_q = 1 (timed once a context: `olds`)."""
    import cupy as cp

    from bench.matvec import _graph_time
    for n_q in a.nq:
        P0 = ctx - n_q
        if P0 < 0:
            continue
        state = cp.asarray(np.array([0, P0, 0, 0, 0, 0, 0, 0], np.int32))
        q = cp.asarray(rng.standard_normal((n_q, cfg.n_head * hd)).astype(np.float32))
        out_new = cp.zeros((n_q, cfg.n_head * hd), cp.float32)
        t_new = _graph_time(cp, lambda i: new.attend(K, i, q, out_new, state, scale, n_q=n_q), n_layer, a.reps)
        new.attend(K, n_layer - 1, q, out_new, state, scale, n_q=n_q)
        old_us = old_bw = diff = "-"
        t_old = None
        if n_q == 1:
            out_old = cp.zeros(cfg.n_head * hd, cp.float32)
            if "t" not in olds:
                olds["t"] = _graph_time(cp, lambda i: old.attend(K, i, q[0], out_old, state, scale), n_layer, a.reps)
            t_old = olds["t"]
            old.attend(K, n_layer - 1, q[0], out_old, state, scale)
            ref = out_old.get().astype(np.float64)
            diff = f"{np.linalg.norm(out_new.get()[0] - ref) / max(np.linalg.norm(ref), 1e-30):.1e}"
            old_us, old_bw = f"{t_old * 1e6:.1f}", f"{nbytes / t_old / 1e9:.0f}"
        bw = nbytes / t_new
        speed = f"{t_old / t_new:.2f}x" if t_old else "-"
        print(f"{kvt:>5} {ctx:>7} {n_q:>3} {nbytes / 1e6:>8.1f} {old_us:>8} {old_bw:>9} {t_new * 1e6:>8.1f} "
              f"{bw / 1e9:>9.0f} {100 * bw / HBM_READ:>6.0f}% {speed:>8} {diff:>12} {new.n_split:>6}")


def main(argv=None) -> None:
    run(parse(argv))


if __name__ == "__main__":
    main()
