"""The worker on the CUDA backend: what only CUDA has (INFO's cache facts, DONE's hits, the profile written at QUIT).
The CPU worker's whole protocol suite runs on CUDA too: STRATA_TEST_BACKEND=cuda pytest tests/test_worker_protocol.py
(tools/gpu_suite.sh does)."""
import re

import pytest

from engine import protocol
from test_worker_protocol import PROMPT, Worker, gen, shape, tokens

pytestmark = pytest.mark.gpu


def cuda_worker(model, *flags):
    return Worker(model, "--backend", "cuda", *flags)     # argparse keeps the last --backend


def test_ready_info_and_one_request_in_order(fixtures_dir):
    w = cuda_worker(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf")
    try:
        assert w.info["backend"] == "cuda" and w.info["arch"] == "qwen3moe"
        assert int(w.info["experts_total"]) == 32 and int(w.info["expert_slots"]) == 32
        assert "arena_mib" in w.info and "vram_free_mib" in w.info
        lines = w.request(gen(6, PROMPT))
        assert re.fullmatch(r"RESUME( PP)+ REUSED( T)* DONE", shape(lines)), lines
        done = protocol.parse_done(lines[-1])
        assert done.generated == len(tokens(lines)) and done.prompt_read == len(PROMPT)
        assert done.lookups % 8 == 0 and done.lookups >= (done.generated - 1) * 8 and done.hits == done.lookups
        assert w.quit() == 0
    finally:
        w.kill()


def test_profile_written_at_quit(fixtures_dir, tmp_path):
    from engine.profile import load_profile
    path = tmp_path / "p.bin"
    w = cuda_worker(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf", "--expert-slots", "8",
                    "--tune", "adapt_every=4", "--expert-profile-save", str(path))
    try:
        lines = w.request(gen(20, PROMPT))
        done = protocol.parse_done(lines[-1])
        assert 0 <= done.hits < done.lookups and done.ram_blobs == done.lookups - done.hits
        assert w.quit() == 0
    finally:
        w.kill()
    prof = load_profile(path, 4, 8)
    assert len(prof.flat_order()) > 0
