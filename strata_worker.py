"""The engine as a subprocess speaking the line protocol of docs/design.md (engine/protocol.py has the formats).

    python strata_worker.py --model M.gguf [--ctx N] [--backend cpu|cuda|auto] [--prompt-chunk N]
        [--checkpoint-every N] [--checkpoint-mib M] [--draft off|ngram|mtp|auto] [--draft-window N] [--draft-fixed]
        [--draft-sampled] [cuda flags: --gpus auto|I,J --layer-split auto|N,M --show-split ...]

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
    # A Qwen3-Next-80B checkpoint in float32 is ~75 MiB (36 GDN layers, each 32 value heads of 128x128 and a conv
    # window of 3 x 8192): the default budget keeps about 13.
    p.add_argument("--checkpoint-every", type=int, default=1024, metavar="N",
                   help="models with recurrent layers (qwen3next, qwen35moe, qwen4exp): snapshot their state every N "
                        "prompt tokens for prefix reuse, besides near each prompt's end and at each request's end "
                        "(0: only those two; default 1024)")
    p.add_argument("--checkpoint-mib", type=float, default=1024.0, metavar="M",
                   help="host memory for those snapshots; the least useful go first (0: none, so a conversation "
                        "resumes only where the previous request ended; default 1024)")
    p.add_argument("--draft", choices=("off", "ngram", "mtp", "auto"), default="off",
                   help="speculative decoding (engine/speculate.py): verify windows of draft tokens from the prompt "
                        "and the answer so far (ngram), from the model's MTP block (mtp: qwen3next / qwen35moe "
                        "files, cpu backend), or mtp where it runs, else ngram (auto); the output is the same "
                        "token for token (default off)")
    p.add_argument("--draft-sampled", action="store_true",
                   help="with mtp drafts on the cpu backend: a request that samples gets drafts drawn from the MTP "
                        "block's distribution, judged by the speculative rule (more accepted; the output follows "
                        "the model's distribution, but a seed draws other tokens than without drafts)")
    p.add_argument("--draft-window", type=int, default=8, metavar="N",
                   help="the longest verify window, in tokens (2..8; the window rule picks each one's length from "
                        "the measured acceptance; default 8)")
    p.add_argument("--draft-fixed", action="store_true",
                   help="every verify window --draft-window tokens long, whatever the acceptance (tests, benches: "
                        "on the cpu backend a window costs one step a token, so the rule offers no drafts there)")
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
                       "experts_total", "arena_mib", "prefetch")


# Tokens decoded over the --calibrate-chats prompts: the settled speed came after ~1,500 tokens through the server at a
# 12 GiB budget (issue 22: 46..192 tok/s over the first seven 256-token answers); a few hundred here fill the profile
# with the routing of real text, so a restart's first answer starts near it.
CALIBRATE_CHAT_TOKENS = 512


def run_calibration(backend, ctx: int, out, info: dict, chats_path: str | None = None) -> int:
    """--calibrate (setup/calibrate.py's contract): time a prompt pass and a greedy decode, then decode the typical
    chats of --calibrate-chats (the adaptive tier learns from them; backend.close() saves the profile), print
    CALIBRATE lines with the rates and the backend's measured facts, and exit without serving."""
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
    if "expert_slots" in info and "experts_total" in info:
        facts["why"] = (f"{info['expert_slots']} of {info['experts_total']} experts fit in VRAM at context {ctx}; "
                        f"decode prefetch {info.get('prefetch', 'off')}; token embedding in {info.get('embed', '?')}")
    if chats_path:
        try:
            facts.update(decode_chats(session, backend, chats_path, ctx))
        except Exception as e:
            print(f"strata_worker: calibration failed while decoding the chats of {chats_path}: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
            backend.close()
            return 1
    if facts.get("pcie_gbps") and getattr(backend.config, "is_moe", False):
        try:
            facts.update(calibrate_cpu(backend, facts))
        except Exception as e:
            print(f"strata_worker: calibration failed while timing the CPU experts: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            backend.close()
            return 1
    out.emit("CALIBRATE " + " ".join(f"{k}={shlex.quote(_calib_value(v))}" for k, v in facts.items()))
    log(f"calibration: prompt {prompt_tok_s:.1f} tok/s ({d.prompt_read} tokens), decode {decode_tok_s:.1f} tok/s "
        f"({d.generated} tokens)")
    backend.close()
    return 0


def calibrate_cpu(backend, facts: dict) -> dict:
    """The CPU experts' rate beside the link's and the split they give (engine/cpu_calibrate.py), on the experts
    where the backend keeps them; the hit rate is the chats' when they ran, else the share of experts cached."""
    from engine.cpu_calibrate import cpu_facts
    hit = facts.get("chat_hit_pct")
    if hit is not None:
        hit = float(hit) / 100.0
    elif facts.get("experts_total"):
        hit = min(1.0, float(facts.get("expert_slots", 0)) / float(facts["experts_total"]))
    else:
        hit = 0.0
    opts = getattr(backend, "opts", None)
    return cpu_facts(backend.model, float(facts["pcie_gbps"]), getattr(backend, "arena", None),
                     getattr(opts, "cpu_threads", None), hit)


def decode_chats(session, backend, path: str, ctx: int) -> dict:
    """Decode CALIBRATE_CHAT_TOKENS tokens in all over the prompts in `path`; the warm decode rate and hit rate."""
    import json

    from engine.protocol import CONTEXT_MARGIN, GenRequest

    prompts = json.loads(open(path, encoding="utf-8").read())
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, list) and p for p in prompts)):
        raise ValueError("expected a JSON list of non-empty lists of token ids")
    per = max(1, CALIBRATE_CHAT_TOKENS // len(prompts))
    generated = decode_ms = hits = lookups = 0
    for prompt in prompts:
        ids = [int(t) for t in prompt][-(ctx - per - CONTEXT_MARGIN):]
        done = session.run(GenRequest(per, ids), lambda line: None)
        if done is None:
            raise RuntimeError("a chat was refused")
        generated += done.generated - 1
        decode_ms += done.decode_ms
        hits, lookups = hits + done.hits, lookups + done.lookups
        session.tokens = []
        backend.truncate(0)
    out = {"chat_decode_tokens": generated}
    if decode_ms > 0:
        out["chat_decode_tok_s"] = round(generated / (decode_ms / 1000.0), 1)
    if lookups:
        out["chat_hit_pct"] = round(100.0 * hits / lookups, 1)
    return out


def _calib_value(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def drop_unusable_own_profile(args, cfg) -> None:
    """The server passes the profile this worker saved last time (--expert-profile P with --expert-profile-save P).
    When that file cannot serve this model (damaged, or made for another one under the same name), start with an
    empty cache and learn a new one, rather than never starting again; a profile named on its own still stops the
    start with its message."""
    path = getattr(args, "expert_profile", None)
    if not path or path != getattr(args, "expert_profile_save", None) or not getattr(cfg, "n_expert", 0):
        return
    from engine.profile import ProfileError, load_profile
    try:
        load_profile(path, cfg.n_layer, cfg.n_expert)
    except ProfileError as e:
        log(f"warning: not loading the saved expert profile ({e}); the cache starts empty and learns a new one, "
            f"which replaces it at QUIT")
        args.expert_profile = None


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
    if not 2 <= args.draft_window <= 8:
        print(f"strata_worker: --draft-window must be 2 to 8 tokens, got {args.draft_window}", file=sys.stderr)
        return 2
    if args.checkpoint_every < 0 or not args.checkpoint_mib >= 0:
        print(f"strata_worker: --checkpoint-every and --checkpoint-mib must be 0 or more, got "
              f"{args.checkpoint_every} and {args.checkpoint_mib}", file=sys.stderr)
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

    def phase(name, done=None, gib=None, gib_s=None):
        out.emit(protocol.format_phase(name, done, gib, gib_s))

    try:
        model = open_model(args.model)
        cfg = model.config
        from engine.supported import runs_on
        if backend_name == "cuda" and not runs_on(cfg.arch, "cuda", preview=True):
            if args.backend == "cuda":
                print(f"strata_worker: the CUDA backend does not run {cfg.arch} yet; use --backend cpu",
                      file=sys.stderr, flush=True)
                return 2
            backend_name, reason_short = "cpu", "arch_cpu_only"
            reason_long = f"auto: a GPU is here, but the CUDA backend does not run {cfg.arch} yet"
        gpu_flags = [f for f, v in (("--gpus", getattr(args, "gpus", None)),
                                    ("--layer-split", getattr(args, "layer_split", None)),
                                    ("--show-split", getattr(args, "show_split", None))) if v]
        if backend_name == "cpu" and gpu_flags:
            print(f"strata_worker: {' and '.join(gpu_flags)} choose GPUs for the CUDA backend, and this worker runs "
                  f"the CPU backend ({reason_long}); drop {'them' if len(gpu_flags) > 1 else 'it'}",
                  file=sys.stderr, flush=True)
            return 2
        phase("loading")    # after the header checks: a file refused at once leaves stdout empty
        n_ctx_train = int(getattr(cfg, "n_ctx_train", 0) or 0)
        ctx = args.ctx if args.ctx is not None else min(n_ctx_train or 4096, 4096)
        if n_ctx_train and ctx > n_ctx_train:
            log(f"warning: --ctx {ctx} is beyond the model's training context {n_ctx_train}; quality may drop")
        if backend_name == "cpu":
            from engine.backend_cpu import CPUBackend
            backend = CPUBackend(model, ctx)
        else:
            cuda, _ = _cuda_module()
            drop_unusable_own_profile(args, cfg)
            from engine.cuda.gpus import before_start
            status = before_start(args, model, ctx, log)     # --gpus / --layer-split: the GPU, or the plan
            if status is not None:
                return status
            backend = cuda.create_backend(model, ctx, args, phase=phase)
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
    from engine.grammar import Grammars
    from engine.tokenizer import Tokenizer
    grammars = Grammars(lambda: Tokenizer.from_metadata(model.metadata), eog)   # llguidance's vocabulary, on first use
    from engine.drafters import DraftError, make_drafter
    from engine.speculate import FixedWindow
    try:
        drafter = make_drafter(args.draft, backend, model, sampled=args.draft_sampled)
    except DraftError as e:
        print(f"strata_worker: {e}", file=sys.stderr, flush=True)
        backend.close()
        return 2
    session = Session(backend, eog, prompt_chunk=chunk, grammars=grammars, checkpoint_every=args.checkpoint_every,
                      checkpoint_mib=args.checkpoint_mib, drafter=drafter, max_window=args.draft_window,
                      rule=FixedWindow(args.draft_window) if args.draft_fixed else None)
    if drafter is not None:
        log(f"speculative decoding: {drafter.name} drafts, windows of up to {args.draft_window} tokens")
    if session.checkpoints is not None:
        log(f"recurrent state: {backend.state_bytes() / 2**20:.1f} MiB a checkpoint, every "
            f"{args.checkpoint_every or '-'} prompt tokens, within {args.checkpoint_mib:g} MiB")
    log(f"backend {backend_name} ({reason_long})")
    log(f"loaded {args.model} ({cfg.arch}, {cfg.n_layer} layers, context {ctx}) in "
        f"{time.perf_counter() - t0:.1f} s; end-of-generation ids {sorted(eog)}")

    out.emit(protocol.format_info(
        engine=ENGINE_VERSION, backend=backend_name, backend_reason=reason_short, arch=cfg.arch,
        n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, n_vocab=cfg.n_vocab,
        n_ctx_train=n_ctx_train, ctx=ctx, n_expert=getattr(cfg, "n_expert", 0) or 0,
        n_expert_used=getattr(cfg, "n_expert_used", 0) or 0, prompt_chunk=chunk,
        eog=",".join(str(i) for i in sorted(eog)) or "-", draft=drafter.name if drafter is not None else "off"))
    extra = backend.info()
    if extra:
        out.emit("INFO " + " ".join(f"{k}={_info_value(v)}" for k, v in extra.items()))
    if getattr(args, "calibrate", False):
        return run_calibration(backend, ctx, out, extra, getattr(args, "calibrate_chats", None))
    phase("ready")
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
                out.emit(protocol.format_err(str(e), protocol.gen_req_number(line)))
                continue
            # RESUME, DONE and ERR carry the request's number (engine/protocol.py), so the server can tell them apart.
            emit = out.emit if req.req is None else (lambda ln, n=req.req: out.emit(protocol.with_req(ln, n)))
            try:
                done = session.run(req, emit, ev)
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
