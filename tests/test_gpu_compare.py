"""tests/gpu_compare.py's CPU side (the GPU tests' reference runs and error measures), checked without a GPU."""
import json

import numpy as np
import pytest

from engine.backend_cpu import CPUBackend
from gpu_compare import cpu_runs, greedy, rel, rel_rows

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
        # the same tokens through the backend's own pick (PickSpec() is greedy), from a fresh cache
        cpu = CPUBackend(model, CTX)
        try:
            assert greedy(cpu, prompt, N) == toks
            cpu.truncate(0)
            np.testing.assert_allclose(cpu.forward(prompt), logits[0], rtol=1e-5, atol=1e-5)
        finally:
            cpu.close()


def test_rel_is_the_whole_arrays_relative_error_and_rel_rows_each_rows():
    b = np.array([[3.0, 4.0], [0.0, 2.0]], np.float32)
    a = b + np.array([[0.5, 0.0], [0.0, 1.0]], np.float32)
    assert rel(a, b) == pytest.approx(np.sqrt(0.25 + 1.0) / np.sqrt(25.0 + 4.0), rel=1e-12)
    np.testing.assert_allclose(rel_rows(a, b), [0.1, 0.5])
    assert rel(b, b) == 0.0 and rel(np.ones(2), np.zeros(2)) > 1e29     # a zero reference does not divide by 0
