"""Expert prefetch inside the decode graph (cuda_src/prefetch.cu has the kernels and the bank protocol).

Without it a missed expert crosses PCIe only when layer l's expert kernels read it, after the rest of the layer: the
link idles during attention and the router, the GPU idles while the link works. Here layer l's router launch also
runs a later layer's router on layer l's FFN input, normed with that layer's norm weights (consecutive layers' FFN
inputs are close, so the guess is usually right on trained models), and a side stream copies the predicted experts
that have no VRAM slot into staging slots while compute goes on; the predicted layer's experts wait for that copy (an
event: a graph edge) and read the staged copies through rewritten table entries. A wrong guess costs only link
bytes: the expert actually routed is still read in place through its untouched entry.

Per layer l, on the step's stream (DecodeStep's hooks):
    enqueue_router(l)   router_predict: layer l's router and the first target's prediction in one launch (where the
                        two routers' rows differ in type: router_fused, then predict; gpt-oss: their _bias variants,
                        each router's bias added to its logits)
    enqueue(l)          event -> [side] prefetch_copy(target) -> event done[target];  wait done[l] -> miss_copy(l)
then enqueue_finish() forks prefetch_finish (the table restored) and enqueue_join() joins it after the pick, so the
graph ends with the table as it began.

Depth (prefetch_depth): 1 predicts layer l+1, whose copy has only ~45 us to hide in; 2 (the default) predicts l+2, so
the copies queue back to back with two layers of compute to hide in. Layer 0 also predicts layer 1; the last layers
note their routing by predict in bookkeeping mode. depth + 1 staging banks (layer m % banks): a bank is reused only
after the experts of the layer it held have run.

Late misses (fetch_misses): after the join, prefetch_copy runs once more on the main stream with the layer's actual
routing, copying every routed expert still outside VRAM (not a cache slot, not staged, not file-only) into a miss
bank (two, by layer parity) with a wide grid, so the expert kernels read VRAM instead of reading it in place with few
loads in flight. The next prefetch copy is forked before the join, so the link has no gap between copies.

Stats (device, uint64): look-ups with a prediction, predicted right, staged, staged and used; the same first pair for
depth-2 predictions; late copies (`fetched`). docs/experiments.md has the measurements behind every choice here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.cuda import kernels
# predict stages n_embd floats with common.cuh stage_x: the decode kernels' shared-memory rule
from engine.cuda.launch import SMEM_DEFAULT, SMEM_MAX, skipped, staged_bytes

# prefetch_copy's grid on the side stream: 8 x 256 threads x 8 loads x 16 B = 256 KiB in flight, about the link's
# bandwidth-delay product; more blocks take block slots from moe_down / moe_gate_up running beside them
# (docs/experiments.md, "The copy grids").
COPY_BLOCKS = 8
# The miss copy's grid: it shares the link with the next prefetch copy, and PCIe serves reads roughly in proportion
# to those in flight, so 4 MiB in flight (a whole expert at once) gives the critical-path copy most of the link.
MISS_BLOCKS = 128
COPY_THREADS = 256
COPY_LOADS = 8             # cuda_src/prefetch.cu PF_LOADS
PREDICT_WARPS = 4          # router rows per predict block (one warp each), as the router's
MAX_K = 16                 # cuda_src/prefetch.cu PF_MAX_K
MAX_EXPERTS = 512          # cuda_src/prefetch.cu PF_MAX_EXPERTS
# The automatic rule (CudaOptions.prefetch None) prefetches only while the cache holds less than this share of the
# experts: near full residency its fixed cost a layer outweighs the stalls it saves (docs/experiments.md).
AUTO_MAX_SHARE = 0.95
# ... and only for experts of at most this many bytes: a wrong guess costs its expert's bytes of link time, which a
# 2.7 MB Qwen expert hides behind a layer's compute (prefetch on won at every share below 95%) and a 13.2 MB gpt-oss
# one does not (~260 us, two to three layers): gpt-oss-120b at 12 GiB, link-bound with 57% of the prefetched bytes
# wasted, decoded 40.1 tok/s with it and 52.0 without (docs/experiments.md). The bound lies between the two sides.
AUTO_MAX_EXPERT_BYTES = 8 << 20
DEPTHS = (1, 2)            # prefetch_depth: predict the next layer, or the one after it (module docstring)
MISS_BANKS = 2             # late-miss banks of k slots: layer parity (a bank is reused two layers on)
FETCHED = 6                # stats index of the late-miss count (cuda_src/prefetch.cu's stats comment)
STATS = 7                  # the device counters (PrefetchStats' fields)


def load_module(qtypes, defines=None):
    """cuda_src/prefetch.cu for these router row types (with these extra defines: bench.prefetch_grid's PF_LOADS)."""
    return kernels.load("prefetch", defines=defines, qtypes=qtypes)


def wanted(choice: bool | None, n_slots: int, n_total: int, expert_bytes: int) -> bool:
    """Whether the decode step prefetches: never when every expert has a VRAM slot (nothing to fetch), else as
    CudaOptions.prefetch says (None: below AUTO_MAX_SHARE of the experts in VRAM, for experts of at most
    AUTO_MAX_EXPERT_BYTES)."""
    if n_slots >= n_total:
        return False
    if choice is None:
        return n_slots < AUTO_MAX_SHARE * n_total and expert_bytes <= AUTO_MAX_EXPERT_BYTES
    return choice


def auto_declined(n_slots: int, n_total: int, expert_bytes: int) -> str | None:
    """Why the automatic rule declines a prefetch that prefetch=on would run (None: it does not decline one)."""
    if not wanted(True, n_slots, n_total, expert_bytes) or wanted(None, n_slots, n_total, expert_bytes):
        return None
    if expert_bytes > AUTO_MAX_EXPERT_BYTES:
        return (f"an expert is {expert_bytes / 2**20:.1f} MiB, and a wrong guess of that size costs more link time "
                f"than the right ones save (auto prefetches experts of at most {AUTO_MAX_EXPERT_BYTES >> 20} MiB)")
    return (f"{n_slots} of {n_total} experts ({n_slots / n_total:.0%}) are in VRAM, and the others are faster read "
            f"in place (auto prefetches below {AUTO_MAX_SHARE:.0%})")


def unsupported(cfg, layout) -> str | None:
    """Why the kernels cannot serve this model (None: they can)."""
    if cfg.n_expert_used > MAX_K or cfg.n_expert > MAX_EXPERTS:
        return (f"it handles up to {MAX_EXPERTS} experts and top-{MAX_K} routing (this model: {cfg.n_expert}, "
                f"top-{cfg.n_expert_used})")
    if staged_bytes(cfg.n_embd) > SMEM_MAX:
        return (f"its predictor keeps n_embd floats in shared memory (this model: {cfg.n_embd}, at most "
                f"{SMEM_MAX * 16 // 68})")
    if cfg.n_embd % 4:
        return f"its predictor reads x as float4 (this model's n_embd {cfg.n_embd} is not a multiple of 4)"
    if cfg.n_expert_used * ((layout.nbytes + 15) // 16) >= 2**31:
        return "the expert blobs are too large for its 32-bit indexing"
    return None


@dataclass(frozen=True)
class PrefetchPlan:
    """The prefetch plan() decided on: DecodeStep builds its Prefetcher from it when it is built."""
    depth: int
    fetch_misses: bool

    def build(self, step) -> "Prefetcher":
        return Prefetcher(step, self.depth, self.fetch_misses)


def plan(cfg, cache, layout, choice: bool | None, log, depth: int, fetch_misses: bool) -> PrefetchPlan | None:
    """The decode step's prefetch when wanted() says so (with the late-miss copy when fetch_misses), else None. A
    model the kernels cannot serve: refused when the prefetch was asked for (choice True), else said in the log."""
    if cache is None or not wanted(choice, cache.n_slots, cache.n_total, layout.stride):
        # the automatic rule declined what prefetch=on would do: say so
        why = auto_declined(cache.n_slots, cache.n_total, layout.stride) if cache is not None and choice is None \
            else None
        if why:
            log(f"expert prefetch off: {why}; --tune prefetch=on overrides")
        return None
    why = unsupported(cfg, layout)
    if why:
        if choice:
            raise ValueError(f"--tune prefetch=on cannot serve this model: {why}; run with --tune prefetch=off")
        log(f"expert prefetch off: {why}")
        return None
    top_k, nb = cfg.n_expert_used, banks(depth)
    what = "next-layer prediction" if depth == 1 else f"prediction {depth} layers ahead"
    late = f" + {MISS_BANKS} x {top_k} for late misses" if fetch_misses else ", late misses read in place"
    log(f"expert prefetch on: {what}, {nb} x {top_k} staging slots{late} "
        f"({vram_staging_slots(top_k, depth, fetch_misses) * layout.stride / 2**20:.0f} MiB of VRAM)")
    return PrefetchPlan(depth, fetch_misses)


def banks(depth: int) -> int:
    """Staging banks: a layer's bank is reused by the copy launched after the router of the layer `depth` before
    the next user's layer, so depth + 1 banks keep it until its experts ran (module docstring)."""
    if depth not in DEPTHS:
        raise ValueError(f"prefetch depth {depth}: expected one of {', '.join(map(str, DEPTHS))}")
    return depth + 1


def vram_staging_slots(top_k: int, depth: int, fetch_misses: bool) -> int:
    """VRAM staging slots the prefetch takes (depth + 1 banks of top_k, and the late-miss banks), in expert strides:
    the cache gives up as many."""
    return (banks(depth) + (MISS_BANKS if fetch_misses else 0)) * top_k


@dataclass
class PrefetchStats:
    predicted: int = 0         # look-ups that had a prediction (k per layer after the first)
    correct: int = 0           # of them, experts the prediction named
    staged: int = 0            # experts copied over PCIe ahead of use (their bytes crossed the link)
    used: int = 0              # staged experts the router then chose
    predicted2: int = 0        # look-ups whose prediction was made two layers ahead (prefetch_depth 2)
    correct2: int = 0          # of them, experts the prediction named
    fetched: int = 0           # experts copied late (routed, neither cached nor staged: the miss copy)

    @classmethod
    def from_counters(cls, c) -> "PrefetchStats":
        return cls(*(int(v) for v in c[:STATS]))

    def summary(self, blob_bytes: int, steps: int) -> dict:
        """The bench's columns: prediction accuracy, staged MB per token, the share of staged bytes wasted, the MB
        per token copied late (the misses the prediction left)."""
        return dict(pred_accuracy=round(self.correct / self.predicted, 4) if self.predicted else None,
                    pred_accuracy_2=round(self.correct2 / self.predicted2, 4) if self.predicted2 else None,
                    prefetch_mb_per_token=round(self.staged * blob_bytes / max(steps, 1) / 1e6, 2),
                    prefetch_wasted=round(1 - self.used / self.staged, 4) if self.staged else None,
                    late_mb_per_token=round(self.fetched * blob_bytes / max(steps, 1) / 1e6, 2))


class Prefetcher:
    """Buffers, staging slots, kernels and events of the prefetch for one DecodeStep (MoE models only): it launches
    the router of the step's family program (step.layers: router_args, router_extra, biased_router)."""

    def __init__(self, step, depth: int, fetch_misses: bool):
        import cupy as cp

        self.step = step
        self.depth, self.banks = depth, banks(depth)
        self.fetch_misses = fetch_misses
        c, cache, lay = step.cfg, step.cache, step.layout
        self.n_layer, self.n_expert, self.top_k = c.n_layer, c.n_expert, c.n_expert_used
        why = unsupported(c, lay)
        if why:
            raise ValueError(f"expert prefetch cannot serve this model: {why}")
        # gpt-oss: every router has a bias (families/gptoss.py), which the predictions add as the router does; the
        # kernels' bias variants take the family's router_extra (prefetch.cu predict_bias, router_predict_bias)
        self.biased = step.layers.biased_router
        self.stride = lay.stride                      # a staging slot holds the largest blob
        # 16-byte units copied per expert of each layer (within the 256-aligned stride): the copy launches carry
        # their layer's count, so a recipe's larger layers copy their own bytes
        self.units = [(ly.nbytes + 15) // 16 for ly in lay.layers]
        self.blob_bytes = sum(self.units) * 16 // len(self.units)      # the mean, for the bench's MB per token
        self.slot_lo, self.slot_hi = cache.slot_lo, cache.slot_hi
        self.table = cache.table
        qts = sorted({int(layer.router.qt) for layer in step.weights.layers})
        mod = load_module(qts)
        # fetched now: no kernel is compiled or loaded while a graph is being captured
        fn = lambda name: {qt: mod.get_function(f"{name}<{qt}>") for qt in qts}
        self.f_predict, self.f_router_predict = fn("predict"), fn("router_predict")
        self.f_predict_bias, self.f_router_predict_bias = (fn("predict_bias"), fn("router_predict_bias")) \
            if self.biased else ({}, {})
        self.smem = staged_bytes(c.n_embd)
        if self.smem > SMEM_DEFAULT:
            for fs in (self.f_predict, self.f_router_predict, self.f_predict_bias, self.f_router_predict_bias):
                for f in fs.values():
                    f.max_dynamic_shared_size_bytes = self.smem
        self.f_copy = mod.get_function("prefetch_copy")
        self.f_finish = mod.get_function("prefetch_finish")
        self.f_restore = mod.get_function("prefetch_restore")
        top_k, nb = self.top_k, self.banks
        mb = MISS_BANKS if fetch_misses else 0
        with step.stream:
            # the staging banks, then the miss banks, as one range: an entry pointing inside it is in VRAM already
            # (the miss copy's second range)
            self.staging = cp.empty((nb + mb) * top_k * self.stride, dtype=cp.uint8)
            self.stage_lo = self.staging.data.ptr
            self.stage_hi = self.stage_lo + self.staging.nbytes
            # the prediction for each layer, kept for the whole step (not in two banks): a replay of the copies
            # alone (DecodeStep.profile's "prefetch" kind) then copies what the last real step predicted for each
            # layer, the real bytes, instead of the last two layers' predictions applied to every layer
            self.pred = cp.zeros(self.n_layer * top_k, dtype=cp.int32)
            self.actual = cp.zeros(self.n_layer * top_k, dtype=cp.int32)
            self.rec = cp.zeros((nb, 2 + top_k), dtype=cp.int32)         # bank: layer, n, expert ids
            self.rec_addr = cp.zeros((nb, top_k), dtype=cp.uint64)       # bank: the entries' original addresses
            self.miss_rec = cp.zeros((MISS_BANKS, 2 + top_k), dtype=cp.int32)     # the miss banks' records, as rec
            self.miss_rec_addr = cp.zeros((MISS_BANKS, top_k), dtype=cp.uint64)
            self.logits = cp.zeros(self.n_expert, dtype=cp.float32)
            self.stats = cp.zeros(STATS, dtype=cp.uint64)
            self.counters = cp.zeros(3, dtype=cp.int32)      # predict's, copy's, miss copy's last-block counters
        self.side = cp.cuda.Stream(non_blocking=True)
        self.done = [cp.cuda.Event(disable_timing=True) for _ in range(self.n_layer)]
        self.forked = cp.cuda.Event(disable_timing=True)
        self.finished = cp.cuda.Event(disable_timing=True)
        self._pending: set[int] = set()
        self._finish_pending = False

    def _fn(self, kind: str, f):
        """Kernel f, or a no-op when the step's tracer filters this kind of launch (decode.py KindFilter)."""
        return f if self.step.keeps(kind) else skipped

    def _ptr(self, a, off_bytes: int = 0):
        """a's address (+ off_bytes); None (a family's FFN input with no norm weights, qwen4exp) is NULL."""
        return np.uint64(0 if a is None else a.data.ptr + off_bytes)

    def _pred_out(self, m: int):
        """Where the prediction for layer m is written: pred[m], or the tracer's pred_sink (bench.prefetch_oracle)."""
        sink = getattr(self.step.tracer, "pred_sink", None)
        return self._ptr(self.pred if sink is None else sink, 4 * self.top_k * m)

    # --- the launches ------------------------------------------------------------------------------------------
    def targets(self, li: int) -> list[int]:
        """The layers whose experts layer li predicts (and starts copying): depth 1, li+1; depth 2, li+2, and at
        layer 0 also layer 1 (nothing earlier can predict it). Past the last layer: none."""
        if self.depth == 1:
            t = [li + 1]
        else:
            t = [1, 2] if li == 0 else [li + 2]
        return [m for m in t if m < self.n_layer]

    def _note_stats(self, li: int):
        """The (predicted, right) counter pair layer li's routing is noted against: the second pair for a layer
        predicted two layers ahead (depth 2, from layer 2 on; layer 1 is predicted at depth 1 by layer 0)."""
        return self._ptr(self.stats, 8 * 4 if self.depth == 2 and li >= 2 else 0)

    def fused(self, li: int) -> bool:
        """Whether layer li's router launch also predicts its first target layer (router_predict): both routers'
        rows of one type. A layer with no target has nothing to predict; mixed types take router_fused + predict."""
        t = self.targets(li)
        layers = self.step.weights.layers
        return bool(t) and int(layers[li].router.qt) == int(layers[t[0]].router.qt)

    def enqueue_router(self, li: int) -> bool:
        """DecodeStep.enqueue's hook in place of its router launch: True when layer li's router ran here, with the
        prediction of its first target layer in the same launch (router_predict); False: the step launches its own
        router."""
        if not self.fused(li):
            return False
        st = self.step
        m = self.targets(li)[0]
        R, nxt = st.weights.layers[li].router, st.weights.layers[m]
        I64, U64 = np.int64, np.uint64
        warps = PREDICT_WARPS
        nb = (self.n_expert + warps - 1) // warps
        # layer li's router (router_fused's arguments), then layer m's prediction and layer li's noting
        predict = (U64(nxt.router.ptr), I64(nxt.router.row_bytes), self._ptr(nxt.ffn_norm), self._ptr(self.logits),
                   self._pred_out(m))
        # gpt-oss: layer li's router bias (its routing, as router_fused_bias) and layer m's (the prediction)
        fs, biases = (self.f_router_predict_bias, (*st.layers.router_extra(li), *st.layers.router_extra(m))) \
            if self.biased else (self.f_router_predict, ())
        self._fn("router", fs[int(R.qt)])(
            (2 * nb,), (32 * warps,), (*st.layers.router_args(li), *predict, *self._note(li, li > 0), *biases),
            shared_mem=self.smem)
        return True

    def enqueue(self, li: int):
        """Between layer li's router and its experts, on the step's stream: the predictions the router launch did
        not make, the copies of the target layers forked onto the side stream, then the wait for this layer's copy
        (forked `depth` layers earlier, or at layer 0 for layer 1)."""
        if li == 0:
            self._pending.clear()       # a capture that failed part-way left nothing to join
        targets = self.targets(li)
        fused = self.fused(li)
        for j, m in enumerate(targets):
            if not (j == 0 and fused):  # else the router launch predicted it already
                self.launch_predict(li, m, note=j == 0)
        if not targets and self.depth > 1:
            self.launch_note(li)        # depth 1's last layer is noted by prefetch_finish instead
        # fork first: the side stream's next copy queues behind this layer's and the link never waits for the join
        # (module docstring, "Late misses"); the miss copy after the join outweighs it on the link
        self._fork(targets)
        self._join(li)
        if self.fetch_misses:
            self.launch_miss(li)

    def _fork(self, targets: list[int]):
        if not targets:
            return
        self.forked.record(self.step.stream)
        self.side.wait_event(self.forked)
        for m in targets:
            with self.side:
                self.launch_copy(m)
            self.done[m].record(self.side)
            self._pending.add(m)

    def _join(self, li: int):
        if li in self._pending:
            self.step.stream.wait_event(self.done[li])
            self._pending.discard(li)

    def enqueue_finish(self):
        """After the last layer's experts: restore the table on the side stream (overlaps the output mat-vec)."""
        main = self.step.stream
        self.forked.record(main)
        self.side.wait_event(self.forked)
        with self.side:
            self.launch_finish()
        self.finished.record(self.side)
        self._finish_pending = True

    def enqueue_join(self):
        """At the end of the step: the graph's last node waits for the restore."""
        if self._finish_pending:
            self.step.stream.wait_event(self.finished)
            self._finish_pending = False

    def _note(self, li: int, check: bool):
        """The arguments that note layer li's routing (step.ids) against its prediction: pred[li], whether to check
        it, actual[li], the counter pair of the depth that predicted it, the last-block counter."""
        I32 = np.int32
        return (self._ptr(self.pred, 4 * self.top_k * li), I32(1 if check else 0),
                self._ptr(self.actual, 4 * self.top_k * li), self._note_stats(li), self._ptr(self.counters))

    def _predict(self, grid: int, li: int, norm_layer: int, router, pred_out, check: bool):
        """predict in named groups: layer li's FFN input normed with norm_layer's weights, the router rows ranked
        (none: bookkeeping only) into pred_out, then layer li's note."""
        st, c = self.step, self.step.cfg
        I32, I64, F32, U64 = np.int32, np.int64, np.float32, np.uint64
        normed_x = (self._ptr(st.x), self._ptr(st.weights.layers[norm_layer].ffn_norm), F32(c.rms_eps),
                    I32(c.n_embd))
        rows = (U64(router.ptr), I64(router.row_bytes)) if router is not None else (U64(0), I64(0))
        ranked = (I32(self.n_expert), I32(self.top_k), self._ptr(self.logits), pred_out)
        qt = int(st.weights.layers[li if router is None else norm_layer].router.qt)
        # gpt-oss: the predicted layer's router bias on its logits (the bookkeeping mode ranks nothing: no bias)
        fs, biases = (self.f_predict_bias, st.layers.router_extra(norm_layer)) if self.biased and router is not None \
            else (self.f_predict, ())
        self._fn("predict", fs[qt])(
            (grid,), (32 * PREDICT_WARPS,),
            (*normed_x, *rows, *ranked, self._ptr(st.ids), *self._note(li, check), *biases),
            shared_mem=self.smem if router is not None else 0)

    def launch_predict(self, li: int, m: int, note: bool = True):
        """predict: layer m's router on layer li's FFN input (with layer m's norm weights) into pred[m]; with
        `note`, layer li's routing noted against its own prediction (a second predict launch of the same layer notes
        nothing: check 0)."""
        grid = (self.n_expert + PREDICT_WARPS - 1) // PREDICT_WARPS
        self._predict(grid, li, m, self.step.weights.layers[m].router, self._pred_out(m), li > 0 and note)

    def launch_note(self, li: int):
        """predict in bookkeeping mode (no router: one block, no staging): layer li's routing kept in actual and
        noted against its prediction, for the layers that predict nothing at depth 2."""
        self._predict(1, li, li, None, np.uint64(0), li > 0)

    def _copy(self, kind: str, blocks: int, li: int, routing, bank: int, rec, rec_addr, in_vram_too, counts,
              counter: int):
        """prefetch_copy (cuda_src/prefetch.cu) in named groups: layer li's entries, the ids to copy (routing), the
        staging bank they go to (units: layer li's blob size), the VRAM ranges whose entries need no copy, the bank's
        records, the counters."""
        I32, I64, U32, U64 = np.int32, np.int64, np.uint32, np.uint64
        what = (self._ptr(self.table), I32(li), I32(self.n_expert), I32(self.top_k), routing)
        into = (self._ptr(self.staging, bank * self.top_k * self.stride), I64(self.stride), U32(self.units[li]))
        in_vram = (U64(self.slot_lo), U64(self.slot_hi), *in_vram_too)
        self._fn(kind, self.f_copy)((blocks,), (COPY_THREADS,),
                                    (*what, *into, *in_vram, self._ptr(rec), self._ptr(rec_addr), *counts,
                                     self._ptr(self.counters, counter)))

    def launch_copy(self, m: int):
        """Layer m's predicted experts that are outside VRAM into staging bank m % banks, on the side stream. No
        second VRAM range: layer m's entries are the table's own until this copy (each layer's entries are rewritten
        by its one copy, and its miss copy runs after this one is joined)."""
        b, U64 = m % self.banks, np.uint64
        self._copy("prefetch", COPY_BLOCKS, m, self._ptr(self.pred, 4 * self.top_k * m), b, self.rec[b],
                   self.rec_addr[b], (U64(0), U64(0)),
                   (self._ptr(self.actual), self._ptr(self.stats, 8 * 2), self._ptr(self.stats, 8 * 3)), 4)

    def routing(self, li: int):
        """Where layer li's routing is when its miss copy runs: actual[li], noted by the layer's router_predict,
        predict or bookkeeping launch before it (so a replay of the miss copies alone copies each layer's own
        misses), except the last layer at depth 1, noted only by prefetch_finish: ids, which then hold it."""
        if self.depth == 1 and li == self.n_layer - 1:
            return self._ptr(self.step.ids)
        return self._ptr(self.actual, 4 * self.top_k * li)

    def launch_miss(self, li: int):
        """prefetch_copy on the main stream for layer li's routing: the routed experts in neither a cache slot nor a
        staging/miss slot (nor 0) copied into miss bank li % 2 (restoring the bank's previous layer first), their
        entries pointed there; counted as fetched only."""
        b, U64 = li % MISS_BANKS, np.uint64
        self._copy("miss_copy", MISS_BLOCKS, li, self.routing(li), self.banks + b, self.miss_rec[b],
                   self.miss_rec_addr[b], (U64(self.stage_lo), U64(self.stage_hi)),
                   (U64(0), self._ptr(self.stats, 8 * FETCHED), U64(0)), 8)

    def launch_finish(self):
        """The last layer's routing noted (depth 1; at depth 2 launch_note did it, against the depth-2 pair) and
        every bank restored: prefetch_finish takes banks 0 and 1, prefetch_restore any further one, and the miss
        banks (one warp each, counting nothing)."""
        st, top_k, last = self.step, self.top_k, self.n_layer - 1
        I32, U64 = np.int32, np.uint64
        if self.fetch_misses:
            self._fn("miss_copy", self.f_restore)((1,), (32 * MISS_BANKS,),
                           (self._ptr(self.table), I32(self.n_expert), I32(top_k), self._ptr(self.miss_rec),
                            self._ptr(self.miss_rec_addr), U64(0), U64(0)))
        self._fn("prefetch", self.f_finish)((1,), (32,),
                      (self._ptr(self.table), I32(self.n_expert), I32(top_k), self._ptr(st.ids),
                       self._ptr(self.pred, 4 * top_k * last), I32(1 if last > 0 and self.depth == 1 else 0), I32(last),
                       self._ptr(self.actual), self._ptr(self.rec[0]), self._ptr(self.rec_addr[0]),
                       self._ptr(self.rec[1]), self._ptr(self.rec_addr[1]), self._ptr(self.stats)))
        for b in range(2, self.banks):
            self._fn("prefetch", self.f_restore)((1,), (32,),
                           (self._ptr(self.table), I32(self.n_expert), I32(top_k), self._ptr(self.rec[b]),
                            self._ptr(self.rec_addr[b]), self._ptr(self.actual), self._ptr(self.stats, 8 * 3)))

    # --- counters ----------------------------------------------------------------------------------------------
    def read_stats(self) -> PrefetchStats:
        with self.step.stream:
            return PrefetchStats.from_counters(self.stats.get(stream=self.step.stream))

    def reset_stats(self):
        with self.step.stream:
            self.stats.fill(0)
