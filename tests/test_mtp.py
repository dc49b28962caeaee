"""The MTP drafter (engine/drafters/mtp.py) against llama.cpp's draft-mtp (tests/fixtures/mtp/*.json, made by
python -m tools.mtp_ref), and its own bookkeeping: a batch and single tokens agree, a cut back and a re-read agree
with a fresh read, a draft leaves the cache as the trunk's rows would have.

On the F16 files llama.cpp's MTP logits were measured within 0.035 of ours at every one of the 340 prompt
positions of each architecture (median 0.005), top-1 agreeing at all but two qwen3next positions (ties within
0.001), and its drafts equal ours.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from engine.backend_cpu import CPUBackend
from engine.drafters.mtp import RECENT, MTPDrafter
from engine.gguf_model import open_model
from engine.sampling import PickSpec
from tools.mtp_ref import ARCHS, make_f16

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "mtp"
MAX_DIFF = 0.1      # measured 0.035 (qwen3next) and 0.031; llama.cpp's F16 matmuls round activations


@pytest.fixture(scope="module", params=ARCHS)
def f16(request, tmp_path_factory):
    path, _ = make_f16(request.param, tmp_path_factory.mktemp("mtp") / f"tiny-{request.param}-f16.gguf")
    ref = json.loads((FIXTURES / f"tiny-{request.param}-f16-mtp.json").read_text())
    model = open_model(path)
    be = CPUBackend(model, 512)
    assert be.keep_hidden(True)
    yield model, be, ref
    be.close()


def trunk(be, prompt):
    be.truncate(0)
    logits = be.forward(prompt)
    return int(np.argmax(logits)), be.hidden().copy()


def test_the_block_agrees_with_llama_cpp(f16):
    model, be, ref = f16
    for case in ref["cases"]:
        prompt = case["prompt_ids"]
        first, H = trunk(be, prompt)
        assert first == case["first"]
        d = MTPDrafter.for_backend(be, model)
        rows = np.concatenate([np.zeros((1, H.shape[1]), np.float32), H[:-1]])
        L = d.logits(d.block(prompt, rows, 0))
        diffs = []
        for i, top in enumerate(case["teacher"]):
            ids = [t[0] for t in top]
            diffs.append(np.abs(L[i, ids] - [t[1] for t in top]).max())
            if top[0][1] - top[1][1] > 2 * MAX_DIFF:       # a clear top-1: ours is the same token
                assert int(np.argmax(L[i])) == ids[0], i
        assert max(diffs) <= MAX_DIFF and np.median(diffs) <= 0.01, (max(diffs), np.median(diffs))
        d2 = MTPDrafter.for_backend(be, model)
        d2.observe(prompt, H)
        draft = d2.propose(first, len(case["draft_ids"]))
        assert draft.tokens == case["draft_ids"] and draft.probs is None


def test_a_batch_and_single_tokens_read_alike(f16):
    model, be, ref = f16
    prompt = ref["cases"][1]["prompt_ids"]
    first, H = trunk(be, prompt)
    one, many = MTPDrafter.for_backend(be, model), MTPDrafter.for_backend(be, model)
    one.observe(prompt, H)
    for i, t in enumerate(prompt):
        many.observe([t], H[i:i + 1])
    assert one.n == many.n == len(prompt)
    k1, k2 = one.kv.k[one.il][:, :len(prompt)], many.kv.k[many.il][:, :len(prompt)]
    np.testing.assert_allclose(k1, k2, rtol=1e-4, atol=1e-5)
    assert one.propose(first, 4).tokens == many.propose(first, 4).tokens


def test_a_cut_back_and_a_reread_are_a_fresh_read(f16):
    model, be, ref = f16
    prompt = ref["cases"][1]["prompt_ids"]
    first, H = trunk(be, prompt)
    fresh = MTPDrafter.for_backend(be, model)
    fresh.observe(prompt, H)
    want = fresh.propose(first, 3)
    d = MTPDrafter.for_backend(be, model)
    d.observe(prompt, H)
    d.propose(first, 5)                     # drafts write the cache past the prompt; a cut must forget them
    d.rewind(len(prompt) - 7)
    assert d.n == len(prompt) - 7 and np.array_equal(d.pending, H[len(prompt) - 8])
    d.observe(prompt[-7:], H[-7:])
    assert d.propose(first, 3).tokens == want.tokens
    # a cut further back than RECENT rows: the row before the cut is zeros (drafts worse, never wrong)
    long_ = MTPDrafter.for_backend(be, model)
    long_.observe(prompt, H)
    assert len(prompt) > RECENT or np.any(long_.pending)
    long_.rewind(0)
    assert long_.n == 0 and not np.any(long_.pending)


def test_a_draft_then_the_window_leaves_the_trunk_pairs(f16):
    """propose() writes the block's own rows at the draft positions; observe() of the kept tokens puts the trunk's
    there, reusing only the first entry, whose pair is the same."""
    model, be, ref = f16
    prompt = ref["cases"][1]["prompt_ids"]
    first, H = trunk(be, prompt)
    d = MTPDrafter.for_backend(be, model)
    d.observe(prompt, H)
    draft = d.propose(first, 4)
    kept = [first] + draft.tokens[:2]
    be.decode(kept, PickSpec(), all_positions=True)
    Hk = be.hidden().copy()
    d.observe(kept, Hk)
    ref_d = MTPDrafter.for_backend(be, model)
    ref_d.observe(prompt, H)
    ref_d.observe(kept, Hk)
    n = len(prompt) + len(kept)
    np.testing.assert_allclose(d.kv.k[d.il][:, :n], ref_d.kv.k[ref_d.il][:, :n], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d.kv.v[d.il][:, :n], ref_d.kv.v[ref_d.il][:, :n], rtol=1e-4, atol=1e-5)


def test_sampled_requests_get_drafts_with_their_distribution(f16):
    from engine.sampling import Sampler
    model, be, ref = f16
    prompt = ref["cases"][1]["prompt_ids"]
    first, H = trunk(be, prompt)
    d = MTPDrafter.for_backend(be, model, sampled=True)
    d.observe(prompt, H)
    s = Sampler({"temperature": 0.8, "top_k": 20, "seed": 3})
    assert MTPDrafter.for_backend(be, model).propose(first, 3, s).probs is None     # not asked for: the argmax
    a, b = d.propose(first, 3, s), d.propose(first, 3, s)
    assert a.tokens == b.tokens and len(a.probs) == 3          # the drafter's draws follow the request's seed
    for t, q in zip(a.tokens, a.probs):
        assert q[t] > 0 and abs(q.sum() - 1.0) < 1e-9 and np.count_nonzero(q) <= 20
    assert d.propose(first, 3, Sampler({})).probs is None       # greedy: the argmax, for sure
