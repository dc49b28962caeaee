"""The GGUF quant types the CUDA kernels handle: ids, block shapes, and valid random blocks for tests and generators.

The kernels (cuda_src/quant.cuh) use the same ids as ggml; block sizes come from engine.quant_types.SIZES (gguf's
table plus Q2_0), except that F32/F16/BF16 (block size 1 in ggml) use pseudo-blocks of 8 elements in the kernels, so
every row is a whole number of 8-element chunks. Every type the engine reads (engine.quant_types.READ_TYPES) has
kernels, Q2_0, Q1_0 and NVFP4 included (their whole models agree with the CPU backend: tests/test_cuda_new_quants.py).
refuse_kernelless turns away, at load and with one line, a file holding a type with no kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.gguf_model import ModelError
from engine.quant_blocks import fp32_to_ue4m3
from engine.quant_types import QT, SIZES


@dataclass(frozen=True)
class QType:
    name: str              # ggml's name, e.g. "Q4_K"; also the suffix of the kernels' names (matvec_Q4_K)
    id: int                # ggml type id (template argument QT of the kernels)
    qk: int                # elements per kernel block
    block_bytes: int       # bytes per kernel block
    f16_offsets: tuple     # byte offsets of the fp16 scales inside a block (kept sane in random blocks)

    @property
    def ggml(self) -> QT:
        """The engine's enum member (gguf's by value; Q2_0 only there): what engine.quant_types.dequantize takes."""
        return QT[self.name]

    def row_bytes(self, ncols: int) -> int:
        if ncols % self.qk:
            raise ValueError(f"{self.name} rows need a multiple of {self.qk} columns, got {ncols}")
        return ncols // self.qk * self.block_bytes


# fp16 scale fields per block (everything else in a block is valid as any bytes, the i-quant grids included)
_F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "Q2_0": (0,), "Q1_0": (0,),
}

_FLOAT_QK = 8
_FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}

# The order here is the order of the kernels' instantiation lists.
NAMES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "MXFP4", "Q2_0", "Q1_0", "NVFP4")


def _make(name: str) -> QType:
    if name in _FLOAT_BYTES:
        return QType(name, int(QT[name]), _FLOAT_QK, _FLOAT_QK * _FLOAT_BYTES[name], ())
    qk, nbytes = SIZES[QT[name]]
    return QType(name, int(QT[name]), qk, nbytes, _F16_FIELDS.get(name, ()))


QTYPES: dict[str, QType] = {n: _make(n) for n in NAMES}
BY_ID: dict[int, QType] = {q.id: q for q in QTYPES.values()}


def qtype(t) -> QType:
    """QType for a name ("Q4_K"), a ggml id (12) or an enum member (gguf's or engine.quant_types.QT); ValueError
    names what is supported."""
    if not isinstance(t, str) and hasattr(t, "name"):
        t = t.name
    q = QTYPES.get(t) if isinstance(t, str) else BY_ID.get(int(t))
    if q is None:
        raise ValueError(f"quant type {t!r} has no CUDA kernel; supported: {', '.join(NAMES)}")
    return q


def refuse_kernelless(model) -> None:
    """ModelError naming the first tensor (in the model's order) whose quant type the CUDA backend does not run, before
    any VRAM is taken: the CPU backend reads every type the engine opens."""
    names = model.tensor_names()
    missing = [(n, model.tensor(n).qtype) for n in names if int(model.tensor(n).qtype) not in BY_ID]
    if missing:
        name, q = missing[0]
        kinds = sorted({m.name for _, m in missing})
        raise ModelError(f"{model.path.name}: tensor {name} is {q.name}, a quant type the CUDA backend has no kernels "
                         f"for yet ({len(missing)} tensors of {', '.join(kinds)}); use --backend cpu until the CUDA "
                         f"kernels for it land")


def random_rows(t, n_rows: int, ncols: int, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """Random valid quantized rows, shape (n_rows, row_bytes) uint8: random bytes with finite fp16 scales of about
    `scale` (positive and negative), random e8m0 exponents near 2^-6 for MXFP4, UE4M3 scales of about `scale` for
    NVFP4 (halved as decoded; at 0.02 normal and subnormal ones), normal values for the float types."""
    q = qtype(t)
    nb = q.row_bytes(ncols)
    if q.name == "F32":
        return rng.standard_normal((n_rows, ncols), dtype=np.float32).view(np.uint8)
    if q.name == "F16":
        return rng.standard_normal((n_rows, ncols)).astype(np.float16).view(np.uint8)
    if q.name == "BF16":
        f = rng.standard_normal((n_rows, ncols), dtype=np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    blocks = rng.integers(0, 256, size=(n_rows * ncols // q.qk, q.block_bytes), dtype=np.uint8)
    if q.name == "MXFP4":
        blocks[:, 0] = rng.integers(118, 126, size=blocks.shape[0], dtype=np.uint8)
    if q.name == "NVFP4":
        blocks[:, :4] = fp32_to_ue4m3(rng.uniform(0.5, 2.0, (blocks.shape[0], 4)) * scale)
    for off in q.f16_offsets:
        d = (rng.uniform(0.25, 1.0, blocks.shape[0]) * scale * rng.choice([-1.0, 1.0], blocks.shape[0]))
        blocks[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n_rows, nb)
