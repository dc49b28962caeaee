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
    assert 2.5e6 < STRIDE < 2.7e6       # DESIGN §5's "2.6 MB experts"


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


def test_explicit_ring_and_lent_slots():
    free = 2 << 30
    p = plan_chunk(QWEN, free, chunk=1024, ring=96, stride=STRIDE, n_stream=N_ALL)
    assert (p.chunk, p.ring) == (1024, 96)
    lent = plan_chunk(QWEN, free, chunk=1024, ring=96, stride=STRIDE, n_stream=N_ALL, lendable=60)
    assert lent.ring == 36 and lent.ring_bytes == 36 * STRIDE
    with pytest.raises(ChunkRefused, match="700 ring slots.*lower --ring"):
        plan_chunk(QWEN, free, chunk=1024, ring=700, stride=STRIDE, n_stream=N_ALL)
    with pytest.raises(ChunkRefused, match="700 ring slots.*lower --ring"):
        plan_chunk(QWEN, 1536 * MiB, ring=700, stride=STRIDE, n_stream=N_ALL)
    with pytest.raises(ValueError, match="at least 2"):
        plan_chunk(QWEN, free, ring=1, stride=STRIDE, n_stream=N_ALL)
    with pytest.raises(ValueError, match="at least 1"):
        plan_chunk(QWEN, free, chunk=0, stride=STRIDE, n_stream=N_ALL)


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


def test_streamed_flags_parse_and_refuse_bad_values():
    import argparse
    from engine.cuda.args import add_cuda_args
    p = argparse.ArgumentParser()
    add_cuda_args(p)
    a = p.parse_args(["--prefill", "streamed", "--prefill-chunk", "auto", "--ring", "2", "--stream-min", "64"])
    assert (a.prefill, a.prefill_chunk, a.ring, a.stream_min) == ("streamed", "auto", 2, 64)
    assert p.parse_args(["--prefill-chunk", "2048"]).prefill_chunk == 2048
    assert p.parse_args([]).prefill is None            # the batched pass stays the default
    for bad in (["--prefill-chunk", "0"], ["--prefill-chunk", "big"], ["--ring", "1"], ["--prefill", "fast"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_the_backend_reserves_the_target_chunk_and_ring():
    pytest.importorskip("cupy")
    from engine.cuda.prefill_streamed import AUTO_RING_RESERVE, AUTO_TARGET, reserve_bytes
    opts = SimpleNamespace(prefill_chunk="auto", ring=None)
    assert reserve_bytes(QWEN, STRIDE, N_ALL, opts, 40960) == (chunk_bytes(QWEN, AUTO_TARGET)
                                                               + AUTO_RING_RESERVE * STRIDE)
    assert reserve_bytes(QWEN, STRIDE, N_ALL, opts, 1000) == chunk_bytes(QWEN, 1000) + AUTO_RING_RESERVE * STRIDE
    opts = SimpleNamespace(prefill_chunk=2048, ring=8)
    assert reserve_bytes(QWEN, STRIDE, N_ALL, opts, 40960) == chunk_bytes(QWEN, 2048) + 8 * STRIDE
    assert reserve_bytes(QWEN, 0, 0, opts, 40960) == chunk_bytes(QWEN, 2048)


def test_expert_row_blocks_cover_the_average_expert_twice():
    from engine.cuda.prefill_streamed import GEMM_TILE, expert_row_blocks
    # 4K tokens x 8 of 128 experts: 256 rows on average, two 128-row passes; twice that many blocks
    assert expert_row_blocks(4096, 8, 128, row_tiles=2) == 4
    assert expert_row_blocks(4096, 8, 128, row_tiles=1) == 8
    for T, k, E in [(1, 8, 128), (5, 2, 4), (1024, 8, 128), (8192, 8, 128), (64, 1, 1)]:
        for mt in (1, 2):
            n = expert_row_blocks(T, k, E, row_tiles=mt)
            assert 1 <= n <= -(-T // (GEMM_TILE * mt))       # never more than one expert's T rows need
