"""general.architecture -> the CUDA family that runs it (engine/cuda/families/__init__.py says what a family is)."""
from __future__ import annotations

from engine.cuda.families.gptoss import GptOssFamily
from engine.cuda.families.hybrid import HybridFamily
from engine.cuda.families.moe import MoeFamily
from engine.cuda.families.qwen4exp import Qwen4ExpFamily

FAMILIES = (MoeFamily, HybridFamily, GptOssFamily, Qwen4ExpFamily)
FAMILY_OF = {arch: fam for fam in FAMILIES for arch in fam.archs}


def family_for(cfg):
    """The family instance for this model's config; ValueError naming the architecture when none runs it."""
    fam = FAMILY_OF.get(cfg.arch)
    if fam is None:
        raise ValueError(f"the CUDA backend has no family for architecture {cfg.arch!r} (it runs "
                         f"{', '.join(sorted(FAMILY_OF))}); use --backend cpu")
    return fam(cfg)
