"""The layer split across several GPUs: which consecutive layers each card holds (a stage), chosen from each card's
free VRAM and measured link rate and each layer's bytes. Pure NumPy (no CuPy): the worker's `--layer-split`, its
printed plan, and bench.layer_split all call `plan_layer_split`.

The cost model is bench/plan.py's decode step, cut into stages. A stage on card c holding layers [a, b):

- VRAM: its layers' non-expert weights and KV (or recurrent state), a workspace (the prompt pass's buffers), the
  token embedding on the first stage and the output head on the last; what is left is its expert cache, filled with
  the hottest experts of its own layers (by expected routings a token per byte), whole experts only.
- time a token: a fixed cost a layer, the weights and resident experts read at the card's memory rate, then the
  misses (expected routings of the experts it does not hold) read over its own link. The decode step is the stages'
  times in a row plus a fixed hand-off between consecutive stages (the hidden state copied to the next card and an
  event wait).

A single token's decode runs the stages one after another, so it is their sum that the split mostly moves (through
which card's cache and link each layer's misses land on); the prompt pass, pipelined by chunk, runs at the pace of
the slowest stage. The rule: the least decode step time, and among the splits within SUM_TOLERANCE of it the one
whose slowest stage is fastest (so equal cards get equal shares instead of an arbitrary split a few microseconds
ahead).

Expected routings come from a routing count (bench.routing traces, the adaptive tier's counts) when given, else are
uniform (k / n_expert an expert): a profile file ranks experts but holds no counts. `share_profile` cuts an expert
profile into the stages' own profiles: each the profile's order restricted to its layers, hottest first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GiB = 2 ** 30
MiB = 2 ** 20

BLOB_ALIGN = 256            # engine/cuda/expert_layout.py ALIGN: an expert's blob stride in the arena and the cache
# A layer's fixed decode cost (launches in the graph, attention, norms, top-k) and the VRAM read rates: bench/plan.py's
# H200 figures, fitted to the all-resident decode of Qwen3-30B-A3B and gpt-oss-20b. A probe that measures a card
# replaces mem_gbps; layer_us is the same on every stage of a plan, so it moves no split.
LAYER_US = 28.2
# The hand-off between stages: the hidden state (n_embd floats, 8-12 KiB) copied device -> pinned -> device and a
# cross-device event wait. An estimate (two small copies of ~10 us each and the wait) until the two-GPU machine
# measures it; the original engine's split charged 0.33 ms a layer on an RTX 5080, which sets the scale: one
# hand-off is worth well under one layer.
HANDOFF_US = 30.0
# Decode step times within this share of the best count as equal; the balanced one of them is taken (see above).
SUM_TOLERANCE = 0.02


class SplitError(ValueError):
    """A split that cannot run on these cards; the message says which card, what it lacks, and what to change."""


@dataclass(frozen=True)
class LayerCost:
    weights_bytes: int              # non-expert tensors (attention or GDN, router, shared expert, norms): in VRAM
    kv_bytes: int                   # its KV cache at the context (or its recurrent state)
    expert_bytes: int = 0           # one expert's blob stride (0: a layer without routed experts)
    n_expert: int = 0
    n_used: int = 0                 # experts a token routes to
    use: tuple | None = None        # (n_expert,) expected routings a token of each expert; None: uniform

    def routings(self) -> np.ndarray:
        if not self.expert_bytes or not self.n_expert:
            return np.zeros(0)
        if self.use is None:
            return np.full(self.n_expert, self.n_used / self.n_expert)
        u = np.asarray(self.use, dtype=np.float64)
        if u.shape != (self.n_expert,) or (u < 0).any():
            raise ValueError(f"use must be {self.n_expert} routings >= 0, got shape {u.shape}")
        return u


@dataclass(frozen=True)
class Card:
    index: int                      # the CUDA device index
    name: str
    free_bytes: int                 # VRAM this worker may take on it (free less the reserve, within a budget)
    link_gbps: float                # host -> device copy rate, measured (GB/s)
    mem_gbps: float = 1569.0        # VRAM read rate of the decode kernels (bench/plan.py's H200 dense_gbps)
    layer_us: float = LAYER_US


@dataclass
class Stage:
    card: Card
    first: int                      # the first layer it holds
    end: int                        # one past its last layer
    fixed_bytes: int                # weights, KV, workspace, embedding / head
    cache_bytes: int                # what its expert cache takes (whole experts)
    slots: int                      # experts in its cache
    experts: int                    # experts of its layers
    hit: float                      # share of its routings the cache holds
    compute_us: float
    miss_us: float

    @property
    def n_layers(self) -> int:
        return self.end - self.first

    @property
    def us(self) -> float:
        return self.compute_us + self.miss_us


@dataclass
class SplitPlan:
    stages: list[Stage]
    handoff_us: float
    how: str                        # "auto" or "given"
    notes: list[str] = field(default_factory=list)

    @property
    def counts(self) -> list[int]:
        return [s.n_layers for s in self.stages]

    @property
    def step_us(self) -> float:
        return sum(s.us for s in self.stages) + self.handoff_us * (len(self.stages) - 1)

    @property
    def slowest_us(self) -> float:
        return max(s.us for s in self.stages)


class _Layers:
    """The layers' costs as arrays, with the experts of all layers in one order (hottest per byte first), so a
    stage's cache is a prefix of that order filtered to its layers."""

    def __init__(self, layers: list[LayerCost]):
        self.n = len(layers)
        self.weights = np.array([lc.weights_bytes for lc in layers], np.float64)
        self.kv = np.array([lc.kv_bytes for lc in layers], np.float64)
        self.fixed = np.concatenate([[0.0], np.cumsum(self.weights + self.kv)])
        self.wcum = np.concatenate([[0.0], np.cumsum(self.weights)])
        lay, size, use = [], [], []
        for i, lc in enumerate(layers):
            u = lc.routings()
            lay.append(np.full(u.size, i))
            size.append(np.full(u.size, float(lc.expert_bytes)))
            use.append(u)
        lay, size, use = (np.concatenate(x) if x else np.zeros(0) for x in (lay, size, use))
        keep = size > 0
        lay, size, use = lay[keep].astype(np.int64), size[keep], use[keep]
        # hottest per byte first; ties by layer, then expert (stable)
        order = np.lexsort((np.arange(lay.size), -(use / np.maximum(size, 1.0))))
        self.e_layer, self.e_size, self.e_use = lay[order], size[order], use[order]
        per_layer_use = np.bincount(self.e_layer, weights=self.e_use * self.e_size, minlength=self.n)
        self.ubytes = np.concatenate([[0.0], np.cumsum(per_layer_use)])      # routed bytes a token, by layer
        self.ecount = np.concatenate([[0], np.cumsum(np.bincount(self.e_layer, minlength=self.n))])

    def cache(self, a: int, b: int, room: float) -> tuple[int, float, float]:
        """(slots, cache bytes, resident routed bytes a token) for layers [a, b) and room bytes."""
        if room <= 0 or not self.e_layer.size:
            return 0, 0.0, 0.0
        sel = (self.e_layer >= a) & (self.e_layer < b)
        sizes = self.e_size[sel]
        ends = np.cumsum(sizes)
        n = int(np.searchsorted(ends, room, side="right"))
        if not n:
            return 0, 0.0, 0.0
        return n, float(ends[n - 1]), float((self.e_use[sel][:n] * sizes[:n]).sum())


def _stage(L: _Layers, card: Card, a: int, b: int, extra: float) -> Stage | None:
    """Stage [a, b) on card, or None when its fixed bytes do not fit the card."""
    fixed = L.fixed[b] - L.fixed[a] + extra
    room = card.free_bytes - fixed
    if room < 0:
        return None
    slots, cbytes, resident = L.cache(a, b, room)
    routed = L.ubytes[b] - L.ubytes[a]
    per_us = lambda nbytes, gbps: nbytes / (gbps * 1e3)  # noqa: E731  (bytes at GB/s, in microseconds)
    compute = (b - a) * card.layer_us + per_us(L.wcum[b] - L.wcum[a] + resident, card.mem_gbps)
    miss = per_us(max(0.0, routed - resident), card.link_gbps)
    experts = int(L.ecount[b] - L.ecount[a])
    return Stage(card, a, b, int(fixed), int(cbytes), slots, experts, resident / routed if routed else 1.0,
                 compute, miss)


def _extra(i: int, S: int, embd_bytes: int, head_bytes: int, work_bytes: int, tied: bool) -> float:
    first, last = i == 0, i == S - 1
    held = (embd_bytes if first or (last and tied) else 0) + (head_bytes if last else 0)
    return float(work_bytes + held)


def _head_us(stage: Stage, head_bytes: int) -> None:
    # the output head is read once a token by the last stage
    stage.compute_us += head_bytes / (stage.card.mem_gbps * 1e3)


def plan_layer_split(layer_costs: list[LayerCost], cards: list[Card], split="auto", *, embd_bytes: int = 0,
                     head_bytes: int = 0, tied: bool = False, work_bytes: int = 0,
                     handoff_us: float = HANDOFF_US, shared: bool = False) -> SplitPlan:
    """The stages for `cards` in their order: `split` is "auto" or a list of layer counts, one a card.
    shared: a card may be listed more than once, each entry a stage's share of it (the one-GPU test mode).

    embd_bytes: the token embedding (the first stage holds it; 0 when it sits in host memory); head_bytes: the output
    norm and head (the last stage); tied: the head is the embedding (the last stage holds and reads it as well);
    work_bytes: each stage's workspace (its prompt-pass buffers). Raises SplitError with the card and the bytes when
    a split cannot run."""
    L = _Layers(list(layer_costs))
    S = len(cards)
    if not S:
        raise SplitError("no GPU to split the layers over")
    if len({c.index for c in cards}) != S and not shared:
        raise SplitError(f"GPU {sorted(c.index for c in cards)} names a card twice")
    if S > L.n:
        raise SplitError(f"{S} GPUs for {L.n} layers: every GPU needs at least one layer")
    extras = [_extra(i, S, embd_bytes, head_bytes, work_bytes, tied) for i in range(S)]
    head_bytes = head_bytes + (embd_bytes if tied else 0)      # what the last stage reads a token
    if split != "auto":
        return _given(L, cards, list(split), extras, head_bytes, handoff_us)
    _too_small(L, cards, extras)

    # cost[s][a][b]: stage s holding layers [a, b); inf where it does not fit
    INF = float("inf")
    cost = np.full((S, L.n + 1, L.n + 1), INF)
    for s, card in enumerate(cards):
        for a in range(s, L.n - (S - 1 - s)):
            # the last stage ends at the last layer; the others leave one layer for each stage after them
            for b in (range(a + 1, L.n - (S - 2 - s)) if s < S - 1 else (L.n,)):
                st = _stage(L, card, a, b, extras[s])
                if st is None:
                    break               # more layers only need more bytes
                if s == S - 1:
                    _head_us(st, head_bytes)
                cost[s, a, b] = st.us
    best, _ = _dp(cost, S, L.n, INF)
    if best == INF:
        raise SplitError(_no_fit(L, cards, extras))
    # The smallest bound on the slowest stage whose least sum stays within the tolerance of the best.
    bound_sum = best * (1 + SUM_TOLERANCE) + 1e-9
    cands = np.unique(cost[np.isfinite(cost)])
    lo, hi = 0, len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        total, _ = _dp(np.where(cost <= cands[mid], cost, INF), S, L.n, INF)
        if total <= bound_sum:
            hi = mid
        else:
            lo = mid + 1
    _, cuts = _dp(np.where(cost <= cands[lo], cost, INF), S, L.n, INF)
    stages = []
    for s, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        st = _stage(L, cards[s], a, b, extras[s])
        if s == S - 1:
            _head_us(st, head_bytes)
        stages.append(st)
    return SplitPlan(stages, handoff_us if S > 1 else 0.0, "auto")


def _dp(cost: np.ndarray, S: int, n: int, INF: float) -> tuple[float, list[int]]:
    """The least sum of stage costs over splits of n layers into S consecutive non-empty stages (hand-offs apart:
    they are the same for every split), and its cut points [0, ..., n]."""
    acc = np.full(n + 1, INF)
    acc[0] = 0.0
    back = np.zeros((S, n + 1), np.int64)
    for s in range(S):
        tot = acc[:, None] + cost[s]                  # [a, b]
        back[s] = np.argmin(tot, axis=0)
        acc = tot[back[s], np.arange(n + 1)]
    if acc[n] == INF:
        return INF, []
    cuts = [n]
    for s in range(S - 1, -1, -1):
        cuts.append(int(back[s, cuts[-1]]))
    return float(acc[n]), cuts[::-1]


def _given(L: _Layers, cards: list[Card], counts: list[int], extras: list[float], head_bytes: int,
           handoff_us: float) -> SplitPlan:
    S = len(cards)
    shown = ",".join(str(c) for c in counts)
    if len(counts) != S:
        raise SplitError(f"--layer-split {shown} gives {len(counts)} stage(s) for {S} GPU(s) "
                         f"({', '.join(str(c.index) for c in cards)}): give one count a GPU")
    if any(c < 1 for c in counts):
        raise SplitError(f"--layer-split {shown}: every GPU needs at least one layer")
    if sum(counts) != L.n:
        raise SplitError(f"--layer-split {shown} adds up to {sum(counts)} layers; the model has {L.n}")
    stages, a = [], 0
    for s, (card, n) in enumerate(zip(cards, counts)):
        st = _stage(L, card, a, a + n, extras[s])
        if st is None:
            need = L.fixed[a + n] - L.fixed[a] + extras[s]
            raise SplitError(f"GPU {card.index} ({card.name}) cannot hold layers {a}-{a + n - 1}: their weights, KV "
                             f"and workspace need {need / GiB:.2f} GiB, it has {card.free_bytes / GiB:.2f} GiB; "
                             f"give it fewer layers (or --layer-split auto)")
        if s == S - 1:
            _head_us(st, head_bytes)
        stages.append(st)
        a += n
    return SplitPlan(stages, handoff_us if S > 1 else 0.0, "given")


def _most_layers(L: _Layers, card: Card, extra: float) -> int:
    """The most consecutive layers anywhere whose fixed bytes fit the card."""
    most = 0
    for a in range(L.n):
        b = int(np.searchsorted(L.fixed, card.free_bytes - extra + L.fixed[a], side="right")) - 1
        most = max(most, b - a)
    return most


def _too_small(L: _Layers, cards: list[Card], extras: list[float]) -> None:
    for s, card in enumerate(cards):
        if _most_layers(L, card, extras[s]) < 1:
            one = float((L.weights + L.kv).min()) + extras[s]
            raise SplitError(f"GPU {card.index} ({card.name}, {card.free_bytes / GiB:.2f} GiB free) cannot hold even "
                             f"one layer's weights, KV and workspace ({one / GiB:.2f} GiB): leave it out of --gpus")


def _no_fit(L: _Layers, cards: list[Card], extras: list[float]) -> str:
    held = [(c, _most_layers(L, c, extras[s])) for s, c in enumerate(cards)]
    each = ", ".join(f"GPU {c.index} at most {n} ({c.free_bytes / GiB:.1f} GiB free)" for c, n in held)
    return (f"no split of the {L.n} layers fits these GPUs' VRAM: {each}; a smaller --ctx, --kv int8 or another "
            f"GPU makes room")


def format_plan(plan: SplitPlan) -> list[str]:
    """Lines for the log and the dry run: each stage's card, layers, cache and predicted time."""
    lines = [f"layer split ({plan.how}): {','.join(str(n) for n in plan.counts)} over GPUs "
             f"{','.join(str(s.card.index) for s in plan.stages)}; predicted decode step {plan.step_us / 1e3:.2f} ms "
             f"({1e6 / plan.step_us:.1f} tok/s), slowest stage {plan.slowest_us / 1e3:.2f} ms, hand-offs "
             f"{plan.handoff_us * (len(plan.stages) - 1) / 1e3:.2f} ms"]
    for s in plan.stages:
        lines.append(f"  GPU {s.card.index} ({s.card.name}): layers {s.first}-{s.end - 1} ({s.n_layers}), "
                     f"{s.fixed_bytes / GiB:.2f} GiB weights/KV/workspace, cache {s.slots}/{s.experts} experts "
                     f"({s.cache_bytes / GiB:.2f} GiB of {s.card.free_bytes / GiB:.2f} GiB free), hit {s.hit:.0%}, "
                     f"{s.compute_us / 1e3:.2f} ms compute + {s.miss_us / 1e3:.2f} ms misses at "
                     f"{s.card.link_gbps:.1f} GB/s")
    lines += [f"  note: {n}" for n in plan.notes]
    return lines


def share_profile(profile, plan: SplitPlan) -> list:
    """Each stage's own expert profile: the profile's order restricted to the stage's layers (global layer ids kept,
    hottest first), so each stage's cache fills with the hottest experts of its own layers."""
    from engine.profile import ExpertProfile
    out = []
    for s in plan.stages:
        keep = (profile.order[:, 0] >= s.first) & (profile.order[:, 0] < s.end)
        out.append(ExpertProfile(profile.n_layers, profile.n_expert, profile.order[keep].copy()))
    return out


# --- a model's layer costs ----------------------------------------------------------------------------------------

def kv_row_bytes(head_dim: int, kv: str) -> int:
    """engine/cuda/kv.py row_bytes (that module imports CuPy): one position of one KV head, K or V."""
    return 2 * head_dim if kv == "f16" else head_dim + head_dim // 32 * 4


def layer_kv_bytes(cfg, ctx: int, kv: str = "f16", chunk: int = 4096) -> list[int]:
    """Per layer: its KV cache at ctx (a window layer's ring: window + chunk, kv.py ring_rows), or a Gated DeltaNet
    layer's state (the delta rule's per-head state and the conv window, float32)."""
    out = []
    rec = tuple(getattr(cfg, "recurrent_layers", ()) or ())
    for i in range(cfg.n_layer):
        if i < len(rec) and rec[i]:
            conv_ch = 2 * cfg.ssm_k_heads * cfg.ssm_state + cfg.ssm_inner
            out.append(4 * (cfg.ssm_v_heads * cfg.ssm_state * cfg.ssm_state + (cfg.ssm_conv - 1) * conv_ch))
            continue
        rows = ctx
        if getattr(cfg, "n_swa", 0) and cfg.is_swa(i):
            rows = min(ctx, -(-(cfg.n_swa + max(1, chunk) - 1) // 64) * 64)
        hd_v = getattr(cfg, "head_dim_v", cfg.head_dim) or cfg.head_dim
        out.append(cfg.n_head_kv * rows * (kv_row_bytes(cfg.head_dim, kv) + kv_row_bytes(hd_v, kv)))
    return out


@dataclass
class ModelCosts:
    layers: list[LayerCost]
    embd_bytes: int                 # the token embedding
    head_bytes: int                 # the output norm and head (without the embedding when tied)
    tied: bool                      # the head is the token embedding

    def plan(self, cards: list[Card], split="auto", **kw) -> SplitPlan:
        return plan_layer_split(self.layers, cards, split, embd_bytes=self.embd_bytes, head_bytes=self.head_bytes,
                                tied=self.tied, **kw)


def layer_costs_from_tensors(tensors, n_layer: int, n_expert: int, n_used: int, kv_bytes: list[int],
                             use: np.ndarray | None = None) -> ModelCosts:
    """A model's costs from (name, bytes) pairs of its GGUF tensors. An expert's stride is its gate, up and down rows
    rounded up to BLOB_ALIGN; use: (n_layer, n_expert) routing counts, or None (uniform)."""
    weights = np.zeros(n_layer, np.int64)
    expert = np.zeros(n_layer, np.int64)
    embd = head = 0
    names = set()
    for name, nbytes in tensors:
        names.add(name)
        parts = name.split(".")
        if parts[0] != "blk":
            if name == "token_embd.weight":
                embd = int(nbytes)
            elif name.startswith(("output.", "output_norm.")):
                head += int(nbytes)
            continue
        layer = int(parts[1])
        if layer >= n_layer:            # an MTP block: not in the decode step
            continue
        if "_exps." in name and name.endswith(".weight") and n_expert:
            expert[layer] += int(nbytes) // n_expert
        else:
            weights[layer] += int(nbytes)
    tied = "output.weight" not in names    # the head is the embedding
    stride = (expert + BLOB_ALIGN - 1) // BLOB_ALIGN * BLOB_ALIGN
    costs = []
    for i in range(n_layer):
        u = None
        if use is not None and stride[i]:
            row = np.asarray(use[i], np.float64)
            total = row.sum()
            u = tuple(row / total * n_used) if total > 0 else None
        costs.append(LayerCost(int(weights[i]), int(kv_bytes[i]), int(stride[i]), n_expert if stride[i] else 0,
                               n_used if stride[i] else 0, u))
    return ModelCosts(costs, int(embd), int(head), tied)


def model_layer_costs(model, ctx: int, kv: str = "f16", use: np.ndarray | None = None) -> ModelCosts:
    """layer_costs_from_tensors for an open GGUFModel at a context and KV format."""
    cfg = model.config
    tensors = [(n, model.tensor(n).nbytes) for n in model.tensor_names()]
    return layer_costs_from_tensors(tensors, cfg.n_layer, int(getattr(cfg, "n_expert", 0) or 0),
                                    int(getattr(cfg, "n_expert_used", 0) or 0), layer_kv_bytes(cfg, ctx, kv), use)
