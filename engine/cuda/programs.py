"""Compile the engine's kernels (cuda_src/*.cu) with NVRTC through cupy.RawModule, once per model, before READY.

The sources are inlined into one translation unit here (each `#include "x"` of cuda_src pasted once), so CuPy's
on-disk kernel cache keys on the full text: an edit to quant.cuh recompiles, a repeated start does not. Templated
kernels are instantiated only for the quant types the model holds.
"""
from __future__ import annotations

import re
from pathlib import Path

import cupy as cp

SRC_DIR = Path(__file__).resolve().parents[2] / "cuda_src"
FILES = ("dense.cu", "norm_rope.cu", "attention.cu", "router.cu", "moe.cu", "sample.cu")
TEMPLATED = ("mv", "mv3", "swiglu_mv", "embed", "dequant_rows", "moe_gate_up", "moe_down", "router_fused",
             "moe_proj")
OPTIONS = ("-std=c++17",)
PLAIN = ("rmsnorm", "qk_rope_store", "router_topk", "argmax_word", "argmax_finish")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)".*$', re.M)


def source_text(files=FILES) -> str:
    """One translation unit: every local include pasted once, in order (#pragma once lines dropped)."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (SRC_DIR / name).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return "\n".join(expand(f) for f in files)


class Kernels:
    """kernel(name) for plain kernels, kernel(name, qt) for the templated ones (qt: ggml type id)."""

    def __init__(self, qtype_ids):
        self.qtype_ids = sorted({int(q) for q in qtype_ids})
        names = [f"{k}<{q}>" for k in TEMPLATED for q in self.qtype_ids]
        self.module = cp.RawModule(code=source_text(), options=OPTIONS, name_expressions=names)
        self._cache: dict = {}
        # Load everything now, so no kernel is compiled or loaded in the middle of a request or a graph capture.
        for n in names + list(PLAIN):
            self.module.get_function(n)

    def __call__(self, name: str, qt: int | None = None, tag: str | None = None):
        key = (name, qt)
        f = self._cache.get(key)
        if f is None:
            f = self.module.get_function(f"{name}<{int(qt)}>" if qt is not None else name)
            self._cache[key] = f
        return f
