"""The CUDA backend's memory modes, wired together: --mmap-experts (no expert pinned up front) and
--resident-budget-gib N (the hottest N GiB pinned, the profile order, docs/design.md "Files", else router-row norms).

`MemoryMode.plan()` decides which experts the arena pins; `attach_cache()` gives the expert cache its source (the
file through a pinned staging LRU, engine/cuda/expert_source.py), `paged_decode()` runs the decode step in its
per-layer form (engine/cuda/decode_paged.py), and `ring_device()` lets the prompt pass's ring stage what it reads.
The backend only calls these.
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from engine.cuda.arena import PinnedBuffer
from engine.cuda.decode_paged import PagedDecode
from engine.cuda.expert_source import (GiB, MiB, ExpertSource, merged_order, pinned_mask, router_norm_order,
                                       staging_slots, vram_aware_order)
from engine.cuda.ring import BATCH_MAX as RING_BATCH_MAX
from engine.profile import load_profile



def _event(stream):
    ev = cp.cuda.Event(disable_timing=True)
    ev.record(stream)
    return ev


class MemoryMode:
    def __init__(self, name: str, pinned: np.ndarray):
        self.name = name                   # "mmap" | "budget"
        self.pinned = pinned
        self.source = self.buffer = self.paged = self.cache = None
        self._base = (0, 0, 0)             # the source's counters at reset_stats

    @classmethod
    def plan(cls, model, opts, layout, log, n_vram: int = 0):
        """None when every expert is pinned (no mode, or a budget that holds them all). n_vram: the VRAM cache's
        slots (engine/cuda/expert_source.py vram_aware_order: the budget goes to the experts after those)."""
        if not model.config.is_moe or not (opts.mmap_experts or opts.resident_budget_gib is not None):
            if opts.mmap_experts or opts.resident_budget_gib is not None:
                log("memory mode: the model has no experts, so --mmap-experts / --resident-budget-gib change nothing")
            return None
        cfg = model.config
        n_total = cfg.n_layer * cfg.n_expert
        budget = 0.0 if opts.mmap_experts else float(opts.resident_budget_gib) * GiB
        sizes = layout.expert_strides(cfg.n_expert)        # a recipe's layers differ in blob size
        if budget >= sizes.sum():
            log(f"memory mode: the budget of {opts.resident_budget_gib:g} GiB holds all "
                f"{sizes.sum() / GiB:.2f} GiB of experts: every expert is pinned")
            return None
        first, src = None, "router-row norms (no --expert-profile)"
        if opts.expert_profile:
            first = load_profile(opts.expert_profile, cfg.n_layer, cfg.n_expert).flat_order()
            src = f"profile {opts.expert_profile}, then router-row norms"
        # VRAM starts with the profile's first experts (the backend's first fill), every expert when all fit, else
        # nothing: only experts it will hold may be left out of the budget, or the hottest would be neither in VRAM
        # nor pinned, read from the file until the adaptive tier (which swaps in only pinned or staged ones) gets
        # to them
        if n_vram < n_total:
            n_vram = min(int(n_vram), len(first)) if first is not None else 0
        order = merged_order(n_total, first, router_norm_order(model)) if budget else np.arange(n_total)
        mask = pinned_mask(n_total, sizes, budget, vram_aware_order(order, n_vram))
        name = "mmap" if opts.mmap_experts else "budget"
        what = (f"{int(mask.sum())} of {n_total} experts pinned ({sizes[mask].sum() / GiB:.2f} GiB, "
                f"the hottest by {src} after the {min(n_vram, n_total)} the VRAM cache holds)" if budget
                else f"no expert pinned, all {n_total} read from the file")
        log(f"memory mode {name}: {what}; the rest are read from {model.path.name} through the OS file cache")
        return cls(name, mask)

    # --- wiring ----------------------------------------------------------------------------------------------
    def attach_cache(self, model, arena, cache, stream, opts, log):
        cfg = model.config
        # a ring batch is at most half the ring, and the ring holds at most every expert
        ring_batch = min(RING_BATCH_MAX, cfg.n_layer * cfg.n_expert // 2)
        # a chunk too short for the ring pins every file-only expert its tokens route to in a layer at once
        # (routed_group): up to a layer's file-only experts
        group = int((~self.pinned).reshape(cfg.n_layer, cfg.n_expert).sum(axis=1).max())
        n = staging_slots(cfg.n_layer, cfg.n_expert_used, arena.layout.stride, int((~self.pinned).sum()),
                          ring_batch, getattr(opts, "staging_slots", None), group=group)
        try:
            self.buffer = PinnedBuffer(n * arena.layout.stride)
        except cp.cuda.runtime.CUDARuntimeError as e:
            from engine.cuda.expert_source import StagingError
            raise StagingError(f"pinning {n * arena.layout.stride / MiB:.0f} MiB of host memory for the expert "
                               f"staging ring failed ({e}); free RAM, or lower --resident-budget-gib") from None
        self.source = ExpertSource(model, arena.layout, arena.blob_ptr, n,
                                   alloc=lambda nbytes: (self.buffer.view, self.buffer.dptr),
                                   on_evict=lambda g: self.cache.on_evict(g, stream), log=log)
        self.cache = cache
        cache.set_source(self.source)
        log(f"expert staging ring: {n} slots ({self.source.nbytes / MiB:.0f} MiB pinned)")

    def paged_decode(self, step, use_graphs: bool) -> PagedDecode:
        """What runs the decode step (in place of step.launch): the whole step while every routed expert is
        readable, else part by part with the file-only ones staged."""
        self.paged = PagedDecode(step, self.cache, self.source, lambda: _event(step.stream), use_graphs)
        return self.paged

    def ring_device(self, dev) -> "StagedCopies":
        """The prompt pass's ring device (ring.py CupyDevice dev), copying file-only experts from staging slots."""
        return StagedCopies(dev, self.cache)

    # --- stats -----------------------------------------------------------------------------------------------
    def reset_stats(self):
        s = self.source
        self._base = (s.file_blobs, s.file_bytes, self.paged.decode_file_blobs if self.paged else 0)

    def stats(self, hits: int, lookups: int) -> tuple[int, int, float]:
        """(ram_blobs, file_blobs, file_mb) since reset_stats: decode misses served from pinned RAM; experts read
        from the file by the prompt pass and decode (as the NumPy backend counts them)."""
        s = self.source
        fb, fbytes, dfb = (s.file_blobs - self._base[0], s.file_bytes - self._base[1],
                           (self.paged.decode_file_blobs if self.paged else 0) - self._base[2])
        return max(0, lookups - hits - dfb), fb, fbytes / MiB

    def info(self) -> dict:
        out = {"memory": self.name, "experts_pinned": int(self.pinned.sum())}
        if self.source is not None:
            out["staging_mib"] = round(self.source.nbytes / MiB, 1)     # tiny models stage well under 1 MiB
        return out

    def close(self):
        cp.cuda.Device().synchronize()      # no copy (the cache's side stream included) still reads a staging slot
        if self.paged is not None:
            self.paged.close()
        if self.source is not None:
            self.source.close()
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


class StagedCopies:
    """A ring Device (engine/cuda/ring.py) whose copies from a staged slot keep that slot until the batch's copy
    event: the ring asks for a source per item (cache.ring_source stages and pins it), and the event the ring
    records on its copy stream after the batch releases the pins."""

    def __init__(self, dev, cache):
        self.dev, self.cache = dev, cache
        self.copy_stream, self.compute_stream = dev.copy_stream, dev.compute_stream
        self._pinned: list[int] = []
        self._layer = -1

    def __getattr__(self, name):
        return getattr(self.dev, name)

    def source_of(self, layer: int, e: int) -> int:
        cache = self.cache
        g = layer * cache.n_expert + e
        if cache.source is None or not cache.source.file_only[g]:
            return int(cache.arena.blob_ptr[g])
        if layer != self._layer:       # the ring goes layer by layer: let the disk start on the next one
            self._layer = layer
            nxt = (layer + 1) % cache.n_layer
            cache.source.advise(np.arange(nxt * cache.n_expert, (nxt + 1) * cache.n_expert)[~cache.resident()[
                nxt * cache.n_expert:(nxt + 1) * cache.n_expert]])
        (a,), _ = cache.stage([g], self.compute_stream)
        self._pinned.append(g)
        return a

    def copy(self, stream, dst, src, nbytes):
        self.dev.copy(stream, dst, src, nbytes)

    def record(self, stream, ev):
        self.dev.record(stream, ev)
        if stream is self.copy_stream and self._pinned:
            self.cache.source.release(self._pinned, ev)
            self._pinned = []


def routed_group(cache, li: int, ids, stream):
    """The streamed pass's in-place expert group of layer li in the memory modes (chunks that do not use the ring):
    only the routed experts, the file-only ones staged and pinned, so no kernel is handed a 0 address. Waits for the
    router. Returns (sel, ptrs, n), a function to call once the group's kernels are enqueued, and the device arrays the
    views point into (the caller keeps them until those kernels have run)."""
    from engine.cuda.launch import U64
    E = cache.n_expert
    es = np.unique(np.asarray(ids.get(stream=stream)).ravel()).astype(np.int64)
    flat = li * E + es
    need = flat[(cache.slot_of[flat] < 0) & cache.source.file_only[flat]]
    if len(need):
        cache.stage(need, stream)
    with stream:
        sel = cp.asarray(es.astype(np.int32))
        ptrs = cp.asarray(cache.table_host[flat])

    def done():
        if len(need):
            cache.source.release(need, _event(stream))
    return (U64(sel.data.ptr), U64(ptrs.data.ptr), len(es)), done, (sel, ptrs)
