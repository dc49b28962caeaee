"""The VRAM expert cache and the device pointer table.

table[g] (g = layer * n_expert + expert) is the device address the expert kernels read expert g from: its VRAM slot
when resident, else its blob in the mapped pinned arena. The router kernels count routing per expert into `counts`
and hits into `stats`. The adaptive tier decays the counts into `heat` (x0.7 per round) and swaps the hottest
non-resident experts into the slots of the coldest, on a copy stream, in this order:
  1. main stream: each victim's entry goes back to its arena address (kernels after this read the arena);
  2. copy stream, after 1 (an event): the newcomers' bytes are copied into the freed slots;
  3. main stream, once the copies have landed (polled, never waited on): the newcomers' entries point at their slots.

In the memory modes (`source`: engine/cuda/expert_source.py) an expert outside VRAM is at its arena address, at its
staging slot while the staging LRU holds it, or unreachable (entry 0; the paged decode step stages it first). The
tier then swaps in only experts reachable from pinned memory (the hot ones were staged when they were routed).

Decode runs a round in two halves so that it never waits for the GPU (a wait there would idle the GPU while the host
chooses swaps, with the next step already queued behind the pipelined one): adapt_start copies the counts into
pinned host memory and zeroes them, ordered on the stream; a later token's adapt_finish, once that copy has landed
(counts_landed), makes the round from them. adapt() and take_counts() add a started round's counts to theirs.

Lending (the streamed prompt pass's ring, engine/cuda/prefill.py): `lend` takes slots out of the cache,
free ones first, then the coldest occupied ones (never one a pending swap is filling); their experts' entries go
back to their home addresses on the main stream before the ring's copy stream may write the slots (the ring waits
on an event recorded after that). A lent slot's owner is LENT, so neither fill nor the adaptive tier touches it.
`give_back` refills lent slots with the hottest experts that have none, through the adaptive tier's swap path
(steps 2 and 3 above), after everything already enqueued on the main stream (the ring's last readers).

Slot pools (SlotPools: a pool per blob stride, for files whose layers differ in blob size) and a pipeline stage's
cache (`serves`): docs/design.md "Memory".
"""
from __future__ import annotations

import time

import cupy as cp
import numpy as np

from engine.cuda.expert_layout import SlotPools

DECAY = 0.7
FREE, LENT = -1, -2          # owner[s] of an empty slot, of a slot lent out (anything >= 0: the expert in it)


def coldest_order(owner, heat, prior) -> np.ndarray:
    """Occupied slots, coldest first: lowest heat, ties broken by the loaded profile's rank (a later rank, or none,
    is colder), then by slot number."""
    occ = np.flatnonzero(owner >= 0)
    g = owner[occ]
    rank = np.where(prior[g] >= 0, prior[g], len(prior))
    return occ[np.lexsort((occ, -rank, heat[g]))]


def lend_choice(owner, heat, prior, n: int, pending=(), occupied: bool = True, evictable=None,
                usable=None) -> np.ndarray:
    """Up to n slots to lend: free ones first, then (occupied=True) the coldest occupied ones whose expert is
    evictable (a bool per expert; None: all); never a slot in `pending` (a swap is copying into it) or already lent,
    and only slots that are `usable` (a bool per slot; None: all)."""
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    busy = np.zeros(len(owner), dtype=bool)
    busy[np.asarray(list(pending), dtype=np.int64)] = True
    if usable is not None:
        busy |= ~np.asarray(usable, dtype=bool)
    free = np.flatnonzero((owner == FREE) & ~busy)
    out = [free]
    if occupied:
        occ = coldest_order(owner, heat, prior)
        occ = occ[~busy[occ]]
        if evictable is not None:
            occ = occ[evictable[owner[occ]]]
        out.append(occ)
    return np.concatenate(out)[:n].astype(np.int64)


def refill_order(slot_of, heat, prior, readable) -> np.ndarray:
    """Experts without a slot that a copy can read now (readable: a bool per expert), hottest first: by heat, then
    by the profile's rank (unranked last), then by id: the adaptive tier's order."""
    gs = np.flatnonzero((slot_of < 0) & readable)
    rank = np.where(prior[gs] >= 0, prior[gs], len(prior))
    return gs[np.lexsort((gs, rank, -heat[gs]))]


def served_split(pools: SlotPools, expert_stride, serves, n: int) -> np.ndarray:
    """Slots per pool of `pools` (every expert's) for a cache of n slots that holds only the experts `serves` marks:
    split as SlotPools would split a cache of those experts alone (a pool none of them is in gets none)."""
    out = np.zeros(pools.n_pools, dtype=np.int64)
    serves = np.asarray(serves, dtype=bool)
    if serves.any():
        mine = SlotPools(np.asarray(expert_stride, dtype=np.int64)[serves])
        out[np.searchsorted(pools.strides, mine.strides)] = mine.split(n)
    return out


def learned_order(slot_of, heat, prior) -> np.ndarray:
    """Resident first (hottest first), then counted routing, then the prior order: the profile to save."""
    res = np.flatnonzero(slot_of >= 0)
    res = res[np.argsort(-heat[res], kind="stable")]
    rest = np.flatnonzero((slot_of < 0) & (heat > 0))
    rest = rest[np.argsort(-heat[rest], kind="stable")]
    seen = np.zeros(len(slot_of), dtype=bool)
    seen[res] = True
    seen[rest] = True
    pri = np.flatnonzero((prior >= 0) & ~seen)
    pri = pri[np.argsort(prior[pri], kind="stable")]
    return np.concatenate([res, rest, pri]).astype(np.int64)


class ExpertCache:
    def __init__(self, arena, n_slots: int, max_swaps: int = 64, serves=None):
        self.arena = arena
        self.n_layer, self.n_expert, self.n_total = arena.n_layer, arena.n_expert, arena.n_total
        self.stride = arena.layout.stride           # the largest blob's (the lent slots')
        self.pools = SlotPools(arena.expert_stride)
        # the experts this cache may hold (a stage's layers'; all by default)
        self.serves = np.ones(self.n_total, dtype=bool) if serves is None else np.asarray(serves, dtype=bool).copy()
        if self.serves.shape != (self.n_total,):
            raise ValueError(f"serves: {self.serves.shape} flags for {self.n_total} experts")
        self.n_served = int(self.serves.sum())
        self.n_slots = int(min(n_slots, self.n_served))
        self._make_slots(self.pools.split(self.n_slots) if serves is None else
                         served_split(self.pools, arena.expert_stride, self.serves, self.n_slots))
        self.slots = cp.empty(max(self.nbytes, 1), dtype=cp.uint8)
        self.slot_lo = int(self.slots.data.ptr)
        self.slot_hi = self.slot_lo + self.nbytes
        self.slot_addr += np.uint64(self.slot_lo)
        self.table_host = arena.blob_ptr.copy()
        self.table = cp.asarray(self.table_host)
        self.slot_of = np.full(self.n_total, -1, dtype=np.int64)
        self.owner = np.full(self.n_slots, -1, dtype=np.int64)
        self.counts = cp.zeros(self.n_total, dtype=cp.int32)
        self.stats = cp.zeros(2, dtype=cp.uint64)          # hits, lookups (decode)
        self.heat = np.zeros(self.n_total, dtype=np.float64)
        self.prior = np.full(self.n_total, -1, dtype=np.int64)   # rank from a loaded profile (load_prior)
        self.max_swaps = max_swaps
        self.copy_stream = cp.cuda.Stream(non_blocking=True)
        self._pending = None          # (event, ids, slots)
        self.swaps = 0
        self.bytes_swapped = 0
        self.source = None            # ExpertSource in the memory modes (set_source)
        import cupyx
        self._counts_host = cupyx.empty_pinned((self.n_total,), dtype=np.int32)   # adapt_start's copy
        self._counts_ev = cp.cuda.Event(disable_timing=True)
        self.counts_taken = False     # adapt_start's counts are in _counts_host (or on their way) for adapt_finish

    def _make_slots(self, per_pool):
        """Slot numbers pool by pool (ascending stride); slot_addr is relative to the slots' base until __init__
        adds it."""
        p = self.pools
        self.slot_pool = np.repeat(np.arange(p.n_pools), per_pool).astype(np.int64)
        self.slot_bytes = p.strides[self.slot_pool]
        self.slot_addr = (np.cumsum(self.slot_bytes) - self.slot_bytes).astype(np.uint64)     # pool by pool
        self.exp_pool = p.expert_pool
        self.blob_bytes = p.strides[p.expert_pool]      # bytes copied per expert (its pool's stride)
        self.lend_pool = p.n_pools - 1
        self.nbytes = int(self.slot_bytes.sum())

    @property
    def lendable(self) -> int:
        """Slots the prompt pass's ring may borrow: those of the largest pool, whose slots hold any blob."""
        return int((self.slot_pool == self.lend_pool).sum())

    # --- the memory modes ------------------------------------------------------------------------------------
    def set_source(self, source):
        self.source = source
        self.table_host[:] = source.addrs()
        self.table_host[self.slot_of >= 0] = [self.slot_ptr(s) for s in self.slot_of[self.slot_of >= 0]]
        self._push(0, self.n_total, cp.cuda.get_current_stream())

    def home(self, g: int) -> int:
        """Where expert g is read from outside VRAM now (0: only in the file)."""
        return self.source.addr(g) if self.source is not None else int(self.arena.blob_ptr[g])

    def reachable(self) -> bool:
        """Every entry of the table points at readable memory (the whole-step graph may run)."""
        return bool(self.table_host.all())

    def set_entries(self, gs, addrs, stream):
        """Point experts gs (not in VRAM) at addrs, in stream order."""
        gs = np.asarray(gs, dtype=np.int64)
        if not len(gs):
            return
        self.table_host[gs] = np.asarray(addrs, dtype=np.uint64)
        self._push(int(gs.min()), int(gs.max()) + 1, stream)

    def on_evict(self, g: int, stream):
        """The staging LRU took g's slot: unless g is in VRAM its entry becomes 0 before anything else launches."""
        if self.slot_of[g] < 0:
            self.table_host[g] = 0
            self._push(g, g + 1, stream)

    def stage(self, gs, stream) -> tuple[list[int], int]:
        """Make experts gs (outside VRAM and the arena) readable: staged from the file where needed, pinned in the
        LRU until release(), their entries pointed at the slots. Returns (addresses, how many were read from the
        file)."""
        addrs, n_read = self.source.stage(gs)
        gs = np.asarray(gs, dtype=np.int64)
        a = np.asarray(addrs, dtype=np.uint64)
        change = (self.table_host[gs] != a) & (self.slot_of[gs] < 0)
        if change.any():
            self.set_entries(gs[change], a[change], stream)
        self.source.mark_visible(gs)
        return addrs, n_read

    def advise(self, gs):
        """Memory modes: ask the OS to start reading the file-only experts among gs that are not in VRAM."""
        if self.source is not None:
            gs = np.asarray(gs, dtype=np.int64)
            self.source.advise(gs[self.slot_of[gs] < 0])

    def read_begin(self, g: int, stream) -> int:
        """The address the prompt pass reads expert g from (staged and pinned if it is only in the file); pair with
        read_end once its readers are enqueued."""
        if self.source is None or self.slot_of[g] >= 0 or not self.source.file_only[g]:
            return int(self.table_host[g])
        (a,), _ = self.stage([g], stream)
        return a

    def read_end(self, g: int, stream):
        if self.source is not None and self.slot_of[g] < 0 and self.source.file_only[g]:
            ev = cp.cuda.Event(disable_timing=True)
            ev.record(stream)
            self.source.release([g], ev)

    def _push(self, lo: int, hi: int, stream):
        # a pageable source: the driver takes the bytes before returning, so table_host may change right after
        with stream:
            self.table[lo:hi].set(self.table_host[lo:hi], stream=stream)

    def slot_ptr(self, s: int) -> int:
        return int(self.slot_addr[s])

    def resident(self) -> np.ndarray:
        return self.slot_of >= 0

    # --- filling ---------------------------------------------------------------------------------------------
    def fill(self, order, stream) -> int:
        """Load experts in `order` (global ids, hottest first) into free slots now; returns how many."""
        empty = self.owner == FREE
        per_pool = [list(np.flatnonzero(empty & (self.slot_pool == p))[::-1]) for p in range(self.pools.n_pools)]
        ids, free = [], []
        for g in order:             # each expert into a free slot of its own pool (lowest first), while any is left
            g = int(g)
            f = per_pool[self.exp_pool[g]]
            if f and self.slot_of[g] < 0 and self.serves[g]:
                ids.append(g)
                free.append(int(f.pop()))
        if self.source is not None:       # file-only experts staged a batch at a time (read in parallel)
            per = max(1, min(64, self.source.lru.n_slots - 1))
            for i in range(0, len(ids), per):
                part, slots = ids[i:i + per], free[i:i + per]
                addrs, _ = self.source.stage(part)
                for g, a, s in zip(part, addrs, slots):
                    cp.cuda.runtime.memcpyAsync(self.slot_ptr(s), a, int(self.blob_bytes[g]),
                                                cp.cuda.runtime.memcpyDefault, stream.ptr)
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(stream)
                self.source.release(part, ev)
        for g, s in zip(ids, free):
            if self.source is None:
                cp.cuda.runtime.memcpyAsync(self.slot_ptr(s), int(self.arena.blob_ptr[g]), int(self.blob_bytes[g]),
                                            cp.cuda.runtime.memcpyDefault, stream.ptr)
            self.slot_of[g] = s
            self.owner[s] = g
            self.table_host[g] = self.slot_ptr(s)
        self._upload_table(stream)
        stream.synchronize()
        return len(ids)

    def _upload_table(self, stream):
        with stream:
            self.table.set(self.table_host, stream=stream)

    # --- the adaptive tier -----------------------------------------------------------------------------------
    def take_counts(self, stream) -> np.ndarray:
        """The routing counted since they were last taken (a started round's included), zeroed on the device."""
        with stream:
            c = self.counts.get(stream=stream)
            self.counts.fill(0)
        stream.synchronize()
        return c + self._taken_counts() if self.counts_taken else c

    def adapt_start(self, stream) -> None:
        """A round's first half: the counts copied to pinned host memory and zeroed, after everything on `stream`;
        nothing waits (adapt_finish makes the round once counts_landed())."""
        if self.counts_taken:
            return
        cp.cuda.runtime.memcpyAsync(self._counts_host.ctypes.data, self.counts.data.ptr, self.counts.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        cp.cuda.runtime.memsetAsync(self.counts.data.ptr, 0, self.counts.nbytes, stream.ptr)
        self._counts_ev.record(stream)
        self.counts_taken = True

    def counts_landed(self) -> bool:
        return self.counts_taken and self._counts_ev.done

    def _taken_counts(self) -> np.ndarray:
        self._counts_ev.synchronize()
        self.counts_taken = False
        return self._counts_host.astype(np.int32)

    def adapt_finish(self, stream) -> int:
        """A round's second half, from adapt_start's counts (waiting for their copy if it has not landed)."""
        self.poll(stream)
        return self._round(self._taken_counts(), stream)

    def adapt(self, stream) -> int:
        """One round: decay heat, add new counts, start swaps. Returns the number of swaps started."""
        self.poll(stream)
        return self._round(self.take_counts(stream), stream)

    def _round(self, c, stream) -> int:
        self.heat *= DECAY
        self.heat += c
        if self._pending is not None or self.n_slots == 0:
            return 0
        res = self.slot_of >= 0
        cand = np.flatnonzero(~res & (self.heat > 0) & self.serves)
        if self.source is not None:          # only what pinned memory holds: a file read would stall the step
            cand = cand[self.table_host[cand] != 0]
        if not len(cand):
            return 0
        cand = cand[np.argsort(-self.heat[cand], kind="stable")][:self.max_swaps]
        # victims: free slots first, then the coldest residents, of the candidates' own pools
        free = np.flatnonzero(self.owner == FREE)
        occ = np.flatnonzero(self.owner >= 0)
        if self.source is not None and self.reachable():
            # every expert is readable without the file, so every step is the whole-step graph: a victim with no
            # pinned copy would get entry 0 and send each step down the per-layer path until it is staged again
            occ = occ[~self.source.file_only[self.owner[occ]]]
        occ = occ[np.argsort(self.heat[self.owner[occ]], kind="stable")]
        ids, slots, evicted = [], [], []
        for p in range(self.pools.n_pools):
            pc = cand[self.exp_pool[cand] == p]
            victims = np.concatenate([free[self.slot_pool[free] == p], occ[self.slot_pool[occ] == p]])
            for g, s in zip(pc, victims):
                old = self.owner[s]
                if old >= 0 and self.heat[g] <= self.heat[old] * 1.25 + 0.5:
                    break          # no clear gain: keep what is there (hysteresis against thrashing)
                ids.append(int(g))
                slots.append(int(s))
                if old >= 0:
                    evicted.append(int(old))
        if not ids:
            return 0
        for old in evicted:          # 1. victims back to the arena, in stream order
            self.table_host[old] = self.home(old)
            self.slot_of[old] = -1
        for s in slots:
            self.owner[s] = FREE
        if evicted:
            self._upload_table(stream)
        self._start_copies(ids, slots, stream)
        return len(ids)

    def _start_copies(self, ids, slots, stream):
        """2. after everything enqueued on `stream` so far, copy experts ids into slots on the side stream; poll()
        points the table at them once they have landed. The slots must be FREE and not read by anything later."""
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(stream)
        self.copy_stream.wait_event(ev)
        for g, s in zip(ids, slots):
            cp.cuda.runtime.memcpyAsync(self.slot_ptr(s), int(self.table_host[g]), int(self.blob_bytes[g]),
                                        cp.cuda.runtime.memcpyDefault, self.copy_stream.ptr)
        done = cp.cuda.Event(disable_timing=True)
        done.record(self.copy_stream)
        if self.source is not None:          # a staged source slot is not refilled before its copy is done
            self.source.fence(ids, done)
        self._pending = (done, list(ids), list(slots))
        self.swaps += len(ids)
        self.bytes_swapped += int(self.blob_bytes[list(ids)].sum())

    # --- lending slots to the prompt pass's ring -------------------------------------------------------------
    def pending_slots(self) -> list[int]:
        return list(self._pending[2]) if self._pending is not None else []

    def _evictable(self):
        """Experts whose eviction keeps every table entry readable: in the memory modes, while the whole-step graph
        can run, only those with a pinned copy (as the adaptive tier's victims)."""
        if self.source is not None and self.reachable():
            return ~self.source.file_only
        return None

    def load_prior(self, ranks) -> None:
        """Each expert's rank in a loaded profile (-1: unranked): evictions and refills order equal heat by it, and
        the profile saved next keeps the unrouted experts in its order."""
        self.prior = np.asarray(ranks, dtype=np.int64).copy()

    def lend(self, n: int, stream, occupied: bool = True) -> list[int]:
        """Take up to n slots for the ring (lend_choice's order); the experts in them go back home on `stream`.
        Returns the slot numbers (slot_ptr gives their addresses)."""
        self.poll(stream)
        slots = lend_choice(self.owner, self.heat, self.prior, n, self.pending_slots(), occupied, self._evictable(),
                            usable=self.slot_pool == self.lend_pool)
        evicted = self.owner[slots][self.owner[slots] >= 0]
        for g in evicted:
            self.table_host[g] = self.home(int(g))
            self.slot_of[g] = -1
        self.owner[slots] = LENT
        if len(evicted):
            self._upload_table(stream)
        return [int(s) for s in slots]

    def give_back(self, slots, stream) -> int:
        """Lent slots come back: refilled with the hottest experts that have no slot (copies after everything on
        `stream` so far; entries written by poll() once they have landed). Returns how many are being refilled."""
        slots = [int(s) for s in slots]
        if not slots:
            return 0
        if any(self.owner[s] != LENT for s in slots):
            raise RuntimeError(f"slots {[s for s in slots if self.owner[s] != LENT]} were not lent")
        if self._pending is not None:        # one swap in flight at a time: the adaptive tier's, usually landed
            self.poll(stream, wait=True)
        self.owner[slots] = FREE
        ids, into = [], []
        readable = (self.table_host != 0) & self.serves
        for p in sorted({int(self.slot_pool[s]) for s in slots}):     # each slot refilled from its own pool
            mine = [s for s in slots if self.slot_pool[s] == p]
            got = refill_order(self.slot_of, self.heat, self.prior, readable & (self.exp_pool == p))[:len(mine)]
            ids += [int(g) for g in got]
            into += mine[:len(got)]
        if ids:
            self._start_copies(ids, into, stream)
        return len(ids)

    def poll(self, stream, wait: bool = False) -> bool:
        """3. once the copies have landed, point the table at the new slots (on the main stream)."""
        if self._pending is None:
            return False
        ev, ids, slots = self._pending
        if wait:
            ev.synchronize()
        elif not ev.done:
            return False
        for g, s in zip(ids, slots):
            self.slot_of[g] = s
            self.owner[s] = g
            self.table_host[g] = self.slot_ptr(s)
        self._upload_table(stream)
        self._pending = None
        return True

    # --- reporting -------------------------------------------------------------------------------------------
    def read_stats(self, stream) -> tuple[int, int]:
        with stream:
            s = self.stats.get(stream=stream)
        return int(s[0]), int(s[1])

    def reset_stats(self, stream):
        with stream:
            self.stats.fill(0)

    def learned_order(self) -> np.ndarray:
        """Resident first (hottest first), then counted routing, then the prior order: the profile to save."""
        return learned_order(self.slot_of, self.heat, self.prior)

    def heat_u8(self) -> np.ndarray:
        """Heat scaled to 0..255 (the hottest expert 255), one byte per expert, for the CACHE line."""
        h = self.heat
        top = h.max() if len(h) and h.max() > 0 else 1.0
        return np.clip(np.round(255.0 * h / top), 0, 255).astype(np.uint8)
