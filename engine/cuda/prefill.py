"""The prompt pass: a chunk of tokens through every layer.

Per chunk of T tokens, per layer: the dense projections as cuBLAS GEMMs with fp16 operands on tensor cores (weights
dequantized to fp16 once per chunk), the chunk's K/V into the cache in kv.py's layout (fp16 or int8) and tiled flash
attention over it (cuda_src/prefill_attn.cu); then the router and top-k on the GPU, the (token, expert) pairs sorted
by expert on the GPU (no host round trip), and the grouped expert GEMMs (cuda_src/moe_gemm.cu): first over the
experts resident in VRAM, then, for chunks of at least `stream_min` tokens, over every other expert batch by batch as
the ring (engine/cuda/ring.py) brings them in. Shorter chunks read the non-resident experts in place from the pinned
arena through the same kernels.

Every buffer comes from engine/cuda/chunk_plan.py's list, sized once when the backend starts, so a prompt never runs
out of VRAM halfway; a chunk or ring that does not fit is refused at start with the numbers.

The ring's VRAM: the backend holds back chunk_plan's buffers for the 4,096-token auto target and no ring (with
`ring=N`: N slots) before the expert cache takes the rest, so decode gets those bytes as cache slots. A streamed
prompt borrows expert-cache slots instead (two layers' worth of streamed experts): free ones first, then the coldest
occupied ones, whose experts stream with the rest; the first decode step after the prompt gives them back
(ExpertCache.give_back, refilled with the hottest experts that have no slot). docs/design.md, "The prompt pass".
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import cupy as cp
import numpy as np

from engine.cuda import kernels
from engine.cuda.chunk_plan import DEQUANT_SCRATCH_ELEMS, MiB, RING_MIN, buffers, chunk_bytes, no_buffers, plan_chunk
from engine.cuda.launch import F32, I32, I64, NULL, SMEM_DEFAULT, U64, Launcher, ptr
from engine.cuda.ring import CupyDevice, RingRunner, schedule
from engine.cuda.trace import Tracer

AUTO_TARGET = 4096          # the chunk auto reserves room for before the expert cache takes the rest
GEMM_TILE = 64              # rows and columns per expert GEMM block (moe_gemm.cu MG_BM, MG_BN)
# 64-row tiles a grouped-GEMM block multiplies per dequantized weight tile (moe_gemm.cu MG_MT): 2 halves the
# dequantization of the 4K-token chunk's average expert (256 rows); bench.prefill --moe-row-tiles 1 builds the other.
MOE_ROW_TILES = 2
CUDA_R_16F, CUDA_R_32F = 2, 0
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)     # cuBLAS scalars (host pointer mode)

PHASES = ("dense", "attention", "router", "sort", "gate_up", "down", "ring_wait", "other")

_INT = {"ids", "rows", "offsets"}
_HALF = {"xh", "h", "wh"}


def attn_module(head_dim: int):
    """prefill_attn.cu built for this head dim (compile-time in its tensor-core tiles; 128 is the default build that
    the backend loads before READY like any other build)."""
    return kernels.load("prefill_attn", None if head_dim == 128 else {"FA_HD": head_dim})


def attn_grid(T: int, n_head: int, n_head_kv: int, rows_per_block: int) -> tuple[int, int]:
    """flash_attn_*'s grid for a chunk of T tokens: the T * G query rows of each KV head in blocks of
    rows_per_block (prefill_attn.cu FA_BM), one grid row per KV head."""
    G = n_head // n_head_kv
    return (T * G + rows_per_block - 1) // rows_per_block, n_head_kv


@dataclass(frozen=True)
class AttnKernel:
    """flash_attn_f16 or flash_attn_i8 of one prefill_attn build with the launch shape that build was compiled for."""
    fn: object
    rows: int           # query rows per block (FA_BM)
    threads: int        # FA_THREADS
    smem: int           # dynamic shared memory bytes (two K/V stages; int8 also its raw stages)

    def __call__(self, T: int, n_head: int, n_head_kv: int, args) -> None:
        self.fn(attn_grid(T, n_head, n_head_kv, self.rows), (self.threads,), args, shared_mem=self.smem)


def attn_kernel(mod, int8: bool, oss: bool = False) -> AttnKernel:
    """The attention kernel of an attn_module build for this KV format, its shape asked of the build itself
    (flash_attn_shape), so the engine, the tests and bench.prefill_attn launch every variant alike; opted in to the
    shared memory it needs above 48 KiB. oss: gpt-oss's variant (sinks, window, KV ring: flash_attn_oss_*)."""
    shape = cp.zeros(4, cp.int32)
    mod.get_function("flash_attn_shape")((1,), (1,), (shape,))
    rows, threads, smem_f16, smem_i8 = (int(x) for x in shape.get())
    fn = mod.get_function(("flash_attn_oss_" if oss else "flash_attn_") + ("i8" if int8 else "f16"))
    smem = smem_i8 if int8 else smem_f16
    if smem > SMEM_DEFAULT and getattr(fn, "max_dynamic_shared_size_bytes", 0) < smem:
        fn.max_dynamic_shared_size_bytes = smem
    return AttnKernel(fn, rows, threads, smem)


def expert_row_blocks(T: int, k: int, n_expert: int, row_tiles: int | None = None) -> int:
    """Blocks per expert along the rows of the grouped GEMMs (moe_gemm.cu loops over the rest): twice what the
    average expert's rows need, at most what one expert can have (T rows)."""
    rows = GEMM_TILE * (row_tiles or MOE_ROW_TILES)
    avg = T * k / max(n_expert, 1)
    return max(1, min(-(-T // rows), 2 * -(-int(avg) // rows)))


def moe_module(qtypes, row_tiles: int | None = None, pairs=None):
    """moe_gemm.cu for these quant types with MG_MT = row_tiles (the default build when it is the default); pairs:
    the (gate, up) types of layers whose gate and up differ (moe_gemm_gate_up_mixed)."""
    mt = row_tiles or MOE_ROW_TILES
    return kernels.load("moe_gemm", None if mt == 2 else {"MG_MT": mt}, qtypes=sorted(qtypes),
                        pairs=sorted(pairs) if pairs else None)


def parse_chunk(v):
    return "auto" if v in (None, "auto") else int(v)


def vram_left(opts) -> int:
    """Bytes this worker may still take: free VRAM (plus what CuPy's pool holds unused) less the reserve, within
    --vram-budget-mib."""
    pool = cp.get_default_memory_pool()
    free = cp.cuda.runtime.memGetInfo()[0] + pool.free_bytes() - opts.vram_reserve_mib * MiB
    if opts.vram_budget_mib is not None:
        free = min(free, opts.vram_budget_mib * MiB - pool.used_bytes())
    return max(0, int(free))


def target_chunk(opts, max_ctx: int) -> int:
    """The chunk the backend plans for: --prefill-chunk, or AUTO_TARGET for auto; at most the context."""
    chunk = parse_chunk(opts.prefill_chunk)
    return min(AUTO_TARGET if chunk == "auto" else chunk, max_ctx)


def reserve_bytes(cfg, stride: int, n_total: int, opts, max_ctx: int, extra=no_buffers) -> int:
    """What the backend holds back for the streamed pass before sizing the expert cache: the target chunk, and the
    ring only when `ring=N` asks for its own slots (the auto ring borrows cache slots per prompt; when the cache
    holds every expert nothing streams). extra: the family's prompt buffers (chunk_plan.buffers)."""
    ring = opts.ring if (stride and n_total and opts.ring is not None) else 0
    return chunk_bytes(cfg, target_chunk(opts, max_ctx), extra) + ring * stride


class PhaseTimer:
    """GPU time per phase of a chunk from CUDA events recorded on the compute stream between phases (never inside a
    kernel sequence, so the figures are the chunk's own): mark(p) closes phase p at that point of the stream."""

    def __init__(self, stream):
        self.stream = stream
        self.marks = []
        self.start = self._record()

    def _record(self):
        ev = cp.cuda.Event()
        ev.record(self.stream)
        return ev

    def mark(self, phase: str) -> None:
        self.marks.append((phase, self._record()))

    def totals(self) -> dict[str, float]:
        """Milliseconds per phase (waits for the chunk's last event)."""
        out = dict.fromkeys(PHASES, 0.0)
        if not self.marks:
            return out
        self.marks[-1][1].synchronize()
        prev = self.start
        for phase, ev in self.marks:
            out[phase] = out.get(phase, 0.0) + cp.cuda.get_elapsed_time(prev, ev)
            prev = ev
        return out


class Prefill:
    """The prompt pass over a DecodeStep's weights, caches and family. ring_device(dev) -> dev: what the ring copies
    through (the memory modes stage file-only experts: memory_mode.MemoryMode.ring_device); None: dev itself.
    free: the VRAM bytes its buffers and ring may take (a pipeline stage's share); None: vram_left(opts).

    A pipeline stage's step (DecodeStep.layer_range, engine/cuda/staged_backend.py) makes a stage's pass: only its
    layers run (and stream experts through its ring), the first stage embeds the chunk, a later one starts from the
    rows handed to forward(x_in=), and every stage but the last returns its chunk's rows instead of logits."""

    def __init__(self, step, opts, log=lambda m: None, tracer=None, ring_device=None, free: int | None = None):
        self.step, self.opts, self.log = step, opts, log
        self.tracer = tracer or Tracer()
        self.kernels, self.cfg, self.weights, self.kv, self.cache, self.layout = (
            step.kernels, step.cfg, step.weights, step.kv, step.cache, step.layout)
        self.launcher = Launcher(self.kernels, self.cfg)
        c, family = self.cfg, step.family
        self.att_mod = attn_module(c.head_dim)
        self.attend = family.prompt_attention(self.att_mod, self.kv.dtype == "int8")     # the family's variant
        blob = self.layout
        qts = set(self.weights.qtype_ids()) | (blob.qtype_ids() if blob else set())
        pairs = {(ly.qt_gate_up, ly.qt_up) for ly in blob.layers if ly.qt_up >= 0} if blob else set()
        self.moe_mod = moe_module(qts, pairs=pairs)          # also to_half and dequant_rows_f16
        stride = blob.stride if blob else 0
        # at least the experts the cache has no slot for stream; the ring borrows cache slots on top of its own
        n_stream = self.cache.n_served - self.cache.n_slots if self.cache is not None else 0
        free = vram_left(opts) if free is None else int(free)
        self.plan = plan_chunk(c, free, chunk=parse_chunk(opts.prefill_chunk), ring=opts.ring, stride=stride,
                               n_stream=n_stream, max_tokens=getattr(self.kv, "chunk_cap", self.kv.max_ctx),
                               lendable=self.cache.lendable if self.cache is not None else 0,
                               extra=family.prompt_buffers)
        self.chunk = self.plan.chunk
        with step.stream:
            self.buf = {}
            for b in buffers(c, self.chunk, family.prompt_buffers):
                if b.keep:
                    dt = cp.int32 if b.name in _INT else cp.float16 if b.name in _HALF else cp.float32
                    self.buf[b.name] = cp.empty(b.elems, dtype=dt)
            self.ring_mem = cp.empty(self.plan.ring * stride, dtype=cp.uint8)
        self.dev = CupyDevice(step.stream) if blob else None        # the ring's copy device
        if self.dev is not None and ring_device is not None:
            self.dev = ring_device(self.dev)
        self._tm = None
        self._groups_key = self._groups_val = None
        self.lent: list[int] = []    # expert-cache slots the ring holds now (given back by give_back)
        self._chunk = None           # the chunk's expert groups, ring runner and ring batches (experts())
        self._views, self._views_T = {}, 0       # _view's, for chunks of _views_T tokens
        p = self.plan
        lend = (f"up to {p.lend} expert-cache slots lent per prompt (the coldest experts evicted for them)"
                if p.lend_occupied else f"up to {p.lend} free expert-cache slots lent")
        log(f"streamed prompt pass: chunks of {self.chunk} tokens ({p.chunk_bytes / MiB:.0f} MiB), "
            f"ring of {p.ring} own slots ({p.ring_bytes / MiB:.0f} MiB) + {lend}; {free / MiB:.0f} MiB were left")
        self.layers = family.prompt_layers(self, step.recurrent)    # the family's layer program (its scratch)

    # --- lent expert-cache slots ------------------------------------------------------------------------------
    def borrow(self) -> list[int]:
        """Top the ring's lent cache slots up to the plan's count (the first streamed chunk of a prompt borrows them,
        later chunks keep them); returns their addresses. The cache writes the evicted experts' entries on the
        compute stream, before the event the ring's copy stream waits on."""
        want = self.plan.lend - len(self.lent)
        if want > 0:
            new = self.cache.lend(want, self.step.stream, occupied=self.plan.lend_occupied)
            if new:
                self.lent += new
                self.log(f"streamed prompt pass: {len(self.lent)} expert-cache slots lent to the ring "
                         f"({self.plan.ring} own)")
        return [self.cache.slot_ptr(s) for s in self.lent]

    def give_back(self, stream) -> int:
        """The prompt is over: the lent slots go back to the cache, refilled with its hottest experts that have
        none (after everything on `stream`, which includes the ring's last readers). Returns how many."""
        if not self.lent:
            return 0
        slots, self.lent = self.lent, []
        self._groups_key = self._groups_val = None
        return self.cache.give_back(slots, stream)

    def _groups(self, T: int):
        """Per layer the in-place group (sel, ptrs, n): the resident experts when the ring streams the rest, else every
        expert through the pointer table. With the ring: its runner and, per layer, its (batch, (sel, ptrs, n))."""
        c, cache = self.cfg, self.cache
        # a stage's pass runs only its layers: the others count as resident, so none of their experts streams
        others = np.ones(c.n_layer, dtype=bool)
        others[self.step.layers_run.start:self.step.layers_run.stop] = False
        resident = (cache.slot_of >= 0).reshape(c.n_layer, c.n_expert) | others[:, None]
        stream = T >= self.opts.stream_min and not resident.all()
        slots = []
        if stream:
            own = [int(self.ring_mem.data.ptr) + i * self.layout.stride for i in range(self.plan.ring)]
            slots = own + self.borrow()
            stream = len(slots) >= RING_MIN
            # lending evicted experts: they stream too
            resident = (cache.slot_of >= 0).reshape(c.n_layer, c.n_expert) | others[:, None]
        key = (stream, resident.tobytes(), tuple(slots), cache.table_host.tobytes())
        if self._groups_key == key:       # the same placement as the last chunk: the same tables and batches
            groups, per_layer, batches = self._groups_val
            runner = RingRunner(self.dev, slots, self.layout.stride, timing=self.tracer.copy_timing,
                                layer_bytes=self.layout.strides()) if stream else None
            return groups, per_layer, runner, batches
        table = cache.table_host.reshape(c.n_layer, c.n_expert)
        sel_all, ptr_all, spans = [], [], []
        for li in range(c.n_layer):
            es = np.flatnonzero(resident[li]) if stream else np.arange(c.n_expert)
            if others[li]:
                es = es[:0]             # another stage's layer: never run here
            spans.append((len(sel_all), len(es)))
            sel_all += es.tolist()
            ptr_all += table[li, es].tolist()
        batches = schedule(resident, len(slots)) if stream else []
        for b in batches:
            spans.append((len(sel_all), len(b.items)))
            sel_all += list(b.experts)
            ptr_all += [slots[s] for s in b.slots]
        # kept on self: the views below point into these until the chunk's kernels have run
        self._sel = cp.asarray(np.asarray(sel_all, dtype=np.int32))
        self._ptrs = cp.asarray(np.asarray(ptr_all, dtype=np.uint64))
        views = [(U64(self._sel.data.ptr + 4 * o), U64(self._ptrs.data.ptr + 8 * o), n) for o, n in spans]
        per_layer = {li: [] for li in range(c.n_layer)}
        for b, view in zip(batches, views[c.n_layer:]):
            per_layer[b.layer].append((b, view))
        self._groups_key, self._groups_val = key, (views[:c.n_layer], per_layer, batches)
        runner = RingRunner(self.dev, slots, self.layout.stride, timing=self.tracer.copy_timing,
                            layer_bytes=self.layout.strides()) if stream else None
        return views[:c.n_layer], per_layer, runner, batches

    # --- fp32 projections (routers, the shared expert, an all-logits head) -----------------------------------------
    def dequant(self, addr: int, qt: int, row_bytes: int, rows: int, cols: int) -> cp.ndarray:
        out = cp.empty((rows, cols), dtype=cp.float32)
        blocks = min(4096, (rows * cols // 8 + 255) // 256)
        self.kernels("dequant_rows", qt)((max(blocks, 1),), (256,),
                                   (U64(addr), I64(row_bytes), ptr(out), I32(rows), I32(cols)))
        return out

    def linear(self, W, X: cp.ndarray) -> cp.ndarray:
        """X @ W^T for a DevMatrix W, dequantized in row blocks."""
        step_rows = max(1, DEQUANT_SCRATCH_ELEMS // W.cols)
        if W.rows <= step_rows:
            return X @ self.dequant(W.ptr, W.qt, W.row_bytes, W.rows, W.cols).T
        out = cp.empty((X.shape[0], W.rows), dtype=cp.float32)
        for r0 in range(0, W.rows, step_rows):
            n = min(step_rows, W.rows - r0)
            out[:, r0:r0 + n] = X @ self.dequant(W.ptr + r0 * W.row_bytes, W.qt, W.row_bytes, n, W.cols).T
        return out

    def ffn(self, Wg, Wu, Wd, xn):
        g = self.linear(Wg, xn)
        u = self.linear(Wu, xn)
        return self.linear(Wd, g / (1.0 + cp.exp(-g)) * u)

    def linear_into(self, W, X, out):
        """out = X @ W^T for a DevMatrix W (dequantized to fp32 scratch in row blocks)."""
        step_rows = max(1, DEQUANT_SCRATCH_ELEMS // W.cols)
        for r0 in range(0, W.rows, step_rows):
            n = min(step_rows, W.rows - r0)
            Wd = self.dequant(W.ptr + r0 * W.row_bytes, W.qt, W.row_bytes, n, W.cols)
            if n == W.rows:
                cp.matmul(X, Wd.T, out=out)
            else:
                out[:, r0:r0 + n] = X @ Wd.T
        return out

    # --- the pass --------------------------------------------------------------------------------------------
    def linear_f16(self, W, xh, out, accumulate: bool = False):
        """out (T, W.rows) fp32 = xh (T, W.cols) fp16 @ W^T, or out += that: W dequantized to fp16 once per chunk in
        row blocks of the "wh" scratch, each block one cuBLAS GEMM with fp16 operands on tensor cores and fp32
        accumulation (out's columns r0.. of each block written in place: ldc is the full row)."""
        from cupy_backends.cuda.libs import cublas     # here: importing it needs libcublas, which CPU machines lack
        T, K = xh.shape
        if K != W.cols or out.shape != (T, W.rows):
            raise ValueError(f"linear_f16: {xh.shape} @ ({W.rows}, {W.cols})^T into {out.shape}")
        wh = self.buf["wh"]
        deq = self.moe_mod.get_function(f"dequant_rows_f16<{int(W.qt)}>")
        step = max(1, wh.size // K)
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
        mode = cublas.getPointerMode(handle)
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        try:
            for r0 in range(0, W.rows, step):
                n = min(step, W.rows - r0)
                deq((max(1, min(4096, (n * K // 8 + 255) // 256)),), (256,),
                    (U64(W.ptr + r0 * W.row_bytes), I64(W.row_bytes), wh, I32(n), I32(K)))
                cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, T, K,
                              _ONE.ctypes.data, wh.data.ptr, CUDA_R_16F, K, xh.data.ptr, CUDA_R_16F, K,
                              (_ONE if accumulate else _ZERO).ctypes.data, out.data.ptr + 4 * r0, CUDA_R_32F, W.rows,
                              cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        finally:
            cublas.setPointerMode(handle, mode)
        return out

    def to_half(self, src, T: int, width: int):
        """src (T, width) fp32 -> the "xh" buffer's first T * width values as fp16 (saturating); the (T, width) view."""
        n = T * width
        xh = self.buf["xh"]
        self.moe_mod.get_function("to_half")((max(1, min(1024, (n // 4 + 255) // 256)),), (256,), (src, xh, I64(n)))
        return xh[:n].reshape(T, width)

    def _timing_event(self):
        ev = cp.cuda.Event()
        ev.record(self.step.stream)
        return ev

    def _mark(self, phase: str) -> None:
        if self._tm is not None:
            self._tm.mark(phase)

    def _view(self, name, T, width):
        """Buffer `name` as (T, width); the chunk's views are made once (the families' layers ask per layer)."""
        if T != self._views_T:
            self._views, self._views_T = {}, T
        v = self._views.get((name, width))
        if v is None:
            v = self._views[name, width] = self.buf[name][:T * width].reshape(T, width)
        return v

    def forward(self, tokens, pos0: int, all_logits: bool, ahead=None, x_in=None) -> cp.ndarray:
        """The chunk `tokens` at positions pos0.. through this pass's layers on the current stream: its logits (all
        rows, or the last row's) when the pass ends at the model's last layer, else its hidden rows (the "x" buffer's
        view: valid until the next chunk; a stage hands them on). ahead: the token ids of the chunk that will follow,
        when known (the family gathers its host inputs meanwhile). x_in: the rows a later stage starts from (its first
        T rows are copied into "x"); None: the first stage embeds `tokens`.

        The chunk's facts for the tracer: host_ms from the start to the last layer enqueued (launches block once
        the GPU is far enough behind, so on a GPU-bound pass this is close to the wall time too), begin_ms of it in
        the family's per-chunk host inputs (qwen4exp: its PLE rows, rows_* in host_facts), groups_ms in the expert
        groups' tables, layers_ms enqueuing the layers."""
        c, w, mv = self.cfg, self.weights, self.launcher
        T = len(tokens)
        if T > self.chunk:
            raise ValueError(f"a chunk of {T} tokens is longer than the streamed pass's {self.chunk}")
        if (x_in is None) != self.step.embeds:
            raise ValueError("a pass that starts at layer 0 embeds its tokens; a later stage's needs the rows "
                             "handed to it (x_in)")
        t0 = time.perf_counter()
        x, xn = self._view("x", T, c.n_embd), self._view("xn", T, c.n_embd)
        self._tm = PhaseTimer(self.step.stream) if self.tracer.phase_timing else None
        if x_in is None:
            tok = cp.asarray(np.asarray(tokens, dtype=np.int32))
            te = w.tok_embd
            self.kernels("embed", te.qt)((T,), (256,), (U64(te.ptr), I64(te.row_bytes), ptr(tok), NULL, NULL,
                                                ptr(x), I32(c.n_embd)))
        else:
            if x_in.dtype != x.dtype or x_in.ndim != 2 or x_in.shape[0] < T or x_in.shape[1] != c.n_embd:
                raise ValueError(f"x_in {x_in.shape} {x_in.dtype} for a chunk of {T} rows of {c.n_embd}")
            x[...] = x_in[:T]
        groups = runner = ring_views = window = None
        t_groups = time.perf_counter()
        if c.is_moe:
            groups, ring_views, runner, batches = self._groups(T)
            if runner is not None:
                # the ring's slots may still be read by earlier work (and lent ones by the decode steps before the
                # table writes that evicted their experts); with timing, every copy-span time counts from here
                ev = cp.cuda.Event(disable_timing=not self.tracer.copy_timing)
                ev.record(self.step.stream)
                self.dev.copy_stream.wait_event(ev)
                window = [ev, None, None]
                arena = self.cache.arena.blob_ptr
                # the memory modes' device stages file-only experts for the ring (engine/cuda/memory_mode.py)
                src_of = getattr(self.dev, "source_of", None) or (lambda li, e: int(arena[li * c.n_expert + e]))
                runner.begin_chunk(batches, src_of)
        self._chunk = (groups, runner, ring_views)
        t_begin = time.perf_counter()
        self.layers.begin_chunk(tokens, pos0)   # the family's per-chunk host inputs (qwen4exp: its PLE rows)
        if ahead is not None:
            self.layers.read_ahead(ahead)       # ... and the next chunk's, gathered while this one runs
        t_layers = time.perf_counter()
        self._mark("other")
        # bench: the link's busy share counts from the first layer that streams experts to the end of the last one
        run = self.step.layers_run
        streamed = [li for li in run if ring_views[li]] if window and self.tracer.copy_timing else []
        for li in run:
            layer = w.layers[li]
            if streamed and li == streamed[0]:
                window[1] = self._timing_event()
            self.layers.layer(li, layer, x, xn, T, pos0)        # the family's: x through layer li
            if c.is_moe:
                self.tracer.prefill_routes(pos0, li, self._view("ids", T, c.n_expert_used))
                if streamed and li == streamed[-1]:
                    window[2] = self._timing_event()
        self._chunk = None
        if runner is not None:
            runner.end_chunk()
            facts = dict(ring=runner.depth, lent=len(self.lent), bytes=runner.bytes_copied, runner=runner,
                         window=tuple(window) if streamed else None)
        else:
            facts = dict(ring=0, lent=0, bytes=0, runner=None, window=None)
        t_end = time.perf_counter()
        facts.update(tokens=T, host_ms=(t_end - t0) * 1000, groups_ms=(t_begin - t_groups) * 1000,
                     begin_ms=(t_layers - t_begin) * 1000, layers_ms=(t_end - t_layers) * 1000,
                     **self.layers.host_facts())
        if not self.step.heads:         # a stage before the last: its rows go on to the next stage
            self._mark("other")
            if self._tm is not None:
                facts["phases"], self._tm = self._tm, None
            self.tracer.prefill_chunk(facts)
            return x
        if all_logits:
            xo = x      # a family without an output norm (qwen4exp) leaves x normed by its own last step
            if w.output_norm is not None:
                xo = cp.empty_like(x)
                mv.rmsnorm(x, w.output_norm, xo, rows=T)
            out = self.linear(w.output, xo)
        else:   # the last row: the decode step's mat-vec (norm fused) on the quantized head, no fp32 copy of it
            out = cp.empty((1, c.n_vocab), dtype=cp.float32)
            mv.output_logits(w, x[-1:], out)
        self._mark("other")
        if self._tm is not None:
            facts["phases"], self._tm = self._tm, None     # .totals() once the chunk has finished
        self.tracer.prefill_chunk(facts)
        return out

    # --- the routed experts: the families' prompt layers compose these ---------------------------------------
    def route(self, li: int, logits, T: int, renorm: bool) -> None:
        """The top k of layer li's router logits (T, n_expert) into the "ids" / "wts" buffers, the routing counted."""
        c, cache = self.cfg, self.cache
        top_k = c.n_expert_used
        ids, wts = self._view("ids", T, top_k), self._view("wts", T, top_k)
        self.kernels("router_topk")((T,), (32,),
                              (ptr(logits), I32(c.n_expert), I32(top_k), I32(1 if renorm else 0),
                               F32(c.expert_weights_scale), ptr(ids), ptr(wts), NULL, U64(0), U64(0),
                               U64(cache.counts.data.ptr + 4 * li * c.n_expert), NULL))
        self._mark("router")

    def experts(self, li: int, xn, x, T: int, gemms) -> None:
        """x += layer li's routed experts of xn for the routing in "ids" / "wts": the (token, expert) pairs sorted by
        expert, then gemms (the family's moe_gemm.cu kernels, families/moe.py ExpertGemms) over every expert in place
        (or, in the memory modes, the routed ones with the file-only ones staged), then the ring's batches."""
        c, blob, cache, mod = self.cfg, self.layout.layer(li), self.cache, self.moe_mod
        groups, runner, ring_views = self._chunk
        top_k = c.n_expert_used
        ids, wts = self._view("ids", T, top_k), self._view("wts", T, top_k)
        xh = self.to_half(xn, T, c.n_embd)
        offsets, rows, row_w, h = self.buf["offsets"], self.buf["rows"], self.buf["row_w"], self.buf["h"]
        mod.get_function("moe_sort")((1,), (1024,), (ids, wts, I32(T * top_k), I32(top_k), I32(c.n_expert), offsets,
                                                     rows, row_w))
        self._mark("sort")
        gu, dn = gemms.gate_up, gemms.down
        row_blocks = expert_row_blocks(T, top_k, c.n_expert)

        def run(sel, ptrs, n):
            if not n:
                return
            gu(((blob.n_ff + GEMM_TILE - 1) // GEMM_TILE, row_blocks, n), (256,),
               (sel, ptrs, offsets, rows, xh, h, I64(blob.up_off), *gemms.gate_up_rows, I32(blob.n_ff),
                I32(c.n_embd), *gemms.gate_up_extra))
            self._mark("gate_up")
            dn(((c.n_embd + GEMM_TILE - 1) // GEMM_TILE, row_blocks, n), (256,),
               (sel, ptrs, offsets, rows, row_w, h, x, I64(blob.down_off), I64(blob.rb_down), I32(c.n_embd),
                I32(blob.n_ff), *gemms.down_extra))
            self._mark("down")

        if runner is None and cache.source is not None:   # memory modes: the routed experts, file-only ones staged
            from engine.cuda.memory_mode import routed_group
            # its arrays stay alive until the next layer's group replaces them
            group, staged_done, self._routed = routed_group(cache, li, ids, self.step.stream)
            run(*group)
            staged_done()
        else:
            run(*groups[li])
        if runner is not None:
            for b, view in ring_views[li]:
                runner.acquire(b)
                self._mark("ring_wait")
                run(*view)
                runner.release(b)
