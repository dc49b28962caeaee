"""The CUDA backend's memory modes against the NumPy reference: --mmap-experts (no expert pinned) and
--resident-budget-gib (about half the experts pinned), with the VRAM cache holding all, half and none of the experts,
through the prompt pass with the experts streamed through its ring and read in place: teacher-forced logits within
1e-2 relative, greedy tokens equal over 64 steps, DONE's file blobs when experts come from the file; and the worker
taking the flags end to end."""
import re

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine import protocol  # noqa: E402
from engine.session import Session  # noqa: E402
import gpu_compare  # noqa: E402
from gpu_compare import assert_same_greedy, greedy  # noqa: E402
from route_ties import RouteRecorder  # noqa: E402

CTX = 256
N_GREEDY = 64
MODELS = ("tiny-qwen3moe-q4k", "tiny-qwen2moe-mixed")     # the second has a shared expert and mixed quant types
MiB = 1 << 20


@pytest.fixture(scope="module")
def cpu_runs(fixtures_dir):
    return gpu_compare.cpu_runs(fixtures_dir, MODELS, N_GREEDY, CTX)


def half_budget_gib(model):
    from engine.cuda.arena import blob_layout
    cfg = model.config
    return (cfg.n_layer * cfg.n_expert // 2) * blob_layout(model).stride / 2**30


def backend(model, mode, share, prefill="in_place", **extra):
    """prefill: "ring" streams every chunk's non-resident experts through the ring; "in_place" (the default
    stream_min, longer than these prompts) reads them in place, the file-only ones staged per layer."""
    from engine.cuda.backend import CUDABackend, CudaOptions
    cfg = model.config
    total = cfg.n_layer * cfg.n_expert
    opts = dict(expert_slots={"none": 0, "half": total // 2, "all": total}[share], adapt_every=4)
    if prefill == "ring":
        opts["stream_min"] = 1
    if mode == "mmap":
        opts["mmap_experts"] = True
    else:
        opts["resident_budget_gib"] = half_budget_gib(model)
    opts.update(extra)
    return CUDABackend(model, CTX, CudaOptions(**opts), tracer=RouteRecorder())


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("prefill", ["in_place", "ring"])
@pytest.mark.parametrize("share", ["none", "half", "all"])
@pytest.mark.parametrize("mode", ["mmap", "budget"])
def test_memory_mode_matches_cpu(cpu_runs, name, mode, share, prefill):
    model, prompt, toks, cpu_logits = cpu_runs[name]
    cfg = model.config
    total = cfg.n_layer * cfg.n_expert
    be = backend(model, mode, share, prefill)
    try:
        info = be.info()
        assert info["memory"] == mode
        assert info["experts_pinned"] == (0 if mode == "mmap" else total // 2)
        assert info["arena_mib"] == int(info["experts_pinned"] * be.layout.stride / MiB)
        assert info["staging_mib"] > 0
        # teacher-forced through the prompt pass, then the same positions through the decode step
        gpu_compare.assert_pass_and_decode_match(be, model, CTX, prompt, toks, cpu_logits)
        # greedy from a fresh cache position, the stats of that request
        be.truncate(0)
        be.reset_stats()
        assert_same_greedy(greedy(be, prompt, N_GREEDY), toks, cpu_logits)
        st = be.get_stats()
        assert st.lookups == (N_GREEDY - 1) * cfg.n_layer * cfg.n_expert_used
        assert 0 <= st.ram_blobs <= st.lookups - st.hits
        assert st.file_mb == pytest.approx(st.file_blobs * be.layout.nbytes / MiB)
        if share == "all":
            assert st.hits == st.lookups and be.mem.paged.paged_steps == 0
        else:
            assert be.mem.paged.paged_steps > 0 or be.cache.reachable()
    finally:
        be.close()


def _profile_half_and_half(cpu_runs, tmp_path, seed: int, adapt_every: int):
    """The tiny MoE model's backend with a random expert profile (seeded): VRAM holds its first half, the resident
    budget pins the second half. Returns (backend, the profile's order, the CPU run)."""
    from engine.profile import from_flat, save_profile
    run = cpu_runs["tiny-qwen3moe-q4k"]
    cfg = run[0].config
    order = np.random.default_rng(seed).permutation(cfg.n_layer * cfg.n_expert)
    path = tmp_path / "p.bin"
    save_profile(path, from_flat(cfg.n_layer, cfg.n_expert, order))
    be = backend(run[0], "budget", "half", expert_profile=str(path), adapt_every=adapt_every)
    return be, order, run


def test_budget_after_a_profile_filled_vram_keeps_the_whole_step_graph(cpu_runs, tmp_path):
    """VRAM holds the profile's first half, the budget pins the second half: every expert is readable without the
    file, so every step is the whole-step graph (and nothing is read from the file while decoding)."""
    be, order, (_, prompt, toks, cpu_logits) = _profile_half_and_half(cpu_runs, tmp_path, 1, adapt_every=0)
    total = len(order)
    try:
        assert be.cache.n_slots == total // 2
        assert set(np.flatnonzero(be.cache.resident())) == set(order[:total // 2].tolist())
        assert set(np.flatnonzero(be.arena.pinned)) == set(order[total // 2:].tolist())
        assert be.cache.reachable()
        be.reset_stats()
        assert_same_greedy(greedy(be, prompt, N_GREEDY), toks, cpu_logits)
        assert be.mem.paged.paged_steps == 0 and be.mem.paged.graph_steps == N_GREEDY - 1
        st = be.get_stats()
        assert st.file_blobs == 0 and st.ram_blobs == st.lookups - st.hits
    finally:
        be.close()


def test_the_adaptive_tier_keeps_a_reachable_table_reachable(cpu_runs, tmp_path):
    """VRAM holds the profile's first half, the budget pins the second half, the adaptive tier runs (every 4 tokens)
    with the profile's order random against the real routing, so it wants swaps: it must not evict an expert that has
    no pinned copy (its entry would become 0 and every later step would take the per-layer path)."""
    be, _, (_, prompt, toks, cpu_logits) = _profile_half_and_half(cpu_runs, tmp_path, 2, adapt_every=4)
    try:
        assert be.cache.reachable()
        be.reset_stats()
        assert_same_greedy(greedy(be, prompt, N_GREEDY), toks, cpu_logits)
        assert be.cache.reachable() and be.mem.paged.paged_steps == 0
        assert be.get_stats().file_blobs == 0
    finally:
        be.close()


@pytest.mark.parametrize("mode", ["mmap", "budget"])
def test_small_staging_ring_thrashes_and_stays_right(cpu_runs, mode):
    """The smallest staging ring the prompt pass allows (a ring batch or a layer's in-place group, plus one; fewer is
    refused with the number): file-only experts are read again and again, and the answer stays right."""
    model, prompt, toks, cpu_logits = cpu_runs["tiny-qwen3moe-q4k"]
    with pytest.raises(ValueError, match=r"the staging ring needs at least \d+ slots") as refused:
        backend(model, mode, "none", staging_slots=3, adapt_every=0)
    need = int(re.search(r"needs at least (\d+) slots", str(refused.value)).group(1))
    be = backend(model, mode, "none", staging_slots=need, adapt_every=0)
    try:
        be.reset_stats()
        assert_same_greedy(greedy(be, prompt, 32), toks[:32], cpu_logits)
        st = be.get_stats()
        assert st.hits == 0 and st.file_blobs > 0
        assert be.mem.source.lru.pins.sum() == 0
    finally:
        be.close()


def test_done_reports_file_blobs_with_the_cache_empty(cpu_runs):
    model, prompt, toks, cpu_logits = cpu_runs["tiny-qwen3moe-q4k"]
    be = backend(model, "mmap", "none", adapt_every=0)
    try:
        lines = []
        done = Session(be, eog_ids=()).run(protocol.GenRequest(16, prompt), lines.append)
        assert done is not None
        line = protocol.parse_done(lines[-1])
        assert (line.hits, line.lookups, line.ram_blobs, line.file_blobs) == (done.hits, done.lookups,
                                                                              done.ram_blobs, done.file_blobs)
        assert done.hits == 0 and done.file_blobs > 0
        assert line.file_mb == pytest.approx(done.file_blobs * be.layout.nbytes / MiB, abs=0.06)
        assert done.ram_blobs <= done.lookups
        assert_same_greedy([int(t.split()[1]) for t in lines if t.startswith("T ")], toks[:16], cpu_logits)
    finally:
        be.close()


@pytest.mark.parametrize("flags", [["--mmap-experts"], ["--resident-budget-gib", "0.002"]])
def test_worker_takes_the_memory_flags(fixtures_dir, flags):
    from test_worker_protocol import PROMPT, Worker, gen, shape
    w = Worker(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf", "--backend", "cuda", "--expert-slots", "0",
               *flags)
    try:
        mode = "mmap" if flags[0] == "--mmap-experts" else "budget"
        assert w.info["memory"] == mode
        assert int(w.info["arena_mib"]) < 4 and float(w.info["staging_mib"]) >= 0
        lines = w.request(gen(6, PROMPT))
        assert re.fullmatch(r"RESUME( PP)+ REUSED( T)* DONE", shape(lines)), lines
        done = protocol.parse_done(lines[-1])
        assert done.hits == 0 and done.file_blobs > 0
        assert w.quit() == 0
    finally:
        w.kill()


@pytest.mark.parametrize("mode", ["mmap", "budget"])
def test_close_gives_back_every_byte_and_the_next_backend_is_right(cpu_runs, mode):
    """The benches build a backend per budget in one process: a closed one holds no VRAM even while a name still
    refers to it (the per-layer graphs and the step's prefetcher referred to the cache; swaps may still have been
    copying), so the next one's cache is sized from what is really free, and decodes as the CPU does."""
    import gc
    model, prompt, toks, cpu_logits = cpu_runs["tiny-qwen3moe-q4k"]
    pool = cp.get_default_memory_pool()
    gc.collect()
    pool.free_all_blocks()
    before, held = pool.used_bytes(), pool.total_bytes()
    be = backend(model, mode, "half")
    try:
        greedy(be, prompt, 16)          # adapt_every=4: swaps have started
        assert pool.used_bytes() > before + be.cache.nbytes
    finally:
        be.close()
    gc.collect()
    pool.free_all_blocks()
    assert (pool.used_bytes(), pool.total_bytes()) == (before, held), "a closed backend still holds VRAM"
    nxt = backend(model, mode, "half")
    try:
        nxt.reset_stats()
        assert_same_greedy(greedy(nxt, prompt, N_GREEDY), toks, cpu_logits)
        st = nxt.get_stats()
        assert 0 <= st.ram_blobs <= st.lookups - st.hits
    finally:
        nxt.close()
