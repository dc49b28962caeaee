"""The worker process: spawn, READY, the line pump, the silence deadlines, STOP, kill, close (DESIGN §3-4).

Every wait here is timed: a worker that stops talking is killed, never waited on, so the request FIFO that holds it
always moves on. The worker's stderr goes straight to the log file; this module reads the log back to explain a
failure (the last lines of *this* start, and the likely cause).
"""
from __future__ import annotations

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


class WorkerError(RuntimeError):
    """The worker failed; the message says what happened and what the next request will do."""


class WorkerStartError(WorkerError):
    pass


class WorkerDied(WorkerError):
    pass


class WorkerSilent(WorkerError):
    pass


@dataclass
class Event:
    kind: str          # RESUME, PP, REUSED, T, DONE, ERR, or TICK (nothing arrived for a moment)
    value: object = None


def likely_cause(returncode: int | None, log_tail: str) -> str:
    low = log_tail.lower()
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) or "out of memory" in low or "memoryerror" in low \
            or "cudaerrormemoryallocation" in low or "\nkilled" in "\n" + low:
        return ("out of memory (the kernel's OOM killer sends SIGKILL; `dmesg` says so): lower --ctx, use a smaller "
                "quantization, or read experts from the file (--mmap-experts / --resident-budget-gib)")
    if "watchdog" in low:
        return "the worker's own watchdog ended it (see the log lines below)"
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"it was ended by {name}"
    return f"it exited with status {returncode}; the log lines below say why"


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
    def start(self) -> None:
        """Spawn the worker and wait for READY (each line restarts the silence allowance)."""
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
                raise WorkerStartError(f"could not start the worker ({shlex.join(self.cmd)}): {e}") from None
        threading.Thread(target=self._pump, args=(self.proc, self._q), daemon=True,
                         name=f"worker-pump-{self.proc.pid}").start()
        threading.Thread(target=self._write, args=(self.proc, self._wq), daemon=True,
                         name=f"worker-write-{self.proc.pid}").start()
        last = time.monotonic()
        allowance = max(self.silence_s, START_SILENCE_MIN_S)
        while True:
            line = self._get(last + allowance if self.silence_s else None)
            if line is None:
                self.kill(f"it printed nothing for {allowance:g} s while loading")
                raise WorkerStartError(
                    f"the worker printed nothing for {allowance:g} s while loading and was stopped; raise "
                    f"engine_silence_s if loading takes longer. Last lines of its log:\n{self.log_tail()}")
            if line is _EOF:
                rc = self._reap()
                raise WorkerStartError(
                    f"the worker exited (status {rc}) before it was ready; the next request tries again. Last lines "
                    f"of its log ({self.log_path}):\n{self.log_tail()}")
            last = time.monotonic()
            if protocol.kind(line) == "READY":
                parts = line.split()
                try:
                    self.max_context = int(parts[1])
                except (IndexError, ValueError):
                    self.kill("its READY line was malformed")
                    raise WorkerStartError(f"the worker's READY line is malformed: {line[:80]!r}") from None
                self.honours_stop = "stop" in parts[2:]
                return

    def _pump(self, proc, q) -> None:
        # INFO and CACHE are state, kept as they arrive (between requests too); every line still goes to the queue
        # because any line counts as a sign of life.
        for raw in proc.stdout:
            line = raw.rstrip("\r\n")
            k = protocol.kind(line)
            if k == "INFO":
                info = protocol.parse_info(line)
                self.info.update(info)
                if "phase" in info:    # the narrated start, in the server's own log
                    print(f"strata: worker {proc.pid}: {protocol.describe_phase(self.info)}", file=sys.stderr,
                          flush=True)
            elif k == "CACHE":
                self.cache_line = line
            elif not k and line.strip():
                self.note(f"unexpected line on the worker's stdout: {line[:200]!r}")
            q.put(line)
        proc.stdout.close()
        q.put(_EOF)

    def _get(self, deadline: float | None):
        """The next line, _EOF, or None at the deadline (None deadline: wait in ticks, forever)."""
        while True:
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
    def generate(self, req: GenRequest):
        """Send GEN and yield Events up to and including DONE or ERR; TICK events while waiting.

        Raises WorkerSilent (after killing it) when the worker breaks the deadline, WorkerDied when it exits.
        """
        if not self.alive:
            raise WorkerDied("the worker is not running; the next request restarts it")
        while True:  # lines left from between requests are INFO/CACHE (already kept); drop them
            try:
                if self._q.get_nowait() is _EOF:
                    self._died("before the request was sent")
            except queue.Empty:
                break
        self._stop_at = None
        S = self.silence_s
        first_chunk = min(len(req.prompt), int(self.info.get("prompt_chunk", len(req.prompt)) or len(req.prompt)))
        allowance = S + first_chunk / FIRST_CHUNK_TOK_S
        self._send(protocol.format_gen(req))
        last = time.monotonic()
        prev_ms = 0.0
        while True:
            line = self._q_get_tick(last, allowance)
            if line is None:
                yield Event("TICK")
                continue
            if line is _EOF:
                self._died("mid-request")
            last = time.monotonic()
            k = protocol.kind(line)
            if k == "T":
                allowance = S
                yield Event("T", int(line.split()[1]))
            elif k == "PP":
                pp = protocol.parse_pp(line)
                chunk_s = max(0.0, pp[2] - prev_ms) / 1000.0
                prev_ms = pp[2]
                allowance = max(S, CHUNK_SLACK * chunk_s)
                yield Event("PP", pp)
            elif k in ("RESUME", "REUSED"):
                if k == "REUSED":
                    allowance = S
                yield Event(k, int(line.split()[1]))
            elif k == "DONE":
                yield Event("DONE", protocol.parse_done(line))
                return
            elif k == "ERR":
                yield Event("ERR", line[4:].strip())
                return

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
                f"starts it again. Last lines of its log:\n{self.log_tail()}")
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
                         f"The next request restarts it. Last lines of its log ({self.log_path}):\n{tail}")

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
