"""The architectures this engine runs (GGUF `general.architecture`): open_model refuses every other one.

FAMILIES is the registry of the reference engine: the modules of engine/arch/ that each run a family, in the order
they are offered. Each declares the architectures it serves as a literal `ARCHS = (...)` at its top; this module
reads that literal from the source, without importing the module, so that setup reads the same lists before the
packages (NumPy, gguf) are installed: the catalog offers exactly what the backend it would use accepts.
engine/arch/__init__.py imports the same modules to run them.
"""
from __future__ import annotations

import ast
from pathlib import Path

FAMILIES = ("dense", "qwen2moe", "qwen3moe", "gptoss", "qwen3next", "qwen4exp")


def declared_archs(module: Path) -> tuple[str, ...]:
    """The literal ARCHS tuple a family module assigns at its top level, read from its source."""
    for node in ast.parse(module.read_text(encoding="utf-8"), str(module)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ARCHS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise ImportError(f"{module} assigns no literal ARCHS = (...); every module in engine/supported.py FAMILIES must")


_ARCH_DIR = Path(__file__).resolve().parent / "arch"
# llama appears twice (dense, and qwen3moe for the files with experts): listed once, where it first appears
SUPPORTED_ARCHS = tuple(dict.fromkeys(a for f in FAMILIES for a in declared_archs(_ARCH_DIR / f"{f}.py")))

# What the CUDA backend runs: its own declaration (a family runs there once engine/cuda has its kernels), a subset
# of SUPPORTED_ARCHS. The others run on the CPU backend (the NumPy reference) only: right, but far too slow for the
# sizes these models come in, so setup never offers them for a GPU.
CUDA_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gpt-oss", "qwen3next", "qwen35moe")
# What the CUDA backend runs but setup does not offer for a GPU yet: a family whose first version awaits its
# measurements on the GPU machine (engine/cuda/families/qwen4exp.py). The worker runs them on CUDA when asked
# (--backend cuda or auto: runs_on(..., preview=True)); setup's catalog keeps recommending what CUDA_ARCHS lists.
CUDA_PREVIEW_ARCHS = ("qwen4exp",)


def runs_on(arch: str, backend: str, preview: bool = False) -> bool:
    """Whether `backend` ("cuda" or "cpu") runs architecture `arch`; preview: counting CUDA_PREVIEW_ARCHS."""
    if backend == "cuda":
        return arch in CUDA_ARCHS or (preview and arch in CUDA_PREVIEW_ARCHS)
    return arch in SUPPORTED_ARCHS


def archs_for(backend: str) -> tuple[str, ...]:
    return CUDA_ARCHS if backend == "cuda" else SUPPORTED_ARCHS
