"""The reference engine's registry: engine/supported.py's FAMILIES and the ARCHS each engine/arch/ module declares,
read without importing it (setup runs before NumPy); the family a file gets; the per-layer expert plan."""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine import arch, supported
from engine.arch import tensors
from engine.arch.base import Transformer, Weights, dense_ffn
from engine.gguf_model import ModelError, open_model
from test_gguf_model import tiny_model, tiny_tensors, write_gguf

ROOT = Path(__file__).resolve().parent.parent
ARCH_DIR = ROOT / "engine" / "arch"


def test_each_family_declares_what_the_registry_reads():
    assert [f.__name__ for f in arch.FAMILIES] == [f"engine.arch.{n}" for n in supported.FAMILIES]
    for f in arch.FAMILIES:
        assert f.ARCHS == supported.declared_archs(Path(f.__file__)) and f.ARCHS
        assert all(isinstance(a, str) for a in f.ARCHS), f.__name__
        assert isinstance(f.EXPERTS, bool) and isinstance(f.FUSED_QKV, bool), f.__name__
        assert callable(f.configure) and callable(f.check_tensors), f.__name__
        assert issubclass(f.MODEL, Transformer), f.__name__
    every = [a for f in arch.FAMILIES for a in f.ARCHS]
    assert supported.SUPPORTED_ARCHS == tuple(dict.fromkeys(every))
    assert set(supported.CUDA_ARCHS) <= set(supported.SUPPORTED_ARCHS)


def test_an_architecture_has_one_family_with_experts_and_one_without_at_most():
    for a in supported.SUPPORTED_ARCHS:
        for experts in (False, True):
            assert sum(a in f.ARCHS and f.EXPERTS == experts for f in arch.FAMILIES) <= 1, (a, experts)
    assert arch.family("llama", False).__name__ == "engine.arch.dense"
    assert arch.family("llama", True).__name__ == "engine.arch.qwen3moe"     # Mixtral
    assert arch.family("qwen3", True) is None and arch.family("mamba9", False) is None


def test_no_module_declares_archs_without_being_registered():
    """A family module that engine/supported.py does not list would be a family nobody can reach."""
    for path in sorted(ARCH_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        declares = any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "ARCHS" for t in n.targets)
                       for n in tree.body)
        assert declares == (path.stem in supported.FAMILIES), path.name


def test_a_module_without_archs_is_a_clear_error(tmp_path):
    p = tmp_path / "fam.py"
    p.write_text("ARCH = ('x',)\n")
    with pytest.raises(ImportError, match="fam.py assigns no literal ARCHS"):
        supported.declared_archs(p)


def test_supported_imports_neither_numpy_nor_gguf():
    """setup reads engine/supported.py (through setup/catalog.py) on a machine without the packages."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('numpy', 'gguf'):\n"
            "            raise ImportError('no ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import engine.supported as s, setup.catalog\n"
            "print(','.join(s.SUPPORTED_ARCHS))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ",".join(supported.SUPPORTED_ARCHS)


def test_experts_where_the_family_has_none_and_none_where_it_needs_them(tmp_path):
    with pytest.raises(ModelError, match="q3.gguf is qwen3 with 4 experts, which this engine runs only as a dense"):
        open_model(tiny_model(tmp_path, "qwen3", "q3.gguf", n_expert=4))
    with pytest.raises(ModelError, match="is qwen3moe but has no qwen3moe.expert_count; the file is incomplete"):
        open_model(tiny_model(tmp_path, "qwen3moe", "q3m.gguf"))


def test_every_layer_routes_when_the_model_has_experts(tmp_path):
    moe = open_model(tiny_model(tmp_path, "qwen3moe", "moe.gguf", n_expert=4, n_layer=3)).config
    dense = open_model(tiny_model(tmp_path, "llama", "dense.gguf", n_layer=3)).config
    assert moe.moe_layers == (True,) * 3 and moe.is_moe and moe.is_moe_layer(2)
    assert dense.moe_layers == (False,) * 3 and not dense.is_moe and not dense.is_moe_layer(0)


def test_a_dense_layer_before_the_expert_layers(tmp_path):
    """A plan with a leading dense layer (as GLM's and DeepSeek's files have): the checks ask that layer for a
    SwiGLU and the others for experts, and the MoE families run the SwiGLU there."""
    t, hp = tiny_tensors("qwen3moe", n_expert=4)
    rng = np.random.default_rng(1)
    for name, shape in (("ffn_gate", (96, 64)), ("ffn_up", (96, 64)), ("ffn_down", (64, 96))):
        t[f"blk.0.{name}.weight"] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    model = open_model(write_gguf(tmp_path / "lead.gguf", "qwen3moe", t, hp))
    cfg = dataclasses.replace(model.config, moe_layers=(False, True))
    names = tensors.required(cfg)
    assert "blk.0.ffn_gate.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    assert "blk.1.ffn_gate_exps.weight" in names and "blk.1.ffn_gate.weight" not in names
    assert tensors.layer_shapes(cfg, 0)["ffn_down.weight"] == (64, 96)
    assert tensors.layer_shapes(cfg, 1)["ffn_down_exps.weight"] == (4, 64, 32)
    model.config = cfg     # the plan a family's configure would have made
    w = Weights(model)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    for f in (arch.family("qwen3moe", True), arch.family("qwen2moe", True)):
        net = f.MODEL(model, w, 16)
        np.testing.assert_array_equal(net.ffn(0, x, False), dense_ffn(w, "blk.0.", x))
        assert not np.array_equal(net.ffn(1, x, False), dense_ffn(w, "blk.0.", x))
