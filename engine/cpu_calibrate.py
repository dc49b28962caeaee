"""--calibrate's CPU half: the CPU experts' rate on the model's own experts beside the link's, and the split the rule
(engine/cpu_share.py) would choose with them, as CALIBRATE keys (docs/design.md, "Calibration").

    facts = cpu_facts(model, link_gbps, arena=backend.arena, hit_rate=0.8)

measures engine.cpu_expert_pool.measure_gbps on the experts where the decode step would read them: the pinned
arena's blobs when there is one (what the CPU pool will compute from), else the memory-mapped GGUF. The answer:
cpu_gbps, cpu_threads, cpu_share_typical ("c of n": the rule's choice for a typical layer's misses), and the
worker flags that carry the rates into the config (`arg.tune.cpu_share`, `arg.tune.cpu_gbps`,
`arg.tune.link_gbps`, `arg.tune.cpu_threads`: setup/calibrate.py chosen_args makes them `--tune KEY=VALUE`).
cpu_share stays auto (the per-step cost model) unless the CPU would take nothing of a typical layer: then off.
"""
from __future__ import annotations

import os

from engine import cpu_share
from engine.cpu_experts import ExpertTable, model_activation, model_biases


def default_threads() -> int:
    """Every core but one (the decode loop's host thread), at least 1, within numba's cap."""
    from engine.cpu_expert_pool import max_threads
    return max(1, min(max_threads(), (os.cpu_count() or 2) - 1))


def host_table(model, arena=None) -> ExpertTable:
    """The model's experts where host memory holds them: the arena's blobs (engine/cuda/arena.py ExpertArena's
    host_ptr and layout), or the GGUF's mapped tensors when there is no arena (--mmap-experts, or no GPU)."""
    if arena is None:
        return ExpertTable.from_model(model)
    return ExpertTable.from_blobs(arena.host_ptr, arena.layout.layers, model.config.n_expert,
                                  model_activation(model), model_biases(model), (arena,))


def cpu_facts(model, link_gbps: float, arena=None, threads: int | None = None, hit_rate: float = 0.0,
              calls: int = 12) -> dict:
    """The CALIBRATE keys of the CPU's half (module docstring). link_gbps: the link's measured rate (pcie_gbps);
    hit_rate: the share of routed experts found in VRAM (the chats' hit rate, or the cached share)."""
    from engine.cpu_expert_pool import measure_gbps
    cfg = model.config
    threads = default_threads() if threads is None else threads
    table = host_table(model, arena)
    k = min(cfg.n_expert_used, cfg.n_expert)
    gbps = measure_gbps(table, threads, k=k, calls=calls)
    layers = [il for il in range(table.n_layer) if table.types[il] is not None]
    expert_bytes = sum(table.expert_bytes(il) for il in layers) / len(layers)
    c, n = cpu_share.typical_split(cpu_share.Rates(link_gbps, gbps), expert_bytes, k, hit_rate)
    return {"cpu_gbps": round(gbps, 2), "cpu_threads": threads, "cpu_share_typical": f"{c} of {n}",
            "arg.tune.cpu_share": "auto" if c else "off", "arg.tune.cpu_gbps": round(gbps, 2),
            "arg.tune.link_gbps": round(link_gbps, 1), "arg.tune.cpu_threads": threads,
            "cpu_why": (f"CPU experts at {gbps:.1f} GB/s ({threads} threads) beside the link's {link_gbps:.1f}: a "
                        f"layer's {n} misses (hit rate {hit_rate:.2f}) would send {c} to the CPU")}
