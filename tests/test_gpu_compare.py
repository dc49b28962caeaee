"""tests/gpu_compare.py's CPU side (the GPU tests' reference runs), checked here where there is no GPU."""
import json

import numpy as np

from engine.backend_cpu import CPUBackend
from gpu_compare import cpu_runs, greedy

CTX = 64
N = 6
MODELS = ("tiny-llama-legacy", "tiny-qwen2moe-mixed")


def test_cpu_runs_are_the_greedy_continuation_of_the_reference_prompt(fixtures_dir):
    runs = cpu_runs(fixtures_dir, MODELS, N, CTX)
    assert sorted(runs) == sorted(MODELS)
    for name in MODELS:
        model, prompt, toks, logits = runs[name]
        case = json.loads((fixtures_dir / "reference" / f"{name}.json").read_text())["cases"][0]
        assert prompt == list(case["prompt_ids"])
        assert logits.shape == (N, model.config.n_vocab) and np.isfinite(logits).all()
        assert toks == np.argmax(logits, axis=-1).tolist()
        # the same tokens through the backend's own sampling path (Sampler({}) is greedy), from a fresh cache
        cpu = CPUBackend(model, CTX)
        try:
            assert greedy(cpu, prompt, N) == toks
            cpu.truncate(0)
            np.testing.assert_allclose(cpu.forward(prompt), logits[0], rtol=1e-5, atol=1e-5)
        finally:
            cpu.close()
