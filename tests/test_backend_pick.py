"""The pick on the reference backend (engine/backend.py decode over CPUBackend, engine/sampling.py pick): greedy,
seeded sampling, penalties, a grammar mask, logprobs, the NaN rule, and windows of k picks against k one-token calls
with the per-position spec (spec.after), on the tiny fixture models."""
import json

import numpy as np
import pytest

from engine.backend_cpu import CPUBackend
from engine.gguf_model import open_model
from engine.grammar import apply_mask, mask_words
from engine.sampling import PickSpec, Sampler, SamplingError, logprobs_of

MODELS = ("tiny-llama-legacy", "tiny-qwen3moe-q4k")


@pytest.fixture(scope="module", params=MODELS)
def cpu(request, fixtures_dir):
    name = request.param
    model = open_model(fixtures_dir / "reference" / f"{name}.gguf")
    prompt = list(json.loads((fixtures_dir / "reference" / f"{name}.json").read_text())["cases"][0]["prompt_ids"])
    be = CPUBackend(model, 128)
    yield be, prompt
    be.close()


def fresh(be, prompt):
    """The prompt's logits from a cold cache (the cache is left holding the prompt)."""
    be.truncate(0)
    return be.forward(prompt)


def words_of(allowed):
    pad = np.zeros(mask_words(len(allowed)) * 32 - len(allowed), bool)
    return np.packbits(np.concatenate([allowed, pad]), bitorder="little").view(np.int32)


def test_greedy_is_the_argmax(cpu):
    be, prompt = cpu
    logits = fresh(be, prompt)
    be.truncate(0)
    got = be.decode(prompt, PickSpec())
    assert [p.id for p in got] == [int(np.argmax(logits))] and got[0].logprob is None and got[0].top == ()
    assert be.n_cached == len(prompt)


def test_seeded_sampling_reproduces_and_follows_the_draws(cpu):
    be, prompt = cpu
    logits = fresh(be, prompt)
    s = Sampler({"temperature": 1.5, "top_k": 50, "seed": 11})
    picks = []
    for i in range(30):                   # the prompt's pick with draws 0..29: the i-th number of default_rng(11)
        be.truncate(0)
        picks.append(be.decode(prompt, s.spec())[0].id)
        s.advance()
    g = np.random.default_rng(11)
    params = s.params
    want = [params.choose(logits, (), g.random()) for _ in range(30)]
    assert picks == want and len(set(picks)) > 1


def test_penalties_count_the_history_and_the_fed_tokens(cpu):
    be, prompt = cpu
    lg = fresh(be, prompt)
    top = int(np.argmax(lg))
    s = Sampler({"penalty_repeat": 50.0, "penalty_last_n": 3})
    be.truncate(len(prompt) - 1)
    spec = s.spec([top, 7])                  # the pick after the last prompt token counts (top, 7, that token)
    assert spec.counted([prompt[-1]]) == (top, 7, prompt[-1])
    got = be.decode([prompt[-1]], spec)[0].id
    assert got == int(np.argmax(s.params.apply_penalties(lg, (top, 7, prompt[-1])))) != top
    be.truncate(len(prompt) - 1)
    far = s.spec([top, 7, 8, 9])             # top has left the last 3
    got = be.decode([prompt[-1]], far)[0].id
    assert got == int(np.argmax(s.params.apply_penalties(lg, (8, 9, prompt[-1]))))
    if top not in (8, 9, prompt[-1]):
        assert got == top


def test_a_mask_limits_the_pick_and_logprobs_are_the_masked_distributions(cpu):
    be, prompt = cpu
    n = be.config.n_vocab
    logits = fresh(be, prompt)
    rng = np.random.default_rng(5)
    for params in ({}, {"temperature": 0.9, "seed": 4}):
        allowed = rng.random(n) < 0.05
        allowed[0] = True
        masked = apply_mask(logits, words_of(allowed))
        be.truncate(0)
        spec = Sampler(params).spec(mask=words_of(allowed), logprobs=4)
        got = be.decode(prompt, spec)[0]
        assert allowed[got.id]
        lp, top = logprobs_of(masked, got.id, 4)
        assert got.logprob == pytest.approx(lp) and list(got.top) == top and len(top) == 4
        if not params:
            assert got.id == int(np.argmax(masked)) == top[0][0]
    be.truncate(0)
    got = be.decode(prompt, PickSpec(logprobs=0))[0]
    assert got.top == () and got.logprob == pytest.approx(logprobs_of(logits, got.id, 0)[0])


class NaNAt(CPUBackend):
    """The CPU backend whose logits come out NaN at one position."""
    nan_at = None

    def forward(self, tokens, all_logits=False):
        pos0 = self.n_cached
        out = super().forward(tokens, all_logits)
        rows = out if all_logits else out[None]
        end = pos0 + len(tokens)
        for i in range(len(rows)):
            if (pos0 + i + 1 if all_logits else end) == self.nan_at:
                rows[i, 3] = np.nan
        return out


def test_the_nan_rule_and_an_all_masked_pick(fixtures_dir):
    model = open_model(fixtures_dir / "reference" / "tiny-llama-legacy.gguf")
    be = NaNAt(model, 64)
    try:
        be.nan_at = 4
        with pytest.raises(SamplingError, match="^the model produced NaN logits$"):
            be.decode([1, 2, 3, 4], PickSpec())
        be.truncate(3)
        nothing = np.zeros(mask_words(be.config.n_vocab), np.int32)
        with pytest.raises(SamplingError, match="^the model produced NaN logits$"):    # NaN first, mask or not
            be.decode([4], PickSpec(mask=nothing))
        be.nan_at = None
        be.truncate(3)
        with pytest.raises(SamplingError, match="^the grammar allows no token here$"):
            be.decode([4], PickSpec(mask=nothing))
        be.truncate(0)
        be.nan_at = 3                   # inside a window: the window's pick there fails
        with pytest.raises(SamplingError, match="NaN"):
            be.decode([1, 2, 3, 4], Sampler({"temperature": 1.0, "seed": 1}).spec(), all_positions=True)
        be.truncate(0)
        with pytest.raises(ValueError, match="a grammar mask limits one pick"):
            be.decode([1, 2], PickSpec(mask=nothing), all_positions=True)
    finally:
        be.close()


@pytest.mark.parametrize("params,logprobs", [({}, None), ({"penalty_repeat": 1.5, "penalty_last_n": 4}, 3),
                                             ({"temperature": 1.2, "top_p": 0.95, "seed": 9, "penalty_freq": 0.5,
                                               "penalty_present": 0.3, "penalty_last_n": 6}, 2),
                                             ({"temperature": 2.0, "seed": 3, "penalty_repeat": 1.3,
                                               "penalty_last_n": -1}, None)])
def test_a_window_of_picks_equals_one_token_calls(cpu, params, logprobs):
    """decode(window, spec, all_positions=True)[i] is decode([window[i]], spec.after(window[:i])) from the same
    cache: position i counts the history and the window up to it, and uses draw spec.draws + i."""
    be, prompt = cpu
    s = Sampler(params)
    be.truncate(0)
    first = be.decode(prompt, s.spec([]))[0]
    s.advance()
    n0 = be.n_cached
    window = [first.id] + prompt[:5]        # the prompt's ids again: the penalties bite
    spec = s.spec(prompt, logprobs=logprobs)
    picks = be.decode(window, spec, all_positions=True)
    assert len(picks) == len(window) and be.n_cached == n0 + len(window)
    be.truncate(n0)
    singles = [be.decode([t], spec.after(window[:i]))[0] for i, t in enumerate(window)]
    assert [p.id for p in picks] == [p.id for p in singles]
    for p, q in zip(picks, singles):
        assert (p.logprob is None) == (logprobs is None) and len(p.top) == len(q.top)
        if logprobs is not None:
            assert p.logprob == pytest.approx(q.logprob, abs=1e-4)
    assert spec.after(window[:2]).draws == spec.draws + (0 if s.params.greedy else 2)
