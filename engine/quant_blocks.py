"""Q2_0, Q1_0 and NVFP4 blocks in NumPy, as llama.cpp 0c1e570 reads and writes them (ggml-common.h, ggml-quants.c).

    Q2_0  (ggml 42): 64 values, 18 bytes: fp16 d, then 2 bits a value (value j: bits 2(j%4) of byte j/4);
                     w = (q - 1) d, codes 0..3 meaning -d, 0, +d, +2d.
    Q1_0  (ggml 41): 128 values, 18 bytes: fp16 d, then 1 bit a value (value j: bit j%8 of byte j/8); w = +-d.
    NVFP4 (ggml 40): 64 values, 36 bytes: 4 UE4M3 scale bytes (one per 16 values), then 32 bytes of E2M1 nibbles
                     (sub-block s, byte s*8+j: value j in the low nibble, value j+8 in the high one).

NVFP4's scale is not fp16: UE4M3 is an unsigned 8-bit float (4 exponent bits, bias 7, 3 mantissa bits, subnormals
at exponent 0; ggml ignores the top bit and reads bytes 0x00 and 0x7F as zero), and ggml stores the E2M1 values
doubled (kvalues_fp4: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives), so its decoder halves the scale.

dequantize_* take blocks (n, block bytes) uint8 and give float32 (n, values a block); quantize_* take float32
values (n, values a block) and give the blocks, byte for byte those of quantize_row_*_ref, the code
llama-quantize runs for these types (an importance matrix changes nothing for them). Every step keeps llama.cpp's
float32 operations in its order: Q2_0 multiplies by 1/d rather than dividing and rounds half away from zero
(roundf); Q1_0 sums |x| left to right; NVFP4 picks the first code of least float32 error. Non-finite inputs give
what x86 builds of ggml give (tests/fixtures/quants holds such blocks).
"""
from __future__ import annotations

import numpy as np

Q2_0_BLOCK, Q2_0_BYTES = 64, 18
Q1_0_BLOCK, Q1_0_BYTES = 128, 18
NVFP4_BLOCK, NVFP4_BYTES, NVFP4_SUB = 64, 36, 16

# kvalues_fp4 (ggml-common.h): E2M1 magnitudes times two; codes 8..15 are the negatives (8 is zero)
FP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
_SHIFTS2 = np.array([0, 2, 4, 6], dtype=np.uint8)


def _ue4m3_table() -> np.ndarray:
    """ggml_ue4m3_to_fp32 for every byte: exact in float32 (at most 4 significant bits)."""
    x = np.arange(256)
    exp, man = (x >> 3) & 0xF, (x & 7).astype(np.float64)
    raw = np.where(exp == 0, man * 2.0 ** -9, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    raw[(x == 0) | (x == 0x7F)] = 0.0
    return (raw * 0.5).astype(np.float32)


UE4M3 = _ue4m3_table()


def _blocks(data: np.ndarray, nbytes: int) -> np.ndarray:
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if data.size % nbytes:
        raise ValueError(f"{data.size} bytes are not a whole number of {nbytes}-byte blocks")
    return data.reshape(-1, nbytes)


def _values(x: np.ndarray, block: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.size % block:
        raise ValueError(f"{x.size} values are not a whole number of {block}-value blocks")
    return x.reshape(-1, block)


def _fp16(d: np.ndarray) -> np.ndarray:
    """float32 -> fp16 bytes (n, 2), round to nearest even, overflow to inf, NaN as 0x7E00 with its sign (NumPy
    keeps the payload): GGML_FP32_TO_FP16."""
    with np.errstate(over="ignore", invalid="ignore"):
        h = d.astype("<f2").view("<u2")
    sign = (d.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)
    return np.where(np.isnan(d), sign | np.uint16(0x7E00), h).astype("<u2").view(np.uint8).reshape(-1, 2)


def _nan_max_abs(x: np.ndarray) -> np.ndarray:
    """max |x| over the last axis from 0 up, NaN never taken (ggml's `if (a > amax) amax = a`)."""
    a = np.abs(x)
    return np.where(np.isnan(a), np.float32(0), a).max(axis=-1)


# --- Q2_0 -------------------------------------------------------------------------------------------------------

def dequantize_q2_0(data: np.ndarray) -> np.ndarray:
    b = _blocks(data, Q2_0_BYTES)
    d = b[:, :2].copy().view("<f2").astype(np.float32)                # (n, 1)
    q = (b[:, 2:, None] >> _SHIFTS2) & np.uint8(3)                   # (n, 16, 4): value 4i+k at bits 2k of qs[i]
    with np.errstate(invalid="ignore"):                                # 0 * inf: NaN, as in C
        return (q.reshape(len(b), Q2_0_BLOCK).astype(np.float32) - np.float32(1)) * d


def quantize_q2_0(x: np.ndarray) -> np.ndarray:
    """d = max|x|, q = clamp(roundf(x * (1/d)) + 1, 0, 3): quantize_row_q2_0_ref."""
    x = _values(x, Q2_0_BLOCK)
    d = _nan_max_abs(x)
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        t = x * inv[:, None]                                          # float32, as w * id in C
        # roundf in float64, where |t| + 0.5 is exact (in float32 0.49999997 + 0.5 rounds up to 1)
        r = np.copysign(np.floor(np.abs(t).astype(np.float64) + 0.5), t)
        # (int) of NaN or of anything beyond int's range (1/d overflows for subnormal d) is x86's INT_MIN,
        # which the clamp turns into 0
        q = np.where(np.abs(r) < 2.0 ** 31, np.clip(r + 1, 0, 3), 0).astype(np.uint8)
    q = q.reshape(len(x), Q2_0_BLOCK // 4, 4) << _SHIFTS2
    out = np.empty((len(x), Q2_0_BYTES), np.uint8)
    out[:, :2] = _fp16(d)
    out[:, 2:] = np.bitwise_or.reduce(q, axis=2)
    return out


# --- Q1_0 -------------------------------------------------------------------------------------------------------

def dequantize_q1_0(data: np.ndarray) -> np.ndarray:
    b = _blocks(data, Q1_0_BYTES)
    # times one: ggml's fp16 conversion quiets a signalling NaN, NumPy's keeps it (Q2_0's multiply quiets it too)
    with np.errstate(invalid="ignore"):
        d = b[:, :2].copy().view("<f2").astype(np.float32) * np.float32(1)
    bits = np.unpackbits(b[:, 2:], axis=1, bitorder="little")        # value j = bit j%8 of qs[j/8]
    return np.where(bits.astype(bool), d, -d)


def quantize_q1_0(x: np.ndarray) -> np.ndarray:
    """d = mean|x| (summed left to right in float32), bit = x >= 0: quantize_row_q1_0_ref."""
    x = _values(x, Q1_0_BLOCK)
    with np.errstate(invalid="ignore", over="ignore"):               # inf - inf and NaN: as in C
        s = np.cumsum(np.abs(x), axis=1, dtype=np.float32)[:, -1]   # cumsum adds in order; sum() pairs
        d = (s / np.float32(Q1_0_BLOCK)).astype(np.float32)
        bits = x >= 0
    out = np.empty((len(x), Q1_0_BYTES), np.uint8)
    out[:, :2] = _fp16(d)
    out[:, 2:] = np.packbits(bits, axis=1, bitorder="little")
    return out


# --- NVFP4 ------------------------------------------------------------------------------------------------------

def fp32_to_ue4m3(x: np.ndarray) -> np.ndarray:
    """ggml_fp32_to_ue4m3, element-wise: 0 for x <= 0 or NaN, 0x7E (448) from 256 up, mantissa rounded half up."""
    x = np.asarray(x, dtype=np.float32)
    pos = x > 0
    xc = np.where(pos, np.minimum(x, np.float32(448)), np.float32(1)).astype(np.float32)
    bits = xc.view(np.uint32)
    e = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + 7
    sub = np.minimum((xc * np.float32(512) + np.float32(0.5)).astype(np.int32), 7)   # (int) truncates
    man = ((bits >> 20) & 7).astype(np.int32) + ((bits >> 19) & 1).astype(np.int32)
    carry = man > 7
    e_n = e + carry
    normal = np.where(e_n >= 15, 0x7E, (e_n << 3) | np.where(carry, 0, man))
    out = np.where(e <= 0, np.where(sub >= 1, sub, 0), np.where(e >= 15, 0x7E, normal))
    return np.where(pos, out, 0).astype(np.uint8)


def dequantize_nvfp4(data: np.ndarray) -> np.ndarray:
    b = _blocks(data, NVFP4_BYTES)
    n = len(b)
    d = UE4M3[b[:, :4]][:, :, None]                                  # (n, 4, 1)
    qs = b[:, 4:].reshape(n, 4, NVFP4_SUB // 2)
    codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2)   # (n, 4, 16)
    return (FP4_VALUES[codes].astype(np.float32) * d).reshape(n, NVFP4_BLOCK)


def quantize_nvfp4(x: np.ndarray) -> np.ndarray:
    """Per 16 values: scale byte = UE4M3(max|x| / 6), code = the first of the 16 with least |v*d - x|:
    quantize_row_nvfp4_ref (best_index_mxfp4)."""
    x = _values(x, NVFP4_BLOCK)
    n = len(x)
    sub = x.reshape(n, 4, NVFP4_SUB)
    with np.errstate(over="ignore"):
        ue = fp32_to_ue4m3(_nan_max_abs(sub) / np.float32(6))        # (n, 4)
    d = UE4M3[ue]
    grid = FP4_VALUES.astype(np.float32)[None, None, None, :] * d[:, :, None, None]   # (n, 4, 1, 16)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(grid - sub[:, :, :, None])
    code = np.argmin(err, axis=3).astype(np.uint8)                    # first minimum; all-NaN rows give 0, as C
    out = np.empty((n, NVFP4_BYTES), np.uint8)
    out[:, :4] = ue
    half = NVFP4_SUB // 2
    out[:, 4:] = (code[:, :, :half] | (code[:, :, half:] << np.uint8(4))).reshape(n, 32)
    return out
