"""The decode step in the memory modes (--mmap-experts, --resident-budget-gib N), where some experts have no address
the GPU can read until they are staged from the file.

When every table entry is readable (VRAM, the pinned arena, or a staging slot the LRU still holds) the step is the
ordinary whole-step CUDA graph. Otherwise it runs the step's program (DecodeStep.program) part by part: a layer's
mixer and router (one small graph per layer, or eager launches), a wait, the layer's k routed ids read back, every
routed expert with entry 0 staged from the file into pinned slots by helper threads and its entry pointed there
(stream-ordered), then the layer's experts (a second small graph). Staged entries stay valid while the LRU holds
them, so repeated experts are not read again and, once the working set is staged, the whole-step graph takes over
again.
"""
from __future__ import annotations

import numpy as np


class PagedDecode:
    """step: DecodeStep (its program(): the parts it runs apart); cache: ExpertCache with a source; new_event(): a
    recorded event on the step's stream (injected, so the loop runs on the CPU against fakes)."""

    def __init__(self, step, cache, source, new_event, use_graphs: bool = True):
        self.step, self.cache, self.source = step, cache, source
        self.new_event = new_event
        self.n_expert = step.cfg.n_expert
        self.use_graphs = use_graphs
        self.parts = None              # the step's program with a graph per part (kind, layer, graph)
        self.decode_file_blobs = 0     # experts read from the file by decode steps (the rest of a miss is RAM)
        self.paged_steps = 0
        self.graph_steps = 0

    # --- capture ---------------------------------------------------------------------------------------------
    def capture(self):
        """One graph per part of the step's program, replayed between the host's per-layer waits (a graph launch
        costs a fraction of the ~10 launches of a layer)."""
        s = self.step.stream

        def grab(fn):
            s.synchronize()
            s.begin_capture()
            try:
                with s:
                    fn()
            finally:
                g = s.end_capture()
            return g

        self.parts = [(kind, li, grab(fn)) for kind, li, fn in self.step.program("greedy")]

    def close(self):
        self.parts = None

    # --- one step --------------------------------------------------------------------------------------------
    def launch(self, token: int, pos: int, pick: str = "greedy", use_graph: bool = True) -> str:
        """Enqueue one step (in place of DecodeStep.launch); returns "graph" or "paged". The caller waits with
        step.pick_at(pos) or step.result()."""
        st = self.step
        if self.cache.reachable():
            st.launch(token, pos, pick, use_graph)
            self.source.note_table_reads(self.new_event())
            self.graph_steps += 1
            return "graph"
        st.set_inputs(token, pos)
        graphs = self.parts if (use_graph and self.use_graphs) else None
        s = st.stream
        with s:
            self._run(graphs, s)
            if pick != "greedy":        # the per-layer parts pick greedily: the sampled pick follows, stream-ordered
                st.enqueue_pick(pick)
        st.note_launch(pos)
        self.paged_steps += 1
        return "paged"

    def _run(self, graphs, s):
        """The step's program part by part (its graphs, or its launches): after a layer's "route" part the routed
        experts that are only in the file are staged, and after its "ffn" part their pins released."""
        st, cache, E = self.step, self.cache, self.n_expert
        staged = ()
        for kind, li, part in graphs or st.program("greedy"):
            if graphs:
                part.launch(s)
            else:
                part()
            if kind == "route":
                routed = li * E + np.asarray(st.ids.get(stream=s), dtype=np.int64)   # waits for the router
                # every routed expert outside VRAM and the arena is pinned in the LRU for this layer, the staged
                # ones too: staging a missing one must not evict one this layer is about to read
                staged = routed[(cache.slot_of[routed] < 0) & self.source.file_only[routed]]
                if len(staged):
                    _, n_read = cache.stage(staged, s)
                    self.decode_file_blobs += n_read
            elif kind == "ffn":
                ev = self.new_event()
                if len(staged):
                    self.source.release(staged, ev)
                self.source.note_table_reads(ev)
