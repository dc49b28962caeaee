"""Prompt speed of the prompt pass at several VRAM budgets and prompt lengths.

    python -m bench.prefill [--model data/models/qwen3-30b-a3b-q4k-g3.gguf] [--budgets all,16,12]
                            [--prompts 1024,4096,8192,32768] [--chunk auto] [--ring N] [--out prefill.json]
                            [--no-profile] [--lend-floor N] [--host-profile N]

One process, a backend per budget (--vram-budget-mib semantics: weights, KV cache, expert cache and the prompt
pass's buffers all count; bench.decode's fresh_backend: built once the last one gave its VRAM back, filled from the
profile it saved), warmed by a 1K prompt and 64 decoded tokens (the adaptive tier fills it from the routing), then
each prompt length is read chunk by chunk as the worker's session reads it. Per row: tok/s, chunk, ring depth used (its own slots + expert-cache
slots lent to it), expert bytes streamed per chunk, the link rate while copying and averaged over the prompt (against
55 GB/s, the pinned copy in docs/design.md "Measured facts"), the share of the prompt's time the copy engine was busy (from events around each
ring batch's copies), and that share within the streamed layers only (from the first streamed layer's start to the
last one's end, per chunk: the issue's "link busy >= 80% in streamed layers"). A second table splits the
GPU time by phase (dense projections, attention, router, expert sort, gate/up, down, ring waits, other) from CUDA
events recorded between phases, with the host's time to enqueue a chunk beside it (a launch-bound pass shows GPU
time well under the wall time). A third table splits each chunk's host time (bench/prompt_pass.py host_split:
the expert tables, the family's inputs such as qwen4exp's PLE rows, the layers' launches, what follows the last
one); --host-profile N prints a cProfile of each budget's first prompt (Python, or launches blocked behind the GPU).
Targets (issue 5, against llama.cpp on the same machine): 12 GiB, 4K >= 6,500 tok/s with the link >= 80% busy;
everything resident, 4K >= 9,840 tok/s. The KV cache is sized for the longest prompt: at 32K it takes ~6 GiB of a
budget (reported), so run `--prompts 1024,4096,8192` separately for the 4K target at 12 GiB.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from bench.decode import (DEFAULT_MODEL, dump, free_vram, fresh_backend, make_model, memory_facts,
                          resident_budget)
from bench.prompt_pass import prompt_row

LINK_BPS = 55e9


def log(msg):
    print(f"bench.prefill: {msg}", file=sys.stderr, flush=True)


def warm(be, rng, n_prompt=1024, n_new=64):
    from engine.sampling import PickSpec
    be.truncate(0)
    greedy = PickSpec()
    n_prompt = min(n_prompt, be.max_context - n_new)     # --prompts 1024 gives a context of 1040
    tok = be.decode(rng.integers(0, be.config.n_vocab, n_prompt).tolist(), greedy)[0].id
    for _ in range(n_new - 1):
        tok = be.decode([tok], greedy)[0].id
    be.cache.poll(be.stream, wait=True)


def print_tables(rows) -> None:
    """The main table, then GPU time by phase for the rows that were profiled."""
    print("| budget GiB | prompt | resident/total | chunk | ring (own+lent) | tok/s | MB/chunk | GB/s copying "
          "| GB/s avg | of 55 | copy busy | busy in streamed layers |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['budget']} | refused: {r['error']} |")
            continue
        print(f"| {r['budget']} | {r['prompt']} | {r['resident']}/{r['experts_total']} | {r['chunk']} | {r['ring']} "
              f"({r['ring'] - r['lent']}+{r['lent']}) | {r['tok_s']:.0f} | {r['mb_per_chunk']:.0f} | "
              f"{r['link_gbps_copying']:.1f} | {r['link_gbps_avg']:.1f} | "
              f"{r['link_gbps_copying'] * 1e9 / LINK_BPS:.2f} | {r['copy_busy_share']:.2f} | "
              f"{r['link_busy_streamed']:.2f} |")
    prof = [r for r in rows if "phase_ms" in r]
    if prof:
        names = list(prof[0]["phase_ms"])
        print("\nGPU ms per prompt by phase (CUDA events between phases; host = time to enqueue a chunk, per chunk):")
        print("| budget GiB | prompt | " + " | ".join(names) + " | GPU total | wall | host/chunk |")
        print("| --- | ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: | ---: |")
        for r in prof:
            ph = r["phase_ms"]
            gpu = max(sum(ph.values()), 1e-9)
            cells = " | ".join(f"{ph[n]:.1f} ({100 * ph[n] / gpu:.0f}%)" for n in names)
            print(f"| {r['budget']} | {r['prompt']} | {cells} | {gpu:.1f} | {1000 * r['prompt'] / r['tok_s']:.1f} "
                  f"| {r['host_ms_per_chunk']:.1f} |")
    split = [r for r in rows if "host_split_ms" in r]
    if split:
        print("\nhost ms per chunk (bench/prompt_pass.py host_split): groups = expert tables, begin = the family's "
              "inputs (qwen4exp: PLE rows taken; gather = their gather, on the worker when ahead; wait = what begin "
              "spent on them: all of the gather when not ahead), layers = enqueuing the layers (blocks when the GPU "
              "is behind), after = last layer enqueued to logits on the host:")
        print("| budget GiB | prompt | chunks | host/chunk | groups | begin | rows gather | rows wait | chunks ahead "
              "| layers | after |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in split:
            h = r["host_split_ms"]
            print(f"| {r['budget']} | {r['prompt']} | {r['chunks']} | {r['host_ms_per_chunk']:.1f} | "
                  f"{h['groups_ms']:.1f} | {h['begin_ms']:.1f} | {h['rows_gather_ms']:.1f} | {h['rows_wait_ms']:.1f} "
                  f"| {h['rows_ahead']} | {h['layers_ms']:.1f} | {h['after_ms']:.1f} |")



def host_profiled(fn, top: int, what: str):
    """fn() under cProfile; its `top` costliest functions by own time printed (stdout), its result returned."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    out = prof.runcall(fn)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print(f"\nhost profile ({what}), by own time:\n{buf.getvalue()}", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--make-recipe", help="when --model is missing, make it in this llama-quantize recipe (q4_k_m...)")
    ap.add_argument("--make-preset", default="qwen3-30b-a3b",
                    help="when --model is missing, make this tools/make_moe preset (qwen35moe-35b-a3b, "
                         "qwen3next-80b-a3b: ~48 GB at q4_k_m, give --model a path in /dev/shm)")
    ap.add_argument("--budgets", default="all,16,12", help="GiB, comma-separated; 'all' = no budget")
    ap.add_argument("--prompts", default="1024,4096,8192,32768", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--chunk", default="auto", help="--prefill-chunk: tokens or auto")
    ap.add_argument("--ring", type=int, default=None, help="--ring: slots (default: the VRAM rule)")
    ap.add_argument("--stream-min", type=int, default=1024)
    ap.add_argument("--ctx", type=int, default=None,
                    help="the context the backend is built for (default: the longest prompt + 16); its KV cache "
                         "shares the budget, so --ctx 32784 measures a 4K prompt as the 32K rows' backend runs it")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--moe-row-tiles", type=int, choices=(1, 2), default=None,
                    help="64-row tiles per dequantized weight tile in the grouped expert GEMMs (moe_gemm.cu MG_MT; "
                         "default 2)")
    ap.add_argument("--lend-floor", type=int, default=None,
                    help="the lent ring's least depth (chunk_plan.RING_LEND_FLOOR, default 64): the auto ring borrows "
                         "max(2 layers of streamed experts, this) cache slots, at most 384; 384 tries the deepest")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the per-phase GPU times (CUDA events between the phases of each chunk)")
    ap.add_argument("--resident-budget-gib", metavar="GIB|auto",
                    help="pin only this many GiB of experts in host RAM, the rest read from the model file "
                         "(engine/cuda/memory_mode.py); auto: what RAM holds beside the file (bench/host_ram.py)")
    ap.add_argument("--out", type=Path, help="the rows as JSON, rewritten as each one is measured")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="cProfile the first measured prompt of each budget and print its N costliest functions by "
                         "own time (where the host's time goes: Python, or launches blocked behind the GPU)")
    a = ap.parse_args(argv)

    import shutil
    import tempfile

    from engine.cuda import chunk_plan, prefill
    from engine.cuda.trace import ChunkFacts
    from engine.gguf_model import open_model

    if a.moe_row_tiles:
        prefill.MOE_ROW_TILES = a.moe_row_tiles
    if a.lend_floor:
        chunk_plan.RING_LEND_FLOOR = a.lend_floor
    lengths = [int(x) for x in a.prompts.split(",")]
    facts = {}
    if not a.model.is_file():
        facts["model_make_s"] = round(make_model(a.model, recipe=a.make_recipe, preset=a.make_preset), 1)
    model = open_model(a.model)
    ctx = max(max(lengths) + 16, a.ctx or 0)
    opts = dict(prefill_chunk=None if a.chunk == "auto" else int(a.chunk), ring=a.ring, stream_min=a.stream_min,
                resident_budget_gib=resident_budget(a.resident_budget_gib, model, log))
    profile = Path(tempfile.mkdtemp(prefix="bench-prefill-")) / "learned.profile"
    tracer = ChunkFacts()

    def start(budget):
        t0 = time.perf_counter()
        be = fresh_backend(model, ctx, budget, profile, tracer, calibrate=not facts.get("load_s"), **opts)
        if not facts.get("load_s"):     # the first backend's start, as the worker's
            facts.update(load_s=round(time.perf_counter() - t0, 1), ctx=ctx, **memory_facts(be),
                         kv_gib=round(be.kv.total_bytes / 2**30, 2), arena_gib=round(be.arena.nbytes / 2**30, 2),
                         pcie_copy_gbps=round(be.pcie_gbps, 1), expert_mb=round(be.layout.stride / 1e6, 2),
                         moe_row_tiles=prefill.MOE_ROW_TILES, ring_lend_floor=chunk_plan.RING_LEND_FLOOR)
            log(json.dumps(facts))
        return be

    rows = []
    rng = np.random.default_rng(a.seed)
    budgets = a.budgets.split(",")
    if budgets[0] != "all":
        # every row's cache is filled from the profile learned so far: a first row at a small budget would start
        # cold (the H200 measured 252 of 6144 experts resident at 12 GiB that way, against ~2,940 after a pass with
        # everything in VRAM), so one unmeasured warm-up with every expert resident learns it, as bench.decode does
        be = start("all")
        warm(be, rng)
        be.close()      # saves the profile
    for b in budgets:
        try:
            be = start(b)
        except MemoryError as e:
            rows.append(dict(budget=b, error=str(e)))
            log(f"budget {b}: {e}")
            continue
        warm(be, rng)
        for i, n in enumerate(lengths):
            if a.host_profile and i == 0:
                row = host_profiled(lambda: prompt_row(be, tracer, b, n, rng, profile=not a.no_profile),
                                    a.host_profile, f"budget {b}, prompt {n}")
            else:
                row = prompt_row(be, tracer, b, n, rng, profile=not a.no_profile)
            rows.append(row)
            log(json.dumps(row))
            dump(a.out, facts, rows)
        be.close()      # saves the profile the next budget starts from
    free_vram()
    shutil.rmtree(profile.parent, ignore_errors=True)
    dump(a.out, facts, rows)
    print(f"model {a.model.name}: prompt pass; link reference {LINK_BPS / 1e9:.0f} GB/s; "
          f"{json.dumps(facts)}")
    print_tables(rows)

if __name__ == "__main__":
    main()
