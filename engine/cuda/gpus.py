"""Which GPUs the worker runs on (`--gpus`, `--layer-split`, `--show-split`), before the CUDA backend starts.

`before_start` resolves --gpus against the GPUs CUDA shows, probes each one (`probe_cards`: free VRAM within the
reserve and budget, and its host -> device copy rate), plans the layer split (engine/cuda/layer_split.py) and logs
it. One GPU: the backend starts on it. Several stages on one GPU (`--gpus 0,0`, the test mode): the staged backend
(engine/cuda/staged_backend.py) starts with the plan's counts. Stages on separate GPUs are not built yet, so the
worker says so and exits (never a silent run on one of them); --show-split prints the plan and exits either way.

CuPy is imported inside the functions: the worker imports this module only on the CUDA path.
"""
from __future__ import annotations

import time
from dataclasses import replace

from engine.cuda import layer_split as ls

MiB = 2 ** 20
# Stages on separate GPUs (per-card weights, KV and kernels): not built. When they are this turns True, and setup
# then asks whether to use several GPUs (setup/gpus.py).
STAGES_BUILT = False
# Stages sharing one GPU (--gpus 0,0, a test mode setup never offers): engine/cuda/staged_backend.py, which
# tests/test_cuda_staged_backend.py holds to one stage on every splittable family's fixtures (its H200 runs:
# docs/experiments.md).
SHARED_GPU_STAGES = True
PROBE_BYTES = 64 * MiB      # a probe copy: large enough that the link's rate, not the copy's latency, is timed
PROBE_REPEATS = 4
NOT_BUILT = ("stages on separate GPUs are not built yet (issue 32): the stages run only on one GPU, sharing its "
             "weights and KV cache (the test mode, e.g. --gpus 0,0), with no per-card weights or KV, so the worker "
             "runs on one GPU. The split above is what they will run; name one GPU (--gpus 0), or --show-split to "
             "print the plan only")


class GpuError(ValueError):
    """A --gpus / --layer-split this PC cannot run; one line, with what to change."""


def device_count() -> int:
    import cupy as cp
    return int(cp.cuda.runtime.getDeviceCount())


def resolve(gpus, n_devices: int) -> list[int]:
    """--gpus (None, "auto" or indices) as device indices, checked against the n_devices CUDA shows."""
    if n_devices < 1:
        raise GpuError("CUDA shows no GPU here; --gpus needs one (or --backend cpu)")
    if gpus is None:
        return [0]
    if gpus == "auto":
        return list(range(n_devices))
    bad = [i for i in gpus if i >= n_devices]
    if bad:
        shown = ",".join(str(i) for i in gpus)
        have = "GPU 0" if n_devices == 1 else f"GPUs 0-{n_devices - 1}"
        raise GpuError(f"--gpus {shown}: there is no GPU {bad[0]}; CUDA shows {n_devices} here ({have})")
    return list(gpus)


def shared_cards(ids: list[int], cards: list[ls.Card]) -> list[ls.Card]:
    """The cards of a stage list whose devices may repeat (--gpus 0,0), from one probe a device (`cards`, in the
    order of the distinct ids): a device listed k times gives each of its stages 1/k of its free VRAM."""
    by = {c.index: c for c in cards}
    return [replace(by[i], free_bytes=by[i].free_bytes // ids.count(i)) for i in ids]


def cannot_split(model) -> str | None:
    """Why this model's family cannot run as stages (its stage_split), else None."""
    from engine.cuda.families.registry import family_for
    try:
        fam = family_for(model.config)
    except ValueError as e:
        return str(e)
    if fam.stage_split:
        return None
    return (f"the {fam.name} family ({model.config.arch}) cannot be split into stages: its layers carry more than "
            f"the hidden state from one layer to the next (engine/cuda/families/{fam.name}.py stage_split); run it on "
            f"one GPU: drop --layer-split and name one GPU (--gpus 0)")


def probe_cards(ids: list[int], reserve_mib: int, budget_mib: int | None) -> list[ls.Card]:
    """Each GPU's name, the VRAM this worker may take on it (free less the reserve, at most the budget: with
    several GPUs --vram-budget-mib caps each one) and its host -> device copy rate (pinned host memory, like the
    expert arena's)."""
    import cupy as cp
    rt = cp.cuda.runtime
    cards = []
    host = rt.hostAlloc(PROBE_BYTES, 0x01)          # cudaHostAllocPortable: every GPU copies from it at full rate
    try:
        for i in ids:
            with cp.cuda.Device(i):
                props = rt.getDeviceProperties(i)
                name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
                free, _ = rt.memGetInfo()
                take = max(0, free - reserve_mib * MiB)
                if budget_mib is not None:
                    take = min(take, budget_mib * MiB)
                dst = cp.empty(PROBE_BYTES, dtype=cp.uint8)
                stream = cp.cuda.Stream(non_blocking=True)
                rt.memcpyAsync(dst.data.ptr, host, PROBE_BYTES, rt.memcpyHostToDevice, stream.ptr)   # warm-up
                stream.synchronize()
                t0 = time.perf_counter()
                for _ in range(PROBE_REPEATS):
                    rt.memcpyAsync(dst.data.ptr, host, PROBE_BYTES, rt.memcpyHostToDevice, stream.ptr)
                stream.synchronize()
                gbps = PROBE_REPEATS * PROBE_BYTES / (time.perf_counter() - t0) / 1e9
                del dst
                cp.get_default_memory_pool().free_all_blocks()
            cards.append(ls.Card(i, name, int(take), gbps))
    finally:
        rt.freeHost(host)
    return cards


def plan_for(args, model, ctx: int, cards: list[ls.Card]) -> ls.SplitPlan:
    """The split of `model` at `ctx` over `cards` as --layer-split asks (auto when not given)."""
    from engine.cuda.chunk_plan import chunk_bytes
    cfg = model.config
    costs = ls.model_layer_costs(model, ctx, getattr(args, "kv", None) or "f16")
    chunk = min(getattr(args, "prefill_chunk", None) or 4096, ctx)   # prefill.py AUTO_TARGET: 4,096 targeted
    split = getattr(args, "layer_split", None) or "auto"
    shared = len({c.index for c in cards}) < len(cards)      # stages sharing a GPU (shared_cards)
    return costs.plan(cards, split, work_bytes=chunk_bytes(cfg, chunk), shared=shared)


def before_start(args, model, ctx: int, log) -> int | None:
    """None: start the backend (on the one GPU named, now the current device); else the worker's exit status, the
    reason already printed."""
    gpus, split = getattr(args, "gpus", None), getattr(args, "layer_split", None)
    show = bool(getattr(args, "show_split", False))
    if gpus is None and split is None and not show:
        return None
    from engine.cuda import _signals_stay_with_python
    with _signals_stay_with_python():       # a context on another card starts driver threads too
        return _before_start(args, model, ctx, log, gpus, split, show)


def _before_start(args, model, ctx, log, gpus, split, show) -> int | None:
    try:
        ids = resolve(gpus, device_count())
        if isinstance(split, tuple) and len(split) != len(ids):
            raise GpuError(f"--layer-split {','.join(map(str, split))} gives {len(split)} stages for {len(ids)} "
                           f"GPU(s) ({','.join(map(str, ids))}): give one count a GPU")
        several = len(ids) > 1
        plan = None
        if several and not show:
            why = cannot_split(model)
            if why:
                raise GpuError(why)
        if several or show:
            from engine.cuda.args import CudaOptions
            reserve = getattr(args, "vram_reserve_mib", None)
            reserve = CudaOptions().vram_reserve_mib if reserve is None else reserve
            distinct = list(dict.fromkeys(ids))
            cards = shared_cards(ids, probe_cards(distinct, reserve, getattr(args, "vram_budget_mib", None)))
            plan = plan_for(args, model, ctx, cards)
            for line in ls.format_plan(plan):
                log(line)
    except (GpuError, ls.SplitError) as e:
        print(f"strata_worker: {e}", flush=True, file=_stderr())
        return 2
    if show:
        return 0
    one_gpu = len(set(ids)) == 1
    if several and not (one_gpu and SHARED_GPU_STAGES):     # separate cards start here once STAGES_BUILT
        print(f"strata_worker: {NOT_BUILT}", flush=True, file=_stderr())
        return 2
    use_device(ids[0])
    if several:     # the staged backend's stages (engine/cuda/__init__.py create_backend): the plan's counts
        args.gpus, args.layer_split = tuple(ids), tuple(plan.counts)
        log(f"{len(ids)} stages on GPU {ids[0]} (--gpus {','.join(map(str, ids))}: the test mode; they share its "
            f"weights and KV cache, the plan's per-card weights above are not separate here)")
    else:
        log(f"GPU {ids[0]} (--gpus)")
    return None


def use_device(i: int) -> None:
    """The backend starts on CUDA device i (the current device from here on)."""
    import cupy as cp
    cp.cuda.Device(i).use()


def _stderr():
    import sys
    return sys.stderr
