"""Every cuda_src/*.cu variant the engine builds (engine.cuda.kernels.builds()) compiles for sm_90 without a GPU.

Same source, defines and C++ standard as the loader; compiled to PTX with the machine's nvcc (the front end, where
source errors show; PTX keeps the whole set to about a minute on CI's two cores), else NVRTC through CuPy; skipped with
the reason only when neither exists.
"""
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.cuda import kernels

BUILDS = kernels.builds()


def _nvcc() -> str | None:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def _compile_nvcc(nvcc: str, build: kernels.Build, out_dir: str) -> str:
    stem = "tu_" + build.label().replace(" ", "_").replace("=", "-")  # not the included file's own name
    src = Path(out_dir) / f"{stem}.cu"
    src.write_text(build.instantiation_source())
    cmd = [nvcc, "-arch=sm_90", "--ptx", "-o", str(Path(out_dir) / f"{stem}.ptx"), *kernels.options(build), str(src)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    return "" if p.returncode == 0 else f"{' '.join(cmd)}\n{p.stdout}{p.stderr}"


def _compile_nvrtc(build: kernels.Build) -> str:
    from cupy.cuda import compiler
    try:
        compiler.compile_using_nvrtc(build.path.read_text(), kernels.options(build), arch="90",
                                     name_expressions=list(build.instances) or None)
    except compiler.CompileException as e:
        return str(e)
    return ""


@pytest.fixture(scope="module")
def compiled():
    """Compile every variant once, in parallel; {Build: error text or ''}."""
    nvcc = _nvcc()
    if nvcc:
        with tempfile.TemporaryDirectory() as d, ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as ex:
            return dict(zip(BUILDS, ex.map(lambda b: _compile_nvcc(nvcc, b, d), BUILDS)))
    try:
        from cupy.cuda import compiler  # noqa: F401
        _compile_nvrtc(BUILDS[0])
    except Exception as e:  # ImportError, or CuPy present but no NVRTC library
        pytest.skip(f"no nvcc on PATH or /usr/local/cuda/bin and no NVRTC through CuPy ({type(e).__name__}: {e}); "
                    "install the CUDA toolkit or set NVCC=/path/to/nvcc")
    return {b: _compile_nvrtc(b) for b in BUILDS}


def test_every_source_has_a_build():
    names = {b.name for b in BUILDS}
    assert {p.stem for p in kernels.CUDA_SRC.glob("*.cu")} == names
    assert {"matvec", "dequant"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("build", BUILDS, ids=[b.label().replace(" ", ":") for b in BUILDS])
def test_compiles_for_sm90(compiled, build):
    err = compiled[build]
    assert not err, f"{build.label()} does not compile:\n{err[-3000:]}"


def test_per_qtype_builds_follow_the_model_types():
    got = kernels.builds(["Q4_K", "Q6_K"])
    mv = [dict(b.defines)["STRATA_QT"] for b in got if b.name == "matvec"]
    assert mv == ["12", "14"]


def test_qt_templates_are_instantiated_for_every_type(tmp_path):
    p = tmp_path / "t.cu"
    p.write_text("template <int QT>\n__global__ void k1(int a) {}\ntemplate <int NV> __global__ void k2() {}\n")
    (b,) = kernels.parse_builds(p)
    assert b.instances == tuple(f"k1<{q.id}>" for q in kernels.QTYPES.values())
    assert "(void*)&k1<12>" in b.instantiation_source()


@pytest.mark.parametrize("bounds_at", ["before void", "after void", "before __global__"])
def test_qt_templates_are_found_wherever_launch_bounds_stand(tmp_path, bounds_at):
    """CUDA takes __launch_bounds__ before or after `void`; read at the wrong place it became a kernel's name."""
    lb = "__launch_bounds__(128, 5)"
    head = {"before void": f"__global__ {lb} void", "after void": f"__global__ void {lb}",
            "before __global__": f"{lb} __global__ void"}[bounds_at]
    p = tmp_path / "t.cu"
    p.write_text(f"template <int QT>\n{head} k1(int a) {{}}\n")
    (b,) = kernels.parse_builds(p)
    assert b.instances == tuple(f"k1<{q.id}>" for q in kernels.QTYPES.values())


def test_every_kernel_of_the_sources_is_found():
    """Each __global__ of the engine's files (outside comments) is a kernel the loader's pattern names (the
    per-qtype modules, matvec.cu's macro-made kernels among them, are fetched by name, not found by it)."""
    import re
    for f in kernels.ENGINE_FILES + ("moe_oss.cu",):      # the engine's, and the gptoss family's (its kernel_files)
        path = kernels.CUDA_SRC / f
        text = re.sub(r"//[^\n]*", "", path.read_text())
        names = kernels._GLOBAL_RE.findall(text)
        assert "__launch_bounds__" not in names and len(names) == text.count("__global__"), (path.name, names)


def test_bad_build_line_is_refused(tmp_path):
    p = tmp_path / "x.cu"
    p.write_text("// @build 1BAD=2\n")
    with pytest.raises(ValueError, match="bad @build define"):
        kernels.parse_builds(p)
