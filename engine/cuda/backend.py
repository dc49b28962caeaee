"""The CUDA backend (engine/backend.py's contract): weights and KV cache in VRAM, experts in a pinned host arena with
the hottest cached in VRAM, decode steps replayed from one CUDA graph with the pick on the GPU, the prompt pass as
tensor-core GEMMs in chunks (engine/cuda/prefill.py). Decode steps are pipelined (engine/cuda/pipeline.py): the next
step, fed on the GPU by this one's pick, is launched before the host reads the pick."""
from __future__ import annotations

import sys
import time
from dataclasses import replace

import cupy as cp
import numpy as np

from engine.backend import Backend, ExpertStats, RecurrentSnapshot, decode_tokens
from engine.cuda.arena import ExpertArena, blob_layout
from engine.cuda.args import CudaOptions
from engine.cuda.decode import DecodeStep
from engine.cuda.decode_window import WindowStep, why_not, window_cost
from engine.cuda.decode_window import build as build_window
from engine.cuda.embed_place import embed_placement
from engine.cuda.expert_cache import ExpertCache, SlotPools
from engine.cuda.families.registry import family_for
from engine.cuda.memory_mode import MemoryMode
from engine.cuda.prefetch import plan as prefetch_plan
from engine.cuda.prefetch import vram_staging_slots
from engine.cuda.prefetch import wanted as prefetch_wanted
from engine.cuda.prefill import Prefill, reserve_bytes, target_chunk
from engine.cuda.kernels import ENGINE_FILES, Kernels
from engine.cuda.logits_mask import masked_copy, top_logprobs
from engine.cuda.pipeline import Ahead, DeviceCopy, PipelineCounts, watches_steps
from engine.cuda.sampler import GpuSampler
from engine.cuda.trace import Tracer
from engine.profile import from_flat, load_profile, save_profile
from engine.sampling import Pick, PickSpec, refuse

MiB = 1 << 20
STEP_HEADROOM = 64 * MiB        # the prompt pass's scratch beyond what is allocated at start is taken per chunk


def _log(msg: str) -> None:
    print(f"strata cuda: {msg}", file=sys.stderr, flush=True)


def _host_inputs(layers) -> bool:
    """Whether a family's decode layers compute a step's inputs on the host from its token (they override the
    plain layers' set_inputs, e.g. qwen4exp's n-gram rows): such a step cannot be launched before the pick is read."""
    from engine.cuda.families.moe import MoeDecode
    own = getattr(type(layers), "set_inputs", None)
    return own is not None and own is not getattr(MoeDecode, "set_inputs", None)


class CUDABackend(Backend):
    name = "cuda"

    def __init__(self, model, max_context: int, opts: CudaOptions | None = None, log=_log, phase=None,
                 tracer: Tracer | None = None):
        super().__init__(model, max_context)
        self.opts = opts = opts or CudaOptions()
        self.log = log
        # phase(name, done=, gib=, gib_s=): the narrated start (engine/protocol.py's INFO phase lines)
        self.phase = phase or (lambda name, **facts: None)
        self.tracer = tracer or Tracer()    # benches' and tests' observer (engine/cuda/trace.py)
        if opts.mmap_experts and opts.resident_budget_gib is not None:
            raise ValueError("--mmap-experts pins no expert and --resident-budget-gib pins some: give one of them")
        cfg = self.config
        self.family = family_for(cfg)       # engine/cuda/families/: what runs this architecture
        self.recurrent_state = None         # the family's state carried between tokens (the hybrids' GdnState)
        if cfg.head_dim_v != cfg.head_dim or cfg.head_dim % 32 or cfg.head_dim > 256:
            raise ValueError(f"the CUDA backend needs head_dim == head_dim_v, a multiple of 32 and <= 256 "
                             f"(this model: {cfg.head_dim}/{cfg.head_dim_v}); use --backend cpu")
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.arena = None
        self.step = None
        self.decoder = None         # what runs a decode step: the step, or the memory modes' PagedDecode over it
        self.window = None          # engine/cuda/decode_window.py's step, built at the first window (False: none)
        self.gpu_sampler = None     # engine/cuda/sampler.py: every pick but plain greedy
        self.mem = None             # engine/cuda/memory_mode.py: --mmap-experts / --resident-budget-gib
        self.stats = ExpertStats()
        self._tokens_since_adapt = 0
        self._kv_high = 0           # the most positions written since the cache was last empty (truncate)
        self.pipelined = False      # decode steps run ahead (engine/cuda/pipeline.py): set once the step is built
        self._ahead: Ahead | None = None        # the step launched ahead, not yet kept or discarded
        self._restorable: list = []             # DeviceCopy of what a step changes besides K/V
        self.pipeline_counts = PipelineCounts()
        self._last_save = time.monotonic()
        pool = cp.get_default_memory_pool()
        free0, total = cp.cuda.runtime.memGetInfo()
        try:
            with self.stream:
                t0 = time.perf_counter()
                fam = self.family
                self.weights = fam.load_weights(model)
                self.kv = fam.kv_cache(max_context, opts.kv, target_chunk(opts, max_context), log)
                self.rope = cp.asarray(fam.rope_table(max_context))
                self.recurrent_state = fam.recurrent_state(self.stream)
                # a step run ahead must leave the recurrent state restorable: a spare of its one device buffer
                # (`mem`), allocated before the expert cache takes the free VRAM (the memory modes never pipeline)
                state_copy = None
                if self.recurrent_state is not None and opts.pipeline and not opts.mmap_experts \
                        and opts.resident_budget_gib is None:
                    mem = getattr(self.recurrent_state, "mem", None)
                    state_copy = DeviceCopy(mem, self.stream) if mem is not None else False
                self.layout = blob_layout(model) if cfg.is_moe else None
                if self.layout:
                    fam.check_experts(self.layout)
                qts = self.weights.qtype_ids()
                if self.layout:
                    qts |= self.layout.qtype_ids()
                self.kernels = Kernels(qts, ENGINE_FILES + fam.kernel_files)
                log(f"weights {pool.used_bytes() / MiB:.0f} MiB in VRAM, kernels ready "
                    f"({time.perf_counter() - t0:.1f} s)")
                self.cache = None
                if cfg.is_moe:
                    n_slots = self._expert_slots(pool)
                    self.mem = MemoryMode.plan(model, opts, self.layout, log, n_vram=n_slots)
                    self.arena = ExpertArena(model, log=log, pinned=self.mem.pinned if self.mem else None,
                                             progress=lambda d, t, s: self.phase("arena", done=d / t, gib=t / 2**30,
                                                                                 gib_s=d / 2**30 / max(s, 1e-9)))
                    self.cache = self._make_cache(n_slots)
                    if self.mem:
                        self.mem.attach_cache(model, self.arena, self.cache, self.stream, opts, log)
                self.gpu_sampler = GpuSampler(self.kernels, cfg.n_vocab, max_context + 1, self.stream)
                self._build_step()
                self._plan_pipeline(state_copy)
                self.stream.synchronize()
        except cp.cuda.memory.OutOfMemoryError as e:
            self.close()
            free, _ = cp.cuda.runtime.memGetInfo()
            raise MemoryError(f"out of VRAM while loading the model ({e}); {free0 / MiB:.0f} MiB were free at "
                              f"start: lower --ctx ({max_context}) or use a GPU with more memory") from None
        except (MemoryError, ValueError):   # a refusal with the numbers (VRAM budget, prompt chunk, staging ring)
            self.close()
            raise
        if self.cache is not None:
            self._initial_fill()
        if not opts.no_graph:
            self.step.capture()                     # the greedy and the sampled variant, before READY
            if self.mem:
                self.mem.paged.capture()
        self.vram_free_mib = cp.cuda.runtime.memGetInfo()[0] / MiB
        self.pcie_gbps = self._calibrate() if opts.calibrate else None

    # --- set-up ----------------------------------------------------------------------------------------------
    def _expert_slots(self, pool) -> int:
        """The expert cache's slot count, the token embedding placed first: in mapped pinned host memory when the
        cache cannot hold every expert and the embedding's VRAM buys it slots (embed_place.py), else in VRAM. Both
        counts are measured here, with the same accounting as the cache's, so the freed bytes become slots."""
        w, cfg = self.weights, self.config
        nbytes, was = w.tok_embd.nbytes, w.tok_embd.where
        n_vram = self._slot_count(pool, extra=nbytes if was == "host" else 0, quiet=True)
        n_host = self._slot_count(pool, extra=0 if was == "host" else -nbytes, quiet=True)
        where, why = embed_placement(self.opts.embed_host, cfg.tied_embeddings, n_vram, n_host,
                                     cfg.n_layer * cfg.n_expert)
        failed = w.place_embedding(self.model, where)
        if failed:
            why = f"{failed}; it stays in VRAM"
        elif where != was:
            pool.free_all_blocks()          # the old VRAM copy goes back to the device, where the cache can have it
        place = "pinned host memory, read in place over PCIe" if w.tok_embd.where == "host" else "VRAM"
        self.log(f"token embedding ({nbytes / MiB:.0f} MiB) in {place}: {why}")
        return self._slot_count(pool)

    def _make_cache(self, n_slots: int):
        """The VRAM expert cache of n_slots over the arena (the staged backend's: one a stage)."""
        return ExpertCache(self.arena, n_slots)

    def _slot_count(self, pool, extra: int = 0, quiet: bool = False) -> int:
        """extra: VRAM a placement not yet made would add (negative: free); quiet: a what-if, with no log line and no
        refusal (a budget the weights overrun gives 0 slots)."""
        opts, cfg = self.opts, self.config
        pools = SlotPools(self.layout.expert_strides(cfg.n_expert))     # the cache's slots, pool by blob size
        free, _ = cp.cuda.runtime.memGetInfo()
        # what the decode step and a prompt chunk still need beyond what is allocated now
        later = STEP_HEADROOM + self._prefill_scratch_bytes() + extra
        avail = free - opts.vram_reserve_mib * MiB - later
        used = pool.total_bytes()
        if opts.vram_budget_mib is not None:
            left = opts.vram_budget_mib * MiB - used - later
            if left < 0 and not quiet:
                raise MemoryError(
                    f"--vram-budget-mib {opts.vram_budget_mib} is too small: the weights and the KV cache alone take "
                    f"{used / MiB:.0f} MiB and the prompt pass {later / MiB:.0f} MiB; raise it or lower --ctx")
            avail = min(avail, left)
        n = pools.slots_for_bytes(avail)
        total = cfg.n_layer * cfg.n_expert
        # the prefetch's VRAM staging slots come out of the budget
        if prefetch_wanted(opts.prefetch, n, total, self.layout.stride):
            n = pools.slots_for_bytes(avail - self.layout.stride * vram_staging_slots(
                cfg.n_expert_used, opts.prefetch_depth, opts.fetch_misses))
        if opts.expert_slots is not None:
            n = min(n, max(0, opts.expert_slots))
        n = min(n, cfg.n_layer * cfg.n_expert)
        if quiet:
            return n
        split = "" if pools.n_pools == 1 else " in pools of " + ", ".join(
            f"{k} x {b / MiB:.2f} MiB" for k, b in zip(pools.split(n), pools.strides))
        self.log(f"expert cache: {n} of {cfg.n_layer * cfg.n_expert} experts fit in VRAM{split} "
                 f"({pools.bytes_of(n) / MiB:.0f} MiB; {free / MiB:.0f} MiB free, "
                 f"{opts.vram_reserve_mib} MiB reserved)")
        return n

    def _build_step(self):
        """The decode step over the cache with its prefetch, the prompt pass, and what runs the step: the memory
        mode's per-layer form when there is one."""
        opts = self.opts
        prefetch = prefetch_plan(self.config, self.cache, self.layout, opts.prefetch, self.log, opts.prefetch_depth,
                                 opts.fetch_misses)
        self.step = DecodeStep(self.kernels, self.config, self.weights, self.kv, self.rope, self.cache, self.layout,
                               self.stream, self.family, self.recurrent_state, self.gpu_sampler, prefetch)
        self.prefill = Prefill(self.step, opts, self.log, self.tracer,
                               ring_device=self.mem.ring_device if self.mem else None)
        self.decoder = self.mem.paged_decode(self.step, use_graphs=not opts.no_graph) if self.mem else self.step

    def _plan_pipeline(self, state_copy):
        """Pipelined decode unless --tune pipeline=off, a memory mode (its per-layer path waits on the host for each
        layer's routing), a tracer that follows each step's launch and read in turn, or a recurrent state that cannot
        be restored (state_copy False; None: no recurrent state)."""
        self.pipelined = bool(self.opts.pipeline) and self.mem is None and not watches_steps(self.tracer)
        if self.pipelined and not self.family.run_ahead:
            self.pipelined = False
            self.log(f"decode pipeline off: the {self.family.name} family's steps are not yet held to the "
                     f"unpipelined ones on a GPU (engine/cuda/families/{self.family.name}.py run_ahead)")
        if self.pipelined and state_copy is False:
            self.pipelined = False
            self.log(f"decode pipeline off: {type(self.recurrent_state).__name__} keeps its state in no single "
                     f"device buffer (`mem`) that a discarded step could be undone from")
        if self.pipelined and _host_inputs(self.step.layers):
            self.pipelined = False
            self.log(f"decode pipeline off: {type(self.step.layers).__name__} gives each step host-side inputs from "
                     f"its token (set_inputs), which a step fed on the GPU cannot have")
        if not self.pipelined:
            return
        keep = [state_copy] if state_copy is not None else []
        if self.cache is not None:
            keep.append(DeviceCopy(self.cache.stats, self.stream))          # DONE's hits and lookups
        if self.step.prefetch is not None:
            keep.append(DeviceCopy(self.step.prefetch.stats, self.stream))
        self._restorable = keep

    def _prefill_scratch_bytes(self) -> int:
        stride = self.layout.stride if self.layout else 0
        return reserve_bytes(self.config, stride, self.config.n_layer * self.config.n_expert,
                             self.opts, self.max_context, self.family.prompt_buffers)

    def _initial_fill(self):
        cache, opts = self.cache, self.opts
        t0 = time.perf_counter()
        order = None
        if opts.expert_profile:
            prof = load_profile(opts.expert_profile, self.config.n_layer, self.config.n_expert)
            order = prof.flat_order()
            cache.load_prior(prof.ranks())
            src = f"profile {opts.expert_profile}"
        elif cache.n_slots >= cache.n_total:
            order = np.arange(cache.n_total)
            src = "all experts"
        if order is not None and cache.n_slots:
            gib = min(len(order), cache.n_slots) * cache.stride / 2**30
            self.phase("cache", done=0.0, gib=gib)
            n = cache.fill(order, self.stream)
            self.phase("cache", done=1.0, gib=gib)
            dt = time.perf_counter() - t0
            gib = float(cache.blob_bytes[cache.owner[cache.owner >= 0]].sum()) / 2**30
            self.log(f"expert cache filled from {src}: {n} experts, {gib:.2f} GiB in {dt:.1f} s")

    def _calibrate(self) -> float:
        n = min(256 * MiB, self.arena.views[0].nbytes) if self.arena and self.arena.views else 0
        if not n:
            return 0.0
        dst = cp.empty(n, dtype=cp.uint8)
        src = self.arena.chunks[0]
        for _ in range(2):
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, src, n, cp.cuda.runtime.memcpyDefault, self.stream.ptr)
        self.stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(4):
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, src, n, cp.cuda.runtime.memcpyDefault, self.stream.ptr)
        self.stream.synchronize()
        return 4 * n / (time.perf_counter() - t0) / 1e9

    # --- the contract ----------------------------------------------------------------------------------------
    def prompt_chunk_size(self) -> int:
        return int(self.prefill.chunk)

    def truncate(self, n: int) -> None:
        """As Backend.truncate. A recurrent state (hybrids) cannot be rewound: only 0 or n_cached. A window layer's
        KV ring (gpt-oss, kv.py) keeps only `spare` rows beyond its window, so after positions more than that past n
        were written the window before n is gone: the cache then restarts empty (n_cached 0) and the session feeds
        the prompt again."""
        self._settle()
        if self.recurrent and n not in (0, self.n_cached):
            raise ValueError(f"cannot truncate to {n} of {self.n_cached}: a recurrent state cannot be rewound; "
                             f"restore_state() a snapshot taken at or before {n}, or truncate(0)")
        self._kv_high = max(self._kv_high, self.n_cached)
        super().truncate(n)
        spare = getattr(self.kv, "spare", None)
        if n and spare is not None and self._kv_high - n > spare:
            self.n_cached = 0
        if self.n_cached == 0:
            self._kv_high = 0
            if self.recurrent:
                self.recurrent_state.zero()

    # --- the recurrent state (engine/backend.py's contract; the family's, e.g. families/hybrid.py GdnState) -----
    @property
    def recurrent(self) -> bool:
        return self.recurrent_state is not None

    def state_bytes(self) -> int:
        return self.recurrent_state.nbytes if self.recurrent else 0

    def snapshot_state(self) -> RecurrentSnapshot:
        self._settle()
        if not self.recurrent:
            return super().snapshot_state()
        return RecurrentSnapshot(self.n_cached, self.recurrent_state.nbytes, self.recurrent_state.snapshot())

    def restore_state(self, snap: RecurrentSnapshot) -> None:
        self._settle()
        super().restore_state(snap)
        if self.recurrent:
            self.recurrent_state.restore(snap.data)

    def _room(self, n: int):
        if self.n_cached + n > self.max_context:
            raise ValueError(f"{self.n_cached} cached + {n} new tokens exceed the context of {self.max_context}")

    def _prefill(self, tokens, all_logits: bool) -> cp.ndarray:
        self._settle()
        self._room(len(tokens))
        out = []
        step = self.prompt_chunk_size()
        with self.stream:
            if self.cache is not None:
                self.cache.poll(self.stream)
            hint, self._hint = self._hint, None
            for i in range(0, len(tokens), step):
                part = list(tokens[i:i + step])
                last = i + step >= len(tokens)
                ahead = hint if last else list(tokens[i + step:i + 2 * step])
                lg = self.prefill.forward(part, self.n_cached, all_logits, ahead=ahead)
                self.n_cached += len(part)
                if all_logits or last:
                    out.append(lg)
            if self.cache is not None and self.opts.adapt_every:
                self.cache.adapt(self.stream)    # the prompt's routing fills free slots and warms the tier
            return out[0] if len(out) == 1 else cp.concatenate(out, axis=0)

    _hint = None        # read_ahead's tokens, for the next prompt pass's last chunk

    def read_ahead(self, tokens) -> None:
        """As Backend.read_ahead: the next prompt pass's last chunk hands these tokens (at most a chunk) to the family's
        prompt program, which gathers their host inputs while the GPU runs (qwen4exp: the n-gram rows)."""
        self._hint = [int(t) for t in tokens][:self.prompt_chunk_size()] or None

    def forward(self, tokens, all_logits: bool = False) -> np.ndarray:
        tokens = [int(t) for t in tokens]
        if len(tokens) == 1 and not all_logits:
            self._step(tokens[0], "greedy")
            with self.stream:
                return self.step.logits.get(stream=self.stream)
        lg = self._prefill(tokens, all_logits)
        with self.stream:
            h = lg.get(stream=self.stream)
        return h if all_logits else h[-1]

    def decode(self, tokens, spec: PickSpec, all_positions: bool = False) -> list[Pick]:
        """engine/backend.py's contract, every pick on the GPU: only the id (and the log-probabilities asked for)
        comes back. After one token without a mask the pick is the step's own, in its graph: the argmax for plain
        greedy, else engine/cuda/sampler.py's chain (engine/sampling.py's chain and kept sets, its own seeded random
        source) from the state GpuSampler.prepare keeps in step with the spec. After a prompt chunk, or with a mask,
        it is made from the logits left in VRAM (_pick_from_logits). Log-probabilities are read from the logits the
        pick saw (masked when there was a mask). A window (all_positions) is one window step (_decode_window) where
        the family has a window program, else one step a token; none runs ahead (the next one is fed a draft, not
        the pick)."""
        tokens = decode_tokens(tokens, spec, all_positions)
        if all_positions and len(tokens) > 1:
            self._settle()          # a window runs nothing ahead, and whatever runs it starts from n_cached
            if self.window_step() is not None:
                return self._decode_window(tokens, spec)
            return [self.decode([t], replace(spec.after(tokens[:i]), more=False))[0] for i, t in enumerate(tokens)]
        pick = "greedy" if spec.params.plain_greedy else "sampled"
        if len(tokens) == 1 and spec.mask is None:
            tok, status, logits = self._pick_in_step(tokens[0], spec, pick)
        else:
            self._settle()
            tok, status, logits = self._pick_from_logits(tokens, spec, pick)
        refuse(status, masked=spec.mask is not None)
        if spec.logprobs is None:
            return [Pick(tok)]
        with self.stream:
            lp, top = top_logprobs(logits, tok, spec.logprobs)
        return [Pick(tok, lp, tuple(top))]

    # --- verify windows (engine/cuda/decode_window.py) ------------------------------------------------------
    def window_cost(self, n_tokens: int) -> float:
        """A window of n tokens in one-token steps (the speculation rule's cost): the window step's measured cost
        (decode_window.window_cost), or n where windows run one step a token. Not the clock: a fixed table, so a
        request's windows follow from its tokens (engine/speculate.py)."""
        if n_tokens <= 1:
            return float(n_tokens)
        win = self.window_step()
        return float(n_tokens) if win is None else window_cost(n_tokens, win.max_t)

    def window_step(self) -> WindowStep | None:
        """The window step, built (its kernels compiled) at the first window; None where a window runs one step a
        token (decode_window.why_not says why, in one log line)."""
        if self.window is None:
            why = why_not(self)
            if why is not None:
                self.log(f"verify windows run one step a token: {why}")
                self.window = False
            else:
                self.window = build_window(self.step, self.family)
        return self.window or None

    def _decode_window(self, tokens, spec: PickSpec) -> list[Pick]:
        """The window's tokens through the window step (launches of up to its max_t tokens), then the pick after
        each position: the step's argmax for plain greedy, else the GPU sampler's chain on that position's logits
        with spec.after(the tokens before it), as the one-token calls of the same window pick. The trace hooks of
        one-token steps (before_step / after_step) are not called for windows."""
        win = self.window
        self._room(len(tokens))
        picks = []
        for i0 in range(0, len(tokens), win.max_t):
            part = tokens[i0:i0 + win.max_t]
            if self.cache is not None:
                if self.prefill.lent:
                    self.prefill.give_back(self.stream)
                self.cache.poll(self.stream)
            win.launch(part, self.n_cached, use_graph=not self.opts.no_graph)
            greedy = win.result(len(part))
            self.n_cached += len(part)
            for _ in part:
                self._tick()
            for i, t in enumerate(part):
                picks.append(self._window_pick(win.logits[i], t, spec.after(tokens[:i0 + i]), greedy[i]))
        return picks

    def _window_pick(self, logits, token: int, spec: PickSpec, greedy: tuple[int, int]) -> Pick:
        if spec.params.plain_greedy:
            tok, status = greedy
        else:
            with self.stream:
                self.gpu_sampler.prepare(spec, [token])
                self.gpu_sampler.enqueue(self.kernels, logits, self.step.out.dptr)
            tok, status = self.step.result()
            self.gpu_sampler.picked(tok, status)
        refuse(status, masked=False)
        if spec.logprobs is None:
            return Pick(tok)
        with self.stream:
            lp, top = top_logprobs(logits, tok, spec.logprobs)
        return Pick(tok, lp, tuple(top))

    def _pick_in_step(self, token: int, spec: PickSpec, pick: str) -> tuple[int, int, cp.ndarray]:
        """One step with its own pick; (id, status, the step's logits). The step is the one run ahead when that
        assumed this call (_keeps), else launched now; then, when the spec allows (_may_run_ahead), the next step
        is launched before this one's pick is read."""
        pos = self.n_cached
        if not self._keeps(token, pos, pick, spec):
            self._settle()
            if pick == "sampled":
                with self.stream:
                    self.gpu_sampler.prepare(spec, [token])
            self._launch(token, pos, pick)
        if self._may_run_ahead(spec):
            self._run_ahead(pos + 1, pick)
        tok, status = self._read(token, pos)
        if pick == "sampled":
            self.gpu_sampler.picked(tok, status)
        if self._ahead is not None:
            if status:
                self._settle()          # fed a failed pick: discarded before the refusal
            else:
                self._ahead.token = tok
        return tok, status, self.step.logits

    # --- the pipeline (engine/cuda/pipeline.py) --------------------------------------------------------------
    def _keeps(self, token: int, pos: int, pick: str, spec: PickSpec) -> bool:
        """Whether the step run ahead is this call's: at pos, fed this token, in this pick mode, and (sampled)
        from the device state this spec needs, which GpuSampler.picked followed. Kept: it is no longer ahead."""
        a = self._ahead
        if a is None or a.pos != pos or a.token != token or a.pick != pick:
            return False
        if pick == "sampled" and self.gpu_sampler.state_for(spec, [token]) != self.gpu_sampler.held:
            return False
        self._ahead = None
        self.pipeline_counts.kept += 1
        return True

    def _may_run_ahead(self, spec: PickSpec) -> bool:
        """The next step may be launched now: the caller expects one (spec.more: not the request's last token, no
        grammar), this pick's logits need not outlive the next step (no logprobs), and the context has room."""
        return (self.pipelined and spec.more and spec.logprobs is None and spec.mask is None and not spec.drafts
                and self.n_cached + 2 <= self.max_context)

    def _run_ahead(self, pos: int, pick: str) -> None:
        """Launch the step at pos, fed on the device by the pick of the step at pos - 1, with what it changes
        besides K/V copied aside first."""
        for r in self._restorable:
            r.save()
        self._launch(None, pos, pick)
        self._ahead = Ahead(pos, pick)
        self.pipeline_counts.ahead += 1

    def _settle(self) -> None:
        """Discard the step run ahead, if any (pipeline.py: it leaves no trace); nothing waits for it."""
        a = self._ahead
        if a is None:
            return
        self._ahead = None
        self._kv_high = max(self._kv_high, a.pos + 1)       # its K/V row was written (a window ring lost one)
        for r in self._restorable:
            r.restore()
        if a.pick == "sampled":
            self.gpu_sampler.held = None        # its pick advanced the device's RNG counter and penalty window
        self.pipeline_counts.discarded += 1

    def _pick_from_logits(self, tokens, spec: PickSpec, pick: str) -> tuple[int, int, cp.ndarray]:
        """The prompt pass's last row, or a greedy step's logits (its own argmax unused), masked on a copy
        (engine/cuda/logits_mask.py), then the argmax (the lowest id among equal maxima, as the step's) or the GPU
        sampler's chain on the copy; (id, status, the copy)."""
        if len(tokens) > 1:
            lg = self._prefill(tokens, False)[-1]
        else:
            self._step(tokens[0], "greedy")
            lg = self.step.logits
        with self.stream:
            lg, status = masked_copy(lg, spec.mask)
            if status:
                return -1, status, lg
            if pick == "greedy":
                return int(cp.argmax(lg)), 0, lg
            self.gpu_sampler.prepare(spec, tokens)
            self.gpu_sampler.enqueue(self.kernels, lg, self.step.out.dptr)
        tok, status = self.step.result()
        self.gpu_sampler.picked(tok, status)
        return tok, status, lg

    def _step(self, token: int, pick: str) -> tuple[int, int]:
        """One decode step: `token` at the next position through every layer, then the step's pick ("greedy": the
        argmax; "sampled": the GPU sampler's chain from the state it holds). Returns (id, status) as the step wrote
        them (status: the NaN count, or -1 when every logit was -inf; engine/sampling.py refuse reads it)."""
        self._settle()
        pos = self.n_cached
        self._launch(token, pos, pick)
        return self._read(token, pos)

    def _launch(self, token: int | None, pos: int, pick: str) -> None:
        """Enqueue the step at pos fed `token` (None: fed on the device by the step before, launched ahead)."""
        if token is not None:
            self._room(1)               # (a step run ahead: _may_run_ahead checked its room)
        if self.cache is not None:
            if self.prefill.lent:                   # the first step after a streamed prompt ends it: once
                self.prefill.give_back(self.stream)     # the ring's lent cache slots back
            self.cache.poll(self.stream)            # the adaptive tier's landed swaps into the table
        self.tracer.before_step(self)
        if token is None:
            self.step.launch_next(pos, pick, use_graph=not self.opts.no_graph)
        else:
            self.decoder.launch(token, pos, pick, use_graph=not self.opts.no_graph)
        self.tracer.launched(self)

    def _read(self, token: int, pos: int) -> tuple[int, int]:
        """The pick of the step at pos (fed `token`), waiting for that step alone; the position advances."""
        tok, nan = self.step.pick_at(pos)
        self.tracer.after_step(self, token, pos)
        self.n_cached += 1
        self._tick()
        return tok, nan

    def _tick(self):
        if self.cache is None:
            return
        self._tokens_since_adapt += 1
        cache = self.cache
        if self.opts.adapt_every:       # a round in two halves that wait for nothing (expert_cache.py)
            if cache.counts_taken:
                if cache.counts_landed():
                    cache.adapt_finish(self.stream)
            elif self._tokens_since_adapt >= self.opts.adapt_every:
                self._tokens_since_adapt = 0
                cache.adapt_start(self.stream)
        every = self.opts.expert_profile_save_every
        if self.opts.expert_profile_save and every and time.monotonic() - self._last_save > every * 60:
            self.save_profile()

    def save_profile(self, path=None):
        self._settle()
        path = path or self.opts.expert_profile_save
        if self.cache is None or not path:
            return
        c = self.cache
        c.heat += c.take_counts(self.stream)     # the counts since the last round count, undecayed
        save_profile(path, from_flat(c.n_layer, c.n_expert, c.learned_order()))
        self._last_save = time.monotonic()

    def reset_stats(self) -> None:
        self._settle()
        self.stats = ExpertStats()
        if self.cache is not None:
            self.cache.reset_stats(self.stream)
        if self.step is not None and self.step.prefetch is not None:
            self.step.prefetch.reset_stats()
        if self.mem:
            self.mem.reset_stats()
        self.family.reset_stats()

    def request_info(self) -> dict:
        """The family's counters since reset_stats() (qwen4exp: ple_row_lookups, ple_row_hits)."""
        return self.family.request_info()

    def get_stats(self) -> ExpertStats:
        self._settle()
        if self.cache is None:
            return ExpertStats()
        hits, lookups = self.cache.read_stats(self.stream)
        if self.mem:
            ram, files, mb = self.mem.stats(hits, lookups)
            return ExpertStats(hits=hits, lookups=lookups, ram_blobs=ram, file_blobs=files, file_mb=mb)
        return ExpertStats(hits=hits, lookups=lookups, ram_blobs=lookups - hits)

    def prefetch_stats(self):
        """engine/cuda/prefetch.py's PrefetchStats since the last reset_stats(), or None when the step does not
        prefetch."""
        self._settle()
        prefetch = self.step.prefetch if self.step is not None else None
        return prefetch.read_stats() if prefetch is not None else None

    def info(self) -> dict:
        dev = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(dev.id)
        out = {"gpu": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
               "kv": self.kv.dtype, "graph": "off" if self.opts.no_graph else "on",
               "pipeline": "on" if self.pipelined else "off",
               "vram_free_mib": int(self.vram_free_mib), "embed": self.weights.tok_embd.where}
        if self.cache is not None:
            out.update(expert_slots=self.cache.n_slots, experts_total=self.cache.n_total,
                       arena_mib=int(self.arena.nbytes / MiB))
            out["prefetch"] = "on" if self.step.prefetch is not None else "off"
            out.update(self.mem.info() if self.mem else {"memory": "pinned"})
        if self.cache is not None and self.opts.expert_profile:
            out["expert_profile"] = self.opts.expert_profile      # the profile this start filled the cache from
        if self.pcie_gbps is not None:
            out["pcie_gbps"] = round(self.pcie_gbps, 1)
        out.update(self.family.info())
        if self.recurrent:                  # what one checkpoint takes (pinned host memory)
            out["recurrent_state_mib"] = round(self.recurrent_state.nbytes / MiB, 1)
        if self.prefill is not None:
            out.update(prefill_chunk=self.prefill.chunk, ring=self.prefill.plan.ring,
                       ring_lend=self.prefill.plan.lend)
        return out

    def cache_picture(self):
        if self.cache is None:
            return None
        c = self.cache
        return c.n_layer, c.n_expert, c.resident(), c.heat_u8()

    def close(self) -> None:
        try:
            if self.step is not None:
                self._settle()
            if self.opts.expert_profile_save and getattr(self, "cache", None) is not None:
                self.save_profile()
        finally:
            if self.gpu_sampler is not None:
                self.gpu_sampler.close()
                self.gpu_sampler = None
            if self.window:
                self.window.close()
                self.window = None
            if self.step is not None:
                self.step.close()
                self.step = self.decoder = None
            if self.mem is not None:
                self.stream.synchronize()
                self.mem.close()
                self.mem = None
            if self.arena is not None:
                cp.cuda.Device().synchronize()      # the cache's swap copies (their own stream) read the arena too
                self.arena.close()
                self.arena = None
            if getattr(self, "weights", None) is not None:
                self.stream.synchronize()           # the last step may still read a host-resident embedding
                self.weights.close()
            self.family.close()
            # a closed backend holds no device memory, whoever still refers to it: a bench builds the next one in the
            # same process, and its expert cache is sized from the VRAM free then
            self.weights = self.kv = self.rope = self.cache = self.prefill = None
