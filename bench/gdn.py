"""One Gated DeltaNet layer's prompt kernels (cuda_src/gdn.cu) per 4K tokens at the Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B
shapes, beside the same model's gated-attention layer in the flash prompt kernel (prefill_attn.cu) at the same T, so
the share of the mixers' prompt time that GDN takes can be read off; and the decode step's two GDN kernels replayed
in a CUDA graph (which shows them capture-safe), beside the delta kernel alone with its q/k norms (the engine's
decode step, whose conv runs in the projection's launch).

    python -m bench.gdn [--tokens 4096] [--reps 10] [--define GDN_BV=128]

Ceilings beside each GDN figure: its bytes at HBM's measured read rate (docs/design.md "Measured facts": fp32 qkv, z,
beta/alpha in, the gated output out, the state in and out) and its tensor-core FLOPs (the chunk form's products,
as the kernels compute them) at cuBLAS's fp16 rate; the larger of the two is the floor. Attention FLOPs count the
causal pairs (bench.prefill_attn). Random inputs: the kernels' speed does not depend on the values.
"""
from __future__ import annotations

import argparse

import numpy as np

from bench.prefill_attn import causal_flops
from bench.variant import CUBLAS_TFLOPS

HBM_GBS = 4454.0     # docs/design.md "Measured facts": HBM read

# (name, GDN (n_k, n_v, D, grouped), attention (n_head, n_head_kv, head_dim), GDN layers, attention layers)
MODELS = (("qwen3next-80b-a3b", (16, 32, 128, True), (16, 2, 256), 36, 12),
          ("qwen35moe-35b-a3b", (16, 32, 128, False), (16, 2, 256), 30, 10))


def gdn_flops(T: int, n_v: int, D: int, bv: int) -> int:
    """Tensor-core FLOPs of the chunk form as gdn_chunk_prep and gdn_chunk_scan compute them (chunks padded to 64):
    prep K K^T and Q K^T; per value slice of bv: K H and Q H, u = [T_v | T_k] [V; KH], (QK) u, K^T u."""
    C = 64
    nc = (T + C - 1) // C
    prep = 2 * (2 * C * C * D)
    scan = (D // bv) * (2 * (2 * C * D * bv) + 2 * C * 2 * C * bv + 2 * C * C * bv + 2 * D * C * bv)
    return nc * n_v * (prep + scan)


def gdn_bytes(T: int, n_k: int, n_v: int, D: int) -> int:
    C = (2 * n_k + n_v) * D
    return 4 * (T * C + 2 * T * n_v * D + 2 * T * n_v + 2 * n_v * D * D)


def timed(fn, reps: int) -> float:
    """Seconds per call (events around reps calls after a warm-up)."""
    import cupy as cp
    fn()
    ev = [cp.cuda.Event() for _ in range(2)]
    ev[0].record()
    for _ in range(reps):
        fn()
    ev[1].record()
    ev[1].synchronize()
    return cp.cuda.get_elapsed_time(ev[0], ev[1]) / reps / 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a gdn.cu define for a variant (e.g. GDN_BV=128); repeatable")
    a = ap.parse_args(argv)
    if any("=" not in d for d in a.define):
        ap.error("--define takes NAME=VALUE")
    defs = dict(d.split("=", 1) for d in a.define)
    import cupy as cp

    from engine.cuda.families.gdn import GdnKernels, GdnShape
    from engine.cuda.launch import F32, I32
    from engine.cuda.prefill import attn_kernel, attn_module

    T = a.tokens
    rng = np.random.default_rng(1)
    rows = []
    for name, (n_k, n_v, D, grouped), (H, KV, hd), n_gdn, n_att in MODELS:
        sh = GdnShape(n_k, n_v, D, 4, grouped, 1e-6)
        k = GdnKernels(sh, defs)
        C = sh.channels

        def f32(*s, scale=1.0):
            return cp.asarray(rng.standard_normal(s).astype(np.float32) * scale)

        qkv, z, ba = f32(T, C), f32(T, n_v * D), f32(T, 2 * n_v)
        b, al = (ba, None) if grouped else (ba[:, :n_v], ba[:, n_v:])
        conv_w, conv_state = f32(C, 4, scale=0.5), f32(3, C)
        dt_bias = cp.asarray(np.log(np.expm1(rng.uniform(0.001, 0.1, n_v))).astype(np.float32))
        ssm_a = cp.asarray(-rng.uniform(1, 16, n_v).astype(np.float32))
        norm_w, S = f32(D), f32(n_v, D, D, scale=0.1)
        out = cp.empty((T, n_v * D), cp.float32)
        scratch = k.scratch(T)
        t_conv = timed(lambda: k.conv_prefill(qkv, T, conv_state, conv_w, scratch), a.reps)
        t_delta = timed(lambda: k.delta_prefill(T, b, al, dt_bias, ssm_a, S, out, scratch), a.reps)
        t_norm = timed(lambda: k.gated_norm(out, z, norm_w, out, T), a.reps)
        t_all = timed(lambda: k.prefill(qkv, z, b, al, dt_bias, ssm_a, conv_w, norm_w, conv_state, S, out, scratch),
                      a.reps)
        assert bool(cp.isfinite(out).all()), f"{name}: non-finite GDN output"
        # prep alone (the rest of delta_prefill is the scan)
        nc = (T + 63) // 64
        from engine.cuda.launch import ptr
        pb, pa, ld, grp = k._ba(b, al)
        t_prep = timed(lambda: k.f["gdn_chunk_prep"](
            (nc, n_v), (k.prep_threads,),
            (ptr(scratch.act16), I32(T), I32(C), pb, pa, ld, grp, ptr(dt_bias), ptr(ssm_a), I32(n_k), I32(n_v),
             I32(int(grouped)), ptr(scratch.gcum), ptr(scratch.tcat), ptr(scratch.qkm)),
            shared_mem=k.prep_smem), a.reps)

        # decode: the two kernels of one layer captured in a graph, replayed
        act = cp.empty(C, cp.float32)
        dout = cp.empty(n_v * D, cp.float32)
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            dec_args = (qkv[0], z[0], b[0], None if al is None else al[0], dt_bias, ssm_a, conv_w, norm_w,
                        conv_state, S, dout, act)
            k.decode(*dec_args)
            stream.begin_capture()
            for _ in range(10):
                k.decode(*dec_args)
            graph = stream.end_capture()
            t_dec = timed(lambda: graph.launch(stream), a.reps * 10) / 10
            # the engine's decode form: the conv is in the projection's launch (dense.cu mv4), the delta kernel
            # norms q and k itself, one launch a layer here
            stream.begin_capture()
            for _ in range(10):
                k.delta_decode(act, b[0], None if al is None else al[0], dt_bias, ssm_a, S, z[0], norm_w, dout,
                               qk_norm=True)
            graph1 = stream.end_capture()
            t_dec1 = timed(lambda: graph1.launch(stream), a.reps * 10) / 10
        stream.synchronize()

        # the attention layer of the same model at the same T
        mod = attn_module(hd)
        ak = attn_kernel(mod, False)
        q = f32(T, H * hd)
        kc = cp.asarray(rng.standard_normal((KV, T, hd)).astype(np.float16))
        vc = cp.asarray(rng.standard_normal((KV, T, hd)).astype(np.float16))
        aout = cp.empty((T, H * hd), cp.float32)
        args = (q, kc, vc, aout, I32(T), I32(0), I32(H), I32(KV), I32(hd), I32(T), F32(1 / np.sqrt(hd)))
        t_att = timed(lambda: ak(T, H, KV, args), a.reps)

        fl = gdn_flops(T, n_v, D, k.bv)
        floor = max(fl / (CUBLAS_TFLOPS * 1e12), gdn_bytes(T, n_k, n_v, D) / (HBM_GBS * 1e9))
        per4k = 4096 / T
        share = n_gdn * t_all / (n_gdn * t_all + n_att * t_att)
        rows.append((name, t_conv, t_prep, t_delta - t_prep, t_norm, t_all, floor, fl / t_all / 1e12, t_att,
                     causal_flops(T, 0, H, hd) / t_att / 1e12, n_gdn, n_att, share, t_dec, t_dec1, per4k))
    print(f"bench.gdn: {' '.join(a.define) or 'default build'}, T = {T} tokens, one layer; ms per 4K tokens (x {4096 / T:.2f} of the measured)")
    print("| model | conv | prep | scan | norm | GDN layer | floor | GDN TFLOP/s | attention layer | attn TFLOP/s "
          "| GDN x n + attn x m (ms) | GDN share | decode GDN us/token/layer | the same, delta kernel alone (qk_norm) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (name, tc, tp, ts, tn, ta, fl, tf, tt, atf, ng, na, share, td, td1, s) in rows:
        print(f"| {name} | {tc * s * 1e3:.3f} | {tp * s * 1e3:.3f} | {ts * s * 1e3:.3f} | {tn * s * 1e3:.3f} | "
              f"{ta * s * 1e3:.3f} | {fl * s * 1e3:.3f} | {tf:.0f} | {tt * s * 1e3:.3f} | {atf:.0f} | "
              f"{ng} x {ta * s * 1e3:.2f} + {na} x {tt * s * 1e3:.2f} = {(ng * ta + na * tt) * s * 1e3:.1f} | "
              f"{share:.0%} | {td * 1e6:.1f} | {td1 * 1e6:.1f} |")


if __name__ == "__main__":
    main()
