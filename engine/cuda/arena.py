"""The pinned expert arena: every expert's gate, up and down bytes as one blob in page-locked host memory, allocated
in ~1 GiB chunks and filled from the memory-mapped GGUF. Pinned memory from cudaHostAlloc is mapped into the GPU's
address space (UVA), so a kernel can read a blob in place over PCIe through its device address.

In the memory modes (--mmap-experts, --resident-budget-gib N) only the experts in `pinned` get a blob here; the
others have blob_ptr 0 and are read from the file through engine/cuda/expert_source.py's staging ring.

Each layer has its own blob layout (ExpertLayout): gate, up and down may each have any quant type the kernels know,
per layer, as llama-quantize's recipes write them. Blobs are packed at their layer's stride, so the arena holds no
padding beyond the 256-byte alignment."""
from __future__ import annotations

import ctypes
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import cupy as cp
import numpy as np

from engine.cuda.expert_layout import blob_layout

CHUNK_BYTES = 1 << 30
HOST_ALLOC_PORTABLE, HOST_ALLOC_MAPPED = 1, 2


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
    """blob_ptr[g] is the device address of expert g = layer * n_expert + e (mapped pinned memory); its blob takes
    expert_stride[g] bytes (its layer's stride)."""

    def __init__(self, model, log=lambda m: print(m, file=sys.stderr, flush=True), threads: int = 8,
                 pinned: np.ndarray | None = None, progress=None):
        # progress(done_bytes, total_bytes, seconds): called as the fill goes, for the worker's narrated start.
        cfg = model.config
        self.layout = lay = blob_layout(model)
        self.n_layer, self.n_expert = cfg.n_layer, cfg.n_expert
        self.n_total = cfg.n_layer * cfg.n_expert
        self.expert_stride = lay.expert_strides(cfg.n_expert)
        self.pinned = np.ones(self.n_total, dtype=bool) if pinned is None else np.asarray(pinned, dtype=bool)
        ids = np.flatnonzero(self.pinned)         # the experts with a blob here, packed in id order
        sizes = self.expert_stride[ids]
        total = int(sizes.sum())
        self.chunks: list[int] = []           # host pointers from cudaHostAlloc
        self.views: list[np.ndarray] = []
        self.blob_ptr = np.zeros(self.n_total, dtype=np.uint64)
        self._host_ptr = np.zeros(self.n_total, dtype=np.uint64)
        g = 0
        try:
            while g < len(ids):
                # as many whole blobs as fit in a chunk (at least one)
                ends = np.cumsum(sizes[g:])
                n = max(1, int(np.searchsorted(ends, CHUNK_BYTES, side="right")))
                size = int(ends[n - 1])
                try:
                    hp = cp.cuda.runtime.hostAlloc(size, HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED)
                except cp.cuda.runtime.CUDARuntimeError as e:
                    done = sum(v.nbytes for v in self.views) / 2**30
                    raise MemoryError(
                        f"pinning host memory for the expert arena failed after {done:.1f} GiB of "
                        f"{total / 2**30:.1f} GiB ({e}); free RAM, or pin less: "
                        f"--resident-budget-gib {max(0.0, done - 1):.0f} (the rest is read from the model file) "
                        f"or --mmap-experts") from None
                self.chunks.append(hp)
                self.views.append(_host_view(hp, size))
                dp = device_address(hp)
                offs = np.concatenate([[0], ends[:n - 1]]).astype(np.uint64)
                self.blob_ptr[ids[g:g + n]] = np.uint64(dp) + offs
                self._host_ptr[ids[g:g + n]] = np.uint64(hp) + offs
                g += n
            self._fill(model, log, threads, progress)
        except BaseException:
            self.close()
            raise
        self.nbytes = total

    def _fill(self, model, log, threads, progress=None):
        E = self.n_expert
        per_layer = [lay.nbytes for lay in self.layout.layers]
        total = sum(per_layer[g // E] for g in np.flatnonzero(self.pinned))
        if not total:
            self.fill_seconds = 0.0
            return
        t0 = time.perf_counter()
        done = [0, t0]

        def one_layer(i):
            lay = self.layout.layer(i)
            tens = [model.tensor(model.expert_name(i, k)).data for k in ("gate", "up", "down")]
            offs = (0, lay.up_off, lay.down_off)
            n = 0
            for e in range(E):
                hp = int(self._host_ptr[i * E + e])
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

    @property
    def host_ptr(self) -> np.ndarray:
        """Each expert's blob's host address (layer * n_expert + e; 0: not pinned here), for the CPU experts
        (engine/cpu_calibrate.py)."""
        return self._host_ptr

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
