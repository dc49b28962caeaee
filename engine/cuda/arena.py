"""The pinned expert arena: every expert's gate, up and down bytes as one blob in page-locked host memory, allocated
in ~1 GiB chunks and filled from the memory-mapped GGUF. Pinned memory from cudaHostAlloc is mapped into the GPU's
address space (UVA), so a kernel can read a blob in place over PCIe through its device address.

In the memory modes (--mmap-experts, --resident-budget-gib N) only the experts in `pinned` get a blob here; the
others have blob_ptr 0 and are read from the file through engine/cuda/expert_source.py's staging ring."""
from __future__ import annotations

import ctypes
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import cupy as cp
import numpy as np

from engine.cuda.quant_types import qtype

CHUNK_BYTES = 1 << 30
ALIGN = 256                     # blob stride alignment (kernels need 16; 256 keeps copies on cache lines)
HOST_ALLOC_PORTABLE, HOST_ALLOC_MAPPED = 1, 2


@dataclass(frozen=True)
class BlobLayout:
    """Where gate, up and down sit inside one expert blob (the same for every layer)."""
    qt_gate_up: int
    qt_down: int
    n_ff: int
    n_embd: int
    rb_gate_up: int            # bytes per gate/up row (n_embd values)
    rb_down: int               # bytes per down row (n_ff values)
    up_off: int
    down_off: int
    nbytes: int
    stride: int


def blob_layout(model) -> BlobLayout:
    cfg = model.config
    found = set()
    for i in range(cfg.n_layer):
        g, u, d = (model.tensor(model.expert_name(i, k)) for k in ("gate", "up", "down"))
        if g.qtype != u.qtype:
            raise ValueError(f"layer {i}: ffn_gate_exps is {g.qtype.name} but ffn_up_exps is {u.qtype.name}; "
                             f"the CUDA engine needs gate and up in one quant type")
        found.add((g.qtype, d.qtype, g.shape, d.shape))
    if len(found) != 1:
        raise ValueError("the expert tensors differ in quant type or shape between layers; the CUDA engine "
                         "needs one layout for every layer")
    (qg, qd, gshape, dshape), = found
    n_ff, n_embd = gshape[1], gshape[2]
    rb_gu = qtype(qg).row_bytes(n_embd)
    rb_d = qtype(qd).row_bytes(n_ff)
    up_off = n_ff * rb_gu
    down_off = 2 * up_off
    nbytes = down_off + n_embd * rb_d
    stride = (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return BlobLayout(int(qg), int(qd), n_ff, n_embd, rb_gu, rb_d, up_off, down_off, nbytes, stride)


def device_address(host_ptr: int) -> int:
    """The device address of mapped pinned memory (cudaPointerGetAttributes; equal to the host address under UVA)."""
    attrs = cp.cuda.runtime.pointerGetAttributes(host_ptr)
    dp = int(attrs.devicePointer)
    if not dp:
        raise RuntimeError("pinned host memory has no device address (no unified addressing?); the CUDA backend "
                           "needs a 64-bit OS and a GPU with UVA")
    return dp


def _host_view(ptr: int, size: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))


class ExpertArena:
    """blob_ptr[g] is the device address of expert g = layer * n_expert + e (mapped pinned memory)."""

    def __init__(self, model, log=lambda m: print(m, file=sys.stderr, flush=True), threads: int = 8,
                 pinned: np.ndarray | None = None, progress=None):
        # progress(done_bytes, total_bytes, seconds): called as the fill goes, for the worker's narrated start.
        cfg = model.config
        self.layout = lay = blob_layout(model)
        self.n_layer, self.n_expert = cfg.n_layer, cfg.n_expert
        self.n_total = cfg.n_layer * cfg.n_expert
        self.pinned = np.ones(self.n_total, dtype=bool) if pinned is None else np.asarray(pinned, dtype=bool)
        ids = np.flatnonzero(self.pinned)         # the experts with a blob here, packed in id order
        per_chunk = max(1, CHUNK_BYTES // lay.stride)
        self.chunks: list[int] = []           # host pointers from cudaHostAlloc
        self.views: list[np.ndarray] = []
        self.blob_ptr = np.zeros(self.n_total, dtype=np.uint64)
        self._host_ptr = np.zeros(self.n_total, dtype=np.uint64)
        left = len(ids)
        g = 0
        try:
            while left:
                n = min(per_chunk, left)
                size = n * lay.stride
                try:
                    hp = cp.cuda.runtime.hostAlloc(size, HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED)
                except cp.cuda.runtime.CUDARuntimeError as e:
                    done = sum(v.nbytes for v in self.views) / 2**30
                    raise MemoryError(
                        f"pinning host memory for the expert arena failed after {done:.1f} GiB of "
                        f"{len(ids) * lay.stride / 2**30:.1f} GiB ({e}); free RAM, or pin less: "
                        f"--resident-budget-gib {max(0.0, done - 1):.0f} (the rest is read from the model file) "
                        f"or --mmap-experts") from None
                self.chunks.append(hp)
                self.views.append(_host_view(hp, size))
                dp = device_address(hp)
                for j in range(n):
                    self.blob_ptr[ids[g + j]] = dp + j * lay.stride
                    self._host_ptr[ids[g + j]] = hp + j * lay.stride
                g += n
                left -= n
            self._fill(model, log, threads, progress)
        except BaseException:
            self.close()
            raise
        self.nbytes = len(ids) * lay.stride

    def _fill(self, model, log, threads, progress=None):
        lay = self.layout
        total = int(self.pinned.sum()) * lay.nbytes
        if not total:
            self.fill_seconds = 0.0
            return
        t0 = time.perf_counter()
        done = [0, t0]

        def one_layer(i):
            tens = [model.tensor(model.expert_name(i, k)).data for k in ("gate", "up", "down")]
            offs = (0, lay.up_off, lay.down_off)
            n = 0
            for e in range(self.n_expert):
                hp = int(self._host_ptr[i * self.n_expert + e])
                if not hp:
                    continue
                dst = _host_view(hp, lay.nbytes)
                for t, off in zip(tens, offs):
                    src = t[e].reshape(-1)
                    dst[off:off + src.size] = src
                n += lay.nbytes
            return n

        with ThreadPoolExecutor(threads) as ex:
            for nb in ex.map(one_layer, range(self.n_layer)):
                done[0] += nb
                now = time.perf_counter()
                if now - done[1] > 1.0 or done[0] == total:
                    done[1] = now
                    log(f"expert arena: {done[0] / 2**30:.1f} / {total / 2**30:.1f} GiB pinned "
                        f"({done[0] / 2**30 / max(now - t0, 1e-9):.1f} GiB/s)")
                    if progress is not None:
                        progress(done[0], total, now - t0)
        self.fill_seconds = time.perf_counter() - t0

    def close(self):
        self.views.clear()
        for hp in self.chunks:
            try:
                cp.cuda.runtime.freeHost(hp)
            except Exception:
                pass
        self.chunks.clear()


class PinnedBuffer:
    """One mapped pinned allocation (the memory modes' staging ring): a host view and the device address."""

    def __init__(self, nbytes: int):
        self.hptr = cp.cuda.runtime.hostAlloc(max(int(nbytes), 1), HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED)
        self.view = _host_view(self.hptr, max(int(nbytes), 1))
        self.dptr = device_address(self.hptr)

    def close(self):
        if self.hptr:
            self.view = None
            cp.cuda.runtime.freeHost(self.hptr)
            self.hptr = 0
