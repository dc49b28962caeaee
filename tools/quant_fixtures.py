"""llama.cpp's own Q2_0, Q1_0 and NVFP4 blocks and floats, for tests/test_quant_blocks.py (made once, committed).

    python -m tools.quant_fixtures [--out tests/fixtures/quants/llama_blocks.npz]
    python -m tools.quant_fixtures --check          # remake in memory and compare with the committed file

Drives the anchor wheel's libggml-base.so (../shared/anchors, llama.cpp 0c1e570) through ctypes, unpacked from
the wheel into a temporary folder: ggml_quantize_chunk (what llama-quantize calls per tensor) on float rows, and
the type traits' to_float (what every ggml backend's dequantization is checked against) on those blocks and on
random ones. It also records ggml's ids, block sizes and byte sizes and llama.h's file types for these types, as
the wheel's own headers and library state them. Inputs are random rows at several sizes plus edge cases (zeros of
either sign, scales that overflow or underflow fp16 and UE4M3, ties between codes, inf and NaN); the blocks to
dequantize are random bytes with every fp16 scale class and all 256 UE4M3 scale bytes.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "quants" / "llama_blocks.npz"
WHEEL = ROOT.parent / "shared" / "anchors" / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
TYPES = {"NVFP4": (64, 36), "Q1_0": (128, 18), "Q2_0": (64, 18)}   # what the wheel must confirm
FTYPES = ("NVFP4", "Q1_0", "Q2_0")                                  # LLAMA_FTYPE_MOSTLY_*
SEED = 290


class _Traits(ctypes.Structure):   # struct ggml_type_traits (ggml.h)
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class Ggml:
    """libggml-base.so of the wheel: header facts, ggml_quantize_chunk and to_float."""

    def __init__(self, wheel: Path = WHEEL):
        if not wheel.is_file():
            raise SystemExit(f"quant_fixtures: llama.cpp's wheel is not at {wheel}; put it there (../shared/anchors)")
        self._dir = tempfile.TemporaryDirectory(prefix="ggml-")
        with zipfile.ZipFile(wheel) as z:
            lib = z.extract("llama_cpp/lib/libggml-base.so", self._dir.name)
            ggml_h = z.read("include/ggml.h").decode()
            llama_h = z.read("include/llama.h").decode()
        self.ids = {n: int(re.search(rf"GGML_TYPE_{n}\s*=\s*(\d+)", ggml_h).group(1)) for n in TYPES}
        self.ftypes = {n: int(re.search(rf"LLAMA_FTYPE_MOSTLY_{n}\s*=\s*(\d+)", llama_h).group(1)) for n in FTYPES}
        self.lib = ctypes.CDLL(lib)
        self.lib.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
        self.lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self.lib.ggml_row_size.restype = ctypes.c_size_t
        self.lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]

    def traits(self, name: str) -> _Traits:
        return self.lib.ggml_get_type_traits(self.ids[name]).contents

    def quantize(self, name: str, x: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        rows, n = x.shape
        rb = self.lib.ggml_row_size(self.ids[name], n)
        out = np.full((rows, rb), 0xAB, np.uint8)            # poisoned: every byte must be written
        im = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
        got = self.lib.ggml_quantize_chunk(self.ids[name], x.ctypes.data, out.ctypes.data, 0, rows, n,
                                           None if im is None else im.ctypes.data)
        assert got == out.nbytes, (name, got, out.nbytes)
        return out

    def to_float(self, name: str, blocks: np.ndarray) -> np.ndarray:
        t = self.traits(name)
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
        n = blocks.size // t.type_size * t.blck_size
        out = np.full(n, np.nan, np.float32)                  # poisoned
        _TO_FLOAT(t.to_float)(blocks.ctypes.data, out.ctypes.data, n)
        return out.reshape(*blocks.shape[:-1], -1)


# --- inputs -----------------------------------------------------------------------------------------------------

def special_rows(name: str, block: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One block each (NVFP4: four sub-blocks of 16, so cases differ per sub-block): the edges of each format."""
    g = lambda: rng.standard_normal(block).astype(np.float32)   # noqa: E731
    rows = {
        "zeros": np.zeros(block), "negzeros": -np.zeros(block), "signed_zeros": np.where(g() > 0, 0.0, -0.0),
        "constant": np.full(block, 0.75), "negative_constant": np.full(block, -3.0),
        "one_nonzero": np.eye(block)[block // 3] * -2.5,
        "huge_over_f16": g() * 1e30, "at_f16_max": np.clip(g(), -1, 1) * 65504.0, "over_f16_max": g() * 7e4,
        "tiny_under_f16": g() * 1e-30, "f16_subnormal": g() * 1e-6, "f32_subnormal": g() * 1e-40,
        "wide_exponents": np.sign(g()) * 2.0 ** rng.uniform(-30, 30, block),
        "integers": rng.integers(-3, 4, block).astype(np.float64),
        "with_inf": np.where(np.arange(block) == 5, np.inf, g()), "with_neg_inf": np.where(np.arange(block) == 0,
                                                                                           -np.inf, g()),
        "with_nan": np.where(np.arange(block) % 7 == 2, np.nan, g()), "all_nan": np.full(block, np.nan),
        "all_negative_nan": np.full(block, -np.nan),
    }
    if name == "Q2_0":
        # x = +-amax/2 exactly and a hair either side: roundf's half-away-from-zero and 1/d's rounding
        half = np.float32(0.5)
        rows["halves"] = np.tile(np.array([1.0, half, -half, np.nextafter(half, 1), np.nextafter(-half, -1),
                                           np.nextafter(half, 0), 0.25, -1.0], np.float32), block // 8)
        rows["thirds"] = np.tile(np.array([3.0, 1.5, -1.5, 1.4999999, 0.1, -3.0, 1.0, 2.0]), block // 8)
    if name == "Q1_0":
        # sums whose float32 order matters: large and small magnitudes mixed
        rows["mixed_magnitudes"] = np.where(np.arange(block) % 2 == 0, 1e4, 1e-3) * np.sign(g())
    if name == "NVFP4":
        # sub-block scales around UE4M3's edges: the subnormal range (max/6 < 2^-6), the rounding carry, 448
        amax = np.array([6 * 2.0 ** -6 * (1 - 2 ** -10), 6 * 2.0 ** -6, 6 * 7.5 * 2.0 ** -9, 6 * 2.0 ** -10,
                         6 * 1.9375, 6 * 255.0, 6 * 300.0, 6 * 448.0, 6 * 1e6, 6 * 2.0 ** -12, 6 * 3.96875,
                         6 * 0.5 * 2.0 ** -9])
        for i in range(0, len(amax), 4):
            sub = np.stack([np.clip(g()[:16], -1, 1) for _ in range(4)])
            sub[:, 3] = 1.0
            rows[f"scale_edges_{i // 4}"] = (sub * amax[i:i + 4, None]).reshape(-1)
        # values at the midpoints between the E2M1 codes (d = 0.5 exactly: amax 6 -> UE4M3 1.0)
        mids = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
                         -6.0])
        rows["midpoints"] = np.tile(mids, 4)
        rows["near_midpoints"] = np.tile(np.nextafter(mids.astype(np.float32), 0), 4)
    return {k: np.asarray(v, dtype=np.float32).reshape(1, block) for k, v in rows.items()}


def random_inputs(block: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"normal_1x1": rng.standard_normal((1, block)),
            "normal_2x2": rng.standard_normal((2, 2 * block)) * 0.02,
            "scaled_2x3": rng.standard_normal((2, 3 * block)) * np.array([[1e-3], [40.0]]),
            "uniform_2x1": rng.uniform(-1, 1, (2, block)),
            # any float32 bit pattern: every exponent, infinities, NaNs with payloads
            "any_bits_2x1": rng.integers(0, 2 ** 32, (2, block), dtype=np.uint64).astype(np.uint32).view(np.float32)}


def random_blocks(name: str, nbytes: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks to dequantize: random bytes; Q2_0/Q1_0 with every fp16 class of scale, NVFP4 every scale byte."""
    if name == "NVFP4":
        b = rng.integers(0, 256, (64, nbytes), dtype=np.uint8)
        b[:64, :4] = np.arange(256, dtype=np.uint8).reshape(64, 4)
        return b
    d_bits = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00,
              0x7E00, 0x7C01, 0xFE00]
    b = rng.integers(0, 256, (len(d_bits) + 17, nbytes), dtype=np.uint8)
    finite = rng.standard_normal(17) * 10.0 ** rng.uniform(-7, 4, 17)
    with np.errstate(over="ignore"):
        d = np.concatenate([np.array(d_bits, np.uint16).view(np.float16), finite.astype(np.float16)])
    b[:, :2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    return b


def make(ggml: Ggml) -> dict[str, np.ndarray]:
    """{T}_x / {T}_blocks / {T}_y: every case's input rows, llama.cpp's blocks of them and its floats of those,
    flattened and concatenated in facts["cases"][T]'s order ([case, rows, values a row]); {T}_dequant_blocks /
    {T}_dequant_y: blocks to dequantize and llama.cpp's floats of them."""
    rng = np.random.default_rng(SEED)
    arrays: dict[str, np.ndarray] = {}
    facts = {"made_with": "llama.cpp 0c1e570 (llama-cpp-python 0.3.36's vendor/llama.cpp), the anchor wheel's "
                          "libggml-base.so: ggml_quantize_chunk without an importance matrix, type traits' to_float",
             "ggml_type": ggml.ids, "llama_ftype": ggml.ftypes, "sizes": {}, "imatrix_changes_nothing": {},
             "cases": {}}
    for name, (block, nbytes) in TYPES.items():
        t = ggml.traits(name)
        facts["sizes"][name] = [int(t.blck_size), int(t.type_size)]
        cases = {**random_inputs(block, rng), **special_rows(name, block, rng)}
        xs, qs, ys = [], [], []
        for case, x in cases.items():
            x = np.asarray(x, dtype=np.float32)
            q = ggml.quantize(name, x)
            xs.append(x.reshape(-1))
            qs.append(q.reshape(-1))
            ys.append(ggml.to_float(name, q).reshape(-1))
            facts["cases"].setdefault(name, []).append([case, int(x.shape[0]), int(x.shape[1])])
        arrays[f"{name}_x"], arrays[f"{name}_blocks"], arrays[f"{name}_y"] = map(np.concatenate, (xs, qs, ys))
        x = cases["scaled_2x3"].astype(np.float32)
        same = ggml.quantize(name, x, rng.uniform(0.1, 10, x.shape[1]))
        facts["imatrix_changes_nothing"][name] = bool(np.array_equal(same, ggml.quantize(name, x)))
        b = random_blocks(name, nbytes, rng)
        arrays[f"{name}_dequant_blocks"] = b
        arrays[f"{name}_dequant_y"] = ggml.to_float(name, b)
    arrays["facts"] = np.frombuffer(json.dumps(facts, sort_keys=True).encode(), dtype=np.uint8)
    return arrays


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.quant_fixtures", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--wheel", type=Path, default=WHEEL)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)
    with np.errstate(all="ignore"):
        arrays = make(Ggml(args.wheel))
    if args.check:
        old = np.load(args.out)
        bad = [k for k in arrays if k not in old or old[k].tobytes() != arrays[k].tobytes()]
        bad += [k for k in old if k not in arrays]
        print(f"quant_fixtures: {len(arrays) - len(bad)} of {len(arrays)} arrays equal"
              + (f"; differ: {', '.join(bad[:8])}" if bad else ""))
        return 1 if bad else 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    print(f"quant_fixtures: wrote {args.out} ({args.out.stat().st_size:,} bytes, {len(arrays)} arrays)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
