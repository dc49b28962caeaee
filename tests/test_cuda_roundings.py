"""tools/cuda_roundings.py (the NumPy model of the CUDA backend's fp16 roundings) on the CPU: with no rounding it is
the NumPy backend bit for bit; with them it moves the logits, within the bound on files the GPU passes."""
import numpy as np
import pytest

from engine.backend_cpu import CPUBackend
from engine.gguf_model import open_model
from gpu_compare import rel_rows
from tools import make_moe
from tools.cuda_roundings import DECODE, PASS, RoundedModel, main


@pytest.mark.parametrize("name", ["tiny-qwen3moe-q4k", "tiny-qwen2moe-mixed", "tiny-llama-legacy"])
def test_without_roundings_it_is_the_numpy_backend(fixtures_dir, name):
    model = open_model(fixtures_dir / "reference" / f"{name}.gguf")
    toks = np.random.default_rng(5).integers(3, 1000, 100).tolist()
    cpu = CPUBackend(model, 256, chunk=64)
    try:
        want = cpu.forward(toks, all_logits=True)
    finally:
        cpu.close()
    rm = RoundedModel(model, 256, 64)
    assert np.array_equal(rm.forward(toks, all_logits=True), want)
    assert rm.parted == [] and len(rm.routes) == (len(toks) * model.config.n_layer if model.config.is_moe else 0)


def test_roundings_move_the_logits_but_not_far(fixtures_dir):
    model = open_model(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf")
    toks = np.random.default_rng(5).integers(3, 1000, 100).tolist()
    rm = RoundedModel(model, 256, 64)
    want = rm.forward(toks, all_logits=True)
    for roundings in (PASS, DECODE):
        rm.truncate(0)
        d = rel_rows(rm.forward(toks, all_logits=True, roundings=roundings), want)
        assert 1e-5 < d.max() < 1e-2


def test_cli_prints_the_figures_and_refuses_other_families(capsys, tmp_path, fixtures_dir):
    assert main(["--model", str(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"), "--tokens", "20"]) == 0
    out = capsys.readouterr().out
    assert "prompt pass" in out and "decode" in out and "routes against a clear gap: 0" in out
    hybrid = tmp_path / "hybrid.gguf"
    assert make_moe.main(["--preset", "tiny-qwen3next", "--out", str(hybrid)]) == 0
    capsys.readouterr()
    assert main(["--model", str(hybrid)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not qwen3next" in err[0]
