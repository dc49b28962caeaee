"""How much a model's residual stream changes between layers: the premise of the decode prefetch's pre-gating.

    python -m bench.residual_similarity --model A.gguf [--model B.gguf ...] [--prompt 32] [--new 40]

engine/cuda/prefetch.py predicts layer m's experts by running layer m's router on layer m-2's FFN input; that works
as far as the two inputs point the same way. Per model (any architecture the NumPy backend runs, dense too), this
decodes a random prompt greedily, records every layer's normed FFN input, and prints for layer distances 1-3 their
mean cosine and the share of top-8 ids that one random 128-way router (the same for both layers) gives both: a
router-free proxy for the prediction's accuracy (on bench.decode's model cut to 12 layers: 0.70 at depth 2, where
bench.prefetch_predictors measures 0.72 with the model's own routers). A trained MoE's routers are trained, so the
proxy says what the residual stream allows, not what a router makes of it.

2026-11-30, `--model data/models/SmolLM2-135M-Instruct.Q4_1.gguf --model <bench model cut to 12 layers>` (CPU):
    depth                          1              2              3
    SmolLM2-135M (trained, dense)  0.878 / 0.618  0.788 / 0.522  0.717 / 0.440   (cosine / top-8 overlap)
    bench.decode's model (12 l.)   0.967 / 0.784  0.938 / 0.701  0.909 / 0.646
The synthetic model's residual stream is the steadier of the two.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.prefetch_predictors import record


def similarity(rows: list[np.ndarray], depth: int, rng, k: int = 8, n_router: int = 128) -> tuple[float, float]:
    """(mean cosine, random-router top-k overlap) of layer l's and layer l+depth's rows, over the layers from 1 on
    (layer 0's input is the embedding)."""
    cos, overlap = [], []
    for li in range(1, len(rows) - depth):
        a, b = rows[li].astype(np.float64), rows[li + depth].astype(np.float64)
        cos.append(float(np.mean((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1))))
        r = rng.standard_normal((n_router, a.shape[1]))
        ta = np.argsort(-(a @ r.T), axis=1, kind="stable")[:, :k]
        tb = np.argsort(-(b @ r.T), axis=1, kind="stable")[:, :k]
        overlap.append(float(np.mean([len(set(x) & set(y)) / k for x, y in zip(ta.tolist(), tb.tolist())])))
    return float(np.mean(cos)), float(np.mean(overlap))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, action="append", required=True)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    if a.prompt < 1 or a.new < 1:
        raise SystemExit("bench.residual_similarity: --prompt and --new must be at least 1")
    from engine.gguf_model import open_model

    print("| model | layers | depth | cosine | random-router top-8 overlap |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for path in a.model:
        if not path.is_file():
            raise SystemExit(f"bench.residual_similarity: {path} not found")
        model = open_model(path)
        ffn_in, _ = record(model, a.prompt, a.new, a.seed)
        rows = [r[a.prompt:] for r in ffn_in]               # the decoded tokens' rows
        for depth in (1, 2, 3):
            cos, overlap = similarity(rows, depth, np.random.default_rng(depth))
            print(f"| {path.name} | {len(rows)} | {depth} | {cos:.3f} | {overlap:.3f} |", flush=True)


if __name__ == "__main__":
    main()
