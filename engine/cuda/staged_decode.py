"""The decode step cut into pipeline stages of consecutive layers (issue 32): one DecodeStep a stage over its layer
range (engine/cuda/decode.py `layer_range`), each on its own stream with its own buffers (x, routing, state), its own
expert cache (engine/cuda/staged_backend.py gives each stage one; by default all share the backend's) and its own
graph; the first embeds, the last runs the output head and the pick. Between stages the residual x and the step
state (the position the family's embed wrote, read by every layer's attention) are copied after the sender's event
(engine/cuda/stages.py copy_after: the one-vector case of stages.Handoff, straight into the receiver's x, which its
graph was captured on), so each stage starts from exactly what the one step would hold at that layer.

What runs now: stages on the backend's GPU (the test mode of --gpus 0,0). They share that device's weights, KV cache
and recurrent state (each stage reads and writes only its layers' parts of them); a stage list naming another
device is refused, as are per-stage weights / KV on their own devices and the decode pipeline's run-ahead
(engine/cuda/pipeline.py), which are not built.
"""
from __future__ import annotations

import cupy as cp

from engine.cuda.decode import DecodeStep
from engine.cuda.stages import StageError, StageSpec, copy_after


class StagedDecode:
    """caches: one expert cache a stage (None: the backend's for all); streams: one a stage, the last the backend's
    own (its sampler's; None: new streams for the others)."""
    prefetch = None         # no stage prefetches (a stage's prefetch would predict only within its own layers)

    def __init__(self, backend, specs: list[StageSpec], caches=None, streams=None):
        here = cp.cuda.Device().id
        other = [s for s in specs if s.device != here]
        if other:
            raise StageError(f"stage {other[0].index} is on GPU {other[0].device}: the staged decode runs its stages "
                             f"on the backend's GPU ({here}) only for now (issue 32)")
        if not specs or specs[-1].end != len(backend.weights.layers) or specs[0].first != 0:
            raise StageError("the stages must cover the model's layers from the first to the last")
        if len(specs) > 1 and not backend.family.stage_split:
            raise StageError(f"the {backend.family.name} family's decode layers carry more than x from one layer to "
                             f"the next (engine/cuda/families/{backend.family.name}.py stage_split): no stages yet")
        b = self.backend = backend
        caches = [b.cache] * len(specs) if caches is None else list(caches)
        if streams is None:
            streams = [b.stream if s.heads else cp.cuda.Stream(non_blocking=True) for s in specs]
        if len(caches) != len(specs) or len(streams) != len(specs) or streams[-1] is not b.stream:
            raise StageError(f"{len(caches)} caches and {len(streams)} streams for {len(specs)} stages (the last "
                             f"stage's stream is the backend's)")
        self.specs = specs
        self.steps: list[DecodeStep] = []
        self.events = []
        self.begun = cp.cuda.Event(disable_timing=True)
        for s, cache, stream in zip(specs, caches, streams):
            # the last stage runs the pick on the backend's stream (its sampler's); the others on their own
            self.steps.append(DecodeStep(b.kernels, b.config, b.weights, b.kv, b.rope, cache, b.layout, stream,
                                         b.family, b.recurrent_state, b.gpu_sampler if s.heads else None, None,
                                         layer_range=s.layers))
            self.events.append(cp.cuda.Event(disable_timing=True))

    @property
    def last(self) -> DecodeStep:
        return self.steps[-1]

    # what the backend reads of "the step": the last stage's pick, logits, pick slot and layer program
    @property
    def out(self):
        return self.last.out

    @property
    def layers(self):
        return self.last.layers

    @property
    def logits(self):
        return self.last.logits

    def result(self) -> tuple[int, int]:
        return self.last.result()

    def pick_at(self, pos: int) -> tuple[int, int]:
        return self.last.pick_at(pos)

    def capture(self) -> None:
        for st in self.steps:
            st.capture()

    def begin(self) -> None:
        """Every stage's stream waits for what the backend enqueued on its own stream (the last stage's) so far: a
        recurrent state zeroed there, the sampler's inputs, the last step or prompt pass's final stage."""
        begin_after(self.begun, self.last.stream, [st.stream for st in self.steps[:-1]])

    def launch(self, token: int, pos: int, pick: str = "greedy", use_graph: bool = True) -> None:
        """Enqueue the step at pos fed `token`, stage by stage, after the backend's stream (begin): stage s + 1's
        stream waits for stage s's event, copies its x and state, then runs its layers (its graph, or the launches
        one by one)."""
        dev = cp.cuda.Device().id
        self.begin()
        for i, st in enumerate(self.steps):
            if i:
                prev = self.steps[i - 1]
                copy_after(st.x, dev, st.stream, prev.x, dev, prev.stream, self.events[i - 1])
                copy_after(st.state, dev, st.stream, prev.state, dev, prev.stream, self.events[i - 1])
            st.launch(token, pos, pick if st.heads else "greedy", use_graph)

    def launch_next(self, pos: int, pick: str = "greedy", use_graph: bool = True):
        raise RuntimeError("a staged decode does not run ahead (its backend keeps the decode pipeline off)")

    def close(self) -> None:
        for st in self.steps:
            st.stream.synchronize()
            st.close()
        self.steps = []


def begin_after(event, stream, others) -> None:
    """Each of `others` (streams) runs its later work after everything enqueued on `stream` so far."""
    event.record(stream)
    for s in others:
        if s is not stream:
            s.wait_event(event)
