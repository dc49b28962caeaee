"""The tiny files of issue 35's quant types (Q2_0, Q1_0, NVFP4: make_moe's random blocks) that the CUDA backend is
checked on against the NumPy backend (tests/test_cuda_new_quants.py), and that tests/test_cuda_roundings.py checks
leave that comparison room under the CUDA backend's own fp16 roundings (tools/cuda_roundings.py).

ATTN_GAIN: make_moe's --attn-gain. It must spread a prompt's routing (at 1.0 the tokens of a prompt share most of
their experts and greedy decoding repeats a token or two) without sharpening the attention past what fp16 q, K/V and
P resolve. The rounding model's largest routed row distance on these files, prompt pass / decode after it
(docs/experiments.md, 2026-12-02, "Q2_0, Q1_0 and NVFP4 on CUDA: the roundings, not the kernels"): 0.07-0.11 /
0.03-0.04 at 3.0 (`--routing spread`, the first version's: no engine could pass it), 0.011-0.015 / 0.009-0.012 at
2.0, 0.003-0.004 / 0.002-0.003 at 1.4.
"""
from pathlib import Path

from tools import make_moe

ATTN_GAIN = 1.4
CTX = 512
N_PROMPT = 150
N_GREEDY = 16
CHUNK = 64
# the routed experts' type -> make_moe's arguments after the preset
MODELS = {
    "Q2_0": ["--arch", "qwen3moe", "--recipe", "q2_0"],
    "Q1_0": ["--arch", "qwen2moe", "--experts", "Q1_0", "--shexp", "Q2_0", "--attn", "NVFP4", "--embd", "Q1_0",
             "--output", "Q2_0"],
    "NVFP4": ["--arch", "qwen2moe", "--experts", "NVFP4", "--shexp", "Q1_0", "--attn", "Q2_0", "--embd", "NVFP4",
              "--output", "Q1_0"],
}


def make(name: str, path: Path, vocab: Path) -> Path:
    """MODELS[name] as a tiny file at path."""
    rc = make_moe.main(["--preset", "tiny", *MODELS[name], "--seed", "3", "--attn-gain", str(ATTN_GAIN),
                        "--threads", "2", "--vocab", str(vocab), "--out", str(path)])
    assert rc == 0
    return path
