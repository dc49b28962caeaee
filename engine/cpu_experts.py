"""CPU experts: one token's routed experts of one layer computed on the CPU, straight from their quantized rows.

The decode step sends some of a layer's VRAM misses here instead of over PCIe (engine/cpu_share.py chooses which).
An ExpertTable says where every (layer, expert)'s gate, up and down rows are in host memory: the pinned arena's
blobs (from_blobs: gate | up | down at the layer's offsets) or the memory-mapped GGUF (from_model), each layer
with its own quant types (llama-quantize's recipes mix them), plus gpt-oss's biases and clamped SwiGLU.

experts_ffn(table, layer, ids, weights, x, out) writes sum_e weights[e] * expert_e(x) into out, as the NumPy
backend's moe_ffn (engine/arch/base.py) and gpt-oss's ffn compute it, exact to float32 rounding:
- "numba" (engine/cpu_expert_kernels.py), when numba is installed: each row's codes dotted with x without a
  float32 copy of the row, threads over rows, the result the same for any thread count;
- "numpy": the reference itself, rows dequantized (engine.gguf_model.dequantize) and float32 matmuls. It reads
  every type the engine does, so a new quant type works here first and gets a kernel when it needs speed.
engine/cpu_expert_pool.py runs experts_ffn beside the caller.

The addresses are the caller's promise: memory that stays mapped while the table is used (from_blobs and from_model
keep a reference to what owns it; the arena's owner keeps the arena open).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from types import ModuleType

import gguf
import numpy as np

from engine.arch import family, gptoss
from engine.arch.base import silu
from engine.gguf_model import dequantize

# ggml type id -> (values a block, bytes a block) of every type the engine reads: gguf's table, and Q1_0 / Q2_0,
# which gguf 0.19 lacks (ggml-common.h of llama.cpp 0c1e570)
QUANT_BLOCKS: dict[int, tuple[int, int]] = {int(t): s for t, s in gguf.GGML_QUANT_SIZES.items()}
QUANT_BLOCKS.update({41: (128, 18), 42: (64, 18)})

ACTIVATIONS = ("swiglu", "swiglu_oai")
BACKENDS = ("numba", "numpy")
_FAMILY_ACTIVATION: dict[ModuleType, str] = {gptoss: "swiglu_oai"}
BLOB_ALIGN = 256            # the pinned arena's blob stride alignment (engine/cuda/expert_layout.py ALIGN)


def row_bytes(qt: int, n: int) -> int:
    if qt not in QUANT_BLOCKS:
        raise ValueError(f"quant type id {qt} is not one ggml has")
    values, nbytes = QUANT_BLOCKS[qt]
    if n % values:
        raise ValueError(f"rows of {n} values are not whole blocks of quant type {qt} ({values} values)")
    return n // values * nbytes


@dataclass(frozen=True)
class LayerTypes:
    """One layer's expert quant types (ggml ids) and the bytes of one row of each."""
    gate: int
    up: int
    down: int
    rb_gate: int
    rb_up: int
    rb_down: int

    @classmethod
    def of(cls, gate: int, up: int, down: int, n_ff: int, n_embd: int) -> "LayerTypes":
        return cls(int(gate), int(up), int(down), row_bytes(gate, n_embd), row_bytes(up, n_embd),
                   row_bytes(down, n_ff))

    def expert_bytes(self, n_ff: int, n_embd: int) -> int:
        return n_ff * (self.rb_gate + self.rb_up) + n_embd * self.rb_down


@dataclass
class ExpertTable:
    """Host addresses of every expert's rows: gate[l, e], up[l, e], down[l, e] (int64, 0 where layer l has no
    experts or the expert is not in host memory), each layer's types, the activation and gpt-oss's biases."""
    n_ff: int
    n_embd: int
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    types: tuple[LayerTypes | None, ...]          # None: a layer without routed experts
    activation: str = "swiglu"
    biases: tuple | None = None                    # per layer (gate (E, n_ff), up (E, n_ff), down (E, n_embd)) f32
    keep: tuple = ()                               # what owns the memory the addresses point into

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: one of {', '.join(ACTIVATIONS)}")
        shape = (len(self.types), self.gate.shape[1] if self.gate.ndim == 2 else 0)
        for name in ("gate", "up", "down"):
            a = getattr(self, name)
            if a.shape != shape or a.dtype != np.int64:
                raise ValueError(f"ExpertTable.{name} must be int64 of shape {shape}, not {a.dtype} {a.shape}")

    @property
    def n_layer(self) -> int:
        return len(self.types)

    @property
    def n_expert(self) -> int:
        return self.gate.shape[1]

    def expert_bytes(self, layer: int) -> int:
        """The bytes of one expert of this layer (what computing it reads)."""
        t = self.types[layer]
        return 0 if t is None else t.expert_bytes(self.n_ff, self.n_embd)

    @classmethod
    def from_model(cls, model, activation: str | None = None) -> "ExpertTable":
        """The experts where the memory-mapped GGUF holds them (engine.gguf_model.GGUFModel)."""
        cfg = model.config
        L, E = cfg.n_layer, cfg.n_expert
        addr = {k: np.zeros((L, E), np.int64) for k in ("gate", "up", "down")}
        types, keep = [], []
        for il in range(L):
            if not cfg.is_moe_layer(il):
                types.append(None)
                continue
            ts = [model.tensor(model.expert_name(il, k)) for k in ("gate", "up", "down")]
            types.append(LayerTypes.of(*(int(t.qtype) for t in ts), cfg.n_ff_exp, cfg.n_embd))
            for kind, t in zip(("gate", "up", "down"), ts):
                d = t.data
                if d.shape[0] != E or d.strides[2] != 1 or d.strides[1] != d.shape[2]:
                    raise ValueError(f"{t.name}: an expert's rows are not contiguous in the file ({d.strides})")
                addr[kind][il] = d.ctypes.data + np.arange(E, dtype=np.int64) * d.strides[0]
                keep.append(d)
        return cls(cfg.n_ff_exp, cfg.n_embd, addr["gate"], addr["up"], addr["down"], tuple(types),
                   activation or model_activation(model), model_biases(model), tuple(keep))

    @classmethod
    def from_blobs(cls, host_ptr: np.ndarray, layouts, n_expert: int, activation: str = "swiglu",
                   biases=None, keep=()) -> "ExpertTable":
        """The experts in pinned-arena blobs: host_ptr[layer * n_expert + e] the blob's host address (0: none),
        layouts[layer] its layout (engine/cuda/expert_layout.py's BlobLayout: qt_gate_up, up_type, qt_down,
        up_off, down_off, n_ff, n_embd), or None for a layer without experts."""
        host_ptr = np.asarray(host_ptr, dtype=np.uint64).astype(np.int64)
        L = len(layouts)
        if host_ptr.shape != (L * n_expert,):
            raise ValueError(f"host_ptr has {host_ptr.size} entries for {L} layers of {n_expert} experts")
        base = host_ptr.reshape(L, n_expert)
        some = next((lay for lay in layouts if lay is not None), None)
        if some is None:
            raise ValueError("no layer has experts")
        n_ff, n_embd = some.n_ff, some.n_embd
        types, gate, up, down = [], np.zeros_like(base), np.zeros_like(base), np.zeros_like(base)
        for il, lay in enumerate(layouts):
            if lay is None:
                types.append(None)
                continue
            t = LayerTypes.of(lay.qt_gate_up, lay.up_type, lay.qt_down, n_ff, n_embd)
            if (lay.up_off, lay.down_off) != (n_ff * t.rb_gate, n_ff * (t.rb_gate + t.rb_up)):
                raise ValueError(f"layer {il}'s blob layout puts up at {lay.up_off} and down at {lay.down_off}, "
                                 f"not where gate | up | down rows of its types end")
            types.append(t)
            have = base[il] != 0
            gate[il] = np.where(have, base[il], 0)
            up[il] = np.where(have, base[il] + lay.up_off, 0)
            down[il] = np.where(have, base[il] + lay.down_off, 0)
        return cls(n_ff, n_embd, gate, up, down, tuple(types), activation, biases, tuple(keep))


@dataclass(frozen=True)
class PackedLayout:
    """A blob layout as the pinned arena's (engine/cuda/expert_layout.py BlobLayout's fields from_blobs reads)."""
    qt_gate_up: int
    up_type: int
    qt_down: int
    up_off: int
    down_off: int
    n_ff: int
    n_embd: int
    stride: int


def pack_blobs(model) -> tuple[np.ndarray, np.ndarray, list]:
    """Every expert of a GGUF as one blob (gate | up | down) in a host buffer laid out as the pinned arena lays
    out its chunks, without CUDA: (buffer, host_ptr per layer * n_expert + e, per-layer layouts). For tests and
    benches of the blob path; the engine's arena is engine/cuda/arena.py."""
    cfg = model.config
    layouts, sizes = [], []
    for il in range(cfg.n_layer):
        if not cfg.is_moe_layer(il):
            layouts.append(None)
            sizes.append(0)
            continue
        ts = [model.tensor(model.expert_name(il, k)) for k in ("gate", "up", "down")]
        t = LayerTypes.of(*(int(x.qtype) for x in ts), cfg.n_ff_exp, cfg.n_embd)
        nbytes = t.expert_bytes(cfg.n_ff_exp, cfg.n_embd)
        stride = (nbytes + BLOB_ALIGN - 1) // BLOB_ALIGN * BLOB_ALIGN
        layouts.append(PackedLayout(t.gate, t.up, t.down, cfg.n_ff_exp * t.rb_gate,
                                    cfg.n_ff_exp * (t.rb_gate + t.rb_up), cfg.n_ff_exp, cfg.n_embd, stride))
        sizes.append(stride)
    E = cfg.n_expert
    buf = np.zeros(sum(sizes) * E + BLOB_ALIGN, np.uint8)
    start = (-buf.ctypes.data) % BLOB_ALIGN
    host_ptr = np.zeros(cfg.n_layer * E, np.uint64)
    off = start
    for il, lay in enumerate(layouts):
        if lay is None:
            continue
        tens = [model.tensor(model.expert_name(il, k)).data for k in ("gate", "up", "down")]
        for e in range(E):
            host_ptr[il * E + e] = buf.ctypes.data + off
            for t, o in zip(tens, (0, lay.up_off, lay.down_off)):
                src = np.ascontiguousarray(t[e]).reshape(-1)
                buf[off + o:off + o + src.size] = src
            off += lay.stride
    return buf, host_ptr, layouts


def model_activation(model) -> str:
    """The activation between an expert's gate/up and down in this model's family."""
    cfg = model.config
    return _FAMILY_ACTIVATION.get(family(cfg.arch, cfg.is_moe), "swiglu")


def model_biases(model):
    """gpt-oss's expert biases per layer, float32 (gate (E, n_ff), up, down (E, n_embd)); None when it has none."""
    cfg = model.config
    if not any(model.has(f"blk.{il}.ffn_gate_exps.bias") for il in range(cfg.n_layer)):
        return None
    return tuple((tuple(model.dequant(f"blk.{il}.ffn_{k}_exps.bias") for k in ("gate", "up", "down"))
                  if cfg.is_moe_layer(il) else None) for il in range(cfg.n_layer))


# --- computing ----------------------------------------------------------------------------------------------------

def _kernels():
    """engine.cpu_expert_kernels, or None when numba is not installed."""
    try:
        from engine import cpu_expert_kernels
    except ImportError as e:
        if getattr(e, "name", None) not in ("numba", "llvmlite"):
            raise
        return None
    return cpu_expert_kernels


def default_backend() -> str:
    return "numba" if _kernels() is not None else "numpy"


def check_backend(backend: str) -> str:
    """'auto' -> the best one here; else the name itself, if it can run here."""
    if backend == "auto":
        return default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"CPU expert backend {backend!r}: one of auto, {', '.join(BACKENDS)}")
    if backend == "numba" and _kernels() is None:
        raise ValueError("the numba CPU expert kernels need numba (pip install numba); or use backend numpy")
    return backend


def check_call(table: ExpertTable, layer: int, ids, weights, x, out) -> tuple[np.ndarray, np.ndarray]:
    """ids as int64 and weights as float32 (k,) after checking every argument; ValueError says what is wrong."""
    ids, weights, _ = _checked(table, layer, ids, weights, x, out)
    return ids, weights


def _checked(table, layer, ids, weights, x, out):
    """check_call's work, and the experts' (gate, up, down) addresses it gathered on the way. Written for a call's
    cost: row views, then one gather each, and Python's min / max of a list (a decode layer's call: 18 -> ~6 us)."""
    if not 0 <= layer < table.n_layer or table.types[layer] is None:
        raise ValueError(f"layer {layer} has no routed experts (the table has {table.n_layer} layers)")
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    weights = np.asarray(weights, dtype=np.float32).reshape(-1)
    if ids.size != weights.size:
        raise ValueError(f"{ids.size} expert ids but {weights.size} weights")
    listed = ids.tolist()
    if listed and (min(listed) < 0 or max(listed) >= table.n_expert):
        raise ValueError(f"expert ids {listed} outside 0..{table.n_expert - 1}")
    if len(set(listed)) != len(listed):
        raise ValueError(f"expert ids {listed} repeat one")
    g, u, d = table.gate[layer][ids], table.up[layer][ids], table.down[layer][ids]
    if listed and not (g.all() and d.all()):
        missing = ids[(g == 0) | (d == 0)]
        raise ValueError(f"layer {layer}: experts {missing.tolist()} are not in host memory (no address)")
    for name, a in (("x", x), ("out", out)):
        if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == (table.n_embd,)
                and a.flags.c_contiguous):
            raise ValueError(f"{name} must be a contiguous float32 array of shape ({table.n_embd},)")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    return ids, weights, (g, u, d)


def experts_ffn(table: ExpertTable, layer: int, ids, weights, x: np.ndarray, out: np.ndarray,
                backend: str = "auto", ahead: int | None = None) -> np.ndarray:
    """out[:] = sum over e of weights[e] * expert ids[e] of `layer` applied to x; returns out.

    The numba backend uses numba's thread count (numba.set_num_threads, per calling thread); ahead: its software
    prefetch distance in rows (None: engine/cpu_expert_kernels.py AHEAD; 0: none), for bench.cpu_experts' A/B."""
    ids, weights, (g, u, d) = _checked(table, layer, ids, weights, x, out)
    backend = check_backend(backend)
    if ids.size == 0:
        out[:] = 0
        return out
    if backend == "numpy":
        return _numpy_ffn(table, layer, ids, weights, x, out)
    K = _kernels()
    t = table.types[layer]
    empty = np.zeros((0, 0), np.float32)
    bg = bu = bd = empty
    if table.biases is not None and table.biases[layer] is not None:
        bg, bu, bd = (np.ascontiguousarray(b[ids], dtype=np.float32) for b in table.biases[layer])
    h = np.empty((ids.size, table.n_ff), np.float32)
    act = K.ACT_SWIGLU_OAI if table.activation == "swiglu_oai" else K.ACT_SWIGLU
    K.ffn_experts(g, u, d, t.gate, t.up, t.down, t.rb_gate, t.rb_up, t.rb_down, table.n_ff, table.n_embd, x, weights,
                  act, gptoss.SWIGLU_ALPHA, gptoss.SWIGLU_LIMIT, bg, bu, bd, h, out,
                  K.AHEAD if ahead is None else int(ahead))
    return out


def _rows(addr: int, n_rows: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * (n_rows * nbytes)).from_address(int(addr))).reshape(n_rows,
                                                                                                       nbytes)


def _numpy_ffn(table, layer, ids, weights, x, out):
    """The NumPy backend's own arithmetic (engine/arch/base.py moe_ffn, gptoss.GptOss.ffn), one token."""
    t = table.types[layer]
    F, D = table.n_ff, table.n_embd
    act = gptoss.swiglu_oai if table.activation == "swiglu_oai" else (lambda g, u: silu(g) * u)
    biases = table.biases[layer] if table.biases is not None else None
    acc = np.zeros(D, np.float32)
    xr = x[None, :]
    for e, w in zip(ids.tolist(), weights):
        g = xr @ dequantize(_rows(table.gate[layer, e], F, t.rb_gate), t.gate).T
        u = xr @ dequantize(_rows(table.up[layer, e], F, t.rb_up), t.up).T
        if biases is not None:
            g, u = g + biases[0][e], u + biases[1][e]
        y = act(g, u) @ dequantize(_rows(table.down[layer, e], D, t.rb_down), t.down).T
        if biases is not None:
            y = y + biases[2][e]
        acc += w * y[0]
    out[:] = acc
    return out
