"""Decode speed and hit rate at one VRAM budget for several settings of the adaptive expert tier (engine/cuda/
expert_cache.py's DECAY, the swaps a round, --adapt-every), all in one process.

    python -m bench.adapt_tier [--budget 12] [--passes 3] [--settings 0.7:64:32,0.7:256:32,0.85:256:32]

A setting is DECAY:SWAPS:EVERY (heat decay a round, most swaps a round, tokens between rounds). The tier's swaps
cross the same link as the decode step's expert copies, so what a setting buys in hit rate and costs in link time is
measured together: bench.decode's model and passes (a learning pass with every expert resident; per setting the
cache rebuilt from that same heat, a learning pass at the budget, then --passes measured passes on fresh random
prompts, the tier running). Prints tok/s and hit rate per pass, swaps a pass, and the means.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from bench.decode import DEFAULT_MODEL, make_model, run_pass


def parse_setting(text: str) -> tuple[float, int, int]:
    """'0.7:64:32' -> (decay, swaps a round, tokens a round)."""
    try:
        d, s, e = text.split(":")
        decay, swaps, every = float(d), int(s), int(e)
    except ValueError:
        raise SystemExit(f"bench.adapt_tier: bad setting {text!r}; expected DECAY:SWAPS:EVERY, "
                         "e.g. 0.7:64:32") from None
    if not 0.0 < decay < 1.0 or swaps <= 0 or every <= 0:
        raise SystemExit(f"bench.adapt_tier: bad setting {text!r}: decay in (0, 1), swaps and every positive")
    return decay, swaps, every


def main(argv=None):
    from engine.cuda import expert_cache
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--budget", type=float, default=12.0, help="GiB")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--settings", default=f"{expert_cache.DECAY}:64:32,{expert_cache.DECAY}:256:32")
    a = ap.parse_args(argv)
    settings = [parse_setting(s) for s in a.settings.split(",")]

    from pathlib import Path

    from engine.cuda.backend import CUDABackend, CudaOptions
    from engine.gguf_model import open_model

    model_path = Path(a.model)
    if not model_path.is_file():
        make_model(model_path)
    be = CUDABackend(open_model(model_path), 512 + 256 + 16, CudaOptions(adapt_every=32))
    rng = np.random.default_rng(1)
    be.resize_expert_cache(vram_budget_mib=None)
    run_pass(be, rng, 512, 256)                   # the routing heat every setting starts from
    heat = be.cache.heat.copy()
    rows = []
    for decay, swaps, every in settings:
        expert_cache.DECAY = decay                # read by ExpertCache.adapt at each round
        be.opts.adapt_every = every
        be.cache.heat[:] = heat
        be.resize_expert_cache(vram_budget_mib=int(a.budget * 1024))
        be.cache.max_swaps = swaps
        run_pass(be, rng, 512, 256)
        res = []
        for _ in range(a.passes):
            s0 = be.cache.swaps
            m = run_pass(be, rng, 512, 256)
            res.append((m["steps"] / m["decode_s"], m["hits"] / max(m["lookups"], 1), be.cache.swaps - s0))
        rows.append((decay, swaps, every, res))
        print(f"bench.adapt_tier: {decay}:{swaps}:{every}: " + " ".join(f"{t:.1f}" for t, _, _ in res),
              file=sys.stderr, flush=True)
    be.close()
    print(f"decode at {a.budget:g} GiB, {a.passes} passes a setting (512-token prompt, 256 new tokens)")
    print("| decay | swaps a round | every | tok/s per pass | hit rate per pass | swaps a pass | mean tok/s "
          "| mean hit |")
    print("| ---: | ---: | ---: | --- | --- | ---: | ---: | ---: |")
    for decay, swaps, every, res in rows:
        r = np.array(res)
        print(f"| {decay:g} | {swaps} | {every} | {' '.join(f'{t:.1f}' for t in r[:, 0])} | "
              f"{' '.join(f'{h:.3f}' for h in r[:, 1])} | {r[:, 2].mean():.0f} | {r[:, 0].mean():.1f} | "
              f"{r[:, 1].mean():.4f} |")


if __name__ == "__main__":
    main()
