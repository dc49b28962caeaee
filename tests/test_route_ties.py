"""tests/route_ties.py: the NumPy reference that follows another backend's routes at its own near-ties (CPU only)."""
import numpy as np
import pytest

from engine.arch import base
from engine.backend_cpu import CPUBackend
from engine.gguf_model import open_model
from gpu_compare import rel_rows
from route_ties import ROUTE_TIE, Reference, gap, gpu_routes, greedy_reference

CTX = 256


@pytest.fixture(scope="module")
def qwen2(fixtures_dir):
    model = open_model(fixtures_dir / "reference" / "tiny-qwen2moe-mixed.gguf")
    prompt = np.random.default_rng(5).integers(3, 1000, 200).tolist()     # test_cuda_prefill's prompt
    cpu = CPUBackend(model, CTX)
    plain = cpu.forward(prompt, all_logits=True)
    cpu.close()
    return model, prompt, plain


@pytest.fixture(scope="module")
def probed(qwen2):
    """A Reference that read the prompt with its own routes: its margins and rankings (one forward for the module)."""
    model, prompt, _ = qwen2
    ref = Reference(model, CTX)
    ref.forward(prompt, all_logits=True)
    ref.close()
    return ref


def other_route(probed, key, k):
    """The expert set a near-tie would part to at (position, layer): the k-th expert swapped for the (k+1)-th."""
    r = probed.ranked[key]
    return frozenset(r[:k - 1] + [r[k]])


def test_no_routes_given_is_the_plain_backend(qwen2):
    model, prompt, plain = qwen2
    ref = Reference(model, CTX)
    try:
        got = ref.forward(prompt, all_logits=True)
        net = ref.cpu.net
        assert "ffn" not in vars(net) and "forward" not in vars(net)       # the patches are gone afterwards
        import engine.arch.qwen2moe as q2
        assert q2.route is base.route
    finally:
        ref.close()
    np.testing.assert_array_equal(got, plain)
    assert ref.parted == []
    assert len(ref.margins) == len(prompt) * model.config.n_layer
    assert all(m >= 0 for m in ref.margins.values())


def forced(model, prompt, probed, pick):
    """The route of the (token, layer) with the smallest (pick=min) or largest (max) router margin handed to a fresh
    Reference as another backend's choice: (its margin, the key, the route given, the Reference, its logits)."""
    key, g = pick(probed.margins.items(), key=lambda kv: kv[1])
    theirs = other_route(probed, key, model.config.n_expert_used)
    ref = Reference(model, CTX, {key: theirs})
    try:
        got = ref.forward(prompt, all_logits=True)
    finally:
        ref.close()
    return g, key, theirs, ref, got


def test_a_near_tie_is_followed_and_reported(qwen2, probed):
    model, prompt, plain = qwen2
    g, key, theirs, ref, got = forced(model, prompt, probed, min)
    assert g < ROUTE_TIE           # the fixture prompt has near-ties (token 192, layer 0: 1.3e-4)
    pos = key[0]
    assert [p[:2] for p in ref.parted] == [key] and sorted(theirs) == ref.parted[0][4]
    assert ref.clear_parts() == []
    # causal: earlier rows unchanged (up to BLAS's order: the other rows of both experts multiply in other groups)
    assert rel_rows(got[:pos], plain[:pos]).max() < 1e-5
    # the parted row moves far past the 1e-2 the CUDA tests allow: this is what a near-tie costs
    assert rel_rows(got[pos:pos + 1], plain[pos:pos + 1])[0] > 5e-2


def test_a_clear_gap_is_not_followed_but_reported(qwen2, probed):
    model, prompt, plain = qwen2
    g, key, _, ref, got = forced(model, prompt, probed, max)
    assert g >= ROUTE_TIE
    np.testing.assert_array_equal(got, plain)
    assert [p[:2] for p in ref.clear_parts()] == [key]


def test_gpu_routes_and_gap():
    ids = np.array([[3, 1], [0, 2]])
    assert gpu_routes([(10, 2, ids)], cupy_get=lambda a: a) == {(10, 2): frozenset({1, 3}), (11, 2): frozenset({0, 2})}
    np.testing.assert_allclose(gap(np.array([[0.5, 2.0, 1.0, 1.9]]), 2), [0.9])


def test_greedy_reference_follows_the_prompt_routes(qwen2):
    model, prompt, plain = qwen2
    cpu = CPUBackend(model, CTX)
    want = [int(np.argmax(cpu.forward(prompt[:40])))]
    cpu.close()
    ref = Reference(model, CTX)
    try:
        toks, logits = greedy_reference(ref, prompt[:40], 3)
    finally:
        ref.close()
    assert toks[0] == want[0] and logits.shape == (3, model.config.n_vocab)
    assert [int(np.argmax(r)) for r in logits] == toks
