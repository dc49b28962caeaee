"""bench.prefetch_oracle: the upgraded predictions (CPU), and on the GPU the replays themselves: the same tokens as the
real step, a perfect prediction seen as such by the step's own counters, the control row as the real one, the table
as it was."""
import numpy as np
import pytest

from bench.prefetch_oracle import oracle_pass, summarize, upgrade
from test_cuda_backend import CTX, cpu_runs  # noqa: F401 (cpu_runs: a fixture)

gpu = pytest.mark.gpu


def _case(rng, n_layer=6, n_expert=32, k=8):
    actual = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n_layer)]).astype(np.int32)
    pred = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n_layer)]).astype(np.int32)
    pred[2] = actual[2][::-1]                      # a layer predicted right already
    return actual, pred


def test_upgrade_zero_is_the_prediction_and_one_the_routing():
    rng = np.random.default_rng(0)
    for _ in range(50):
        actual, pred = _case(rng)
        np.testing.assert_array_equal(upgrade(pred, actual, 0.0, rng), pred)
        up = upgrade(pred, actual, 1.0, rng)
        np.testing.assert_array_equal(up[0], pred[0])          # layer 0: nothing predicts it
        for m in range(1, len(up)):
            assert set(up[m].tolist()) == set(actual[m].tolist())
        np.testing.assert_array_equal(up[2], pred[2])


def test_upgrade_keeps_the_right_guesses_and_reaches_the_share():
    rng = np.random.default_rng(1)
    right0 = right = wrong0 = 0
    for _ in range(400):
        actual, pred = _case(rng)
        up = upgrade(pred, actual, 0.5, rng)
        for m in range(1, len(up)):
            a, p, u = set(actual[m].tolist()), set(pred[m].tolist()), up[m].tolist()
            assert len(set(u)) == len(u)                        # still k distinct experts
            assert p & a <= set(u)                              # a right guess is never replaced
            right0 += len(p & a)
            right += len(set(u) & a)
            wrong0 += len(p - a)
    assert 0.45 < (right - right0) / wrong0 < 0.55


@gpu
def test_oracle_replays_compute_the_real_tokens(cpu_runs):
    model, prompt, _, _ = cpu_runs["tiny-qwen3moe-q4k"]
    cfg = model.config
    from bench.prefetch_oracle import OracleReplays
    from engine.cuda.backend import CUDABackend, CudaOptions
    opts = CudaOptions(expert_slots=cfg.n_layer * cfg.n_expert // 2, adapt_every=4, prefetch=True)
    be = CUDABackend(model, CTX, opts, tracer=OracleReplays())
    try:
        rows = oracle_pass(be, prompt, 24, [0.0, 1.0])
        np.testing.assert_array_equal(be.cache.table.get(stream=be.stream), be.cache.table_host)
        out = {r["row"]: r for r in summarize(rows, be.layout.nbytes)}
    finally:
        be.close()
    assert all(r["mismatches"] == 0 and r["steps"] == 23 for r in out.values())
    real, ctl, perfect = out["real"], out["q=0"], out["q=1"]
    assert real["pred_accuracy"] < 1.0 and perfect["pred_accuracy"] == 1.0
    assert ctl["pred_accuracy"] == real["pred_accuracy"]
    assert ctl["prefetch_mb_per_token"] == real["prefetch_mb_per_token"]
    assert ctl["hit_rate"] == real["hit_rate"] == perfect["hit_rate"]
    assert perfect["prefetch_wasted"] == 0.0
    assert perfect["late_mb_per_token"] < real["late_mb_per_token"]
