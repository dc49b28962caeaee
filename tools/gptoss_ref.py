"""llama.cpp's outputs for a model, as the fixtures in ../shared/fixtures/reference/ hold them (their README).

    /tmp/llamavenv/bin/python -m tools.gptoss_ref MODEL.gguf OUT.json --prompts 0:40,1:90 [--steps 24]

Runs under a Python with llama-cpp-python (the low-level API only; no engine import, so no gguf package needed).
Each prompt is `seed:length` random token ids below the first control token (deterministic), evaluated in one batch,
then llama.cpp's greedy continuation one token at a time; at every step the top-10 [id, logit] and the top-1/top-2
margin. A minimal stand-in for the team's generic reference tool, kept to what the gpt-oss fixtures need.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys
from pathlib import Path

import numpy as np


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run(model_path: Path, prompts: list[list[int]], steps: int, threads: int) -> list[dict]:
    import llama_cpp as L
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(model_path).encode(), mp)
    if not model:
        raise SystemExit(f"gptoss_ref: llama.cpp could not load {model_path}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cp = L.llama_context_default_params()
    cp.n_ctx = max(len(p) for p in prompts) + steps + 16
    cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(512, 0, 1)

    def decode(tokens, pos0):
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(tokens) - 1
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("gptoss_ref: llama_decode failed")
        ptr = L.llama_get_logits_ith(ctx, len(tokens) - 1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float64).copy()

    cases = []
    for prompt in prompts:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        logits = decode(prompt, 0)
        greedy, rows = [], []
        for s in range(steps):
            order = np.argsort(-logits, kind="stable")[:10]
            rows.append({"top": [[int(i), round(float(logits[i]), 5)] for i in order],
                         "margin": round(float(logits[order[0]] - logits[order[1]]), 5)})
            greedy.append(int(order[0]))
            if s + 1 < steps:
                logits = decode([greedy[-1]], len(prompt) + s)
        cases.append({"prompt_ids": prompt, "greedy_ids": greedy, "steps": rows})
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return cases


def prompt_ids(spec: str, n_text: int) -> list[int]:
    seed, n = (int(x) for x in spec.split(":"))
    return np.random.default_rng(seed).integers(0, n_text, n).tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gptoss_ref")
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--prompts", default="0:40,1:90", help="seed:length,... (random ids of the text tokens)")
    ap.add_argument("--n-text", type=int, default=1021, help="ids below this are text tokens (tiny-bpe-1024's)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tolerance", type=json.loads, default={}, help="a JSON object stored as the file's tolerance")
    args = ap.parse_args(argv)
    prompts = [prompt_ids(s, args.n_text) for s in args.prompts.split(",")]
    cases = run(args.model, prompts, args.steps, args.threads)
    import llama_cpp
    out = {"model_file": args.model.name, "model_sha256": sha256(args.model),
           "made_with": f"llama.cpp as vendored by llama-cpp-python {llama_cpp.__version__}, CPU build, "
                        f"{args.threads} threads, n_batch 512, default context (F16 KV cache): prompt evaluated in "
                        f"one batch, then one token at a time (greedy)",
           "tolerance": args.tolerance, "cases": cases}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"gptoss_ref: {len(cases)} cases, {args.steps} steps each -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
