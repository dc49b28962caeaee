"""Models whose tensors are Q2_0, Q1_0 or NVFP4 (make_moe's random blocks) on the CPU backend: a prompt pass and
token-by-token decoding give the logits of exact arithmetic (tools.exact_forward, float64 over the dequantized
weights) within test_fused_tensors' bound; the file make_moe wrote holds the types, ids and sizes it planned."""
from __future__ import annotations

import numpy as np
import pytest

from engine.backend_cpu import CPUBackend
from engine.gguf_model import open_model, read_header
from engine.quant_types import QT, row_bytes
from tools import make_moe
from tools.exact_forward import exact_logits

TOKENS = [3, 141, 59, 265, 358, 979, 323, 84, 626]
PROMPT = 5      # tokens of the prompt pass; the rest are decoded one at a time
# experts in each type, the other classes spread over the three (qwen2moe has a shared expert and biases)
MODELS = {
    "Q2_0": ["--experts", "Q2_0", "--shexp", "NVFP4", "--attn", "Q1_0", "--embd", "Q2_0", "--output", "NVFP4"],
    "Q1_0": ["--experts", "Q1_0", "--shexp", "Q2_0", "--attn", "NVFP4", "--embd", "Q1_0", "--output", "Q2_0"],
    "NVFP4": ["--experts", "NVFP4", "--shexp", "Q1_0", "--attn", "Q2_0", "--embd", "NVFP4", "--output", "Q1_0"],
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("newq") / f"{request.param}.gguf"
    make_moe.main(["--preset", "tiny", "--arch", "qwen2moe", "--n-layer", "2", "--n-expert", "4",
                   "--n-expert-used", "2", *MODELS[request.param], "--threads", "1", "--out", str(path)])
    return request.param, path


def test_file_holds_the_planned_types(model):
    name, path = model
    flags = dict(zip(MODELS[name][::2], MODELS[name][1::2]))
    h = read_header(path)
    ends = [h.data_offset + t.offset for t in h.tensors]
    for t, end in zip(h.tensors, ends):
        q = QT(t.type_id)
        if "_exps." in t.name:
            assert q.name == flags["--experts"]
        if "attn_q.weight" in t.name:
            assert q.name == flags["--attn"]
        assert end + row_bytes(q, t.dims[0]) * int(np.prod(t.dims[1:], dtype=np.int64)) <= h.file_size
    assert {QT(t.type_id).name for t in h.tensors} >= {"Q2_0", "Q1_0", "NVFP4"}


def test_cpu_backend_equals_exact_arithmetic(model):
    _, path = model
    want = exact_logits(path, TOKENS)
    backend = CPUBackend(open_model(path), 64)
    got = [backend.forward(TOKENS[:PROMPT], all_logits=True)]
    for tok in TOKENS[PROMPT:]:
        got.append(backend.forward([tok])[None, :])
    got = np.concatenate(got, axis=0)
    assert got.shape == want.shape and np.isfinite(got).all()
    assert np.max(np.abs(got - want)) < 1e-3      # test_fused_tensors' bound for exact arithmetic
    assert np.std(want) > 0.5                       # logits that say something (HEAD_GAIN spreads them)


def test_cuda_backend_takes_them_and_refuses_a_type_without_kernels(model, tmp_path):
    """The CUDA kernels read all three and their whole models agree with the CPU backend on the GPU
    (tests/test_cuda_new_quants.py), so their files pass the load check; a type with no kernel is turned away before
    CuPy is imported or VRAM taken, with the one line the worker prints."""
    from types import SimpleNamespace

    from engine.cuda.quant_types import refuse_kernelless
    from engine.gguf_model import ModelError
    _, path = model
    m = open_model(path)
    refuse_kernelless(m)
    refuse_kernelless(_q4k(path.parent))
    types = {n: m.tensor(n).qtype for n in m.tensor_names()}
    first = next(n for n in types if "_exps." in n)
    types[first] = QT.TQ1_0          # a ggml type the engine has no kernel for
    fake = SimpleNamespace(path=tmp_path / "x.gguf", tensor_names=lambda: list(types),
                           tensor=lambda n: SimpleNamespace(qtype=types[n]))
    with pytest.raises(ModelError, match=rf"^x.gguf: tensor {first} is TQ1_0, a quant type the CUDA backend has no "
                                         rf"kernels for yet \(1 tensors of TQ1_0\); use --backend cpu until the "
                                         rf"CUDA kernels for it land$"):
        refuse_kernelless(fake)


def _q4k(d):
    path = d / "q4k.gguf"
    if not path.exists():
        make_moe.main(["--preset", "tiny", "--n-layer", "1", "--threads", "1", "--out", str(path)])
    return open_model(path)


def test_setup_measures_their_experts(model):
    """setup's own-file entry reads the tensor table through the engine (gguf.GGUFReader fails on Q2_0)."""
    from setup.catalog import model_from_gguf
    _, path = model
    h = read_header(path)
    experts = sum(row_bytes(QT(t.type_id), t.dims[0]) * int(np.prod(t.dims[1:])) for t in h.tensors
                  if "_exps." in t.name)
    m = model_from_gguf(path)
    assert m.arch == "qwen2moe" and m.expert_share == pytest.approx(experts / path.stat().st_size, rel=1e-12)


def test_fused_tensors_of_them_load_as_the_parts(model, tmp_path):
    """tools.fuse_tensors writes them (attn_qkv, ffn_gate_up_exps) and the engine's views give the same logits."""
    from tools.fuse_tensors import fuse
    _, path = model
    fused = fuse(path, tmp_path / "fused.gguf", qkv=True, gate_up=True)
    names = {t.name: QT(t.type_id) for t in read_header(fused).tensors}
    assert "blk.0.attn_qkv.weight" in names and "blk.0.ffn_gate_up_exps.weight" in names
    want = CPUBackend(open_model(path), 64).forward(TOKENS, all_logits=True)
    np.testing.assert_array_equal(CPUBackend(open_model(fused), 64).forward(TOKENS, all_logits=True), want)
