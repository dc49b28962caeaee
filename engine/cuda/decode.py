"""One decode step (one token through every layer, the next token picked on the GPU) as a fixed sequence of kernel
launches, captured as CUDA graphs and replayed. Nothing that changes between steps is a kernel argument: the token and
position are read from mapped pinned memory by the first kernel, the experts through the pointer table, so the same
graph serves every step and every cache state (docs/design.md, "Decode").

The step is built with its collaborators (weights, KV cache, expert cache, family, prefetch plan) and changes none
of them afterwards. What each layer launches is the family's decode program (engine/cuda/families/: `layers`); the
step owns the buffers every part shares (the residual x, the routing ids / wts, the logits), the order of the parts
(`program`) and one graph per pick mode (PICKS): "greedy" ends in the argmax, "sampled" in the GPU sampler's chain
(engine/cuda/sampler.py). Around the family's launches:
  - the prefetch (engine/cuda/prefetch.py): `enqueue_router(li)` may take the router launch over,
    `enqueue(li)` runs between a layer's router and its experts, `enqueue_finish()` after the last layer,
    `enqueue_join()` at the end;
  - the paged memory modes (engine/cuda/decode_paged.py) run `program()` part by part while some expert is only in
    the file, and the whole step (`launch`) otherwise;
  - a tracer (engine/cuda/trace.py) passed to `record`/`enqueue`: `keeps(kind)` filters the launches by kind
    (bench.decode's per-kind profile), `pred_sink` redirects the prefetch's predictions (bench.prefetch_oracle).
"""
from __future__ import annotations

from functools import partial

import cupy as cp

from engine.cuda.launch import I32, Launcher, MappedInts, ptr, skipped

PICKS = ("greedy", "sampled")


class DecodeStep:
    def __init__(self, kernels, cfg, weights, kv, rope_cs, cache, layout, stream, family, recurrent=None,
                 sampler=None, prefetch=None):
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
        self.family = family            # engine/cuda/families/: what its layers launch
        self.recurrent = recurrent      # the family's recurrent state (the hybrids' GdnState), or None
        c = cfg
        f32 = lambda n: cp.zeros(n, dtype=cp.float32)      # noqa: E731
        with stream:
            # shared by the family's layers and the plug-ins (the prefetch reads x and ids, the paged modes ids)
            self.x = f32(c.n_embd)                          # the residual stream
            self.rlogits = f32(max(c.n_expert, 1))
            self.ids = cp.zeros(max(c.n_expert_used, 1), dtype=cp.int32)
            self.wts = f32(max(c.n_expert_used, 1))
            self.logits = f32(c.n_vocab)
            self.state = cp.zeros(8, dtype=cp.int32)
            self.counter = cp.zeros(1, dtype=cp.int32)          # router_fused's "last block" counter
        self.params = MappedInts(2)     # token, position: read by the embed kernel and attention
        self.out = MappedInts(2)        # the pick: id, NaN count (or -1: every logit -inf)
        self.graphs: dict = {}          # pick mode -> captured graph
        self.tracer = None              # the tracer of the enqueue in progress (record / enqueue)
        self.layers = family.decode_layers(self, recurrent)    # its buffers, its kernels compiled now
        # prefetch: prefetch.PrefetchPlan (None: no prefetch); its Prefetcher reads the buffers above
        self.prefetch = prefetch.build(self) if prefetch is not None else None

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
    def program(self, pick: str = "greedy", prefetch=None) -> list:
        """The step as its parts in launch order, (kind, layer, enqueue): ("head", -1) the embedding; per layer
        ("route", li), the family's mixer and router, after which the step's ids hold layer li's routing, and
        ("ffn", li), the family's experts or dense FFN; ("tail", -1) the output head and the pick. prefetch: its
        hooks, which may launch a layer's router and run before its ffn (the whole step's graphs); None: the
        family's launches alone (the paged memory modes' per-layer graphs)."""
        L = self.layers
        parts = [("head", -1, L.embed)]
        for li in range(len(self.weights.layers)):
            parts.append(("route", li, partial(self._route, li, prefetch)))
            parts.append(("ffn", li, partial(self._ffn, li, prefetch)))
        parts.append(("tail", -1, partial(self._tail, pick, prefetch)))
        return parts

    def _route(self, li: int, prefetch) -> None:
        self.layers.mixer(li)
        if not (prefetch and prefetch.enqueue_router(li)):     # the prefetch's router launch also predicts
            self.layers.router(li)

    def _ffn(self, li: int, prefetch) -> None:
        if prefetch:        # predict later layers' experts and start fetching them; wait for this layer's
            prefetch.enqueue(li)
        self.layers.ffn(li)

    def _tail(self, pick: str, prefetch) -> None:
        if prefetch:
            prefetch.enqueue_finish()
        self.layers.output()
        self.enqueue_pick(pick)
        if prefetch:
            prefetch.enqueue_join()

    def enqueue(self, pick: str = "greedy", tracer=None):
        """The whole step's launches on the current stream."""
        self.tracer = tracer
        try:
            for _, _, part in self.program(pick, self.prefetch):
                part()
        finally:
            self.tracer = None

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

    def set_inputs(self, token: int, pos: int) -> None:
        """The token and position the next launch reads (mapped host memory: no copy, read by the embed kernel and
        attention)."""
        self.params.view[0], self.params.view[1] = token, pos
        self.layers.set_inputs(token, pos)      # the family's host-side inputs of the step (qwen4exp: its PLE rows)

    def launch(self, token: int, pos: int, pick: str = "greedy", use_graph: bool = True):
        """Enqueue the whole step, its graph for this pick mode or the launches one by one; result() waits for it.
        (The memory modes' PagedDecode.launch runs it part by part while some expert has no address the GPU can
        read.)"""
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
        self.prefetch = self.sampler = None
        self.params.close()
        self.out.close()
