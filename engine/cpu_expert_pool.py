"""A pool that computes a layer's CPU share of experts while the caller goes on (the GPU keeps going meanwhile).

    pool = CpuExpertPool(table, threads=8)              # table: engine.cpu_experts.ExpertTable
    job = pool.submit(layer, expert_ids, weights, x, out, ready=None, on_done=None)
    ...                                                 # the caller's own work
    job.wait()                                          # out now holds sum_e weights[e] * expert_e(x)

One worker thread takes the jobs in the order they were submitted and runs engine.cpu_experts.experts_ffn on each
with `threads` threads (numba's parallel loops, which release the GIL; the numpy backend runs on the worker alone
beside BLAS's own threads). The result does not depend on the thread count. x is read and out written when the job
runs, not at submit: both stay the caller's (out will be mapped pinned memory the GPU reads), unchanged and alive
until the job is done. `ready` runs on the worker before x is read (a wait for the GPU's flag), `on_done` after out
is written (setting the flag the GPU waits on); an exception in either, or in the kernel, fails that job alone:
wait() raises it. submit() checks its arguments at once and raises ValueError for bad ones.

measure_gbps(table, threads) times the CPU's rate on the table's own experts through a pool: what calibration writes
beside pcie_gbps for engine/cpu_share.py's rule.

numba's threads are per process: run one pool (and no other numba-parallel work) at a time unless numba's threading
layer is omp or tbb (numba -s says which it found); workqueue, its fallback, aborts on concurrent launches.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import numpy as np

from engine.cpu_experts import ExpertTable, check_backend, check_call, experts_ffn


def max_threads(backend: str = "auto") -> int:
    """The most threads a pool may use here (numba's NUMBA_NUM_THREADS: the CPU count unless set)."""
    if check_backend(backend) == "numba":
        import numba
        return int(numba.config.NUMBA_NUM_THREADS)
    return 1


class CpuJob:
    """One submitted layer: done(), wait(timeout) -> out (raising what the job raised)."""

    def __init__(self, layer: int, out: np.ndarray):
        self.layer, self.out = layer, out
        self._done = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> np.ndarray:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the CPU experts of layer {self.layer} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self.out


class CpuExpertPool:
    def __init__(self, table: ExpertTable, threads: int = 1, backend: str = "auto"):
        self.table = table
        self.backend = check_backend(backend)
        top = max_threads(self.backend)
        if not isinstance(threads, (int, np.integer)) or not 1 <= threads <= top:
            raise ValueError(f"CPU expert threads must be 1..{top} here ({self.backend} backend), not {threads!r}"
                             + (" (NUMBA_NUM_THREADS caps numba's)" if self.backend == "numba" else ""))
        self.threads = int(threads)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="cpu-experts", daemon=True)
        self._worker.start()

    def submit(self, layer: int, expert_ids, weights, x: np.ndarray, out: np.ndarray,
               ready: Callable[[], None] | None = None, on_done: Callable[[], None] | None = None) -> CpuJob:
        if self._closed:
            raise ValueError("the CPU expert pool is closed")
        ids, w = check_call(self.table, layer, expert_ids, weights, x, out)
        job = CpuJob(layer, out)
        self._jobs.put((job, layer, ids, w, x, ready, on_done))
        return job

    def _run(self) -> None:
        if self.backend == "numba":
            import numba
            numba.set_num_threads(self.threads)     # per thread: this worker's parallel loops
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, layer, ids, w, x, ready, on_done = item
            try:
                if ready is not None:
                    ready()
                experts_ffn(self.table, layer, ids, w, x, job.out, self.backend)
                if on_done is not None:
                    on_done()
            except BaseException as e:      # the job's failure, raised by its wait(); the pool goes on
                job._error = e
            job._done.set()

    def close(self) -> None:
        """Finish the jobs already submitted, then stop the worker."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._worker.join()

    def __enter__(self) -> "CpuExpertPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def measure_gbps(table: ExpertTable, threads: int, k: int = 4, calls: int = 12, backend: str = "auto",
                 seed: int = 0) -> float:
    """The CPU's rate on these experts, GB/s of expert bytes: the median of `calls` jobs of k random experts of
    random layers (those with addresses) through a pool of `threads` (what --calibrate writes beside pcie_gbps)."""
    rng = np.random.default_rng(seed)
    layers = [il for il in range(table.n_layer) if table.types[il] is not None]
    have = {il: np.flatnonzero((table.gate[il] != 0) & (table.down[il] != 0)) for il in layers}
    layers = [il for il in layers if len(have[il]) >= k]
    if not layers:
        raise ValueError(f"no layer has {k} experts in host memory to time")
    x = rng.standard_normal(table.n_embd).astype(np.float32)
    out = np.empty(table.n_embd, np.float32)
    w = np.full(k, 1.0 / k, np.float32)
    rates = []
    with CpuExpertPool(table, threads, backend) as pool:
        for i in range(calls + 1):
            il = layers[rng.integers(len(layers))]
            ids = rng.choice(have[il], k, replace=False)
            t0 = time.perf_counter()
            pool.submit(il, ids, w, x, out).wait()
            if i:                                   # the first call warms the threads (and numba's cache)
                rates.append(k * table.expert_bytes(il) / (time.perf_counter() - t0) / 1e9)
    return float(np.median(rates))
