"""The prompt pass end to end against the NumPy backend: logits within 1e-2 relative and
the same greedy continuation for prompts that cross several chunks, with the ring at its smallest and largest depth
and the expert cache full, half, empty (and empty with its free slots lent to the ring); STOP mid-prompt through the
worker; a chunk that does not fit refused with the numbers; the ring made of lent expert-cache slots (the coldest
experts evicted for it) giving the same answers, the table equal to its host copy, and the slots refilled after it."""
import dataclasses

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine import protocol  # noqa: E402
from engine.gguf_model import open_model  # noqa: E402
from gpu_compare import assert_same_greedy, cpu_teacher_run, greedy, rel_rows  # noqa: E402
from route_ties import (ROUTE_TIE, ROUTE_TIE_KV8, Reference, RouteRecorder, gpu_routes,  # noqa: E402
                        greedy_reference)
from test_worker_protocol import Worker, gen, shape  # noqa: E402

CTX = 512
N_PROMPT = 200
N_GREEDY = 16
CHUNK = 64
# qwen2moe (Q2_K experts) in its own process on the GPU machine: see tools/gpu_suite.sh
MODELS = ("tiny-qwen3moe-q4k", "tiny-qwen2moe-mixed", "tiny-llama-legacy")


def streamed(model, tracer=None, **opts):
    from engine.cuda.backend import CUDABackend, CudaOptions
    kw = dict(prefill_chunk=CHUNK, stream_min=1, adapt_every=0)
    kw.update(opts)
    return CUDABackend(model, CTX, CudaOptions(**kw), tracer=tracer or RouteRecorder())


@pytest.fixture(scope="module")
def cpu_runs(fixtures_dir):
    out = {}
    for name in MODELS:
        model = open_model(fixtures_dir / "reference" / f"{name}.gguf")
        rng = np.random.default_rng(5)
        prompt = rng.integers(3, min(model.config.n_vocab, 1000), N_PROMPT).tolist()
        out[name] = (model, prompt, *cpu_teacher_run(model, prompt, N_GREEDY, CTX))
    return out



def routed_logits(be, model, tokens, tie=ROUTE_TIE):
    """The pass's logits for tokens (all rows) and the NumPy backend's, the latter taking the pass's routes wherever
    its own router is a near-tie (tests/route_ties.py: a near-tie parting moves a row by 10-60%); fails on a route
    the pass took against a clear gap."""
    be.tracer.routes = []
    lg = be.forward(tokens, all_logits=True)
    ref = Reference(model, CTX, gpu_routes(be.tracer.routes), tie)
    be.tracer.routes = None
    try:
        want = ref.forward(tokens, all_logits=True)
    finally:
        ref.close()
    assert ref.clear_parts() == [], f"routes taken against a clear gap (position, layer, gap, cpu, cuda): {ref.parted}"
    return lg, want


def routed_greedy(be, model, prompt, n):
    """Greedy tokens from the pass (prompt) and the decode step, and the reference's (the prompt's routes as the pass
    took them at near-ties) with its step logits."""
    be.tracer.routes = []
    got = greedy(be, prompt, n)
    ref = Reference(model, CTX, gpu_routes(be.tracer.routes))
    be.tracer.routes = None
    try:
        want, step_logits = greedy_reference(ref, prompt, n)
    finally:
        ref.close()
    assert ref.clear_parts() == [], f"routes taken against a clear gap (position, layer, gap, cpu, cuda): {ref.parted}"
    return got, want, step_logits


def place(be, model, placement):
    """Put the expert cache in the wanted state: 'full', 'half' (every other expert), 'empty', or 'lent' (half the
    slots, none filled: the ring borrows them)."""
    if placement == "half":
        total = model.config.n_layer * model.config.n_expert
        be.cache.fill(np.arange(0, total, 2), be.stream)


PLACES = {"full": 1.0, "half": 0.5, "empty": 0.0, "lent": 0.5}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("placement", list(PLACES))
@pytest.mark.parametrize("ring", [2, None], ids=["ring2", "ringmax"])
def test_streamed_matches_cpu(cpu_runs, name, placement, ring):
    model, prompt, toks, cpu_logits = cpu_runs[name]
    cfg = model.config
    if not cfg.n_expert and (placement != "full" or ring is not None):
        pytest.skip("a dense model has no experts to place or stream")
    total = cfg.n_layer * cfg.n_expert
    be = streamed(model, expert_slots=int(total * PLACES[placement]), ring=ring)
    try:
        place(be, model, placement)
        assert be.prompt_chunk_size() == CHUNK
        seq = prompt + toks[:-1]
        lg, want = routed_logits(be, model, seq)
        assert np.isfinite(lg).all()
        assert rel_rows(lg, want).max() < 1e-2
        if cfg.n_expert and placement != "full":
            last = be.tracer.last
            assert last["ring"] >= 2 and last["bytes"] > 0          # the chunks streamed experts
            if ring == 2 and placement != "lent":
                assert last["ring"] == 2
        be.truncate(0)
        assert_same_greedy(*routed_greedy(be, model, prompt, N_GREEDY))
    finally:
        be.close()


@pytest.mark.parametrize("name", ["tiny-qwen3moe-q4k"])
def test_short_chunks_read_experts_in_place(cpu_runs, name):
    model, prompt, toks, cpu_logits = cpu_runs[name]
    be = streamed(model, expert_slots=0, stream_min=10**6)
    try:
        lg, want = routed_logits(be, model, prompt + toks[:-1])
        assert rel_rows(lg, want).max() < 1e-2
        assert be.tracer.last["ring"] == 0 and be.tracer.last["bytes"] == 0
    finally:
        be.close()


def test_a_chunk_that_does_not_fit_is_refused_with_the_numbers(cpu_runs):
    from engine.cuda.chunk_plan import ChunkRefused
    from engine.cuda.prefill import Prefill
    model = cpu_runs["tiny-qwen3moe-q4k"][0]
    be = streamed(model)
    try:
        used = cp.get_default_memory_pool().used_bytes() / 2**20
        tight = dataclasses.replace(be.opts, prefill_chunk=CTX, vram_budget_mib=int(used) + 1)
        with pytest.raises(ChunkRefused) as e:
            Prefill(be.step, tight)
        msg = str(e.value)
        assert f"a prompt chunk of {CTX} tokens" in msg and "MiB of VRAM but" in msg and "--prefill-chunk" in msg
    finally:
        be.close()


def test_stop_mid_prompt_cancels(fixtures_dir):
    w = Worker(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf", "--backend", "cuda",
               "--prefill-chunk", "16", "--tune", "stream_min=1", "--tune", "ring=2", "--expert-slots", "0")
    try:
        assert int(w.info["prefill_chunk"]) == 16
        long_prompt = [(i * 37 + 11) % 1000 for i in range(1000)]
        w.send(gen(4, long_prompt))
        assert w.read() == "RESUME 0"
        assert w.read().startswith("PP 16 1000 ")
        w.send("STOP")
        lines = w.collect()
        done = protocol.parse_done(lines[-1])
        assert done.finish == "cancel" and 0 < done.prompt_read < len(long_prompt) and done.generated == 0
        assert done.prompt_read % 16 == 0 and "T" not in shape(lines)
        again = w.request(gen(3, long_prompt[:100]))
        assert protocol.parse_done(again[-1]).finish in ("length", "stop")
        assert w.quit() == 0
    finally:
        w.kill()


def test_phase_profile_covers_the_chunk(cpu_runs):
    """bench.prefill's per-phase table: every phase of a streamed chunk is timed and the phases add up to the chunk."""
    from engine.cuda.prefill import PHASES
    model, prompt, toks, cpu_logits = cpu_runs["tiny-qwen3moe-q4k"]
    be = streamed(model, expert_slots=model.config.n_layer * model.config.n_expert // 2, ring=2,
                  tracer=RouteRecorder(phase_timing=True))
    try:
        lg, want = routed_logits(be, model, prompt[:CHUNK])
        assert rel_rows(lg, want).max() < 1e-2        # profiling changes nothing
        ms = be.tracer.last["phases"].totals()
        assert set(ms) == set(PHASES)
        for p in ("dense", "attention", "router", "sort", "gate_up", "down", "other"):
            assert ms[p] > 0, p
        assert be.tracer.last["bytes"] > 0 and ms["ring_wait"] >= 0
    finally:
        be.close()


def test_streamed_pass_writes_and_reads_an_int8_kv_cache(cpu_runs):
    """--kv int8: the pass stores K/V through KVCache.store in the int8 layout and attends with flash_attn_i8, over
    several chunks (each attending to the earlier ones through the int8 cache)."""
    model, prompt, toks, cpu_logits = cpu_runs["tiny-qwen3moe-q4k"]
    cfg = model.config
    be = streamed(model, expert_slots=cfg.n_layer * cfg.n_expert // 2, ring=2, kv="int8")
    try:
        assert be.kv.dtype == "int8"
        seq = prompt + toks[:-1]
        lg, want = routed_logits(be, model, seq, tie=ROUTE_TIE_KV8)
        assert np.isfinite(lg).all()
        assert rel_rows(lg, want).max() < 5e-2              # int8 K/V: ~1/254 of each 32 values' absmax
        n = len(seq)
        assert int(cp.count_nonzero(be.kv.k_scale[:, :, :n] > 0)) == be.kv.k_scale[:, :, :n].size
        assert int(cp.count_nonzero(be.kv.v_scale[:, :, :n] > 0)) == be.kv.v_scale[:, :, :n].size
    finally:
        be.close()


def lend_all(be, k):
    """The auto plan at a budget below all: no own ring slots, k cache slots borrowed per prompt, the coldest
    experts evicted for them (the tiny models leave VRAM for a whole own ring, so the plan is set by hand)."""
    be.prefill.plan = dataclasses.replace(be.prefill.plan, ring=0, ring_bytes=0, lend=k, lend_occupied=True)


def table_matches_host(cache):
    cp.cuda.Device().synchronize()
    return np.array_equal(cp.asnumpy(cache.table), cache.table_host)


def slots_hold_their_experts(be):
    """Every occupied slot's bytes are its expert's (the refill's copies landed where the table says)."""
    cache = be.cache
    rt = cp.cuda.runtime
    blob = cp.empty(cache.stride, dtype=cp.uint8)
    for s in np.flatnonzero(cache.owner >= 0):
        rt.memcpy(blob.data.ptr, int(cache.arena.blob_ptr[cache.owner[s]]), cache.stride, rt.memcpyDefault)
        if not bool((cache.slots[s * cache.stride:(s + 1) * cache.stride] == blob).all()):
            return False
    return True


@pytest.mark.parametrize("name", ["tiny-qwen3moe-q4k", "tiny-qwen2moe-mixed"])
def test_lent_occupied_slots_stream_and_come_back_refilled(cpu_runs, name):
    from engine.cuda.expert_cache import LENT
    model, prompt, toks, cpu_logits = cpu_runs[name]
    cfg = model.config
    total = cfg.n_layer * cfg.n_expert
    be = streamed(model, expert_slots=total // 2)
    try:
        place(be, model, "half")
        cache = be.cache
        k = cache.n_slots // 2
        lend_all(be, k)
        cache.heat[:] = np.arange(total)[::-1]         # expert 0 hottest: the lent slots are the highest ids'
        occupied = int((cache.owner >= 0).sum())
        assert occupied == cache.n_slots
        lg, want = routed_logits(be, model, prompt + toks[:-1])        # several chunks on one lending
        assert np.isfinite(lg).all() and rel_rows(lg, want).max() < 1e-2
        last = be.tracer.last
        assert last["lent"] == k and last["ring"] == k and last["bytes"] > 0
        lent = be.prefill.lent
        assert len(lent) == k and (cache.owner[lent] == LENT).all()
        evicted = np.flatnonzero((cache.slot_of < 0) & (np.arange(total) % 2 == 0))
        assert len(evicted) == k and evicted.min() > np.flatnonzero(cache.slot_of >= 0).max()   # the coldest
        assert table_matches_host(cache)
        assert be.prefill.give_back(be.stream) == k
        cache.poll(be.stream, wait=True)
        assert int((cache.owner >= 0).sum()) == occupied and not (cache.owner == LENT).any()
        assert table_matches_host(cache) and slots_hold_their_experts(be)
        # the whole thing again through the session's calls: the prompt lends, the first decode step gives back
        be.truncate(0)
        assert_same_greedy(*routed_greedy(be, model, prompt, N_GREEDY))
        assert be.prefill.lent == [] and not (cache.owner == LENT).any()
        cache.poll(be.stream, wait=True)
        assert int((cache.owner >= 0).sum()) == occupied
        assert table_matches_host(cache) and slots_hold_their_experts(be)
    finally:
        be.close()


@pytest.mark.parametrize("mode", ["mmap", "budget"])
def test_lending_in_the_memory_modes(cpu_runs, mode):
    """File-only experts (entry 0 / staged reads): lent slots stream them through the staging ring, the answers stay
    the same, and the slots come back."""
    from test_cuda_memory_modes import backend as mm_backend
    model, prompt, toks, cpu_logits = cpu_runs["tiny-qwen3moe-q4k"]
    cfg = model.config
    be = mm_backend(model, mode, "half", "ring", adapt_every=0, prefill_chunk=CHUNK)
    try:
        cache = be.cache
        cache.fill(np.arange(cfg.n_layer * cfg.n_expert), be.stream)
        occupied = int((cache.owner >= 0).sum())
        lend_all(be, cache.n_slots // 2)
        lg, want = routed_logits(be, model, prompt + toks[:-1])
        assert np.isfinite(lg).all() and rel_rows(lg, want).max() < 1e-2
        assert be.tracer.last["lent"] > 0
        be.truncate(0)
        assert_same_greedy(*routed_greedy(be, model, prompt, N_GREEDY))
        cache.poll(be.stream, wait=True)
        assert be.prefill.lent == [] and table_matches_host(cache)
        assert int((cache.owner >= 0).sum()) <= occupied
    finally:
        be.close()
