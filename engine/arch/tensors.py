"""The tensors of the standard layer (base.Transformer's attention, then a SwiGLU or routed experts) and of the
output, with the shapes the config implies, as llama.cpp names them: the families built on that layer check a file
with check_standard, the others check their own layers and the output with check_output.
"""
from __future__ import annotations

from engine.model_config import ModelConfig, ModelError

EXPERT_KINDS = ("gate", "up", "down")


def required(cfg: ModelConfig, ffn_norm: str = "ffn_norm.weight") -> list[str]:
    """Every tensor the standard forward reads. ffn_norm: the name of the norm before the feed-forward block."""
    names = ["token_embd.weight", "output_norm.weight"]
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        names += [b + n for n in ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                                  "attn_output.weight", ffn_norm)]
        if cfg.qk_norm:
            names += [b + "attn_q_norm.weight", b + "attn_k_norm.weight"]
        if cfg.attn_bias:
            names += [b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias"]
        if cfg.is_moe_layer(i):
            names += [b + "ffn_gate_inp.weight"] + [b + f"ffn_{k}_exps.weight" for k in EXPERT_KINDS]
            if cfg.shared_expert:
                names += [b + f"ffn_{k}_shexp.weight" for k in EXPERT_KINDS]
            if cfg.shared_expert_gate:
                names += [b + "ffn_gate_inp_shexp.weight"]
        else:
            names += [b + f"ffn_{k}.weight" for k in EXPERT_KINDS]
    return names


def layer_shapes(cfg: ModelConfig, layer: int, ffn_norm: str = "ffn_norm.weight") -> dict[str, tuple[int, ...]]:
    """Numpy shapes of one layer's main tensors, by name without the 'blk.N.' prefix."""
    E, q, kv, v = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.n_head_kv * cfg.head_dim_v
    shapes = {"attn_q.weight": (q, E), "attn_k.weight": (kv, E), "attn_v.weight": (v, E),
              "attn_output.weight": (E, cfg.n_head * cfg.head_dim_v), "attn_norm.weight": (E,), ffn_norm: (E,)}
    if cfg.is_moe_layer(layer):
        X, F = cfg.n_expert, cfg.n_ff_exp
        shapes.update({"ffn_gate_inp.weight": (X, E), "ffn_gate_exps.weight": (X, F, E),
                       "ffn_up_exps.weight": (X, F, E), "ffn_down_exps.weight": (X, E, F)})
    else:
        shapes.update({"ffn_gate.weight": (cfg.n_ff, E), "ffn_up.weight": (cfg.n_ff, E),
                       "ffn_down.weight": (E, cfg.n_ff)})
    return shapes


def check_standard(model, ffn_norm: str = "ffn_norm.weight") -> None:
    """Every tensor the standard forward reads is there, in the shape the config implies; else a ModelError."""
    cfg = model.config
    for name in required(cfg, ffn_norm):
        model.tensor(name)
    for i in range(cfg.n_layer):
        for suffix, want in layer_shapes(cfg, i, ffn_norm).items():
            t = model.tensor(f"blk.{i}.{suffix}")
            if t.shape != want:
                raise ModelError(f"{model.path.name}: tensor {t.name} has shape {t.shape}, but the metadata implies "
                                 f"{want}; the file is damaged or made for another program")
    check_output(model)


def check_output(model) -> None:
    cfg = model.config
    out = model.tensor("token_embd.weight" if cfg.tied_embeddings else "output.weight")
    if out.shape != (cfg.n_vocab, cfg.n_embd):
        raise ModelError(f"{model.path.name}: tensor {out.name} has shape {out.shape}, expected "
                         f"{(cfg.n_vocab, cfg.n_embd)}; the file is damaged")
