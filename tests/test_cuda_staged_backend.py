"""The staged backend (engine/cuda/staged_backend.py: the worker's --gpus 0,0 --layer-split N,M) agrees with the
unsplit one on every splittable family's tiny model: two and three stages on one GPU, a prompt of several chunks
(the staged prompt pass hands each chunk's rows from stage to stage), greedy decode after it, with every expert
cached (each stage's cache holds its layers' experts) and with a third of them (each stage's cache filled from its
share of a random profile; the prompt's chunks stream the rest through each stage's own ring; the adaptive tier runs
on each stage's own stream).

Agreement (DESIGN section 7): the same kernels run on the same inputs, so the staged logits stay within 1e-3 relative
(row by row) of the unsplit ones, ten times inside the CUDA backend's 1e-2 bound against exact arithmetic (only the
order of float atomics and which experts come from VRAM or the ring differ); greedy tokens are equal up to a step
whose unsplit top-2 margin is a near-tie (gpu_compare.TIE); the expert lookups are the same count."""
import re

import numpy as np
import pytest

from gpu_compare import assert_same_greedy, greedy, rel_rows
from tiny_models import FAMILIES, tiny_model

pytestmark = pytest.mark.gpu

CTX = 256
CHUNK = 16              # the prompt below spans four chunks
N_NEW = 10
TOL = 1e-3


def _prompt(prompt):
    return (list(prompt) * (1 + (3 * CHUNK + 5) // max(len(prompt), 1)))[:3 * CHUNK + 5]


def _options(cfg, cache, profile, **kw):
    from engine.cuda.args import CudaOptions
    total = cfg.n_layer * cfg.n_expert
    part = cache == "part"
    # no prefetch and no run-ahead on either side: the staged backend has neither, so both run the same programs
    return CudaOptions(pipeline=False, prefetch=False, prefill_chunk=CHUNK, expert_slots=total // 3 if part else None,
                       expert_profile=profile if part else None, adapt_every=4 if part else 0,
                       stream_min=CHUNK if part else 1024, **kw)


def _profile(cfg, path, seed=11):
    from engine.profile import from_flat, save_profile
    order = np.random.default_rng(seed).permutation(cfg.n_layer * cfg.n_expert)
    save_profile(path, from_flat(cfg.n_layer, cfg.n_expert, order))
    return str(path)


def _run(be, prompt, toks=None):
    """Greedy from prompt (N_NEW tokens: the prompt pass, then decode steps) and its expert stats; then, teacher-forced
    on `toks` (the unsplit run's tokens; its own when None), every row of prompt + toks[:-1] through the prompt pass,
    and the prompt pass followed by toks[:-1] through the decode step."""
    be.truncate(0)
    be.reset_stats()
    got = greedy(be, prompt, N_NEW)
    stats = be.get_stats()
    toks = got if toks is None else toks
    be.truncate(0)
    rows = be.forward(prompt + toks[:-1], all_logits=True)
    be.truncate(0)
    be.forward(prompt)
    dec = np.stack([be.forward([t]) for t in toks[:-1]])
    be.truncate(0)
    return got, stats, rows, dec


def _splits(n):
    return [(n // 2, n - n // 2)] + ([(1, n - 2, 1)] if n >= 3 else [])


def _check_caches(be, cfg, cache, profile):
    """Each stage's cache holds only its own layers' experts: all of them, or the top of its profile share."""
    from engine.cuda import stages as st
    from engine.profile import load_profile
    caches = be.stage_caches
    assert len(caches) == len(be.specs)
    for s, c in zip(be.specs, caches):
        assert c.n_served == (s.end - s.first) * cfg.n_expert
        assert not (c.resident() & ~c.serves).any()
    if cache == "all":
        assert [c.n_slots for c in caches] == [c.n_served for c in caches]
        assert be.cache.resident().all()
        return
    total = cfg.n_layer * cfg.n_expert
    assert 0 < be.cache.n_slots <= total // 3 and all(c.n_slots > 0 for c in caches)
    shares = st.profile_shares(load_profile(profile, cfg.n_layer, cfg.n_expert), be.specs)
    for c, share in zip(caches, shares):
        # ExpertCache.fill: each expert in profile order into a free slot of its own pool while that pool has one
        left = np.bincount(c.slot_pool, minlength=c.pools.n_pools)
        want = set()
        for g in share.flat_order():
            p = c.exp_pool[g]
            if left[p]:
                left[p] -= 1
                want.add(int(g))
        assert set(np.flatnonzero(c.resident()).tolist()) == want


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", ["all", "part"])
def test_staged_backend_agrees_with_one_stage(family, cache, tmp_path, fixtures_dir):
    import cupy as cp

    from engine.cuda.backend import CUDABackend
    from engine.cuda.staged_backend import StagedBackend
    model, prompt = tiny_model(family, tmp_path, fixtures_dir)
    cfg = model.config
    prompt = _prompt(prompt)
    profile = _profile(cfg, tmp_path / "p.bin")
    ref = CUDABackend(model, CTX, _options(cfg, cache, profile))
    try:
        assert ref.prompt_chunk_size() == CHUNK
        want, ref_stats, ref_rows, ref_dec = _run(ref, prompt)
    finally:
        ref.close()
    assert np.isfinite(ref_rows).all() and np.isfinite(ref_dec).all()
    assert ref_stats.lookups > 0
    here = cp.cuda.Device().id
    for counts in _splits(cfg.n_layer):
        opts = _options(cfg, cache, profile, gpus=(here,) * len(counts), layer_split=counts)
        be = StagedBackend(model, CTX, opts)
        try:
            info = be.info()
            assert info["stages"] == ",".join(f"{s.first}-{s.end - 1}" for s in be.specs)
            assert info["pipeline"] == "off" and info["prefetch"] == "off"
            assert be.prompt_chunk_size() == CHUNK
            assert [st.layers_run for st in be.step.steps] == [s.layers for s in be.specs]
            _check_caches(be, cfg, cache, profile)
            got, stats, rows, dec = _run(be, prompt, want)
        finally:
            be.close()
        what = f"{family} {cache} {counts}"
        assert_same_greedy(got, want, ref_rows[len(prompt) - 1:])
        assert stats.lookups == ref_stats.lookups, what
        if cache == "all":
            assert stats.hits == stats.lookups, what
        assert np.isfinite(rows).all() and np.isfinite(dec).all(), what
        assert rel_rows(rows, ref_rows).max() < TOL, (what, rel_rows(rows, ref_rows).max())
        assert rel_rows(dec, ref_dec).max() < TOL, (what, rel_rows(dec, ref_dec).max())


def test_staged_backend_refuses_what_it_cannot_run(tmp_path, fixtures_dir):
    import cupy as cp

    from engine.cuda.args import CudaOptions
    from engine.cuda.stages import StageError
    from engine.cuda.staged_backend import StagedBackend
    from engine.gguf_model import open_model
    model, _ = tiny_model("moe", tmp_path, fixtures_dir)
    here = cp.cuda.Device().id
    n = model.config.n_layer
    for opts, msg in [
        (CudaOptions(gpus=(here, here + 1), layer_split=(1, n - 1)), "stages on separate GPUs are not built yet"),
        (CudaOptions(gpus=(here, here), layer_split="auto"), "takes the split's layer counts"),
        (CudaOptions(gpus=(here, here), layer_split=(1, n)), f"covers {n + 1} layers; this model has {n}"),
        (CudaOptions(gpus=(here, here), layer_split=(1, n - 1), mmap_experts=True), "memory modes"),
    ]:
        with pytest.raises(StageError, match=re.escape(msg)):
            StagedBackend(model, CTX, opts)
    from pathlib import Path
    q4 = open_model(Path(__file__).resolve().parent / "fixtures" / "qwen4exp" / "tiny-qwen4exp-q2_0.gguf")
    with pytest.raises(StageError, match=r"the qwen4exp family \(qwen4exp\) cannot run as stages"):
        StagedBackend(q4, CTX, CudaOptions(gpus=(here, here), layer_split=(1, q4.config.n_layer - 1)))


# --- the worker ---------------------------------------------------------------------------------------------------

def test_worker_with_two_stages_on_one_gpu_generates_what_one_stage_does(fixtures_dir):
    """strata_worker --gpus 0,0 (the auto split's counts) against the plain worker: the same greedy tokens over a
    prompt of several chunks; INFO names the stages."""
    from engine import protocol
    from test_worker_protocol import PROMPT, Worker, gen, shape, tokens
    model = fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"
    prompt = (PROMPT * 4)[:60]
    runs = {}
    for name, flags in (("one", ()), ("two", ("--gpus", "0,0")), ("three", ("--gpus", "0,0,0", "--layer-split",
                                                                                 "1,2,1"))):
        w = Worker(model, "--backend", "cuda", "--prefill-chunk", str(CHUNK), *flags)
        try:
            if name == "two":
                assert w.info["stages"] == "0-1,2-3" and w.info["stage_gpus"] == "0,0", w.info
                assert w.info["stage_expert_slots"] == "16,16"
            if name == "three":
                assert w.info["stages"] == "0-0,1-2,3-3"
            lines = w.request(gen(12, prompt))
            assert re.fullmatch(r"RESUME( PP)+ REUSED( T)* DONE", shape(lines)), lines
            done = protocol.parse_done(lines[-1])
            assert done.hits == done.lookups and done.lookups >= (done.generated - 1) * 8      # 4 layers, k = 2
            runs[name] = (tokens(lines), done.lookups)
            assert w.quit() == 0
        finally:
            w.kill()
    assert runs["two"] == runs["one"] and runs["three"] == runs["one"], runs


SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "penalty_repeat": 1.3, "penalty_last_n": 8}


def _sampled(be, prompt, n):
    """n seeded sampled picks after prompt (the GPU sampler's chain on the last stage), penalties over the output."""
    from engine.sampling import Sampler
    be.truncate(0)
    s = Sampler(SAMPLED)
    out = []
    toks, history = list(prompt), []
    for _ in range(n):
        tok = be.decode(toks, s.spec(history=history))[0].id
        s.advance()
        history += toks
        out.append(tok)
        toks = [tok]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_staged_backend_samples_what_one_stage_samples(family, tmp_path, fixtures_dir):
    """The sampled pick runs in the last stage's graph (its sampler on the backend's stream): seeded, the same
    tokens as the unsplit backend's over a prompt of several chunks."""
    import cupy as cp

    from engine.cuda.backend import CUDABackend
    from engine.cuda.staged_backend import StagedBackend
    model, prompt = tiny_model(family, tmp_path, fixtures_dir)
    cfg = model.config
    prompt = _prompt(prompt)
    ref = CUDABackend(model, CTX, _options(cfg, "all", None))
    try:
        want = _sampled(ref, prompt, N_NEW)
    finally:
        ref.close()
    n = cfg.n_layer
    here = cp.cuda.Device().id
    be = StagedBackend(model, CTX, _options(cfg, "all", None, gpus=(here, here), layer_split=(n // 2, n - n // 2)))
    try:
        got = _sampled(be, prompt, N_NEW)
    finally:
        be.close()
    assert got == want
