"""qwen4exp's QSA attention block (cuda_src/qsa.cu) and HC read (cuda_src/hc.cu) at the published shape
(Qwen3.8-Flash-Next: 24/2 heads of 256, indexer 4 x 128, blocks of 4, a 2048-token budget; 4 streams of 2560, rank
320): the decode step's QSA launches captured in a CUDA graph and replayed at several contexts (the time should stay
nearly flat: only the scores and the selection grow with the context), each launch alone beside it; a prompt chunk's
QSA block at a few depths; the decode HC read (write_norm, mv4 of W_down and W_inj, up_mix) in the packs' W_up types.

    python -m bench.qsa [--contexts 0,4096,32768,131072] [--chunk 4096] [--reps 20]

Random inputs (the kernels' speed does not depend on the values; the selection's radix passes do a little, on the
spread of the scores). Per layer figures; the model has 12 QSA layers and 96 HC reads a token.
"""
from __future__ import annotations

import argparse

import numpy as np


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
    ap.add_argument("--contexts", default="0,2048,4096,32768,131072",
                    help="decode positions, comma-separated (default %(default)s)")
    ap.add_argument("--chunk", type=int, default=4096, help="prompt chunk tokens (default %(default)s)")
    ap.add_argument("--depths", default="0,28672", help="prompt chunk start positions (default %(default)s)")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    contexts = [int(x) for x in a.contexts.split(",") if x]
    depths = [int(x) for x in a.depths.split(",") if x]
    import cupy as cp

    from engine.cuda.qsa import QsaKernels, QsaNorms, QsaShape

    s = QsaShape(24, 2, 256, 64, 4, 128, 4, 2048, 1e-6, 1 / 16)
    k = QsaKernels(s)
    max_ctx = max(contexts + [d + a.chunk for d in depths]) + 8
    max_ctx = -(-max_ctx // 64) * 64
    cache = k.cache(max_ctx)
    cache.kc[...] = cp.random.standard_normal(cache.kc.shape, dtype=cp.float32).astype(cp.float16)
    cache.vc[...] = cp.random.standard_normal(cache.vc.shape, dtype=cp.float32).astype(cp.float16)
    cache.kraw[...] = cp.random.standard_normal(cache.kraw.shape, dtype=cp.float32)
    cache.kbar[...] = cp.random.standard_normal(cache.kbar.shape, dtype=cp.float32)
    half = s.n_rot // 2
    ang = np.arange(max_ctx)[:, None] * (1e7 ** (-2.0 * np.arange(half) / s.n_rot))[None, :]
    rope = cp.asarray(np.stack([np.cos(ang), np.sin(ang)], -1).astype(np.float32))
    norms = QsaNorms(*(cp.ones(n, cp.float32) for n in (s.head_dim, s.head_dim, s.idx_dim, s.idx_dim)))

    def proj(T):
        w = (2 * s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_head_kv * s.head_dim,
             s.idx_heads * s.idx_dim, s.idx_dim)
        buf = cp.random.standard_normal((T, sum(w)), dtype=cp.float32)
        o = np.cumsum([0, *w])
        return [buf[:, x:y] for x, y in zip(o[:-1], o[1:])]

    # --- decode ---
    sc = k.decode_scratch(max_ctx)
    q, kk, v, qi, ki = (x[0] for x in proj(1))
    out = cp.empty(s.n_head * s.head_dim, cp.float32)
    state = cp.zeros(8, cp.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    print(f"QSA decode, one layer ({sc.n_split} splits of {sc.ups} units), graph of 10 steps replayed:")
    print(f"{'context':>8} {'block us':>9} {'prep':>7} {'scores':>7} {'select':>7} {'attn':>7} {'combine':>8}")
    for p in contexts:
        state[1] = p
        args = (state, q, kk, v, qi, ki, norms, rope, cache, sc, out)
        with stream:
            k.decode(*args, gate=q[s.head_dim:])
            stream.begin_capture()
            for _ in range(10):
                k.decode(*args, gate=q[s.head_dim:])
            graph = stream.end_capture()
            t_graph = timed(graph.launch, a.reps) / 10
            parts = [
                timed(lambda: k.prep(1, q, kk, v, qi, ki, norms, rope, cache, sc.q, sc.qi, state=state, pool=True),
                      a.reps),
                timed(lambda: k.scores_decode(sc.qi, cache, sc.scores, state), a.reps),
                timed(lambda: k.select(sc.scores, 0, 1, sc.units, sc.n_units, state=state), a.reps),
                timed(lambda: k.attend(1, sc.q, cache, sc.units, sc.n_units, None, state=state, part=sc.part,
                                       n_split=sc.n_split, ups=sc.ups), a.reps),
                timed(lambda: k.combine(sc.part, sc.n_split, out, q[s.head_dim:]), a.reps)]
        stream.synchronize()
        assert bool(cp.isfinite(out).all()), f"context {p}: non-finite attention output"
        print(f"{p:>8} {t_graph * 1e6:>9.1f} " + " ".join(f"{t * 1e6:>7.1f}" for t in parts[:4])
              + f" {parts[4] * 1e6:>8.1f}")

    # --- prompt ---
    T = a.chunk
    psc = k.prompt_scratch(T, max_ctx, min(T, 1024))
    pq = proj(T)
    pout = cp.empty((T, s.n_head * s.head_dim), cp.float32)
    print(f"\nQSA prompt chunk of {T} tokens, one layer:")
    for d in depths:
        t = timed(lambda: k.prompt(d, T, *pq, norms, rope, cache, psc, pout, gate=pq[0][:, s.head_dim:]), 3)
        print(f"  at {d:>7}: {t * 1e3:8.2f} ms  ({T / t / 1e3:.0f}K tok/s a layer)")

    # --- HC decode read ---
    from types import SimpleNamespace

    from engine.cuda.hc import HcKernels, HcShape, HcWeights
    from engine.cuda.kernels import Kernels
    from engine.cuda.launch import Launcher
    from engine.cuda.quant_types import qtype, random_rows
    from engine.cuda.weights import DevMatrix
    hs = HcShape(2560, 4, 320, 1e-6)
    rng = np.random.default_rng(1)
    print("\nHC decode read (write_norm + mv4 of W_down/W_inj + up_mix), one read:")
    for name in ("Q8_0", "Q4_0", "F16", "BF16"):
        t_id = qtype(name).id
        mv = Launcher(Kernels({t_id}), SimpleNamespace(rms_eps=1e-6))
        hk = HcKernels(hs, (name,))

        def mat(r, c):
            raw = random_rows(name, r, c, rng)
            return DevMatrix(cp.asarray(raw), t_id, r, c, raw.shape[1])

        w = HcWeights(cp.ones(hs.D, cp.float32), mat(hs.R, hs.D), mat(hs.D, hs.R), mat(hs.H, hs.D))
        x = cp.random.standard_normal(hs.D, dtype=cp.float32)
        o = cp.random.standard_normal(hs.N, dtype=cp.float32) * 0.01
        y, iota, iota_prev = cp.empty(hs.N, cp.float32), cp.empty(hs.H, cp.float32), cp.ones(hs.H, cp.float32)
        hsc = hk.scratch()
        t_all = timed(lambda: hk.read_decode(mv, x, w, hsc, y, iota, o=o, iota_prev=iota_prev), a.reps)
        t_up = timed(lambda: hk.up_mix(w.up, hsc.d, hsc.u, y, inj=hsc.e, iota=iota), a.reps)
        nbytes = w.down.nbytes + w.up.nbytes + w.inject.nbytes
        print(f"  {name:>5}: {t_all * 1e6:6.1f} us (up_mix {t_up * 1e6:5.1f} us; weights {nbytes / 2**20:.1f} MiB "
              f"-> {nbytes / t_all / 1e9:.0f} GB/s)")


if __name__ == "__main__":
    main()
