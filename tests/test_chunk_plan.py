"""Chunk sizing for the streamed prompt pass (engine/cuda/chunk_plan.py) with real shapes: Qwen3-30B-A3B's from
tools/make_moe's preset and the tiny fixture models' own configs. CPU only."""
from types import SimpleNamespace

import pytest

from engine.cuda import chunk_plan as cp_
from engine.cuda.chunk_plan import AUTO_MIN, MiB, RING_MAX, RING_MIN, STEP, ChunkRefused, chunk_bytes, plan_chunk
from engine.cuda.quant_types import qtype
from tools.make_moe import PRESETS

FIELDS = "n_layer n_embd n_head n_head_kv head_dim n_ff n_expert n_expert_used n_ff_exp n_ff_shexp".split()


def preset_cfg(name, n_vocab=151936):
    s = PRESETS[name].shape
    return SimpleNamespace(**{k: getattr(s, k) for k in FIELDS}, n_vocab=n_vocab)


def q4k_stride(cfg):
    q = qtype("Q4_K")
    return 2 * cfg.n_ff_exp * q.row_bytes(cfg.n_embd) + cfg.n_embd * q.row_bytes(cfg.n_ff_exp)


QWEN = preset_cfg("qwen3-30b-a3b")
STRIDE = q4k_stride(QWEN)
N_ALL = QWEN.n_layer * QWEN.n_expert


def test_the_qwen3_expert_blob_is_the_measured_size():
    assert 2.5e6 < STRIDE < 2.7e6       # a Qwen3-30B-A3B Q4_K expert is ~2.6 MB


def test_chunk_bytes_grow_with_the_chunk_and_count_every_buffer():
    sizes = [chunk_bytes(QWEN, T) for T in (1, 16, 1024, 4096, 8192)]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    names = {b.name for b in cp_.buffers(QWEN, 1024)}
    assert {"x", "xn", "q", "k", "v", "att", "xh", "wh", "router_logits", "ids", "rows", "h",
            "dequant_scratch"} <= names
    # the per-token part is what the buffers say: fp32 x/xn/q/k/v/att, fp16 xh (n_embd or the attention
    # width, whichever is wider) and h, routing arrays
    per_token = chunk_bytes(QWEN, 2048) - chunk_bytes(QWEN, 1024)
    E, qw, kw, k = 2048, 32 * 128, 4 * 128, 8
    want = 1024 * (4 * (2 * E + qw + 2 * kw + qw) + 2 * max(E, qw) + 4 * 128 + 4 * 4 * k + 2 * k * 768)
    assert per_token == want


def test_the_fp32_scratch_holds_what_is_dequantized_to_fp32_not_the_output_head():
    """The prompt's last-row logits come from the decode mat-vec, so the fp32 dequant scratch is sized by the routers
    (and a shared expert) of an MoE model, by the FFN of a dense one (capped), never by n_vocab x n_embd."""
    def scratch(cfg):
        return next(b.nbytes for b in cp_.buffers(cfg, 1024) if b.name == "dequant_scratch")
    assert scratch(QWEN) == 4 * QWEN.n_expert * QWEN.n_embd                  # 1 MiB, not 128
    shexp = SimpleNamespace(**{**vars(QWEN), "n_ff_shexp": 5632})
    assert scratch(shexp) == 4 * 5632 * QWEN.n_embd
    dense = SimpleNamespace(**{**vars(QWEN), "n_expert": 0, "n_expert_used": 0, "n_ff": 14336, "n_embd": 4096})
    assert scratch(dense) == 4 * cp_.DEQUANT_SCRATCH_ELEMS                  # 14336 x 4096 is past the cap
    assert chunk_bytes(QWEN, 1024) < 200 * MiB


def test_auto_takes_the_largest_chunk_that_fits():
    for free_mib in (400, 700, 1000, 2000, 6000):
        free = free_mib * MiB
        p = plan_chunk(QWEN, free, stride=STRIDE, n_stream=N_ALL)
        assert p.total <= free
        floor = max(RING_MIN, min(cp_.RING_AUTO_FLOOR, N_ALL))
        assert chunk_bytes(QWEN, p.chunk) + floor * STRIDE <= free
        if p.chunk >= AUTO_MIN and p.chunk + STEP <= cp_.AUTO_MAX:
            assert chunk_bytes(QWEN, p.chunk + STEP) + floor * STRIDE > free, free_mib
        assert RING_MIN <= p.ring <= RING_MAX


def test_auto_is_at_least_1024_when_1024_fits():
    free = chunk_bytes(QWEN, 1024) + 16 * STRIDE
    assert plan_chunk(QWEN, free, stride=STRIDE, n_stream=N_ALL).chunk == 1024
    p = plan_chunk(QWEN, free - 1, stride=STRIDE, n_stream=N_ALL)
    assert 16 <= p.chunk < 1024 and p.chunk % 16 == 0


def test_auto_never_passes_the_context_or_the_cap():
    big = 64 << 30
    assert plan_chunk(QWEN, big, stride=STRIDE, n_stream=N_ALL).chunk == cp_.AUTO_MAX
    assert plan_chunk(QWEN, big, stride=STRIDE, n_stream=N_ALL, max_tokens=3000).chunk == 3000
    assert plan_chunk(QWEN, big, stride=STRIDE, n_stream=N_ALL).ring == RING_MAX
    assert plan_chunk(QWEN, big, stride=STRIDE, n_stream=40).ring == 40      # no more slots than experts to stream


def test_everything_resident_needs_no_ring():
    p = plan_chunk(QWEN, 2 << 30, stride=STRIDE, n_stream=0)
    assert p.ring == 0 and p.ring_bytes == 0


def test_one_streamed_expert_still_gets_the_smallest_ring():
    """All but one expert cached (31 of 32 on the tiny models): the ring still takes RING_MIN slots, its own where
    VRAM is left, else borrowed; the H200 suite refused this with plenty of VRAM before the floor was applied."""
    p = plan_chunk(QWEN, 2 << 30, stride=STRIDE, n_stream=1, lendable=N_ALL - 1)
    assert p.ring + p.lend >= RING_MIN and p.ring == RING_MIN and p.lend == 0
    tight = chunk_bytes(QWEN, p.chunk) + STRIDE        # room for one own slot beside the chunk
    p = plan_chunk(QWEN, tight, chunk=p.chunk, stride=STRIDE, n_stream=1, lendable=N_ALL - 1)
    assert (p.ring, p.lend) == (1, RING_MIN - 1)


def test_a_chunk_too_big_is_refused_with_the_numbers():
    free = 600 * MiB
    with pytest.raises(ChunkRefused) as e:
        plan_chunk(QWEN, free, chunk=8192, stride=STRIDE, n_stream=N_ALL)
    msg = str(e.value)
    need = chunk_bytes(QWEN, 8192) + RING_MIN * STRIDE
    assert f"{need / MiB:.0f} MiB" in msg and "600 MiB" in msg and "--prefill-chunk" in msg
    assert isinstance(e.value, MemoryError)


def test_nothing_fits_is_refused():
    with pytest.raises(ChunkRefused, match="smallest prompt chunk.*--vram-budget-mib"):
        plan_chunk(QWEN, 100 * MiB, stride=STRIDE, n_stream=N_ALL)


def test_explicit_ring_is_the_rings_own_depth():
    free = 2 << 30
    p = plan_chunk(QWEN, free, chunk=1024, ring=96, stride=STRIDE, n_stream=N_ALL)
    assert (p.chunk, p.ring, p.lend) == (1024, 96, 0)
    # a cache that could lend changes nothing of the own ring; only its free slots are lent on top
    lent = plan_chunk(QWEN, free, chunk=1024, ring=96, stride=STRIDE, n_stream=N_ALL, lendable=3000)
    assert lent.ring == 96 and lent.ring_bytes == 96 * STRIDE
    assert lent.lend == RING_MAX - 96 and not lent.lend_occupied
    with pytest.raises(ChunkRefused, match="760 ring slots.*lower --tune ring"):
        plan_chunk(QWEN, free, chunk=1024, ring=760, stride=STRIDE, n_stream=N_ALL)
    with pytest.raises(ChunkRefused, match="760 ring slots.*lower --tune ring"):
        plan_chunk(QWEN, 1536 * MiB, ring=760, stride=STRIDE, n_stream=N_ALL)
    with pytest.raises(ChunkRefused, match="760 ring slots.*lower --tune ring"):
        plan_chunk(QWEN, 1536 * MiB, ring=760, stride=STRIDE, n_stream=N_ALL, lendable=3000)
    with pytest.raises(ValueError, match="at least 2"):
        plan_chunk(QWEN, free, ring=1, stride=STRIDE, n_stream=N_ALL)
    with pytest.raises(ValueError, match="at least 1"):
        plan_chunk(QWEN, free, chunk=0, stride=STRIDE, n_stream=N_ALL)


def test_ring_target_is_two_layers_of_streamed_experts_within_bounds():
    # 12 GiB, 4K prompt on the H200: ~2,928 slots, 67 non-resident experts a layer
    assert cp_.ring_target(N_ALL - 2928, 48) == 134
    assert cp_.ring_target(N_ALL - 6000, 48) == cp_.RING_LEND_FLOOR       # 3 a layer: the floor
    assert cp_.ring_target(40, 48) == 40                                   # never more than there are to stream
    assert cp_.ring_target(N_ALL, 48) == 256                               # nothing resident: 128 a layer
    assert cp_.ring_target(48 * 300, 48) == RING_MAX                       # the measured cap
    assert cp_.ring_target(0, 48) == 0


# what the 12 GiB bench.prefill run left the cache (4K prompt, 32K context)
SLOTS_12G = 2928


def test_a_partial_cache_gets_the_rings_bytes_and_lends_the_ring_its_depth():
    """The backend holds back only the chunk (reserve_bytes), so the expert cache is sized with the bytes the ring
    used to take; the plan then finds just the chunk's room and borrows the ring's depth from the cache."""
    pytest.importorskip("cupy")
    from engine.cuda.prefill import AUTO_TARGET, reserve_bytes
    opts = SimpleNamespace(prefill_chunk="auto", ring=None)
    held = reserve_bytes(QWEN, STRIDE, N_ALL, opts, 32768)
    assert held == chunk_bytes(QWEN, AUTO_TARGET)                # no ring bytes held back from the cache
    n_stream = N_ALL - SLOTS_12G
    p = plan_chunk(QWEN, held, stride=STRIDE, n_stream=n_stream, max_tokens=32768, lendable=SLOTS_12G)
    assert p.chunk == AUTO_TARGET and p.ring == 0 and p.ring_bytes == 0
    assert p.lend == cp_.ring_target(n_stream, QWEN.n_layer) == 134 and p.lend_occupied
    # VRAM the chunk leaves idle becomes own slots first, so fewer experts are evicted for the rest
    p = plan_chunk(QWEN, held + 10 * STRIDE, chunk=AUTO_TARGET, stride=STRIDE, n_stream=n_stream,
                   max_tokens=32768, lendable=SLOTS_12G)
    assert p.chunk == AUTO_TARGET and (p.ring, p.lend) == (10, 124)
    # without lending (an empty cache) the old rule: the ring's own floor first, the chunk smaller
    p = plan_chunk(QWEN, held, stride=STRIDE, n_stream=N_ALL, max_tokens=32768)
    assert p.chunk < AUTO_TARGET and p.ring >= cp_.RING_AUTO_FLOOR and p.lend == 0


def test_lending_refusals_still_name_the_numbers():
    with pytest.raises(ChunkRefused) as e:
        plan_chunk(QWEN, 600 * MiB, chunk=8192, stride=STRIDE, n_stream=N_ALL - SLOTS_12G, lendable=SLOTS_12G)
    msg = str(e.value)
    assert f"{chunk_bytes(QWEN, 8192) / MiB:.0f} MiB" in msg and "600 MiB" in msg and "--prefill-chunk" in msg
    # one lendable slot: the ring still needs one of its own
    with pytest.raises(ChunkRefused) as e:
        plan_chunk(QWEN, chunk_bytes(QWEN, 1024), chunk=1024, stride=STRIDE, n_stream=N_ALL - 1, lendable=1)
    assert "1 ring slots" in str(e.value) and f"{(chunk_bytes(QWEN, 1024) + STRIDE) / MiB:.0f} MiB" in str(e.value)
    p = plan_chunk(QWEN, chunk_bytes(QWEN, 1024), chunk=1024, stride=STRIDE, n_stream=N_ALL - 2, lendable=2)
    assert (p.ring, p.lend) == (0, 2)


def test_qwen3_next_shapes_plan_too():
    cfg = preset_cfg("qwen3-next-80b")
    p = plan_chunk(cfg, 1500 * MiB, stride=2_000_000, n_stream=cfg.n_layer * cfg.n_expert)
    assert p.chunk >= AUTO_MIN and "sh_tmp" in {b.name for b in cp_.buffers(cfg, 16)}


@pytest.mark.parametrize("name", ["tiny-qwen3moe-q4k", "tiny-qwen2moe-mixed", "tiny-llama-legacy"])
def test_fixture_configs(fixtures_dir, name):
    from engine.gguf_model import open_model
    cfg = open_model(fixtures_dir / "reference" / f"{name}.gguf").config
    n = cfg.n_layer * cfg.n_expert
    p = plan_chunk(cfg, 512 * MiB, stride=100_000 if n else 0, n_stream=n, max_tokens=256)
    assert p.chunk == 256
    assert (p.ring > 0) == bool(n)
    if not cfg.n_expert:
        assert "ffn_tmp" in {b.name for b in cp_.buffers(cfg, 8)}


def test_prompt_pass_flags_parse_and_refuse_bad_values():
    from cuda_flags import options, parse
    o = options("--prefill-chunk", "auto", "--tune", "ring=2", "--tune", "stream_min=64")
    assert (o.prefill_chunk, o.ring, o.stream_min) == (None, 2, 64)
    assert options("--prefill-chunk", "2048").prefill_chunk == 2048
    for bad in (["--prefill-chunk", "0"], ["--prefill-chunk", "big"], ["--tune", "ring=1"], ["--tune", "stream_min=0"],
                ["--tune", "nothing=1"], ["--tune", "ring"], ["--prefill", "batched"]):
        with pytest.raises(SystemExit):
            parse(*bad)


def test_the_backend_reserves_the_target_chunk_and_only_an_explicit_ring():
    pytest.importorskip("cupy")
    from engine.cuda.prefill import AUTO_TARGET, reserve_bytes
    opts = SimpleNamespace(prefill_chunk="auto", ring=None)
    assert reserve_bytes(QWEN, STRIDE, N_ALL, opts, 40960) == chunk_bytes(QWEN, AUTO_TARGET)
    assert reserve_bytes(QWEN, STRIDE, N_ALL, opts, 1000) == chunk_bytes(QWEN, 1000)
    opts = SimpleNamespace(prefill_chunk=2048, ring=8)
    assert reserve_bytes(QWEN, STRIDE, N_ALL, opts, 40960) == chunk_bytes(QWEN, 2048) + 8 * STRIDE
    assert reserve_bytes(QWEN, 0, 0, opts, 40960) == chunk_bytes(QWEN, 2048)


def test_expert_row_blocks_cover_the_average_expert_twice():
    from engine.cuda.prefill import GEMM_TILE, expert_row_blocks
    # 4K tokens x 8 of 128 experts: 256 rows on average, two 128-row passes; twice that many blocks
    assert expert_row_blocks(4096, 8, 128, row_tiles=2) == 4
    assert expert_row_blocks(4096, 8, 128, row_tiles=1) == 8
    for T, k, E in [(1, 8, 128), (5, 2, 4), (1024, 8, 128), (8192, 8, 128), (64, 1, 1)]:
        for mt in (1, 2):
            n = expert_row_blocks(T, k, E, row_tiles=mt)
            assert 1 <= n <= -(-T // (GEMM_TILE * mt))       # never more than one expert's T rows need
