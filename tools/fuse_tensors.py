"""Rewrite a GGUF as other converters write it: attn_q/k/v -> attn_qkv (weights and biases), ffn_gate_exps +
ffn_up_exps -> ffn_gate_up_exps (per expert, the gate rows then the up rows), [1, n] tensors as 1-D.

    python -m tools.fuse_tensors SRC.gguf DST.gguf [--no-qkv] [--no-gate-up] [--drop-unit-dims]

llama.cpp 0c1e570 loads both forms (create_tensor_qkv, create_tensor_gate_up_exps in src/llama-model.cpp); the
tests use this to check that our loaders do too. The bytes are copied, not requantized: quant blocks never cross
a row, so stacking rows of one type is exact. Parts of different types cannot be fused: refused.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGUFValueType

from engine import quant_types
from engine.gguf_model import read_header
from engine.quant_types import QT as Q, SIZES


def fuse(src: Path, dst: Path, qkv: bool = True, gate_up: bool = True, drop_unit_dims: bool = False) -> Path:
    """drop_unit_dims: store [1, n] tensors as 1-D [n], as llama-quantize writes them (ggml_n_dims)."""
    h = read_header(src)
    mm = np.memmap(src, dtype=np.uint8, mode="r")
    raw = {}
    for t in h.tensors:
        q = Q(t.type_id)
        block, size = SIZES[q]
        shape = tuple(reversed(t.dims))
        row = shape[-1] // block * size
        n = row * int(np.prod(shape[:-1], dtype=np.int64))
        start = h.data_offset + t.offset
        raw[t.name] = (q, shape, np.asarray(mm[start:start + n]).reshape(*shape[:-1], row))
    out: dict[str, tuple] = {}
    for name, (q, shape, data) in raw.items():
        stem = name.rsplit(".", 2)[0] + "."
        if qkv and name.endswith(("attn_q.weight", "attn_q.bias")):
            suffix = name.rsplit(".", 1)[1]
            parts = [raw[f"{stem}attn_{p}.{suffix}"] for p in "qkv"]
            _same_type(parts, name)
            out[f"{stem}attn_qkv.{suffix}"] = (q, None, np.concatenate([p[2] for p in parts], axis=0))
        elif qkv and name.endswith(("attn_k.weight", "attn_v.weight", "attn_k.bias", "attn_v.bias")):
            continue
        elif gate_up and name.endswith("ffn_gate_exps.weight"):
            parts = [raw[name], raw[f"{stem}ffn_up_exps.weight"]]
            _same_type(parts, name)
            out[f"{stem}ffn_gate_up_exps.weight"] = (q, None, np.concatenate([p[2] for p in parts], axis=1))
        elif gate_up and name.endswith("ffn_up_exps.weight"):
            continue
        elif drop_unit_dims and len(shape) == 2 and shape[0] == 1:
            out[name] = (q, None, data.reshape(-1))
        else:
            out[name] = (q, shape, data)
    arch = h.metadata["general.architecture"]
    w = gguf.GGUFWriter(Path(dst), arch)
    for key, value in h.metadata.items():
        if key in ("general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"):
            continue
        types = h.types[key]
        w.add_key_value(key, value, types[0], sub_type=types[1] if types[0] == GGUFValueType.ARRAY else None)
    for name, (q, _, data) in out.items():
        quant_types.add_tensor(w, name, data, q)     # GGUFWriter's own table lacks Q2_0
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)


def _same_type(parts, name):
    if len({p[0] for p in parts}) != 1:
        raise SystemExit(f"fuse_tensors: the parts of {name} differ in type ({', '.join(p[0].name for p in parts)}); "
                         f"they cannot share one tensor")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.fuse_tensors", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--no-qkv", action="store_true")
    ap.add_argument("--no-gate-up", action="store_true")
    ap.add_argument("--drop-unit-dims", action="store_true", help="write [1, n] tensors as 1-D, as llama-quantize does")
    a = ap.parse_args(argv)
    fuse(a.src, a.dst, qkv=not a.no_qkv, gate_up=not a.no_gate_up, drop_unit_dims=a.drop_unit_dims)
    print(f"wrote {a.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
