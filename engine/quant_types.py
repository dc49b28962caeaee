"""The engine's quant-type table: the GGUF tensor types it reads, their ggml ids, block shapes and dequantizer.

QT is gguf's GGMLQuantizationType plus the types gguf 0.19 lacks (Q2_0 = 42, ggml.h of llama.cpp 0c1e570): an
IntEnum of the same names and values, so a QT member equals and hashes as gguf's member of that value and as the
int (dict keys, gguf.GGML_QUANT_SIZES and gguf.quants take either; tests/test_quant_types.py checks this). It is a
new enum, not a subclass (an Enum with members cannot be extended): isinstance(QT.Q4_K, GGMLQuantizationType) is
False, and gguf.GGMLQuantizationType(42) still raises, so code that meets type ids from files converts them here.

SIZES has ggml's (values a block, bytes a block) for every member. READ_TYPES is what a model file may hold for
engine.gguf_model to open it; dequantize() decodes every one of them to float32: gguf.quants where it decodes a
type as llama.cpp does (NVFP4 included: it matches llama.cpp's floats bit for bit), engine.quant_blocks for Q2_0
and Q1_0, which gguf cannot decode. quantize() is for tools and tests: engine.quant_blocks' llama.cpp-exact
quantizers for the three new types, gguf.quants' for the few it has.
"""
from __future__ import annotations

import enum

import gguf
import gguf.quants
import numpy as np

from engine import quant_blocks as qb

# ggml type ids that gguf 0.19's enum may lack (ggml.h, llama.cpp 0c1e570)
_ADDED = {"NVFP4": 40, "Q1_0": 41, "Q2_0": 42}
_GGUF = {m.name: m.value for m in gguf.GGMLQuantizationType}
for _n, _v in _ADDED.items():
    if _GGUF.get(_n, _v) != _v or any(v == _v and n != _n for n, v in _GGUF.items()):
        raise ImportError(f"the installed gguf package numbers {_n} differently from ggml ({_v}); "
                          f"install gguf==0.19")

QT = enum.IntEnum("QT", {**_GGUF, **{n: v for n, v in _ADDED.items() if n not in _GGUF}}, module=__name__,
                  qualname="QT")
QT.__doc__ = "ggml's tensor types by name and id: gguf.GGMLQuantizationType's members plus Q2_0 (42)."

_OWN_SIZES = {QT.NVFP4: (qb.NVFP4_BLOCK, qb.NVFP4_BYTES), QT.Q1_0: (qb.Q1_0_BLOCK, qb.Q1_0_BYTES),
              QT.Q2_0: (qb.Q2_0_BLOCK, qb.Q2_0_BYTES)}
SIZES: dict[QT, tuple[int, int]] = {QT(int(t)): s for t, s in gguf.GGML_QUANT_SIZES.items()}
for _t, _s in _OWN_SIZES.items():
    if SIZES.setdefault(_t, _s) != _s:
        raise ImportError(f"gguf's GGML_QUANT_SIZES gives {_t.name} {SIZES[_t]}, ggml {_s}; install gguf==0.19")

# What the engine reads (docs/design.md, section 2 of ../shared/DESIGN.md), in that list's order.
READ_NAMES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "MXFP4", "Q2_0", "Q1_0", "NVFP4")
READ_TYPES = frozenset(QT[n] for n in READ_NAMES)
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)

_DEQUANT = {QT.Q2_0: qb.dequantize_q2_0, QT.Q1_0: qb.dequantize_q1_0}
_QUANT = {QT.Q2_0: qb.quantize_q2_0, QT.Q1_0: qb.quantize_q1_0, QT.NVFP4: qb.quantize_nvfp4}


def qtype(type_id: int) -> QT:
    """QT for a ggml type id (from a file, a gguf enum member or a QT); ValueError for an id ggml does not have."""
    return QT(int(type_id))


def block_size(t) -> int:
    return SIZES[qtype(t)][0]


def row_bytes(t, n_values: int) -> int:
    """Bytes of a row of n_values values; ValueError when blocks do not tile the row."""
    block, size = SIZES[qtype(t)]
    if n_values % block:
        raise ValueError(f"{qtype(t).name} rows need a multiple of {block} values, not {n_values}")
    return n_values // block * size


def byte_shape(shape, t) -> tuple[int, ...]:
    """(..., values a row) -> (..., bytes a row)."""
    return (*shape[:-1], row_bytes(t, shape[-1]))


def value_shape(shape, t) -> tuple[int, ...]:
    """(..., bytes a row) -> (..., values a row): gguf.quants.quant_shape_from_byte_shape for every QT."""
    block, size = SIZES[qtype(t)]
    if shape[-1] % size:
        raise ValueError(f"{shape[-1]} bytes a row are not whole {qtype(t).name} blocks of {size} bytes")
    return (*shape[:-1], shape[-1] // size * block)


def dequantize(data: np.ndarray, t) -> np.ndarray:
    """Raw GGUF bytes (..., bytes a row) -> float32 (..., values a row), bit for bit as llama.cpp's to_float."""
    t = qtype(t)
    data = np.ascontiguousarray(data)
    if t == QT.F32:
        return data.view(np.float32).copy()
    own = _DEQUANT.get(t)
    if own is not None:
        return own(data).reshape(value_shape(data.shape, t))
    return np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType(int(t))), dtype=np.float32)


def quantize(values: np.ndarray, t) -> np.ndarray:
    """float values (..., values a row) -> GGUF bytes (..., bytes a row): llama.cpp's reference quantizer for
    Q2_0, Q1_0 and NVFP4 (byte for byte), gguf.quants' for the types it can quantize (NotImplementedError else)."""
    t = qtype(t)
    values = np.asarray(values)
    own = _QUANT.get(t)
    if own is not None:
        return own(values).reshape(byte_shape(values.shape, t))
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType(int(t)))


# --- writing: gguf.GGUFWriter -----------------------------------------------------------------------------------
# GGUFWriter turns a uint8 tensor's byte shape into values through gguf.GGML_QUANT_SIZES, which lacks Q2_0 (a
# KeyError). Given any other dtype it records the shape as is, so these pass the value shape with an int8 view of
# the same bytes; the type id it writes is the QT's. The file is byte for byte what the uint8 call would write.

def add_tensor_info(writer: gguf.GGUFWriter, name: str, shape, t) -> None:
    """Declare a tensor of `shape` values (numpy order, rows first) of type t, whose bytes come later
    (writer.write_tensor_data with (..., bytes a row) uint8)."""
    t = qtype(t)
    shape = tuple(int(s) for s in shape)
    nbytes = int(np.prod(byte_shape(shape, t), dtype=np.int64))
    writer.add_tensor_info(name, shape, np.dtype(np.int8), nbytes, raw_dtype=t)


def add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, t) -> None:
    """Add a tensor given as its raw bytes (..., bytes a row) uint8 of type t."""
    t = qtype(t)
    data = np.ascontiguousarray(data, dtype=np.uint8)
    writer.add_tensor(name, data.view(np.int8), raw_shape=value_shape(data.shape, t), raw_dtype=t)
