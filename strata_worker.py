"""The engine as a subprocess speaking the line protocol of docs/design.md (engine/protocol.py has the formats).

    python strata_worker.py --model M.gguf [--ctx N] [--backend cpu|cuda|auto] [--prompt-chunk N] [cuda flags]

stdout carries protocol lines only; everything a person reads goes to stderr. Exit status: 0 after QUIT or the end
of stdin, 2 for a bad model or a bad flag (one line on stderr), 1 when the engine breaks (the reason on stderr).

The CUDA engine plugs in through three names in engine/cuda/__init__.py, whose import needs no CuPy, so a machine
without CuPy still runs the CPU backend:
    add_cuda_args(parser)                      its own flags, added to this parser (must not import cupy)
    create_backend(model, max_context, args)   -> a Backend (engine/backend.py)
    available() -> (bool, reason)              whether a usable GPU is there
"""
from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
import time

ENGINE_VERSION = "0.1.0"


def log(msg: str) -> None:
    print(f"strata_worker: {msg}", file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line a person can act on, instead of argparse's usage block.
        print(f"strata_worker: {message} (see python strata_worker.py --help)", file=sys.stderr, flush=True)
        raise SystemExit(2)


def _cuda_module():
    """engine.cuda when it imports, else None and why."""
    try:
        import engine.cuda as cuda
    except Exception as e:  # ImportError for a missing CuPy, or anything the package raises while importing
        return None, f"engine.cuda does not import ({type(e).__name__}: {e})"
    return cuda, ""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="strata_worker.py", description="Strata engine worker (line protocol on stdin/stdout).")
    p.add_argument("--model", required=True, help="GGUF file (or the first file of a split set)")
    p.add_argument("--ctx", type=int, default=None,
                   help="context length in tokens (default: the model's training context, at most 4096)")
    p.add_argument("--backend", choices=("cpu", "cuda", "auto"), default="auto",
                   help="cpu: NumPy reference; cuda: the CuPy engine; auto: cuda when a GPU is usable")
    p.add_argument("--prompt-chunk", type=int, default=None, metavar="N",
                   help="read prompts in chunks of at most N tokens (default: the backend's own size)")
    cuda, _ = _cuda_module()
    if cuda is not None:
        cuda.add_cuda_args(p.add_argument_group("CUDA backend"))
    return p


def choose_backend(choice: str) -> tuple[str, str, str]:
    """(backend name, short reason for INFO, long reason for the log). Raises SystemExit(2) for cuda unavailable."""
    if choice == "cpu":
        return "cpu", "requested", "--backend cpu"
    cuda, why = _cuda_module()
    ok = False
    if cuda is not None:
        try:
            ok, why = cuda.available()
        except Exception as e:
            ok, why = False, f"checking for a GPU failed ({type(e).__name__}: {e})"
    if choice == "cuda":
        if not ok:
            print(f"strata_worker: --backend cuda is not usable here: {why}; use --backend cpu",
                  file=sys.stderr, flush=True)
            raise SystemExit(2)
        return "cuda", "requested", "--backend cuda"
    if ok:
        return "cuda", "gpu_found", f"auto: {why or 'CuPy finds a GPU'}"
    return "cpu", "no_usable_gpu", f"auto: {why}"


def _info_value(v) -> str:
    text = f"{v:.1f}" if isinstance(v, float) else str(v)
    return "_".join(text.split()) or "-"


class Protocol:
    """Protocol lines out (the original stdout), one flushed line each, from the main thread only."""

    def __init__(self):
        # Libraries that print (CuPy warnings, a stray print) must not corrupt the protocol: fd 1 becomes stderr,
        # and protocol lines go to a private duplicate of the original stdout.
        sys.stdout.flush()
        fd = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self.out = os.fdopen(fd, "w", encoding="utf-8", newline="\n")

    def emit(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()


class Input:
    """stdin on a thread of its own: GEN/QUIT go onto a queue in order; STOP sets the newest GEN's event at once."""

    def __init__(self, stream):
        self.queue: queue.Queue = queue.Queue()
        self._stream = stream
        self._last_event: threading.Event | None = None
        threading.Thread(target=self._loop, name="stdin", daemon=True).start()

    def _loop(self):
        try:
            for raw in self._stream:
                line = raw.decode("utf-8", "replace").strip()
                if not line:
                    continue
                head = line.split(" ", 1)[0]
                if head == "STOP":
                    # A STOP after its request's DONE sets a finished event: ignored, as the protocol says.
                    if self._last_event is not None:
                        self._last_event.set()
                elif head == "GEN":
                    ev = threading.Event()
                    self._last_event = ev
                    self.queue.put(("GEN", line, ev))
                elif head == "QUIT":
                    self.queue.put(("QUIT", line, None))
                    return
                else:
                    self.queue.put(("BAD", line, None))
        except Exception as e:
            log(f"reading stdin failed: {type(e).__name__}: {e}")
        # End of stdin: answer what is queued, then exit as for QUIT.
        self.queue.put(("EOF", "", None))


# Keys setup/calibrate.py takes from the backend's INFO facts when the backend measured them.
CALIBRATE_FROM_INFO = ("gpu", "vram_total_mib", "vram_free_mib", "pcie_gbps", "hbm_gbps", "expert_slots",
                       "experts_total", "arena_mib")


def run_calibration(backend, ctx: int, out, info: dict) -> int:
    """--calibrate (setup/calibrate.py's contract): time a prompt pass and a greedy decode, print CALIBRATE lines
    with those rates and the backend's measured facts, then exit without serving."""
    import shlex

    import numpy as np

    from engine.protocol import GenRequest
    from engine.session import Session

    n_vocab = int(backend.config.n_vocab)
    n_new = min(64, max(1, (ctx - 8) // 4))
    n_prompt = max(2, min(512, ctx - 8 - n_new - 1))
    rng = np.random.default_rng(0)
    # No end-of-generation ids: the decode must run its full length to be timed.
    session = Session(backend, eog_ids=())
    runs = []
    try:
        # A short warm-up first, so kernel loads and graph capture are not timed.
        for prompt_len, max_new in ((min(16, n_prompt), min(4, n_new)), (n_prompt, n_new)):
            prompt = [int(t) for t in rng.integers(0, n_vocab, prompt_len)]
            done = session.run(GenRequest(max_new, prompt), lambda line: None)
            if done is None:
                raise RuntimeError("a calibration request was refused")
            runs.append(done)
            session.tokens = []
            backend.truncate(0)
    except Exception as e:  # whatever failed, setup shows this line and the log
        print(f"strata_worker: calibration failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        backend.close()
        return 1
    d = runs[-1]
    # The first token comes out of the prompt pass; the decode time covers the other generated - 1.
    decode_tok_s = (d.generated - 1) / (d.decode_ms / 1000.0) if d.decode_ms > 0 and d.generated > 1 else 0.0
    prompt_tok_s = d.prompt_read / (d.prompt_ms / 1000.0) if d.prompt_ms > 0 else 0.0
    facts = {k: info[k] for k in CALIBRATE_FROM_INFO if k in info}
    facts.update(prompt_tok_s=round(prompt_tok_s, 1), decode_tok_s=round(decode_tok_s, 1),
                 calib_prompt_tokens=d.prompt_read, calib_decode_tokens=d.generated)
    out.emit("CALIBRATE " + " ".join(f"{k}={shlex.quote(_calib_value(v))}" for k, v in facts.items()))
    log(f"calibration: prompt {prompt_tok_s:.1f} tok/s ({d.prompt_read} tokens), decode {decode_tok_s:.1f} tok/s "
        f"({d.generated} tokens)")
    backend.close()
    return 0


def _calib_value(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def emit_cache_picture(backend, out) -> None:
    """The CACHE line after a DONE, for backends with an expert cache. It is a picture for the Monitor, so a
    failure to draw it is logged, never allowed to stop the worker serving."""
    from engine import protocol
    try:
        pic = backend.cache_picture()
        if pic is None:
            return
        import numpy as np
        n_layer, n_expert, resident, heat = pic
        line = protocol.format_cache(n_layer, n_expert, np.asarray(resident, bool).ravel(),
                                     np.asarray(heat, np.uint8).ravel().tobytes())
    except Exception as e:
        log(f"warning: no CACHE line: the backend's cache picture failed ({type(e).__name__}: {e})")
        return
    out.emit(line)


def _next_command(inp):
    # A timed wait: the OS may deliver SIGTERM to another thread (CUDA's driver threads), and Python runs its handler
    # only when the main thread wakes up, so an untimed get() could sleep through the server's SIGTERM.
    while True:
        try:
            return inp.queue.get(timeout=0.5)
        except queue.Empty:
            pass


def main(argv=None) -> int:
    out = Protocol()
    # SIGTERM (the server's second try after QUIT) unwinds like QUIT: backend.close() saves the expert profile.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = build_parser().parse_args(argv)
    if args.ctx is not None and args.ctx < 16:
        print(f"strata_worker: --ctx {args.ctx} is too small; use at least 16 (or leave it out)", file=sys.stderr)
        return 2
    if args.prompt_chunk is not None and args.prompt_chunk < 1:
        print(f"strata_worker: --prompt-chunk must be at least 1, got {args.prompt_chunk}", file=sys.stderr)
        return 2
    if args.backend != "cpu":
        from engine.cuda.args import check_cuda_args
        bad = check_cuda_args(args)
        if bad:
            print(f"strata_worker: {bad}", file=sys.stderr)
            return 2

    from engine.gguf_model import ModelError, open_model
    from engine.session import BackendBroken, Session
    from engine import protocol

    t0 = time.perf_counter()
    backend_name, reason_short, reason_long = choose_backend(args.backend)
    try:
        model = open_model(args.model)
        cfg = model.config
        n_ctx_train = int(getattr(cfg, "n_ctx_train", 0) or 0)
        ctx = args.ctx if args.ctx is not None else min(n_ctx_train or 4096, 4096)
        if n_ctx_train and ctx > n_ctx_train:
            log(f"warning: --ctx {ctx} is beyond the model's training context {n_ctx_train}; quality may drop")
        if backend_name == "cpu":
            from engine.backend_cpu import CPUBackend
            backend = CPUBackend(model, ctx)
        else:
            cuda, _ = _cuda_module()
            backend = cuda.create_backend(model, ctx, args)
    except ModelError as e:
        print(f"strata_worker: {e}", file=sys.stderr, flush=True)
        return 2
    except OSError as e:
        print(f"strata_worker: cannot open {args.model}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        import traceback
        traceback.print_exc()
        hint = "; --backend cpu runs the NumPy engine instead" if backend_name == "cuda" else ""
        print(f"strata_worker: starting the {backend_name} backend failed: {type(e).__name__}: {e}{hint}",
              file=sys.stderr, flush=True)
        return 1

    from engine.tokenizer import eog_ids_from_metadata
    eog = eog_ids_from_metadata(model.metadata)
    if not eog:
        log("warning: the model declares no end-of-generation token; requests end only at max_new")
    chunk = backend.prompt_chunk_size()
    if args.prompt_chunk:
        chunk = min(chunk, args.prompt_chunk)
    session = Session(backend, eog, prompt_chunk=chunk)
    log(f"backend {backend_name} ({reason_long})")
    log(f"loaded {args.model} ({cfg.arch}, {cfg.n_layer} layers, context {ctx}) in "
        f"{time.perf_counter() - t0:.1f} s; end-of-generation ids {sorted(eog)}")

    out.emit(protocol.format_info(
        engine=ENGINE_VERSION, backend=backend_name, backend_reason=reason_short, arch=cfg.arch,
        n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, n_vocab=cfg.n_vocab,
        n_ctx_train=n_ctx_train, ctx=ctx, n_expert=getattr(cfg, "n_expert", 0) or 0,
        n_expert_used=getattr(cfg, "n_expert_used", 0) or 0, prompt_chunk=chunk,
        eog=",".join(str(i) for i in sorted(eog)) or "-"))
    extra = backend.info()
    if extra:
        out.emit("INFO " + " ".join(f"{k}={_info_value(v)}" for k, v in extra.items()))
    if getattr(args, "calibrate", False):
        return run_calibration(backend, ctx, out, extra)
    out.emit(f"READY {ctx} stop")

    # A private reader on a duplicate of fd 0: a daemon thread blocked on sys.stdin's own buffer would make the
    # interpreter abort at exit (it cannot take that buffer's lock to close it).
    inp = Input(open(os.dup(0), "rb"))
    status = 0
    try:
        while True:
            what, line, ev = _next_command(inp)
            if what in ("QUIT", "EOF"):
                break
            if what == "BAD":
                out.emit(protocol.format_err(f"unknown command {line[:40]!r}: expected GEN, STOP or QUIT"))
                continue
            try:
                req = protocol.parse_gen(line)
            except protocol.ProtocolError as e:
                out.emit(protocol.format_err(str(e)))
                continue
            try:
                done = session.run(req, out.emit, ev)
            except BackendBroken as e:
                print(f"strata_worker: the engine broke and exits: {e}", file=sys.stderr, flush=True)
                status = 1
                break
            if done is not None:
                emit_cache_picture(backend, out)
    except BrokenPipeError:
        log("stdout closed (the server went away); exiting")
        status = 1
    except KeyboardInterrupt:
        log("interrupted; exiting")
        status = 130
    finally:
        try:
            backend.close()
        except Exception as e:
            print(f"strata_worker: closing the backend failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            status = status or 1
    return status


if __name__ == "__main__":
    sys.exit(main())
