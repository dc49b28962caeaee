"""Speculative decoding on the CUDA backend (GPU machine): with every drafter the tokens are the CUDA backend's own
plain tokens, greedy and sampled at a seed, whatever share of the experts sits in VRAM (none, half, all), on each
family's tiny fixture. On the moe family's files a window is one window step (engine/cuda/decode_window.py), whose
kernels keep one-token decoding's arithmetic per token, and its K/V past the accepted prefix is cut back by truncate;
the hybrids run one step a token, their state cut back by the session's snapshot and replay. Either way the tokens
must be equal, not only near."""
from pathlib import Path

import numpy as np
import pytest

from engine.drafters.ngram import NgramDrafter
from engine.drafters.oracle import OracleDrafter
from engine.gguf_model import open_model
from engine.protocol import GenRequest
from engine.session import Session
from engine.speculate import FixedWindow

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
MODELS = ("ref:tiny-llama-legacy", "ref:tiny-qwen3moe-q4k", "ref:tiny-qwen2moe-mixed",
          "hybrid:tiny-qwen3next-q4_k_m", "hybrid:tiny-qwen35moe-q4_k_m")
CTX = 256


def path_of(name, fixtures_dir):
    kind, stem = name.split(":")
    return fixtures_dir / "reference" / f"{stem}.gguf" if kind == "ref" else HERE / "fixtures" / "hybrid" / f"{stem}.gguf"


def run(be, prompt, n, drafter=None, rule=None, params=None):
    be.truncate(0)
    s = Session(be, eog_ids=(), drafter=drafter, rule=rule)
    lines = []
    done = s.run(GenRequest(n, list(prompt), dict(params or {})), lines.append)
    assert done is not None, lines
    return [int(ln.split()[1]) for ln in lines if ln.startswith("T ")], done


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("share", ["none", "half", "all"])
def test_windows_give_the_plain_tokens(fixtures_dir, name, share):
    from engine.cuda.backend import CUDABackend, CudaOptions
    model = open_model(path_of(name, fixtures_dir))
    cfg = model.config
    opts = {}
    if cfg.is_moe:
        total = cfg.n_layer * cfg.n_expert
        opts = dict(expert_slots={"none": 0, "half": total // 2, "all": total}[share], adapt_every=4)
    elif share != "all":
        pytest.skip("a dense model has no experts to place")
    be = CUDABackend(model, CTX, CudaOptions(**opts))
    try:
        prompt = [int(t) for t in np.random.default_rng(3).integers(1, cfg.n_vocab, 24)]
        plain, _ = run(be, prompt, 40)
        V = cfg.n_vocab
        for drafter, rule in ((NgramDrafter(), FixedWindow(8)), (OracleDrafter(prompt + plain, 0.5, V, 1),
                                                                 FixedWindow(5)),
                              (OracleDrafter(prompt + plain, 0.9, V, 2), FixedWindow(8))):
            got, done = run(be, prompt, 40, drafter, rule)
            assert got == plain, drafter.name
        assert 0 < done.drafts_accepted < done.drafts_offered
        params = {"temperature": 0.9, "top_k": 40, "seed": 11}
        splain, _ = run(be, prompt, 24, params=params)
        got, done = run(be, prompt, 24, OracleDrafter(prompt + splain, 0.7, V, 3), FixedWindow(4), params)
        assert got == splain and done.drafts_offered > 0
    finally:
        be.close()


def test_the_cuda_backend_has_no_mtp_drafter_yet(fixtures_dir):
    """The MTP block reads hidden rows the CUDA backend does not give yet: --draft mtp is refused, auto is ngram."""
    from engine.cuda.backend import CUDABackend, CudaOptions
    from engine.drafters import DraftError, make_drafter
    model = open_model(HERE / "fixtures" / "hybrid" / "tiny-qwen35moe-q4_k_m.gguf")
    be = CUDABackend(model, CTX, CudaOptions())
    try:
        with pytest.raises(DraftError, match="gives no hidden rows"):
            make_drafter("mtp", be, model)
        assert make_drafter("auto", be, model).name == "ngram"
    finally:
        be.close()


def test_the_rule_sizes_windows_from_the_window_cost(fixtures_dir, monkeypatch):
    """Without --draft-fixed the window rule reads CUDABackend.window_cost: with window steps cheaper than a step a
    token (a table like the H200's) it offers drafts, and the tokens are still the plain ones."""
    from engine.cuda import decode_window as dw
    from engine.cuda.backend import CUDABackend, CudaOptions
    monkeypatch.setattr(dw, "MEASURED_COST", {2: 1.1, 4: 1.3, 8: 1.9})
    model = open_model(path_of("ref:tiny-qwen3moe-q4k", fixtures_dir))
    be = CUDABackend(model, CTX, CudaOptions())
    try:
        assert be.window_cost(4) == pytest.approx(1.3) and be.window_cost(1) == 1.0
        prompt = [int(t) for t in np.random.default_rng(4).integers(1, model.config.n_vocab, 24)]
        plain, _ = run(be, prompt, 40)
        got, done = run(be, prompt, 40, OracleDrafter(prompt + plain, 0.9, model.config.n_vocab, 5))
        assert got == plain and done.drafts_offered > 8
    finally:
        be.close()
