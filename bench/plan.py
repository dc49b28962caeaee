"""What a PC gets: decode and prompt tok/s for a VRAM budget, a link rate and a CPU rate, with the CPU share chosen.

    python -m bench.plan --preset qwen3-30b-a3b --recipe q4_k_m --trace T.json --vram-gib 12,8 --link-gbps 25
    python -m bench.plan --model M.gguf --trace T.json --vram-gib 12 --link-gbps 50 --cpu-gbps 37.6 [--costs C.json]

The model's shapes come from a GGUF's header (no weights read) or a make_moe preset (its plan, nothing written);
the routing from a trace (bench/routing_trace.py, `bench.routing --trace-out`) whose layers and experts match;
the GPU's costs from a small JSON of per-kind figures (DEFAULT_COSTS: the H200's, each with its source).

The expert cache holds the experts each sequence routed to most in its first half (one pool for all layers, by
bytes, as the adaptive tier ranks them); its second half is decoded. A decode step (docs/experiments.md's model
that fits the measured rows) is per layer a fixed cost, the layer's dense weights and its resident experts read
from VRAM, then its misses: without the prefetch read in place over the link after the layer's work, with it
copied beside the compute (with `prefetch_waste` wrong guesses a missed byte) so that a layer takes the longer of
its compute and its link bytes at `prefetch_link_share` of the link. Each layer's unstaged misses are split with
the CPU by engine/cpu_share.py's rule (or a fixed share). A prompt chunk streams every non-resident expert once
while it computes 2 x active parameters FLOPs a token: the longer of the two.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench import routing_trace
from engine import cpu_share
from engine.cpu_experts import BLOB_ALIGN, QUANT_BLOCKS

GiB = 2 ** 30

# The H200's costs (docs/experiments.md and ../shared/DESIGN.md section 5). Fitted where said so, to the
# all-resident decode steps of Qwen3-30B-A3B (uniform Q4_K, 321.1 tok/s: 3.114 ms) and gpt-oss-20b (319.4 tok/s after
# the MXFP4 kernels: 3.131 ms) with this planner's own byte counts of those presets.
DEFAULT_COSTS = {
    "expert_gbps": 790.0,       # routed experts read from VRAM by the decode kernels (bench.matvec --gpt-oss: the
                                # 20b's 4 experts, 53 MB, in 67.0 us)
    "dense_gbps": 1569.0,       # fitted: the non-expert weights a step reads (attention, routers, head)
    "layer_us": 28.2,           # fitted: a layer's fixed cost (launches in the graph, attention, norms, top-k)
    "prefetch_link_share": 0.96,  # the prefetch's copies run at 48 of the link's 50 GB/s (gpt-oss-120b, 12 GiB:
                                # 1,194 MB a token at 47.9 GB/s)
    "prefetch_waste": 0.25,     # wrong guesses a missed byte (Qwen3-30B-A3B at 12 GiB: 39 MB wasted of 193)
    "prefetch_max_expert_mib": 8.0,   # engine/cuda/prefetch.py AUTO_MAX_EXPERT_BYTES: larger experts, no prefetch
    "prefetch_max_resident": 0.95,    # ... AUTO_MAX_SHARE: at or above this share in VRAM, no prefetch
    "prompt_tflops": 139.5,     # fitted: Qwen3-30B-A3B's 4K prompt at 22,928 tok/s all resident (DESIGN section
                                # 5), 2 x 3.04 G active parameters a token
    "prompt_chunk": 4096,       # tokens a prompt chunk (the largest that fits; 4,096 targeted)
    "vram_misc_mib": 40.0,      # fitted: what the budget holds beyond weights, a 4K KV cache and the slots
                                # (Qwen3-30B-A3B Q4_K_M held 4,066 slots at 12 GiB, 2,563 at 8: 41 and 40 MiB)
    "cpu_overhead_us": cpu_share.CPU_OVERHEAD_US,
}


class PlanError(ValueError):
    """Inputs the planner cannot use; the message says what to do."""


@dataclass
class ModelShape:
    name: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    expert_bytes: np.ndarray        # (n_layer,) bytes of one expert's rows; 0 for a layer without experts
    dense_bytes: int                # non-expert tensors in VRAM, read every step (the embedding apart)
    embd_bytes: int                 # the token embedding (in host memory when that buys slots; the head if tied)
    tied: bool
    kv_bytes_token: int             # fp16 K and V a token, over the layers that attend
    active_params: float            # weights a token multiplies (dense + its k experts), for the prompt's FLOPs

    @property
    def expert_stride(self) -> np.ndarray:
        return (self.expert_bytes + BLOB_ALIGN - 1) // BLOB_ALIGN * BLOB_ALIGN

    @property
    def experts_total_bytes(self) -> int:
        return int(self.expert_stride.sum() * self.n_expert)


def _values(type_id: int, nbytes: int) -> float:
    values, size = QUANT_BLOCKS[type_id]
    return nbytes / size * values


def _shape(name, tensors, n_layer, n_expert, k, kv_row) -> ModelShape:
    """tensors: (name, type id, bytes) of every tensor; kv_row: K+V values a token and attending layer."""
    expert = np.zeros(n_layer, np.int64)
    dense = embd = 0
    params = 0.0
    attends = set()
    by_name = {t[0]: t for t in tensors}
    for tname, qt, nbytes in tensors:
        parts = tname.split(".")
        layer = int(parts[1]) if parts[0] == "blk" else -1
        if layer >= n_layer:            # an MTP block: not in the decode step
            continue
        if "_exps." in tname:
            if tname.endswith(".weight"):
                expert[layer] += nbytes // n_expert
                params += _values(qt, nbytes) / n_expert * k
            else:
                dense += nbytes         # gpt-oss's expert biases stay in VRAM
            continue
        if tname == "token_embd.weight":
            embd = nbytes
            continue
        dense += nbytes
        if tname.endswith(".weight") and not tname.endswith("norm.weight"):
            params += _values(qt, nbytes)
        if tname.endswith("attn_k.weight") or (tname.endswith("attn_qkv.weight")
                                                and f"blk.{layer}.ssm_out.weight" not in by_name):
            attends.add(layer)
    tied = "output.weight" not in by_name
    if tied:
        params += _values(by_name["token_embd.weight"][1], embd)
    return ModelShape(name, n_layer, n_expert, k, expert, dense, embd, tied, 2 * 2 * kv_row * len(attends), params)


def shape_from_gguf(path) -> ModelShape:
    from engine.gguf_model import ModelError, read_header
    try:
        h = read_header(path)
    except ModelError as e:
        raise PlanError(str(e)) from None
    md = h.metadata
    arch = md.get("general.architecture")
    get = lambda key, default=None: md.get(f"{arch}.{key}", default)  # noqa: E731
    n_expert, k = int(get("expert_count", 0) or 0), int(get("expert_used_count", 0) or 0)
    if not n_expert:
        raise PlanError(f"{path} has no experts ({arch}.expert_count); the planner is for MoE models")
    n_layer = int(get("block_count")) - int(get("nextn_predict_layers", 0) or 0)
    n_head = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_head)
    n_kv = int(n_kv[0] if isinstance(n_kv, list) else n_kv)
    dk = int(get("attention.key_length", int(get("embedding_length")) // n_head))
    dv = int(get("attention.value_length", dk))
    tensors = []
    for t in h.tensors:
        if t.type_id not in QUANT_BLOCKS:
            raise PlanError(f"{path}: tensor {t.name} has quant type id {t.type_id}, which the planner cannot size")
        values, size = QUANT_BLOCKS[t.type_id]
        tensors.append((t.name, t.type_id, t.dims[0] // values * size * int(np.prod(t.dims[1:], dtype=np.int64))))
    return _shape(Path(path).name, tensors, n_layer, n_expert, k, n_kv * (dk + dv) // 2)


def shape_from_preset(preset: str, extra: list[str] | None = None) -> ModelShape:
    from tools import make_moe as mm
    from tools.recipes import Hparams, apply_recipe
    if preset not in mm.PRESETS:
        raise PlanError(f"no make_moe preset {preset!r}; one of {', '.join(sorted(mm.PRESETS))}")
    args = mm.parse_args(["--preset", preset, *(extra or [])])
    s = mm.resolve_shape(args)
    if not s.n_expert:
        raise PlanError(f"preset {preset} has no experts")
    vocab = mm.shape_vocab(s)
    n_vocab = next(len(v) for key, v, _ in vocab if key == "tokenizer.ggml.tokens")
    types = {g: getattr(args, g) for g in ("experts", "shexp", "attn", "ffn", "embd", "output", "norm")}
    specs = mm.shape_plan(s, types, n_vocab)
    if args.recipe:
        n_all = s.n_layer + (s.hybrid.n_nextn if s.hybrid else 0)
        specs = apply_recipe(specs, args.recipe, Hparams(n_all, s.n_head, s.n_head_kv, s.n_expert))
    name = preset + (f" {args.recipe}" if args.recipe else "")
    return _shape(name, [(t.name, int(t.qtype), t.nbytes) for t in specs], s.n_layer, s.n_expert,
                  s.n_expert_used, s.n_head_kv * s.head_dim)


# --- the plan -----------------------------------------------------------------------------------------------------

@dataclass
class Row:
    vram_gib: float
    cpu_share: str
    slots: int
    hit_rate: float
    decode_tok_s: float
    prompt_tok_s: float
    link_mb_token: float
    cpu_mb_token: float
    cpu_experts_token: float
    prefetch: bool
    notes: list = field(default_factory=list)


def vram_slots_bytes(shape: ModelShape, costs: dict, vram_gib: float, ctx: int) -> tuple[int, bool]:
    """(bytes of expert slots the budget leaves, whether the embedding sits in host memory)."""
    fixed = shape.dense_bytes + shape.kv_bytes_token * ctx + costs["vram_misc_mib"] * 2 ** 20
    room = vram_gib * GiB - fixed
    if shape.tied or room >= shape.experts_total_bytes:
        return int(room - shape.embd_bytes), False
    return int(room), True


def resident_from(counts: np.ndarray, stride: np.ndarray, room: int) -> np.ndarray:
    """(L, E) bool: the most-counted experts (ties by layer, expert id) whose strides fit in room bytes."""
    L, E = counts.shape
    flat = counts.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))
    sizes = np.repeat(stride, E)[order]
    keep = np.cumsum(sizes) <= room
    out = np.zeros(flat.size, bool)
    out[order[keep]] = True
    out[np.repeat(stride, E) == 0] = False
    return out.reshape(L, E)


def step_us(shape: ModelShape, costs: dict, rates: cpu_share.Rates, resident: np.ndarray, token: np.ndarray,
            prefetch: bool, share: float | None) -> tuple[float, float, float, int]:
    """One decode step: (microseconds, link bytes, CPU bytes, experts on the CPU) for token (L, k) of routed ids.

    A layer's own work is its fixed cost and its share of the dense bytes; its resident experts are read from VRAM.
    Without the prefetch its misses follow on the link (or the CPU, beside); with it the link's copies (and wrong
    guesses) run beside all of the layer's work."""
    dense_us = shape.dense_bytes / shape.n_layer / (costs["dense_gbps"] * 1e3)
    total = link_b = cpu_b = 0.0
    n_cpu = 0
    waste = 1.0 + costs["prefetch_waste"] if prefetch else 1.0
    link = cpu_share.Rates(rates.link_gbps * (costs["prefetch_link_share"] if prefetch else 1.0), rates.cpu_gbps,
                           rates.cpu_overhead_us)
    for il in range(shape.n_layer):
        b = float(shape.expert_bytes[il])
        own = costs["layer_us"] + dense_us
        ids = token[il][token[il] >= 0]
        if not b or not ids.size:
            total += own
            continue
        miss = [int(e) for e in ids if not resident[il, e]]
        gpu = (ids.size - len(miss)) * b / (costs["expert_gbps"] * 1e3)
        sp = cpu_share.split_layer(miss, (), b * waste, link, gpu_us=gpu + own if prefetch else gpu, share=share,
                                   overlapped=prefetch, cpu_bytes=b)
        total += sp.us if prefetch else own + sp.us
        link_b += len(sp.link) * b * waste
        cpu_b += len(sp.cpu) * b
        n_cpu += len(sp.cpu)
    return total, link_b, cpu_b, n_cpu


def plan(shape: ModelShape, trace: routing_trace.Trace, costs: dict, vram_gib: float, rates: cpu_share.Rates,
         ctx: int = 4096, share: float | None = 0.0, prefetch: str = "auto") -> Row:
    if (trace.n_layer, trace.n_expert, trace.n_expert_used) != (shape.n_layer, shape.n_expert, shape.n_expert_used):
        raise PlanError(f"the trace routes {trace.n_layer} layers x {trace.n_expert} experts (top "
                        f"{trace.n_expert_used}), the model has {shape.n_layer} x {shape.n_expert} (top "
                        f"{shape.n_expert_used}); record a trace of this model's routing (bench.routing)")
    room, embd_host = vram_slots_bytes(shape, costs, vram_gib, ctx)
    if room < 0:
        raise PlanError(f"{vram_gib} GiB does not hold {shape.name}'s dense weights and a {ctx}-token KV cache "
                        f"({(shape.dense_bytes + shape.kv_bytes_token * ctx) / GiB:.2f} GiB)")
    stride = shape.expert_stride
    notes = ["token embedding in host memory"] if embd_host else []
    steps = []
    hits = lookups = 0
    slots_seen = []
    resident_share = []
    for seq in trace.sequences:
        half = len(seq) // 2
        if half < 1:
            continue
        counts = np.zeros((shape.n_layer, shape.n_expert), np.int64)
        learn = seq[:half]
        for il in range(shape.n_layer):
            ids = learn[:, il].reshape(-1)
            counts[il] = np.bincount(ids[ids >= 0], minlength=shape.n_expert)
        resident = resident_from(counts, stride, room)
        slots_seen.append(int(resident.sum()))
        resident_share.append(resident.sum() / max(1, (stride > 0).sum() * shape.n_expert))
        on = _prefetch_on(prefetch, costs, shape, resident_share[-1])
        for tok in seq[half:]:
            steps.append(step_us(shape, costs, rates, resident, tok, on, share))
            routed = tok[tok >= 0]
            lookups += routed.size
            hits += sum(int(resident[il, e]) for il in range(shape.n_layer) for e in tok[il] if e >= 0)
    if not steps:
        raise PlanError("the trace's sequences are too short to learn on half and decode the other half")
    us = np.array([s[0] for s in steps])
    per_tok = lambda i: float(np.mean([s[i] for s in steps]))  # noqa: E731
    on = _prefetch_on(prefetch, costs, shape, float(np.mean(resident_share)))
    prompt = prompt_tok_s(shape, costs, rates.link_gbps, room)
    label = "auto" if share is None else ("off" if share == 0 else f"{share:g}")
    return Row(vram_gib, label, int(np.mean(slots_seen)), hits / max(1, lookups), 1e6 / float(us.mean()), prompt,
               per_tok(1) / 1e6, per_tok(2) / 1e6, per_tok(3), on, notes)


def _prefetch_on(prefetch: str, costs: dict, shape: ModelShape, resident_share: float) -> bool:
    if prefetch in ("on", "off"):
        return prefetch == "on"
    small = shape.expert_bytes.max() <= costs["prefetch_max_expert_mib"] * 2 ** 20
    return bool(small and resident_share < costs["prefetch_max_resident"])


def prompt_tok_s(shape: ModelShape, costs: dict, link_gbps: float, room: int) -> float:
    """A chunk's tokens over the longer of its FLOPs and streaming every expert the cache does not hold."""
    chunk = costs["prompt_chunk"]
    compute = chunk * 2 * shape.active_params / (costs["prompt_tflops"] * 1e12)
    stream = max(0.0, shape.experts_total_bytes - max(room, 0)) / (link_gbps * 1e9)
    return chunk / max(compute, stream)


def load_costs(path: Path | None) -> dict:
    costs = dict(DEFAULT_COSTS)
    if path is None:
        return costs
    try:
        given = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read the costs {path}: {e}; give a JSON object of {', '.join(DEFAULT_COSTS)}") \
            from None
    if not isinstance(given, dict):
        raise PlanError(f"{path} must hold a JSON object of per-kind costs ({', '.join(DEFAULT_COSTS)})")
    for key, v in given.items():
        if key not in DEFAULT_COSTS:
            raise PlanError(f"{path}: unknown cost {key!r}; the kinds are {', '.join(DEFAULT_COSTS)}")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 or math.isinf(v):
            raise PlanError(f"{path}: {key} must be a number >= 0, not {v!r}")
        costs[key] = float(v)
    for key in ("expert_gbps", "dense_gbps", "prompt_tflops", "prompt_chunk", "prefetch_link_share"):
        if not costs[key] > 0:
            raise PlanError(f"{path}: {key} must be above 0")
    return costs


def _numbers(text: str, what: str) -> list[float]:
    try:
        vals = [float(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if not vals or not all(v > 0 and math.isfinite(v) for v in vals):
        raise PlanError(f"{what} takes positive numbers, comma-separated; got {text!r}")
    return vals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a GGUF whose header gives the shapes (no weights are read)")
    src.add_argument("--preset", help="a make_moe preset's shapes (with --recipe, --n-layer, ... as make_moe's)")
    ap.add_argument("--recipe", help="with --preset: make_moe's --recipe (llama-quantize's per-layer types)")
    ap.add_argument("--trace", type=Path, required=True, help="a routing trace of the model (bench.routing)")
    ap.add_argument("--costs", type=Path, help="JSON of per-kind GPU costs (default: the H200's, DEFAULT_COSTS)")
    ap.add_argument("--vram-gib", default="12", help="VRAM budgets in GiB, comma-separated (default 12)")
    ap.add_argument("--link-gbps", type=float, default=50.0, help="the link's in-place read rate (default 50: "
                                                                  "PCIe 5 x16; PCIe 4 x16 ~25)")
    ap.add_argument("--cpu-gbps", type=float, default=0.0, help="CPU experts' GB/s of expert bytes "
                                                                "(bench.cpu_experts; default 0: no CPU share)")
    ap.add_argument("--cpu-share", default="off,auto", help="cpu_share settings to plan, comma-separated "
                                                            "(auto, off or F; default off,auto)")
    ap.add_argument("--ctx", type=int, default=4096, help="context the KV cache is sized for (default 4096)")
    ap.add_argument("--prefetch", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    a = ap.parse_args(argv)
    try:
        shape = shape_from_gguf(a.model) if a.model else shape_from_preset(
            a.preset, ["--recipe", a.recipe] if a.recipe else [])
        trace = routing_trace.read(a.trace)
        costs = load_costs(a.costs)
        budgets = _numbers(a.vram_gib, "--vram-gib")
        shares = []
        for v in a.cpu_share.split(","):
            try:
                shares.append(cpu_share.parse_cpu_share(v))
            except argparse.ArgumentTypeError as e:
                raise PlanError(f"--cpu-share: {e}") from None
        rates = cpu_share.Rates(a.link_gbps, a.cpu_gbps, costs["cpu_overhead_us"])
        rows = [plan(shape, trace, costs, g, rates, a.ctx, s, a.prefetch) for g in budgets for s in shares]
    except (PlanError, routing_trace.TraceError, ValueError) as e:
        raise SystemExit(f"bench.plan: {e}")
    if a.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
        return 0
    print(f"bench.plan: {shape.name}: {shape.n_layer} layers, {shape.n_expert} experts (top {shape.n_expert_used}), "
          f"experts {shape.experts_total_bytes / GiB:.2f} GiB, dense {shape.dense_bytes / GiB:.2f} GiB; trace "
          f"{trace.n_tokens} tokens ({trace.source}); link {a.link_gbps:g} GB/s, CPU {a.cpu_gbps:g} GB/s")
    print("| VRAM GiB | cpu_share | slots | hit rate | decode tok/s | prompt tok/s | link MB/token | CPU MB/token "
          "| CPU experts/token | prefetch |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r.vram_gib:g} | {r.cpu_share} | {r.slots} | {r.hit_rate:.3f} | {r.decode_tok_s:.1f} | "
              f"{r.prompt_tok_s:,.0f} | {r.link_mb_token:.1f} | {r.cpu_mb_token:.1f} | {r.cpu_experts_token:.2f} | "
              f"{'on' if r.prefetch else 'off'}{' (' + '; '.join(r.notes) + ')' if r.notes else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
