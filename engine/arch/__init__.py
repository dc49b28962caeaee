"""One module per architecture family; build() picks the one a model needs."""
from __future__ import annotations

from engine.gguf_model import GGUFModel, ModelError, SUPPORTED_ARCHS


def family(model: GGUFModel):
    from engine.arch.dense import Dense
    from engine.arch.gptoss import GptOss
    from engine.arch.mixtral import Mixtral
    from engine.arch.qwen2moe import Qwen2MoE
    from engine.arch.qwen3moe import Qwen3MoE
    from engine.arch.qwen3next import Qwen3Next

    arch = model.config.arch
    if arch == "llama":
        return Mixtral if model.config.is_moe else Dense
    if arch in ("qwen2", "qwen3"):
        return Dense
    if arch == "qwen3moe":
        return Qwen3MoE
    if arch == "qwen2moe":
        return Qwen2MoE
    if arch == "gpt-oss":
        return GptOss
    if arch in ("qwen3next", "qwen35moe"):
        return Qwen3Next
    if _declaring(arch) is not None:
        return _declaring(arch).FAMILY
    raise ModelError(f"architecture {arch!r} has no forward pass here; supported: {', '.join(SUPPORTED_ARCHS)}")


def _declaring(arch: str):
    """The family module that declares arch in its ARCHS with its own config rules and tensor checks, or None."""
    from engine.arch import qwen4exp
    return qwen4exp if arch in qwen4exp.ARCHS else None


def read_family_config(cfg, md: dict, model) -> None:
    """engine.gguf_model.read_config's per-family step: the declaring family fills cfg (and cfg.family_params)."""
    fam = _declaring(cfg.arch)
    if fam is not None:
        fam.read_config(cfg, md, model)


def check_family_tensors(model) -> bool:
    """The declaring family's tensor checks; False where gguf_model's own checks apply."""
    fam = _declaring(model.config.arch)
    if fam is None:
        return False
    fam.check_tensors(model)
    return True


def build(model: GGUFModel, weights, max_context: int, observer=None):
    """observer: an engine.arch.base.Observer (benches watch the forward through it), or None."""
    return family(model)(model, weights, max_context, observer)
