"""One decode step (one token through every layer, greedy pick on the GPU) as a fixed sequence of kernel launches,
captured once as a CUDA graph and replayed. Nothing that changes between steps is a kernel argument: the token and
position are read from mapped pinned memory by the first kernel, the experts through the pointer table, so the same
graph serves every step and every cache state.

The host launches a step only after it has read the last pick. Queuing the next step before that, its token read on
the device from the pick (branch experiment/ahead, not landed), measured nothing on the H200
(bench.decode --ahead both: all resident 322.7 against 322.3 tok/s, 12 GiB 197.0 against 198.5): back-to-back graph
replays take as long per step as the bench loop does, so no host gap sits between steps. The ~300 us that
bench.decode_trace shows for cudaGraphLaunch, with the GPU idle meanwhile, is the profiler's (CUPTI) own."""
from __future__ import annotations

import cupy as cp
import numpy as np

from engine.cuda.kv import DecodeAttention
from engine.cuda.launch import F32, I32, I64, MV_WARPS, NULL, U64, Launcher, MappedInts, ptr

class _Only:
    """The kernel table with every kind but `tag` turned into a no-op (profiling); records the kinds it sees."""

    def __init__(self, kernels, tag, seen: set):
        self.kernels, self.tag, self.seen = kernels, tag, seen

    def __call__(self, name, qt=None, tag=None):
        kind = tag or name
        self.seen.add(kind)
        if self.tag is None or kind == self.tag:
            return self.kernels(name, qt)
        return lambda *a, **kw: None


class DecodeStep:
    def __init__(self, kernels, cfg, weights, kv, rope_cs, cache, layout, stream):
        self.L = Launcher(kernels, cfg)
        self.k = kernels
        self.cfg = cfg
        self.w = weights
        self.kv = kv
        self.rope = rope_cs
        self.cache = cache
        self.layout = layout
        self.stream = stream
        c = cfg
        f32 = lambda n: cp.zeros(n, dtype=cp.float32)
        with stream:
            self.x = f32(c.n_embd)
            self.q = f32(c.n_head * c.head_dim)
            self.kk = f32(c.n_head_kv * c.head_dim)
            self.v = f32(c.n_head_kv * c.head_dim)
            self.att = f32(c.n_head * c.head_dim)
            self.attn = DecodeAttention(kernels, c, kv)      # its split buffers; K/V layout from kv.dtype
            k = max(c.n_expert_used, 1)
            self.h = f32(max(c.n_ff, k * c.n_ff_exp, 8))
            self.h2 = f32(max(c.n_ff_shexp, 8))
            self.rlogits = f32(max(c.n_expert, 1))
            self.ids = cp.zeros(k, dtype=cp.int32)
            self.wts = f32(k)
            self.sgate = f32(1)
            self.logits = f32(c.n_vocab)
            self.state = cp.zeros(8, dtype=cp.int32)
            self.counter = cp.zeros(1, dtype=cp.int32)          # router_fused's "last block" counter
        self.params = MappedInts(2)
        self.out = MappedInts(2)
        self.graph = None
        self.prefetch = None        # engine/cuda/prefetch.py's Prefetcher, attached by the backend when it is on

    # --- the launch sequence ---------------------------------------------------------------------------------
    # The RMSNorms have no launches: each kernel that reads a normed vector stages rmsnorm(x) * w per block (the
    # consumer recomputes sum(x^2); no inter-block sync). The other direction, the producer's last block writing
    # the next norm (a fence and a serial tail in wo and moe_down), measured slower on the H200: 4.93 vs 4.64 ms.
    def enqueue(self):
        pf = self.prefetch
        self.enqueue_embed()
        for li in range(len(self.w.layers)):
            self.enqueue_attention_block(li)
            if not (pf and pf.enqueue_router(li)):      # the prefetch's router launch also predicts layer li+1
                self.enqueue_router(li)
            if pf:          # predict layer li+1's experts and start fetching them; wait for layer li's fetch
                pf.enqueue(li)
            self.enqueue_experts(li)
        if pf:
            pf.enqueue_finish()
        self.enqueue_output()
        self.enqueue_pick()
        if pf:
            pf.enqueue_join()

    def enqueue_embed(self):
        c, te = self.cfg, self.w.tok_embd
        self.k("embed", te.qt)((1,), (256,), (U64(te.ptr), I64(te.row_bytes), NULL, self.params.dptr,
                                            ptr(self.state), ptr(self.x), I32(c.n_embd)))

    def enqueue_attention_block(self, li):
        """Attention norm, Q/K/V, RoPE + KV store, attention, and wo added to the residual x."""
        c, L = self.cfg, self.L
        ly = self.w.layers[li]
        scale = F32(c.attn_scale or 1.0 / np.sqrt(c.head_dim))
        L.mv3((ly.wq, ly.wk, ly.wv), self.x, (self.q, self.kk, self.v), (ly.bq, ly.bk, ly.bv), norm=ly.attn_norm)
        self.attn.step(self.k, li, self.q, self.kk, self.v, ly.q_norm, ly.k_norm, self.rope, self.att, self.state,
                       scale)
        L.mv(ly.wo, self.att, self.x, accumulate=True, tag="wo")

    def enqueue_router(self, li):
        """For MoE layers the router (on the FFN-normed x, the norm fused): afterwards self.ids / self.wts hold
        layer li's routing. Dense layers: nothing (their FFN kernels apply the norm)."""
        c = self.cfg
        ly = self.w.layers[li]
        if not c.is_moe:
            return
        cache = self.cache
        k = c.n_expert_used
        tab = U64(cache.table.data.ptr + 8 * li * c.n_expert)
        R = ly.router
        f = self.k("router_fused", R.qt, "router")
        f(((R.rows + MV_WARPS - 1) // MV_WARPS,), (32 * MV_WARPS,),
          (U64(R.ptr), I64(R.row_bytes), ptr(self.x), ptr(ly.ffn_norm), F32(c.rms_eps), I32(R.cols),
           ptr(self.rlogits), I32(c.n_expert), I32(k), I32(1 if c.expert_weights_norm else 0),
           F32(c.expert_weights_scale), ptr(self.ids), ptr(self.wts), tab, U64(cache.slot_lo), U64(cache.slot_hi),
           U64(cache.counts.data.ptr + 4 * li * c.n_expert), ptr(cache.stats), ptr(self.counter)),
          shared_mem=self.L.smem(f, R.cols, True))

    def enqueue_experts(self, li):
        """The routed experts (gate/up then down, weighted, added to x) and the shared expert; or the dense FFN."""
        c, L = self.cfg, self.L
        ly = self.w.layers[li]
        nw, x = ly.ffn_norm, self.x
        if not c.is_moe:
            L.swiglu(ly.w_gate, ly.w_up, x, self.h, norm=nw)
            L.mv(ly.w_down, self.h, x, accumulate=True)
            return
        lay, cache = self.layout, self.cache
        k = c.n_expert_used
        tab = U64(cache.table.data.ptr + 8 * li * c.n_expert)
        f = self.k("moe_gate_up", lay.qt_gate_up)
        f(((lay.n_ff + MV_WARPS - 1) // MV_WARPS, k, 1), (32 * MV_WARPS,),
          (tab, ptr(self.ids), I64(lay.up_off), I64(lay.rb_gate_up), ptr(x), ptr(nw), F32(c.rms_eps), ptr(self.h),
           I32(lay.n_ff), I32(c.n_embd), I32(k)),
          shared_mem=L.smem(f, c.n_embd, True))
        shared = ly.sh_up is not None
        if shared:      # the shared expert reads x before moe_down adds to it
            if ly.sh_gate_inp is not None:
                L.mv(ly.sh_gate_inp, x, self.sgate, tag="shexp", norm=nw)
            L.swiglu(ly.sh_gate, ly.sh_up, x, self.h2, norm=nw, tag="shexp")
        f = self.k("moe_down", lay.qt_down)
        sm = L.smem(f, k * lay.n_ff, False, optional_max=100 * 1024)   # e.g. 8 x 1536 (Qwen3-235B): 50 KiB
        f(((c.n_embd + MV_WARPS - 1) // MV_WARPS, 1), (32 * MV_WARPS,),
          (tab, ptr(self.ids), ptr(self.wts), I64(lay.down_off), I64(lay.rb_down), ptr(self.h), ptr(x),
           I32(c.n_embd), I32(lay.n_ff), I32(k), I32(1 if sm else 0)),
          shared_mem=sm)
        if shared:
            L.mv(ly.sh_down, self.h2, x, gate_logit=self.sgate if ly.sh_gate_inp is not None else None,
                 accumulate=True, tag="shexp")

    def enqueue_output(self):
        """The output mat-vec (of the final-normed x, the norm fused) into self.logits."""
        self.L.output_logits(self.w, self.x, self.logits)

    def enqueue_pick(self):
        """The next token from self.logits into self.out: the argmax, or while a GPU sampler is active (its own graph
        variant, engine/cuda/sampler.py) its penalties / top_k / top_p / min_p / temperature and seeded draw."""
        gs = getattr(self, "sampler", None)
        if gs is not None and gs.active:
            gs.enqueue(self.k, self.logits, self.out.dptr)
            return
        c = self.cfg
        self.k("argmax_word")((264,), (256,), (ptr(self.logits), I32(c.n_vocab), ptr(self.state)))
        self.k("argmax_finish")((1,), (1,), (ptr(self.state), self.out.dptr))

    # --- running ---------------------------------------------------------------------------------------------
    def capture(self):
        s = self.stream
        s.synchronize()
        s.begin_capture()
        try:
            with s:
                self.enqueue()
        finally:
            self.graph = s.end_capture()

    def launch(self, token: int, pos: int, use_graph: bool = True):
        self.params.view[0] = token
        self.params.view[1] = pos
        if use_graph and self.graph is not None:
            self.graph.launch(self.stream)
        else:
            with self.stream:
                self.enqueue()

    def result(self) -> tuple[int, int]:
        """(greedy id, NaN count) of the last launched step; waits for it."""
        self.stream.synchronize()
        return int(self.out.view[0]), int(self.out.view[1])

    def profile(self, reps: int = 20) -> dict[str, float]:
        """Microseconds per step of each kind of kernel: a graph of only that kind's launches, replayed. The full
        step comes as 'step'; the kinds' sum exceeds it by the launch gaps the full graph overlaps."""
        full = self.k
        tags = set()
        probe = _Only(full, None, tags)
        self.k = self.L.kernels = probe
        with self.stream:
            self.enqueue()          # eager: records the kinds, and leaves state as a real step would
        out = {"step": self._time_graph(reps)}
        try:
            for tag in sorted(tags):
                self.k = self.L.kernels = _Only(full, tag, set())
                out[tag] = self._time_graph(reps)
        finally:
            self.k = self.L.kernels = full
            self.capture()
        return out

    def _time_graph(self, reps: int) -> float:
        self.capture()
        s = self.stream
        self.graph.launch(s)
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(s)
        for _ in range(reps):
            self.graph.launch(s)
        b.record(s)
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b) * 1000.0 / reps

    def close(self):
        self.graph = None
        self.params.close()
        self.out.close()
