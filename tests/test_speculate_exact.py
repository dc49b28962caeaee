"""Greedy speculation is plain greedy by construction (issue 30's exactness), on several prompts of every family's
tiny fixtures: the CPU backend runs a verify window's tokens through the one-token forward
(engine/backend_cpu.py _window_forward), so each position's logits are plain decoding's bit for bit, and a window
of any length, with any drafts, emits plain greedy's tokens. A T-row forward parted from them: bench.spec's
window-4 rows on tiny-qwen35moe at oracle acceptance 0.9 and 1.0 were NOT EXACT (14 tokens in)."""
import numpy as np
import pytest

from engine.backend_cpu import CPUBackend
from engine.drafters.ngram import NgramDrafter
from engine.drafters.oracle import OracleDrafter
from engine.gguf_model import open_model
from engine.speculate import FixedWindow
from tests.test_speculate import HYBRIDS, NoRewind, made, run  # noqa: F401  (made: the module's fixture)

N_NEW = 24
FILES = ["ref:tiny-qwen3moe-q4k", "qwen3next", "qwen35moe", "made:gpt-oss-tiny"]


def _path(key, fixtures_dir, made):
    if key.startswith("ref:"):
        return fixtures_dir / "reference" / f"{key[4:]}.gguf"
    if key.startswith("made:"):
        return made[key[5:]]
    return HYBRIDS[key]


@pytest.fixture(scope="module", params=FILES)
def model(request, fixtures_dir, made):
    return request.param, open_model(_path(request.param, fixtures_dir, made))


def _prompts(model, n=3):
    V = model.config.n_vocab
    return [[int(t) for t in np.random.default_rng(seed).integers(1, V, 24)] for seed in range(n)]


def test_a_windows_logits_are_the_one_token_logits(model):
    key, m = model
    for cls in (CPUBackend, NoRewind):
        be = cls(m, 128)
        for prompt in _prompts(m, 2):
            be.truncate(0)
            be.forward(prompt)
            window = prompt[:5]
            got = be.forward(window, all_logits=True).copy()
            be.truncate(0)
            be.forward(prompt)
            want = np.stack([be.forward([t]) for t in window])
            np.testing.assert_array_equal(got, want, err_msg=f"{key} {cls.__name__}")
        be.close()


def test_greedy_windows_of_2_to_5_are_plain_greedy(model):
    key, m = model
    V = m.config.n_vocab
    be = CPUBackend(m, 128)
    for i, prompt in enumerate(_prompts(m)):
        plain, _, _, _ = run(be, prompt, N_NEW)
        for w in range(2, 6):
            for name, drafter in (("oracle-1.0", OracleDrafter(prompt + plain, 1.0, V, seed=i)),
                                  ("oracle-0.7", OracleDrafter(prompt + plain, 0.7, V, seed=i)),
                                  ("ngram", NgramDrafter())):
                got, _, done, _ = run(be, prompt, N_NEW, drafter, FixedWindow(w))
                assert got == plain, f"{key} prompt {i} window {w} {name}: {got} != {plain}"
                if name == "oracle-1.0":    # every draft offered is the truth, so every one is accepted
                    assert done.drafts_offered > 0 and done.drafts_accepted == done.drafts_offered, (key, w, done)
    be.close()
