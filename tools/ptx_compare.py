"""Which kernels a change of cuda_src/ touched: every engine build's PTX here against a git ref's, function by function.

    python -m tools.ptx_compare [--ref main] [--expect Li39E,QT=39]

Both trees are compiled with nvcc exactly as tests/test_cuda_compile.py does (engine.cuda.kernels.builds(): the same
defines and options, -arch=sm_90 --ptx). Prints per build the functions that are identical and those that differ;
with --expect, exits 1 when a function differs whose mangled name (or whose build's label) contains none of the
given strings: e.g. a change meant for MXFP4 only (ggml type 39: template argument Li39E, builds "... STRATA_QT=39")
must leave every other type's code byte-identical.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_DUMP = r"""
import subprocess, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from engine.cuda import kernels
out, work = Path(sys.argv[1]), Path(sys.argv[2])
def one(b):
    stem = "tu_" + b.label().replace(" ", "_").replace("=", "-")
    src = work / f"{stem}.cu"
    src.write_text(b.instantiation_source())
    p = subprocess.run([sys.argv[3], "-arch=sm_90", "--ptx", "-o", str(out / f"{b.label()}.ptx"),
                        *kernels.options(b), str(src)], capture_output=True, text=True)
    return b.label(), p.returncode, p.stderr[-2000:]
with ThreadPoolExecutor(int(sys.argv[4])) as ex:
    for label, rc, err in ex.map(one, kernels.builds()):
        if rc:
            sys.exit(f"{label} does not compile:\n{err}")
"""


def functions(ptx: str) -> dict[str, str]:
    """A PTX module split at each .entry / .func header: {name: its text}; the text before the first under
    '<header>' (globals, tables)."""
    parts = re.split(r"(?m)^(?=(?:\.visible |\.weak |\.extern )?\.(?:entry|func) )", ptx)
    out = {"<header>": parts[0]}
    for p in parts[1:]:
        m = re.search(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)", p)
        out[m.group(1) if m else p[:80]] = p
    return out


def compare(a: dict[str, str], b: dict[str, str]) -> tuple[list[str], list[str]]:
    """(identical names, differing names: changed, added or removed)."""
    names = sorted(set(a) | set(b))
    return [n for n in names if a.get(n) == b.get(n)], [n for n in names if a.get(n) != b.get(n)]


def dump(tree: Path, out: Path, nvcc: str, jobs: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        env = dict(os.environ, PYTHONPATH=str(tree))
        subprocess.run([sys.executable, "-c", _DUMP, str(out), work, nvcc, str(jobs)], cwd=tree, env=env, check=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="main", help="git ref to compare against (default main)")
    ap.add_argument("--expect", default="", help="comma-separated: the only strings a differing function may name")
    ap.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"))
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    expect = [s for s in args.expect.split(",") if s]
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        base = d / "ref"
        base.mkdir()
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", args.ref, "engine", "cuda_src"], check=True,
                             capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=tar, check=True)
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda t: dump(t[0], t[1], args.nvcc, max(1, args.jobs // 2)),
                        [(base, d / "ptx_ref"), (ROOT, d / "ptx_here")]))
        unexpected = 0
        for f in sorted((d / "ptx_here").glob("*.ptx")):
            g = d / "ptx_ref" / f.name
            if not g.exists():
                print(f"{f.stem}: new build")
                continue
            same, diff = compare(functions(g.read_text()), functions(f.read_text()))
            bad = [n for n in diff if not any(e in n or e in f.stem for e in expect)] if expect else []
            unexpected += len(bad)
            print(f"{f.stem}: {len(same)} identical" + (f", {len(diff)} differ" if diff else "")
                  + (f", UNEXPECTED: {' '.join(bad)}" if bad else ""))
        for g in sorted((d / "ptx_ref").glob("*.ptx")):
            if not (d / "ptx_here" / g.name).exists():
                print(f"{g.stem}: build removed")
    if expect:
        print(f"{'no' if not unexpected else unexpected} function(s) differ outside {', '.join(expect)}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
