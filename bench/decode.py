"""Decode speed of the CUDA engine at several VRAM budgets, with the ceilings next to each figure.

    python -m bench.decode [--model data/models/qwen3-30b-a3b-q4k-g3.gguf] [--budgets all,24,16,12,8]
                           [--prompt 512] [--new 256] [--prefetch on|off|both] [--prefetch-depth 1|2|both]
                           [--fetch-misses on|off|both] [--out bench.json]

Makes the Qwen3-30B-A3B-shaped Q4_K model with tools/make_moe.py when it is not there (timed). One process, a backend
per budget (--vram-budget-mib semantics: everything the worker takes, weights and KV included), each built after the
last one closed and gave its VRAM back, its expert cache filled from the profile the last one saved (as a restart
loads it). Per budget: a learning pass (prompt + decode, the adaptive tier running), then the measured pass on a
fresh random prompt. Ceilings: PCIe-bound = expert bytes missed per token
over 51 GB/s (the in-place read rate, docs/design.md "Measured facts"); HBM-bound = bytes touched per token over 4.4 TB/s.
With the next-layer prefetch (engine/cuda/prefetch.py): its prediction accuracy, the MB per token it copied and the
share of them wasted (never routed), and the bytes that really crossed the link (misses read in place + copies).
--prefetch both measures each budget twice, on and off; --prefetch-depth both measures each budget's prefetch-on row
at depth 1 (predict the next layer) and 2 (the one after it), with the prediction accuracy of each depth.
--fetch-misses both measures each prefetching row with the late-miss copy on and off (the routed experts the prediction
missed copied into VRAM before the layer's expert kernels, or read in place by them); "late MB/tok" is what it copied.
--adapt-measured off|both measures each row with the adaptive tier frozen during the measured pass (its swaps cross the
link too: the swaps column counts them): a backend built with adapt_every 0 after the learning pass's, filled from
the profile that pass saved.
--window K[,K...] also times verify windows of K tokens on each row's backend (engine/cuda/decode_window.py), with
each of --window-modes' kernels (tokens: the default; shared: the token-serial ones): a window step's graph replayed
beside the one-token step's graph (its cost in one-token steps: issue 34 asks <= 1.4 for K = 4
with every expert in VRAM), and windows of K random tokens through CUDABackend.decode(all_positions=True) (wall time,
the picks included): tok/s of the window beside the row's one-token tok/s.
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.arch import qwen4exp

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "data" / "models" / "qwen3-30b-a3b-q4k-g3.gguf"
PCIE_BPS = 51e9
HBM_BPS = 4.4e12


def find_vocab() -> Path:
    for cand in (ROOT.parent / "shared" / "fixtures" / "vocab", ROOT / ".fixtures" / "vocab"):
        p = cand / "ggml-vocab-qwen2.gguf"
        if p.is_file():
            return p
    raise SystemExit("bench.decode: ggml-vocab-qwen2.gguf not found in ../shared/fixtures/vocab or .fixtures/vocab")


def make_model(path: Path, n_layer: int | None = None, recipe: str | None = None, routing: str | None = None,
               preset: str = "qwen3-30b-a3b") -> float:
    """tools/make_moe's Qwen3-30B-A3B preset (or `preset`: qwen35moe-35b-a3b, qwen3next-80b-a3b) at path (n_layer:
    cut to that many layers; recipe: llama-quantize's per-layer types, e.g. q4_k_m; routing: make_moe --routing,
    else --attn-gain 3); returns the seconds taken."""
    t0 = time.perf_counter()
    # --attn-gain 3: with flat random attention every token of a prompt reaches nearly the same hidden state, so
    # routing collapses onto a few experts (the H200 measured 0.997 hits at a 12 GiB budget). Sharper attention
    # gives the per-layer curve bench/routing.py calibrates against (half the experts cached: ~70% hits), so the
    # budgets below exercise the PCIe path as a real model would.
    cmd = [sys.executable, "-m", "tools.make_moe", "--preset", preset, "--out", str(path)]
    if not preset.startswith("gpt-oss"):    # gpt-oss presets make their own harmony vocabulary
        cmd += ["--vocab", str(find_vocab())]
    cmd += ["--n-layer", str(n_layer)] if n_layer else []
    cmd += ["--routing", routing] if routing else ["--attn-gain", "3"]
    cmd += ["--recipe", recipe] if recipe else []
    print("bench.decode: making the model:", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.perf_counter() - t0


def free_vram() -> None:
    """What closed backends left in CuPy's pools goes back to the driver, so that the next backend sizes its expert
    cache from the VRAM really free (--vram-budget-mib counts the pool's bytes as used), as a fresh process would."""
    import cupy as cp
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()


def fresh_backend(model, ctx: int, budget: str, profile: Path, tracer=None, **opts):
    """A backend for one budget ('all' or GiB), built once the previous one has closed: its expert cache filled from
    the profile the previous one saved at close, its own saved there at close. opts: more CudaOptions fields."""
    from engine.cuda.backend import CUDABackend, CudaOptions
    if tracer is not None:
        # the last prompt chunk's facts hold the previous backend (its ring runner), so its VRAM could not go back
        # to the pool: the likely cause of the H200's gpt-oss-120b 24 GiB row after the 12 GiB one with
        # --prefill-prompts starting at 14,130 MiB of "weights" against 2,636 (812 slots; not yet re-measured)
        tracer.forget()
    free_vram()
    mib = None if budget == "all" else int(float(budget) * 1024)
    return CUDABackend(model, ctx, CudaOptions(vram_budget_mib=mib, expert_profile_save=str(profile),
                                               expert_profile=str(profile) if profile.is_file() else None, **opts),
                       tracer=tracer)


def resident_budget(value, model, log) -> float | None:
    """--resident-budget-gib (GiB, 'auto' or None) as CudaOptions takes it: 'auto' pins what host RAM holds beside
    the model file (bench/host_ram.py; gpt-oss-120b's file in /dev/shm and a whole arena would not both fit)."""
    from bench.host_ram import resolve
    from engine.cuda.expert_layout import blob_layout
    if value is None:
        return None
    nbytes = int(blob_layout(model).expert_strides(model.config.n_expert).sum()) if model.config.is_moe else 0
    return resolve(value, nbytes, log=log)


def memory_facts(be) -> dict:
    """Where the experts' host copies are: 'pinned' (the whole arena) or the memory mode's name and how many it
    pinned, for the bench output (a budget-mode figure reads its misses from the file, not all from pinned RAM)."""
    info = be.info()
    out = {"memory": info.get("memory", "pinned")}
    if "experts_pinned" in info:
        out["experts_pinned"] = info["experts_pinned"]
        out["arena_gib"] = round(be.arena.nbytes / 2**30, 2)
    return out


def dump(path, facts: dict, rows: list) -> None:
    """The rows so far as JSON (rewritten after each row, so a run cut short still leaves what it measured)."""
    if path:
        tmp = Path(str(path) + ".part")
        tmp.write_text(json.dumps(dict(facts=facts, rows=rows), indent=1))
        tmp.replace(path)


def touched_bytes(model, k_used: int, expert_bytes: int) -> int:
    """Weight bytes one decode step reads: every non-expert matrix once, k experts per layer, one embedding row, and
    of a hashed n-gram table (qwen4exp's PLE) the rows a token hashes to (one per PLE head), not the table: it is
    read by row from the host (a 1.3 GB table counted whole put the HBM ceiling at a few hundred tok/s)."""
    total = 0
    for name in model.tensor_names():
        t = model.tensor(name)
        if "_exps." in name:
            continue
        if name == qwen4exp.PLE_TABLE:
            total += model.config.family_params.n_ple_heads * (t.nbytes // t.shape[0])
            continue
        if name == "token_embd.weight":
            total += t.nbytes // t.shape[0]
            if not model.config.tied_embeddings:
                continue
        total += t.nbytes
    return total + model.config.n_layer * k_used * expert_bytes


def kernel_profile(step, reps: int = 20) -> dict[str, float]:
    """Microseconds per step of each kind of kernel: a graph of only that kind's launches (trace.KindFilter), replayed.
    The full step comes as 'step'; the kinds' sum exceeds it by the launch gaps the full graph overlaps."""
    from engine.cuda.trace import KindFilter
    probe = KindFilter()
    pos = at_room(step, step.last_pos + 1, reps)     # the replays' positions: inside the context
    with step.stream:
        step.enqueue(tracer=probe)      # eager: records the kinds, and leaves state as a real step would
    graphs = {"step": step.record()}
    graphs.update((kind, step.record(tracer=KindFilter(kind))) for kind in sorted(probe.seen))
    out = {}
    for kind, graph in graphs.items():
        at_room(step, pos, reps)
        out[kind] = _time_graph(step, graph, reps)
    return out


def at_room(step, pos: int, reps: int) -> int:
    """Sets the one-token step's device inputs (token 0) to the latest position <= pos from which reps + 1 replays of
    its graph stay inside the context; returns that position (nothing here counts as the backend's n_cached)."""
    pos = max(0, min(pos, step.kv.max_ctx - reps - 2))
    step.set_inputs(0, pos)
    return pos


def _time_graph(step, graph, reps: int) -> float:
    """Microseconds a replay of graph, over reps replays after one warm-up. A one-token step's graph advances its
    own position on the device at each replay (sample.cu step_advance): the caller first sets a position with
    reps + 1 rows of room (at_room), or the replays write K/V and read RoPE rows past the context (on main that
    corrupted the cache: the NaN logits of the first window after this timing)."""
    import cupy as cp
    s = step.stream
    graph.launch(s)
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(s)
    for _ in range(reps):
        graph.launch(s)
    b.record(s)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) * 1000.0 / reps


# WindowStep (dense_mode, expert_mode, attn_mode): the one-token kernels' blocks for every token; with the attention
# a launch a token; with each routed expert's gate/up read once for its tokens (the window's union); everything
# token-serial (the first H200 figures: about K one-token steps a window)
MODES = {"tokens": ("tokens", "tokens", "window"), "attn-tokens": ("tokens", "tokens", "tokens"),
         "union": ("tokens", "union", "window"), "shared": ("shared", "serial", "tokens")}


def window_rows(be, rng, sizes, n_prompt: int, modes=("tokens",), reps: int = 20) -> list[dict]:
    """Per window mode (MODES) and length K: the window graph's replay time beside the one-token graph's, and
    decode() windows of K random tokens after a prompt (wall clock). [] where the backend keeps one step a token."""
    win = be.window_step()
    if win is None or be.opts.no_graph:
        return []
    out = []
    for mode in modes:
        win.dense_mode, win.expert_mode, win.attn_mode = MODES[mode]
        win.graphs = {}
        out += [dict(mode=mode, **r) for r in _window_rows(be, win, rng, sizes, n_prompt, reps)]
    win.dense_mode, win.expert_mode, win.attn_mode = MODES["tokens"]
    win.graphs = {}
    return out


def _window_rows(be, win, rng, sizes, n_prompt: int, reps: int) -> list[dict]:
    from engine.sampling import PickSpec
    cfg, spec = be.config, PickSpec()
    out = []
    for K in sizes:
        be.truncate(0)
        be.decode(rng.integers(0, cfg.n_vocab, size=n_prompt).tolist(), spec)
        be._settle()            # (a prompt runs nothing ahead; the replays below must not meet a step that did)
        at_room(be.step, be.n_cached, reps)     # the replays at the positions after the prompt, past n_cached
        one_us = _time_graph(be.step, be.step.graphs["greedy"], reps)
        n = max(1, min(32, (be.max_context - be.n_cached - 1) // K))
        be.decode(rng.integers(0, cfg.n_vocab, size=K).tolist(), spec, all_positions=True)    # captures K's graph
        t0 = time.perf_counter()
        for _ in range(n - 1):
            be.decode(rng.integers(0, cfg.n_vocab, size=K).tolist(), spec, all_positions=True)
        dt = (time.perf_counter() - t0) / max(n - 1, 1)
        graph = (win.graphs.get(K) or win.graphs.setdefault(K, win.record(K))) if K <= win.max_t else None
        if graph is not None:       # replays of the window at the last window's place (K = 1: none ran; the prompt's)
            win.params.view[1] = min(be.n_cached, be.max_context - K)
        graph_us = _time_graph(win, graph, reps) if graph is not None else None
        out.append(dict(window=K, windows=n - 1, window_ms=round(dt * 1e3, 3), window_tok_s=round(K / dt, 1),
                        window_graph_us=None if graph_us is None else round(graph_us, 1),
                        one_token_graph_us=round(one_us, 1),
                        cost_in_steps=None if graph_us is None else round(graph_us / one_us, 3)))
    return out


# The sampled row's settings: a typical chat request (the GPU sampler's top_k/top_p passes are its costliest path).
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 7}


def run_pass(be, rng, n_prompt: int, n_new: int, params=None):
    from engine.sampling import Sampler
    cfg = be.config
    be.truncate(0)
    prompt = rng.integers(0, cfg.n_vocab, size=n_prompt).tolist()
    s = Sampler(params or {})      # no penalty history: the rows' settings have no penalties

    def pick(toks):
        tok = be.decode(toks, s.spec())[0].id
        s.advance()
        return tok
    t0 = time.perf_counter()
    tok = pick(prompt)
    t1 = time.perf_counter()
    be.reset_stats()
    for _ in range(n_new - 1):
        tok = pick([tok])
    t2 = time.perf_counter()
    st = be.get_stats()
    return dict(prompt_s=t1 - t0, decode_s=t2 - t1, steps=n_new - 1, hits=st.hits, lookups=st.lookups,
                file_mb=st.file_mb, prefetch=be.prefetch_stats())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--make-recipe", help="when --model is missing, make it in this llama-quantize recipe (q4_k_m...)")
    ap.add_argument("--make-preset", default="qwen3-30b-a3b",
                    help="when --model is missing, make this tools/make_moe preset (qwen35moe-35b-a3b, "
                         "qwen3next-80b-a3b: ~48 GB at q4_k_m, give --model a path in /dev/shm)")
    ap.add_argument("--make-routing", choices=("trained", "spread"),
                    help="when --model is missing, make it with make_moe --routing (default: --attn-gain 3)")
    ap.add_argument("--budgets", default="all,24,16,12,8", help="GiB, comma-separated; 'all' = no budget")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--adapt-every", type=int, default=32)
    ap.add_argument("--adapt-measured", choices=("on", "off", "both"), default="on",
                    help="the adaptive tier during the measured pass (off: the cache stays as the learning pass left "
                         "it; both: each row twice)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prefetch", choices=("on", "off", "both"), default=None,
                    help="next-layer expert prefetch (default: the engine's default); both: each budget on and off")
    ap.add_argument("--prefetch-depth", choices=("1", "2", "both"), default=None,
                    help="prefetch depth (default: the engine's default); both: each prefetching budget at 1 and 2")
    ap.add_argument("--fetch-misses", choices=("on", "off", "both"), default=None,
                    help="late-miss copy (default: the engine's default); both: each prefetching row on and off")
    ap.add_argument("--pipeline", choices=("on", "off", "both"), default=None,
                    help="the pipelined decode (engine/cuda/pipeline.py; default: the engine's default); both: each "
                         "row on and off")
    ap.add_argument("--out", type=Path, help="the rows as JSON, rewritten as each one is measured")
    ap.add_argument("--resident-budget-gib", metavar="GIB|auto",
                    help="pin only this many GiB of experts in host RAM, the rest read from the model file "
                         "(engine/cuda/memory_mode.py); auto: what RAM holds beside the file (bench/host_ram.py)")
    ap.add_argument("--prefill-prompts", default="",
                    help="also time prompts of these lengths (comma-separated) on each budget's backend after its "
                         "decode rows, as bench.prefill does (one backend a budget serves both benches)")
    ap.add_argument("--prefill-out", type=Path, help="those prompt rows as bench.prefill --out writes them")
    ap.add_argument("--learn", action=argparse.BooleanOptionalAction, default=True,
                    help="when the first budget is not 'all': one unmeasured pass with every expert in VRAM first, "
                         "whose profile fills the first budget's cache (default on)")
    ap.add_argument("--sampled", action=argparse.BooleanOptionalAction, default=True,
                    help="also time a sampled pass (temperature/top_k/top_p/min_p, seeded) at the first budget")
    ap.add_argument("--window", default="", metavar="K[,K...]",
                    help="also time verify windows of these lengths (1-8) on each row's backend")
    ap.add_argument("--window-modes", default="tokens,shared",
                    help="the window kernels to time (MODES): tokens (the one-token kernels' blocks for every token "
                         "side by side, the default), attn-tokens (its attention a launch a token), union (the "
                         "routed experts' union, each read once), shared (each weight row loaded once a warp)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="time each kind of kernel in the step graph (default on)")
    a = ap.parse_args(argv)

    import cupy as cp
    from engine.cuda.backend import CudaOptions
    from engine.gguf_model import open_model

    facts = {}
    if not a.model.is_file():
        facts["model_make_s"] = round(make_model(a.model, recipe=a.make_recipe, routing=a.make_routing,
                                                       preset=a.make_preset), 1)
    model = open_model(a.model)
    lengths = [int(x) for x in a.prefill_prompts.split(",") if x.strip()]
    windows = [int(x) for x in a.window.split(",") if x.strip()]
    if any(not 1 <= k <= 8 for k in windows):
        ap.error(f"--window takes lengths of 1 to 8 tokens, got {a.window!r}")
    # the windows' rows: up to 32 windows of each length after the prompt (and the graph replays' 21 rows)
    ctx = max(a.prompt + a.new, a.prompt + 32 * max(windows, default=0), max(lengths, default=0)) + 16
    log = lambda m: print(f"bench.decode: {m}", file=sys.stderr, flush=True)
    memory = resident_budget(a.resident_budget_gib, model, log)
    tracer = None
    if lengths:
        from engine.cuda.trace import ChunkFacts
        tracer = ChunkFacts()
    pre_facts, pre_rows = {"ctx": ctx, "with": "bench.decode --prefill-prompts (the decode rows' backends)"}, []
    # each flag's values as CudaOptions takes them (None: the option's default)
    on_off = {"on": True, "off": False, None: None}
    default = CudaOptions()
    modes = [True, False] if a.prefetch == "both" else [on_off[a.prefetch]]
    depths = [1, 2] if a.prefetch_depth == "both" else [int(a.prefetch_depth or default.prefetch_depth)]
    fetches = [True, False] if a.fetch_misses == "both" else [on_off[a.fetch_misses]]
    fetches = [default.fetch_misses if f is None else f for f in fetches]
    pipes = [True, False] if a.pipeline == "both" else [on_off[a.pipeline]]
    pipes = [default.pipeline if p is None else p for p in pipes]
    budgets = a.budgets.split(",")
    rows = []
    rng = np.random.default_rng(a.seed)
    profile = Path(tempfile.mkdtemp(prefix="bench-decode-")) / "learned.profile"

    def start(budget, **opts):
        t0 = time.perf_counter()
        be = fresh_backend(model, ctx, budget, profile, tracer, calibrate=not facts.get("load_s"),
                           resident_budget_gib=memory, **opts)
        if not facts.get("load_s"):     # the first backend's start, as the worker's
            facts["load_s"] = round(time.perf_counter() - t0, 1)
            facts["ctx"] = ctx
            facts.update(memory_facts(be))
            facts["arena_gib"] = round(be.arena.nbytes / 2**30, 2)
            facts["arena_fill_gib_s"] = round(be.arena.nbytes / 2**30 / be.arena.fill_seconds, 1)
            facts["pcie_copy_gbps"] = round(be.pcie_gbps, 1)
            facts["blob"] = int(np.mean([ly.nbytes for ly in be.layout.layers]))   # a recipe's layers differ
            facts["touched_mb_per_token"] = round(touched_bytes(model, model.config.n_expert_used,
                                                                facts["blob"]) / 1e6, 1)
            print(f"bench.decode: {json.dumps(facts)}", file=sys.stderr, flush=True)
        return be

    if budgets[0] != "all" and a.learn:
        # Every row's cache is filled from the profile learned so far; a first row at a small budget would start
        # cold (the H200 measured 0.32 hits at 12 GiB that way, against 0.84 after a learning pass with everything
        # resident): one unmeasured pass with every expert in VRAM learns it, as the default budget list does.
        be = start("all", adapt_every=a.adapt_every)
        run_pass(be, rng, a.prompt, a.new)
        be.close()      # saves the profile
    # everything resident never prefetches: one row for it; prefetch off: one row whatever the depth and late copy
    adapts = ["on", "off"] if a.adapt_measured == "both" else [a.adapt_measured]
    runs = [(b, mode, d, f, ad, pipe) for b in budgets for mode in (modes[:1] if b == "all" else modes)
            for d in (depths[:1] if b == "all" or mode is False else depths)
            for f in (fetches[:1] if b == "all" or mode is False else fetches)
            for ad in (adapts[:1] if b == "all" else adapts) for pipe in pipes]
    for b, mode, depth, fetch, adapt, pipe in runs:
        row_opts = dict(prefetch=mode, prefetch_depth=depth, fetch_misses=fetch, pipeline=pipe)
        be = start(b, adapt_every=a.adapt_every, **row_opts)
        blob = facts["blob"]
        touched = touched_bytes(model, model.config.n_expert_used, blob)
        learn = run_pass(be, rng, a.prompt, a.new)
        if adapt == "off":      # the tier frozen: a backend that starts where the learning pass left the cache
            be.close()
            be = start(b, adapt_every=0, **row_opts)
        slots = be.cache.n_slots
        used_mib = cp.get_default_memory_pool().total_bytes() / 2**20
        swaps0 = be.cache.swaps
        m = run_pass(be, rng, a.prompt, a.new)
        tps = m["steps"] / m["decode_s"]
        hit = m["hits"] / max(m["lookups"], 1)
        miss_bytes = (m["lookups"] - m["hits"]) * blob / m["steps"]
        pcie_ceiling = PCIE_BPS / miss_bytes if miss_bytes else float("inf")
        ps = m["prefetch"]
        pre = ps.summary(blob, m["steps"]) if ps else dict(pred_accuracy=None, pred_accuracy_2=None,
                                                          prefetch_mb_per_token=0.0, prefetch_wasted=None,
                                                          late_mb_per_token=0.0)
        # what crossed the link: misses not served from a prefetched copy (read in place, or copied late: the same
        # bytes), plus every prefetch copy
        link_bytes = miss_bytes + ((ps.staged - ps.used) * blob / m["steps"] if ps else 0.0)
        hbm_ceiling = HBM_BPS / touched
        rows.append(dict(budget=b, slots=slots, experts_total=be.cache.n_total, vram_used_mib=round(used_mib),
                         tok_s=round(tps, 1), hit_rate=round(hit, 4), learn_hit_rate=round(
                             learn["hits"] / max(learn["lookups"], 1), 4),
                         pcie_mb_per_token=round(miss_bytes / 1e6, 2), pcie_gbps=round(miss_bytes * tps / 1e9, 1),
                         pcie_ceiling_tok_s=round(pcie_ceiling, 1), hbm_ceiling_tok_s=round(hbm_ceiling, 1),
                         of_pcie_ceiling=round(tps / pcie_ceiling, 3), of_hbm_ceiling=round(tps / hbm_ceiling, 3),
                         prompt_tok_s=round(a.prompt / m["prompt_s"], 1), adapt=adapt,
                         pipeline="on" if be.pipelined else "off",
                         swaps=be.cache.swaps - swaps0,
                         prefetch="on" if ps else "off", prefetch_depth=be.step.prefetch.depth if ps else None,
                         fetch_misses=("on" if be.step.prefetch.fetch_misses else "off") if ps else None,
                         **pre, link_mb_per_token=round(link_bytes / 1e6, 2),
                         link_gbps=round(link_bytes * tps / 1e9, 1)))
        if b == budgets[0] and a.sampled:
            smp = run_pass(be, rng, a.prompt, a.new, SAMPLED)
            rows[-1]["sampled_tok_s"] = round(smp["steps"] / smp["decode_s"], 1)
        if a.profile:
            be._settle()        # no step left running ahead under the profile's replays
            rows[-1]["profile_us"] = {k: round(v, 1) for k, v in kernel_profile(be.step).items()}
        if windows:
            rows[-1]["windows"] = window_rows(be, rng, windows, a.prompt, a.window_modes.split(","))
        rows[-1].update(memory_facts(be))
        if be.mem is not None:      # the memory modes: what decode read from the model file (not pinned RAM)
            rows[-1]["file_mb_per_token"] = round(m["file_mb"] * 2**20 / 1e6 / m["steps"], 2)
        print(f"bench.decode: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
        dump(a.out, facts, rows)
        if lengths and b not in {r["budget"] for r in pre_rows}:    # warmed by the two decode passes
            from bench.prompt_pass import prompt_row
            for n in lengths:
                pre_rows.append(prompt_row(be, tracer, b, n, rng, profile=False))
                print(f"bench.decode: prompt {json.dumps(pre_rows[-1])}", file=sys.stderr, flush=True)
                dump(a.prefill_out, {**facts, **pre_facts}, pre_rows)
        be.close()      # saves the profile the next row starts from
    free_vram()
    shutil.rmtree(profile.parent, ignore_errors=True)
    dump(a.out, facts, rows)
    print(f"model {a.model.name}: prompt {a.prompt}, {a.new} new tokens, ceilings PCIe {PCIE_BPS / 1e9:.0f} GB/s, "
          f"HBM {HBM_BPS / 1e12:.1f} TB/s; {json.dumps(facts)}")
    print("| budget GiB | prefetch | depth | late copy | adapt (swaps) | pipeline | slots | hit rate | tok/s | PCIe MB/tok "
          "| PCIe GB/s | PCIe ceiling | of it | HBM ceiling | of it | prompt tok/s | acc d1 | acc d2 | prefetch MB/tok "
          "| wasted | late MB/tok | link MB/tok | link GB/s |")
    print("| --- | --- | --- | --- | --- | --- |" + " ---: |" * 17)
    opt = lambda v, f: "-" if v is None else format(v, f)
    for r in rows:
        print(f"| {r['budget']} | {r['prefetch']} | {r['prefetch_depth'] or '-'} | {r['fetch_misses'] or '-'} | "
              f"{r['adapt']} ({r['swaps']}) | {r['pipeline']} | "
              f"{r['slots']}/{r['experts_total']} | "
              f"{r['hit_rate']:.3f} | "
              f"{r['tok_s']:.1f} | {r['pcie_mb_per_token']:.1f} | {r['pcie_gbps']:.1f} | "
              f"{r['pcie_ceiling_tok_s']:.0f} | {r['of_pcie_ceiling']:.2f} | {r['hbm_ceiling_tok_s']:.0f} | "
              f"{r['of_hbm_ceiling']:.2f} | {r['prompt_tok_s']:.0f} | {opt(r['pred_accuracy'], '.3f')} | "
              f"{opt(r['pred_accuracy_2'], '.3f')} | "
              f"{r['prefetch_mb_per_token']:.1f} | {opt(r['prefetch_wasted'], '.2f')} | "
              f"{r['late_mb_per_token']:.1f} | {r['link_mb_per_token']:.1f} | {r['link_gbps']:.1f} |")
    for r in rows:
        if "sampled_tok_s" in r:
            print(f"\nsampled decode ({', '.join(f'{k} {v}' for k, v in SAMPLED.items())}) at budget {r['budget']}: "
                  f"{r['sampled_tok_s']:.1f} tok/s (greedy {r['tok_s']:.1f})")
    wins = [(r, w) for r in rows for w in r.get("windows", [])]
    if windows:
        print("\nverify windows (decode_window.py): graph replay beside the one-token step's, and decode() windows "
              "of random tokens (wall clock, picks included)")
        print("| budget | kernels | K | window graph us | one-token graph us | cost (one-token steps) | window tok/s "
              "| one-token tok/s |")
        print("| --- | --- |" + " ---: |" * 6)
        for r, w in wins:
            print(f"| {r['budget']} | {w['mode']} | {w['window']} | {opt(w['window_graph_us'], '.1f')} | "
                  f"{w['one_token_graph_us']:.1f} | {opt(w['cost_in_steps'], '.3f')} | {w['window_tok_s']:.1f} | "
                  f"{r['tok_s']:.1f} |")
        for r in rows:
            if not r.get("windows"):
                print(f"| {r['budget']} | - | - | windows run one step a token here (the backend's log says why) |")
    prof = [r for r in rows if "profile_us" in r]
    if prof:
        kinds = list(dict.fromkeys(k for r in prof for k in r["profile_us"]))
        print("\nmicroseconds per decode step by kind of kernel (a graph of only that kind, replayed)")
        label = lambda r: (f"{r['budget']} {r['prefetch']}{'' if r['prefetch_depth'] in (None, 1) else ' d2'}"
                           f"{' late off' if r['fetch_misses'] == 'off' else ''}")
        print("| kind | " + " | ".join(label(r) for r in prof) + " |")
        print("| --- |" + " ---: |" * len(prof))
        for k in kinds:
            print(f"| {k} | " + " | ".join(f"{r['profile_us'].get(k, 0):.0f}" for r in prof) + " |")


if __name__ == "__main__":
    main()
