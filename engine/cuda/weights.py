"""The model's non-expert weights in VRAM, each matrix in its GGUF quant format (the kernels dequantize as they read);
norm weights and biases as float32. The token embedding may instead live in mapped pinned host memory, read in place
over PCIe (engine/cuda/embed_place.py decides when). A layer's weights are its family's dataclass
(engine/cuda/families/), loaded through Upload."""
from __future__ import annotations

from dataclasses import dataclass, field

import cupy as cp
import numpy as np

from engine.cuda.arena import PinnedBuffer
from engine.cuda.quant_types import qtype


@dataclass
class DevMatrix:
    data: cp.ndarray        # uint8 (rows, row_bytes); in VRAM, or a view of `host` through its device address
    qt: int                 # ggml type id
    rows: int
    cols: int
    row_bytes: int
    host: PinnedBuffer | None = None    # the mapped pinned memory behind data, when the matrix is on the host

    @property
    def ptr(self) -> int:
        return int(self.data.data.ptr)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def where(self) -> str:
        return "vram" if self.host is None else "host"

    def close(self):
        """Frees a host copy (the caller makes sure no kernel reads it any more); VRAM goes with the last reference."""
        if self.host is not None:
            self.data = None
            self.host.close()


def _shape(t):
    q = qtype(t.qtype)                      # ValueError naming the type when no kernel handles it
    rows = int(np.prod(t.shape[:-1]))
    cols = int(t.shape[-1])
    return q, rows, cols, q.row_bytes(cols)


def upload_matrix(t) -> DevMatrix:
    q, rows, cols, rb = _shape(t)
    data = cp.asarray(np.ascontiguousarray(t.data).reshape(rows, rb))
    return DevMatrix(data, q.id, rows, cols, rb)


def host_matrix(t) -> DevMatrix:
    """t's bytes, the same as upload_matrix's, in mapped pinned host memory: kernels take the same pointer argument
    and read the rows they need in place over PCIe. Pinning failures raise (CUDARuntimeError / RuntimeError)."""
    q, rows, cols, rb = _shape(t)
    buf = PinnedBuffer(rows * rb)
    try:
        buf.view[:] = np.ascontiguousarray(t.data).reshape(-1)
        mem = cp.cuda.UnownedMemory(buf.dptr, rows * rb, buf, cp.cuda.Device().id)
        data = cp.ndarray((rows, rb), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
    except BaseException:
        buf.close()
        raise
    return DevMatrix(data, q.id, rows, cols, rb, host=buf)


@dataclass
class DeviceWeights:
    tok_embd: DevMatrix
    output: DevMatrix
    output_norm: cp.ndarray
    layers: list = field(default_factory=list)      # the family's layer dataclasses (engine/cuda/families/)

    def place_embedding(self, model, where: str) -> str | None:
        """Moves token_embd to "host" (mapped pinned memory) or back to "vram"; None when done, else why it stayed
        (pinning failed: it stays in VRAM). Nothing may be reading the old copy (the decode step not yet built, or
        closed and synchronized)."""
        old = self.tok_embd
        if old.where == where:
            return None
        if old is self.output:
            raise ValueError("the token embedding is tied to the output head, which reads all of it every token: it "
                             "stays in VRAM")
        t = model.tensor("token_embd.weight")
        if where == "host":
            try:
                self.tok_embd = host_matrix(t)
            except (cp.cuda.runtime.CUDARuntimeError, RuntimeError) as e:
                return f"pinning {old.nbytes / 2**20:.0f} MiB of host memory failed ({e})"
        else:
            self.tok_embd = upload_matrix(t)
        old.close()
        return None

    def close(self):
        """Frees host-resident matrices (after the last kernel that reads them)."""
        self.tok_embd.close()

    def qtype_ids(self) -> set[int]:
        ids = {self.tok_embd.qt, self.output.qt}
        for L in self.layers:
            ids |= {m.qt for m in L.matrices()}
        return ids


class Upload:
    """How a family's layer loader puts a model's tensors on the device, in the order it asks for them: f32 (norm
    weights, biases: float32 arrays), mat (a matrix in its quant format), rows (some of a matrix's rows). asarray:
    where the bytes go (cupy.asarray; the CPU tests pass numpy.asarray)."""

    def __init__(self, model, asarray=None):
        self.model = model
        self.asarray = asarray or cp.asarray

    def has(self, name: str) -> bool:
        return self.model.has(name)

    def f32(self, name: str, shape=(-1,)):
        return self.asarray(self.model.dequant(name).reshape(shape).astype(np.float32))

    def opt_f32(self, name: str):
        return self.f32(name) if self.model.has(name) else None

    def mat(self, name: str) -> DevMatrix:
        t = self.model.tensor(name)
        q, rows, cols, rb = _shape(t)
        return DevMatrix(self.asarray(np.ascontiguousarray(t.data).reshape(rows, rb)), q.id, rows, cols, rb)

    def rows(self, name: str, rows: np.ndarray) -> DevMatrix:
        """Some rows of tensor `name` (in the given order), from its quantized bytes: rows are independent."""
        t = self.model.tensor(name)
        q, n, cols, rb = _shape(t)
        data = np.ascontiguousarray(t.data).reshape(n, rb)[np.asarray(rows, dtype=np.int64)]
        return DevMatrix(self.asarray(np.ascontiguousarray(data)), q.id, len(rows), cols, rb)


def load_weights(model, load_layer, up: Upload | None = None) -> DeviceWeights:
    """The token embedding, the output head and norm, then load_layer(up, i) for every layer (the family's loader,
    engine/cuda/families/: a dataclass with a matrices() method)."""
    cfg = model.config
    up = up or Upload(model)
    tok = up.mat("token_embd.weight")
    out = tok if cfg.tied_embeddings else up.mat("output.weight")
    dw = DeviceWeights(tok_embd=tok, output=out, output_norm=up.f32("output_norm.weight"))
    for i in range(cfg.n_layer):
        dw.layers.append(load_layer(up, i))
    return dw
