"""Where the token embedding lives: VRAM, or mapped pinned host memory that the embed kernel reads in place over PCIe
(one row per decoded token, T rows per prompt chunk). Where decode is bound by the PCIe bytes of missed experts, the
table's VRAM is worth more as expert-cache slots than as a copy a decode step reads one row of (docs/experiments.md).

This module only decides (no CuPy, tested on the CPU); engine/cuda/weights.py moves the bytes and
engine/cuda/backend.py measures the slot counts."""
from __future__ import annotations

def embed_placement(choice: bool | None, tied: bool, slots_vram: int, slots_host: int, total: int) -> tuple[str, str]:
    """("vram" | "host", why). slots_vram / slots_host: the expert slots the VRAM cache gets with the embedding in
    VRAM / on the host, after every cap (--vram-budget-mib, --expert-slots, the prefetch's staging); total: experts
    in the model. choice (CudaOptions.embed_host): None moves it only when that buys the cache slots it could not
    otherwise have; True (A/B runs, tests) whenever it is not tied; False never."""
    if tied:        # the output head reads the whole matrix every token: over PCIe that would be the step
        return "vram", "tied to the output head, which reads all of it every token"
    if choice is False:
        return "vram", "--tune embed_host=off"
    if choice is True:
        return "host", "--tune embed_host=on"
    if slots_vram >= total:
        return "vram", f"every expert fits in VRAM ({total})"
    if slots_host <= slots_vram:
        return "vram", (f"its VRAM would buy the expert cache no slot ({slots_vram} of {total} experts cached either "
                        f"way)")
    return "host", (f"the expert cache holds {slots_vram} of {total} experts with it in VRAM, {slots_host} without "
                    f"(+{slots_host - slots_vram} slots)")
