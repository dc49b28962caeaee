"""Where gate, up and down sit in each layer's expert blob (ExpertLayout), and how the VRAM expert cache splits its
slots between blob sizes (SlotPools). No CuPy: the arithmetic is tested on the CPU.

llama-quantize's recipes give layers their own expert types (Q4_K_M: ffn_down_exps in Q6_K on the first and last
eighth of the layers and every third between; community quants mix gate and up and keep some layers at Q8_0 or
BF16), so a blob's size and its tensors' offsets are per layer. Kernel launches carry their layer's types and
offsets; host memory packs blobs at their layer's stride; VRAM slots come in one pool per stride (SlotPools).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.cuda.quant_types import qtype

ALIGN = 256                     # blob stride alignment (kernels need 16; 256 keeps copies on cache lines)


@dataclass(frozen=True)
class BlobLayout:
    """Where gate, up and down sit inside one layer's expert blob (gate | up | down, each the GGUF's rows)."""
    qt_gate_up: int            # gate's quant type (up's too unless qt_up says otherwise)
    qt_down: int
    n_ff: int
    n_embd: int
    rb_gate_up: int            # bytes per gate row (n_embd values)
    rb_down: int               # bytes per down row (n_ff values)
    up_off: int
    down_off: int
    nbytes: int
    stride: int
    qt_up: int = -1            # up's quant type when it differs from gate's (-1: the same)
    rb_up: int = 0             # bytes per up row when qt_up is set

    @property
    def up_type(self) -> int:
        return self.qt_gate_up if self.qt_up < 0 else self.qt_up


@dataclass(frozen=True)
class ExpertLayout:
    """Every layer's BlobLayout. A llama-quantize recipe gives layers their own types (Q4_K_M: ffn_down_exps in Q6_K
    on a third of the layers), so blob sizes differ by layer; `stride` and `nbytes` are the largest (what a slot
    that may hold any expert needs: the staging rings and the prefetch's banks)."""
    layers: tuple[BlobLayout, ...]

    def layer(self, li: int) -> BlobLayout:
        return self.layers[li]

    @property
    def uniform(self) -> bool:
        return len(set(self.layers)) == 1

    @property
    def stride(self) -> int:
        return max(lay.stride for lay in self.layers)

    @property
    def nbytes(self) -> int:
        return max(lay.nbytes for lay in self.layers)

    @property
    def n_ff(self) -> int:
        return self.layers[0].n_ff

    @property
    def n_embd(self) -> int:
        return self.layers[0].n_embd

    def strides(self) -> np.ndarray:
        """Blob stride per layer."""
        return np.array([lay.stride for lay in self.layers], dtype=np.int64)

    def expert_strides(self, n_expert: int) -> np.ndarray:
        """Blob stride per global expert (layer * n_expert + e)."""
        return np.repeat(self.strides(), n_expert)

    def qtype_ids(self) -> set[int]:
        return {q for lay in self.layers for q in (lay.qt_gate_up, lay.up_type, lay.qt_down)}


def layer_layout(qg, qu, qd, n_ff: int, n_embd: int) -> BlobLayout:
    """One layer's blob from its gate, up and down quant types (names, ids or gguf types)."""
    qg, qu, qd = qtype(qg), qtype(qu), qtype(qd)
    rb_g, rb_u, rb_d = qg.row_bytes(n_embd), qu.row_bytes(n_embd), qd.row_bytes(n_ff)
    up_off = n_ff * rb_g
    down_off = up_off + n_ff * rb_u
    nbytes = down_off + n_embd * rb_d
    stride = (nbytes + ALIGN - 1) // ALIGN * ALIGN
    mixed = qu.id != qg.id
    return BlobLayout(qg.id, qd.id, n_ff, n_embd, rb_g, rb_d, up_off, down_off, nbytes, stride,
                      qu.id if mixed else -1, rb_u if mixed else 0)


def blob_layout(model) -> ExpertLayout:
    cfg = model.config
    layers, shapes = [], set()
    for i in range(cfg.n_layer):
        g, u, d = (model.tensor(model.expert_name(i, k)) for k in ("gate", "up", "down"))
        shapes.add((g.shape, u.shape, d.shape))
        if len(shapes) > 1 or g.shape != u.shape:
            raise ValueError(f"layer {i}: the expert tensors' shapes differ from the other layers' or between gate "
                             f"and up; the CUDA engine needs one expert shape")
        try:
            layers.append(layer_layout(g.qtype, u.qtype, d.qtype, g.shape[1], g.shape[2]))
        except ValueError as e:
            raise ValueError(f"layer {i}'s experts: {e}") from None
    return ExpertLayout(tuple(layers))


class SlotPools:
    """The cache's pools: one per distinct blob stride (ascending), with the experts each holds. Pure arithmetic,
    tested on the CPU."""

    def __init__(self, expert_stride):
        es = np.asarray(expert_stride, dtype=np.int64)
        self.strides, self.expert_pool = np.unique(es, return_inverse=True)
        self.expert_pool = self.expert_pool.astype(np.int64)
        self.counts = np.bincount(self.expert_pool, minlength=len(self.strides)).astype(np.int64)
        # The order in which slots go to the pools as the cache grows: pool p's j-th slot comes at (j + 1) / N_p,
        # so the first n slots give every pool about the share n / N of its N_p experts, and a larger cache never
        # has fewer slots in any pool (the split is monotone, unlike rounding n * N_p / N each time).
        keys = np.concatenate([(np.arange(n) + 1) / n for n in self.counts])
        pools = np.repeat(np.arange(len(self.counts)), self.counts)
        self.sequence = pools[np.lexsort((pools, keys))]
        self.cum_bytes = np.cumsum(self.strides[self.sequence])

    @property
    def n_pools(self) -> int:
        return len(self.strides)

    @property
    def n_total(self) -> int:
        return int(self.counts.sum())

    def split(self, n: int) -> np.ndarray:
        """Slots per pool for a cache of n slots."""
        n = max(0, min(int(n), self.n_total))
        return np.bincount(self.sequence[:n], minlength=self.n_pools).astype(np.int64)

    def bytes_of(self, n: int) -> int:
        n = max(0, min(int(n), self.n_total))
        return int(self.cum_bytes[n - 1]) if n else 0

    def slots_for_bytes(self, nbytes: float) -> int:
        """The most slots whose split fits in nbytes."""
        return int(np.searchsorted(self.cum_bytes, nbytes, side="right")) if nbytes > 0 else 0
