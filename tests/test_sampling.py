"""Sampler: every stage against values worked out by hand (llama.cpp's semantics)."""
import numpy as np
import pytest

from engine.sampling import Sampler, SamplingError


def test_greedy_is_argmax_and_ignores_rng():
    s = Sampler({})
    assert s.greedy
    assert s.sample(np.array([0.1, 2.0, -1.0, 1.9], np.float32)) == 1


def test_repeat_penalty_divides_positive_and_multiplies_negative():
    s = Sampler({"penalty_repeat": 2.0})
    s.accept_many([0, 1])
    out = s.apply_penalties(np.array([4.0, -1.0, 3.0], np.float32))
    # 4/2 = 2; -1*2 = -2; token 2 not in history stays 3
    np.testing.assert_allclose(out, [2.0, -2.0, 3.0])


def test_frequency_and_presence_subtract_per_count():
    s = Sampler({"penalty_freq": 0.5, "penalty_present": 0.25})
    s.accept_many([2, 2, 2, 0])
    out = s.apply_penalties(np.array([1.0, 1.0, 1.0], np.float32))
    # token 0: count 1 -> 1 - 0.5 - 0.25; token 2: count 3 -> 1 - 1.5 - 0.25; token 1 untouched
    np.testing.assert_allclose(out, [0.25, 1.0, -0.75])


def test_penalties_see_only_the_last_n_tokens():
    s = Sampler({"penalty_repeat": 2.0, "penalty_last_n": 2})
    s.accept_many([0, 1, 2])  # token 0 has left the window
    out = s.apply_penalties(np.array([4.0, 4.0, 4.0], np.float32))
    np.testing.assert_allclose(out, [4.0, 2.0, 2.0])


def test_penalty_last_n_zero_disables_and_minus_one_is_everything():
    off = Sampler({"penalty_repeat": 2.0, "penalty_last_n": 0})
    off.accept_many([0])
    np.testing.assert_allclose(off.apply_penalties(np.array([4.0, 1.0], np.float32)), [4.0, 1.0])
    allctx = Sampler({"penalty_repeat": 2.0, "penalty_last_n": -1})
    allctx.accept_many([0] + [1] * 500)
    np.testing.assert_allclose(allctx.apply_penalties(np.array([4.0, 1.0], np.float32)), [2.0, 0.5])


def test_greedy_applies_penalties():
    s = Sampler({"penalty_repeat": 4.0})
    s.accept(0)
    # 3.0/4 = 0.75 < 1.0: the penalty flips the argmax
    assert s.sample(np.array([3.0, 1.0], np.float32)) == 1


def test_top_k_keeps_k_largest():
    s = Sampler({"temperature": 1.0, "top_k": 2})
    out = s.filter(np.array([1.0, 5.0, 3.0, 4.0], np.float32))
    assert np.isneginf(out[[0, 2]]).all()
    np.testing.assert_allclose(out[[1, 3]], [5.0, 4.0])


def test_top_p_keeps_the_token_that_crosses_the_mass():
    # probabilities 0.5, 0.3, 0.2 (logits = log p)
    logits = np.log(np.array([0.2, 0.5, 0.3], np.float32))
    s = Sampler({"temperature": 1.0, "top_p": 0.6})
    out = s.filter(logits)
    # 0.5 < 0.6, 0.5 + 0.3 = 0.8 >= 0.6: keep tokens 1 and 2
    assert np.isneginf(out[0]) and np.isfinite(out[1]) and np.isfinite(out[2])
    s2 = Sampler({"temperature": 1.0, "top_p": 0.5})
    out2 = s2.filter(logits)
    assert np.isfinite(out2).sum() == 1 and np.isfinite(out2[1])


def test_min_p_is_relative_to_the_top_probability():
    logits = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    s = Sampler({"temperature": 1.0, "min_p": 0.5})
    out = s.filter(logits)
    # threshold 0.25: 0.5 and 0.3 stay, 0.2 goes
    assert np.isfinite(out[0]) and np.isfinite(out[1]) and np.isneginf(out[2])


def test_temperature_scales_after_filters():
    logits = np.array([np.log(2.0), 0.0], np.float32)  # p = 2/3, 1/3 at T=1
    p1 = Sampler({"temperature": 1.0}).probabilities(logits)
    np.testing.assert_allclose(p1, [2 / 3, 1 / 3], rtol=1e-6)
    p2 = Sampler({"temperature": 0.5}).probabilities(logits)
    # T=0.5 squares the ratio: 4:1
    np.testing.assert_allclose(p2, [0.8, 0.2], rtol=1e-6)


def test_sampled_draws_follow_the_distribution_and_never_pick_a_filtered_token():
    logits = np.log(np.array([0.6, 0.3, 0.1], np.float32))
    s = Sampler({"temperature": 1.0, "top_k": 2, "seed": 7})
    draws = np.array([s.sample(logits) for _ in range(4000)])
    assert not (draws == 2).any()
    # after top_k the mass is 2/3 vs 1/3
    assert abs((draws == 0).mean() - 2 / 3) < 0.04


def test_seed_makes_runs_reproducible_and_different_seeds_differ():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=200).astype(np.float32)

    def run(seed):
        s = Sampler({"temperature": 1.5, "seed": seed})
        return [s.sample(logits) for _ in range(50)]
    assert run(123) == run(123)
    assert run(123) != run(124)


def test_nan_logits_raise():
    with pytest.raises(SamplingError):
        Sampler({}).sample(np.array([0.0, np.nan], np.float32))


def test_unknown_key_is_refused():
    with pytest.raises(ValueError):
        Sampler({"temprature": 1.0})


def _reference_filter(x, top_k, top_p, min_p):
    """The chain's definition, written the slow obvious way: full sorts, masked arrays."""
    out = x.astype(np.float64).copy()
    order = np.argsort(-out, kind="stable")
    if 0 < top_k < len(out):
        out[order[top_k:]] = -np.inf
    if top_p < 1.0:
        order = np.argsort(-out, kind="stable")
        p = np.exp(out[order] - out[order[0]])
        cum = np.cumsum(p / p.sum())
        n_keep = min(int(np.argmax(cum >= top_p)) + 1 if (cum >= top_p).any() else len(cum), len(cum))
        out[order[n_keep:]] = -np.inf
    if min_p > 0:
        out[out < out.max() + np.log(min_p)] = -np.inf
    return np.isfinite(out)


@pytest.mark.parametrize("n", [7, 1000, 50_000])
@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 0.9, 0.0), (40, 0.95, 0.0), (0, 1.0, 0.1), (20, 0.5, 0.05),
                                               (0, 0.3, 0.0), (3, 1.0, 0.0)])
def test_candidates_match_the_obvious_full_sort(n, top_k, top_p, min_p):
    rng = np.random.default_rng(n + top_k)
    # peaked like a language model's logits: a few large values over a wide low floor
    logits = (rng.standard_normal(n) * 2 + np.where(rng.random(n) < 0.01, 8, 0)).astype(np.float32)
    s = Sampler({"temperature": 1.0, "top_k": top_k, "top_p": top_p, "min_p": min_p})
    kept = np.isfinite(s.filter(logits))
    np.testing.assert_array_equal(kept, _reference_filter(logits, top_k, top_p, min_p))
    ids, vals = s.candidates(logits)
    np.testing.assert_array_equal(vals, logits[ids])
