"""One decode step (one token through every layer, the next token picked on the GPU) as a fixed sequence of kernel
launches, captured as CUDA graphs and replayed. Nothing that changes between steps is a kernel argument: the token and
position are read from device memory (`params`) by the first kernel, the experts through the pointer table, so the
same graph serves every step and every cache state (docs/design.md, "Decode").

The step's last launch (step_advance) publishes the pick in a ring of mapped pinned slots, one per position mod RING,
and writes it with the next position into `params`: the next step may be launched before the host has read this
one's pick (launch_next; the backend's pipeline), and the host reads a step's pick after that step's own event
(pick_at), never waiting for the steps queued behind it. The host gives a step's inputs itself (launch, set_inputs)
as a stream-ordered copy, so it never writes what a queued step is about to read.

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
RING = 4            # pick slots (and step events): a step's pick stays readable while the one launched after it runs


class StepInputs:
    """The token and position the next step reads (int32[2] in VRAM, `dptr` for the embed kernel): written by the
    previous step's step_advance, or by the host through `view` and push(): a copy from pinned memory ordered on the
    stream. Before `view` is written again the previous copy must have run (wait(), normally long done: every step
    launched with host inputs has its pick read before the next is)."""

    def __init__(self, stream):
        with stream:
            self.dev = cp.zeros(2, dtype=cp.int32)
        self.dptr = ptr(self.dev)
        self.host = MappedInts(2)
        self.view = self.host.view
        self.copied = cp.cuda.Event(disable_timing=True)
        self.copied.record(stream)

    def wait(self) -> None:
        self.copied.synchronize()

    def push(self, stream) -> None:
        cp.cuda.runtime.memcpyAsync(int(self.dptr), self.host.hptr, 8, cp.cuda.runtime.memcpyHostToDevice,
                                    stream.ptr)
        self.copied.record(stream)

    def close(self):
        self.host.close()
        self.dev = None


class DecodeStep:
    layer_range: range | None = None

    def __init__(self, kernels, cfg, weights, kv, rope_cs, cache, layout, stream, family, recurrent=None,
                 sampler=None, prefetch=None, layer_range: range | None = None):
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
        self.layer_range = layer_range  # a pipeline stage's layers (engine/cuda/staged_decode.py); None: all
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
            self.pick = cp.zeros(2, dtype=cp.int32)            # the step's pick: id, NaN count (or -1: all -inf)
        self.params = StepInputs(stream)    # token, position: read by the embed kernel (then from state)
        self.pick_ring = MappedInts(2 * RING)   # the picks by position mod RING (step_advance), read by pick_at
        self.events = [cp.cuda.Event(disable_timing=True) for _ in range(RING)]    # recorded after each step
        self.last_pos = -1                  # the position of the step launched last
        self.out = MappedInts(2)        # the last pick made: the last step's (step_advance), or a sampler chain's
                                        # on other logits (the masked pick's) written there: result() reads it
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
    @property
    def layers_run(self) -> range:
        """The layers this step runs: a stage's range, else every layer."""
        return range(len(self.weights.layers)) if self.layer_range is None else self.layer_range

    @property
    def embeds(self) -> bool:
        """The step starts at layer 0, so it embeds the token (a later stage gets x from the one before)."""
        return self.layers_run.start == 0

    @property
    def heads(self) -> bool:
        """The step ends at the last layer, so it runs the output head and the pick."""
        return self.layers_run.stop == len(self.weights.layers)

    def program(self, pick: str = "greedy", prefetch=None) -> list:
        """The step as its parts in launch order, (kind, layer, enqueue): ("head", -1) the embedding; per layer
        ("route", li), the family's mixer and router, after which the step's ids hold layer li's routing, and
        ("ffn", li), the family's experts or dense FFN; ("tail", -1) the output head and the pick. prefetch: its
        hooks, which may launch a layer's router and run before its ffn (the whole step's graphs); None: the
        family's launches alone (the paged memory modes' per-layer graphs)."""
        L = self.layers
        parts = [("head", -1, L.embed)] if self.embeds else []
        for li in self.layers_run:
            parts.append(("route", li, partial(self._route, li, prefetch)))
            parts.append(("ffn", li, partial(self._ffn, li, prefetch)))
        if self.heads:
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
        """The next token from self.logits into self.pick: the argmax ("greedy"), or the GPU sampler's penalties /
        top_k / top_p / min_p / temperature and seeded draw ("sampled"); then step_advance publishes it (the ring
        slot of this step's position) and makes it the next step's input."""
        if pick == "sampled":
            self.sampler.enqueue(self.kernel, self.logits, ptr(self.pick))
        else:
            self.kernel("argmax_word")((264,), (256,), (ptr(self.logits), I32(self.cfg.n_vocab), ptr(self.state)))
            self.kernel("argmax_finish")((1,), (1,), (ptr(self.state), ptr(self.pick)))
        self.kernel("step_advance")((1,), (1,), (ptr(self.state), ptr(self.pick), self.params.dptr,
                                                 self.pick_ring.dptr, self.out.dptr, I32(RING), I32(self.cfg.n_vocab)))

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
        """The token and position the next launch reads, copied in stream order (StepInputs.push); then the family's
        host-side inputs of the step (qwen4exp: its PLE rows; a family with those does not run ahead)."""
        self.params.wait()
        v = self.params.view
        v[0], v[1] = token, pos
        self.params.push(self.stream)
        self.last_pos = pos
        self.layers.set_inputs(token, pos)

    def launch(self, token: int, pos: int, pick: str = "greedy", use_graph: bool = True):
        """Enqueue the whole step, its graph for this pick mode or the launches one by one; pick_at(pos) or
        result() waits for it. (The memory modes' PagedDecode.launch runs it part by part while some expert has no
        address the GPU can read.)"""
        self.set_inputs(token, pos)
        self._run(pick, use_graph, pos)

    def launch_next(self, pos: int, pick: str = "greedy", use_graph: bool = True):
        """Enqueue the step after the last one launched, fed on the device by that step's pick (step_advance wrote
        it and pos into params): nothing waits for the host. pos: that position, for pick_at."""
        if pos != self.last_pos + 1:
            raise ValueError(f"the step after position {self.last_pos} is at {self.last_pos + 1}, not {pos}")
        self._run(pick, use_graph, pos)

    def _run(self, pick: str, use_graph: bool, pos: int):
        graph = self.graphs.get(pick) if use_graph else None
        if graph is not None:
            graph.launch(self.stream)
        else:
            with self.stream:
                self.enqueue(pick)
        self.note_launch(pos)

    def note_launch(self, pos: int) -> None:
        """The step at pos is enqueued (its last launch, step_advance, included): its event follows it."""
        self.events[pos % RING].record(self.stream)
        self.last_pos = pos

    def pick_at(self, pos: int) -> tuple[int, int]:
        """(picked id, NaN count) of the step at pos, one of the last RING launched; waits for that step only."""
        self.events[pos % RING].synchronize()
        v, i = self.pick_ring.view, 2 * (pos % RING)
        return int(v[i]), int(v[i + 1])

    def result(self) -> tuple[int, int]:
        """(picked id, NaN count) of the last pick enqueued (the last launched step's, or a sampler chain's into
        `out` after it); waits for everything enqueued."""
        self.stream.synchronize()
        return int(self.out.view[0]), int(self.out.view[1])

    def close(self):
        self.graphs = {}
        self.prefetch = self.sampler = None
        self.params.close()
        self.pick_ring.close()
        self.out.close()
