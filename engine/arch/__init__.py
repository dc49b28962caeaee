"""The reference engine's families: one module each, named in engine/supported.py's FAMILIES; family() picks one.

A family module defines, at its top level:
    ARCHS        the general.architecture values it serves: a literal tuple, which engine/supported.py reads
                 from the source (setup runs before NumPy is installed)
    EXPERTS      whether the files it runs have routed experts: llama runs in dense.py without, qwen3moe.py with
    FUSED_QKV    whether a fused attn_qkv is attention's q, k and v stacked (llama.cpp's create_tensor_qkv):
                 engine/gguf_model.py then splits it on loading
    configure(cfg, get, model)   its config rules, after engine/gguf_model.read_config has read the common keys
                 into cfg (get(key, default, required) reads "<arch>.<key>"): RoPE order, routing, its own keys,
                 its layer plan (cfg.moe_layers, cfg.recurrent_layers), its own settings in cfg.family_params
    check_tensors(model)         every tensor its forward reads is in the file, in the shapes cfg implies
    MODEL        its forward pass, an engine.arch.base.Transformer
The modules are imported by their names in FAMILIES, so that a family is added in one place.
"""
from __future__ import annotations

from importlib import import_module

from engine.model_config import ModelError
from engine.supported import FAMILIES as FAMILY_NAMES, SUPPORTED_ARCHS

FAMILIES = tuple(import_module(f"engine.arch.{name}") for name in FAMILY_NAMES)


def family(arch: str, experts: bool):
    """The module that runs architecture `arch` with routed experts (experts=True) or without; None if none does."""
    for f in FAMILIES:
        if arch in f.ARCHS and f.EXPERTS == experts:
            return f
    return None


def build(model, weights, max_context: int, observer=None):
    """model: an engine.gguf_model.GGUFModel; observer: an engine.arch.base.Observer (benches watch the forward
    through it), or None."""
    cfg = model.config
    f = family(cfg.arch, cfg.is_moe)
    if f is None:
        raise ModelError(f"architecture {cfg.arch!r} has no forward pass here; supported: {', '.join(SUPPORTED_ARCHS)}")
    return f.MODEL(model, weights, max_context, observer)
