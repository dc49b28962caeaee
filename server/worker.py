"""The worker process: spawn, READY, the line pump, silence deadlines, STOP, kill, close (docs/design.md: server).

Every wait here is timed: a worker that stops talking is killed, never waited on, so the request FIFO that holds it
always moves on. The worker's stderr goes straight to the log file; this module reads the log back to explain a
failure (the last lines of *this* start, and the likely cause).
"""
from __future__ import annotations

import dataclasses
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine import protocol
from engine.protocol import GenRequest

FIRST_CHUNK_TOK_S = 50.0   # the slowest prompt rate we allow for before the first PP arrives
CHUNK_SLACK = 3.0          # after a PP, the next chunk may take this many times the previous one
TAIL_LINES = 20
START_SILENCE_MIN_S = 30.0  # loading may be silent for this long even under a small engine_silence_s
_EOF = object()
_ABORT = object()
_STAGES = {"sent": "before RESUME", "prompt": "while the prompt is read", "tokens": "after the prompt"}


class WorkerError(RuntimeError):
    """The worker failed; the message says what happened and what the next request will do (the client sees it).
    detail holds the worker's last log lines, for the server's log only: they name files and paths."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


class WorkerStartError(WorkerError):
    pass


class WorkerDied(WorkerError):
    pass


class WorkerSilent(WorkerError):
    pass


class WorkerProtocolError(WorkerError):
    """The worker sent a line the protocol does not allow at that point; it was killed."""


@dataclass
class Event:
    kind: str          # RESUME, PP, REUSED, T, DONE, ERR, or TICK (nothing arrived for a moment)
    value: object = None
    extra: object = None   # T: (logprob, [(id, logprob), ...]) when the request asked for logprobs


OOM_HINT = "lower --ctx, use a smaller quantization, or read experts from the file (--mmap-experts / --resident-budget-gib)"


def likely_cause(returncode: int | None, log_tail: str) -> str:
    low = log_tail.lower()
    if "out of memory" in low or "memoryerror" in low or "cudaerrormemoryallocation" in low:
        return f"out of memory (the log says so): {OOM_HINT}"
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) or "\nkilled" in "\n" + low:
        # SIGKILL alone does not say who sent it: a person, a supervisor, or the kernel's OOM killer.
        return ("it was killed with SIGKILL, by another process or by the kernel's out-of-memory killer (`dmesg` "
                f"says which; if it was memory: {OOM_HINT})")
    if "watchdog" in low:
        return "the worker's own watchdog ended it (the server's log has its last lines)"
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"it was ended by {name}"
    return f"it exited with status {returncode}; its last log lines (in the server's log) say why"


class Worker:
    """One worker process. Not thread-safe: one owner (the service's engine thread) drives it."""

    def __init__(self, cmd: list[str], cwd: str | None, log_path, env: dict | None = None,
                 silence_s: float = 300.0, quit_timeout_s: float = 30.0, tick_s: float = 0.05):
        if silence_s < 0:
            raise ValueError("engine_silence_s must be a number >= 0 (0 = no limit)")
        self.cmd = list(cmd)
        self.cwd = cwd
        self.log_path = Path(log_path)
        self.env = env or {}
        self.silence_s = float(silence_s)
        self.quit_timeout_s = quit_timeout_s
        self.tick_s = tick_s
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, str] = {}
        self.cache_line: str | None = None     # the latest CACHE line, parsed on demand
        self.max_context = 0
        self.honours_stop = False
        self._q: queue.Queue = queue.Queue()
        self._wq: queue.Queue = queue.Queue()
        self._log_offset = 0
        self._stop_at: float | None = None
        self._req_no = 0

    # --- state ------------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def log_tail(self, n: int = TAIL_LINES) -> str:
        """The last n lines this start wrote to the log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return "\n".join(lines[-n:]) if lines else "(the worker wrote nothing to its log)"

    def note(self, message: str) -> None:
        """A line of the server's own in the worker's log, so the log tells the whole story."""
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} strata server: {message}\n")

    # --- start ------------------------------------------------------------------------------------------------
    def start(self, abort: threading.Event | None = None) -> None:
        """Spawn the worker and wait for READY (each line restarts the silence allowance). abort: set by another
        thread (the server shutting down) to end a load at once: the half-loaded worker is killed."""
        if self.alive:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.note(f"starting the worker: {shlex.join(self.cmd)}")
        self._log_offset = self.log_path.stat().st_size
        self.info, self.cache_line, self.max_context, self.honours_stop = {}, None, 0, False
        self._q = queue.Queue()
        self._wq = queue.Queue()
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        with open(self.log_path, "ab") as logf:
            try:
                self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=env, stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=logf, text=True, bufsize=1,
                                             encoding="utf-8", errors="replace")
            except OSError as e:
                raise WorkerStartError(f"could not start the worker ({e.strerror or type(e).__name__}); the "
                                       f"server's log has the command", f"command: {shlex.join(self.cmd)}: {e}") from None
        threading.Thread(target=self._pump, args=(self.proc, self._q), daemon=True,
                         name=f"worker-pump-{self.proc.pid}").start()
        threading.Thread(target=self._write, args=(self.proc, self._wq), daemon=True,
                         name=f"worker-write-{self.proc.pid}").start()
        last = time.monotonic()
        allowance = max(self.silence_s, START_SILENCE_MIN_S)
        while True:
            line = self._get(last + allowance if self.silence_s else None, abort)
            if line is _ABORT:
                # Nothing is learned before READY, so there is nothing for a QUIT to save.
                self.kill("the server is shutting down")
                raise WorkerStartError("the server is shutting down; the model's load was abandoned")
            if line is None:
                self.kill(f"it printed nothing for {allowance:g} s while loading")
                raise WorkerStartError(
                    f"the worker printed nothing for {allowance:g} s while loading and was stopped; raise "
                    f"engine_silence_s if loading takes longer (the server's log has the worker's last lines)",
                    self.log_tail())
            if line is _EOF:
                rc = self._reap()
                tail = self.log_tail()
                raise WorkerStartError(
                    f"the worker exited (status {rc}) before it was ready; likely cause: {likely_cause(rc, tail)}. "
                    f"The next request tries again; the server's log has the worker's last lines", tail)
            last = time.monotonic()
            if protocol.kind(line) == "READY":
                parts = line.split()
                try:
                    self.max_context = int(parts[1])
                except (IndexError, ValueError):
                    self.kill("its READY line was malformed")
                    raise WorkerStartError(f"the worker's READY line is malformed: {line[:80]!r}") from None
                if self.max_context < 1:
                    self.kill("its READY line was malformed")
                    raise WorkerStartError(f"the worker's READY line is malformed: {line[:80]!r}") from None
                self.honours_stop = "stop" in parts[2:]
                return

    def _pump(self, proc, q) -> None:
        # INFO and CACHE are state, kept as they arrive (between requests too); every line still goes to the queue
        # because any line counts as a sign of life.
        # Bytes, not the text wrapper: its universal newlines would turn a lone "\r" at EOF into a line's end.
        for raw in proc.stdout.buffer:
            if not raw.endswith(b"\n"):
                # Only the last read can lack its newline: the worker died while writing that line. Half a line is
                # not a protocol line ("T 12" may be the start of "T 1234"), so it never reaches a request.
                self.note(f"the worker's output ended inside a line, which was ignored: {raw[:80]!r}")
                break
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            k = protocol.kind(line)
            if k == "INFO":
                info = protocol.parse_info(line)
                self.info.update(info)
                if "phase" in info:    # the narrated start, in the server's own log
                    print(f"strata: worker {proc.pid}: {protocol.describe_phase(self.info)}", file=sys.stderr,
                          flush=True)
            elif k == "CACHE":
                # A picture for the Monitor: a bad one is dropped (the last good one stays), so /metrics never
                # meets a line it cannot draw.
                try:
                    protocol.parse_cache(line)
                    self.cache_line = line
                except protocol.ProtocolError as e:
                    self.note(f"a bad CACHE line from the worker was ignored: {e}")
            elif not k and line.strip():
                self.note(f"unexpected line on the worker's stdout: {line[:200]!r}")
            q.put(line)
        proc.stdout.close()
        q.put(_EOF)

    def _get(self, deadline: float | None, abort: threading.Event | None = None):
        """The next line, _EOF, None at the deadline (None deadline: wait in ticks, forever), or _ABORT once abort
        is set."""
        while True:
            if abort is not None and abort.is_set():
                return _ABORT
            now = time.monotonic()
            timeout = self.tick_s if deadline is None else min(self.tick_s, deadline - now)
            if timeout <= 0:
                return None
            try:
                return self._q.get(timeout=timeout)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return None

    # --- one request ------------------------------------------------------------------------------------------
    def generate(self, req: GenRequest, n_vocab: int | None = None):
        """Send GEN and yield Events up to and including DONE or ERR; TICK events while waiting.

        Every line is checked against the protocol's order for this request (its req number in RESUME, DONE and
        ERR; PP and REUSED only between RESUME and the first T; T ids inside n_vocab; as many T as DONE counts).
        Raises WorkerProtocolError on any other line, WorkerSilent when the worker breaks the deadline, WorkerDied
        when it exits; each after killing it, so no later request can read this one's lines.
        """
        if not self.alive:
            raise WorkerDied("the worker is not running; the next request restarts it")
        while True:  # lines left from between requests: INFO/CACHE (already kept) are dropped, anything else is wrong
            try:
                line = self._q.get_nowait()
            except queue.Empty:
                break
            if line is _EOF:
                self._died("before the request was sent")
            if protocol.kind(line) not in ("INFO", "CACHE"):
                self._violation(f"{line[:80]!r} between requests")
        self._stop_at = None
        self._req_no += 1
        req = dataclasses.replace(req, req=self._req_no)
        S = self.silence_s
        chunk = self.info.get("prompt_chunk", "")
        first_chunk = min(len(req.prompt), int(chunk) if chunk.isdigit() and int(chunk) > 0 else len(req.prompt))
        allowance = S + first_chunk / FIRST_CHUNK_TOK_S
        self._send(protocol.format_gen(req))
        last = time.monotonic()
        prev_ms = 0.0
        stage = "sent"          # sent -> prompt (RESUME) -> tokens (REUSED or the first T)
        tokens = 0
        while True:
            line = self._q_get_tick(last, allowance)
            if line is None:
                yield Event("TICK")
                continue
            if line is _EOF:
                self._died("mid-request")
            last = time.monotonic()
            k = protocol.kind(line)
            if k in ("INFO", "CACHE"):
                continue
            try:
                if k == "ERR":
                    msg, no = protocol.parse_err(line)
                    self._check_req(no, req.req, line)
                    yield Event("ERR", msg)
                    return
                if k == "RESUME" and stage == "sent":
                    n, no = protocol.parse_resume(line)
                    self._check_req(no, req.req, line)
                    stage = "prompt"
                    yield Event("RESUME", n)
                elif k == "PP" and stage == "prompt":
                    pp = protocol.parse_pp(line)
                    chunk_s = max(0.0, pp[2] - prev_ms) / 1000.0
                    prev_ms = pp[2]
                    allowance = max(S, CHUNK_SLACK * chunk_s)
                    yield Event("PP", pp)
                elif k == "REUSED" and stage == "prompt":
                    stage = "tokens"
                    allowance = S
                    yield Event("REUSED", protocol.parse_resume(line)[0])
                elif k == "T" and stage == "tokens":
                    tok, lp, top = protocol.parse_token(line, n_vocab)
                    if (lp is None) != (req.logprobs is None):
                        raise protocol.ProtocolError(f"T: logprobs {'missing' if lp is None else 'not asked for'}")
                    tokens += 1
                    allowance = S
                    yield Event("T", tok, None if lp is None else (lp, top))
                elif k == "DONE" and stage != "sent":
                    done, no = protocol.parse_done_req(line)
                    self._check_req(no, req.req, line)
                    if done.generated != tokens:
                        raise protocol.ProtocolError(f"DONE counts {done.generated} tokens, {tokens} T lines came")
                    yield Event("DONE", done)
                    return
                else:
                    raise protocol.ProtocolError(f"{line[:80]!r} is not allowed {_STAGES[stage]}")
            except protocol.ProtocolError as e:
                self._violation(str(e))

    def _check_req(self, got: int | None, want: int, line: str) -> None:
        if got != want:
            raise protocol.ProtocolError(f"{line[:60]!r} belongs to request {got}, not to request {want}")

    def _violation(self, what: str):
        self.kill(f"it broke the line protocol: {what}")
        raise WorkerProtocolError(
            f"the worker broke the line protocol ({what}); it was stopped and the next request starts it again",
            self.log_tail())

    def _q_get_tick(self, last: float, allowance: float):
        """One wait of at most a tick; kills the worker and raises when the silence or STOP deadline passes."""
        now = time.monotonic()
        deadline = None
        if self.silence_s:
            deadline = last + allowance
            if self._stop_at is not None:
                deadline = min(deadline, self._stop_at + allowance)
        timeout = self.tick_s if deadline is None else min(self.tick_s, deadline - now)
        if timeout > 0:
            try:
                return self._q.get(timeout=timeout)
            except queue.Empty:
                pass
        if deadline is not None and time.monotonic() >= deadline:
            if self._stop_at is not None:
                what = f"did not finish the request within {allowance:g} s of being told to STOP"
            else:
                what = f"printed nothing for {allowance:g} s"
            self.kill(what)
            raise WorkerSilent(
                f"the worker {what} (engine_silence_s={self.silence_s:g}); it was stopped and the next request "
                f"starts it again", self.log_tail())
        return None

    def stop(self) -> None:
        """Ask the running request to end (DONE ... cancel follows); the generator keeps reading to that DONE."""
        if self._stop_at is None:
            self._stop_at = time.monotonic()
            self._send("STOP")

    def _send(self, line: str) -> None:
        # The writer thread does the (possibly blocking) pipe write: a worker that stops reading stdin must not
        # block the engine thread, which keeps timing the worker's silence and kills it at the deadline.
        if not self.alive:
            self._died("before a line could be sent to it")
        self._wq.put(line)

    def _write(self, proc, wq) -> None:
        while True:
            line = wq.get()
            try:
                if line is None:
                    proc.stdin.close()
                    return
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
            except (OSError, ValueError):
                return     # the worker is gone; its stdout's end tells the engine thread how

    def _died(self, when: str):
        rc = self._reap()
        tail = self.log_tail()
        raise WorkerDied(f"the worker exited {when} (status {rc}); likely cause: {likely_cause(rc, tail)}. "
                         f"The next request restarts it", tail)

    def _reap(self) -> int | None:
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill("its stdout closed but it did not exit")
            return self.proc.returncode

    # --- end --------------------------------------------------------------------------------------------------
    def kill(self, why: str) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.note(f"killing the worker (pid {self.proc.pid}): {why}")
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.note(f"the worker (pid {self.proc.pid}) did not exit 10 s after SIGKILL")
        self._close_pipes()

    def close(self, term_timeout_s: float = 5.0) -> None:
        """QUIT (the worker saves its profile and exits), then SIGTERM, then SIGKILL, each with a timeout."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._wq.put("QUIT")
            self._wq.put(None)
            try:
                self.proc.wait(timeout=self.quit_timeout_s)
            except subprocess.TimeoutExpired:
                self.note(f"the worker did not exit {self.quit_timeout_s:g} s after QUIT; sending SIGTERM")
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=term_timeout_s)
                except subprocess.TimeoutExpired:
                    self.kill(f"it did not exit {term_timeout_s:g} s after SIGTERM")
        self._close_pipes()

    def _close_pipes(self) -> None:
        # The writer thread owns stdin and the pump thread stdout; each closes its own (closing a pipe under a
        # blocked read or write from another thread is unsafe).
        self._wq.put(None)
