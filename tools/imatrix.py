"""Importance matrices, as llama-imatrix makes them, for the recipes that need one (IQ2_XXS, IQ3_XXS).

llama-imatrix is a program, not part of the llama-cpp-python wheel; what it computes is simple, so we compute it:
for every matrix product of the forward pass, the sum over tokens of each input column squared (per expert for
the 3-D expert stacks, over the tokens routed to that expert) and the token count. The forward is
tools.exact_forward's (float64; llama-imatrix sees llama.cpp's own activations, which differ by rounding only).
llama_model_quantize takes the per-column means (sums / count, 1 where an expert saw no token, as llama-quantize
loads a GGUF imatrix): write_imatrix stores those for tools/llama_worker.py, write_gguf_imatrix stores the sums
and counts in llama-imatrix's own GGUF format (`<tensor>.in_sum2`, `<tensor>.counts`), for llama-quantize.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Stat:
    sums: np.ndarray              # (n_mat, n_in) float64: sum of squared inputs per column
    counts: np.ndarray            # (n_mat,) tokens seen per matrix (expert)

    def means(self) -> np.ndarray:
        out = np.ones_like(self.sums)
        seen = self.counts > 0
        out[seen] = self.sums[seen] / self.counts[seen, None]
        return out


@dataclass
class IMatrix:
    stats: dict[str, Stat] = field(default_factory=dict)
    n_tokens: int = 0
    chunk_size: int = 0


def compute_imatrix(model: Path, prompt_ids: list[list[int]]) -> IMatrix:
    """Activation statistics of every weight matrix over these prompts (each its own sequence)."""
    from tools.exact_forward import _Weights, exact_logits
    w = _Weights(Path(model))
    n_mat = {name: (int(t.shape[2]) if len(t.shape) == 3 else 1) for name, t in w.t.items()}
    im = IMatrix(chunk_size=max(len(p) for p in prompt_ids))

    def collect(name, x, expert=None):
        x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        st = im.stats.get(name)
        if st is None:
            st = im.stats[name] = Stat(np.zeros((n_mat[name], x.shape[-1])), np.zeros(n_mat[name], np.int64))
        e = 0 if expert is None else expert
        st.sums[e] += np.sum(x * x, axis=0)
        st.counts[e] += len(x)

    for p in prompt_ids:
        exact_logits(model, p, collect)
        im.n_tokens += len(p)
    return im


def write_imatrix(path: Path, im: IMatrix) -> Path:
    """The exchange file tools/llama_worker.py reads: per tensor (u32 name length, name, u64 n, n float32 means)."""
    path = Path(path)
    with open(path, "wb") as f:
        for name, st in im.stats.items():
            m = st.means().astype("<f4").reshape(-1)
            b = name.encode()
            f.write(struct.pack("<I", len(b)) + b + struct.pack("<Q", m.size) + m.tobytes())
    return path


def write_gguf_imatrix(path: Path, im: IMatrix, dataset: str = "random token ids") -> Path:
    """llama-imatrix's GGUF format: general.type imatrix, <name>.in_sum2 [n_in, n_mat], <name>.counts [1, n_mat]."""
    import gguf
    w = gguf.GGUFWriter(Path(path), arch="imatrix")
    # GGUFWriter always writes general.architecture; llama-imatrix's files carry general.type instead
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", [dataset])
    w.add_uint32("imatrix.chunk_count", max(1, im.n_tokens // max(im.chunk_size, 1)))
    w.add_uint32("imatrix.chunk_size", im.chunk_size)
    for name, st in im.stats.items():
        w.add_tensor(f"{name}.in_sum2", st.sums.astype(np.float32))
        w.add_tensor(f"{name}.counts", st.counts.astype(np.float32).reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
