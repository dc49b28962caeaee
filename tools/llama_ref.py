"""Fixtures made by llama.cpp itself: quantize with llama-quantize's recipes, record llama.cpp's outputs.

    python -m tools.llama_ref fixtures --model qwen3moe [--recipes q4_k_m,q6_k] --out tests/fixtures/llama_ref
    python -m tools.llama_ref quantize SRC.gguf DST.gguf --recipe q4_k_m [--imatrix auto|FILE]
    python -m tools.llama_ref record MODEL.gguf --out ref.json [--cases 3] [--n-predict 16]
    python -m tools.llama_ref types MODEL.gguf                  # every tensor's quant type

llama.cpp runs in a venv of its own (data/cache/llama_cpp-0.3.36/venv) holding only the CPU wheel from
../shared/anchors/ (unpacked, no pip, no network; llama.cpp is never built here); tools/llama_worker.py is
what runs inside it. STRATA_LLAMA_PYTHON names another interpreter that has llama_cpp (e.g. /tmp/llamavenv).

Python API, for any architecture make_moe writes (pass its arguments; add yours to FIXTURE_MODELS, or call
write_fixtures(name, make_moe_args, out_dir, workdir) from your own script):
    src = make_source(path, ["--preset", "tiny", "--arch", "qwen3moe", "--n-layer", "8", ...])  # F16 model
    quantize(src, dst, "q4_k_m", imatrix=None)       # llama_model_quantize, the recipe by name
    planned_types(src, "q4_k_m")                     # llama-quantize --dry-run: {tensor: type}, nothing written
    header_only_source(path, make_moe_args)          # a sparse full-size source for planned_types
    ref = reference(dst, prompts(1024, seed=0))      # llama.cpp's greedy ids, top-10 and margins, + exact
    stats = compare(ref, [teacher_forced(backend, case) for case in ref["cases"]])   # vs llama.cpp and exact
The JSON a reference writes is that of ../shared/fixtures/reference/ (prompt_ids, greedy_ids, steps of top-10
[id, logit] and margin, model_sha256) plus, per step, exact arithmetic (tools.exact_forward, float64 over the
dequantized weights): `exact_top` (its own top-10) and `exact_at_top` (its logits at llama.cpp's ids). Where
tools.exact_forward lacks an architecture, pass exact=None (or your own logits function) to reference().
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import fcntl
import io
import json
import os
import subprocess
import sys
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.quant_types import QT

ROOT = Path(__file__).resolve().parent.parent
WHEEL = ROOT.parent / "shared" / "anchors" / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
CACHE = ROOT / "data" / "cache" / "llama_cpp-0.3.36"
WORKER = Path(__file__).resolve().parent / "llama_worker.py"
MADE_WITH = ("llama.cpp 0c1e570 as vendored by llama-cpp-python 0.3.36, CPU build (../shared/anchors wheel), "
             "2 threads, n_batch 512: prompt evaluated in one batch, then one token at a time (greedy)")

# llama_ftype of each recipe (include/llama.h), as llama-quantize's names map to them
RECIPES = {"f16": 1, "q8_0": 7, "q6_k": 18, "q5_k_m": 17, "q4_k_m": 15, "q4_k_s": 14, "q3_k_m": 12, "q2_k": 10,
           "iq4_xs": 30, "iq3_xxs": 23, "iq2_xxs": 19, "q1_0": 40, "q2_0": 41}
# llama.cpp refuses these without an importance matrix (llama-quant.cpp: "very low-bit quantization")
NEEDS_IMATRIX = ("iq2_xxs", "iq3_xxs")
# The "dynamic" community quants: a base recipe with per-tensor overrides (llama-quantize --tensor-type), gate and
# up in different types, some layers' experts kept at Q8_0 or BF16. Ours: Q4_K_M plus these, first match wins.
DYNAMIC = ("q4_k_m", [(r"blk\.3\.ffn_(gate|up|down)_exps", "Q8_0"), (r"blk\.5\.ffn_(gate|up|down)_exps", "BF16"),
                      (r"blk\.6\.ffn_down_exps", "IQ4_XS"), (r"ffn_up_exps", "Q5_K"), (r"attn_output", "Q5_K")])
DEFAULT_RECIPES = ("q4_k_m", "q5_k_m", "q3_k_m", "q2_k", "q4_k_s", "iq4_xs", "q6_k", "q8_0", "iq2_xxs", "iq3_xxs",
                   "dynamic")

# The small models our fixtures are made from: 8 layers (so that llama.cpp's every-third-layer and first/last-
# eighth rules each pick some layers), hidden 256, 4 experts of width 256 (2 used), the 1,024-token vocabulary.
_SMALL = ["--preset", "tiny", "--n-layer", "8", "--seed", "22"]
_MOE = ["--n-expert", "4", "--n-expert-used", "2"]
FIXTURE_MODELS: dict[str, list[str]] = {
    "qwen3moe": _SMALL + _MOE + ["--arch", "qwen3moe"],
    "qwen2moe": _SMALL + _MOE + ["--arch", "qwen2moe"],
    "mixtral": _SMALL + _MOE + ["--arch", "llama"],
    "llama": _SMALL + ["--arch", "llama"],
    "qwen3": _SMALL + ["--arch", "qwen3"],
    "qwen2": _SMALL + ["--arch", "qwen2"],
}
F16_TYPES = ["--experts", "F16", "--shexp", "F16", "--attn", "F16", "--ffn", "F16", "--embd", "F16",
             "--output", "F16", "--norm", "F32"]


class LlamaRefError(Exception):
    """llama.cpp could not be reached or refused a request; the message says what to do."""


# --- llama.cpp's venv -------------------------------------------------------------------------------------------

def llama_python(wheel: Path = WHEEL, cache: Path = CACHE) -> Path:
    """An interpreter that has llama_cpp: $STRATA_LLAMA_PYTHON, or a venv in `cache` made from `wheel` once."""
    env = os.environ.get("STRATA_LLAMA_PYTHON")
    if env:
        return Path(env)
    # test processes run side by side (tools/gpu_suite.sh recipes): one makes the venv while the others wait
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _make_venv(wheel, cache)


def _make_venv(wheel: Path, cache: Path) -> Path:
    py = cache / "venv" / "bin" / "python"
    stamp = cache / "venv" / "installed-from"
    if py.is_file() and stamp.is_file() and stamp.read_text() == wheel.name:
        return py
    if not wheel.is_file():
        raise LlamaRefError(f"llama.cpp's CPU wheel is not at {wheel}; put llama_cpp_python-0.3.36 there "
                            f"(../shared/anchors/) or set STRATA_LLAMA_PYTHON to a python that has llama_cpp")
    # A wheel is a zip of what goes into site-packages; unpacking it needs neither pip nor a network (this one has
    # no scripts to install, and its dependencies are not needed: see tools/llama_worker.py).
    try:
        venv.EnvBuilder(clear=True, with_pip=False).create(cache / "venv")
        site = cache / "venv" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    except (OSError, subprocess.CalledProcessError, zipfile.BadZipFile) as e:
        raise LlamaRefError(f"installing {wheel.name} into {cache / 'venv'} failed: {e}") from None
    stamp.write_text(wheel.name)
    return py


def available() -> str | None:
    """None when llama.cpp can be run here, else why not (for tests' skip reasons)."""
    try:
        llama_python()
    except LlamaRefError as e:
        return str(e)
    return None


def _call(req: dict) -> dict:
    r = subprocess.run([str(llama_python()), str(WORKER)], input=json.dumps(req), capture_output=True, text=True)
    try:
        ans = json.loads(r.stdout)
    except json.JSONDecodeError:
        raise LlamaRefError(f"llama.cpp's worker died (exit {r.returncode}): {r.stderr.strip()[-800:]}") from None
    if "error" in ans:
        raise LlamaRefError(f"llama.cpp: {ans['error']}")
    return ans


# --- models -----------------------------------------------------------------------------------------------------

def make_source(out: Path, make_moe_args: list[str]) -> Path:
    """An F16 model (F32 norms, routers and biases) written by tools.make_moe with these arguments."""
    from tools import make_moe
    out = Path(out)
    # a name of this process's own, then one atomic rename: test processes side by side (gpu_suite recipes) may
    # make the same file at once, and each must see it whole or not at all
    tmp = out.with_name(f"{out.stem}.{os.getpid()}{out.suffix}")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        make_moe.main([*make_moe_args, *F16_TYPES, "--threads", "1", "--out", str(tmp)])
    os.replace(tmp, out)
    return out


def quantize(src: Path, dst: Path, recipe: str, imatrix: Path | None = None, nthread: int = 2,
             overrides: list[tuple[str, str]] = ()) -> Path:
    """llama-quantize SRC DST RECIPE [--imatrix FILE] [--tensor-type REGEX=TYPE ...] through
    llama_model_quantize. Deterministic. recipe "dynamic" is DYNAMIC's base recipe with its overrides."""
    if recipe == "dynamic":
        recipe, overrides = DYNAMIC[0], [*overrides, *DYNAMIC[1]]
    if recipe not in RECIPES:
        raise LlamaRefError(f"unknown recipe {recipe!r}; one of {', '.join(RECIPES)}")
    if recipe in NEEDS_IMATRIX and imatrix is None:
        raise LlamaRefError(f"{recipe} needs an importance matrix: pass imatrix= (tools.imatrix makes one)")
    dst = Path(dst)
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.part")     # this process's own (make_source says why)
    _call({"op": "quantize", "src": str(src), "dst": str(tmp), "ftype": RECIPES[recipe], "nthread": nthread,
           "imatrix": str(imatrix) if imatrix else None,
           "overrides": [(pattern, int(QT[t])) for pattern, t in overrides]})
    os.replace(tmp, dst)
    return dst


def planned_types(src: Path, recipe: str) -> dict[str, str]:
    """{tensor: type} that llama-quantize RECIPE would write from SRC (its --dry-run; no data is read)."""
    return _call({"op": "types", "src": str(src), "ftype": RECIPES[recipe]})["types"]


def header_only_source(out: Path, make_moe_args: list[str]) -> Path:
    """An F16 model's header with its data left as a sparse hole: full-size shapes (a 48-layer, 128-expert
    model) for planned_types, at no disk cost. Not a model to run: every weight reads as zero."""
    import gguf
    from tools import make_moe as mm
    args = mm.build_parser().parse_args([*make_moe_args, *F16_TYPES])
    shape = mm.resolve_shape(args)
    vocab = mm.read_vocab(mm._resolve_vocab(shape.vocab))
    n_vocab = next(len(v) for k, v, _ in vocab if k == "tokenizer.ggml.tokens")
    types = {g: getattr(args, g) for g in ("experts", "shexp", "attn", "ffn", "embd", "output", "norm")}
    specs = mm.plan(shape, types, n_vocab)
    mm.write_header_only(Path(out), shape, specs, vocab, "header-only", gguf.GGMLQuantizationType.F16)
    return Path(out)


def tensor_types(path: Path) -> dict[str, str]:
    """{tensor name: quant type name}, in file order."""
    from engine.gguf_model import read_header
    return {t.name: QT(t.type_id).name for t in read_header(path).tensors}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --- references -------------------------------------------------------------------------------------------------

def prompts(n_vocab: int, seed: int = 0, lengths=(8, 24, 40)) -> list[list[int]]:
    """Prompts of random token ids (random-weight models have no language to prompt in)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_vocab, n).tolist() for n in lengths]


def record(model: Path, prompt_ids: list[list[int]], n_predict: int = 16, n_threads: int = 2) -> list[dict]:
    """llama.cpp's greedy continuation of each prompt and, at every step, its top-10 [id, logit] and margin."""
    ans = _call({"op": "record", "model": str(model), "n_threads": n_threads, "n_batch": 512, "top": 10,
                 "cases": [{"prompt_ids": p, "n_predict": n_predict} for p in prompt_ids]})
    return ans["cases"]


def _r(x: float) -> float:
    return round(float(x), 5)


def reference(model: Path, prompt_ids: list[list[int]], n_predict: int = 16, exact="auto", **extra) -> dict:
    """The fixture JSON for one model file: llama.cpp's outputs and, per step, exact arithmetic's.

    exact: "auto" (tools.exact_forward where it knows the architecture, else none), None (llama.cpp's outputs
    only), or a function (path, token ids) -> logits (len, n_vocab) for an architecture exact_forward lacks.
    """
    model = Path(model)
    cases = record(model, prompt_ids, n_predict)
    if exact == "auto":
        from engine.gguf_model import read_header
        from tools.exact_forward import ARCHS, exact_logits
        arch = read_header(model).metadata.get("general.architecture")
        exact = exact_logits if arch in ARCHS else None
        if exact is None:
            print(f"llama_ref: no exact arithmetic for {arch} (tools.exact_forward knows {', '.join(ARCHS)}): "
                  f"llama.cpp's outputs only", file=sys.stderr)
    for case in cases:
        for s in case["steps"]:
            s["top"] = [[i, _r(v)] for i, v in s["top"]]
            s["margin"] = _r(s["margin"])
        if exact is None:
            continue
        n_p = len(case["prompt_ids"])
        logits = exact(model, case["prompt_ids"] + case["greedy_ids"][:-1])[n_p - 1:]
        for s, row in zip(case["steps"], logits, strict=True):
            best = np.argsort(-row, kind="stable")[:10]
            s["exact_top"] = [[int(i), _r(row[i])] for i in best]
            s["exact_at_top"] = [_r(row[i]) for i, _ in s["top"]]
    ref = {"model_file": model.name, "model_sha256": sha256(model), "made_with": MADE_WITH, **extra,
           "tensor_types": tensor_types(model), "cases": cases}
    if exact is not None:
        ref["llama_vs_exact"] = llama_vs_exact(ref)
    return ref


def llama_vs_exact(ref: dict) -> dict:
    """How far llama.cpp sits from exact arithmetic on this file (its 8-bit activations; ~0.007 on F16)."""
    d = np.array([np.abs(np.array([v for _, v in s["top"]]) - np.array(s["exact_at_top"]))
                  for c in ref["cases"] for s in c["steps"]])
    return {"median_abs_diff": _r(np.median(d)), "share_of_steps_over_1": _r(np.mean(d.mean(axis=1) > 1.0)),
            "max_abs_diff": _r(d.max())}


@dataclass
class Comparison:
    vs_exact_median: float        # |ours - exact| at exact's top-10 and llama.cpp's top-10 ids, median
    vs_exact_max: float
    vs_llama_median: float        # |ours - llama.cpp| at its top-10 ids, median
    vs_llama_over1: float         # share of steps whose mean |ours - llama.cpp| exceeds 1
    top1_agree: int               # steps where our argmax is llama.cpp's, among those whose margin >= clear
    top1_clear: int

    def __str__(self) -> str:
        return (f"vs exact: median {self.vs_exact_median:.4f} max {self.vs_exact_max:.4f}; vs llama.cpp: median "
                f"{self.vs_llama_median:.4f}, {self.vs_llama_over1:.0%} of steps over 1, top-1 "
                f"{self.top1_agree}/{self.top1_clear} where clear")


def compare(ref: dict, logits: list[np.ndarray], clear: float = 0.5) -> Comparison:
    """Our teacher-forced logits (one (steps, n_vocab) array per case, the step after each token of
    prompt[-1:] + greedy_ids[:-1]) against the reference's llama.cpp and exact numbers."""
    ex, ll, agree, n_clear = [], [], 0, 0
    for case, rows in zip(ref["cases"], logits, strict=True):
        for s, row in zip(case["steps"], rows, strict=True):
            ids = [i for i, _ in s["top"]]
            ll.append(np.abs(row[ids] - np.array([v for _, v in s["top"]])))
            if "exact_top" in s:
                eids = [i for i, _ in s["exact_top"]]
                ex.append(np.abs(row[eids] - np.array([v for _, v in s["exact_top"]])))
                ex.append(np.abs(row[ids] - np.array(s["exact_at_top"])))
            if s["margin"] >= clear:
                n_clear += 1
                agree += int(np.argmax(row)) == ids[0]
    ll = np.array(ll)
    ex = np.array(ex) if ex else np.full((1, 1), np.nan)
    return Comparison(float(np.median(ex)), float(np.max(ex)), float(np.median(ll)),
                      float(np.mean(ll.mean(axis=1) > 1.0)), agree, n_clear)


def teacher_forced(backend, case: dict) -> np.ndarray:
    """A Backend's logits along a reference case: the prompt in one call, then each greedy token in turn."""
    backend.truncate(0)
    rows = [backend.forward(case["prompt_ids"])]
    for t in case["greedy_ids"][:-1]:
        rows.append(backend.forward([t]))
    return np.array(rows)


# --- fixture sets -----------------------------------------------------------------------------------------------

def build_model_set(name: str, make_moe_args: list[str], workdir: Path, recipes=DEFAULT_RECIPES,
                    imatrix_dir: Path | None = None) -> dict[str, Path]:
    """The F16 source and each recipe's file in workdir: {"f16": path, recipe: path}. Made only if missing;
    the imatrix of IQ2_XXS/IQ3_XXS is read from (or computed into) imatrix_dir, default workdir."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / f"{name}-f16.gguf"
    if not src.is_file():
        make_source(src, make_moe_args)
    out = {"f16": src}
    for recipe in recipes:
        if recipe == "f16":
            continue
        dst = workdir / f"{name}-{recipe}.gguf"
        if not dst.is_file():
            im = imatrix_file(name, src, imatrix_dir or workdir) if recipe in NEEDS_IMATRIX else None
            quantize(src, dst, recipe, im)
        out[recipe] = dst
    return out


def imatrix_file(name: str, src: Path, directory: Path) -> Path:
    """directory/NAME.imatrix, computed from SRC on random prompts if it is not there. The fixtures keep theirs
    beside the references: float64 sums may differ in the last bit with another BLAS, and an IQ2 grid choice with
    them, so a rebuild elsewhere reads the committed file rather than recomputing it."""
    path = Path(directory) / f"{name}.imatrix"
    if not path.is_file():
        from tools.imatrix import compute_imatrix, write_imatrix
        write_imatrix(path, compute_imatrix(src, prompts(_n_vocab(src), seed=1, lengths=(64, 64, 64, 64))))
    return path


def _n_vocab(path: Path) -> int:
    from engine.gguf_model import read_header
    return len(read_header(path).metadata["tokenizer.ggml.tokens"])


def write_fixtures(name: str, make_moe_args: list[str], out_dir: Path, workdir: Path,
                   recipes=DEFAULT_RECIPES, n_predict: int = 16) -> list[Path]:
    files = build_model_set(name, make_moe_args, workdir, ("f16", *recipes), imatrix_dir=out_dir)
    ps = prompts(_n_vocab(files["f16"]), seed=0)
    written = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for recipe, path in files.items():
        ref = reference(path, ps, n_predict, fixture=name, recipe=recipe,
                        source=["python -m tools.make_moe", *make_moe_args, *F16_TYPES])
        dst = out_dir / f"{name}-{recipe}.json"
        dst.write_text(json.dumps(ref, separators=(",", ":")) + "\n")
        written.append(dst)
        print(f"{dst.name}: llama.cpp vs exact {ref.get('llama_vs_exact')}", file=sys.stderr)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.llama_ref", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixtures", help="make F16 sources, quantize them with each recipe, record references")
    f.add_argument("--model", action="append", choices=sorted(FIXTURE_MODELS),
                   help="one of FIXTURE_MODELS (repeatable; default all)")
    f.add_argument("--recipes", default=",".join(DEFAULT_RECIPES))
    f.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "llama_ref")
    f.add_argument("--workdir", type=Path, default=CACHE / "models")
    q = sub.add_parser("quantize", help="llama-quantize one file")
    q.add_argument("src", type=Path)
    q.add_argument("dst", type=Path)
    q.add_argument("--recipe", required=True, choices=sorted([*RECIPES, "dynamic"]))
    q.add_argument("--imatrix", help="'auto' (computed from the source on random prompts) or a file "
                                     "tools.imatrix wrote")
    r = sub.add_parser("record", help="record llama.cpp's outputs for one file")
    r.add_argument("model", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--cases", type=int, default=3)
    r.add_argument("--n-predict", type=int, default=16)
    r.add_argument("--no-exact", action="store_true", help="llama.cpp's outputs only (an arch exact_forward lacks)")
    t = sub.add_parser("types", help="print each tensor's quant type")
    t.add_argument("model", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "fixtures":
            recipes = tuple(x for x in args.recipes.split(",") if x)
            bad = [x for x in recipes if x not in RECIPES and x != "dynamic"]
            if bad:
                raise LlamaRefError(f"unknown recipe(s) {bad}; choose from {', '.join(RECIPES)}")
            for name in args.model or sorted(FIXTURE_MODELS):
                write_fixtures(name, FIXTURE_MODELS[name], args.out, args.workdir, recipes)
        elif args.cmd == "quantize":
            imatrix = None
            if args.imatrix == "auto":
                from tools.imatrix import compute_imatrix, write_imatrix
                imatrix = write_imatrix(args.dst.with_suffix(".imatrix.bin"), compute_imatrix(
                    args.src, prompts(_n_vocab(args.src), seed=1, lengths=(64, 64, 64, 64))))
            elif args.imatrix:
                imatrix = Path(args.imatrix)
            quantize(args.src, args.dst, args.recipe, imatrix)
            print(f"wrote {args.dst}")
        elif args.cmd == "record":
            ps = prompts(_n_vocab(args.model), seed=0, lengths=(8, 24, 40, 16, 32, 12)[:args.cases])
            ref = reference(args.model, ps, args.n_predict, exact=None if args.no_exact else "auto")
            args.out.write_text(json.dumps(ref, separators=(",", ":")) + "\n")
            print(f"wrote {args.out}" + (f"; llama.cpp vs exact {ref['llama_vs_exact']}" if "llama_vs_exact" in ref
                                         else ""))
        else:
            for name, q in tensor_types(args.model).items():
                print(f"{q:<8} {name}")
    except LlamaRefError as e:
        raise SystemExit(f"llama_ref: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
