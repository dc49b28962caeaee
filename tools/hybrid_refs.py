"""llama.cpp's outputs for the tiny hybrid models (tests/fixtures/hybrid/), through llama_cpp's low-level API.

Two steps, in two Pythons:

    python -m tools.hybrid_refs choose --model M.gguf --out prompts.json        # the project's venv
    /tmp/llamavenv/bin/python -m tools.hybrid_refs run --model M.gguf --prompts prompts.json --out M.json \
        [--quantize Q4_K_M --quant-out Q.gguf]                                  # the one with llama-cpp-python

`choose` draws random prompts (seed 0, 1, ...) until the engine's own greedy run of each sees no router near-tie
(the k-th and (k+1)-th expert logits closer than --min-gap): llama.cpp rounds activations to fp16 (F16 weights) or
8 bits (quantized), which flips such a tie, and a recurrent state then carries the other expert's output into every
later token (measured: a 1e-4 gap in layer 0 moved the tiny qwen3next's logits by 0.4 forty tokens later).

With --quantize, M.gguf is first quantized by llama-quantize's recipe (llama_model_quantize) into --quant-out and
the references are taken on that file. For each case: the prompt in one batch (n_batch = n_ubatch = 512, so a
300-token prompt goes through llama.cpp's chunked GDN path), then greedy decoding one token at a time (the
autoregressive path); at every step the top-10 [id, logit] and the top-1/top-2 margin. The same layout as
../shared/fixtures/reference/*.json. (tools/llama_ref.py, when merged from w/fixtures, does this for any model.)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

RECIPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q3_K_M", "Q2_K", "IQ4_XS", "Q4_0", "Q5_1")
N_CTX = 1024
THREADS = 2


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def quantize(L, src: Path, dst: Path, recipe: str) -> None:
    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{recipe}")
    params.nthread = THREADS
    rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise SystemExit(f"hybrid_refs: llama_model_quantize {recipe} failed ({rc})")


def run_case(L, model, prompt: list[int], n_gen: int) -> dict:
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = N_CTX, 512, 512
    cp.n_threads = cp.n_threads_batch = THREADS
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(512, 0, 1)

    def decode(tokens, pos0):
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = int(i == len(tokens) - 1)
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("hybrid_refs: llama_decode failed")
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, len(tokens) - 1), shape=(n_vocab,)).copy()

    logits = decode(prompt, 0)
    greedy, steps = [], []
    for i in range(n_gen):
        top = np.argsort(-logits, kind="stable")[:10]
        steps.append({"top": [[int(t), round(float(logits[t]), 5)] for t in top],
                      "margin": round(float(logits[top[0]] - logits[top[1]]), 5)})
        greedy.append(int(top[0]))
        if i + 1 < n_gen:
            logits = decode([greedy[-1]], len(prompt) + i)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    return {"prompt_ids": prompt, "greedy_ids": greedy, "steps": steps}


def choose(a) -> int:
    from engine.backend_cpu import CPUBackend
    from engine.gguf_model import open_model

    be = CPUBackend(open_model(a.model), 1024)
    prompts = []
    for n in (int(x) for x in a.prompt_lens.split(",")):
        for seed in range(a.tries):
            rng = np.random.default_rng([seed, n])
            prompt = [int(t) for t in rng.integers(0, be.config.n_vocab - 3, n)]
            be.truncate(0)
            be.net.min_route_gap = float("inf")
            logits = be.forward(prompt)
            for _ in range(a.n_gen - 1):
                logits = be.forward([int(np.argmax(logits))])
            if be.net.min_route_gap >= a.min_gap:
                print(f"hybrid_refs: {n} tokens, seed {seed}: smallest router gap {be.net.min_route_gap:.4f}",
                      file=sys.stderr)
                prompts.append(prompt)
                break
        else:
            raise SystemExit(f"hybrid_refs: no prompt of {n} tokens without a router gap under {a.min_gap} "
                             f"in {a.tries} tries; lower --min-gap")
    a.out.write_text(json.dumps({"min_gap": a.min_gap, "n_gen": a.n_gen, "prompts": prompts}) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.hybrid_refs", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("choose", help="pick prompts without router near-ties (the project's venv)")
    c.add_argument("--model", type=Path, required=True)
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--prompt-lens", default="300,40", help="comma-separated prompt lengths (random ids)")
    c.add_argument("--n-gen", type=int, default=24)
    c.add_argument("--min-gap", type=float, default=2e-3)
    c.add_argument("--tries", type=int, default=200)
    r = sub.add_parser("run", help="llama.cpp's references for those prompts (llama-cpp-python's venv)")
    r.add_argument("--model", type=Path, required=True)
    r.add_argument("--prompts", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--quantize", choices=RECIPES)
    r.add_argument("--quant-out", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "choose":
        return choose(a)
    chosen = json.loads(a.prompts.read_text())
    try:
        import llama_cpp as L
    except ImportError:
        raise SystemExit("hybrid_refs: run me with the Python that has llama-cpp-python (e.g. /tmp/llamavenv/bin/python)")
    L.llama_backend_init()
    path = a.model
    if a.quantize:
        if a.quant_out is None:
            raise SystemExit("hybrid_refs: --quantize needs --quant-out")
        quantize(L, a.model, a.quant_out, a.quantize)
        path = a.quant_out
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    if not model:
        raise SystemExit(f"hybrid_refs: llama.cpp cannot load {path}")
    cases = [run_case(L, model, p, chosen["n_gen"]) for p in chosen["prompts"]]
    L.llama_model_free(model)
    ref = {"model_file": path.name, "model_sha256": sha256(path),
           "made_with": f"llama.cpp 0c1e570 as vendored by llama-cpp-python 0.3.36, CPU build, {THREADS} threads, "
                        f"n_batch 512: prompt evaluated in one batch, then one token at a time (greedy)"
                        + (f"; quantized from {a.model.name} by llama_model_quantize {a.quantize}" if a.quantize else ""),
           "cases": cases}
    a.out.write_text(json.dumps(ref, separators=(",", ":")) + "\n")
    print(f"hybrid_refs: wrote {a.out} ({len(cases)} cases on {path.name})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
