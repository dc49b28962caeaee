"""How skewed a MoE model's routing is: the hit rate of a frequency-ranked expert cache per layer, on the CPU.

    python -m bench.routing --preset qwen3-30b-a3b [--seed 0] [--zipf-s S]   # routers made in memory, no file
    python -m bench.routing --model data/models/qwen3-30b-a3b-q4k.gguf       # routers read from a GGUF
    python -m bench.routing --model small.gguf --forward                     # the model's own hidden states
    python -m bench.routing --model 48-layers-8-experts.gguf --forward --route-preset qwen3-30b-a3b
    python -m bench.routing --model small.gguf --forward --trace-out trace.json     # + the routing, for bench.plan

The router input is the layer's RMS-normed hidden state. By default it is random (a unit-RMS Gaussian times the
layer's ffn_norm weight, optionally with a direction shared by each prompt's tokens: --common); --forward runs the
NumPy engine on prompts of random tokens and takes the real router inputs (minutes for 48 layers at hidden 2048, so
a model with few experts, whose hidden states are routed through a preset's 128-expert routers: --route-preset).
Half the prompts rank each layer's experts by how often they are routed to, the other half is measured against
caches that hold the top 25/41/50/67/100% of them (--fractions), which is what a profile-started VRAM tier does
(docs/design.md "Decode"); the second table learns and measures within each prompt, as the engine's adaptive tier
follows one conversation; its LRU row serves each prompt's second half from an LRU cache warmed on the first.
The global row ranks (layer, expert) pairs across all layers together, as one cache budget for the model does.

TARGET is the curve a trained MoE's routing gives (see its comment); the benchmark model should land near it so that
a VRAM budget below the model's size really exercises the PCIe path.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import numpy as np

FRACTIONS = (0.25, 0.41, 0.50, 0.67, 1.0)

# Hit rate of a per-layer frequency-ranked cache holding a fraction of each layer's experts, for a trained MoE with
# a load-balancing loss (Qwen3-30B-A3B: 128 experts, top 8). No published per-layer frequency curve for
# Qwen3-30B-A3B was found; the measurements there are of other caches and models, and they bracket it:
# - a 512-expert Qwen (300 tokens of real text): layer 0's 64 hottest experts (12.5%) carry 41% of its routings;
#   LRU hit 43.5/62.0/72.0/78.9/85.0% at 18/36/54/73/100% of the experts (github.com/kekzl/imp/pull/2061);
# - DeepSeek-V4-Flash (256 experts): 240-248 experts per layer live in a serving window; a frequency oracle's
#   curve is nearly linear, 40/46/52% at 500/700/900 slots (github.com/FlashML-org/FreeToken/issues/174);
# - Qwen3-30B-A3B, LRU over 256 decode tokens of a synthetic prompt: 36.6/74.1/89.4/96.2% with 24/73/146/244
#   slots per layer (8/24/49/81 experts if a slot is one matrix, as we read it), mostly reuse between
#   consecutive tokens, not popularity (github.com/kekzl/imp/pull/1374).
# We take a documented, conservative middle: half the experts catch 70% of the routings, on a smooth concave curve
# through (0, 0) and (1, 1). An assumption, not a measurement of Qwen3-30B-A3B: replace it with a real trace.
TARGET = {0.25: 0.45, 0.41: 0.61, 0.50: 0.70, 0.67: 0.83, 1.0: 1.0}
BAND = 0.06     # how far a generated model's mean curve may sit from TARGET at any fraction


def target_at(f: float) -> float:
    """TARGET between its points (straight lines, through (0, 0))."""
    xs = [0.0, *TARGET]
    return float(np.interp(f, xs, [0.0, *TARGET.values()]))


def cached_fractions(n_expert: int, fractions=FRACTIONS) -> np.ndarray:
    """The fractions a cache of whole experts really holds (8 experts: 25/38/50/63/100%)."""
    return np.array([round(f * n_expert) / n_expert for f in fractions])


def topk_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The k largest logits' expert ids per row (softmax is monotonic: the same set the engine's route picks)."""
    return np.argpartition(-logits, k - 1, axis=1)[:, :k]


def hit_curve(learn: np.ndarray, measure: np.ndarray, n_expert: int,
              fractions=FRACTIONS) -> np.ndarray:
    """Hit rate on `measure` (T, k) of caches holding the experts most routed to in `learn`, one per fraction."""
    return global_curve([learn], [measure], n_expert, fractions)


def global_curve(learn: list[np.ndarray], measure: list[np.ndarray], n_expert: int,
                 fractions=FRACTIONS) -> np.ndarray:
    """As hit_curve, one cache for all layers: (layer, expert) pairs ranked together."""
    n = len(learn) * n_expert
    counts = np.concatenate([np.bincount(a.ravel(), minlength=n_expert) for a in learn])
    # ties broken by (layer, expert) id, so the result is deterministic
    order = np.lexsort((np.arange(n), -counts))
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n)
    r = np.concatenate([rank[il * n_expert + m.ravel()] for il, m in enumerate(measure)])
    return np.array([np.mean(r < round(f * n)) for f in fractions])


# --- routing over time ------------------------------------------------------------------------------------------

# How a trained MoE's routing moves from token to token, from published Qwen3-30B-A3B decode traces (128 experts,
# top 8): ~45% of a token's experts were also the previous token's (chance: 8/128 = 6%), ~80% were used within the
# previous 8 tokens, and an LRU cache holding 40% of each layer's experts hits 90-95%. TEMPORAL_TARGET holds the
# middle of each; make_moe's --routing trained is calibrated, per arch, to land near it (docs/experiments.md).
TEMPORAL_TARGET = {"repeat_next": 0.45, "within_8": 0.80, "lru_40": 0.925}
LRU_FRACTION = 0.40
WINDOW = 8


def lru_hits(ids: np.ndarray, capacity: int, warm: int = 0) -> float:
    """Hit rate of an LRU cache of `capacity` experts serving one sequence's routings ids (T, k), cold start; the
    first `warm` tokens only fill it (their hits are not counted)."""
    cache: dict[int, None] = {}
    hits = 0
    for t, row in enumerate(ids):
        for e in row.tolist():
            if e in cache:
                hits += t >= warm
                del cache[e]
            elif len(cache) >= capacity:
                del cache[next(iter(cache))]
            cache[e] = None
    return hits / ids[warm:].size


def temporal_stats(ids: np.ndarray, n_expert: int, window: int = WINDOW,
                   lru_fraction: float = LRU_FRACTION) -> dict[str, float]:
    """One sequence in one layer, ids (T, k): the share of each token's experts that the previous token used,
    that any of the previous `window` tokens used, and an LRU cache's hit rate at lru_fraction of the experts."""
    T, k = ids.shape
    used = np.zeros((T, n_expert), bool)
    used[np.arange(T)[:, None], ids] = True
    prev = np.mean(used[1:][np.arange(T - 1)[:, None], ids[1:]] & used[:-1][np.arange(T - 1)[:, None], ids[1:]])
    seen = np.zeros((T, n_expert), bool)   # seen[t]: used by any of tokens t-window .. t-1
    for lag in range(1, window + 1):
        seen[lag:] |= used[:-lag]
    within = np.mean(seen[np.arange(window, T)[:, None], ids[window:]])
    return {"repeat_next": float(prev), f"within_{window}": float(within),
            f"lru_{round(lru_fraction * 100)}": lru_hits(ids, max(1, round(lru_fraction * n_expert)))}


def route(router, x: np.ndarray, k: int) -> np.ndarray:
    """The top k expert ids of router inputs x (..., n_embd) -> (n, k); router is (weight, norm weight, bias)."""
    w, _, b = router
    return topk_ids(x.reshape(-1, x.shape[-1]) @ w.T + b, k)


def temporal_table(routers, k: int, prompts: list[np.ndarray]) -> dict[str, float]:
    """temporal_stats averaged over layers and prompts (each prompt one sequence, tokens in order)."""
    n_expert = routers[0][0].shape[0]
    acc: dict[str, list[float]] = {}
    for r, x in zip(routers, prompts):
        for p in x:
            for key, v in temporal_stats(route(r, p, k), n_expert).items():
                acc.setdefault(key, []).append(v)
    return {key: float(np.mean(v)) for key, v in acc.items()}


# --- where the routers come from ---------------------------------------------------------------------------------

def _ffn_norm(arch: str) -> str:
    """The norm before a layer's experts, as the family's forward names it (gpt-oss's is post_attention_norm)."""
    from engine.arch import family
    return family(arch, True).MODEL.ffn_norm


def preset_routers(shape, seed: int, **router_args) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(router (n_expert, n_embd), FFN norm weight (n_embd,), router bias (n_expert,): gpt-oss's, else zeros) per
    layer, made exactly as make_moe writes them."""
    from gguf import GGMLQuantizationType as Q
    from tools import gptoss_plan
    from tools import make_moe as mm
    types_ = {g: Q.F32 for g in ("experts", "shexp", "attn", "ffn", "embd", "output", "norm")}
    # the vocabulary size changes no tensor's index
    specs = gptoss_plan.plan(shape, types_, 1, mm.TensorSpec) if shape.arch == "gpt-oss" else mm.plan(shape, types_, 1)
    wanted = {"ffn_gate_inp.weight": 0, _ffn_norm(shape.arch): 1, "ffn_gate_inp.bias": 2}
    out = {}
    for i, t in enumerate(specs):
        part = wanted.get(t.name.split(".", 2)[-1]) if t.layer >= 0 else None
        if part is not None:
            raw = mm.tensor_bytes(t, i, shape, seed, **router_args)
            out.setdefault(t.layer, {})[part] = raw.view("<f4").reshape(t.shape).astype(np.float32)
    return [(o[0], o[1], o.get(2, np.zeros(shape.n_expert, np.float32))) for _, o in sorted(out.items())]


def file_routers(model) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    cfg, norm = model.config, _ffn_norm(model.config.arch)
    return [(model.dequant(f"blk.{il}.ffn_gate_inp.weight"), model.dequant(f"blk.{il}.{norm}"),
             model.dequant(f"blk.{il}.ffn_gate_inp.bias") if model.has(f"blk.{il}.ffn_gate_inp.bias")
             else np.zeros(cfg.n_expert, np.float32))
            for il in range(cfg.n_layer)]


def random_inputs(rng: np.random.Generator, n: int, norm_w: np.ndarray, common: float = 0.0) -> np.ndarray:
    """n RMS-normed hidden states: unit-RMS rows times the norm weight, as rms_norm(x, w) gives.

    common: the share of each row's energy in one random direction shared by all n rows (one prompt's worth), as
    a random-weight model's deep layers have (their attention averages the context into every token)."""
    x = rng.standard_normal((n, norm_w.shape[0]), dtype=np.float32)
    if common:
        mu = rng.standard_normal(norm_w.shape[0], dtype=np.float32)
        x = np.float32(np.sqrt(1 - common)) * x + np.float32(np.sqrt(common)) * mu
    x /= np.sqrt(np.mean(x * x, axis=1, keepdims=True))
    return x * norm_w


class Sharpened:
    """A model whose attention scores are attn_gain^2 times the file's: what make_moe --attn-gain G writes (q and
    k, or their norms, times G; RoPE is linear), as the attention scale of the config the forward reads."""

    def __init__(self, model, attn_gain: float):
        cfg = model.config
        scale = (cfg.attn_scale or 1.0 / math.sqrt(cfg.head_dim)) * attn_gain * attn_gain
        self.config = dataclasses.replace(cfg, attn_scale=scale)
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)


def forward_inputs(model, n_prompts: int, prompt_len: int, seed: int, attn_gain: float = 1.0) -> list[np.ndarray]:
    """Every layer's router inputs, (n_prompts, prompt_len, n_embd), for prompts of random tokens: the CPU engine.

    attn_gain multiplies q and k as make_moe --attn-gain does (on top of the file's own), so that one file
    serves to calibrate it."""
    from engine.arch.base import Observer
    from engine.backend_cpu import CPUBackend

    class FfnInputs(Observer):
        def __init__(self):
            self.rows: dict[int, list[np.ndarray]] = {}

        def ffn_input(self, il, x):
            self.rows.setdefault(il, []).append(np.array(x, np.float32))

    obs = FfnInputs()
    be = CPUBackend(Sharpened(model, attn_gain) if attn_gain != 1.0 else model, prompt_len, chunk=prompt_len,
                    warm=False, observer=obs)
    rec = obs.rows
    rng = np.random.default_rng(seed)
    for _ in range(n_prompts):
        be.truncate(0)
        be.forward(rng.integers(0, model.config.n_vocab, size=prompt_len).tolist())
    be.close()
    return [np.stack(rec[il]) for il in sorted(rec)]


def shared_energy(x: np.ndarray) -> float:
    """The share of router inputs' energy in their prompt's mean, x (n_prompts, prompt_len, n_embd): ~0 for
    tokens that differ, 1 when every token of a prompt has the same hidden state (and so the same experts)."""
    m = x.mean(axis=1)
    return float(np.mean(np.sum(m * m, axis=-1) / np.mean(np.sum(x * x, axis=-1), axis=-1)))


def random_prompts(routers, n_prompts: int, prompt_len: int, common: float, seed: int) -> list[np.ndarray]:
    """random_inputs for every layer, (n_prompts, prompt_len, n_embd), one shared direction per prompt and layer."""
    rng = np.random.default_rng(seed)
    return [np.stack([random_inputs(rng, prompt_len, norm_w, common) for _ in range(n_prompts)])
            for _, norm_w, _ in routers]


# --- the report --------------------------------------------------------------------------------------------------

def curves(routers, k: int, prompts: list[np.ndarray], fractions=FRACTIONS) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer curves (n_layer, len(fractions)) and the global one, the ranking learnt on the first half of the
    prompts and measured on the other half: a cache made from one workload's profile, serving another's."""
    learn, measure = [], []
    for r, x in zip(routers, prompts):
        half = max(1, len(x) // 2)
        ids = route(r, x, k).reshape(len(x), -1, k)
        learn.append(ids[:half].reshape(-1, k))
        measure.append(ids[half:].reshape(-1, k))
    n_expert = routers[0][0].shape[0]
    per_layer = np.array([hit_curve(a, b, n_expert, fractions) for a, b in zip(learn, measure)])
    return per_layer, global_curve(learn, measure, n_expert, fractions)


def prompt_curves(routers, k: int, prompts: list[np.ndarray], fractions=FRACTIONS) -> np.ndarray:
    """Per-layer curves learnt and measured within each prompt (its first half, then its second), averaged over
    the prompts: what an adaptive cache that follows one conversation sees (the engine's, docs/design.md "Decode")."""
    n_expert = routers[0][0].shape[0]
    out = np.zeros((len(routers), len(fractions)))
    for il, (r, x) in enumerate(zip(routers, prompts)):
        half = x.shape[1] // 2
        for p in x:
            ids = route(r, p, k)
            out[il] += hit_curve(ids[:half], ids[half:], n_expert, fractions)
    return out / len(prompts[0])


def lru_curve(routers, k: int, prompts: list[np.ndarray], fractions=FRACTIONS) -> np.ndarray:
    """Per layer, an LRU cache of each fraction of the layer's experts warmed on each prompt's first half and
    measured on its second, averaged over the prompts: a cache that follows only the most recent routing."""
    n_expert = routers[0][0].shape[0]
    caps = [max(1, round(f * n_expert)) for f in fractions]
    out = np.zeros((len(routers), len(fractions)))
    for il, (r, x) in enumerate(zip(routers, prompts)):
        for p in x:
            ids = route(r, p, k)
            out[il] += [lru_hits(ids, c, len(ids) // 2) for c in caps]
    return out / len(prompts[0])


def table(per_layer: np.ndarray, glob: np.ndarray | None, all_layers: bool, n_expert: int,
          fractions=FRACTIONS, extra: dict[str, np.ndarray] | None = None) -> str:
    held = cached_fractions(n_expert, fractions)
    head = "| layer | " + " | ".join(f"{f:.1%}" for f in held) + " |"
    lines = [head, "|" + " --- |" * (len(fractions) + 1)]
    row = lambda name, v: f"| {name} | " + " | ".join(f"{x:.3f}" for x in v) + " |"
    if all_layers:
        lines += [row(str(il), v) for il, v in enumerate(per_layer)]
    lines += [row("mean", per_layer.mean(0)), row("min", per_layer.min(0)), row("max", per_layer.max(0))]
    if glob is not None:
        lines.append(row("global", glob))
    lines += [row(name, v) for name, v in (extra or {}).items()]
    lines.append(row("TARGET", [target_at(f) for f in held]))
    return "\n".join(lines)


def off_target(curve: np.ndarray, n_expert: int, fractions=FRACTIONS) -> float:
    """The largest distance of a curve from TARGET, at the fractions the cache really holds."""
    return float(np.max(np.abs(curve - np.array([target_at(f) for f in cached_fractions(n_expert, fractions)]))))


def _fractions(text: str) -> tuple[float, ...]:
    try:
        fs = tuple(sorted({float(f) for f in text.split(",")}))
    except ValueError:
        fs = ()
    if not fs or not all(0 < f <= 1 for f in fs):
        raise argparse.ArgumentTypeError(f"{text!r}: give fractions of the experts in (0, 1], e.g. 0.15,0.35,1")
    return fs


def _preset_routers(mm, name: str, n_layer: int | None, seed: int, zipf_s: float | None):
    from dataclasses import replace
    preset = mm.PRESETS[name]
    shape = preset.shape if not n_layer else replace(preset.shape, n_layer=n_layer)
    s = preset.zipf_s if zipf_s is None else zipf_s
    return preset_routers(shape, seed, zipf_s=s), shape.n_expert_used, f"preset {name} (zipf-s {s})"


def main(argv: list[str] | None = None) -> int:
    from tools import make_moe as mm
    ap = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(mm.PRESETS), help="make the routers in memory as make_moe would")
    src.add_argument("--model", type=Path, help="read the routers from this GGUF")
    ap.add_argument("--n-layer", type=int, help="with --preset: only the first N layers")
    ap.add_argument("--seed", type=int, default=0, help="make_moe's --seed for --preset/--route-preset")
    ap.add_argument("--zipf-s", type=float, help="make_moe's --zipf-s for --preset/--route-preset "
                                                 "(default: the preset's)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts: the ranking is learnt on half of them")
    ap.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt")
    ap.add_argument("--common", type=float, default=0.0, metavar="RHO",
                    help="random inputs whose tokens share RHO of their energy in one direction per prompt (a "
                         "random-weight model's deep layers: ~0.67 with Q4_K weights)")
    ap.add_argument("--forward", action="store_true",
                    help="with --model: the model's own router inputs for prompts of random tokens (CPU forward; "
                         "minutes for 48 layers at hidden 2048)")
    ap.add_argument("--route-preset", choices=sorted(mm.PRESETS),
                    help="with --forward: route the model's hidden states through this preset's routers instead "
                         "of its own (a few-expert model of the same width stands in for a 16 GB one)")
    ap.add_argument("--attn-gain", type=float, default=1.0, metavar="G",
                    help="with --forward: multiply the model's q and k by G first, as make_moe --attn-gain does "
                         "(calibrate the gain on one file)")
    ap.add_argument("--fractions", type=_fractions, default=FRACTIONS, metavar="F,F,..",
                    help="cache sizes to measure, as fractions of each layer's experts (default: "
                         + ",".join(f"{f:g}" for f in FRACTIONS) + ")")
    ap.add_argument("--layers", action="store_true", help="print every layer, not just the summary")
    ap.add_argument("--trace-out", type=Path, metavar="PATH",
                    help="also write every prompt's routing (the top k per token and layer) as a routing trace "
                         "(bench/routing_trace.py; .gz compresses) for python -m bench.plan")
    a = ap.parse_args(argv)

    if (a.forward or a.route_preset) and a.model is None:
        raise SystemExit("bench.routing: --forward and --route-preset need --model (a GGUF to run)")
    if a.route_preset and not a.forward:
        raise SystemExit("bench.routing: --route-preset needs --forward")
    if a.prompts < 2 or a.prompt_len < 2:
        raise SystemExit("bench.routing: --prompts and --prompt-len must be at least 2")
    if a.model is not None:
        from engine.gguf_model import ModelError, open_model
        try:
            model = open_model(a.model)
        except ModelError as e:
            raise SystemExit(f"bench.routing: {e}")
        cfg = model.config
        if not cfg.n_expert:
            raise SystemExit(f"bench.routing: {a.model} has no experts; pass a MoE model")
        if a.route_preset:
            routers, k, name = _preset_routers(mm, a.route_preset, cfg.n_layer, a.seed, a.zipf_s)
            if routers[0][0].shape[1] != cfg.n_embd:
                raise SystemExit(f"bench.routing: {a.model} has hidden {cfg.n_embd}, preset {a.route_preset} "
                                 f"{routers[0][0].shape[1]}; pick a preset of the model's width")
            name = f"{a.model}'s hidden states through {name}'s routers"
        else:
            routers, k, name = file_routers(model), cfg.n_expert_used, str(a.model)
    else:
        routers, k, name = _preset_routers(mm, a.preset or "qwen3-30b-a3b", a.n_layer, a.seed, a.zipf_s)
    if a.forward:
        prompts = forward_inputs(model, a.prompts, a.prompt_len, a.seed + 1, a.attn_gain)
        if a.route_preset:      # the model's hidden states with the preset's ffn_norm weights, as make_moe writes
            prompts = [x / nf * nr for x, (_, nf, _), (_, nr, _) in zip(prompts, file_routers(model), routers)]
        inputs = "the CPU forward's router inputs"
        print("bench.routing: share of the router inputs' energy in their prompt's mean, by layer: " + ", ".join(
            f"{il}: {shared_energy(x):.2f}" for il, x in enumerate(prompts)
            if il % max(1, len(prompts) // 8) == 0 or il == len(prompts) - 1))
    else:
        prompts = random_prompts(routers, a.prompts, a.prompt_len, a.common, a.seed + 1)
        inputs = "random RMS-normed inputs" + (f" sharing {a.common:.2f} of their energy per prompt"
                                               if a.common else "")
    n_expert = routers[0][0].shape[0]
    print(f"bench.routing: {name}: {len(routers)} layers, {n_expert} experts, top {k}; {inputs}, "
          f"{a.prompts} prompts of {a.prompt_len} tokens")
    fs = a.fractions
    per_layer, glob = curves(routers, k, prompts, fs)
    print("ranking learnt on half the prompts, measured on the others:")
    print(table(per_layer, glob, a.layers, n_expert, fs))
    off = off_target(per_layer.mean(0), n_expert, fs)
    print(f"mean curve at most {off:.3f} from TARGET: {'within' if off <= BAND else 'OUTSIDE'} the band of {BAND}")
    within = prompt_curves(routers, k, prompts, fs)
    print("ranking learnt on each prompt's first half, measured on its second (an adaptive cache); LRU: the mean "
          "of an LRU cache per layer warmed on the first half:")
    print(table(within, None, a.layers, n_expert, fs, {"LRU": lru_curve(routers, k, prompts, fs).mean(0)}))
    if a.trace_out is not None:
        from bench import routing_trace
        ids = [np.stack([route(r, p, k).reshape(p.shape[0], k) for p in x]) for r, x in zip(routers, prompts)]
        routing_trace.write(routing_trace.from_layers(ids, n_expert, f"bench.routing: {name}; {inputs}"),
                            a.trace_out)
        print(f"bench.routing: wrote the routing of {a.prompts} prompts of {a.prompt_len} tokens to {a.trace_out}")
    tt = temporal_table(routers, k, prompts)
    print("over time (mean of layers and prompts; a trained Qwen3-30B-A3B's in brackets): " + ", ".join(
        f"{key} {v:.3f} ({TEMPORAL_TARGET[key]:.3f})" for key, v in tt.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
