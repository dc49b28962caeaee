"""The CPU expert pool (engine/cpu_expert_pool.py): jobs run beside the caller into its buffers, in submit order,
with the same bits as a direct call whatever the thread count, and the NumPy backend's result; failures stay with
their job; bad arguments are refused at submit."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from engine import cpu_experts as ce
from engine.cpu_expert_pool import CpuExpertPool, max_threads, measure_gbps
from test_cpu_experts import assert_exact_to_f32, blob_table, exact_ffn, needs_numba, numba


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(11)
    table, mats = blob_table((12, 12, 14), 512, 256, 8, rng)
    return table, mats, rng


@needs_numba
def test_jobs_match_a_direct_call_and_the_numpy_backend(layer):
    table, mats, rng = layer
    calls, want = [], []
    numba.set_num_threads(1)            # direct calls first: numba's workqueue layer takes one launcher at a time
    for _ in range(6):
        x = rng.standard_normal(256).astype(np.float32)
        ids = rng.choice(8, 3, replace=False)
        w = rng.uniform(0.1, 0.5, 3).astype(np.float32)
        direct = np.full(256, np.nan, np.float32)
        ce.experts_ffn(table, 0, ids, w, x, direct, "numba")
        calls.append((ids, w, x))
        want.append((direct, exact_ffn(table, mats, ids, w, x)))
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    with CpuExpertPool(table, threads=max_threads()) as pool:
        jobs = []
        for ids, w, x in calls:
            out = np.full(256, np.nan, np.float32)
            jobs.append((pool.submit(0, ids, w, x, out), out))
        for (job, out), (direct, exact) in zip(jobs, want):
            assert job.wait(60) is out and job.done()
            np.testing.assert_array_equal(out, direct)       # the pool's threads change no bit
            assert_exact_to_f32(out, exact, "pool job")


@needs_numba
@pytest.mark.parametrize("threads", [1, 2])
def test_every_thread_count_gives_the_same_bits(layer, threads):
    table, _, _ = layer
    if threads > max_threads():
        pytest.skip(f"numba allows {max_threads()} threads here")
    x = np.linspace(-1, 1, 256, dtype=np.float32)
    w = np.array([0.5, 0.3, 0.2], np.float32)
    outs = []
    for nt in (1, threads):
        with CpuExpertPool(table, threads=nt) as pool:
            out = np.zeros(256, np.float32)
            pool.submit(0, [7, 2, 5], w, x, out).wait(60)
            outs.append(out)
    np.testing.assert_array_equal(*outs)


def test_the_caller_goes_on_and_the_hooks_run_in_order(layer):
    table, _, _ = layer
    gate = threading.Event()
    order = []
    x, out = np.ones(256, np.float32), np.zeros(256, np.float32)
    with CpuExpertPool(table) as pool:
        job = pool.submit(0, [1], [1.0], x, out, ready=lambda: (gate.wait(30), order.append("ready")),
                          on_done=lambda: order.append(("done", bool(out.any()))))
        assert not job.done()            # the worker waits in `ready`; submit returned at once
        order.append("caller")
        gate.set()
        job.wait(60)
    assert order == ["caller", "ready", ("done", True)]


def test_a_failing_job_fails_alone(layer):
    table, _, _ = layer
    x = np.ones(256, np.float32)
    with CpuExpertPool(table) as pool:
        bad = pool.submit(0, [1], [1.0], x, np.zeros(256, np.float32), ready=lambda: 1 / 0)
        good_out = np.zeros(256, np.float32)
        good = pool.submit(0, [1], [1.0], x, good_out)
        with pytest.raises(ZeroDivisionError):
            bad.wait(60)
        assert good.wait(60) is good_out and good_out.any()


@needs_numba
def test_bad_submits_and_settings_are_refused(layer):
    table, _, _ = layer
    x, out = np.ones(256, np.float32), np.zeros(256, np.float32)
    with pytest.raises(ValueError, match="threads must be 1.."):
        CpuExpertPool(table, threads=max_threads() + 1)
    with pytest.raises(ValueError, match="threads must be"):
        CpuExpertPool(table, threads=0)
    with pytest.raises(ValueError, match="threads must be 1..1 here .numpy"):
        CpuExpertPool(table, threads=2, backend="numpy")
    pool = CpuExpertPool(table)
    with pytest.raises(ValueError, match="outside 0..7"):
        pool.submit(0, [9], [1.0], x, out)
    pool.close()
    with pytest.raises(ValueError, match="closed"):
        pool.submit(0, [1], [1.0], x, out)


def test_a_job_not_done_in_time_says_so(layer):
    table, _, _ = layer
    gate = threading.Event()
    with CpuExpertPool(table) as pool:
        job = pool.submit(0, [1], [1.0], np.ones(256, np.float32), np.zeros(256, np.float32),
                          ready=lambda: gate.wait(30))
        with pytest.raises(TimeoutError, match="layer 0"):
            job.wait(0.05)
        gate.set()
        job.wait(60)


def test_the_numpy_backend_pool(layer):
    table, mats, rng = layer
    x = rng.standard_normal(256).astype(np.float32)
    out = np.full(256, np.nan, np.float32)
    with CpuExpertPool(table, backend="numpy") as pool:
        pool.submit(0, [0, 6], [0.4, 0.6], x, out).wait(60)
    assert_exact_to_f32(out, exact_ffn(table, mats, [0, 6], [0.4, 0.6], x), "numpy pool")


def test_measuring_the_cpu_rate(layer):
    table, _, _ = layer
    assert measure_gbps(table, threads=1, k=3, calls=3) > 0
    with pytest.raises(ValueError, match="no layer has 9 experts"):
        measure_gbps(table, threads=1, k=9)
