"""The layer split a set of GPUs would get, without the GPUs: engine/cuda/layer_split.py's plan for given cards.

    python -m bench.layer_split --model M.gguf --cards 12:25,12:25 [--ctx 4096] [--kv f16] [--split auto|N,M]
    python -m bench.layer_split --preset qwen3-next-80b --recipe q4_k_m --cards 12:25,12:25 [--trace T.json]

A card is GIB:GBPS (the VRAM the worker may take on it, its host -> device rate); the worker's own --show-split
probes real cards instead. The model's bytes come from a GGUF (memory-mapped, no weights read) or a make_moe preset
whose layers all attend (its tensor plan, nothing written); the routing from a trace (bench.routing --trace-out)
when given, else uniform. Prints the plan and, beside it, one card of all the VRAM and the fastest link.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from engine.cuda import layer_split as ls
from engine.cuda.chunk_plan import chunk_bytes


class BenchError(ValueError):
    pass


def parse_cards(text: str) -> list[ls.Card]:
    cards = []
    for i, part in enumerate(text.split(",")):
        gib, _, gbps = part.partition(":")
        try:
            g, r = float(gib), float(gbps)
        except ValueError:
            g = r = -1.0
        if not (g > 0 and r > 0):
            raise BenchError(f"--cards takes GIB:GBPS a card, comma-separated (such as 12:25,12:25); got {part!r}")
        cards.append(ls.Card(i, f"{g:g} GiB at {r:g} GB/s", int(g * ls.GiB), r))
    return cards


def counts_of(trace, n_layer: int, n_expert: int) -> np.ndarray:
    if (trace.n_layer, trace.n_expert) != (n_layer, n_expert):
        raise BenchError(f"the trace routes {trace.n_layer} layers x {trace.n_expert} experts, the model has "
                         f"{n_layer} x {n_expert}")
    counts = np.zeros((n_layer, n_expert))
    for seq in trace.sequences:
        for il in range(n_layer):
            ids = seq[:, il].reshape(-1)
            counts[il] += np.bincount(ids[ids >= 0], minlength=n_expert)
    return counts


def from_model(path: Path, ctx: int, kv: str, chunk: int, trace):
    from engine.gguf_model import open_model
    m = open_model(path)
    cfg = m.config
    use = counts_of(trace, cfg.n_layer, cfg.n_expert) if trace is not None else None
    return path.name, cfg.n_layer, ls.model_layer_costs(m, ctx, kv, use), chunk_bytes(cfg, min(chunk, ctx))


def from_preset(preset: str, recipe: str | None, ctx: int, kv: str, chunk: int, trace):
    from types import SimpleNamespace

    from tools import make_moe as mm
    from tools.recipes import Hparams, apply_recipe
    if preset not in mm.PRESETS:
        raise BenchError(f"no make_moe preset {preset!r}; one of {', '.join(sorted(mm.PRESETS))}")
    args = mm.parse_args(["--preset", preset] + (["--recipe", recipe] if recipe else []))
    s = mm.resolve_shape(args)
    if s.hybrid or s.q4exp or s.arch == "gpt-oss":
        raise BenchError(f"preset {preset} has layers that do not all attend ({s.arch}): make its file "
                         f"(tools/make_moe.py) and pass --model")
    vocab = mm.shape_vocab(s)
    n_vocab = next(len(v) for key, v, _ in vocab if key == "tokenizer.ggml.tokens")
    types = {g: getattr(args, g) for g in ("experts", "shexp", "attn", "ffn", "embd", "output", "norm")}
    specs = mm.shape_plan(s, types, n_vocab)
    if recipe:
        specs = apply_recipe(specs, recipe, Hparams(s.n_layer, s.n_head, s.n_head_kv, s.n_expert))
    cfg = SimpleNamespace(n_layer=s.n_layer, n_head_kv=s.n_head_kv, head_dim=s.head_dim, head_dim_v=s.head_dim,
                          n_swa=0, recurrent_layers=(), n_embd=s.n_embd, n_head=s.n_head, n_expert=s.n_expert,
                          n_expert_used=s.n_expert_used, n_ff_exp=s.n_ff_exp, n_ff_shexp=s.n_ff_shexp, n_ff=s.n_ff,
                          n_vocab=n_vocab, ssm_inner=0)
    use = counts_of(trace, s.n_layer, s.n_expert) if trace is not None else None
    costs = ls.layer_costs_from_tensors([(t.name, t.nbytes) for t in specs], s.n_layer, s.n_expert,
                                        s.n_expert_used, ls.layer_kv_bytes(cfg, ctx, kv), use)
    return preset + (f" {recipe}" if recipe else ""), s.n_layer, costs, chunk_bytes(cfg, min(chunk, ctx))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.layer_split", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a GGUF")
    src.add_argument("--preset", help="a make_moe preset whose layers all attend (with --recipe)")
    ap.add_argument("--recipe", help="with --preset: llama-quantize's per-layer types (make_moe's --recipe)")
    ap.add_argument("--cards", required=True, help="GIB:GBPS a card, comma-separated (such as 12:25,12:25)")
    ap.add_argument("--split", default="auto", help="auto, or layers per card such as 24,24")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--kv", choices=("f16", "int8"), default="f16")
    ap.add_argument("--chunk", type=int, default=4096, help="the prompt chunk the workspace is sized for")
    ap.add_argument("--trace", type=Path, help="a routing trace of the model (bench.routing): its counts")
    a = ap.parse_args(argv)
    from bench import routing_trace
    try:
        cards = parse_cards(a.cards)
        split = a.split if a.split == "auto" else [int(x) for x in a.split.split(",")]
        trace = routing_trace.read(a.trace) if a.trace else None
        name, n_layer, costs, work = (from_model(a.model, a.ctx, a.kv, a.chunk, trace) if a.model
                                      else from_preset(a.preset, a.recipe, a.ctx, a.kv, a.chunk, trace))
        plan = costs.plan(cards, split, work_bytes=work)
        one = ls.Card(0, "one card of all of it", sum(c.free_bytes for c in cards), max(c.link_gbps for c in cards))
        alone = costs.plan([one], work_bytes=work)
    except (BenchError, ls.SplitError, routing_trace.TraceError, ValueError) as e:
        raise SystemExit(f"bench.layer_split: {e}")
    print(f"bench.layer_split: {name}: {n_layer} layers at context {a.ctx} ({a.kv} KV), routing "
          f"{'from ' + str(a.trace) if trace is not None else 'uniform'}")
    for line in ls.format_plan(plan) + ["beside it:"] + ls.format_plan(alone):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
