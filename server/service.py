"""The request FIFO over one worker: cancel, thinking budget, history and metrics (docs/design.md: server).

One engine thread owns the worker and runs the jobs in order. HTTP handler threads submit jobs and read their
events from a queue of their own; they never touch the worker, so a slow or vanished client cannot hold the FIFO.
A client that goes away sets its job's cancel flag: the engine sends STOP and reads on to that job's own DONE
before the next job starts, so no job ever reads another's lines.
"""
from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from engine.protocol import CONTEXT_MARGIN, GenRequest, describe_phase
from server.text import TextCodec, TextStream
from server.worker import Worker, WorkerDied, WorkerError, WorkerProtocolError

log = logging.getLogger("strata.service")

HISTORY_LEN = 500
RATE_WINDOW_S = 2.0
SERIES_S = 300              # the Monitor's tok/s chart: generated tokens per second over the last 5 minutes
# DONE's counters, summed over a request's passes into its Result and over requests into the totals.
PASS_SUMS = ("prompt_read", "prompt_ms", "decode_ms", "hits", "lookups", "ram_blobs", "file_blobs", "file_mb",
             "drafts_offered", "drafts_accepted")
TOTAL_SUMS = ("prompt_tokens", "cached_tokens", "generated") + PASS_SUMS


class ServiceError(Exception):
    def __init__(self, status: int, message: str, kind: str = "server_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass
class Result:
    finish: str                     # stop | length | cancel
    prompt_tokens: int = 0
    cached_tokens: int = 0          # reused from the worker's cache (first pass)
    prompt_read: int = 0
    generated: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    stop_string: str | None = None
    hits: int = 0
    lookups: int = 0
    ram_blobs: int = 0              # experts read from pinned RAM (decode misses), from the file (memory modes)
    file_blobs: int = 0
    file_mb: float = 0.0
    drafts_offered: int = 0         # speculative decoding: draft tokens checked, and confirmed (engine/protocol.py Done)
    drafts_accepted: int = 0
    passes: int = 0


@dataclass
class _Run:
    """One request's state across its passes (a thinking budget replays the request from the cache)."""
    max_new: int
    text: TextStream
    res: Result
    budget: int | None
    generated: list[int] = field(default_factory=list)
    took: bool = False              # the worker answered RESUME (it has begun this request)


@dataclass
class Job:
    kind: str                                   # gen | load | unload
    endpoint: str = ""
    prompt: list[int] = field(default_factory=list)
    max_new: int | None = None                  # None: the rest of the context
    params: dict = field(default_factory=dict)
    stops: list[str] = field(default_factory=list)
    reasoning_budget: int | None = None
    prompt_text: str | None = None              # the rendered chat prompt (None: a plain completion)
    logprobs: int | None = None                 # top alternatives per token (None: no log-probabilities)
    grammar: str | None = None                  # a constraint for the worker (engine/grammar.py), or None
    id: str = ""
    created: float = field(default_factory=time.time)
    events: queue.Queue = field(default_factory=queue.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, *ev) -> None:
        self.events.put(ev)


class Service:
    def __init__(self, cfg, codec: TextCodec, worker_factory=None):
        self.cfg = cfg
        self.codec = codec
        self.worker_factory = worker_factory or (lambda: Worker(
            cfg.worker_command(), cfg.cwd, cfg.log, env=cfg.worker_env(), silence_s=cfg.engine_silence_s))
        self.worker: Worker | None = None
        self._ids = itertools.count(1)
        self._cv = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._closing = False
        self._shutdown = threading.Event()     # set by close(): a load in progress is abandoned at once
        self._last_activity = time.monotonic()
        # Live state for /metrics (written by the engine thread, read under the lock).
        self.phase = "unloaded"
        self.progress: dict | None = None
        self.last_error: str | None = None
        self.worker_starts = 0
        self.worker_failures = 0
        self._token_times: collections.deque[float] = collections.deque()
        self._per_second: collections.deque[list[int]] = collections.deque(maxlen=SERIES_S)   # [second, tokens]
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY_LEN)
        zero = Result("stop")       # the sums start as its 0 or 0.0
        self.totals = dict(requests=0, stop=0, length=0, cancel=0, error=0,
                           **{k: getattr(zero, k) for k in TOTAL_SUMS})
        self._thread = threading.Thread(target=self._engine_loop, daemon=True, name="engine")
        self._thread.start()

    # --- the handlers' side -----------------------------------------------------------------------------------
    def preload(self) -> None:
        """Load the worker now (the config's load_at_start, or --preload): a job at the head of the FIFO, so the
        requests that arrive meanwhile wait for it, and the phase says "loading" from this moment on."""
        with self._cv:      # before the job is queued: the engine thread then owns the phase
            if self._running is None and not self._pending and not (self.worker is not None and self.worker.alive):
                self.phase = "loading"
        self.submit(Job("load", endpoint="start"))

    def submit(self, job: Job) -> Job:
        with self._cv:
            if self._closing:
                raise ServiceError(503, "the server is shutting down")
            if job.kind == "unload" and self.phase == "loading":
                raise ServiceError(409, "the model is loading; unload when it is ready (GET /health says when)",
                                   "invalid_request_error")
            if job.kind == "unload" and (self._running is not None or self._waiting_locked()):
                raise ServiceError(409, "requests are running or waiting; unload when they are done",
                                   "invalid_request_error")
            job.id = f"{job.kind}-{next(self._ids)}"
            self._pending.append(job)
            self._cv.notify_all()
        return job

    def _waiting_locked(self) -> int:
        return sum(1 for j in self._pending if not j.cancel.is_set())

    def busy(self) -> bool:
        with self._cv:
            return self._running is not None or self._waiting_locked() > 0

    def close(self, timeout_s: float = 60.0) -> None:
        with self._cv:
            self._closing = True
            self._shutdown.set()
            for j in self._pending:
                j.cancel.set()
            if self._running is not None:
                self._running.cancel.set()
            self._cv.notify_all()
        self._thread.join(timeout_s)

    # --- the engine thread ------------------------------------------------------------------------------------
    def _engine_loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closing:
                    idle = self.cfg.idle_unload_s
                    if idle and self.worker is not None and self.worker.alive and \
                            time.monotonic() - self._last_activity >= idle:
                        break
                    self._cv.wait(timeout=min(idle, 1.0) if idle else None)
                if self._closing:
                    break
                job = self._pending.popleft() if self._pending else None
                self._running = job
            try:
                if job is None:
                    self._unload("idle for idle_unload_s")
                else:
                    self._run(job)
            except Exception as e:  # a bug here must not kill the engine thread and hang every later request
                log.exception("internal error while running %s", job.id if job else "the idle unload")
                # The worker may be mid-request: end it, so no later request reads this one's lines.
                if self.worker is not None and self.worker.alive:
                    self.worker.kill(f"the server failed while it ran a request ({type(e).__name__})")
                    self._set(phase="failed", last_error=f"internal error: {type(e).__name__}: {e}")
                if job is not None:
                    job.emit("error", 500, f"internal error in the server: {type(e).__name__}: {e}")
            finally:
                with self._cv:
                    self._running = None
                    self._last_activity = time.monotonic()
        for j in list(self._pending):
            j.emit("error", 503, "the server is shutting down")
        self._unload("the server is shutting down")

    def _run(self, job: Job) -> None:
        if job.cancel.is_set():
            if job.kind == "gen":
                self._record(job, Result("cancel", prompt_tokens=len(job.prompt)), None, time.time())
            return
        if job.kind == "load":
            try:
                self._ensure_worker()
                job.emit("done", None)
            except WorkerError as e:
                if not self._shutdown.is_set():
                    what = "the model could not be loaded at start: " if job.endpoint == "start" else ""
                    log.warning("%s%s%s", what, e, f"\nthe worker's last log lines:\n{e.detail}" if e.detail else "")
                job.emit("error", 503, str(e))
        elif job.kind == "unload":
            self._unload("asked to by /unload")
            job.emit("done", None)
        else:
            self._generate(job)

    def _set(self, **kw) -> None:
        with self._cv:
            for k, v in kw.items():
                setattr(self, k, v)

    def _ensure_worker(self) -> Worker:
        if self.worker is not None and self.worker.alive:
            return self.worker
        if self.worker is not None:
            self.worker.close()
        self.worker = self.worker_factory()
        self._set(phase="loading")
        self.worker_starts += 1
        try:
            self.worker.start(abort=self._shutdown)
        except WorkerError as e:
            self.worker_failures += 1
            self._set(phase="failed", last_error=str(e))
            raise
        self._set(phase="idle")
        return self.worker

    def _unload(self, why: str) -> None:
        if self.worker is not None and self.worker.alive:
            self.worker.note(f"closing the worker: {why}")
            self._set(phase="unloading")
            self.worker.close()
        self._set(phase="unloaded")

    def _generate(self, job: Job) -> None:
        started = time.time()
        try:
            w = self._ensure_worker()
        except WorkerError as e:
            self._fail(job, None, e, started)
            return
        room = w.max_context - len(job.prompt) - CONTEXT_MARGIN
        if room < 1:
            msg = (f"the prompt has {len(job.prompt)} tokens but the context holds {w.max_context} "
                   f"({CONTEXT_MARGIN} kept free, at least 1 to answer): shorten the conversation, or restart the "
                   f"worker with a larger --ctx")
            job.emit("error", 400, msg)
            self._record(job, None, msg, started)
            return
        run = _Run(max_new=room if job.max_new is None else min(job.max_new, room),
                   text=TextStream(self.codec, job.stops, job.prompt_text),
                   res=Result("stop", prompt_tokens=len(job.prompt)),
                   # a grammar constrains one pass from its start: no budget replay (it would restart the grammar)
                   budget=None if job.grammar else job.reasoning_budget)
        retried = False
        while True:
            if run.budget is not None and run.text.thinking and run.text.think_tokens >= run.budget:
                self._close_thought(job, run.text, run.generated)
                run.budget = None   # one budget per request: a thought the model opens again is its own choice
            left = run.max_new - len(run.generated)
            if left <= 0:
                run.res.finish = "length"
                break
            try:
                stopped_for, done, err = self._pass(w, job, run, left)
            except WorkerError as e:
                self.worker_failures += 1
                if isinstance(e, (WorkerDied, WorkerProtocolError)) and not run.took and not retried \
                        and not job.cancel.is_set():
                    # It was gone (or talking out of turn, and killed) before it began this request: nothing of
                    # this request is lost, so start it again and replay the request once.
                    retried = True
                    self.worker.note("the worker was gone before it took the request; starting it again")
                    try:
                        w = self._ensure_worker()
                        continue
                    except WorkerError as e2:
                        e = e2
                run.res.generated = len(run.generated)
                self._fail(job, run.res, e, started)
                return
            run.res.passes += 1
            if err is not None:
                msg = f"the engine refused the request: {err}"
                job.emit("error", 400 if run.res.passes == 1 and not run.generated else 500, msg)
                self._set(phase="idle", progress=None)
                self._record(job, run.res, msg, started)
                return
            for k in PASS_SUMS:
                setattr(run.res, k, getattr(run.res, k) + getattr(done, k))
            if stopped_for == "budget" and not job.cancel.is_set():
                # Replay: the loop head closes the thought, the next GEN continues from the cache. Whatever the pass
                # ended with: the worker may have reached an end-of-generation token (or max_new: the loop head
                # then ends with length) before it read the STOP, and the budget had run out all the same.
                continue
            run.res.finish = {"client": "cancel", "stop": "stop"}.get(stopped_for, done.finish)
            break
        text, res = run.text, run.res
        r, c = text.finish()
        if r or c:
            job.emit("delta", r, c)
        if text.stop_hit is not None and res.stop_string is None and res.finish != "cancel":
            # a stop that only the end of the text decided (a longer stop could still have followed)
            res.stop_string, res.finish = text.stop_hit, "stop"
        res.generated = len(run.generated)
        self._set(phase="idle", progress=None)
        job.emit("done", res)
        self._record(job, res, None, started)

    def _pass(self, w: Worker, job: Job, run: "_Run", left: int):
        """One GEN (the prompt so far plus what earlier passes generated) read to its DONE or ERR:
        (why the server stopped it: None | client | stop | budget, its Done, the worker's ERR message)."""
        stopped_for, done, err = None, None, None
        text, res = run.text, run.res
        self._set(phase="prompt", progress=None)
        gen = GenRequest(left, job.prompt + run.generated, job.params, logprobs=job.logprobs, grammar=job.grammar)
        for ev in w.generate(gen, n_vocab=self.codec.tok.n_vocab):
            if job.cancel.is_set() and stopped_for is None:
                stopped_for = "client"
                self._set(phase="stopping")
                w.stop()
            if ev.kind == "T":
                run.generated.append(ev.value)
                self._tick_token()
                if stopped_for in ("client", "stop"):
                    continue
                if ev.extra is not None:
                    job.emit("logprobs", ev.value, *ev.extra)
                r, c = text.feed_token(ev.value)
                if r or c:
                    job.emit("delta", r, c)
                if text.stop_hit is not None and stopped_for is None:
                    stopped_for = "stop"
                    res.stop_string = text.stop_hit
                    w.stop()
                elif run.budget is not None and text.thinking and text.think_tokens >= run.budget \
                        and stopped_for is None:
                    stopped_for = "budget"
                    w.stop()
            elif ev.kind == "PP":
                pos, total, ms, tps = ev.value
                self._set(progress=dict(position=pos, prompt_tokens=total, ms=ms, tok_s=tps))
            elif ev.kind == "RESUME":
                if res.passes == 0:
                    res.cached_tokens = ev.value
                    run.took = True
                    job.emit("started")     # the worker took the request: a stream can begin
            elif ev.kind == "REUSED":
                if stopped_for is None:
                    self._set(phase="generating")
            elif ev.kind == "DONE":
                done = ev.value
            elif ev.kind == "ERR":
                err = ev.value
        return stopped_for, done, err

    def _fail(self, job: Job, res: Result | None, e: WorkerError, started: float) -> None:
        """A worker failure: the client gets the cause (503); the worker's log lines go to the server's log."""
        log.warning("%s%s", e, f"\nthe worker's last log lines:\n{e.detail}" if e.detail else "")
        self._set(phase="failed", last_error=str(e), progress=None)
        job.emit("error", 503, str(e))
        self._record(job, res, str(e), started)

    def _close_thought(self, job: Job, text: TextStream, generated: list[int]) -> None:
        generated.extend(self.codec.encode_special(self.codec.closing_words))
        r, c = text.feed_text(self.codec.closing_words)
        if r or c:
            job.emit("delta", r, c)

    def _tick_token(self) -> None:
        now = time.monotonic()
        with self._cv:
            self._token_times.append(now)
            sec = int(now)
            if self._per_second and self._per_second[-1][0] == sec:
                self._per_second[-1][1] += 1
            else:
                self._per_second.append([sec, 1])
            while self._token_times and self._token_times[0] < now - RATE_WINDOW_S:
                self._token_times.popleft()

    def _record(self, job: Job, res: Result | None, error: str | None, started: float) -> None:
        res = res or Result("error")
        finish = "error" if error else res.finish
        entry = dict(id=job.id, endpoint=job.endpoint, queued=job.created, started=started, ended=time.time(),
                     finish=finish, error=error.splitlines()[0] if error else None, prompt_tokens=res.prompt_tokens,
                     cached_tokens=res.cached_tokens, prompt_read=res.prompt_read, generated=res.generated,
                     prompt_ms=round(res.prompt_ms, 1), decode_ms=round(res.decode_ms, 1),
                     prompt_tok_s=round(res.prompt_read / res.prompt_ms * 1000, 1) if res.prompt_ms else None,
                     decode_tok_s=round(res.generated / res.decode_ms * 1000, 1) if res.decode_ms else None,
                     hits=res.hits, lookups=res.lookups, ram_blobs=res.ram_blobs, file_blobs=res.file_blobs,
                     file_mb=round(res.file_mb, 1), drafts_offered=res.drafts_offered,
                     drafts_accepted=res.drafts_accepted, passes=res.passes)
        with self._cv:
            self.history.append(entry)
            t = self.totals
            t["requests"] += 1
            t[finish] += 1
            for k in TOTAL_SUMS:
                t[k] += entry[k]

    # --- /health and /metrics ---------------------------------------------------------------------------------
    def health(self) -> tuple[int, dict]:
        """GET /health: 200 while the service can answer (the worker loaded, or loaded by the next request), 503
        while the model loads and after a failed start or a dead worker (the error says what the next request
        does), as llama.cpp's server answers, so a readiness probe waits for the load."""
        w = self.worker
        with self._cv:
            body = dict(status="ok", phase=self._phase_text(w), model=self.cfg.model_name)
            if self.phase == "loading":
                body["status"] = "loading"
                return 503, body
            if self.phase == "failed" and not (w is not None and w.alive):
                body.update(status="error", error=self.last_error)
                return 503, body
        return 200, body

    def _phase_text(self, w) -> str:
        """While a worker loads, its narrated start ("loading: pinning experts in RAM: 45% of 16.0 GiB at 12.3
        GiB/s"), which the Monitor shows as the phase; otherwise the service's own phase."""
        step = describe_phase(w.info) if self.phase == "loading" and w is not None else None
        return f"loading: {step}" if step else self.phase
    def _series_locked(self, now: float) -> list[int]:
        """Tokens generated in each of the last SERIES_S whole seconds, oldest first (the current one last)."""
        out = [0] * SERIES_S
        first = int(now) - SERIES_S + 1
        for sec, n in self._per_second:
            if sec >= first:
                out[sec - first] = n
        return out

    def snapshot(self) -> dict:
        w = self.worker
        with self._cv:
            now = time.monotonic()
            recent = [t for t in self._token_times if t >= now - RATE_WINDOW_S]
            running = self._running
            snap = dict(
                model=self.cfg.model_name,
                phase=self._phase_text(w),
                worker=dict(alive=bool(w and w.alive), pid=w.pid if w and w.alive else None,
                            max_context=w.max_context if w else 0, info=dict(w.info) if w else {},
                            starts=self.worker_starts, failures=self.worker_failures, last_error=self.last_error),
                queue=dict(running=running.id if running is not None and running.kind == "gen" else None,
                           waiting=self._waiting_locked()),
                progress=self.progress,
                tok_s=round(len(recent) / RATE_WINDOW_S, 1),
                tok_s_series=self._series_locked(now),
                totals=dict(self.totals),
                history=list(self.history),
            )
        t = snap["totals"]
        snap["totals"]["hit_rate"] = round(t["hits"] / t["lookups"], 4) if t["lookups"] else None
        t.update(speculation(t))
        try:
            snap["cache"] = cache_picture(w.cache_line if w else None)
        except Exception as e:      # the worker checks each CACHE line; this guards /metrics against a bug
            log.warning("the expert-cache picture failed: %s", e)
            snap["cache"] = None
        return snap


def speculation(t: dict) -> dict:
    """Acceptance (drafts confirmed over drafts checked) and tokens per window: every emitted token is a confirmed
    draft or a window's own pick (engine/protocol.py, the note above Done). None without drafts."""
    if not t.get("drafts_offered"):
        return dict(draft_acceptance=None, tokens_per_window=None)
    windows = t["generated"] - t["drafts_accepted"]
    return dict(draft_acceptance=round(t["drafts_accepted"] / t["drafts_offered"], 4),
                tokens_per_window=round(t["generated"] / windows, 3) if windows > 0 else None)


def cache_picture(line: str | None) -> dict | None:
    """The CACHE line as JSON for the Monitor; None for a model without experts (or before any CACHE line)."""
    if not line:
        return None
    from engine.protocol import parse_cache
    n_layer, n_expert, resident, heat = parse_cache(line)
    return dict(n_layer=n_layer, n_expert=n_expert, resident=resident.astype(int).tolist(),
                heat=heat.astype(int).tolist(), resident_count=int(resident.sum()))
