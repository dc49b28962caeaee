"""llama.cpp's MTP draft head (draft-mtp) on a qwen3next / qwen35moe file, for tools/mtp_ref.py: run inside the venv
that holds llama-cpp-python (tools/llama_worker.py's bindings; standard library only).

    VENV/bin/python tools/llama_mtp_worker.py < request.json > answer.json

Request {"model", "cases": [{"prompt_ids", "n_draft"}], "n_threads", "top"}. As common/speculative.cpp does: the
target context outputs every position's h_nextn (llama_set_embeddings_nextn(ctx, true, masked=false)); an MTP
context (ctx_type MTP, ctx_other the target) reads the prompt in one batch, token t_i at position i with the target's
row at i - 1 as its embedding (zeros at 0); then from the target's greedy pick after the prompt it drafts n_draft
tokens, each at the next position with the MTP's own h_nextn row of the step before. Answer per case: the MTP's
top-k logits at every prompt position ("teacher"), the target's pick ("first"), the drafts ("draft_ids") and their
steps' top-k ("draft_steps").
"""
from __future__ import annotations

import ctypes
import heapq
import json
import sys

from llama_worker import _quiet, ll     # the same bindings, loaded without llama_cpp's __init__

CTX_MTP = 1             # enum llama_context_type
DECODE = 1              # enum llama_process_type
_lib = ll._lib
# llama-ext.h's staging API is C++ (mangled names)
_set_nextn = _lib._Z26llama_set_embeddings_nextnP13llama_contextbb
_set_nextn.argtypes, _set_nextn.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
_nextn_ith = _lib._Z30llama_get_embeddings_nextn_ithP13llama_contexti
_nextn_ith.argtypes, _nextn_ith.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)


def _row(ptr, n: int) -> list[float]:
    return list(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float * n)).contents)


def _top(row: list[float], k: int) -> list[list]:
    return [[i, row[i]] for i in heapq.nlargest(k, range(len(row)), key=row.__getitem__)]


def _process(ctx, items, n_embd: int) -> None:
    """One llama_process on ctx: items are (token, position, row of n_embd floats or None), every one an output."""
    batch = ll.llama_batch_ext_init(ctx)
    keep = []
    try:
        for tok, pos, row in items:
            idx = ll.llama_batch_ext_add_token(batch, 0, tok)
            p = (ll.llama_pos * 1)(pos)
            keep.append(p)
            if idx < 0 or not ll.llama_batch_ext_set_pos(batch, idx, p):
                raise RuntimeError(f"adding token {tok} at {pos} failed ({idx})")
            if row is not None:
                buf = (ctypes.c_float * n_embd)(*row)
                keep.append(buf)
                if not ll.llama_batch_ext_set_embd_token(batch, idx, ll.llama_embd(buf, 1, n_embd)):
                    raise RuntimeError("setting the hidden row failed")
            ll.llama_batch_ext_set_output_logits(batch, idx, True)
        rc = ll.llama_process(ctx, DECODE, batch)
        if rc != 0:
            raise RuntimeError(f"llama_process returned {rc}")
    finally:
        ll.llama_batch_ext_free(batch)


def mtp(req: dict) -> dict:
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.load_mtp = True
    model = ll.llama_model_load_from_file(req["model"].encode(), mp)
    if not model:
        return {"error": f"llama.cpp could not load {req['model']}"}
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    n_embd = ll.llama_model_n_embd(model)
    top = int(req.get("top", 10))
    out = []
    try:
        for case in req["cases"]:
            prompt, n_draft = [int(t) for t in case["prompt_ids"]], int(case["n_draft"])
            cp = ll.llama_context_default_params()
            cp.n_ctx = len(prompt) + n_draft + 16
            cp.n_batch = cp.n_ubatch = 512
            cp.n_threads = cp.n_threads_batch = int(req.get("n_threads", 2))
            tgt = ll.llama_init_from_model(model, cp)
            cp.ctx_type, cp.ctx_other, cp.n_rs_seq = CTX_MTP, tgt, 0
            dft = ll.llama_init_from_model(model, cp)
            if not tgt or not dft:
                return {"error": "llama_init_from_model failed (target or MTP context)"}
            try:
                _set_nextn(tgt, True, False)
                _set_nextn(dft, True, True)
                _process(tgt, [(t, i, None) for i, t in enumerate(prompt)], n_embd)
                h = [_row(_nextn_ith(tgt, i), n_embd) for i in range(len(prompt))]
                last = _row(ll.llama_get_logits_ith(tgt, len(prompt) - 1), n_vocab)
                first = max(range(n_vocab), key=last.__getitem__)
                _process(dft, [(t, i, h[i - 1] if i else [0.0] * n_embd) for i, t in enumerate(prompt)], n_embd)
                teacher = [_top(_row(ll.llama_get_logits_ith(dft, i), n_vocab), top) for i in range(len(prompt))]
                ids, steps, tok, row = [], [], first, h[-1]
                for i in range(n_draft):
                    _process(dft, [(tok, len(prompt) + i, row)], n_embd)
                    lg = _row(ll.llama_get_logits_ith(dft, 0), n_vocab)
                    steps.append(_top(lg, top))
                    tok = max(range(n_vocab), key=lg.__getitem__)
                    ids.append(tok)
                    row = _row(_nextn_ith(dft, 0), n_embd)
                out.append({"prompt_ids": prompt, "first": first, "teacher": teacher, "draft_ids": ids,
                            "draft_steps": steps})
            finally:
                ll.llama_free(dft)
                ll.llama_free(tgt)
    finally:
        ll.llama_model_free(model)
    return {"n_vocab": n_vocab, "n_embd": n_embd, "cases": out}


def main() -> int:
    req = json.load(sys.stdin)
    ll.llama_log_set(_quiet, None)
    ll.llama_backend_init()
    try:
        ans = mtp(req)
    except RuntimeError as e:
        ans = {"error": str(e)}
    json.dump(ans, sys.stdout)
    return 0 if "error" not in ans else 1


if __name__ == "__main__":
    sys.exit(main())
