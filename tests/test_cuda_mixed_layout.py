"""The CUDA backend on files whose expert tensors differ by layer (llama-quantize's recipes, community mixes) against
the NumPy backend (docs/design.md): a tiny 8-layer model with Q4_K_M's Q6_K ffn_down_exps on llama.cpp's "more bits"
layers, a layer whose gate and up differ, a Q8_0 layer and a BF16 layer (tests/mixed_models.py "mix"). With the VRAM
cache holding all, some and none of the experts, in the pinned, budget and mmap modes, through prompt chunks that
stream the non-resident experts through the ring: teacher-forced logits within 1e-2 relative,
greedy tokens equal, every cached expert in a slot of its own blob size."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine.gguf_model import open_model  # noqa: E402
from gpu_compare import assert_same_greedy, cpu_teacher_run, rel_rows  # noqa: E402
from mixed_models import write  # noqa: E402
from route_ties import RouteRecorder  # noqa: E402
from test_cuda_prefill import routed_greedy, routed_logits  # noqa: E402

CTX = 512
N_PROMPT = 150
N_GREEDY = 16
CHUNK = 64
MiB = 1 << 20
ARCHES = ("qwen3moe", "qwen2moe")          # qwen2moe: the shared expert beside the routed ones


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fixtures_dir):
    out = {}
    for arch in ARCHES:
        path = tmp_path_factory.mktemp("mix") / f"mix-{arch}.gguf"
        args = ["--preset", "tiny", "--arch", arch, "--n-layer", "8", "--seed", "3",
                "--vocab", str(fixtures_dir / "vocab" / "tiny-bpe-1024.gguf")]
        write(path, "mix", args)
        model = open_model(path)
        prompt = np.random.default_rng(5).integers(3, 1000, N_PROMPT).tolist()
        out[arch] = (model, prompt, *cpu_teacher_run(model, prompt, N_GREEDY, CTX))
    return out


def total_bytes(model):
    from engine.cuda.arena import blob_layout
    return int(blob_layout(model).expert_strides(model.config.n_expert).sum())


def backend(model, mode, share, **extra):
    from engine.cuda.args import CudaOptions
    from engine.cuda.backend import CUDABackend
    cfg = model.config
    total = cfg.n_layer * cfg.n_expert
    opts = dict(expert_slots={"none": 0, "some": total // 2, "all": total}[share], adapt_every=4,
                prefill_chunk=CHUNK, stream_min=1)
    if share == "some":         # the prefetch's per-layer copies and its late-miss copies
        opts.update(prefetch=True, fetch_misses=True)
    elif share == "none":       # every miss read in place over PCIe
        opts.update(prefetch=False)
    if mode == "mmap":
        opts["mmap_experts"] = True
    elif mode == "budget":
        opts["resident_budget_gib"] = total_bytes(model) / 2 / 2**30
    opts.update(extra)
    return CUDABackend(model, CTX, CudaOptions(**opts), tracer=RouteRecorder())


def check_books(be):
    """Every cached expert sits in a slot of its own blob size; the device table is the host's."""
    c = be.cache
    occ = np.flatnonzero(c.owner >= 0)
    assert (c.slot_bytes[occ] == be.arena.expert_stride[c.owner[occ]]).all()
    assert c.pools.n_pools == len(set(be.layout.strides()))
    c.poll(be.stream, wait=True)
    be.stream.synchronize()
    np.testing.assert_array_equal(c.table.get(stream=be.stream), c.table_host)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("share", ["all", "some", "none"])
@pytest.mark.parametrize("mode", ["pinned", "budget", "mmap"])
def test_mixed_layout_matches_cpu(runs, arch, mode, share):
    model, prompt, toks, cpu_logits = runs[arch]
    cfg = model.config
    total = cfg.n_layer * cfg.n_expert
    be = backend(model, mode, share)
    try:
        assert not be.layout.uniform
        info = be.info()
        assert info["memory"] == mode
        pinned = be.arena.pinned
        assert info["arena_mib"] == int(be.arena.expert_stride[pinned].sum() / MiB)
        if mode == "budget":
            assert 0 < pinned.sum() < total and be.arena.nbytes <= total_bytes(model) / 2
        assert be.cache.n_slots == {"all": total, "some": total // 2, "none": 0}[share]
        seq = prompt + toks[:-1]
        lg, want = routed_logits(be, model, seq)
        assert np.isfinite(lg).all()
        assert rel_rows(lg, want).max() < 1e-2
        if share != "all":
            last = be.tracer.last
            assert last["ring"] >= 2 and last["bytes"] > 0          # the chunks streamed experts through the ring
        # the same positions through the decode step (the lent slots come back at its first step)
        be.truncate(len(prompt))
        dec = np.stack([be.forward([t]) for t in toks[:-1]])
        assert np.minimum(rel_rows(dec, cpu_logits[len(prompt):]), rel_rows(dec, want[len(prompt):])).max() < 1e-2
        check_books(be)
        be.truncate(0)
        be.reset_stats()
        assert_same_greedy(*routed_greedy(be, model, prompt, N_GREEDY))
        st = be.get_stats()
        assert st.lookups == (N_GREEDY - 1) * cfg.n_layer * cfg.n_expert_used
        if share == "all":
            assert st.hits == st.lookups
        if share == "some" and mode == "pinned":
            pf = be.prefetch_stats()
            assert pf is not None and pf.staged + pf.fetched > 0
        check_books(be)
    finally:
        be.close()


def test_every_slot_count_keeps_each_expert_in_its_pool(runs):
    model, prompt, toks, _ = runs["qwen3moe"]
    cfg = model.config
    total = cfg.n_layer * cfg.n_expert
    for n in (total // 3, 5, total):
        be = backend(model, "pinned", "some", adapt_every=2, expert_slots=n)
        try:
            assert be.cache.n_slots == n
            be.forward(prompt)
            for t in toks[:8]:
                be.forward([t])
            check_books(be)
            be.truncate(0)
            lg, want = routed_logits(be, model, prompt + toks[:-1])
            assert rel_rows(lg, want).max() < 1e-2
        finally:
            be.close()


def test_a_profile_fills_each_pool_with_its_hottest(runs, tmp_path):
    """--expert-profile on a mixed file: every pool takes the profile's first experts of its own blob size, and the
    learned order saved afterwards names every expert once."""
    from engine.profile import from_flat, load_profile, save_profile
    model, prompt, toks, _ = runs["qwen3moe"]
    cfg = model.config
    total = cfg.n_layer * cfg.n_expert
    order = np.random.default_rng(7).permutation(total)
    save_profile(tmp_path / "p.bin", from_flat(cfg.n_layer, cfg.n_expert, order))
    be = backend(model, "pinned", "some", expert_profile=str(tmp_path / "p.bin"),
                 expert_profile_save=str(tmp_path / "q.bin"))
    try:
        c = be.cache
        for p, n in enumerate(c.pools.split(c.n_slots)):
            mine = order[c.exp_pool[order] == p]
            assert sorted(c.owner[c.slot_pool == p].tolist()) == sorted(mine[:n].tolist())
        check_books(be)
        be.forward(prompt)
        for t in toks[:6]:
            be.forward([t])
    finally:
        be.close()          # saves the learned profile (QUIT)
    saved = load_profile(tmp_path / "q.bin", cfg.n_layer, cfg.n_expert).flat_order()
    assert sorted(saved.tolist()) == list(range(total))
