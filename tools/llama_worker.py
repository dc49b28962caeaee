"""llama.cpp's side of tools.llama_ref: run inside the venv that holds llama-cpp-python, standard library only.

    VENV/bin/python tools/llama_worker.py < request.json > answer.json

A request is one JSON object: {"op": "quantize", "src", "dst", "ftype", "nthread", "imatrix": path-or-null} or
{"op": "record", "model", "cases": [{"prompt_ids", "n_predict"}], "n_threads", "n_batch", "top"} or
{"op": "types", "src", "ftype"} (llama-quantize's --dry-run: the type each tensor would get). The answer is
one JSON object ({"error": msg} on failure). It imports llama_cpp's ctypes bindings without the package's
__init__, which pulls in numpy, jinja2 and diskcache: this venv holds the wheel alone (installed --no-deps, no
network), and the bindings need nothing else but typing_extensions.TypeAlias.
"""
from __future__ import annotations

import ctypes
import heapq
import importlib.util
import json
import re
import struct
import sys
import types
import typing


def _bindings():
    try:
        import typing_extensions  # noqa: F401
    except ImportError:   # the one name the bindings take from it
        sys.modules["typing_extensions"] = types.SimpleNamespace(TypeAlias=typing.TypeAlias)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(json.dumps({"error": "llama_cpp is not installed in this interpreter"}))
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["llama_cpp"] = pkg
    import llama_cpp.llama_cpp as ll
    return ll


ll = _bindings()


@ll.llama_log_callback
def _quiet(level, text, user_data):   # llama.cpp's load chatter would drown the answer; errors come back as codes
    pass


def read_imatrix(path: str) -> dict[str, list[float]]:
    """Our imatrix exchange file: repeated (u32 name length, name, u64 count, count float32)."""
    out = {}
    with open(path, "rb") as f:
        data = f.read()
    p = 0
    while p < len(data):
        (n,) = struct.unpack_from("<I", data, p)
        name = data[p + 4:p + 4 + n].decode()
        (count,) = struct.unpack_from("<Q", data, p + 4 + n)
        p += 12 + n
        out[name] = data[p:p + 4 * count]
        p += 4 * count
    return out


def quantize(req: dict) -> dict:
    params = ll.llama_model_quantize_default_params()
    params.nthread = int(req.get("nthread", 2))
    params.ftype = int(req["ftype"])
    keep = []
    if req.get("imatrix"):
        entries = read_imatrix(req["imatrix"])
        arr = (ll.llama_model_imatrix_data * (len(entries) + 1))()   # a zeroed entry ends the list
        for i, (name, raw) in enumerate(entries.items()):
            buf = ctypes.create_string_buffer(raw, len(raw))
            keep.append(buf)
            arr[i].name = name.encode()
            arr[i].data = ctypes.cast(buf, ctypes.POINTER(ctypes.c_float))
            arr[i].size = len(raw) // 4
        keep.append(arr)
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(ll.llama_model_imatrix_data))
    rc = ll.llama_model_quantize(req["src"].encode(), req["dst"].encode(), ctypes.byref(params))
    if rc != 0:
        return {"error": f"llama_model_quantize returned {rc} for ftype {req['ftype']} (a recipe that needs an "
                         f"imatrix, e.g. IQ2_XXS, fails without one)"}
    return {"ok": True}


def planned_types(req: dict) -> dict:
    """llama-quantize --dry-run: the type it would give each tensor, read from its log (data never read)."""
    lines = []

    @ll.llama_log_callback
    def grab(level, text, user_data):
        lines.append(text.decode("utf-8", "replace"))

    ll.llama_log_set(grab, None)
    params = ll.llama_model_quantize_default_params()
    params.ftype = int(req["ftype"])
    params.dry_run = True
    params.nthread = 1
    rc = ll.llama_model_quantize(req["src"].encode(), b"/dev/null", ctypes.byref(params))
    ll.llama_log_set(_quiet, None)
    if rc != 0:
        return {"error": f"llama_model_quantize (dry run) returned {rc}: {''.join(lines)[-600:]}"}
    # "[   3/ 123]   blk.0.attn_k.weight - [  256,   128,     1,     1], type =    f16, size = ... (q4_K)"
    # or, where the type stays, "... type =    f32, size =    0.001 MiB"
    types = {}
    for m in re.finditer(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\S+), size =[^\n(]*(?:\((\S+)\))?",
                         "".join(lines)):
        types[m.group(1)] = (m.group(3) or m.group(2)).upper()
    return {"types": types}


def record(req: dict) -> dict:
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = ll.llama_model_load_from_file(req["model"].encode(), mp)
    if not model:
        return {"error": f"llama.cpp could not load {req['model']}"}
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    cases = req["cases"]
    n_ctx = max(len(c["prompt_ids"]) + c["n_predict"] for c in cases) + 8
    cp = ll.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = cp.n_ubatch = int(req.get("n_batch", 512))
    cp.n_threads = cp.n_threads_batch = int(req.get("n_threads", 2))
    top_k = int(req.get("top", 10))
    out = []
    try:
        for case in cases:
            ctx = ll.llama_init_from_model(model, cp)   # a fresh context per case: nothing carried over
            if not ctx:
                return {"error": "llama_init_from_model failed"}
            batch = ll.llama_batch_init(max(len(case["prompt_ids"]), 1), 0, 1)
            try:
                out.append(_greedy(ctx, batch, case["prompt_ids"], case["n_predict"], n_vocab, top_k))
            finally:
                ll.llama_batch_free(batch)
                ll.llama_free(ctx)
    finally:
        ll.llama_model_free(model)
    return {"n_vocab": n_vocab, "cases": out}


def _greedy(ctx, batch, prompt: list[int], n_predict: int, n_vocab: int, top_k: int) -> dict:
    """The prompt in one batch, then its greedy continuation one token at a time; top-k at every step."""
    steps, greedy = [], []
    toks, pos = list(prompt), 0
    while len(greedy) < n_predict:
        batch.n_tokens = len(toks)
        for i, t in enumerate(toks):
            batch.token[i] = t
            batch.pos[i] = pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(toks) - 1
        rc = ll.llama_decode(ctx, batch)
        if rc != 0:
            raise SystemExit(json.dumps({"error": f"llama_decode returned {rc}"}))
        pos += len(toks)
        ptr = ll.llama_get_logits_ith(ctx, len(toks) - 1)
        row = list(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float * n_vocab)).contents)
        best = heapq.nlargest(top_k, range(n_vocab), key=row.__getitem__)
        steps.append({"top": [[i, row[i]] for i in best], "margin": row[best[0]] - row[best[1]]})
        greedy.append(best[0])
        toks = [best[0]]
    return {"prompt_ids": list(prompt), "greedy_ids": greedy, "steps": steps}


def main() -> int:
    req = json.load(sys.stdin)
    ll.llama_log_set(_quiet, None)
    ll.llama_backend_init()
    ops = {"quantize": quantize, "record": record, "types": planned_types}
    if req.get("op") not in ops:
        ans = {"error": f"unknown op {req.get('op')!r}; one of {sorted(ops)}"}
    else:
        ans = ops[req["op"]](req)
    json.dump(ans, sys.stdout)
    return 0 if "error" not in ans else 1


if __name__ == "__main__":
    sys.exit(main())
