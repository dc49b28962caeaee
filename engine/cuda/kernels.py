"""Compile and cache the cuda_src/*.cu modules (CuPy RawModule through NVRTC, for the current device's architecture).

Each .cu file declares the variants the engine builds in comment lines, so the loader and the no-GPU compile test
(tests/test_cuda_compile.py) read one list:

    // @build per-qtype            one variant per quant type, with -DSTRATA_QT=<ggml id> (matvec.cu, dequant.cu)
    // @build HEAD_DIM=128 NQ=4    one variant with these defines (any number of such lines)
    (no @build line)               one variant without defines

A kernel template over a quant type names its parameter QT (`template <int QT> __global__ void mv(...)`): every
variant instantiates it for each quant type (NVRTC name expressions `mv<12>`; the nvcc test takes their addresses), so
a template that does not compile for some type fails the test even before a model of that type is loaded.
A kernel over two types names them QG and QU (`template <int QG, int QU>`: gate and up of a layer that differ):
instantiated for the `pairs` a model holds, or, in the compile test, for a few representative pairs (CHECK_PAIRS).
`compile_all()` builds every declared variant (or those for the model's quant types) before the worker prints READY,
so no kernel compiles mid-request. `load(name, defines)` returns the cached module for any defines, declared or not.
"""
from __future__ import annotations

import hashlib
import re
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from engine.cuda.quant_types import QTYPES, qtype

CUDA_SRC = Path(__file__).resolve().parents[2] / "cuda_src"
SMEM_DEFAULT = 48 * 1024     # dynamic shared memory a kernel gets without opting in
SMEM_MAX = 227 * 1024        # the most a block may opt in to (sm_80 / sm_90)


def staged_bytes(n: int) -> int:
    """Shared memory for n floats staged by common.cuh stage_x (Q4_K's padded layout: 4 floats per 64)."""
    return 4 * (n + 4 * (n // 64))

STD = "-std=c++17"
_BUILD_RE = re.compile(r"^\s*//\s*@build\b(.*)$")
_QT_TEMPLATE_RE = re.compile(r"template\s*<\s*int\s+QT\s*>\s*(?:__launch_bounds__\s*\([^)]*\)\s*)?"
                             r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(\w+)\s*\(")
_QT2_TEMPLATE_RE = re.compile(r"template\s*<\s*int\s+QG\s*,\s*int\s+QU\s*>\s*(?:__launch_bounds__\s*\([^)]*\)\s*)?"
                              r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(\w+)\s*\(")


@dataclass(frozen=True)
class Build:
    """One module to compile: cuda_src/<name>.cu with these defines."""
    name: str
    defines: tuple[tuple[str, str], ...] = ()
    instances: tuple[str, ...] = ()  # template instantiations, e.g. "mv<12>"

    @property
    def path(self) -> Path:
        return CUDA_SRC / f"{self.name}.cu"

    def define_args(self) -> list[str]:
        return [f"-D{k}={v}" if v != "" else f"-D{k}" for k, v in self.defines]

    def label(self) -> str:
        return self.name + "".join(f" {k}={v}" for k, v in self.defines)

    def instantiation_source(self) -> str:
        """This build as one nvcc translation unit: the file, then a host function taking the address of every
        template instance (which makes nvcc compile each one, as NVRTC's name expressions do)."""
        refs = "".join(f"    out[{i}] = (void*)&{e};\n" for i, e in enumerate(self.instances))
        tail = f"void strata_instantiate_all(void** out) {{\n{refs}}}\n" if self.instances else ""
        return f'#include "{self.path.name}"\n{tail}'


def _norm_defines(defines) -> tuple[tuple[str, str], ...]:
    items = defines.items() if isinstance(defines, dict) else (defines or ())
    return tuple(sorted((str(k), str(v)) for k, v in items))


# The compile test's pairs: the one-type kernels already compile every type's code, so these check the mixing itself
# (Q4_K's own tile path on either side, a float type, an i-quant, a legacy quant).
CHECK_PAIRS = (("Q4_K", "Q5_K"), ("Q6_K", "Q4_K"), ("BF16", "Q6_K"), ("IQ4_XS", "Q8_0"))


def type_pairs(qtypes=None, pairs=None) -> list[tuple[int, int]]:
    """(gate, up) type-id pairs to instantiate: `pairs` when given; none for a model's `qtypes` without pairs;
    CHECK_PAIRS for all types (the compile test)."""
    if pairs is None and qtypes is not None:
        return []
    return sorted({(qtype(a).id, qtype(b).id) for a, b in (CHECK_PAIRS if pairs is None else pairs)})


def parse_builds(path: Path, qtypes=None, pairs=None) -> list[Build]:
    """The variants a .cu file declares; per-qtype variants only for `qtypes` (names or ids) when given; two-type
    kernels for `pairs` (type_pairs)."""
    wanted = None if qtypes is None else {qtype(t).name for t in qtypes}
    text = path.read_text()
    ids = [q.id for q in QTYPES.values() if wanted is None or q.name in wanted]
    instances = tuple(f"{k}<{i}>" for k in _QT_TEMPLATE_RE.findall(text) for i in ids)
    instances += tuple(f"{k}<{a}, {b}>" for k in _QT2_TEMPLATE_RE.findall(text) for a, b in type_pairs(qtypes, pairs))
    out: list[Build] = []
    declared = False
    for line in text.splitlines():
        m = _BUILD_RE.match(line)
        if not m:
            continue
        declared = True
        words = m.group(1).split()
        per_qtype = "per-qtype" in words
        fixed = []
        for w in words:
            if w == "per-qtype":
                continue
            k, eq, v = w.partition("=")
            if not re.fullmatch(r"[A-Za-z_]\w*", k):
                raise ValueError(f"{path.name}: bad @build define {w!r}; write NAME=VALUE")
            fixed.append((k, v if eq else ""))
        if per_qtype:
            for q in QTYPES.values():
                if wanted is None or q.name in wanted:
                    out.append(Build(path.stem, _norm_defines(fixed + [("STRATA_QT", str(q.id))]), instances))
        else:
            out.append(Build(path.stem, _norm_defines(fixed), instances))
    if not declared:
        out.append(Build(path.stem, (), instances))
    return out


def builds(qtypes=None) -> list[Build]:
    """Every variant of every cuda_src/*.cu, in file order."""
    return [b for p in sorted(CUDA_SRC.glob("*.cu")) for b in parse_builds(p, qtypes)]


@lru_cache(maxsize=1)
def _headers_digest() -> str:
    # CuPy's on-disk cache keys on the source text and the options, not on included headers: a digest of every
    # header as a define makes a header edit recompile everything that includes it.
    h = hashlib.sha256()
    for p in sorted(CUDA_SRC.glob("*.cuh")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def options(build: Build) -> tuple[str, ...]:
    """NVRTC options for a build (the nvcc compile test uses the same defines and standard)."""
    return (STD, f"-I{CUDA_SRC}", f"-DSTRATA_HEADERS={_headers_digest()}", *build.define_args())


_modules: dict[Build, object] = {}


def load(name: str, defines=None, qtypes=None, pairs=None):
    """The compiled cupy.RawModule for cuda_src/<name>.cu with these defines (compiled once per process); its QT
    templates are instantiated for `qtypes` (all types when None): get them with get_function("mv<12>"); its
    two-type ones for `pairs` (get_function("k<12, 14>"))."""
    path = CUDA_SRC / f"{name}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"no kernel source {path}; the cuda_src/ folder is incomplete")
    instances = parse_builds(path, qtypes, pairs)[0].instances
    build = Build(name, _norm_defines(defines), instances)
    mod = _modules.get(build)
    if mod is not None:
        return mod
    import cupy

    mod = cupy.RawModule(code=path.read_text(), options=options(build), name_expressions=instances or None)
    try:
        mod.compile()  # NVRTC runs here, not at the first launch
    except cupy.cuda.compiler.CompileException as e:
        first = next((ln for ln in str(e).splitlines() if "error" in ln), str(e).splitlines()[0] if str(e) else "")
        raise RuntimeError(f"kernel {build.label()} does not compile: {first.strip()}") from e
    _modules[build] = mod
    return mod


def function(name: str, kernel: str, defines=None):
    """One kernel (cupy RawKernel) of cuda_src/<name>.cu."""
    return load(name, defines).get_function(kernel)


def quant_function(name: str, kernel: str, t, **defines):
    """A kernel of a per-qtype module (matvec.cu, dequant.cu) for quant type t (name, id or GGMLQuantizationType)."""
    return function(name, kernel, {**defines, "STRATA_QT": qtype(t).id})


def compile_all(qtypes=None, log=sys.stderr) -> int:
    """Compile every declared variant (per-qtype ones only for `qtypes` when given); returns how many."""
    t0 = time.perf_counter()
    todo = builds(qtypes)
    for b in todo:
        load(b.name, dict(b.defines), qtypes)
    if log is not None:
        print(f"kernels: {len(todo)} modules ready in {time.perf_counter() - t0:.1f} s", file=log, flush=True)
    return len(todo)


MATVEC_ROWS = {1: (1, 2, 4), 2: (1, 2), 3: (1, 2), 4: (1, 2), 5: (1, 2), 6: (1, 2), 7: (1, 2), 8: (1, 2)}
MATVEC_WARPS = 4  # warps per block in matvec.cu


# Types whose mat-vec ran faster with two rows per warp on 8192 x 8192 (bench/matvec.py on the H200, 2026-11-29);
# the K-quants and the 2-bit i-quants, with more registers per row, ran fastest with one.
_TWO_ROW_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q6_K", "IQ4_NL", "IQ3_S", "MXFP4"}


def matvec_plan(nrows: int, nv: int = 1, rows_per_warp: int | None = None, qtype_=None,
                ncols: int | None = None) -> tuple[str, tuple[int], tuple[int], int]:
    """(kernel name, grid, block, rows per warp) for matvec.cu. Without rows_per_warp, the choice follows the H200
    measurements: several vectors or short rows (<= 1024 columns, many rows) gain from sharing each x chunk across
    rows; single vectors over long rows gain only for the simple types; small matrices need one row per warp so that
    enough warps run."""
    if nv not in MATVEC_ROWS:
        raise ValueError(f"matvec takes 1 to 8 vectors at once, got {nv}")
    if rows_per_warp is None:
        name = qtype(qtype_).name if qtype_ is not None else None
        if nv > 1:
            rows_per_warp = 2 if nrows >= 8192 else 1
        elif ncols is not None and ncols <= 1024 and nrows >= 32768:
            rows_per_warp = 4
        elif name in _TWO_ROW_TYPES and nrows >= 8192:
            rows_per_warp = 2
        else:
            rows_per_warp = 1
    r = max(x for x in MATVEC_ROWS[nv] if x <= rows_per_warp)
    per_block = MATVEC_WARPS * r
    return f"matvec_r{r}_nv{nv}", ((nrows + per_block - 1) // per_block,), (32 * MATVEC_WARPS,), r
