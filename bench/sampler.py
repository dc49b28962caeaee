"""The GPU sampler's cost a pick: engine/cuda/sampler.py's launches, replayed as one CUDA graph, per sampling chain.

    python -m bench.sampler [--vocab 151936] [--reps 300]

Beside each figure: which path sample_select took (from how many candidates, or the whole vocabulary), what each
launch adds (the chain replayed up to it, the later launches left out), and the HBM floor, the bytes the kernels must touch (logits, the penalized copy, the two float64 weights, the counts with
penalties) at 4.4 TB/s. A pick is a chain of five dependent launches and a few small decisions, so the floor is far
below what any such chain reaches; the figure to compare is the decode step's (3.1 ms all resident on the H200).
"""
from __future__ import annotations

import argparse

import numpy as np

HBM = 4.4e12
# (name, settings): bench.decode's sampled row, Qwen3's generation_config, and what OpenAI-style clients send
CHAINS = [
    ("temperature 0.8", {"temperature": 0.8}),
    ("temperature 0.7, min_p 0.05", {"temperature": 0.7, "min_p": 0.05}),
    ("top_k 40, top_p 0.95, min_p 0.05, temp 0.8", {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}),
    ("top_k 20, top_p 0.8, temp 0.7", {"temperature": 0.7, "top_k": 20, "top_p": 0.8}),
    ("top_p 0.9, temp 0.7", {"temperature": 0.7, "top_p": 0.9}),
    ("top_k 40, top_p 0.95, repeat 1.1", {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "penalty_repeat": 1.1}),
]


def logits_like(kind: str, n: int, rng) -> np.ndarray:
    if kind == "peaked":      # a few large values over a wide low floor (tests/test_cuda_sampler.py lm_logits)
        return (rng.standard_normal(n) * 2 + np.where(rng.random(n) < 0.01, 8, 0)).astype(np.float32)
    if kind == "broad":       # 6,000 plausible ids: top_p 0.9 keeps ~4,100 of them (5,100 candidates)
        x = (rng.standard_normal(n) * 2).astype(np.float32)
        x[rng.choice(n, 6000, replace=False)] = (8 + rng.standard_normal(6000)).astype(np.float32)
        return x
    return rng.standard_normal(n).astype(np.float32)        # flat: top_p keeps a large share


def time_chain(cp, kern, logits, params, reps):
    """(us a pick, the candidates sample_select used or -1 or None where the tree has no such count)."""
    from engine.cuda.launch import MappedInts
    from engine.cuda.sampler import GpuSampler
    from engine.sampling import Sampler

    stream = cp.cuda.Stream(non_blocking=True)
    gs = GpuSampler(kern, len(logits), 4096, stream)
    out = MappedInts(2)
    spec = Sampler({**params, "seed": 1}).spec(history=list(range(64)))
    x = cp.asarray(logits)
    try:
        with stream:
            gs.load(gs.state_for(spec))
            gs.enqueue(kern, x, out.dptr)          # warm-up (and module load) outside the capture
            stream.synchronize()
            stream.begin_capture()
            gs.enqueue(kern, x, out.dptr)
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            t0, t1 = cp.cuda.Event(), cp.cuda.Event()
            t0.record(stream)
            for _ in range(reps):
                graph.launch(stream)
            t1.record(stream)
            t1.synchronize()
        st = gs.read_state()
        nc = int(st["nc"]) if "nc" in st.dtype.names else None
        return cp.cuda.get_elapsed_time(t0, t1) * 1e3 / reps, nc
    finally:
        gs.close()
        out.close()


def upto(kern, names, last):
    """The kernels of the chain up to `last`; the later ones launch nothing."""
    keep = names[:names.index(last) + 1]
    return lambda name, qt=None, tag=None: kern(name) if name in keep else (lambda *a, **k: None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args(argv)
    import cupy as cp
    from engine.cuda import kernels

    mod = kernels.load("sample")
    kern = lambda name, qt=None, tag=None: mod.get_function(name)   # noqa: E731
    n = a.vocab
    floor_us = 32 * n / HBM * 1e6
    print(f"vocabulary {n}; HBM floor {floor_us:.1f} us a pick (~32 bytes an id at 4.4 TB/s)")
    from engine.cuda.sampler import KERNELS
    print("| logits | chain | us a pick | selected from | " + " | ".join(f"+{k}" for k in KERNELS) + " |")
    print("| --- | --- | ---: | --- |" + " ---: |" * len(KERNELS))
    rng = np.random.default_rng(0)
    for kind in ("peaked", "broad", "flat"):
        x = logits_like(kind, n, rng)
        for name, params in (CHAINS if kind != "broad" else [c for c in CHAINS if "top_p" in c[1]]):
            us, nc = time_chain(cp, kern, x, params, a.reps)
            where = "?" if nc is None else ("the vocabulary" if nc < 0 else f"{nc} candidates")
            prev, adds = 0.0, []
            for k in KERNELS:
                t = time_chain(cp, upto(kern, KERNELS, k), x, params, a.reps)[0]
                adds.append(f"{t - prev:.1f}")
                prev = t
            print(f"| {kind} | {name} | {us:.1f} | {where} | " + " | ".join(adds) + " |", flush=True)


if __name__ == "__main__":
    main()
