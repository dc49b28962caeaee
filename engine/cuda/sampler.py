"""Sampling on the GPU (cuda_src/sample.cu): penalties, top_k, top_p, min_p, temperature and a seeded draw from the
logits in VRAM, so only the chosen id comes back to the host. engine/sampling.py's SamplingParams is the reference: the
same chain in the same order with the same float32 penalty arithmetic; only the random source differs.

The random source: u = uniform(seed, step), splitmix64 of the request's seed and the number of draws so far (the
spec's seed and draws), as a double in [0, 1). The draw is the inverse CDF over the kept ids in id order: the first
kept id whose cumulative tempered weight exceeds u * total. So a seeded request gives the same tokens on the same
build, and uniform() below lets a test redo any draw in NumPy.

Settings live in device memory (PARAMS_DTYPE), the RNG counter and the penalty window (a ring of the last
penalty_last_n ids plus a count per vocabulary id) in device memory that the select kernel updates when it picks.
Nothing that changes between requests or steps is a kernel argument, so the launches are captured in the decode
step's graph. The request's state is the session's (engine/sampling.py PickSpec: params, seed, draws, history): the
GpuSampler keeps `held`, what the device holds in the spec's terms, follows the kernels' update after each pick, and
reloads only when a spec asks for another state (a new request, a rewind, a pick that was not fed back).

The kept set is found without sorting (cuda_src/sample.cu has the radix select). One block does it, since it is a
chain of small decisions, but over the whole vocabulary that is slow (docs/experiments.md). So the multi-block
kernels first narrow it down: sample_prep counts the keys in a histogram of their top 12 bits, sample_cut (one block, over
4096 bins) picks the lowest bin that the kept set can reach (from top_k's count, or top_p's mass bounded from both
sides by each bin's value range, and min_p's floor), and sample_gather marks the keys at or above it in a bitmap;
sample_select copies those candidates (at most CAND_CAP) into shared memory in id order and selects from them. When
the bins at and above the cut hold more than CAND_CAP keys (a large top_k, top_p over a flat distribution), it
selects from the whole vocabulary; either way the kept set and the draw are the same. When nothing but min_p cuts the kept set (temperature alone keeps
every key), the draw needs no select: sample_exp sums the tempered weights of each block's run of ids, and
sample_select walks only the run the draw falls in. bench/sampler.py has the figures.

Greedy without penalties keeps the step's own argmax (the fast path, its own graph); everything else goes through
these kernels in the step's "sampled" graph (engine/cuda/decode.py): a mode word read by the kernels would put three
launches (~8 us) into every greedy step as well.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import cupy as cp
import numpy as np

from engine.sampling import PickSpec, SamplingParams

SAMPLE_GRID = 264          # blocks of sample_prep / sample_exp / sample_gather (cuda_src/sample.cu SAMPLE_GRID)
SAMPLE_THREADS = 256       # their block size (SAMPLE_THREADS: their __launch_bounds__)
SELECT_THREADS = 1024      # sample_select's one block (SEL_THREADS)
CUT_THREADS = 1024         # sample_cut's one block (CUT_THREADS)
HIST_BINS = 4096           # sample_prep's key histogram (HIST_BINS)
CAND_CAP = 8192            # the most candidates sample_select takes instead of the vocabulary (CAND_CAP), held in
CAND_SMEM = 4 * CAND_CAP   # its dynamic shared memory (opted in: with its static 17 KB, past the default 48 KB)
KERNELS = ("sample_prep", "sample_exp", "sample_cut", "sample_gather", "sample_select")
MASK64 = (1 << 64) - 1

PARAMS_DTYPE = np.dtype({
    "names": ["top_p", "log_min_p", "seed", "temp", "pen_repeat", "pen_freq", "pen_present", "top_k", "penalties",
              "window", "pad"],
    "formats": ["<f8", "<f8", "<u8", "<f4", "<f4", "<f4", "<f4", "<i4", "<i4", "<i4", "<i4"],
    "offsets": [0, 8, 16, 24, 28, 32, 36, 40, 44, 48, 52], "itemsize": 56})
STATE_DTYPE = np.dtype({
    "names": ["maxword", "nan", "cut", "step", "ring_head", "ring_len", "u", "total", "zk", "bkey", "m", "pick", "nc"],
    "formats": ["<u8", "<i4", "<u4", "<u8", "<i4", "<i4", "<f8", "<f8", "<f8", "<u4", "<i4", "<i4", "<i4"],
    "offsets": [0, 8, 12, 16, 24, 28, 32, 40, 48, 56, 60, 64, 68], "itemsize": 72})
ALL_TIES = 0x7FFFFFFF


def uniform(seed: int, step: int) -> float:
    """The GPU's draw number `step` (0-based) for `seed`: splitmix64, top 53 bits as a double in [0, 1)."""
    z = (int(seed) + (int(step) + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return (z >> 11) * (1.0 / 9007199254740992.0)


def window_length(params: SamplingParams, ring_cap: int) -> int:
    """Ring length on the device: 0 without penalties; -1 (the whole context) and anything longer than the ring
    (max_context + 1) become the ring, which no request can fill."""
    if not params.penalties_active:
        return 0
    n = params.penalty_last_n
    return ring_cap if n < 0 or n > ring_cap else n


def pack_params(params: SamplingParams, ring_cap: int, seed: int) -> np.ndarray:
    p = np.zeros(1, PARAMS_DTYPE)
    p["top_p"] = params.top_p
    p["log_min_p"] = np.log(params.min_p) if params.min_p > 0.0 else -np.inf
    p["seed"] = int(seed) & MASK64
    p["temp"] = params.temperature if params.temperature > 0.0 else 0.0
    p["pen_repeat"], p["pen_freq"], p["pen_present"] = (params.penalty_repeat, params.penalty_freq,
                                                        params.penalty_present)
    p["top_k"] = params.top_k
    p["penalties"] = 1 if params.penalties_active else 0
    p["window"] = window_length(params, ring_cap)
    return p


def window_ids(window, n_vocab: int) -> np.ndarray:
    """The penalty window as the ring holds it: int32 ids, oldest first, those outside the vocabulary as -1 (counted
    by neither side)."""
    w = np.asarray(window, dtype=np.int64).reshape(-1)
    return np.where((w >= 0) & (w < n_vocab), w, -1).astype(np.int32)


@dataclass(frozen=True)
class Held:
    """A device state in a spec's terms: the settings, the seed, the RNG counter (the draws made) and the penalty
    window (the last window_length ids the pick counts, oldest first)."""
    params: SamplingParams
    seed: int
    draws: int
    window: tuple[int, ...]


class GpuSampler:
    """The device buffers of cuda_src/sample.cu's kernels, and `held`: what they hold (None: unknown)."""

    def __init__(self, kernels, n_vocab: int, ring_cap: int, stream):
        self.n = int(n_vocab)
        self.ring_cap = int(ring_cap)
        self.stream = stream
        with stream:
            self.params = cp.zeros(PARAMS_DTYPE.itemsize, dtype=cp.uint8)
            self.state = cp.zeros(STATE_DTYPE.itemsize, dtype=cp.uint8)
            self.counts = cp.zeros(self.n, dtype=cp.int32)
            self.ring = cp.full(self.ring_cap, -1, dtype=cp.int32)
            self.work = cp.zeros(self.n, dtype=cp.float32)
            self.pw = cp.zeros(self.n, dtype=cp.float64)
            self.qw = cp.zeros(self.n, dtype=cp.float64)
            self.zpart = cp.zeros(SAMPLE_GRID, dtype=cp.float64)
            self.qpart = cp.zeros(SAMPLE_GRID, dtype=cp.float64)
            self.hist = cp.zeros(HIST_BINS, dtype=cp.int32)
            self.bitmap = cp.zeros((self.n + 31) // 32, dtype=cp.uint32)
        for name in KERNELS:            # loaded now: nothing is loaded mid-request or mid-capture
            kernels(name)
        sel = kernels("sample_select")
        if getattr(sel, "max_dynamic_shared_size_bytes", 0) < CAND_SMEM:
            sel.max_dynamic_shared_size_bytes = CAND_SMEM
        self.held: Held | None = None

    # --- the request's state ---------------------------------------------------------------------------------
    def state_for(self, spec: PickSpec, fed=()) -> Held:
        """The device state the pick after `fed` (the decode call's tokens up to it) under spec needs."""
        w = window_length(spec.params, self.ring_cap)
        return Held(spec.params, int(spec.seed) & MASK64, int(spec.draws), spec.counted(fed)[-w:] if w else ())

    def prepare(self, spec: PickSpec, fed=()) -> None:
        """Make the device state the one the pick after `fed` needs (stream-ordered before the pick). In the
        session's loop (pick, feed the pick back) picked() has followed the kernels there already; anything else
        compares unequal and loads."""
        want = self.state_for(spec, fed)
        if want != self.held:
            self.load(want)

    def load(self, held: Held) -> None:
        """Write held's settings, penalty window and RNG counter (stream-ordered before the next pick)."""
        p = pack_params(held.params, self.ring_cap, held.seed)
        toks = window_ids(held.window, self.n)
        w = int(p["window"][0])
        st = np.zeros(1, STATE_DTYPE)
        st["step"] = held.draws
        st["ring_len"] = len(toks)
        st["ring_head"] = len(toks) % w if w else 0
        s = self.stream
        self.params.set(p.view(np.uint8), stream=s)
        self.state.set(st.view(np.uint8), stream=s)
        if w:
            valid = toks[toks >= 0]
            self.counts.set(np.bincount(valid, minlength=self.n).astype(np.int32), stream=s)
            if len(toks):
                self.ring[:len(toks)].set(toks, stream=s)
        self.held = held

    def picked(self, tok: int, status: int) -> None:
        """Follow the select kernel's update after a pick from `held`: a temperature > 0 pick advanced the counter,
        the pick entered the window. A failed pick (status != 0: NaN, or every logit -inf) advanced nothing there,
        but `held` is dropped, so the next pick reloads from its spec."""
        h = self.held
        if h is None or status != 0:
            self.held = None
            return
        w = window_length(h.params, self.ring_cap)
        drew = 1 if np.float32(h.params.temperature) > 0 else 0     # the kernel tests its float32 temp
        self.held = replace(h, draws=h.draws + drew, window=(h.window + (int(tok),))[-w:] if w else ())

    # --- launches --------------------------------------------------------------------------------------------
    def enqueue(self, kernels, logits, out_dptr) -> None:
        """The pick from `logits` (float32, n_vocab) into the mapped int32[2] at out_dptr, on the current stream."""
        n = np.int32(self.n)
        p, s = self.params, self.state
        stream = cp.cuda.get_current_stream().ptr
        cp.cuda.runtime.memsetAsync(s.data.ptr, 0, 16, stream)                  # maxword, nan, cut
        cp.cuda.runtime.memsetAsync(self.hist.data.ptr, 0, self.hist.nbytes, stream)
        grid, block = (SAMPLE_GRID,), (SAMPLE_THREADS,)
        kernels("sample_prep")(grid, block, (logits, n, p, self.counts, self.work, s, self.hist))
        kernels("sample_exp")(grid, block, (self.work, n, p, s, self.pw, self.qw, self.zpart, self.qpart))
        kernels("sample_cut")((1,), (CUT_THREADS,), (self.hist, self.zpart, np.int32(SAMPLE_GRID), n, p, s))
        kernels("sample_gather")(grid, block, (self.work, n, s, self.bitmap))
        kernels("sample_select")((1,), (SELECT_THREADS,),
                                 (self.work, self.pw, self.qw, self.zpart, self.qpart, np.int32(SAMPLE_GRID), n, p,
                                  s, self.counts, self.ring, self.bitmap, np.uint64(out_dptr)), shared_mem=CAND_SMEM)

    def read_state(self) -> np.ndarray:
        """The device state record (tests: the kept set's boundary, u, total, the pick)."""
        return self.state.get(stream=self.stream).view(STATE_DTYPE)[0]

    def close(self) -> None:
        self.held = None
        self.params = self.state = self.counts = self.ring = self.work = self.pw = self.qw = self.zpart = None
        self.hist = self.bitmap = self.qpart = None
