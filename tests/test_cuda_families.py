"""The CUDA families (engine/cuda/families/) on the CPU: the registry covers every architecture the CUDA backend
runs and refuses others by name; the shared engine never tests the architecture nor a family's fields; each family's
layer dataclasses, loaded from a tiny model's tensors into host arrays (Upload with numpy.asarray), hold the file's
bytes in the layout its kernels read."""
import re
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest

pytest.importorskip("cupy")     # the family modules import CuPy (no GPU needed)

from engine.cuda.families.registry import FAMILIES, FAMILY_OF, family_for  # noqa: E402
from engine.cuda.weights import DevMatrix, Upload  # noqa: E402
from engine.gguf_model import open_model  # noqa: E402
from engine.supported import archs_for  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED_ENGINE = sorted((ROOT / "engine" / "cuda").glob("*.py"))


# --- the registry -----------------------------------------------------------------------------------------------

def test_every_cuda_architecture_has_one_family():
    claimed = [a for fam in FAMILIES for a in fam.archs]
    assert len(claimed) == len(set(claimed)), "an architecture claimed by two families"
    for arch in archs_for("cuda"):
        fam = family_for(NS(arch=arch))
        assert arch in type(fam).archs and FAMILY_OF[arch] is type(fam)
    assert {FAMILY_OF[a].name for a in ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")} == {"moe"}
    assert {FAMILY_OF[a].name for a in ("qwen3next", "qwen35moe")} == {"hybrid"}
    assert FAMILY_OF["gpt-oss"].name == "gptoss"


def test_an_unknown_architecture_is_refused_by_name():
    with pytest.raises(ValueError, match=r"no family for architecture 'deepseek2'.*--backend cpu"):
        family_for(NS(arch="deepseek2"))


# --- the shared engine asks the family ----------------------------------------------------------------------------

def test_the_shared_engine_never_tests_the_architecture():
    """issue 28's check: grep -rnE "\\.arch ?(==|!=|in)|is_hybrid" engine/cuda/*.py finds nothing."""
    pat = re.compile(r"\.arch ?(==|!=|in)|is_hybrid")
    hits = [f"{p.name}:{i}" for p in SHARED_ENGINE for i, line in enumerate(p.read_text().splitlines(), 1)
            if pat.search(line)]
    assert SHARED_ENGINE and not hits, hits


def test_the_shared_engine_reads_no_family_field():
    """The fields only some families have (gpt-oss's biases and sinks, the hybrids' gate and GDN weights) are read in
    their family modules alone."""
    pat = re.compile(r"\.(bo|sinks|router_bias|exp_bias|attn_gate|gdn)\b")
    hits = [f"{p.name}:{i}" for p in SHARED_ENGINE for i, line in enumerate(p.read_text().splitlines(), 1)
            if pat.search(line)]
    assert not hits, hits


# --- the layer dataclasses from a tiny model's tensors ------------------------------------------------------------

def _host_weights(path):
    model = open_model(path)
    fam = family_for(model.config)
    return model, fam, fam.load_weights(model, Upload(model, np.asarray))


def _rows(model, name):
    t = model.tensor(name)
    return np.ascontiguousarray(t.data).reshape(int(np.prod(t.shape[:-1])), -1)


def _check_matrix(m, model, name, rows=None):
    want = _rows(model, name)
    want = want if rows is None else want[rows]
    assert isinstance(m, DevMatrix) and isinstance(m.data, np.ndarray)
    assert (m.rows, m.row_bytes, m.qt) == (want.shape[0], want.shape[1], int(model.tensor(name).qtype))
    np.testing.assert_array_equal(m.data, want)


@pytest.mark.parametrize("name", ["tiny-qwen3moe-q4k", "tiny-qwen2moe-mixed", "tiny-llama-legacy"])
def test_moe_family_layers(fixtures_dir, name):
    from engine.cuda.families.moe import MoeLayer
    model, fam, w = _host_weights(fixtures_dir / "reference" / f"{name}.gguf")
    cfg = model.config
    assert fam.name == "moe" and len(w.layers) == cfg.n_layer
    for i, L in enumerate(w.layers):
        b = f"blk.{i}."
        assert type(L) is MoeLayer
        for f, t in (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"), ("wo", "attn_output")):
            _check_matrix(getattr(L, f), model, b + t + ".weight")
        np.testing.assert_array_equal(L.ffn_norm, model.dequant(b + "ffn_norm.weight").reshape(-1))
        assert (L.bq is not None) == model.has(b + "attn_q.bias") and L.ffn_norm.dtype == np.float32
        if cfg.is_moe:
            _check_matrix(L.router, model, b + "ffn_gate_inp.weight")
            assert (L.sh_up is not None) == cfg.shared_expert and L.w_gate is None
        else:
            _check_matrix(L.w_down, model, b + "ffn_down.weight")
            assert L.router is None
    assert w.qtype_ids() == {int(model.tensor(n).qtype) for n in model.tensor_names()
                             if len(model.tensor(n).shape) == 2 and not n.endswith("norm.weight")}


@pytest.fixture(scope="module")
def gptoss_path(tmp_path_factory):
    from tools import make_moe
    from tools.gptoss_ref import PRESET
    path = tmp_path_factory.mktemp("families") / "gpt-oss-tiny.gguf"
    assert make_moe.main([*PRESET, "--norm", "F32", "--out", str(path)]) == 0
    return path


def test_gptoss_family_layers(gptoss_path):
    from engine.cuda.families.gptoss import OssLayer, attn_variant, window
    model, fam, w = _host_weights(gptoss_path)
    cfg = model.config
    assert fam.name == "gptoss" and fam.kernel_files == ("moe_oss.cu",)
    for i, L in enumerate(w.layers):
        b = f"blk.{i}."
        assert type(L) is OssLayer and L.sinks.shape == (cfg.n_head,)
        np.testing.assert_array_equal(L.ffn_norm, model.dequant(b + "post_attention_norm.weight").reshape(-1))
        np.testing.assert_array_equal(L.router_bias, model.dequant(b + "ffn_gate_inp.bias").reshape(-1))
        assert [len(x) for x in L.exp_bias] == [cfg.n_expert * cfg.n_ff_exp] * 2 + [cfg.n_expert * cfg.n_embd]
        _check_matrix(L.wo, model, b + "attn_output.weight")
    # the decode attention's extra arguments per layer: its sinks and its window
    sinks = [NS(data=NS(ptr=1000 + i)) for i in range(cfg.n_layer)]
    v = attn_variant(cfg, sinks)
    assert v.suffix == "_oss" and v.fused_only
    assert [tuple(int(a) for a in v.layer_args(i)) for i in range(cfg.n_layer)] == \
        [(1000 + i, cfg.n_swa if cfg.is_swa(i) else 0) for i in range(cfg.n_layer)]
    assert any(window(cfg, i) for i in range(cfg.n_layer)) and not all(window(cfg, i) for i in range(cfg.n_layer))


@pytest.mark.parametrize("name", ["tiny-qwen3next-q4_k_m", "tiny-qwen35moe-q4_k_m"])
def test_hybrid_family_layers(name):
    from engine.cuda.families.hybrid import HybridLayer, attn_q_rows
    model, fam, w = _host_weights(ROOT / "tests" / "fixtures" / "hybrid" / f"{name}.gguf")
    cfg = model.config
    assert fam.name == "hybrid"
    q_rows, g_rows = attn_q_rows(cfg)
    slots = []
    for i, L in enumerate(w.layers):
        b = f"blk.{i}."
        assert type(L) is HybridLayer
        if cfg.recurrent_layers[i]:
            g = L.gdn
            assert L.wq is None and L.attn_gate is None and g is not None
            _check_matrix(g.qkv, model, b + "attn_qkv.weight")
            _check_matrix(g.out, model, b + "ssm_out.weight")
            assert g.conv.shape == (g.qkv.rows, cfg.ssm_conv) and g.conv.dtype == np.float32
            assert (g.alpha is None) == (cfg.arch == "qwen3next")
            assert {id(g.out), id(g.qkv), id(g.beta)} <= {id(m) for m in L.matrices()}
            slots.append(g.slot)
        else:
            assert L.gdn is None
            _check_matrix(L.wq, model, b + "attn_q.weight", q_rows)
            _check_matrix(L.attn_gate, model, b + "attn_q.weight", g_rows)
        _check_matrix(L.router, model, b + "ffn_gate_inp.weight")
    assert slots == list(range(sum(cfg.recurrent_layers)))


def test_hybrid_prompt_buffers_are_the_plans():
    """The hybrid family's prompt buffers join chunk_plan's list where the plan counts them, sized for the chunk."""
    from engine.cuda import chunk_plan
    from engine.cuda.families.gdn import GdnShape, scratch_bytes
    model = open_model(ROOT / "tests" / "fixtures" / "hybrid" / "tiny-qwen35moe-q4_k_m.gguf")
    fam = family_for(model.config)
    plain = {b.name for b in chunk_plan.buffers(model.config, 64)}
    full = chunk_plan.buffers(model.config, 64, fam.prompt_buffers)
    extra = {b.name: b for b in full if b.name not in plain}
    assert set(extra) == {"gate", "gdn_qkv", "gdn_z", "gdn_beta", "gdn_alpha", "gdn_o", "gdn_scratch"}
    assert extra["gdn_scratch"].nbytes == scratch_bytes(GdnShape.from_config(model.config), 64)
    assert not extra["gdn_scratch"].keep
    assert chunk_plan.chunk_bytes(model.config, 64, fam.prompt_buffers) == \
        chunk_plan.chunk_bytes(model.config, 64) + sum(b.nbytes for b in extra.values())
    assert family_for(NS(arch="qwen3moe")).prompt_buffers(64) == []
