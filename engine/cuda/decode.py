"""One decode step (one token through every layer, the next token picked on the GPU) as a fixed sequence of kernel
launches, captured as CUDA graphs and replayed. Nothing that changes between steps is a kernel argument: the token and
position are read from mapped pinned memory by the first kernel, the experts through the pointer table, so the same
graph serves every step and every cache state (docs/design.md, "Decode").

The step owns one graph per pick mode (PICKS): "greedy" ends in the argmax, "sampled" in the GPU sampler's chain
(engine/cuda/sampler.py). Its plug-ins are called through explicit hooks:
  - the prefetch (engine/cuda/prefetch.py): `enqueue_router(li)` may take the router launch over,
    `enqueue(li)` runs between a layer's router and its experts, `enqueue_finish()` after the last layer,
    `enqueue_join()` at the end;
  - the paged memory modes (engine/cuda/decode_paged.py): `launch` hands the step to them, and they drive it layer by
    layer (the enqueue_* methods) while some expert is only in the file;
  - a tracer (engine/cuda/trace.py) passed to `record`/`enqueue`: `keeps(kind)` filters the launches by kind
    (bench.decode's per-kind profile), `pred_sink` redirects the prefetch's predictions (bench.prefetch_oracle).
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from engine.cuda.kv import DecodeAttention
from engine.cuda.launch import F32, I32, I64, MV_WARPS, NULL, U64, Launcher, MappedInts, ptr, skipped

PICKS = ("greedy", "sampled")


class DecodeStep:
    def __init__(self, kernels, cfg, weights, kv, rope_cs, cache, layout, stream, sampler=None):
        self.kernels = kernels          # the kernel table (engine/cuda/kernels.Kernels)
        self.launcher = Launcher(self.kernel, cfg)
        self.cfg = cfg
        self.weights = weights
        self.kv = kv
        self.rope = rope_cs
        self.cache = cache
        self.layout = layout
        self.stream = stream
        self.sampler = sampler          # GpuSampler: the "sampled" pick (None: greedy only)
        c = cfg
        f32 = lambda n: cp.zeros(n, dtype=cp.float32)
        with stream:
            self.x = f32(c.n_embd)                          # the residual stream
            self.q = f32(c.n_head * c.head_dim)
            self.k_new = f32(c.n_head_kv * c.head_dim)      # this token's K and V rows
            self.v_new = f32(c.n_head_kv * c.head_dim)
            self.att = f32(c.n_head * c.head_dim)
            oss = c.arch == "gpt-oss"       # sinks, windows and rings (kv.py), biases and SWIGLU_OAI (moe_oss.cu)
            self.attn = DecodeAttention(kernels, c, kv,      # its split buffers; K/V layout from kv.dtype
                                        sinks=[L.sinks for L in weights.layers] if oss else None)
            top_k = max(c.n_expert_used, 1)
            self.h = f32(max(c.n_ff, top_k * c.n_ff_exp, 8))
            self.h2 = f32(max(c.n_ff_shexp, 8))
            self.rlogits = f32(max(c.n_expert, 1))
            self.ids = cp.zeros(top_k, dtype=cp.int32)
            self.wts = f32(top_k)
            self.sgate = f32(1)
            self.logits = f32(c.n_vocab)
            self.state = cp.zeros(8, dtype=cp.int32)
            self.counter = cp.zeros(1, dtype=cp.int32)          # router_fused's "last block" counter
        self.params = MappedInts(2)     # token, position: read by the embed kernel and attention
        self.out = MappedInts(2)        # the pick: id, NaN count (or -1: every logit -inf)
        self.graphs: dict = {}          # pick mode -> captured graph
        self.prefetch = None            # plug-ins (set_prefetch, set_paged)
        self.paged = None
        self.tracer = None              # the tracer of the enqueue in progress (record / enqueue)
        self.hybrid = None              # qwen3next / qwen35moe: their attention blocks (engine/cuda/hybrid_layers.py)

    # --- plug-ins --------------------------------------------------------------------------------------------
    def set_prefetch(self, prefetch) -> None:
        self.prefetch = prefetch

    def set_paged(self, paged) -> None:
        self.paged = paged

    def set_hybrid(self, hybrid) -> None:
        self.hybrid = hybrid

    def kernel(self, name: str, qt: int | None = None, kind: str | None = None):
        """The table's kernel, or a no-op when the tracer filters this kind (kind: the profile's name for the launch,
        else the kernel's)."""
        if self.tracer is not None and not self.tracer.keeps(kind or name):
            return skipped
        return self.kernels(name, qt)

    def keeps(self, kind: str) -> bool:
        """Whether launches of this kind run (the plug-ins' own kernels ask here)."""
        return self.tracer is None or self.tracer.keeps(kind)

    # --- the launch sequence ---------------------------------------------------------------------------------
    # The RMSNorms have no launches: each kernel that reads a normed vector stages rmsnorm(x) * w per block (the
    # consumer recomputes sum(x^2); no inter-block sync), measured faster than the producer writing the next norm.
    def enqueue(self, pick: str = "greedy", tracer=None):
        """The whole step's launches on the current stream."""
        self.tracer = tracer
        try:
            prefetch = self.prefetch
            self.enqueue_embed()
            for li in range(len(self.weights.layers)):
                self.enqueue_attention_block(li)
                if not (prefetch and prefetch.enqueue_router(li)):     # the prefetch's router launch also predicts
                    self.enqueue_router(li)
                if prefetch:        # predict later layers' experts and start fetching them; wait for this layer's
                    prefetch.enqueue(li)
                self.enqueue_experts(li)
            if prefetch:
                prefetch.enqueue_finish()
            self.enqueue_output()
            self.enqueue_pick(pick)
            if prefetch:
                prefetch.enqueue_join()
        finally:
            self.tracer = None

    def enqueue_embed(self):
        c, te = self.cfg, self.weights.tok_embd
        self.kernel("embed", te.qt)((1,), (256,), (U64(te.ptr), I64(te.row_bytes), NULL, self.params.dptr,
                                                 ptr(self.state), ptr(self.x), I32(c.n_embd)))

    def enqueue_attention_block(self, li):
        """Attention norm, Q/K/V, RoPE + KV store, attention, and wo added to the residual x."""
        if self.hybrid is not None:
            self.hybrid.enqueue_mixer(li)
            return
        c, mv = self.cfg, self.launcher
        layer = self.weights.layers[li]
        scale = F32(c.attn_scale or 1.0 / np.sqrt(c.head_dim))
        mv.mv3((layer.wq, layer.wk, layer.wv), self.x, (self.q, self.k_new, self.v_new), (layer.bq, layer.bk, layer.bv),
               norm=layer.attn_norm)
        self.attn.step(self.kernel, li, self.q, self.k_new, self.v_new, layer.q_norm, layer.k_norm, self.rope,
                       self.att, self.state, scale)
        mv.mv(layer.wo, self.att, self.x, bias=layer.bo, accumulate=True, tag="wo")

    def router_args(self, li):
        """router_fused's arguments for layer li (router_predict takes them too, then its prediction's): the router
        rows, the FFN-normed input, the routing out, the cache's table, counts and stats."""
        c, cache = self.cfg, self.cache
        layer = self.weights.layers[li]
        R = layer.router
        rows = (U64(R.ptr), I64(R.row_bytes))
        normed_x = (ptr(self.x), ptr(layer.ffn_norm), F32(c.rms_eps), I32(R.cols))
        # gpt-oss weights the top k by a softmax over their logits alone: the renormalized top-k softmax, the same
        renorm = c.expert_weights_norm or getattr(layer, "router_bias", None) is not None
        routing = (ptr(self.rlogits), I32(c.n_expert), I32(c.n_expert_used), I32(1 if renorm else 0),
                   F32(c.expert_weights_scale), ptr(self.ids), ptr(self.wts))
        table = (U64(cache.table.data.ptr + 8 * li * c.n_expert), U64(cache.slot_lo), U64(cache.slot_hi),
                 U64(cache.counts.data.ptr + 4 * li * c.n_expert), ptr(cache.stats))
        return (*rows, *normed_x, *routing, *table)

    def enqueue_router(self, li):
        """For MoE layers the router (on the FFN-normed x, the norm fused): afterwards self.ids / self.wts hold
        layer li's routing. Dense layers: nothing (their FFN kernels apply the norm)."""
        if not self.cfg.is_moe:
            return
        layer = self.weights.layers[li]
        R = layer.router
        if layer.router_bias is not None:       # gpt-oss
            f = self.kernel("router_fused_bias", R.qt, "router")
            f(((R.rows + MV_WARPS - 1) // MV_WARPS,), (32 * MV_WARPS,),
              (*self.router_args(li), ptr(self.counter), ptr(layer.router_bias)),
              shared_mem=self.launcher.smem(f, R.cols, True))
            return
        f = self.kernel("router_fused", R.qt, "router")
        f(((R.rows + MV_WARPS - 1) // MV_WARPS,), (32 * MV_WARPS,), (*self.router_args(li), ptr(self.counter)),
          shared_mem=self.launcher.smem(f, R.cols, True))

    def enqueue_experts(self, li):
        """The routed experts (gate/up then down, weighted, added to x) and the shared expert; or the dense FFN."""
        c, mv = self.cfg, self.launcher
        layer = self.weights.layers[li]
        norm, x = layer.ffn_norm, self.x
        if not c.is_moe:
            mv.swiglu(layer.w_gate, layer.w_up, x, self.h, norm=norm)
            mv.mv(layer.w_down, self.h, x, accumulate=True)
            return
        blob, cache = self.layout.layer(li), self.cache     # this layer's quant types and offsets (a graph node each)
        top_k = c.n_expert_used
        table = U64(cache.table.data.ptr + 8 * li * c.n_expert)
        grid = ((blob.n_ff + MV_WARPS - 1) // MV_WARPS, top_k, 1)
        if layer.exp_bias is not None:
            self.enqueue_experts_oss(li, layer, blob, table, grid)
            return
        if blob.qt_up < 0:
            f = self.kernel("moe_gate_up", blob.qt_gate_up)
            f(grid, (32 * MV_WARPS,),
              (table, ptr(self.ids), I64(blob.up_off), I64(blob.rb_gate_up), ptr(x), ptr(norm), F32(c.rms_eps),
               ptr(self.h), I32(blob.n_ff), I32(c.n_embd), I32(top_k)),
              shared_mem=mv.smem(f, c.n_embd, True))
        else:           # gate and up in different types: one launch each (moe.cu moe_proj)
            for qt, off, rb, mul in ((blob.qt_gate_up, 0, blob.rb_gate_up, 0),
                                     (blob.qt_up, blob.up_off, blob.rb_up, 1)):
                f = self.kernel("moe_proj", qt, "moe_gate_up")
                f(grid, (32 * MV_WARPS,),
                  (table, ptr(self.ids), I64(off), I64(rb), ptr(x), ptr(norm), F32(c.rms_eps), ptr(self.h),
                   I32(blob.n_ff), I32(c.n_embd), I32(top_k), I32(mul)),
                  shared_mem=mv.smem(f, c.n_embd, True))
        shared = layer.sh_up is not None
        if shared:      # the shared expert reads x before moe_down adds to it
            if layer.sh_gate_inp is not None:
                mv.mv(layer.sh_gate_inp, x, self.sgate, tag="shexp", norm=norm)
            mv.swiglu(layer.sh_gate, layer.sh_up, x, self.h2, norm=norm, tag="shexp")
        f = self.kernel("moe_down", blob.qt_down)
        sm = mv.smem(f, top_k * blob.n_ff, False, optional_max=100 * 1024)   # e.g. 8 x 1536 (Qwen3-235B): 50 KiB
        f(((c.n_embd + MV_WARPS - 1) // MV_WARPS, 1), (32 * MV_WARPS,),
          (table, ptr(self.ids), ptr(self.wts), I64(blob.down_off), I64(blob.rb_down), ptr(self.h), ptr(x),
           I32(c.n_embd), I32(blob.n_ff), I32(top_k), I32(1 if sm else 0)),
          shared_mem=sm)
        if shared:
            mv.mv(layer.sh_down, self.h2, x, gate_logit=self.sgate if layer.sh_gate_inp is not None else None,
                  accumulate=True, tag="shexp")

    def enqueue_experts_oss(self, li, layer, blob, table, grid):
        """gpt-oss's routed experts (moe_oss.cu): gate/up with their biases and SWIGLU_OAI, then down with its bias,
        weighted, added to x. Its files have gate and up in one type (weights.py refuses others)."""
        c, mv, x = self.cfg, self.launcher, self.x
        top_k = c.n_expert_used
        bg, bu, bd = layer.exp_bias
        f = self.kernel("moe_gate_up_oai", blob.qt_gate_up, "moe_gate_up")
        f(grid, (32 * MV_WARPS,),
          (table, ptr(self.ids), I64(blob.up_off), I64(blob.rb_gate_up), ptr(x), ptr(layer.ffn_norm), F32(c.rms_eps),
           ptr(self.h), I32(blob.n_ff), I32(c.n_embd), I32(top_k), ptr(bg), ptr(bu)),
          shared_mem=mv.smem(f, c.n_embd, True))
        f = self.kernel("moe_down_bias", blob.qt_down, "moe_down")
        sm = mv.smem(f, top_k * blob.n_ff, False, optional_max=100 * 1024)
        f(((c.n_embd + MV_WARPS - 1) // MV_WARPS, 1), (32 * MV_WARPS,),
          (table, ptr(self.ids), ptr(self.wts), I64(blob.down_off), I64(blob.rb_down), ptr(self.h), ptr(x),
           I32(c.n_embd), I32(blob.n_ff), I32(top_k), I32(1 if sm else 0), ptr(bd)),
          shared_mem=sm)

    def enqueue_output(self):
        """The output mat-vec (of the final-normed x, the norm fused) into self.logits."""
        self.launcher.output_logits(self.weights, self.x, self.logits)

    def enqueue_pick(self, pick: str = "greedy"):
        """The next token from self.logits into self.out: the argmax ("greedy"), or the GPU sampler's penalties /
        top_k / top_p / min_p / temperature and seeded draw ("sampled")."""
        if pick == "sampled":
            self.sampler.enqueue(self.kernel, self.logits, self.out.dptr)
            return
        self.kernel("argmax_word")((264,), (256,), (ptr(self.logits), I32(self.cfg.n_vocab), ptr(self.state)))
        self.kernel("argmax_finish")((1,), (1,), (ptr(self.state), self.out.dptr))

    # --- running ---------------------------------------------------------------------------------------------
    def picks(self) -> tuple[str, ...]:
        return PICKS if self.sampler is not None else PICKS[:1]

    def record(self, pick: str = "greedy", tracer=None):
        """The step's launches captured as a graph (not kept: capture() keeps one per pick mode)."""
        s = self.stream
        s.synchronize()
        s.begin_capture()
        try:
            with s:
                self.enqueue(pick, tracer)
        finally:
            graph = s.end_capture()
        return graph

    def capture(self):
        """One graph per pick mode, replayed by launch()."""
        self.graphs = {}
        self.graphs = {pick: self.record(pick) for pick in self.picks()}

    def launch(self, token: int, pos: int, pick: str = "greedy", use_graph: bool = True):
        """Enqueue one step; result() waits for it. The memory modes take it over while some expert has no address
        the GPU can read (decode_paged.py)."""
        if self.paged is not None:
            self.paged.launch(token, pos, pick, use_graph)
        else:
            self.launch_whole(token, pos, pick, use_graph)

    def set_inputs(self, token: int, pos: int) -> None:
        """The token and position the next launch reads (mapped host memory: no copy, read by the embed kernel and
        attention)."""
        self.params.view[0], self.params.view[1] = token, pos

    def launch_whole(self, token: int, pos: int, pick: str = "greedy", use_graph: bool = True):
        """The whole step: its graph for this pick mode, or the launches one by one."""
        self.set_inputs(token, pos)
        graph = self.graphs.get(pick) if use_graph else None
        if graph is not None:
            graph.launch(self.stream)
        else:
            with self.stream:
                self.enqueue(pick)

    def result(self) -> tuple[int, int]:
        """(picked id, NaN count) of the last launched step; waits for it."""
        self.stream.synchronize()
        return int(self.out.view[0]), int(self.out.view[1])

    def close(self):
        self.graphs = {}
        self.prefetch = self.paged = self.sampler = None
        self.params.close()
        self.out.close()
