"""The decode step cut into pipeline stages of consecutive layers (issue 32): one DecodeStep a stage over its layer
range (engine/cuda/decode.py `layer_range`), each on its own stream with its own buffers (x, routing, state) and its
own graph; the first embeds, the last runs the output head and the pick. Between stages the residual x and the step
state (the position the family's embed wrote, read by every layer's attention) are copied after the sender's event
(engine/cuda/stages.py copy_after), so each stage starts from exactly what the one step would hold at that layer.

What this is for now: the one-GPU test mode. Every stage runs on the backend's device over the backend's weights, KV
cache, expert cache and recurrent state, so the stage range, the hand-off and the event chain are held to the unsplit
step (tests/test_cuda_stages.py). Per-stage weights / KV / expert caches on their own devices, the prompt pass by
stage and the decode pipeline (engine/cuda/pipeline.py: off for stages) are not built; a stage list naming another
device is refused.
"""
from __future__ import annotations

import cupy as cp

from engine.cuda.decode import DecodeStep
from engine.cuda.stages import StageError, StageSpec, copy_after


class StagedDecode:
    def __init__(self, backend, specs: list[StageSpec]):
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
        self.specs = specs
        self.steps: list[DecodeStep] = []
        self.events = []
        for s in specs:
            # the last stage runs the pick on the backend's stream (its sampler's); the others on their own
            stream = b.stream if s.heads else cp.cuda.Stream(non_blocking=True)
            self.steps.append(DecodeStep(b.kernels, b.config, b.weights, b.kv, b.rope, b.cache, b.layout, stream,
                                         b.family, b.recurrent_state, b.gpu_sampler if s.heads else None, None,
                                         layer_range=s.layers))
            self.events.append(cp.cuda.Event(disable_timing=True))

    @property
    def last(self) -> DecodeStep:
        return self.steps[-1]

    def capture(self) -> None:
        for st in self.steps:
            st.capture()

    def launch(self, token: int, pos: int, pick: str = "greedy", use_graph: bool = True) -> None:
        """Enqueue the step at pos fed `token`, stage by stage: stage s + 1's stream waits for stage s's event, copies
        its x and state, then runs its layers (its graph, or the launches one by one)."""
        dev = cp.cuda.Device().id
        for i, st in enumerate(self.steps):
            if i:
                prev = self.steps[i - 1]
                copy_after(st.x, dev, st.stream, prev.x, dev, prev.stream, self.events[i - 1])
                copy_after(st.state, dev, st.stream, prev.state, dev, prev.stream, self.events[i - 1])
            st.launch(token, pos, pick if st.heads else "greedy", use_graph)

    def pick_at(self, pos: int) -> tuple[int, int]:
        return self.last.pick_at(pos)

    @property
    def logits(self):
        return self.last.logits

    def close(self) -> None:
        for st in self.steps:
            st.stream.synchronize()
            st.close()
        self.steps = []
