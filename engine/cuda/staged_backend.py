"""The CUDA backend run as a layer split's stages (issue 32; the worker's --gpus 0,0 --layer-split N,M): each stage
owns its consecutive layers' decode step (engine/cuda/staged_decode.py), its own expert cache sized from its share of
the device's VRAM and filled from its share of the expert profile (stages.device_shares, stages.profile_shares), and
its own prompt pass (Prefill over its layers, with its own buffers and expert ring). The hidden state goes from stage
to stage after the sender's event: in decode as one vector into the next stage's x (stages.copy_after), in the prompt
pass as each chunk's rows through two alternating receive buffers (stages.Handoff).

What runs: every stage on one GPU (the test mode; a stage list naming two devices is refused before any VRAM is
taken). On one GPU the stages share the device's weights, KV cache and recurrent state, allocated once as the
unsplit backend allocates them (each stage reads and writes only its layers' parts): per-stage copies on one device
would only cost VRAM, and per-card weights / KV need the separate devices this mode does not have. What is each
stage's own here is what a card would own: its expert cache and slots (sized by its layers' share), its profile
share, its adaptive tier's counts, its prompt buffers and ring, its stream, its decode graph.

The prompt pass enqueues chunk by chunk, stage by stage, each stage on its own stream, and a stage waits only for
the rows handed to it (and, before it overwrites its own rows, for their copy to have landed): on two devices stage
s would run chunk c + 1 while stage s + 1 runs chunk c. On one GPU the streams share its SMs.

Off for stages, with a log line: the decode prefetch (a stage's would predict only its own layers), the decode
pipeline's run-ahead (one step's stages are chained; a step run ahead would need its undo per stage), verify
windows (one step a token), the memory modes (refused)."""
from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import cupy as cp
import numpy as np

from engine.cuda.args import CudaOptions
from engine.cuda.backend import CUDABackend
from engine.cuda.expert_cache import ExpertCache, learned_order
from engine.cuda.expert_layout import SlotPools
from engine.cuda.families.registry import family_for
from engine.cuda.prefill import Prefill, vram_left
from engine.cuda.staged_decode import StagedDecode, begin_after
from engine.cuda.stages import Handoff, StageError, device_shares, profile_shares, stage_specs
from engine.profile import from_flat, load_profile
from engine.profile import save_profile as write_profile

MiB = 1 << 20


def stages_of(opts: CudaOptions, n_layer: int):
    """The stage list of opts.gpus (device indices, one a stage) and opts.layer_split (counts; the worker resolves
    auto to its plan's first, engine/cuda/gpus.py)."""
    gpus, split = opts.gpus, opts.layer_split
    if not isinstance(gpus, tuple) or len(gpus) < 2:
        raise StageError(f"a staged backend needs two or more stages in --gpus (got {gpus!r})")
    if not isinstance(split, tuple):
        raise StageError(f"--layer-split {split or 'auto'}: the staged backend takes the split's layer counts "
                         f"(the worker plans auto into counts before it starts)")
    return stage_specs(list(gpus), list(split), n_layer)


class StageCaches:
    """The stages' expert caches seen as the backend's one cache (polls, adaptive rounds, statistics, the profile):
    each cache acts on its own stage's stream, the stream its kernels read its table on, whatever stream the caller
    names (a table write must be ordered against its own readers)."""

    def __init__(self, caches: list[ExpertCache], streams):
        self.caches, self.streams = caches, streams
        c0 = caches[0]
        self.arena = c0.arena
        self.n_layer, self.n_expert, self.n_total, self.stride = c0.n_layer, c0.n_expert, c0.n_total, c0.stride

    def _each(self):
        return zip(self.caches, self.streams)

    @property
    def n_slots(self) -> int:
        return sum(c.n_slots for c in self.caches)

    def poll(self, stream, wait: bool = False) -> bool:
        return any([c.poll(s, wait) for c, s in self._each()])

    @property
    def counts_taken(self) -> bool:
        return any(c.counts_taken for c in self.caches)

    def counts_landed(self) -> bool:
        return self.counts_taken and all(c.counts_landed() for c in self.caches if c.counts_taken)

    def adapt_start(self, stream) -> None:
        for c, s in self._each():
            c.adapt_start(s)

    def adapt_finish(self, stream) -> int:
        return sum(c.adapt_finish(s) for c, s in self._each() if c.counts_taken)

    def adapt(self, stream) -> int:
        return sum(c.adapt(s) for c, s in self._each())

    def take_counts(self, stream) -> np.ndarray:
        return sum(c.take_counts(s) for c, s in self._each())     # each counts only its own layers' routing

    def read_stats(self, stream) -> tuple[int, int]:
        got = [c.read_stats(s) for c, s in self._each()]
        return sum(h for h, _ in got), sum(n for _, n in got)

    def reset_stats(self, stream) -> None:
        for c, s in self._each():
            c.reset_stats(s)

    def resident(self) -> np.ndarray:
        out = np.zeros(self.n_total, dtype=bool)
        for c in self.caches:
            out |= c.resident() & c.serves
        return out

    @property
    def heat(self) -> np.ndarray:
        return sum(np.where(c.serves, c.heat, 0.0) for c in self.caches)

    def fold_counts(self) -> None:
        """The counts since the last round into each cache's heat, undecayed (before a profile is saved)."""
        for c, s in self._each():
            c.heat += c.take_counts(s)

    def learned_order(self) -> np.ndarray:
        slot_of = np.where(self.resident(), 0, -1)
        return learned_order(slot_of, self.heat, self.caches[0].prior)

    def heat_u8(self) -> np.ndarray:
        h = self.heat
        top = h.max() if len(h) and h.max() > 0 else 1.0
        return np.clip(np.round(255.0 * h / top), 0, 255).astype(np.uint8)


class StagedPrefill:
    """The prompt pass as one Prefill a stage, chained by stages.Handoff: Prefill's interface (forward, chunk,
    lent, give_back, plan) over all of them. Each stage's buffers and ring are planned within its share of the VRAM
    left when it is built (what is left, divided among the stages still to build), all with the first's chunk."""

    def __init__(self, staged: StagedDecode, opts, log, tracer):
        dev = cp.cuda.Device().id
        if any(s.device != dev for s in staged.specs):
            raise StageError("the staged prompt pass runs its stages on the backend's GPU only for now")
        self.stages: list[Prefill] = []
        n = len(staged.steps)
        for i, step in enumerate(staged.steps):
            o = opts if i == 0 else replace(opts, prefill_chunk=self.stages[0].chunk)
            with step.stream:
                self.stages.append(Prefill(step, o, log, tracer, free=vram_left(opts) // (n - i)))
        self.chunk = min(p.chunk for p in self.stages)
        cfg = staged.steps[0].cfg
        self.begun = cp.cuda.Event(disable_timing=True)
        self.handoffs = [Handoff(a.device, b.device, sa.stream, sb.stream, (self.chunk, cfg.n_embd), cp.float32)
                         for a, b, sa, sb in zip(staged.specs, staged.specs[1:], staged.steps, staged.steps[1:])]

    @property
    def lent(self) -> list:
        return [s for p in self.stages for s in p.lent]

    def give_back(self, stream) -> int:
        """Each stage's lent slots back to its cache, after its own stream's work (its ring's last readers)."""
        return sum(p.give_back(p.step.stream) for p in self.stages)

    @property
    def plan(self):
        """The ring's own and lent slots, summed over the stages (the backend's INFO)."""
        return SimpleNamespace(ring=sum(p.plan.ring for p in self.stages), lend=sum(p.plan.lend for p in self.stages))

    def begin(self, stream) -> None:
        """At a prompt's first chunk: every stage runs after what is enqueued on `stream` (the backend's) so far.
        Not per chunk: stage 0's chunk c + 1 would then wait for the last stage's chunk c."""
        begin_after(self.begun, stream, [p.step.stream for p in self.stages])

    def forward(self, tokens, pos0: int, all_logits: bool, ahead=None) -> cp.ndarray:
        """The chunk through every stage in order, each on its own stream: stage s + 1 starts after its rows have
        landed; stage s first waits until its previous chunk's rows were copied out (wait_landed) before writing
        this chunk's. Returns the last stage's logits (on its stream, the backend's). ahead: the next chunk's tokens
        when known, for each stage's family to gather its host inputs meanwhile (Prefill.forward)."""
        x, out = None, None
        last = len(self.stages) - 1
        for i, p in enumerate(self.stages):
            with p.step.stream:
                if i < last:
                    self.handoffs[i].wait_landed()
                out = p.forward(tokens, pos0, all_logits, ahead=ahead, x_in=x)
                if i < last:
                    x = self.handoffs[i].send(out, len(tokens))
        return out


class StagedBackend(CUDABackend):
    """CUDABackend over opts.gpus / opts.layer_split's stages (stages_of), every stage on the current GPU."""
    name = "cuda"

    def __init__(self, model, max_context: int, opts: CudaOptions | None = None, log=None, phase=None,
                 tracer=None):
        opts = opts or CudaOptions()
        self.specs = stages_of(opts, model.config.n_layer)
        here = cp.cuda.Device().id
        if any(s.device != here for s in self.specs):
            raise StageError(f"--gpus {','.join(str(s.device) for s in self.specs)}: stages on separate GPUs are not "
                             f"built yet (issue 32); only stages sharing one GPU run (e.g. --gpus {here},{here})")
        fam = family_for(model.config)
        if not fam.stage_split:
            raise StageError(f"the {fam.name} family ({model.config.arch}) cannot run as stages: its layers carry "
                             f"more than the hidden state from one to the next (engine/cuda/families/{fam.name}.py "
                             f"stage_split); run it on one GPU (drop --gpus and --layer-split)")
        if opts.mmap_experts or opts.resident_budget_gib is not None:
            raise StageError("the memory modes (--mmap-experts, --resident-budget-gib) do not run as stages yet: drop "
                             "them or --gpus")
        if opts.prefetch:
            raise StageError("--tune prefetch=on: the staged decode has no prefetch yet; drop it")
        # no prefetch (its staging slots are planned for one cache) and no run-ahead: see the module's docstring
        opts = replace(opts, prefetch=False, pipeline=False)
        self._stage_streams = None
        self.stage_caches = None
        kw = {} if log is None else {"log": log}
        super().__init__(model, max_context, opts, phase=phase, tracer=tracer, **kw)
        self.log(f"{len(self.specs)} stages on GPU {here}: layers "
                 + ", ".join(f"{s.first}-{s.end - 1}" for s in self.specs)
                 + " (the test mode: one device's weights and KV cache shared, an expert cache and a prompt pass "
                   "a stage)")

    # --- set-up ----------------------------------------------------------------------------------------------
    def _streams(self):
        """One stream a stage, the last the backend's own (the sampler's and the host's reads)."""
        if self._stage_streams is None:
            self._stage_streams = [self.stream if s.heads else cp.cuda.Stream(non_blocking=True) for s in self.specs]
        return self._stage_streams

    def _prefill_scratch_bytes(self) -> int:
        return len(self.specs) * super()._prefill_scratch_bytes()      # each stage's own prompt buffers

    def _make_cache(self, n_slots: int):
        """One cache a stage: the bytes n_slots take, shared among the stages in proportion to their layers'
        expert bytes (stages.device_shares), each share as slots of its own experts' pools."""
        cfg, specs = self.config, self.specs
        es = np.asarray(self.arena.expert_stride, dtype=np.int64)
        total = SlotPools(es).bytes_of(n_slots)
        layer_bytes = [int(b) for b in es.reshape(cfg.n_layer, cfg.n_expert).sum(axis=1)]
        shares = device_shares(specs, layer_bytes, {s.device: total for s in specs})
        caches = []
        for s, share, stream in zip(specs, shares, self._streams()):
            serves = np.zeros(cfg.n_layer * cfg.n_expert, dtype=bool)
            serves[s.first * cfg.n_expert:s.end * cfg.n_expert] = True
            n = SlotPools(es[serves]).slots_for_bytes(share)
            with stream:
                caches.append(ExpertCache(self.arena, n, serves=serves))
            self.log(f"stage {s.index} (layers {s.first}-{s.end - 1}): expert cache {caches[-1].n_slots} of "
                     f"{caches[-1].n_served} experts ({caches[-1].nbytes / MiB:.0f} MiB of a {share / MiB:.0f} MiB "
                     f"share)")
        self.stage_caches = caches
        return StageCaches(caches, self._streams())

    def _build_step(self):
        caches = self.stage_caches if self.stage_caches is not None else [None] * len(self.specs)
        self.step = StagedDecode(self, self.specs, caches=caches, streams=self._streams())
        self.prefill = StagedPrefill(self.step, self.opts, self.log, self.tracer)
        self.decoder = self.step

    def _plan_pipeline(self, state_copy):
        self.pipelined = False
        self.log("decode pipeline off: the staged decode chains each step's stages and runs none ahead")

    def _initial_fill(self):
        """Each stage's cache from its share of the profile (stages.profile_shares), or with all its layers' experts
        when they fit; else empty (the adaptive tier fills it), as the unsplit cache."""
        opts, cfg = self.opts, self.config
        prof = load_profile(opts.expert_profile, cfg.n_layer, cfg.n_expert) if opts.expert_profile else None
        shares = profile_shares(prof, self.specs) if prof is not None else [None] * len(self.specs)
        gib = sum(c.nbytes for c in self.stage_caches) / 2**30
        self.phase("cache", done=0.0, gib=gib)
        for s, c, stream, share in zip(self.specs, self.stage_caches, self._streams(), shares):
            t0 = time.perf_counter()
            if share is not None:
                c.load_prior(prof.ranks())
                order, src = share.flat_order(), f"its share of profile {opts.expert_profile}"
            elif c.n_slots >= c.n_served:
                order, src = np.flatnonzero(c.serves), "all its experts"
            else:
                continue
            if c.n_slots:
                n = c.fill(order, stream)
                self.log(f"stage {s.index}: expert cache filled from {src}: {n} experts in "
                         f"{time.perf_counter() - t0:.1f} s")
        self.phase("cache", done=1.0, gib=gib)

    # --- the contract ----------------------------------------------------------------------------------------
    def _prefill(self, tokens, all_logits: bool):
        self.prefill.begin(self.stream)         # a recurrent state zeroed on the backend's stream, the last step
        return super()._prefill(tokens, all_logits)

    def window_step(self):
        if self.window is None:
            self.log("verify windows run one step a token: the staged decode has no window step")
            self.window = False
        return None

    def save_profile(self, path=None):
        self._settle()
        path = path or self.opts.expert_profile_save
        if self.cache is None or not path:
            return
        self.cache.fold_counts()
        write_profile(path, from_flat(self.cache.n_layer, self.cache.n_expert, self.cache.learned_order()))
        self._last_save = time.monotonic()

    def close(self) -> None:
        try:
            super().close()
        finally:        # a closed backend holds no device memory (CUDABackend.close)
            self.stage_caches = self._stage_streams = None

    def info(self) -> dict:
        out = super().info()
        out["stages"] = ",".join(f"{s.first}-{s.end - 1}" for s in self.specs)
        out["stage_gpus"] = ",".join(str(s.device) for s in self.specs)
        if self.stage_caches is not None:
            out["stage_expert_slots"] = ",".join(str(c.n_slots) for c in self.stage_caches)
        return out
