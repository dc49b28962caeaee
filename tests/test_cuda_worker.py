"""The worker on the CUDA backend passes the CPU worker's protocol checks (tests/test_worker_protocol.py): its tests
that take the `worker` fixture run here again with a CUDA worker, plus the ones that start their own worker."""
import re

import pytest

import test_worker_protocol as cpu_tests
from engine import protocol
from test_worker_protocol import PROMPT, Worker, gen, shape, tokens

pytestmark = pytest.mark.gpu

# The CPU module's tests that only use the `worker` fixture: same code, the CUDA worker below.
test_prefix_reuse_matches_a_cold_run = cpu_tests.test_prefix_reuse_matches_a_cold_run
test_stop_mid_decode_cancels = cpu_tests.test_stop_mid_decode_cancels
test_errors_are_one_err_line_and_the_worker_keeps_serving = \
    cpu_tests.test_errors_are_one_err_line_and_the_worker_keeps_serving
test_max_new_zero_reads_the_prompt_only = cpu_tests.test_max_new_zero_reads_the_prompt_only
test_seeded_sampling_is_reproducible = cpu_tests.test_seeded_sampling_is_reproducible


def cuda_worker(model, *flags):
    return Worker(model, "--backend", "cuda", *flags)     # argparse keeps the last --backend


@pytest.fixture(scope="module")
def worker(fixtures_dir):
    w = cuda_worker(fixtures_dir / "reference" / cpu_tests.MODEL)
    yield w
    w.kill()


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


def test_stop_mid_prompt_cancels_and_the_worker_keeps_serving(fixtures_dir):
    w = cuda_worker(fixtures_dir / "reference" / cpu_tests.MODEL, "--prompt-chunk", "2")
    try:
        long_prompt = [(i * 37 + 11) % 1000 for i in range(1000)]
        w.send(gen(4, long_prompt))
        assert w.read() == "RESUME 0"
        assert w.read().startswith("PP 2 1000 ")
        w.send("STOP")
        lines = w.collect()
        done = protocol.parse_done(lines[-1])
        assert done.finish == "cancel" and 0 < done.prompt_read < len(long_prompt) and done.generated == 0
        again = w.request(gen(3, long_prompt[:600]))
        d2 = protocol.parse_done(again[-1])
        assert d2.finish in ("length", "stop") and d2.reused == min(done.prompt_read, 599)
        assert w.quit() == 0
    finally:
        w.kill()


@pytest.mark.parametrize("name", ["tiny-llama-legacy", "tiny-llama-kquants", "tiny-qwen3moe-q4k",
                                  "tiny-qwen2moe-mixed"])
def test_worker_greedy_tokens_follow_llama_cpp(fixtures_dir, name, monkeypatch):
    monkeypatch.setattr(cpu_tests, "Worker", lambda model, *flags: cuda_worker(model, *flags))
    cpu_tests.test_worker_greedy_tokens_follow_llama_cpp(fixtures_dir, name)


def test_profile_written_at_quit(fixtures_dir, tmp_path):
    from engine.profile import load_profile
    path = tmp_path / "p.bin"
    w = cuda_worker(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf", "--expert-slots", "8",
                    "--adapt-every", "4", "--expert-profile-save", str(path))
    try:
        w.request(gen(20, PROMPT))
        assert w.quit() == 0
    finally:
        w.kill()
    prof = load_profile(path, 4, 8)
    assert len(prof.flat_order()) > 0
