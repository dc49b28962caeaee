"""The sampling chain (engine/sampling.py): every stage against values worked out by hand (llama.cpp's semantics)."""
from dataclasses import replace

import numpy as np
import pytest

from engine.sampling import PickSpec, Sampler, SamplingError, SamplingParams, draw, pick

P = SamplingParams.of


def penalized(params, history, logits):
    """The penalized logits with the history as the spec counts it (its last penalty_last_n)."""
    sp = P(params)
    return sp.apply_penalties(np.array(logits, np.float32), PickSpec(sp, history=history).counted())


def picks(params, logits, n):
    """n picks from the same logits by one request's spec after spec (its draws advancing)."""
    s = Sampler(params)
    out = []
    for _ in range(n):
        out.append(pick(logits, s.spec()).id)
        s.advance()
    return out


def test_greedy_is_argmax():
    assert P({}).greedy
    assert pick(np.array([0.1, 2.0, -1.0, 1.9], np.float32), PickSpec()).id == 1


def test_repeat_penalty_divides_positive_and_multiplies_negative():
    out = penalized({"penalty_repeat": 2.0}, [0, 1], [4.0, -1.0, 3.0])
    # 4/2 = 2; -1*2 = -2; token 2 not in history stays 3
    np.testing.assert_allclose(out, [2.0, -2.0, 3.0])


def test_frequency_and_presence_subtract_per_count():
    out = penalized({"penalty_freq": 0.5, "penalty_present": 0.25}, [2, 2, 2, 0], [1.0, 1.0, 1.0])
    # token 0: count 1 -> 1 - 0.5 - 0.25; token 2: count 3 -> 1 - 1.5 - 0.25; token 1 untouched
    np.testing.assert_allclose(out, [0.25, 1.0, -0.75])


def test_penalties_see_only_the_last_n_tokens():
    out = penalized({"penalty_repeat": 2.0, "penalty_last_n": 2}, [0, 1, 2], [4.0, 4.0, 4.0])  # 0 has left
    np.testing.assert_allclose(out, [4.0, 2.0, 2.0])
    assert Sampler({"penalty_repeat": 2.0, "penalty_last_n": 2}).spec([0, 1, 2]).history == (1, 2)


def test_penalty_last_n_zero_disables_and_minus_one_is_everything():
    off = {"penalty_repeat": 2.0, "penalty_last_n": 0}
    np.testing.assert_allclose(penalized(off, [0], [4.0, 1.0]), [4.0, 1.0])
    assert Sampler(off).spec([0]).history == ()
    allctx = {"penalty_repeat": 2.0, "penalty_last_n": -1}
    np.testing.assert_allclose(penalized(allctx, [0] + [1] * 500, [4.0, 1.0]), [2.0, 0.5])
    assert Sampler({}).spec([1, 2, 3]).history == ()          # no penalties: nothing to count


def test_greedy_applies_penalties():
    # 3.0/4 = 0.75 < 1.0: the penalty flips the argmax
    assert pick(np.array([3.0, 1.0], np.float32), Sampler({"penalty_repeat": 4.0}).spec([0])).id == 1


def test_top_k_keeps_k_largest():
    out = P({"temperature": 1.0, "top_k": 2}).filter(np.array([1.0, 5.0, 3.0, 4.0], np.float32))
    assert np.isneginf(out[[0, 2]]).all()
    np.testing.assert_allclose(out[[1, 3]], [5.0, 4.0])


def test_top_p_keeps_the_token_that_crosses_the_mass():
    # probabilities 0.5, 0.3, 0.2 (logits = log p)
    logits = np.log(np.array([0.2, 0.5, 0.3], np.float32))
    out = P({"temperature": 1.0, "top_p": 0.6}).filter(logits)
    # 0.5 < 0.6, 0.5 + 0.3 = 0.8 >= 0.6: keep tokens 1 and 2
    assert np.isneginf(out[0]) and np.isfinite(out[1]) and np.isfinite(out[2])
    out2 = P({"temperature": 1.0, "top_p": 0.5}).filter(logits)
    assert np.isfinite(out2).sum() == 1 and np.isfinite(out2[1])


def test_min_p_is_relative_to_the_top_probability():
    logits = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    out = P({"temperature": 1.0, "min_p": 0.5}).filter(logits)
    # threshold 0.25: 0.5 and 0.3 stay, 0.2 goes
    assert np.isfinite(out[0]) and np.isfinite(out[1]) and np.isneginf(out[2])


def test_temperature_scales_after_filters():
    logits = np.array([np.log(2.0), 0.0], np.float32)  # p = 2/3, 1/3 at T=1
    p1 = P({"temperature": 1.0}).probabilities(logits)
    np.testing.assert_allclose(p1, [2 / 3, 1 / 3], rtol=1e-6)
    p2 = P({"temperature": 0.5}).probabilities(logits)
    # T=0.5 squares the ratio: 4:1
    np.testing.assert_allclose(p2, [0.8, 0.2], rtol=1e-6)


def test_sampled_draws_follow_the_distribution_and_never_pick_a_filtered_token():
    logits = np.log(np.array([0.6, 0.3, 0.1], np.float32))
    draws = np.array(picks({"temperature": 1.0, "top_k": 2, "seed": 7}, logits, 4000))
    assert not (draws == 2).any()
    # after top_k the mass is 2/3 vs 1/3
    assert abs((draws == 0).mean() - 2 / 3) < 0.04


def test_seed_makes_runs_reproducible_and_different_seeds_differ():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=200).astype(np.float32)

    def run(seed):
        return picks({"temperature": 1.5, "seed": seed}, logits, 50)
    assert run(123) == run(123)
    assert run(123) != run(124)
    assert picks({"temperature": 1.5}, logits, 50) != picks({"temperature": 1.5}, logits, 50)  # fresh entropy


def test_draw_i_is_the_ith_number_of_a_default_rng():
    """A seeded request draws what numpy's default_rng(seed) gives in order, whatever position it asks for."""
    for seed in (0, 7, 2 ** 63 + 5):
        g = np.random.default_rng(seed)
        want = [g.random() for _ in range(40)]
        assert [draw(seed, i) for i in range(40)] == want
        assert draw(seed, 17) == want[17]


def test_the_spec_picks_with_its_draw_number():
    """The pick with draws=i uses draw i: the same as the i-th pick of a run."""
    logits = np.random.default_rng(3).normal(size=300).astype(np.float32)
    run = picks({"temperature": 2.0, "seed": 9}, logits, 20)
    s = Sampler({"temperature": 2.0, "seed": 9})
    spec = s.spec()
    assert [pick(logits, replace(spec, draws=i)).id for i in range(20)] == run
    assert s.draws == 0                       # picking never writes into the request's state
    s.advance(3)
    assert s.draws == 3 and Sampler({}).draws == 0
    g = Sampler({"penalty_repeat": 1.5})
    g.advance(5)
    assert g.draws == 0                       # a greedy pick draws nothing


def test_nan_logits_raise():
    with pytest.raises(SamplingError, match="the model produced NaN logits"):
        pick(np.array([0.0, np.nan], np.float32), PickSpec())
    with pytest.raises(SamplingError, match="every logit is -inf"):
        pick(np.full(4, -np.inf, np.float32), PickSpec())


def test_unknown_key_is_refused():
    with pytest.raises(ValueError, match="unknown sampling keys: temprature"):
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
    s = P({"temperature": 1.0, "top_k": top_k, "top_p": top_p, "min_p": min_p})
    kept = np.isfinite(s.filter(logits))
    np.testing.assert_array_equal(kept, _reference_filter(logits, top_k, top_p, min_p))
    ids, vals = s.candidates(logits)
    np.testing.assert_array_equal(vals, logits[ids])
