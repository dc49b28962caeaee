"""The CUDA families' tiny models for the GPU tests that run each family end to end (tests/test_cuda_pipeline.py,
tests/test_cuda_stages.py, tests/test_cuda_staged_backend.py): tiny-qwen3moe-q4k (moe), the hybrid
tiny-qwen3next-q4_k_m, make_moe's gpt-oss-tiny in the published files' types, each with its reference's first
prompt."""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
FAMILIES = ("moe", "hybrid", "gptoss")


def tiny_model(family, tmp, fixtures_dir):
    """(model, prompt ids) of the family's tiny fixture; gpt-oss-tiny is made into tmp (once a directory)."""
    from engine.gguf_model import open_model
    if family == "moe":
        ref = json.loads((fixtures_dir / "reference" / "tiny-qwen3moe-q4k.json").read_text())
        return (open_model(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"),
                list(ref["cases"][0]["prompt_ids"]))
    if family == "hybrid":
        here = HERE / "fixtures" / "hybrid"
        ref = json.loads((here / "tiny-qwen3next-q4_k_m.json").read_text())
        return open_model(here / "tiny-qwen3next-q4_k_m.gguf"), list(ref["cases"][0]["prompt_ids"])
    if family != "gptoss":
        raise ValueError(f"no tiny model for family {family!r} (one of {', '.join(FAMILIES)})")
    from tools import make_moe
    from tools.gptoss_ref import PRESET
    here = HERE / "fixtures" / "gptoss"
    case = json.loads((here / "gpt-oss-tiny-f16.json").read_text())["cases"][0]
    path = Path(tmp) / "gpt-oss-tiny.gguf"
    if not path.exists():
        assert make_moe.main([*PRESET, "--norm", "F32", "--out", str(path)]) == 0
    return open_model(path), list(case["prompt_ids"])
