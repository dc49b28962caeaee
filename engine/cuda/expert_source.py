"""Where each expert's bytes live in host memory, for the two memory modes (--mmap-experts, --resident-budget-gib N).

An expert is either pinned in the arena (a mapped address the GPU reads in place) or only in the GGUF file. A
file-only expert reaches the GPU through a small pinned staging LRU: helper threads copy its gate/up/down slabs from
the memory-mapped file (the OS file cache, or the disk) into a mapped pinned slot, whose device address then serves
like an arena address (docs/design.md: a kernel never reads pageable memory).

Rules that keep the GPU from reading a slot that is being refilled:
- `stage()` pins the slots it returns until the caller's `release()`: a pinned slot is never evicted. Pins never
  outlive one host function (stage, enqueue the readers, release), so they cannot starve each other.
- `release(gs, fence)` / `fence(gs, ev)`: the event after the last enqueued reader of those slots. A slot is
  refilled only after every fence it carries has completed (the host waits on it).
- A staged expert stays reachable through the pointer table (the cache points its entry at the slot) until the LRU
  evicts it; `note_table_reads(ev)` is the event after the last launch that read through the table, and evicting a
  table-visible slot waits on it too. Then `on_evict(g)` lets the cache reset g's entry to 0 (unreachable) before
  anything else is launched.

This module imports no CuPy: the GPU-facing pieces (pinned allocation, device addresses, events) are passed in, so
the bookkeeping is tested on the CPU with fakes.
"""
from __future__ import annotations

import os
import sys
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

GiB = 1 << 30
MiB = 1 << 20
STAGING_MAX_BYTES = 512 * MiB      # the auto staging LRU: at most this much pinned memory ...
STAGING_STEPS = 2                  # ... or two decode steps' worth of routed experts, whichever is smaller


class StagingError(MemoryError):
    """The pinned staging ring could not be allocated; the message says what to do."""


class ExpertFileError(OSError):
    """Expert bytes could not be read from the memory-mapped model file; the message says what to do."""


# --- placement: which experts the arena pins -------------------------------------------------------------------
def router_norm_order(model) -> np.ndarray:
    """Global expert ids (layer * n_expert + e), most likely routed first, without a profile.

    A router logit is the dot product of the hidden state with the expert's router row, so an expert whose row is
    longer has a logit of larger spread and lands in the top-k more often (the project's synthetic models are built
    with Zipf-like router-row norms for this reason, mimicking the skew of real routing). Norms are divided by their
    layer's mean so every layer gets a fair share of the budget instead of the layers whose routers are larger
    overall taking it all; ties keep layer-major order."""
    cfg = model.config
    score = np.zeros(cfg.n_layer * cfg.n_expert, dtype=np.float64)
    for li in range(cfg.n_layer):
        w = model.dequant(f"blk.{li}.ffn_gate_inp.weight").reshape(cfg.n_expert, -1).astype(np.float64)
        n = np.linalg.norm(w, axis=1)
        score[li * cfg.n_expert:(li + 1) * cfg.n_expert] = n / max(float(n.mean()), 1e-30)
    return np.argsort(-score, kind="stable").astype(np.int64)


def merged_order(n_total: int, first, then) -> np.ndarray:
    """`first` (e.g. a profile's ranked experts), then every expert it leaves out in `then`'s order."""
    first = np.asarray(first if first is not None else [], dtype=np.int64)
    seen = np.zeros(n_total, dtype=bool)
    seen[first] = True
    then = np.asarray(then, dtype=np.int64)
    return np.concatenate([first, then[~seen[then]]])


def vram_aware_order(order, n_vram: int) -> np.ndarray:
    """The pinning order given that the VRAM cache holds the first n_vram of `order` (it is filled in the same
    order, and the adaptive tier keeps the hottest): an expert in VRAM needs no host copy to be read, so the budget
    goes to the next-hottest first, which roughly doubles the routing that VRAM and RAM cover together. The VRAM
    ones come last, coldest first (the tier evicts those first; an evicted expert without a host copy is staged from
    the file when next routed)."""
    order = np.asarray(order, dtype=np.int64)
    n = max(0, min(int(n_vram), len(order)))
    return np.concatenate([order[n:], order[:n][::-1]])


def pinned_mask(n_total: int, stride, budget_bytes: float | None, order) -> np.ndarray:
    """Which experts the arena pins: every one without a budget; else the first of `order` that fit in budget_bytes
    (whole blobs of `stride` bytes: one int, or one per expert where the layers' blobs differ). --mmap-experts is a
    budget of 0."""
    mask = np.zeros(n_total, dtype=bool)
    if budget_bytes is None:
        mask[:] = True
        return mask
    if budget_bytes < 0:
        raise ValueError(f"the resident budget must be >= 0 GiB, got {budget_bytes / GiB:g}")
    order = np.asarray(order, dtype=np.int64)
    if len(np.unique(order)) != n_total or len(order) != n_total:
        raise ValueError("the placement order must name every expert exactly once")
    sizes = np.broadcast_to(np.asarray(stride, dtype=np.int64), (n_total,))
    n = int(np.searchsorted(np.cumsum(sizes[order]), budget_bytes, side="right"))
    mask[order[:n]] = True
    return mask


def staging_slots(n_layer: int, k: int, stride: int, n_file_only: int, ring_batch: int = 0,
                  requested: int | None = None, group: int = 0) -> int:
    """Slots of the staging LRU. It must hold one layer's routed experts at once (k), one batch of the streamed
    prompt pass's ring, and `group` (the streamed pass's in-place group of a chunk too short for the ring: every expert
    a layer's tokens route to, pinned together); beyond that, two decode steps' routed experts, within
    STAGING_MAX_BYTES, and never more than there are file-only experts."""
    need = max(k, ring_batch, group, 1) + 1
    if requested is not None:
        if requested < need:
            raise ValueError(f"the staging ring needs at least {need} slots (top-k {k}, ring batch {ring_batch}, "
                             f"in-place group {group}), got {requested}")
        return int(requested)
    want = min(STAGING_STEPS * n_layer * k, max(1, STAGING_MAX_BYTES // max(stride, 1)))
    return int(max(need, min(want, max(n_file_only, 1))))


# --- reading one expert from the file --------------------------------------------------------------------------
def expert_sources(model, layout, layer: int, e: int):
    """(destination offset, source bytes) of expert e's gate, up and down slabs: memory-mapped views of the file.
    layout: arena.ExpertLayout (each layer's blob its own)."""
    lay = layout.layer(layer)
    offs = (0, lay.up_off, lay.down_off)
    return [(off, model.expert_bytes(layer, kind, e).reshape(-1)) for kind, off in zip(("gate", "up", "down"), offs)]


def read_blob(model, layout, layer: int, e: int, dst: np.ndarray) -> int:
    """Copy expert e of `layer` into dst (uint8, at least that layer's blob) in the blob layout; returns bytes read."""
    n = 0
    try:
        for off, src in expert_sources(model, layout, layer, e):
            dst[off:off + src.size] = src
            n += src.size
    except (OSError, ValueError) as err:
        raise ExpertFileError(f"reading expert {e} of layer {layer} from the memory-mapped model file failed ({err}); "
                              f"the file system may not support memory maps or the file changed: copy the model to "
                              f"a local disk, or run without --mmap-experts / --resident-budget-gib") from None
    return n


# --- the staging LRU -------------------------------------------------------------------------------------------
class StagingLRU:
    """Bookkeeping of the staging slots: which expert each holds, recency, pins and fences. No memory, no I/O."""

    def __init__(self, n_slots: int):
        if n_slots < 1:
            raise ValueError("the staging ring needs at least one slot")
        self.n_slots = n_slots
        self.expert = np.full(n_slots, -1, dtype=np.int64)
        self.slot_of: dict[int, int] = {}
        self.order: OrderedDict[int, None] = OrderedDict((s, None) for s in range(n_slots))   # least recent first
        self.pins = np.zeros(n_slots, dtype=np.int64)
        self.fences: list[list] = [[] for _ in range(n_slots)]

    def lookup(self, g: int) -> int | None:
        s = self.slot_of.get(int(g))
        if s is not None:
            self.order.move_to_end(s)
        return s

    def victim(self) -> int:
        """The least recently used slot that is not pinned."""
        for s in self.order:
            if not self.pins[s]:
                return s
        raise RuntimeError(f"all {self.n_slots} staging slots are pinned at once; the staging ring is too small")

    def assign(self, s: int, g: int) -> int:
        """Slot s now holds g (the caller has waited for s's fences); returns the expert it held before, or -1."""
        old = int(self.expert[s])
        if old >= 0:
            del self.slot_of[old]
        self.expert[s] = g
        self.slot_of[int(g)] = s
        self.fences[s] = []
        self.order.move_to_end(s)
        return old

    def pin(self, s: int):
        self.pins[s] += 1

    def unpin(self, s: int):
        if self.pins[s] <= 0:
            raise RuntimeError(f"staging slot {s} released more often than staged")
        self.pins[s] -= 1

    def add_fence(self, s: int, ev) -> None:
        if ev is not None:
            self.fences[s] = [f for f in self.fences[s] if not _done(f)] + [ev]


def _done(ev) -> bool:
    return bool(ev.done)


class ExpertSource:
    """Host addresses of every expert: the arena's for pinned ones, a staging slot's (or 0) for file-only ones.

    model: the GGUFModel (its memory map is the file source); layout: arena.ExpertLayout (a slot holds its largest
    blob); arena_ptr: uint64 per global
    expert, the arena's device address or 0 for file-only; n_slots: staging slots; alloc(nbytes) -> (host numpy uint8
    view, device address) of mapped pinned memory; free() undoes it (the caller keeps it)."""

    def __init__(self, model, layout, arena_ptr: np.ndarray, n_slots: int, alloc, threads: int = 8,
                 on_evict=lambda g: None, log=lambda m: print(m, file=sys.stderr, flush=True)):
        self.model, self.layout = model, layout
        self.n_expert = model.config.n_expert
        self.arena_ptr = np.asarray(arena_ptr, dtype=np.uint64)
        self.n_total = len(self.arena_ptr)
        self.file_only = self.arena_ptr == 0
        self.stride = layout.stride
        self.lru = StagingLRU(n_slots)
        try:
            self.host, dptr = alloc(n_slots * self.stride)
        except Exception as e:
            raise StagingError(f"pinning {n_slots * self.stride / MiB:.0f} MiB of host memory for the expert staging "
                               f"ring failed ({e}); free RAM, or lower --resident-budget-gib") from None
        self.slot_dptr = np.array([int(dptr) + s * self.stride for s in range(n_slots)], dtype=np.uint64)
        self.on_evict = on_evict
        self.table_fence = None
        self._visible = np.zeros(n_slots, dtype=bool)    # the pointer table may point at this slot
        self._pool = ThreadPoolExecutor(max(1, threads)) if threads > 1 else None
        self.file_blobs = 0
        self.file_bytes = 0
        self.staged_hits = 0
        self.log = log
        self._fds: dict = {}                # model file -> descriptor for read-ahead hints
        self._advise_failed = False

    @property
    def nbytes(self) -> int:
        return self.lru.n_slots * self.stride

    # --- addresses -------------------------------------------------------------------------------------------
    def addr(self, g: int) -> int:
        """The device address expert g can be read from now without touching the file, or 0."""
        a = int(self.arena_ptr[g])
        if a:
            return a
        s = self.lru.slot_of.get(int(g))
        return int(self.slot_dptr[s]) if s is not None else 0

    def addrs(self) -> np.ndarray:
        out = self.arena_ptr.copy()
        for g, s in self.lru.slot_of.items():
            out[g] = self.slot_dptr[s]
        return out

    # --- staging ---------------------------------------------------------------------------------------------
    def stage(self, gs) -> tuple[list[int], int]:
        """Make every expert in gs readable from pinned memory and pin the staging slots among them until
        release(gs). Returns (device addresses, how many were read from the file). File reads run on helper threads."""
        gs = [int(g) for g in gs]
        addrs = [0] * len(gs)
        todo = []                          # (index, slot, g) to read from the file
        pinned = []                        # slots this call pinned: unpinned again if it fails part-way
        try:
            for i, g in enumerate(gs):
                a = int(self.arena_ptr[g])
                if a:
                    addrs[i] = a
                    continue
                s = self.lru.lookup(g)
                if s is None:
                    s = self.lru.victim()
                    self._wait(s)
                    old = self.lru.assign(s, g)
                    self._visible[s] = False
                    if old >= 0:
                        self.on_evict(old)
                    todo.append((i, s, g))
                else:
                    self.staged_hits += 1
                self.lru.pin(s)
                pinned.append(s)
                addrs[i] = int(self.slot_dptr[s])
        except BaseException:
            # e.g. more experts at once than unpinned slots: a pin left behind would make every later stage() fail
            # the same way (the worker wedged); the slots assigned but not read hold nothing valid
            for _, s, g in todo:
                self.lru.expert[s] = -1
                self.lru.slot_of.pop(g, None)
            for s in pinned:
                self.lru.unpin(s)
            raise
        if todo:
            try:
                self._read([(s, g) for _, s, g in todo])
            except BaseException:
                bad = {g for _, _, g in todo}
                for _, s, g in todo:          # these slots hold nothing valid: forget them
                    self.lru.unpin(s)
                    self.lru.expert[s] = -1
                    self.lru.slot_of.pop(g, None)
                self.release([g for g in gs if g not in bad])
                raise
        return addrs, len(todo)

    def _read(self, items):
        lay, E = self.layout, self.n_expert

        def one(item):
            s, g = item
            dst = self.host[s * self.stride:(s + 1) * self.stride]
            return read_blob(self.model, lay, g // E, g % E, dst)

        if self._pool is not None and len(items) > 1:
            # every read finishes before this returns or raises: a read still running after a failure would write
            # into a slot that stage() has already given back
            futs = [self._pool.submit(one, it) for it in items]
            wait(futs)
            sizes = [f.result() for f in futs]
        else:
            sizes = [one(it) for it in items]
        self.file_blobs += len(items)
        self.file_bytes += sum(sizes)

    def _wait(self, s: int):
        """Before slot s is refilled: every reader of it has finished."""
        for ev in self.lru.fences[s]:
            if not _done(ev):
                ev.synchronize()
        if self._visible[s] and self.table_fence is not None and not _done(self.table_fence):
            self.table_fence.synchronize()

    def release(self, gs, fence=None) -> None:
        """The readers of gs's staging slots are enqueued; fence: the event after them (None: already done)."""
        for g in gs:
            s = self.lru.slot_of.get(int(g))
            if s is None or self.arena_ptr[int(g)]:
                continue
            self.lru.add_fence(s, fence)
            self.lru.unpin(s)

    def fence(self, gs, ev) -> None:
        """Readers of staged experts that did not pin them (copies the cache starts from a staged slot)."""
        for g in gs:
            s = self.lru.slot_of.get(int(g))
            if s is not None:
                self.lru.add_fence(s, ev)

    def mark_visible(self, gs) -> None:
        """The pointer table now points at these experts' staging slots."""
        for g in gs:
            s = self.lru.slot_of.get(int(g))
            if s is not None:
                self._visible[s] = True

    def note_table_reads(self, ev) -> None:
        self.table_fence = ev

    # --- read-ahead --------------------------------------------------------------------------------------------
    def advise(self, gs) -> int:
        """Ask the OS to start reading these experts' file pages (posix_fadvise WILLNEED) so the disk works while
        the host copies others; only for file-only experts the LRU does not hold. Returns how many were advised
        (0 where the OS has no posix_fadvise)."""
        if not hasattr(os, "posix_fadvise"):
            return 0
        n = 0
        E = self.n_expert
        for g in gs:
            g = int(g)
            if not self.file_only[g] or g in self.lru.slot_of:
                continue
            for kind in ("gate", "up", "down"):
                t = self.model.tensor(self.model.expert_name(g // E, kind))
                per = t.data[0].nbytes
                try:
                    os.posix_fadvise(self._fd(t.path), t.offset + (g % E) * per, per, os.POSIX_FADV_WILLNEED)
                except OSError as e:        # a hint the file system refuses: say so once, read without it
                    if not self._advise_failed:
                        self._advise_failed = True
                        self.log(f"expert staging: the OS refused read-ahead hints for {t.path.name} ({e}); "
                                 f"experts are read on demand")
                    return n
            n += 1
        return n

    def _fd(self, path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    # --- reporting -------------------------------------------------------------------------------------------
    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.host = None
