"""The one kernel loader: cuda_src/*.cu compiled with NVRTC through cupy.RawModule, once per process and build.

Each .cu file declares the variants it is built in, so the loader and the no-GPU compile test
(tests/test_cuda_compile.py) read one list:

    // @build per-qtype            one variant per quant type, with -DSTRATA_QT=<ggml id> (matvec.cu, dequant.cu)
    // @build HEAD_DIM=128 NQ=4    one variant with these defines (any number of such lines)
    (no @build line)               one variant without defines

A kernel template over a quant type names its parameter QT (`template <int QT> __global__ void mv(...)`): a build
instantiates it for the quant types asked (NVRTC name expressions `mv<12>`; the nvcc test takes their addresses).
A kernel over two types names them QG and QU (`template <int QG, int QU>`: gate and up of a layer that differ):
instantiated for the `pairs` a model holds, or, in the compile test, for a few representative pairs (CHECK_PAIRS).

Recompiling: CuPy's on-disk cache keys on a module's text and options, so every build carries a digest of all of
cuda_src/ as a define; an edit to any source file recompiles, a repeated start does not. `Kernels` is the engine's
table (decode and prompt-pass kernels), loaded before READY so nothing compiles mid-request or mid-capture.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from engine.cuda.quant_types import QTYPES, qtype

CUDA_SRC = Path(__file__).resolve().parents[2] / "cuda_src"
STD = "-std=c++17"
_BUILD_RE = re.compile(r"^\s*//\s*@build\b(.*)$")
# __launch_bounds__ may stand before or after `void` (CUDA takes both): a pattern that allowed only one place would
# read the other as a kernel named __launch_bounds__
_BOUNDS = r"(?:__launch_bounds__\s*\([^)]*\)\s*)?"
_KERNEL = r"__global__\s+" + _BOUNDS + r"void\s+" + _BOUNDS + r"(\w+)\s*\("
_QT_TEMPLATE_RE = re.compile(r"template\s*<\s*int\s+QT\s*>\s*" + _BOUNDS + _KERNEL)
_QT2_TEMPLATE_RE = re.compile(r"template\s*<\s*int\s+QG\s*,\s*int\s+QU\s*>\s*" + _BOUNDS + _KERNEL)


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
# (Q4_K's own tile path on either side, a float type, an i-quant, a legacy quant, llama-quantize's q2_0 recipe's
# attention, the 18- and 36-byte blocks of the newest types side by side).
CHECK_PAIRS = (("Q4_K", "Q5_K"), ("Q6_K", "Q4_K"), ("BF16", "Q6_K"), ("IQ4_XS", "Q8_0"), ("Q2_0", "Q8_0"),
               ("NVFP4", "Q1_0"))


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
def sources_digest() -> str:
    """A digest of every file in cuda_src/ (the one way a source edit forces a recompile: module docstring)."""
    h = hashlib.sha256()
    for p in sorted(CUDA_SRC.glob("*.cu*")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def options(build: Build) -> tuple[str, ...]:
    """NVRTC options for a build (the nvcc compile test uses the same defines and standard)."""
    return (STD, f"-I{CUDA_SRC}", f"-DSTRATA_SRC={sources_digest()}", *build.define_args())


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


# The engine's kernel table: these files' kernels, templated ones for the model's quant types; a family adds its own
# (engine/cuda/families/: kernel_files, e.g. gpt-oss's moe_oss.cu).
ENGINE_FILES = ("dense.cu", "norm_rope.cu", "attention.cu", "router.cu", "moe.cu", "sample.cu")
_GLOBAL_RE = re.compile(_KERNEL)


class Kernels:
    """kernels(name) for a plain kernel, kernels(name, qt) for a QT template (qt: ggml type id); `tag` names the
    launch's kind for a tracer (decode.py) and is ignored here. files: the cuda_src files of the table."""

    def __init__(self, qtype_ids, files=ENGINE_FILES):
        self.qtype_ids = sorted({int(q) for q in qtype_ids})
        self.files = tuple(files)
        self.modules = {f: load(Path(f).stem, qtypes=self.qtype_ids) for f in self.files}
        self.file_of: dict[str, str] = {}
        for f in self.files:
            for name in _GLOBAL_RE.findall((CUDA_SRC / f).read_text()):
                self.file_of.setdefault(name, f)
        self._fn: dict = {}
        # every kernel fetched now: none is loaded in the middle of a request or a graph capture
        for name, f in self.file_of.items():
            if name in _QT_TEMPLATE_RE.findall((CUDA_SRC / f).read_text()):
                for q in self.qtype_ids:
                    self(name, q)
            else:
                self(name)

    def register(self, name: str, qt, fn) -> None:
        """A kernel loaded apart (engine/cuda/launch.py load_mixed: two-type ones), then found as self(name, qt)."""
        self._fn[(name, qt)] = fn

    def __call__(self, name: str, qt: int | None = None, tag: str | None = None):
        key = (name, qt)
        f = self._fn.get(key)
        if f is None:
            if name not in self.file_of:
                raise KeyError(f"no kernel {name!r} in {', '.join(self.files)}")
            mod = self.modules[self.file_of[name]]
            f = mod.get_function(f"{name}<{int(qt)}>" if qt is not None else name)
            self._fn[key] = f
        return f
