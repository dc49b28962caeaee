"""The CUDA engine (CuPy). strata_worker.py uses three names, and importing this package needs no CuPy:

    add_cuda_args(parser)                      the backend's flags
    create_backend(model, max_context, args)   -> engine.cuda.backend.CUDABackend
    available() -> (bool, reason)              whether CuPy finds a usable GPU
"""
from __future__ import annotations

from engine.cuda.args import add_cuda_args


def available() -> tuple[bool, str]:
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, no driver, no device
        first = str(e).splitlines()[0] if str(e) else ""
        return False, f"CuPy finds no GPU ({type(e).__name__}: {first})"
    if n < 1:
        return False, "CuPy finds no GPU"
    return True, f"CuPy finds {n} GPU(s)"


def create_backend(model, max_context: int, args=None):
    from engine.cuda.backend import CUDABackend, CudaOptions
    return CUDABackend(model, max_context, CudaOptions.from_args(args) if args is not None else None)


__all__ = ["add_cuda_args", "available", "create_backend"]
