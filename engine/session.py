"""One request at a time over one backend: prefix reuse, the prompt pass in chunks, the decode loop, cancel, DONE.

The session remembers which tokens the backend's KV cache holds, so the next request (which carries the whole
conversation again) only reads what is new. A backend with recurrent state (the hybrids) cannot be rewound: there the
session resumes from checkpoints (engine/checkpoints.py). With a drafter (engine/drafters) the decode loop verifies
windows of drafts (engine/speculate.py): each window's final picks are emitted in order, and DONE counts the drafts
offered and accepted. It emits protocol lines through `emit` and never writes anywhere else.
"""
from __future__ import annotations

import threading
import time

from engine import protocol
from engine.backend import MAX_WINDOW
from engine.checkpoints import CHECKPOINT_TAIL, CheckpointStore
from engine.protocol import CONTEXT_MARGIN, Done, GenRequest
from engine.sampling import Pick, Sampler, SamplingParams
from engine.speculate import SpecStats, WindowRule, verify


class RequestError(ValueError):
    """A request the worker refuses (bad ids, too long, bad keys); the message says what to do."""


class BackendBroken(RuntimeError):
    """The backend can no longer serve (e.g. a sticky CUDA error); the worker must exit after its ERR."""


class Session:
    def __init__(self, backend, eog_ids, prompt_chunk: int | None = None, grammars=None,
                 checkpoint_every: int = 1024, checkpoint_mib: float = 1024.0, drafter=None,
                 max_window: int = MAX_WINDOW, rule: WindowRule | None = None):
        self.backend = backend
        self.grammars = grammars        # grammar= value -> engine.grammar.Constraint (None: no grammar support)
        # None: the backend's own size; the worker's --prompt-chunk can only lower it.
        self.prompt_chunk = prompt_chunk
        self.eog_ids = frozenset(int(t) for t in eog_ids)
        self.n_vocab = int(backend.config.n_vocab)
        self.max_context = int(backend.max_context)
        # The tokens whose K/V the backend holds, position by position: always len == backend.n_cached.
        self.tokens: list[int] = []
        # Recurrent backends only: snapshots of prefixes of self.tokens, taken every checkpoint_every prompt tokens
        # (0: only near each prompt's end and at each request's end), within checkpoint_mib.
        self.checkpoints = (CheckpointStore(int(checkpoint_mib * 2**20))
                            if getattr(backend, "recurrent", False) else None)
        self.checkpoint_every = max(0, int(checkpoint_every))
        # Speculation: the drafter follows self.tokens (observe/rewind); each request gets a fresh window rule that
        # sizes its windows from the acceptance it measures (a given rule, e.g. FixedWindow, serves every request).
        self.drafter = drafter
        if drafter is not None and drafter.needs_hidden and not backend.keep_hidden(True):
            raise ValueError(f"the {drafter.name} drafter reads hidden rows, which the {backend.name} backend "
                             f"does not give")
        self.fixed_rule = rule
        self.max_window = max_window
        self.rule = rule or WindowRule(backend.window_cost, max_window)
        self.spec_stats = SpecStats()

    # --- validation ------------------------------------------------------------------------------------------
    def validate(self, req: GenRequest) -> None:
        for i, t in enumerate(req.prompt):
            if not 0 <= t < self.n_vocab:
                raise RequestError(
                    f"token id {t} at prompt position {i} is outside this model's vocabulary (0..{self.n_vocab - 1}): "
                    f"tokenize with the model's own vocabulary")
        need = len(req.prompt) + req.max_new + CONTEXT_MARGIN
        if need > self.max_context:
            room = self.max_context - len(req.prompt) - CONTEXT_MARGIN
            hint = (f"lower max_new to {room} or less" if room >= 0
                    else f"shorten the prompt to {self.max_context - CONTEXT_MARGIN - req.max_new} tokens or less")
            raise RequestError(
                f"prompt {len(req.prompt)} + max_new {req.max_new} + {CONTEXT_MARGIN} = {need} tokens exceeds the "
                f"context of {self.max_context}: {hint}, or restart the worker with a larger --ctx "
                f"(the model was trained on {getattr(self.backend.config, 'n_ctx_train', '?')})")
        try:
            SamplingParams.of(req.params)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if req.grammar is not None and self.grammars is None:
            raise RequestError("this worker has no grammar support (grammar= needs llguidance)")

    # --- one request -----------------------------------------------------------------------------------------
    def run(self, req: GenRequest, emit, stop_event: threading.Event | None = None) -> Done | None:
        """Serve one request: emit its lines and return its Done, or emit ERR and return None.

        Raises BackendBroken (after emitting ERR) when the backend cannot serve another request.
        """
        stop_event = stop_event or threading.Event()
        try:
            self.validate(req)
            constraint = self.grammars(req.grammar) if req.grammar is not None else None
        except ValueError as e:     # RequestError, or engine.grammar.GrammarError: the request's fault
            emit(protocol.format_err(str(e)))
            return None
        try:
            return self._run(req, emit, stop_event, constraint)
        except BackendBroken as e:
            emit(protocol.format_err(f"the engine failed and must restart: {e}"))
            raise
        except Exception as e:
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            try:
                self._forget()
            except Exception as e2:
                emit(protocol.format_err(f"request failed ({reason}); the engine cannot recover and exits"))
                raise BackendBroken(f"{reason}; resetting the KV cache then failed: {e2}") from e
            emit(protocol.format_err(f"request failed: {reason}"))
            return None

    def _forget(self) -> None:
        # After a failure mid-forward we cannot know how much of the cache is valid: start from nothing.
        self.tokens = []
        if self.checkpoints is not None:
            self.checkpoints.clear()
        if self.drafter is not None:
            self.drafter.rewind(0)
        self.backend.truncate(0)

    def _rewind(self, common: int) -> int:
        """Cut the backend back to at most `common` tokens of self.tokens; returns how many it keeps."""
        keep = common
        store = self.checkpoints
        if store is not None and common < len(self.tokens):
            # The live state is past `common` and cannot go back: the latest checkpoint at or before it, or nothing.
            snap = store.latest_at_or_before(common)
            keep = snap.n_tokens if snap is not None else 0
            if snap is not None:
                self.backend.restore_state(snap)
            else:
                self.backend.truncate(0)
        else:
            self.backend.truncate(keep)
            keep = self.backend.n_cached        # a KV ring may have kept less (engine/cuda/backend.py truncate)
        del self.tokens[keep:]
        if store is not None:
            store.drop_after(keep)
        if self.drafter is not None:
            self.drafter.rewind(keep)
        return keep

    def _fed(self, tokens, hidden=None) -> None:
        """The backend read these tokens after self.tokens: record them, and let the drafter read them too."""
        self.tokens.extend(tokens)
        d = self.drafter
        if d is not None:
            t0 = time.perf_counter()
            d.observe(tokens, (hidden if hidden is not None else self.backend.hidden()) if d.needs_hidden else None)
            self.spec_stats.observe_s += time.perf_counter() - t0

    def _checkpoint(self) -> None:
        store = self.checkpoints
        if store is None or not self.tokens or not store.fits(self.backend.state_bytes()):
            return
        if len(self.tokens) not in store.positions():
            store.add(self.backend.snapshot_state())

    def _marks(self, start: int, end: int) -> set[int]:
        """Positions strictly between start and end where the prompt pass takes a checkpoint."""
        if self.checkpoints is None:
            return set()
        marks = {end - CHECKPOINT_TAIL}
        if self.checkpoint_every:
            marks.update(range((start // self.checkpoint_every + 1) * self.checkpoint_every, end,
                               self.checkpoint_every))
        return {m for m in marks if start < m < end}

    def _run(self, req: GenRequest, emit, stop_event: threading.Event, constraint=None) -> Done:
        backend = self.backend
        prompt = req.prompt
        sampler = Sampler(req.params)
        backend.reset_stats()
        self.spec_stats = SpecStats()
        self.rule = self.fixed_rule or WindowRule(backend.window_cost, self.max_window)

        # Prefix reuse: the last prompt token is always run again, because its logits pick the first new token.
        common = _common_prefix(self.tokens, prompt, limit=len(prompt) - 1)
        if backend.n_cached != len(self.tokens):
            # A bug, not a broken device: the generic handler forgets the cache and the next request starts cold.
            raise RuntimeError(f"the backend holds {backend.n_cached} tokens but the session expected "
                               f"{len(self.tokens)}")
        reused = self._rewind(common)
        emit(f"RESUME {reused}")
        marks = self._marks(reused, len(prompt))

        chunk = max(1, int(self.prompt_chunk or backend.prompt_chunk_size()))
        t0 = time.perf_counter()
        pos = reused
        read = 0
        first = None
        cancelled = False
        while pos < len(prompt):
            if stop_event.is_set():
                cancelled = True
                break
            end = min(pos + chunk, len(prompt))
            while pos < end:
                # A checkpoint position inside the chunk splits it (one PP still follows the whole chunk).
                cut = min([m for m in marks if pos < m < end], default=end)
                part = prompt[pos:cut]
                after = _next_part(prompt, cut, end, chunk, marks)
                if len(after):
                    backend.read_ahead(after)      # e.g. its host inputs gathered while this part runs
                if cut == len(prompt) and req.max_new > 0:
                    # The backend picks the first new token with the prompt's last logits (on the GPU for cuda).
                    first = self._pick(part, sampler, constraint, req.logprobs,
                                       more=req.max_new > 1 and self.drafter is None)
                else:
                    backend.forward(part)
                self._fed(part)
                pos = cut
                read += len(part)
                if pos in marks:
                    self._checkpoint()
            ms = (time.perf_counter() - t0) * 1000.0
            emit(protocol.format_pp(pos, len(prompt), ms, read / max(ms / 1000.0, 1e-9)))
        prompt_ms = (time.perf_counter() - t0) * 1000.0
        if cancelled:
            return self._done(emit, req, [], prompt_ms, 0.0, "cancel", reused, read)
        emit(f"REUSED {reused}")

        t1 = time.perf_counter()
        generated: list[int] = []
        finish = None
        picks = [first] if req.max_new > 0 else []
        while True:
            for picked in picks:        # the last window's final picks, in order
                tok = picked.id
                if tok in self.eog_ids:
                    finish = "stop"
                    break
                generated.append(tok)
                emit(protocol.format_token(tok, picked.logprob, list(picked.top)) if req.logprobs is not None
                     else f"T {tok}")
                if constraint is not None:
                    constraint.accept(tok)
                    if constraint.done:       # the grammar is complete: only the end of generation may follow
                        finish = "stop"
                        break
            if finish is not None:
                break
            if len(generated) >= req.max_new:
                finish = "length"
                break
            if stop_event.is_set():
                finish = "cancel"
                break
            # The token fed is the one just picked and emitted: its K/V go in, the next picks come out.
            picks = self._window(generated[-1], sampler, constraint, req.logprobs, req.max_new - len(generated) - 1)
        decode_ms = (time.perf_counter() - t1) * 1000.0
        return self._done(emit, req, generated, prompt_ms, decode_ms, finish, reused, read)

    def _window(self, last: int, sampler: Sampler, constraint, logprobs: int | None, room: int) -> list[Pick]:
        """Feed last and the drafts proposed after it (at most room of them), keep what the picks accept: the
        final picks, the accepted drafts' and the target's next one. A grammar takes one pick at a time."""
        d, st, rule = self.drafter, self.spec_stats, self.rule
        k = 0 if d is None or constraint is not None else rule.drafts(room)
        t0 = time.perf_counter()
        draft = d.propose(last, k, sampler) if k else None
        st.propose_s += time.perf_counter() - t0
        drafts = draft.tokens[:k] if draft is not None else []
        probs = tuple(zip(drafts, draft.probs)) if drafts and draft.probs is not None \
            and self.backend.judges_drafts else ()
        # more: after these picks the next call feeds the last of them alone (no drafter: no window may follow),
        # so the backend may run that step ahead; a grammar needs its mask from the host first
        spec = sampler.spec(self.tokens, mask=constraint.mask() if constraint is not None else None,
                            logprobs=logprobs, drafts=probs, more=room > 0 and d is None and constraint is None)
        win = verify(self.backend, [last] + drafts, spec, hidden=d is not None and d.needs_hidden)
        a = win.accepted
        for j in range(a):              # an end of generation among the accepted picks ends the request there
            if win.picks[j].id in self.eog_ids:
                a = j
                break
        win.keep(a + 1)
        sampler.advance(a + 1)
        self._fed(win.tokens[:a + 1], win.hidden[:a + 1] if win.hidden is not None else None)
        if d is not None:
            st.windows += 1
            st.offered += len(drafts)
            st.accepted += a
            rule.record(len(drafts), win.accepted)
        return win.picks[:a + 1]

    def _pick(self, part, sampler: Sampler, constraint, logprobs: int | None, more: bool = False) -> Pick:
        """Feed part and pick the next token. The penalty history is the sequence the backend holds before part
        (self.tokens: the prompt so far, then the generated tokens fed back), so it is never kept twice. more:
        PickSpec.more (a grammar's picks never run ahead)."""
        spec = sampler.spec(self.tokens, mask=constraint.mask() if constraint is not None else None,
                            logprobs=logprobs, more=more and constraint is None)
        picked = self.backend.decode(part, spec)[-1]
        sampler.advance()
        return picked

    def _done(self, emit, req, generated, prompt_ms, decode_ms, finish, reused, read) -> Done:
        facts = {}
        if self.checkpoints is not None:
            # The next turn usually extends this one: a checkpoint where the request ended (cancelled ones too).
            self._checkpoint()
            facts.update(checkpoints=len(self.checkpoints), checkpoint_mib=self.checkpoints.nbytes / 2**20)
        facts.update(self.backend.request_info())    # e.g. qwen4exp's n-gram row-cache hits
        if facts:
            emit(protocol.format_info(**facts))
        st = self.backend.get_stats()
        sp = self.spec_stats
        done = Done(generated=len(generated), prompt=len(req.prompt), prompt_ms=prompt_ms, decode_ms=decode_ms,
                    finish=finish, drafts_accepted=sp.accepted, drafts_offered=sp.offered,
                    reused=reused, hits=st.hits, lookups=st.lookups, ram_blobs=st.ram_blobs,
                    file_blobs=st.file_blobs, file_mb=float(st.file_mb), prompt_read=read)
        emit(protocol.format_done(done))
        return done


def _next_part(prompt, cut: int, end: int, chunk: int, marks) -> list:
    """The part of the prompt the loop in Session.run feeds after prompt[..cut] (end: the current chunk's end)."""
    if cut >= len(prompt):
        return []
    nxt_end = end if cut < end else min(cut + chunk, len(prompt))
    return prompt[cut:min([m for m in marks if cut < m < nxt_end], default=nxt_end)]


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), max(limit, 0))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
