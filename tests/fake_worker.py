"""A stand-in worker speaking the line protocol (docs/design.md: protocol), with misbehaviours chosen by flags.

Its answer is a function of the prompt: the prompt's own ids again, in order (repeated if max_new is larger), so a
test can tell whose tokens a client received. Finish `stop` after len(prompt) tokens, `length` at max_new.

    python tests/fake_worker.py --model M.gguf [--ctx N] [--chunk N] [--pp-delay S] [--token-delay S]
        [--silent-after-tokens N] [--silent-in-prompt] [--ignore-stop] [--die-in-prompt] [--exit-before-ready]
        [--moe] [--load-delay S] [--ignore-quit] [--die-on-gen N] [--die-in-prompt-of-gen N] [--plan FILE]
        [--expert-profile P] [--expert-profile-save P] [--expert-profile-save-every MIN]
        [--fault KIND [--fault-gen N]] [--logprobs-mode ok|missing] [--replies FILE]

As the CUDA worker does, it narrates its start (INFO phase=loading/arena/cache/ready) and, with --moe, saves an expert
profile at QUIT (--expert-profile-save: its experts ranked by the prompt ids it read, hottest first) and loads one
at start (--expert-profile: INFO expert_profile=P profile_top=<layer*n_expert+expert of the hottest>).

--fault KIND: on the Nth GEN (default every GEN) break the protocol in one way (FAULTS lists them), then carry on
as if nothing happened, as a buggy worker would.

--plan FILE: a JSON list of flag strings, one per start (the last one repeats); the start count is kept in
FILE.count, so a test can make the first start misbehave and the restarted worker behave.
--replies FILE: a JSON list of id lists, the answer to each GEN in turn (the last one repeats) instead of the
prompt's ids, each ending with finish `stop` as at an end-of-generation token: a scripted model.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine import protocol  # noqa: E402

N_LAYER, N_EXPERT = 4, 16
# Protocol faults: the line written in place of (or beside) the third token, or what happens around DONE.
FAULTS = {
    "t-not-a-number": "T abc", "bare-t": "T", "short-pp": "PP 1 2", "short-done": "DONE 1 2", "oov": "T 999999",
    "garbage": "HELLO world", "ready-again": "READY 4096 stop", "early-done": None, "wrong-req-done": None,
    "no-req": None, "tokens-after-done": None, "bad-cache": None, "bad-info": None, "count-mismatch": None,
    "resume-twice": None, "nan-logprob": None, "truncated-t": None,
}


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def log(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def hang() -> None:
    # Silent but alive, as a stuck engine would be; it never reads stdin again.
    while True:
        time.sleep(3600)


def cache_line(step: int) -> str:
    n = N_LAYER * N_EXPERT
    resident = [((i * 7 + step) % 5) < 2 for i in range(n)]
    heat = bytes((i * 37 + step * 11) % 256 for i in range(n))
    return protocol.format_cache(N_LAYER, N_EXPERT, resident, heat)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--pp-delay", type=float, default=0.0)
    ap.add_argument("--token-delay", type=float, default=0.0)
    ap.add_argument("--load-delay", type=float, default=0.0)
    ap.add_argument("--silent-after-tokens", type=int, default=-1)
    ap.add_argument("--silent-in-prompt", action="store_true")
    ap.add_argument("--ignore-stop", action="store_true")
    ap.add_argument("--answer-len", type=int, default=0,
                    help="end each pass after N tokens (finish stop, as at an end-of-generation token), STOP or not")
    ap.add_argument("--die-in-prompt", action="store_true")
    ap.add_argument("--die-in-prompt-of-gen", type=int, default=0, help="die while reading the Nth GEN's prompt")
    ap.add_argument("--exit-before-ready", action="store_true")
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--die-on-gen", type=int, default=0, help="exit when the Nth GEN arrives, before answering it")
    ap.add_argument("--ignore-quit", action="store_true", help="ignore QUIT, stdin's end and SIGTERM")
    ap.add_argument("--plan")
    ap.add_argument("--expert-profile")
    ap.add_argument("--expert-profile-save")
    ap.add_argument("--expert-profile-save-every", type=float)
    ap.add_argument("--fault", choices=sorted(FAULTS))
    ap.add_argument("--fault-gen", type=int, default=0, help="the GEN the fault hits (0: every one)")
    ap.add_argument("--chaos", type=float, default=0.0,
                    help="each GEN meets a random fault (or an exit, or a hang) with this probability")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--replies")
    a = ap.parse_args()
    if a.plan:
        count_file = Path(a.plan + ".count")
        n = int(count_file.read_text()) if count_file.exists() else 0
        count_file.write_text(str(n + 1))
        plan = json.loads(Path(a.plan).read_text())
        a = ap.parse_args(sys.argv[1:] + shlex.split(plan[min(n, len(plan) - 1)]))
    if a.ignore_quit:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    log(f"fake worker pid {os.getpid()}: loading {a.model}")
    if a.exit_before_ready:
        for i in range(30):
            log(f"loading step {i}")
        log("error: cannot open the model: this fake worker was told to fail")
        return 2
    out(protocol.format_phase("loading"))
    time.sleep(a.load_delay)
    out(protocol.format_info(engine="fake", pid=os.getpid(), backend="fake", prompt_chunk=a.chunk,
                             arch="fakemoe" if a.moe else "fake", n_expert=N_EXPERT if a.moe else 0))
    if a.moe:
        out(protocol.format_phase("arena", done=1.0, gib=0.5, gib_s=10.0))
        if a.expert_profile:
            from engine.profile import load_profile
            prof = load_profile(a.expert_profile, N_LAYER, N_EXPERT)
            out(protocol.format_info(expert_profile=a.expert_profile, profile_top=int(prof.flat_order()[0])))
            out(protocol.format_phase("cache", done=1.0, gib=0.1))
    out(protocol.format_phase("ready"))
    if a.moe:
        out(cache_line(0))
    out(f"READY {a.ctx} stop")

    gens: queue.Queue = queue.Queue()
    stop = threading.Event()
    seen: list[int] = []       # prompt ids read, the "routing" a saved profile ranks

    def save_profile():
        if not (a.moe and a.expert_profile_save):
            return
        from engine.profile import from_flat, save_profile as save
        n = N_LAYER * N_EXPERT
        order = list(dict.fromkeys(t % n for t in seen)) + [g for g in range(n) if g not in {t % n for t in seen}]
        save(a.expert_profile_save, from_flat(N_LAYER, N_EXPERT, order))
        log(f"fake worker: expert profile saved to {a.expert_profile_save}")

    def read_stdin():
        for line in sys.stdin:
            line = line.strip()
            if line == "STOP":
                stop.set()
            elif line == "QUIT" and not a.ignore_quit:
                break
            elif line.startswith("GEN"):
                gens.put(line)
        log("fake worker: QUIT")
        if a.ignore_quit:
            hang()
        save_profile()
        os._exit(0)

    threading.Thread(target=read_stdin, daemon=True).start()
    held: list[int] = []
    import random
    rng = random.Random(a.seed)
    step = n_gen = 0
    while True:
        line = gens.get()
        stop.clear()
        n_gen += 1
        if n_gen == a.die_on_gen:
            log("fake worker: exiting before it answers this GEN")
            os._exit(3)
        try:
            req = protocol.parse_gen(line)
        except protocol.ProtocolError as e:
            out(protocol.format_err(str(e), protocol.gen_req_number(line)))
            continue
        if len(req.prompt) + req.max_new + 8 > a.ctx:
            out(protocol.format_err(f"prompt {len(req.prompt)} + max_new {req.max_new} + 8 exceeds the context {a.ctx}",
                                    req.req))
            continue
        seen.extend(req.prompt)
        answer = req.prompt
        if a.replies:
            replies = json.loads(Path(a.replies).read_text())
            answer = replies[min(n_gen, len(replies)) - 1]
        log(f"fake worker: GEN max_new={req.max_new} params={json.dumps(req.params, sort_keys=True)} prompt={','.join(map(str, req.prompt))}"
            + (f" grammar={req.grammar}" if req.grammar else ""))
        fault = a.fault if a.fault and a.fault_gen in (0, n_gen) else None
        if a.chaos and rng.random() < a.chaos:
            fault = rng.choice(sorted(FAULTS) + ["die", "hang"])
            log(f"fake worker: chaos: {fault}")
        no = None if fault == "no-req" else req.req
        if fault == "wrong-req-done":
            no = (req.req or 0) + 1

        def tline(tok):
            if req.logprobs is None:
                return f"T {tok}"
            lp = "nan" if fault == "nan-logprob" else "-0.5000"
            return f"T {tok} {lp} " + (",".join(f"{tok}:-0.5000" for _ in range(req.logprobs)) or "-")
        reused = 0
        while reused < min(len(held), len(req.prompt) - 1) and held[reused] == req.prompt[reused]:
            reused += 1
        out(protocol.with_req(f"RESUME {reused}", no if fault != "wrong-req-done" else req.req))
        if fault == "resume-twice":
            out(protocol.with_req(f"RESUME {reused}", no))
        t0 = time.monotonic()
        pos, cancelled = reused, False
        while pos < len(req.prompt):
            if stop.is_set() and not a.ignore_stop:
                cancelled = True
                break
            time.sleep(a.pp_delay)
            pos = min(len(req.prompt), pos + a.chunk)
            ms = (time.monotonic() - t0) * 1000
            out(protocol.format_pp(pos, len(req.prompt), ms, (pos - reused) / max(ms, 1e-3) * 1000))
            if a.die_in_prompt or n_gen == a.die_in_prompt_of_gen:
                log("CUDA error: out of memory")
                log("Killed")
                os._exit(137)
            if a.silent_in_prompt:
                hang()
        prompt_ms = (time.monotonic() - t0) * 1000
        held = req.prompt[:pos]
        generated, finish = 0, "cancel" if cancelled else None
        if not cancelled:
            out(f"REUSED {reused}")
        t1 = time.monotonic()
        while finish is None:
            if stop.is_set():
                if a.ignore_stop:
                    # Never acknowledges: keeps talking, never DONE (the server must kill it).
                    while True:
                        time.sleep(a.token_delay or 0.05)
                        out(tline(req.prompt[0]))
                finish = "cancel"
                break
            if generated == a.silent_after_tokens:
                hang()
            if generated >= req.max_new:
                finish = "length"
                break
            if generated >= (a.answer_len or len(answer)):
                finish = "stop"
                break
            time.sleep(a.token_delay)
            if generated == 2 and fault:
                if fault == "die":
                    os._exit(1)
                elif fault == "hang":
                    hang()
                elif FAULTS[fault]:
                    out(FAULTS[fault])
                elif fault == "early-done":
                    out(protocol.with_req(protocol.format_done(protocol.Done(generated, len(req.prompt), 1.0, 1.0,
                                                                             "stop")), no))
                elif fault == "bad-cache":
                    out("CACHE 4 16 zz 00")
                elif fault == "bad-info":
                    out("INFO prompt_chunk=abc n_vocab= =x")
                elif fault == "truncated-t":
                    # dies while writing the third token's line: the line without its newline, then EOF
                    sys.stdout.write(tline(answer[generated % len(answer)]))
                    sys.stdout.flush()
                    os._exit(1)
            out(tline(answer[generated % len(answer)]))
            generated += 1
        decode_ms = (time.monotonic() - t1) * 1000
        lookups = generated * 8 if a.moe else 0
        out(protocol.with_req(protocol.format_done(protocol.Done(
            generated=generated + (fault == "count-mismatch"), prompt=len(req.prompt), prompt_ms=prompt_ms, decode_ms=decode_ms, finish=finish,
            reused=reused, hits=lookups * 3 // 4, lookups=lookups, prompt_read=pos - reused,
            # as a worker in a memory mode: one expert a token from the file, the other misses from pinned RAM
            ram_blobs=lookups - lookups * 3 // 4 - generated if a.moe else 0, file_blobs=generated if a.moe else 0,
            file_mb=2.5 * generated if a.moe else 0.0)), no))
        if fault == "tokens-after-done":
            for tok in req.prompt[:4]:       # a worker that runs ahead of its own DONE: the next request must not see these
                out(f"T {tok}")
        step += 1
        if a.moe:
            out(cache_line(step))


if __name__ == "__main__":
    sys.exit(main())
