"""Setup's GPU question on a PC with several NVIDIA cards: one card, or the layers split across several.

Setup recommends and never forces: the default answer is one card (or what the config already says), so `--yes`
never spreads a model across cards on its own. Several cards pay a hand-off a token and give each stage its own
expert cache and link, which buys speed only when one card's VRAM cannot hold the experts: that is the
recommendation's test. The answer goes into the config's `gpu` (one card) or `gpus` (several; the worker splits
the layers, `layer_split` stays null for its auto split).

Standard library only, like the steps before the packages step.
"""
from __future__ import annotations

from .catalog import CUDA_CONTEXT, GPU_WORKSPACE, best_gpu, fmt_gib
from .machine import MIB, Machine

# A second card is recommended when it lets at least this much more of the experts sit in VRAM: below that its
# hand-off costs about what its cache saves.
MIN_GAIN_SHARE = 0.10


def stages_built() -> bool:
    """Whether the worker runs several GPUs (engine/cuda/gpus.py STAGES_BUILT)."""
    from engine.cuda.gpus import STAGES_BUILT
    return bool(STAGES_BUILT)


def expert_room(m: Machine, ids: list[int], dense_bytes: int, kv_bytes: int, reserve_mib: int) -> int:
    """VRAM left for the expert caches when the cards `ids` hold the model's weights and KV between them, each
    with its own CUDA context, workspace and reserve."""
    total = sum(g.vram_total_mib for g in m.gpus if g.index in ids) * MIB
    return max(0, total - dense_bytes - kv_bytes - len(ids) * (CUDA_CONTEXT + GPU_WORKSPACE + reserve_mib * MIB))


def recommend(m: Machine, expert_bytes: int, dense_bytes: int, kv_bytes: int,
              reserve_mib: int) -> tuple[list[int], str]:
    """(the cards setup recommends, why). One card unless every card together caches clearly more experts."""
    one = [best_gpu(m).index]
    every = [g.index for g in m.gpus]
    room_one = expert_room(m, one, dense_bytes, kv_bytes, reserve_mib)
    room_all = expert_room(m, every, dense_bytes, kv_bytes, reserve_mib)
    if not expert_bytes:
        return one, "the model has no experts to cache: one card runs it without a hand-off between cards"
    held_one, held_all = min(room_one, expert_bytes), min(room_all, expert_bytes)
    if held_one >= expert_bytes:
        return one, (f"GPU {one[0]} holds all {fmt_gib(expert_bytes)} of experts: more cards would only add a "
                     f"hand-off a token")
    if held_all - held_one < MIN_GAIN_SHARE * expert_bytes:
        return one, (f"the cards together cache {fmt_gib(held_all)} of the {fmt_gib(expert_bytes)} of experts, "
                     f"GPU {one[0]} alone {fmt_gib(held_one)}: too little more for a hand-off a token")
    return every, (f"one card caches {fmt_gib(held_one)} of the {fmt_gib(expert_bytes)} of experts, all "
                   f"{len(every)} together {fmt_gib(held_all)}, each with its own link for the rest")


def parse_answer(answer: str, m: Machine) -> list[int] | str:
    """'one' | 'all' | indices such as 0,1 -> the cards; else a message saying what is expected."""
    a = answer.strip().lower()
    if a == "one":
        return [best_gpu(m).index]
    if a == "all":
        return [g.index for g in m.gpus]
    try:
        ids = [int(x) for x in a.replace(" ", "").split(",")]
    except ValueError:
        ids = []
    have = {g.index for g in m.gpus}
    if not ids or len(set(ids)) != len(ids) or not set(ids) <= have:
        return (f"{answer!r}: answer one, all, or GPU indices among {', '.join(str(i) for i in sorted(have))} "
                f"(such as {','.join(str(i) for i in sorted(have)[:2])})")
    return ids


def show(ids: list[int]) -> str:
    return "one" if len(ids) == 1 else ",".join(str(i) for i in ids)


def remembered(previous: dict | None, m: Machine) -> tuple[list[int] | None, str | None]:
    """The cards an earlier config chose (`gpus`, else `gpu`), or None; and a warning when they are not all on this
    PC any more (the choice is then made again)."""
    prev = previous or {}
    ids = prev.get("gpus") or ([prev["gpu"]] if isinstance(prev.get("gpu"), int) else None)
    if not ids:
        return None, None
    have = {g.index for g in m.gpus}
    if not set(ids) <= have:
        gone = sorted(set(ids) - have)
        return None, (f"the config's GPU {', '.join(map(str, gone))} is not on this PC any more (nvidia-smi lists "
                      f"{', '.join(map(str, sorted(have))) or 'none'}); choosing again")
    return list(ids), None


def env_for(ids: list[int] | None) -> dict:
    """What server/config.py worker_env sets for these cards, for the calibration run."""
    if not ids:
        return {}
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in ids)}
