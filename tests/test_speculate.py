"""Speculative decoding on the reference backend (engine/speculate.py, engine/drafters): verify windows give exactly
the tokens one-token decoding gives, greedy and sampled at a set seed, on every family's tiny fixture with every
drafter (n-gram, the oracle at acceptance 0.5 and 0.9, the hybrids' MTP blocks), through both rollbacks (the
per-position states of qwen3next.HybridCache, and the snapshot-and-replay fallback); the window rule; DONE's counts.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from engine.backend_cpu import CPUBackend
from engine.drafters import DraftError, make_drafter
from engine.drafters.mtp import MTPDrafter
from engine.drafters.ngram import NgramDrafter
from engine.drafters.oracle import OracleDrafter
from engine.gguf_model import open_model
from engine.protocol import GenRequest
from engine.sampling import PickSpec, Sampler
from engine.session import Session
from engine.speculate import FixedWindow, WindowRule, accepted, verify
from tools import make_moe

HERE = Path(__file__).resolve().parent
HYBRIDS = {"qwen3next": HERE / "fixtures" / "hybrid" / "tiny-qwen3next-q4_k_m.gguf",
           "qwen35moe": HERE / "fixtures" / "hybrid" / "tiny-qwen35moe-q4_k_m.gguf"}
QWEN4EXP = HERE / "fixtures" / "qwen4exp" / "tiny-qwen4exp-q4_k_m.gguf"
N_NEW = 40


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """make_moe's tiny presets that have no committed file: qwen3moe (tiny) and gpt-oss-tiny."""
    d = tmp_path_factory.mktemp("spec_models")
    out = {}
    for name, args in (("tiny-qwen3moe", ["--preset", "tiny", "--vocab", str(_vocab())]),
                       ("gpt-oss-tiny", ["--preset", "gpt-oss-tiny", "--seed", "1"])):
        out[name] = d / f"{name}.gguf"
        assert make_moe.main([*args, "--threads", "1", "--out", str(out[name])]) == 0
    return out


def _vocab():
    for cand in (HERE.parent.parent / "shared" / "fixtures" / "vocab", HERE.parent / ".fixtures" / "vocab"):
        if (cand / "tiny-bpe-1024.gguf").is_file():
            return cand / "tiny-bpe-1024.gguf"
    pytest.skip("the tiny vocabulary (../shared/fixtures/vocab) is not here")


FAMILY_FILES = ["ref:tiny-llama-legacy", "ref:tiny-qwen2moe-mixed", "ref:tiny-qwen3moe-q4k", "made:tiny-qwen3moe",
                "made:gpt-oss-tiny", "qwen3next", "qwen35moe", "qwen4exp"]


def model_path(key, fixtures_dir, made):
    if key.startswith("ref:"):
        return fixtures_dir / "reference" / f"{key[4:]}.gguf"
    if key.startswith("made:"):
        return made[key[5:]]
    if key == "qwen4exp":
        from engine.supported import SUPPORTED_ARCHS
        if "qwen4exp" not in SUPPORTED_ARCHS or not QWEN4EXP.is_file():
            pytest.skip("qwen4exp does not run on this checkout's CPU backend yet")
        return QWEN4EXP
    return HYBRIDS[key]


@pytest.fixture(scope="module", params=FAMILY_FILES)
def family(request, fixtures_dir, made):
    model = open_model(model_path(request.param, fixtures_dir, made))
    be = CPUBackend(model, 256)
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(1, model.config.n_vocab, 24)]
    yield request.param, model, be, prompt
    be.close()


class NoRewind(CPUBackend):
    """The CPU backend without per-position states: a recurrent model then rolls a window back by replay."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rewinds_windows = not self.recurrent


def run(be, prompt, n, drafter=None, rule=None, params=None, eog=(), logprobs=None):
    """(generated ids, T lines, Done, session) of one request on a cold cache."""
    be.truncate(0)
    if drafter is not None:
        drafter.rewind(0)
    s = Session(be, eog_ids=eog, drafter=drafter, rule=rule)
    lines = []
    done = s.run(GenRequest(n, list(prompt), dict(params or {}), logprobs=logprobs), lines.append)
    assert done is not None, lines
    toks = [int(ln.split()[1]) for ln in lines if ln.startswith("T ")]
    return toks, [ln for ln in lines if ln.startswith("T ")], done, s


def drafters_for(key, model, be, truth):
    V = model.config.n_vocab
    out = [("ngram", NgramDrafter(), FixedWindow(8)), ("ngram-rule", NgramDrafter(), None),
           ("oracle-0.5", OracleDrafter(truth, 0.5, V, seed=1), FixedWindow(5)),
           ("oracle-0.9", OracleDrafter(truth, 0.9, V, seed=2), FixedWindow(8))]
    if key in HYBRIDS:
        out.append(("mtp", MTPDrafter.for_backend(be, model), FixedWindow(4)))
    return out


def test_greedy_with_every_drafter_is_plain_greedy(family):
    key, model, be, prompt = family
    plain, _, done0, _ = run(be, prompt, N_NEW)
    assert done0.drafts_offered == 0 and len(plain) == N_NEW
    for name, drafter, rule in drafters_for(key, model, be, prompt + plain):
        got, _, done, s = run(be, prompt, N_NEW, drafter, rule)
        assert got == plain, f"{key} with {name} drafts: {got} != {plain}"
        assert done.generated == N_NEW and done.drafts_accepted <= done.drafts_offered
        if name.startswith("oracle"):     # windows that were cut back, and windows that were kept whole
            assert 0 < done.drafts_accepted < done.drafts_offered, (name, done)
        # the backend holds what plain decoding leaves: the prompt and every emitted token but the last
        assert be.n_cached == len(prompt) + N_NEW - 1 == len(s.tokens)


def test_the_replay_rollback_gives_the_same_tokens(fixtures_dir, made):
    """A recurrent backend that keeps no per-position states: snapshot before the window, restore and feed the
    accepted prefix again (engine/speculate.py Window.keep). Against plain greedy, and the per-position path."""
    for key in HYBRIDS:
        model = open_model(HYBRIDS[key])
        be = NoRewind(model, 256)
        assert be.recurrent and not be.rewinds_windows
        prompt = [int(t) for t in np.random.default_rng(5).integers(1, model.config.n_vocab, 20)]
        plain, _, _, _ = run(be, prompt, 30)
        got, _, done, _ = run(be, prompt, 30, OracleDrafter(prompt + plain, 0.6, model.config.n_vocab, 4),
                              FixedWindow(6))
        assert got == plain and 0 < done.drafts_accepted < done.drafts_offered
        be.close()


SAMPLED = [{"temperature": 0.9, "seed": 17},
           {"temperature": 1.3, "top_k": 20, "top_p": 0.9, "min_p": 0.02, "seed": 5, "penalty_repeat": 1.2,
            "penalty_freq": 0.3, "penalty_present": 0.2, "penalty_last_n": 8}]


@pytest.mark.parametrize("params", SAMPLED)
def test_sampled_windows_are_plain_sampling_at_the_seed(family, params):
    """Drafts proposed for sure (n-gram, the oracle): each pick is judged with its own draw, so the output is the
    very tokens plain sampling draws with that seed, penalties and logprobs included."""
    key, model, be, prompt = family
    plain, plain_lines, _, _ = run(be, prompt, 24, params=params, logprobs=2)
    for name, drafter, rule in drafters_for(key, model, be, prompt + plain)[:4]:
        got, lines, done, _ = run(be, prompt, 24, drafter, rule, params=params, logprobs=2)
        assert got == plain, f"{key} {name}"
        for a, b in zip(lines, plain_lines):
            ta, tb = a.split(), b.split()
            assert ta[1] == tb[1] and abs(float(ta[2]) - float(tb[2])) < 1e-3, (a, b)


def test_a_stop_inside_a_window_leaves_what_plain_decoding_leaves(fixtures_dir):
    model = open_model(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf")
    be = CPUBackend(model, 256)
    prompt = list(range(5, 29))
    plain, _, _, _ = run(be, prompt, 30)
    eog = plain[12]                                 # the 13th token ends the request
    want = plain[:plain.index(eog)]
    stop, _, _, s0 = run(be, prompt, 30, eog=[eog])
    held = list(s0.tokens)
    got, _, done, s = run(be, prompt, 30, OracleDrafter(prompt + plain, 1.0, model.config.n_vocab), FixedWindow(8),
                          eog=[eog])
    assert stop == got == want and done.finish == "stop"
    assert s.tokens == held and be.n_cached == len(held)
    be.close()


def test_windows_fit_max_new_exactly(fixtures_dir):
    model = open_model(fixtures_dir / "reference" / "tiny-llama-legacy.gguf")
    be = CPUBackend(model, 128)
    prompt = list(range(3, 20))
    for n in (1, 2, 3, 7, 9):
        plain, _, _, _ = run(be, prompt, n)
        got, _, done, _ = run(be, prompt, n, OracleDrafter(prompt + plain, 1.0, model.config.n_vocab),
                              FixedWindow(8))
        assert got == plain and done.generated == n and done.finish == "length"
        assert done.drafts_accepted == done.drafts_offered == n - 1 - (n - 1 + 7) // 8
    be.close()


def test_a_grammar_takes_one_pick_at_a_time(fixtures_dir):
    """With a constraint, the loop never drafts (a mask limits one pick)."""
    from engine.grammar import mask_words

    class Everything:
        done = False

        def mask(self):
            return np.full(mask_words(V), -1, np.int32)

        def accept(self, tok):
            pass

    model = open_model(fixtures_dir / "reference" / "tiny-llama-legacy.gguf")
    V = model.config.n_vocab
    be = CPUBackend(model, 128)
    s = Session(be, eog_ids=(), drafter=NgramDrafter(), rule=FixedWindow(8), grammars=lambda g: Everything())
    lines = []
    done = s.run(GenRequest(12, list(range(3, 20)), grammar="x"), lines.append)
    assert done.generated == 12 and done.drafts_offered == 0
    be.close()


class Spy(CPUBackend):
    """The CPU backend, counting the windows whose spec carried draft distributions."""
    judged = 0

    def decode(self, tokens, spec, all_positions=False):
        self.judged += bool(spec.drafts)
        return super().decode(tokens, spec, all_positions)


def test_sampled_mtp_drafts_go_to_the_pick_with_their_distribution():
    model = open_model(HYBRIDS["qwen35moe"])
    be = Spy(model, 256)
    prompt = list(range(40, 60))
    params = {"temperature": 0.8, "seed": 21}
    outs = [run(be, prompt, 24, MTPDrafter.for_backend(be, model, sampled=True), FixedWindow(4), params=params)
            for _ in range(2)]
    assert outs[0][0] == outs[1][0] and len(outs[0][0]) == 24 and be.judged > 0
    assert outs[0][2].drafts_offered > 0
    be.judged = 0
    run(be, prompt, 24, MTPDrafter.for_backend(be, model), FixedWindow(4), params=params)
    assert be.judged == 0                                       # without sampled: drafts for sure, nothing to judge
    be.close()


# --- rollback at the backend ---------------------------------------------------------------------------------

@pytest.mark.parametrize("key", list(HYBRIDS))
def test_truncate_inside_a_window_is_the_state_after_that_position(key):
    model = open_model(HYBRIDS[key])
    be, ref = CPUBackend(model, 128), CPUBackend(model, 128)
    prompt = [int(t) for t in np.random.default_rng(8).integers(1, model.config.n_vocab, 17)]
    window = [int(t) for t in np.random.default_rng(9).integers(1, model.config.n_vocab, 6)]
    for n in range(0, len(window) + 1):
        be.truncate(0)
        be.forward(prompt)
        be.decode(window, PickSpec(), all_positions=True)
        be.truncate(len(prompt) + n)
        assert be.n_cached == len(prompt) + n
        ref.truncate(0)
        ref.forward(prompt)
        for t in window[:n]:
            ref.forward([t])
        got, want = be.forward([7]), ref.forward([7])
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * float(np.abs(want).max()))
        for il in be.kv.gdn_layers:
            np.testing.assert_allclose(be.kv.delta[il], ref.kv.delta[il], atol=1e-5)
            np.testing.assert_allclose(be.kv.conv[il], ref.kv.conv[il], atol=1e-5)
    be.truncate(0)
    be.forward(prompt)
    be.decode(window, PickSpec(), all_positions=True)
    with pytest.raises(ValueError, match="cannot be rewound"):
        be.truncate(len(prompt) - 1)                # before the window
    be.forward([3])
    with pytest.raises(ValueError, match="cannot be rewound"):
        be.truncate(len(prompt) + 2)                # the window is no longer the last call
    be.close()
    ref.close()


def test_verify_and_keep_through_both_rollbacks():
    model = open_model(HYBRIDS["qwen35moe"])
    prompt = list(range(10, 30))
    for cls in (CPUBackend, NoRewind):
        be = cls(model, 128)
        be.forward(prompt)
        truth = be.decode([5], PickSpec())[0].id
        be.truncate(0)
        be.forward(prompt)
        win = verify(be, [5, truth, 1, 2], PickSpec())
        assert win.accepted >= 1 and (win.snap is None) == (cls is CPUBackend)
        win.keep(2)
        assert be.n_cached == len(prompt) + 2
        be.close()


# --- the window rule -----------------------------------------------------------------------------------------

def test_accepted_counts_the_run_of_agreeing_picks():
    from engine.sampling import Pick
    assert accepted([9, 1, 2, 3], [Pick(1), Pick(2), Pick(4), Pick(5)]) == 2
    assert accepted([9, 1, 2], [Pick(1), Pick(2), Pick(3)]) == 2
    assert accepted([9, 1], [Pick(0), Pick(1)]) == 0
    assert accepted([9], [Pick(4)]) == 0


def test_the_rule_follows_acceptance_and_cost():
    rule = WindowRule(lambda n: 1.0 + 0.2 * (n - 1), 8)
    for _ in range(30):
        rule.record(7, 7)
    assert rule.alpha > 0.95 and rule.drafts(100) == 7 and rule.drafts(3) == 3 and rule.drafts(0) == 0
    for _ in range(40):
        rule.record(3, 0)
    assert rule.alpha < 0.1 and rule.drafts(100) == 0
    # at no acceptance it still offers one draft every 16th window, to notice a drafter that improves
    picks = [rule.drafts(100) for _ in range(32)]
    assert picks.count(1) == 2 and set(picks) == {0, 1}
    # one step a token (the default cost): no window can pay, so nothing is offered, not even a probe
    flat = WindowRule(None, 8)
    for _ in range(10):
        flat.record(4, 4)
    assert [flat.drafts(100) for _ in range(40)] == [0] * 40
    with pytest.raises(ValueError):
        WindowRule(None, 9)


def test_the_rule_takes_the_most_tokens_per_cost():
    rule = WindowRule(lambda n: 1.0 + 0.5 * (n - 1), 8)
    for _ in range(12):
        rule.record(4, 3)                        # 3 of 4 accepted, then a rejection: alpha about 0.75
    a = rule.alpha
    gains = [sum(a ** i for i in range(k + 1)) / (1.0 + 0.5 * k) for k in range(8)]
    assert rule.drafts(100) == int(np.argmax(gains)) and rule.gain(3) == pytest.approx(gains[3])
    assert rule.steps(3) == 2.5


def test_each_request_starts_its_own_rule(fixtures_dir):
    """The rule reads acceptance only, from a fresh prior each request: a request's windows are a function of its
    tokens, whatever ran before."""
    model = open_model(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf")
    be = CPUBackend(model, 256)
    s = Session(be, eog_ids=(), drafter=NgramDrafter())
    first = s.run(GenRequest(30, list(range(5, 25))), lambda ln: None)
    r1 = s.rule
    s.run(GenRequest(30, list(range(40, 70))), lambda ln: None)
    again = s.run(GenRequest(30, list(range(5, 25))), lambda ln: None)
    assert s.rule is not r1 and (again.drafts_offered, again.drafts_accepted) == \
        (first.drafts_offered, first.drafts_accepted)
    be.close()


# --- drafters -------------------------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_longest_match():
    d = NgramDrafter(max_n=3, min_n=2)
    d.observe([2, 3, 4, 6, 2, 3, 7, 8, 9, 2])
    assert d.propose(3, 4).tokens == [7, 8, 9, 2]          # (2, 3): its latest occurrence was followed by 7
    assert d.propose(3, 2).tokens == [7, 8]
    assert d.propose(5, 4).tokens == []                     # (2, 5): never seen
    d.observe([3, 4])                                        # ... 9 2 3 4
    assert d.propose(6, 6).tokens == [2, 3, 7, 8, 9, 2]     # (3, 4, 6) once, then 2 3 7 ...: the longest first
    d.rewind(6)                                              # back to 2 3 4 6 2 3
    assert d.seq == [2, 3, 4, 6, 2, 3] and d.propose(4, 3).tokens == [6, 2, 3]
    d.rewind(0)
    assert d.propose(1, 3).tokens == [] and d.propose(1, 0).tokens == []


def test_make_drafter_chooses_and_refuses(fixtures_dir):
    model = open_model(fixtures_dir / "reference" / "tiny-llama-legacy.gguf")
    be = CPUBackend(model, 64)
    assert make_drafter("off", be, model) is None
    assert make_drafter("ngram", be, model).name == "ngram"
    assert make_drafter("auto", be, model).name == "ngram"
    with pytest.raises(DraftError, match="--draft mtp: llama has no MTP block"):
        make_drafter("mtp", be, model)
    with pytest.raises(DraftError, match="choose one of"):
        make_drafter("eagle", be, model)
    hybrid = open_model(HYBRIDS["qwen3next"])
    hb = CPUBackend(hybrid, 64)
    assert make_drafter("auto", hb, hybrid).name == "mtp" == make_drafter("mtp", hb, hybrid).name
    be.close()
    hb.close()
