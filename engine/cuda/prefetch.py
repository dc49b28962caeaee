"""Next-layer expert prefetch inside the decode graph (cuda_src/prefetch.cu has the kernels and the bank protocol).

Without it a missed expert crosses PCIe only when layer l's expert kernels read it, after everything else of the
layer: the link idles during attention and the router, the GPU idles while the link works. Here, right after layer
l's router, layer l+1's router runs on layer l's FFN input normed with layer l+1's FFN norm weights (pre-gating:
consecutive layers' FFN inputs are close, so the prediction is usually right on trained models; the weights are the
predicted layer's because its router sees its input through them, and trained models' norm weights differ per
layer: even on bench.decode's model, whose norm weights are 1 + N(0, 0.05), the depth-2 accuracy went from 0.782 to
0.791 when they replaced the predicting layer's), and a side stream copies the predicted experts that have no VRAM
slot into staging slots while layer l's experts and layer l+1's attention run; layer l+1's experts wait for it
(an event: a graph edge) and read the staged copies through the rewritten table entries. A wrong guess costs only
wasted link bytes: the expert actually routed is still read in place through its untouched entry.

On the main stream, per layer l: `enqueue_router(l)` (DecodeStep.enqueue's hook) launches router_predict, layer l's
router and layer l+1's in one kernel (the prediction costs no launch and no sync of its own on the critical path;
where the two routers' rows differ in type, the step's router_fused and a separate predict launch instead); then,
between the router and the experts, `enqueue(l)`:
    event -> [side] prefetch_copy(l+1) -> event done[l+1]
    wait done[l]                                  (the copy for this layer, forked at layer l-1)
After the last layer's experts `enqueue_finish()` forks prefetch_finish (restores the table) and, after the pick,
`enqueue_join()` joins it, so the graph ends with the table as it began.

The stats counters (device, uint64): look-ups with a prediction, predicted right, experts staged, staged and used;
then look-ups with a depth-2 prediction and predicted right (the first pair counts the depth-1 predictions only).

--prefetch-depth 2: a layer's copy has only the window from layer l's router to layer l+1's experts (~45 us on the
H200 at the Qwen3-30B shape) for ~70 us of copying, so the join waits every layer and the link idles between layers.
At depth 2 layer l's router launch predicts layer l+2 instead (its router on layer l's FFN input: less accurate) and
its copy starts right away, so it has two layers of compute to hide in and the copies queue back to back on the
side stream. Layer 0 predicts layers 1 (depth 1: nothing earlier could) and 2 (a predict launch of its own, once a
step); layers n-2 and n-1 predict nothing and note their routing by predict in bookkeeping mode (one-block
launches: `actual` and the accuracy counters must see every layer's routing before the next router rewrites ids).
Three staging banks (layer m % 3): the copy for layer m, forked after layer m-2's router, restores and reuses the
bank of layer m-3, whose experts ran before that router on the main stream (two banks would hand it layer m-2's,
whose experts have not run yet). Each layer's entries are rewritten by its one copy only, joined before its experts,
and restored by the copy three layers on or at the step's end (prefetch_finish + prefetch_restore for the third
bank). No depth-1 top-up at layer m-1 for what the depth-2 guess missed: the link is the bottleneck (193 MB a
token, 3.8 ms at 51 GB/s, against a 3.1 ms compute step), a top-up moves no bytes off it (the missed expert is read
in place anyway, by the same link) and would put a short-window copy back in front of every join, the wait depth 2
exists to remove.

Late misses (--fetch-misses on, the default): what the prediction missed used to be read in place by the expert
kernels, which spread their blocks over the k routed experts, so one missed expert had few loads in flight: ~15-20
GB/s against the link's 41-51 (DESIGN §5). The H200 trace at 12 GiB (hit rate 0.815, depth 1) put moe_gate_up +
moe_down at +1.76 ms a step over all-resident (6.0 ms a step), while the next layer's prefetch copy competed for the
link. Now, after the join of layer l's prefetch copy (its staged entries are in the table), the main stream runs
prefetch_copy once more for layer l with the actual routing as its "prediction" (`miss_copy`): every routed expert
still outside VRAM (not a cache slot, not in the staging + miss banks, the kernel's second VRAM range; not 0,
file-only) is copied by a grid of MISS_BLOCKS into a miss bank (two, by layer parity, each restored by the bank's
next miss copy and at the step's end) and its entry pointed there, so the expert kernels read VRAM. Per layer:
    event -> [side] prefetch_copy(l+1) -> event done[l+1];  wait done[l] -> miss_copy(l)
The next copy is forked before the join, as without late misses, so it queues on the side stream right behind layer
l's and the link has no gap between them. The first version forked it after the miss copy, so that nothing competed
with the critical-path copy, but then the link idled from the end of layer l's copy to the end of the join and the
miss copy: the H200 trace at 12 GiB, depth 1 (2026-11-30, bench.decode_trace) showed 3.43 ms of prefetch copies and
0.88 ms of miss copies (13 experts) a step against 3.6 ms of compute, in a 6.1 ms step. Forking first measured the
same (bench.decode at 12 GiB, depth 1: 181.3 tok/s against 181.4): the miss copy now shares the link with the next
prefetch copy, and four times the loads in flight (MISS_BLOCKS) did not win it the link (the trace: a one-expert miss
copy took 152 us beside a three-expert prefetch copy, against 58 us alone).
What did help was the other side of it (later the same day): the prefetch copy's blocks, 32 of 256 threads then,
took block slots from moe_down and moe_gate_up on the SMs they sat on and pushed part of those kernels into another
wave; 8 blocks (256 KiB in flight, still the link's bandwidth-delay product) measured 195-199 tok/s against 187-188
(COPY_BLOCKS has the table), and the miss copy's 128 blocks now hold 16x the prefetch copy's loads in flight.

Tried on the H200 on 2026-11-30 and dropped (the link is what a 12 GiB step waits on: 181-199 MB a token at 46-50
GB/s while copying; in a layer where it is the bottleneck only fewer bytes help):
- a priority flag in device memory, raised by the miss copy, that the prefetch copies waited on before each round of
  loads: the miss copies were fast again (58-81 us for one expert) and the step the same (183.5 tok/s), since the
  prefetch copy it delays is on the critical path too;
- a lookahead at depth 1: layer l's router launch also ranked layer l+2's router (a third block group) and a copy of
  that guess followed layer l+1's copy, to use the link time that layers with nothing to copy leave idle (the trace:
  0 to 3 predicted misses a layer, 58-163 us of copying against ~75 us of compute). Queued on the side stream:
  179.3 tok/s against 183.5 (its 30 MB a token of wrong guesses delayed the next copies); on a stream of its own,
  waiting while another copy held the link: 38.7 tok/s (the waits stretched it past the step, whose end joins it).
  Depth 2 is the measured form of copying earlier (below).
- the miss copy folded into the router launch (router_predict_fetch, commit 7836ef9, reverted): extra blocks of the
  router_predict launch waited in the kernel for the routing and copied the routed experts outside VRAM that the
  layer's prediction had not named, so no layer paid a launch for it and none waited for the join before copying:
  194.3 tok/s against 196.3 without it (12 GiB, depth 2, three passes each in one H200 call); a layer's late misses
  are spread evenly over the layers (the trace: 4-72 us a layer, layer 0 like any other), and the join they skipped
  was the link finishing the prefetch copy they would share it with;
- __launch_bounds__ on moe_gate_up / moe_down for more blocks an SM beside the copy blocks: slower everywhere (all
  resident 307-312 against 323.5, 12 GiB 190.5-195.9 against 196.3);
- the adaptive tier tuned (12 GiB; bench.prefetch_grid's passes with the tier's settings varied instead of the
  grid, a one-off script): 256 swaps a round instead of 64 raised the hit rate 0.851 -> 0.856 at the same speed;
  adapting every 16 or 8 tokens cost 7-21% in swap traffic; decay 0.5 or 0.85 changed nothing; frozen during the
  measured pass (bench.decode --adapt-measured off) the hit rate fell to 0.828 and the speed to 180.7 (the prompt's
  own routing is what the tier adapts to).
- the prediction beside the router instead of inside its launch (branch experiment/aside, not landed): after each
  layer's attention a stream of its own ran predict for the layer's targets and their copies followed it, while the
  main stream's router launch (router_predict without the second router's rows) took 8.7 us instead of 12.0 (the
  trace); the main stream waited for the prediction before the experts. Two interleaved runs of three passes each in
  one process, 12 GiB: 195.3 and 196.1 tok/s against 195.5 and 198.4 fused (the GPU tests passed on it). A step that
  waits on the link gains nothing from a shorter router;
- the prefetch copy taking only the first N of its k = 8 guesses (ranked by predicted logit), to spend fewer link
  bytes on wrong ones: N = 7 cut the staged bytes 150 -> 124-129 MB a token and the wasted 39 -> 25, but 13 MB a token
  more were copied late, on the critical path: 196.7 and 194.3 tok/s against 198.1 and 197.9 for all 8 (N = 6:
  192.1, N = 5: 182.7; interleaved, three passes each, one process). A late expert costs more than a wasted one;
- late copies split (branch experiment/split): the miss copy took each late expert's gate/up prefix and the down
  parts followed on a stream of their own beside moe_gate_up, joined before moe_down, so a third of the late bytes
  crossed while the GPU computed. Four interleaved A/B pairs at 12 GiB (three passes each, one process per two
  pairs): +2.0, +0.5 tok/s with a 32-block tail copy, +2.6, -1.6 with 64 blocks, around 197-200; no clear gain for a
  second stream and kernel (its GPU tests passed);
The miss copy runs at every layer, the first too (nothing predicts it), and at both depths; a layer with no late miss
costs its launch (~3 us, not yet measured). Its counters: `fetched` (stats[6]) only, so the prediction counters
stay the prefetch's own. Profile kind "miss_copy": a replay of the miss copies alone reads each layer's routing of the
last real step (`actual`), but with no prefetch copy in that graph it also copies what they would have staged, so it
over-counts; bench.decode_trace (the miss copy is the prefetch_copy on the main stream) has the real figure.

What a better prediction would buy (bench.prefetch_oracle, H200, 12 GiB, 2026-11-30: each step replayed with the
copies fed its own routing, GPU time): the real prediction (right 0.79 of the time) 199.5 tok/s, 0.60 of the PCIe
ceiling; half its wrong guesses made right (0.89) 220.1, 0.66; three quarters (0.95) 229.7, 0.69; a perfect one
240.9, 0.72, the step then 4.15 ms against 2.9 ms of link time for its missed bytes (the copies still start two
layers ahead). Issue 4's 70% needs a prediction right ~0.96 of the time. On bench.decode's model
no predictor from the hidden state has come near 0.95: the predicted layer's router on an earlier layer's input is
the best measured (bench.prefetch_predictors), and a linear map fitted to the prompt's rows gains nothing over it
(--fit-lambda).

Cost (H200, Qwen3-30B-A3B shape at 12 GiB, the 01:20 run of the first version: 151.6 tok/s): predict was a launch
of its own, 17 us a layer on the critical path (806 us a step). The per-kind profile's "prefetch" figure (6.77 ms
for 47 copies, read as 26 GB/s) replayed the copies without predict while the predictions sat in two banks, so
every layer copied the experts predicted for the last two layers: about 8 x 0.33 non-resident ones a layer instead
of the real 1.4, i.e. ~330 MB in 6.77 ms, ~49 GB/s, near the link. The predictions are now kept per layer, so that
replay copies the real step's bytes (prefetch MB/tok / its time = the copy's rate). With the fused router the
profile's "router" kind includes the prediction.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.cuda import kernels
# predict stages n_embd floats with common.cuh stage_x: the decode kernels' shared-memory rule
from engine.cuda.launch import SMEM_DEFAULT, SMEM_MAX, skipped, staged_bytes

# prefetch_copy's grid on the side stream. In flight: 8 blocks x 256 threads x 8 loads x 16 B = 256 KiB, about the
# link's bandwidth-delay product (51 GB/s x 2-5 us of PCIe read latency = 100-250 KB); a warp's 8 loads are 4 KiB
# contiguous and served together, so warps re-issue one by one and the rounds do not drain the link between them.
# What sets the count is what the copy blocks take from the main stream's kernels, which run beside them: a block
# (256 threads x 48 registers = 12K of an SM's 64K) costs its SM one block slot of moe_down (4 an SM by registers,
# 512 blocks in 528 slots: one wave only while at most 16 SMs lose a slot) and of moe_gate_up (1536 blocks in 2
# waves of 792). H200, 12 GiB, depth 2, 3 measured passes each, ~2 tok/s of noise (2026-11-30; bench.prefetch_grid):
#   blocks x threads (loads)   32x256  16x256  12x256  8x256   6x256   4x256   4x512   64x128  32x128  8x128 (16)
#   tok/s                       187-188 193-194 197     196-199 194     175     197     180     193     187
# 4x256 (128 KiB in flight) leaves the link short; 16 loads a thread (more registers a block) were slower at every
# size tried. The late misses gain too: the miss copy's 4 MiB in flight now get ~15/16 of a shared link.
COPY_BLOCKS = 8
# The miss copy's grid (module docstring, "Late misses"): it shares the link with the side stream's next prefetch
# copy, and PCIe serves reads roughly in proportion to those in flight, so 128 blocks (4 MiB in flight, more than an
# expert's 2.65 MB: its whole blob is requested at once) give the critical-path copy most of the link (64 blocks:
# 191 tok/s against 194 beside a 16-block prefetch copy; 256: 193). On the main stream nothing else runs beside it,
# so its blocks take no SM time from other work.
MISS_BLOCKS = 128
COPY_THREADS = 256
COPY_LOADS = 8             # cuda_src/prefetch.cu PF_LOADS
PREDICT_WARPS = 4          # router rows per predict block (one warp each), as the router's
MAX_K = 16                 # cuda_src/prefetch.cu PF_MAX_K
MAX_EXPERTS = 512          # cuda_src/prefetch.cu PF_MAX_EXPERTS
# The automatic rule (CudaOptions.prefetch None) prefetches only while the cache holds less than this share of the
# experts: the prefetch's fixed cost a layer (the
# two-router launch, the miss copy's launch, the graph edges to its stream) outweighs the stalls it saves when nearly
# every expert is in VRAM, and the few others are faster read in place. H200, bench.decode --prefetch both
# (2026-11-30), share of the experts with a slot, tok/s with the prefetch on / off:
#   14 GiB 85%: 241.6 / 213.4    15 GiB 92%: 263.3 / 255.3    16 GiB 98%: 284.6 / 309.5
AUTO_MAX_SHARE = 0.95
DEPTHS = (1, 2)            # prefetch_depth: predict the next layer, or the one after it (module docstring)
MISS_BANKS = 2             # late-miss banks of k slots: layer parity (a bank is reused two layers on)
FETCHED = 6                # stats index of the late-miss count (cuda_src/prefetch.cu's stats comment)
STATS = 7                  # the device counters (PrefetchStats' fields)


def load_module(qtypes, defines=None):
    """cuda_src/prefetch.cu for these router row types (with these extra defines: bench.prefetch_grid's PF_LOADS)."""
    return kernels.load("prefetch", defines=defines, qtypes=qtypes)


def wanted(choice: bool | None, n_slots: int, n_total: int) -> bool:
    """Whether the decode step prefetches: never when every expert has a VRAM slot (nothing to fetch), else as
    CudaOptions.prefetch says (None: below AUTO_MAX_SHARE of the experts in VRAM)."""
    if n_slots >= n_total:
        return False
    if choice is None:
        return n_slots < AUTO_MAX_SHARE * n_total
    return choice


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


def attach(step, choice: bool | None, log, depth: int, fetch_misses: bool) -> "Prefetcher | None":
    """Give the decode step a Prefetcher when wanted() says so (with the late-miss copy when fetch_misses). A model
    the kernels cannot serve: refused when the prefetch was asked for (choice True), else said in the log."""
    c = step.cache
    if c is None or not wanted(choice, c.n_slots, c.n_total):
        # the automatic share rule declined what prefetch=on would do: say so
        if c is not None and choice is None and wanted(True, c.n_slots, c.n_total):
            log(f"expert prefetch off: {c.n_slots} of {c.n_total} experts ({c.n_slots / c.n_total:.0%}) are in VRAM, "
                f"and the others are faster read in place (auto prefetches below {AUTO_MAX_SHARE:.0%}; "
                f"--tune prefetch=on overrides)")
        return None
    why = unsupported(step.cfg, step.layout)
    if why:
        if choice:
            raise ValueError(f"--tune prefetch=on cannot serve this model: {why}; run with --tune prefetch=off")
        log(f"expert prefetch off: {why}")
        return None
    step.set_prefetch(Prefetcher(step, depth, fetch_misses))
    top_k, nb = step.cfg.n_expert_used, banks(depth)
    what = "next-layer prediction" if depth == 1 else f"prediction {depth} layers ahead"
    late = f" + {MISS_BANKS} x {top_k} for late misses" if fetch_misses else ", late misses read in place"
    log(f"expert prefetch on: {what}, {nb} x {top_k} staging slots{late} "
        f"({vram_staging_slots(top_k, depth, fetch_misses) * step.layout.stride / 2**20:.0f} MiB of VRAM)")
    return step.prefetch


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
    """Buffers, staging slots, kernels and events of the prefetch for one DecodeStep (MoE models only)."""

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
        self.stride = lay.stride
        self.units = (lay.nbytes + 15) // 16          # 16-byte units copied per expert (within the 256-aligned stride)
        self.blob_bytes = self.units * 16
        self.slot_lo, self.slot_hi = cache.slot_lo, cache.slot_hi
        self.table = cache.table
        qts = sorted({int(layer.router.qt) for layer in step.weights.layers})
        mod = load_module(qts)
        # fetched now: no kernel is compiled or loaded while a graph is being captured
        self.f_predict = {qt: mod.get_function(f"predict<{qt}>") for qt in qts}
        self.f_router_predict = {qt: mod.get_function(f"router_predict<{qt}>") for qt in qts}
        self.smem = staged_bytes(c.n_embd)
        if self.smem > SMEM_DEFAULT:
            for f in (*self.f_predict.values(), *self.f_router_predict.values()):
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
        return np.uint64(a.data.ptr + off_bytes)

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
        st, top_k = self.step, self.top_k
        m = self.targets(li)[0]
        R, nxt = st.weights.layers[li].router, st.weights.layers[m]
        I32, I64, U64 = np.int32, np.int64, np.uint64
        warps = PREDICT_WARPS
        nb = (self.n_expert + warps - 1) // warps
        # layer li's router (router_fused's arguments), then layer m's prediction and layer li's noting
        predict = (U64(nxt.router.ptr), I64(nxt.router.row_bytes), self._ptr(nxt.ffn_norm), self._ptr(self.logits),
                   self._pred_out(m))
        note = (self._ptr(self.pred, 4 * top_k * li), I32(1 if li > 0 else 0), self._ptr(self.actual, 4 * top_k * li),
                self._note_stats(li), self._ptr(self.counters))
        self._fn("router", self.f_router_predict[int(R.qt)])(
            (2 * nb,), (32 * warps,), (*st.router_args(li), *predict, *note), shared_mem=self.smem)
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

    def launch_predict(self, li: int, m: int, note: bool = True):
        """predict: layer m's router on layer li's FFN input (with layer m's norm weights) into pred[m]; with
        `note`, layer li's routing noted against its own prediction (a second predict launch of the same layer notes
        nothing: check 0)."""
        st, top_k, c = self.step, self.top_k, self.step.cfg
        nxt = st.weights.layers[m]
        R = nxt.router
        I32, I64, F32, U64 = np.int32, np.int64, np.float32, np.uint64
        warps = PREDICT_WARPS
        self._fn("predict", self.f_predict[int(R.qt)])(
            ((self.n_expert + warps - 1) // warps,), (32 * warps,),
            (self._ptr(st.x), self._ptr(nxt.ffn_norm), F32(c.rms_eps), I32(c.n_embd), U64(R.ptr), I64(R.row_bytes),
             I32(self.n_expert), I32(top_k), self._ptr(self.logits), self._pred_out(m),
             self._ptr(st.ids), self._ptr(self.pred, 4 * top_k * li), I32(1 if li > 0 and note else 0),
             self._ptr(self.actual, 4 * top_k * li), self._note_stats(li), self._ptr(self.counters)),
            shared_mem=self.smem)

    def launch_note(self, li: int):
        """predict in bookkeeping mode (no router: one block, no staging): layer li's routing kept in actual and
        noted against its prediction, for the layers that predict nothing at depth 2."""
        st, top_k, c = self.step, self.top_k, self.step.cfg
        qt = int(st.weights.layers[li].router.qt)
        I32, I64, F32, U64 = np.int32, np.int64, np.float32, np.uint64
        self._fn("predict", self.f_predict[qt])(
            (1,), (32 * PREDICT_WARPS,),
            (self._ptr(st.x), self._ptr(st.weights.layers[li].ffn_norm), F32(c.rms_eps), I32(c.n_embd), U64(0), I64(0),
             I32(self.n_expert), I32(top_k), self._ptr(self.logits), U64(0),
             self._ptr(st.ids), self._ptr(self.pred, 4 * top_k * li), I32(1 if li > 0 else 0),
             self._ptr(self.actual, 4 * top_k * li), self._note_stats(li), self._ptr(self.counters)))

    def _copy(self, kind: str, blocks: int, li: int, routing, bank: int, rec, rec_addr, in_vram_too, counts,
              counter: int):
        """prefetch_copy (cuda_src/prefetch.cu) in named groups: layer li's entries, the ids to copy (routing), the
        staging bank they go to, the VRAM ranges whose entries need no copy, the bank's records, the counters."""
        I32, I64, U32, U64 = np.int32, np.int64, np.uint32, np.uint64
        what = (self._ptr(self.table), I32(li), I32(self.n_expert), I32(self.top_k), routing)
        into = (self._ptr(self.staging, bank * self.top_k * self.stride), I64(self.stride), U32(self.units))
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
