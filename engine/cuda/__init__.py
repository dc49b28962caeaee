"""The CUDA engine (CuPy). strata_worker.py uses three names, and importing this package needs no CuPy:

    add_cuda_args(parser)                      the backend's flags
    create_backend(model, max_context, args, phase)  -> engine.cuda.backend.CUDABackend (staged_backend's
                                               StagedBackend for several --gpus stages)
    available() -> (bool, reason)              whether CuPy finds a usable GPU
"""
from __future__ import annotations

import signal
from contextlib import contextmanager

from engine.cuda.args import add_cuda_args
from engine.cuda.quant_types import refuse_kernelless

_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


@contextmanager
def _signals_stay_with_python():
    """Block SIGTERM/SIGINT/SIGHUP while the CUDA driver starts its helper threads, which inherit the mask: a signal
    delivered to one of those threads never wakes Python's main thread, whose handler (the worker's clean exit on
    SIGTERM) then never runs."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def available() -> tuple[bool, str]:
    try:
        with _signals_stay_with_python():
            import cupy
            n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, no driver, no device
        first = str(e).splitlines()[0] if str(e) else ""
        return False, f"CuPy finds no GPU ({type(e).__name__}: {first})"
    if n < 1:
        return False, "CuPy finds no GPU"
    return True, f"CuPy finds {n} GPU(s)"


def create_backend(model, max_context: int, args=None, phase=None):
    """phase(name, done=, gib=, gib_s=): called as the start goes (engine/protocol.py's INFO phase lines)."""
    refuse_kernelless(model)        # a ModelError, before CuPy or any VRAM: the worker prints it as one line
    with _signals_stay_with_python():
        from engine.cuda.backend import CUDABackend, CudaOptions
        opts = CudaOptions.from_args(args) if args is not None else None
        if opts is not None and isinstance(opts.gpus, tuple) and len(opts.gpus) > 1:
            from engine.cuda.staged_backend import StagedBackend
            return StagedBackend(model, max_context, opts, phase=phase)
        return CUDABackend(model, max_context, opts, phase=phase)


__all__ = ["add_cuda_args", "available", "create_backend"]
