"""gpt-oss in the CUDA backend's memory modes (the way gpt-oss-120b is benched: its file in /dev/shm and a whole
arena do not fit the GPU machine's RAM together, bench/host_ram.py): half the experts pinned (--resident-budget-gib)
or none (--mmap-experts), the VRAM cache holding none or half of them, the rest read from the file through the
staging ring; teacher-forced logits within 1e-2 of the NumPy reference and greedy tokens equal, as
tests/test_cuda_gptoss.py holds the pinned arena to. The MXFP4 file only (the published types)."""
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from gpu_compare import assert_pass_and_decode_match, assert_same_greedy, greedy  # noqa: E402
from test_cuda_gptoss import CTX, N_GREEDY, cuda_backend, runs  # noqa: E402,F401  (runs: the module fixture)

MiB = 1 << 20


@pytest.mark.parametrize("mode,share", [("budget", "none"), ("budget", "half"), ("mmap", "half")])
def test_memory_modes_match_cpu(runs, mode, share):
    from engine.cuda.arena import blob_layout
    model, prompt, toks, cpu_logits = runs["mxfp4"]
    cfg = model.config
    total = cfg.n_layer * cfg.n_expert
    half_gib = (total // 2) * blob_layout(model).stride / 2**30
    opts = dict(mmap_experts=True) if mode == "mmap" else dict(resident_budget_gib=half_gib)
    be = cuda_backend(model, expert_slots={"none": 0, "half": total // 2}[share], prefill_chunk=64, adapt_every=4,
                      **opts)
    try:
        info = be.info()
        assert info["memory"] == mode
        assert info["experts_pinned"] == (0 if mode == "mmap" else total // 2)
        assert_pass_and_decode_match(be, model, CTX, prompt, toks, cpu_logits)
        be.truncate(0)
        be.reset_stats()
        assert_same_greedy(greedy(be, prompt, N_GREEDY), toks, cpu_logits)
        st = be.get_stats()
        assert st.file_mb == pytest.approx(st.file_blobs * be.layout.nbytes / MiB)
    finally:
        be.close()
