"""Scripted batch run: a JSONL file of prompts (token ids) in, a JSONL file of results out, through the worker.

    python -m tools.batch --model M.gguf prompts.jsonl results.jsonl [--ctx N] [--backend cpu|cuda|auto]
                          [--resume] [--worker-arg=--flag ...]

Each input line: {"id": ..., "prompt": [ids], "max_new": N, and any GEN sampling key (temperature, top_k, ...)}.
Each output line: {"id", "tokens", "finish", and every DONE field} or {"id", "error"}. Results are written and
flushed as each request finishes, so an interrupted run keeps what it did; --resume skips ids already in the output.
The worker is spawned once and speaks the same protocol the server uses (no second interface to keep in step).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from engine import protocol
from engine.protocol import GEN_KEYS, GenRequest

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "strata_worker.py"


class WorkerGone(RuntimeError):
    """The worker exited (or closed stdout); the message has its exit status."""


class WorkerClient:
    """One worker subprocess, driven line by line. Its stderr goes to ours (or to `stderr`)."""

    def __init__(self, model, worker_args=(), stderr=None, python=sys.executable):
        self.cmd = [python, str(WORKER), "--model", str(model), *worker_args]
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                     text=True, encoding="utf-8", bufsize=1, cwd=ROOT,
                                     # Ctrl-C reaches us alone: we answer it with STOP, the protocol's way.
                                     start_new_session=True)
        self.info: dict[str, str] = {}
        self.max_context = 0
        self.cache_line: str | None = None
        self._wait_ready()

    def _readline(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise WorkerGone(f"the worker exited with status {code} (its stderr says why)")
        return line.rstrip("\n")

    def _wait_ready(self) -> None:
        while True:
            line = self._readline()
            k = protocol.kind(line)
            if k == "INFO":
                self.info.update(protocol.parse_info(line))
            elif line.startswith("READY "):
                self.max_context = int(line.split()[1])
                return

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise WorkerGone(f"the worker exited with status {self.proc.wait()} (its stderr says why)") from None

    def stop(self) -> None:
        self.send("STOP")

    def generate(self, req: GenRequest, on_token=None, on_line=None) -> dict:
        """Send one GEN and read to its DONE or ERR. Returns {"tokens", "finish", DONE fields} or {"error"}."""
        self.send(protocol.format_gen(req))
        return self.read_result(on_token, on_line)

    def read_result(self, on_token=None, on_line=None, tokens=None) -> dict:
        """Read one request's lines to its DONE or ERR (after a STOP too: the request still ends with DONE)."""
        tokens = [] if tokens is None else tokens
        while True:
            line = self._readline()
            if on_line:
                on_line(line)
            k = protocol.kind(line)
            if k == "T":
                tok = int(line.split()[1])
                tokens.append(tok)
                if on_token:
                    on_token(tok)
            elif k == "DONE":
                d = protocol.parse_done(line)
                return {"tokens": tokens, **asdict(d)}
            elif k == "ERR":
                return {"tokens": tokens, "error": line[4:]}
            elif k == "INFO":
                self.info.update(protocol.parse_info(line))
            elif k == "CACHE":
                self.cache_line = line

    def close(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            try:
                self.send("QUIT")
                self.proc.stdin.close()
            except (WorkerGone, BrokenPipeError, OSError):
                pass
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def parse_item(obj) -> tuple[object, GenRequest]:
    """A JSONL input object -> (id, GenRequest); ValueError with a message naming the problem."""
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    rid = obj.get("id")
    prompt = obj.get("prompt")
    if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in prompt):
        raise ValueError('"prompt" must be a non-empty list of token ids (integers)')
    max_new = obj.get("max_new", 128)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
        raise ValueError('"max_new" must be an integer >= 0')
    unknown = set(obj) - {"id", "prompt", "max_new"} - set(GEN_KEYS)
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} (known: id, prompt, max_new, {', '.join(GEN_KEYS)})")
    params = {k: obj[k] for k in GEN_KEYS if k in obj and obj[k] is not None}
    # Round-trip through the protocol's own parser so a bad value is refused here with the worker's words.
    req = protocol.parse_gen(protocol.format_gen(GenRequest(max_new, prompt, params)))
    return rid, req


def _done_ids(path: Path) -> set:
    ids = set()
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                ids.add(json.dumps(json.loads(line).get("id")))
            except (ValueError, AttributeError):
                continue  # a line cut by a crash: that prompt runs again
    return ids


def run_batch(model, in_path, out_path, worker_args=(), resume=False, log=sys.stderr) -> int:
    """Run every prompt; returns the number of results with an error."""
    in_path, out_path = Path(in_path), Path(out_path)
    skip = _done_ids(out_path) if resume else set()
    items = []
    for n, raw in enumerate(in_path.read_text(encoding="utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as e:
            items.append((n, None, None, f"line {n} is not JSON: {e}"))
            continue
        rid = obj.get("id", n) if isinstance(obj, dict) else n
        if json.dumps(rid) in skip:
            continue
        try:
            rid, req = parse_item(obj)
            items.append((n, rid if rid is not None else n, req, None))
        except (ValueError, protocol.ProtocolError) as e:
            items.append((n, rid, None, f"line {n}: {e}"))

    errors = 0
    worker = None
    t_start = time.perf_counter()
    with open(out_path, "a" if resume else "w", encoding="utf-8") as out:
        for i, (n, rid, req, problem) in enumerate(items, 1):
            if problem is None:
                if worker is None:
                    worker = WorkerClient(model, worker_args)
                    print(f"batch: worker ready ({worker.info.get('backend', '?')}, context {worker.max_context})",
                          file=log, flush=True)
                try:
                    res = worker.generate(req)
                except WorkerGone as e:
                    # The next prompt starts a fresh worker; this one is reported, not silently retried.
                    res = {"tokens": [], "error": str(e)}
                    worker = None
            else:
                res = {"tokens": [], "error": problem}
            result = {"id": rid, **res}
            out.write(json.dumps(result) + "\n")
            out.flush()
            if "error" in res:
                errors += 1
                print(f"batch: [{i}/{len(items)}] id={rid}: error: {res['error']}", file=log, flush=True)
            else:
                rate = res["generated"] / (res["decode_ms"] / 1000) if res["decode_ms"] > 0 else 0.0
                print(f"batch: [{i}/{len(items)}] id={rid}: {res['generated']} tokens ({res['finish']}), prompt "
                      f"{res['prompt']} ({res['reused']} reused) in {res['prompt_ms']:.0f} ms, decode "
                      f"{rate:.1f} tok/s", file=log, flush=True)
    if worker is not None:
        worker.close()
    print(f"batch: {len(items)} prompts, {errors} errors, {time.perf_counter() - t_start:.1f} s; results in "
          f"{out_path}", file=log, flush=True)
    return errors


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.batch", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="GGUF model for the worker")
    p.add_argument("input", help="JSONL prompts")
    p.add_argument("output", help="JSONL results (written as each prompt finishes)")
    p.add_argument("--ctx", type=int, help="the worker's --ctx")
    p.add_argument("--backend", choices=("cpu", "cuda", "auto"), help="the worker's --backend")
    p.add_argument("--resume", action="store_true", help="append to the output, skipping ids already in it")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra worker flag, passed as is (repeat; write --worker-arg=--flag)")
    a = p.parse_args(argv)
    wargs = list(a.worker_arg)
    if a.ctx:
        wargs += ["--ctx", str(a.ctx)]
    if a.backend:
        wargs += ["--backend", a.backend]
    if not Path(a.input).is_file():
        p.error(f"no input file {a.input}")
    try:
        errors = run_batch(a.model, a.input, a.output, wargs, a.resume)
    except WorkerGone as e:
        print(f"batch: the worker did not start: {e}", file=sys.stderr)
        return 2
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
