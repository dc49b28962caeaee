"""The staged backend on one GPU beside the unsplit one (issue 32's test mode, engine/cuda/staged_backend.py): the
cost of cutting a step into stages (a graph a stage, the hand-off's event waits and copies, an expert cache a stage)
where no second card adds VRAM or a link.

    python -m bench.stages [--model M] [--splits 24,24:1,46,1] [--budget GIB|all] [--prompt N] [--new N]

Rows: one stage (the plain CUDABackend with the stages' settings: no prefetch, no run-ahead), then each split of
--splits on GPU 0 (`--gpus 0,0` as the worker runs it), each after an unmeasured pass that warms its caches. Each
row: decode tok/s over --new tokens after a --prompt-token prompt, the prompt's tok/s, the hit rate, each stage's
expert slots. The caches start from the profile an all-resident learning pass saved (as bench.decode's rows), so
every row's cache holds the same hot experts by its own rule (the unsplit cache the hottest overall, each stage the
hottest of its layers within its share of the bytes). Timings are one pass each; nothing here is asserted."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.decode import DEFAULT_MODEL, free_vram, make_model, run_pass


def parse_splits(text: str) -> list[tuple[int, ...]]:
    """'24,24:1,46,1' -> [(24, 24), (1, 46, 1)]: each split two or more layer counts >= 1."""
    out = []
    for part in text.split(":"):
        try:
            counts = tuple(int(x) for x in part.split(","))
        except ValueError:
            counts = ()
        if len(counts) < 2 or any(c < 1 for c in counts):
            raise SystemExit(f"bench.stages: --splits takes splits of two or more layer counts >= 1 separated by "
                             f"':', e.g. 24,24:1,46,1; got {part!r}")
        out.append(counts)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--make-recipe", help="when --model is missing, make it in this llama-quantize recipe")
    ap.add_argument("--splits", default=None, help="layer counts a stage, splits separated by ':' (default: halves)")
    ap.add_argument("--budget", default="all", help="GiB the backend may take in all (each row), or 'all'")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, help="the rows as JSON")
    a = ap.parse_args(argv)
    splits = parse_splits(a.splits) if a.splits else None

    import cupy as cp
    from engine.cuda.args import CudaOptions
    from engine.cuda.backend import CUDABackend
    from engine.cuda.staged_backend import StagedBackend
    from engine.gguf_model import open_model

    facts = {}
    if not a.model.is_file():
        facts["model_make_s"] = round(make_model(a.model, recipe=a.make_recipe), 1)
    model = open_model(a.model)
    n = model.config.n_layer
    splits = splits or [(n // 2, n - n // 2)]
    bad = [s for s in splits if sum(s) != n]
    if bad:
        raise SystemExit(f"bench.stages: --splits {','.join(map(str, bad[0]))} covers {sum(bad[0])} layers; "
                         f"{a.model.name} has {n}")
    ctx = a.prompt + a.new + 16
    mib = None if a.budget == "all" else int(float(a.budget) * 1024)
    profile = Path(tempfile.mkdtemp(prefix="bench-stages-")) / "learned.profile"
    rng = np.random.default_rng(a.seed)
    here = cp.cuda.Device().id

    def start(counts, **kw):
        free_vram()
        base = dict(vram_budget_mib=mib, pipeline=False, prefetch=False,
                    expert_profile=str(profile) if profile.is_file() else None)
        base.update(kw)
        if counts is None:
            return CUDABackend(model, ctx, CudaOptions(**base))
        return StagedBackend(model, ctx, CudaOptions(gpus=(here,) * len(counts), layer_split=counts, **base))

    be = start(None, vram_budget_mib=None, expert_profile_save=str(profile))     # the learning pass, all resident
    run_pass(be, rng, a.prompt, a.new)
    be.close()
    rows = []
    for counts in [None, *splits]:
        t0 = time.perf_counter()
        be = start(counts)
        load_s = time.perf_counter() - t0
        try:
            run_pass(be, rng, a.prompt, a.new)          # warms the caches' adaptive tiers
            m = run_pass(be, rng, a.prompt, a.new)
            info = be.info()
        finally:
            be.close()
        row = dict(split=",".join(map(str, counts)) if counts else str(n), stages=len(counts) if counts else 1,
                   budget=a.budget, tok_s=round(m["steps"] / m["decode_s"], 1),
                   prompt_tok_s=round(a.prompt / m["prompt_s"], 1),
                   hit_rate=round(m["hits"] / max(m["lookups"], 1), 4), expert_slots=info.get("expert_slots"),
                   stage_expert_slots=info.get("stage_expert_slots", ""), prefill_chunk=info.get("prefill_chunk"),
                   load_s=round(load_s, 1))
        rows.append(row)
        print(f"bench.stages: {json.dumps(row)}", file=sys.stderr, flush=True)
    one = rows[0]["tok_s"]
    print(f"bench.stages: {a.model.name}, prompt {a.prompt}, {a.new} new tokens, budget {a.budget}"
          + (f" ({json.dumps(facts)})" if facts else ""))
    print("| split | stages | decode tok/s | vs one | prompt tok/s | hit rate | expert slots |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        slots = r["stage_expert_slots"] or str(r["expert_slots"])
        print(f"| {r['split']} | {r['stages']} | {r['tok_s']} | {r['tok_s'] / one:.3f} | {r['prompt_tok_s']} | "
              f"{r['hit_rate']} | {slots} |")
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
