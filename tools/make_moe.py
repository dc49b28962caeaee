"""Make GGUF models with random weights: llama.cpp's tensor names and keys, valid quant blocks, real shapes.

    python -m tools.make_moe --preset tiny --out data/models/tiny-moe.gguf [--arch qwen3moe|qwen2moe|llama]
    python -m tools.make_moe --preset qwen3-30b-a3b --out data/models/qwen3-30b-a3b-q4k.gguf
    python -m tools.make_moe --preset qwen3-30b-a3b --dry-run

Weights are random bytes inside each quant block with the block's fp16 scales set so that every weight row
dequantizes to RMS ~ 1/sqrt(n_in): a unit-RMS input gives a unit-RMS output, so activations stay finite through
48 layers. The file streams to disk one tensor at a time (a 17 GB model never sits in memory), under a .part
name renamed at the end. Deterministic from --seed.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np
import gguf
from gguf import GGUFValueType, MODEL_TENSOR as MT

from engine import quant_types
from engine.gguf_model import ModelError, read_header
from engine.quant_blocks import UE4M3
from engine.quant_types import QT as Q, SIZES
from tools import gptoss_plan
from tools import hybrid_plan
from tools import qwen4exp_plan
from tools.hybrid_plan import Hybrid
from tools.recipes import RECIPES, Hparams, apply_recipe, ftype_id
from tools.qwen4exp_plan import Qwen4ExpShape

ROOT = Path(__file__).resolve().parent.parent
VOCAB_DIR = ROOT.parent / "shared" / "fixtures" / "vocab"

# --- valid random quant blocks --------------------------------------------------------------------------------

# Byte offsets of the fp16 block scales (ggml-common.h). "d" multiplies the quants; "dmin"/"m" is an offset whose
# size (in units of d) cancels the mean of the unsigned quants, so weights come out centred on zero.
_F16_FIELDS: dict[Q, tuple[tuple[int, float], ...]] = {
    Q.Q4_0: ((0, 1.0),),
    Q.Q4_1: ((0, 1.0), (2, -7.5)),        # x = d*q + m, q in 0..15
    Q.Q5_0: ((0, 1.0),),
    Q.Q5_1: ((0, 1.0), (2, -15.5)),       # q in 0..31
    Q.Q8_0: ((0, 1.0),),
    Q.Q2_K: ((80, 1.0), (82, 1.5)),       # x = d*sc*q - dmin*m, q in 0..3, sc and m both 4-bit
    Q.Q3_K: ((108, 1.0),),
    Q.Q4_K: ((0, 1.0), (2, 7.5)),         # sc and m both 6-bit, q in 0..15
    Q.Q5_K: ((0, 1.0), (2, 15.5)),
    Q.Q6_K: ((208, 1.0),),
    Q.IQ4_NL: ((0, 1.0),),
    Q.IQ4_XS: ((0, 1.0),),
    Q.IQ2_XXS: ((0, 1.0),),
    Q.IQ2_XS: ((0, 1.0),),
    Q.IQ2_S: ((0, 1.0),),
    Q.IQ3_XXS: ((0, 1.0),),
    Q.IQ3_S: ((0, 1.0),),
    Q.Q2_0: ((0, 1.0),),                  # x = (q - 1) d, q in 0..3
    Q.Q1_0: ((0, 1.0),),                  # x = +-d
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
# Types with one signed scale and no offset, whose random quants average off zero (see _quant_blocks).
_SIGNED_SCALE = (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS, Q.Q2_0)
# Every type the engine reads. In the quantized ones every byte pattern of the quants and packed sub-scales is a
# valid block (grid indices cover their whole range), so only the fp16/E8M0/UE4M3 scales need choosing.
QUANT_TYPES = tuple(_F16_FIELDS) + (Q.MXFP4, Q.NVFP4)
SUPPORTED_TYPES = FLOAT_TYPES + QUANT_TYPES

_MXFP4_REF_E = 128          # E8M0 exponent whose half-scale is 1.0 (gguf.quants.MXFP4.e8m0_to_fp32_half)
_UE4M3_UP = UE4M3[1:0x7F]   # NVFP4's positive scales (halved, as decoded), increasing with the byte 1..0x7E
_CALIBRATION_BLOCKS = 8192


def _raw_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    # random_raw is the fastest way numpy has to fill bytes (several GB/s, GIL released)
    return rng.bit_generator.random_raw((n + 7) // 8).view(np.uint8)[:n]


def _quant_blocks(rng: np.random.Generator, qtype: Q, n_blocks: int, d_base: float) -> np.ndarray:
    """n_blocks random blocks of qtype, shape (n_blocks, type_size), scales d_base times a per-block jitter."""
    type_size = SIZES[qtype][1]
    blocks = _raw_bytes(rng, n_blocks * type_size).reshape(n_blocks, type_size)
    if qtype == Q.NVFP4:
        # A scale byte per 16 values: of the two representable scales around d_base, the upper one with the
        # probability that puts the mean square on d_base^2 exactly (as MXFP4's exponents below).
        i = int(np.searchsorted(_UE4M3_UP, d_base, side="right")) - 1
        if not 0 <= i < len(_UE4M3_UP) - 1:
            raise ValueError(f"NVFP4 scale {d_base:g} is out of the UE4M3 range")
        lo, hi = float(_UE4M3_UP[i]), float(_UE4M3_UP[i + 1])
        p_up = (d_base * d_base - lo * lo) / (hi * hi - lo * lo)
        blocks[:, :4] = (i + 1 + (rng.random((n_blocks, 4)) < p_up)).astype(np.uint8)
        return blocks
    if qtype == Q.MXFP4:
        # The scale is a power of two: mix exponents k and k+1 so the mean square lands on d_base^2 exactly.
        k = int(np.floor(np.log2(d_base)))
        p_up = (d_base * d_base / 4.0 ** k - 1.0) / 3.0
        e = _MXFP4_REF_E + k + (rng.random(n_blocks) < p_up)
        if e.min() < 2 or e.max() > 254:
            raise ValueError(f"MXFP4 scale {d_base:g} is out of the E8M0 range")
        blocks[:, 0] = e.astype(np.uint8)
        return blocks
    # Real quantizers give every block its own scale; a jitter of 0.5..1.5 keeps rows from being copies in scale.
    d = d_base * (0.5 + rng.random(n_blocks))
    if qtype in _SIGNED_SCALE:
        # Their quants are not centred (Q4_0's q-8 averages -0.5, IQ4's table -5.9 of 127): a mean that every block
        # shares pushes every token towards one hidden state within a dozen layers, so routing collapses. A random
        # sign per block scale (as real blocks of either sign have) cancels it.
        d *= np.where(rng.random(n_blocks) < 0.5, -1.0, 1.0)
    for offset, mult in _F16_FIELDS[qtype]:
        blocks[:, offset:offset + 2] = (d * mult).astype("<f2").view(np.uint8).reshape(n_blocks, 2)
    return blocks


@cache
def _unit_rms(qtype: Q) -> float:
    """RMS of the dequantized weights when the block scale is 1, measured through the engine's reference decoder."""
    rng = np.random.Generator(np.random.SFC64(20260))
    blocks = _quant_blocks(rng, qtype, _CALIBRATION_BLOCKS, 1.0)
    x = quant_types.dequantize(blocks, qtype).astype(np.float64)
    return float(np.sqrt(np.mean(x * x)))


def random_rows(rng: np.random.Generator, qtype: Q, n_rows: int, n_in: int, rms: float) -> np.ndarray:
    """n_rows weight rows of n_in values with the given RMS, as GGUF bytes: shape (n_rows, row_bytes) uint8."""
    if qtype in FLOAT_TYPES:
        x = rng.standard_normal((n_rows, n_in), dtype=np.float32)
        x *= np.float32(rms)
        if qtype == Q.F32:
            return x.view(np.uint8)
        if qtype == Q.F16:
            return x.astype("<f2").view(np.uint8)
        # bf16: round to nearest even on the upper 16 bits
        u = x.view(np.uint32)
        u = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
        return u.astype("<u2").view(np.uint8)
    block_size, type_size = SIZES[qtype]
    if n_in % block_size:
        raise ValueError(f"{qtype.name} needs rows that are a multiple of {block_size} values, not {n_in}")
    per_row = n_in // block_size
    blocks = _quant_blocks(rng, qtype, n_rows * per_row, rms / _unit_rms(qtype))
    return blocks.reshape(n_rows, per_row * type_size)


def row_bytes(qtype: Q, n_in: int) -> int:
    block_size, type_size = SIZES[qtype]
    return n_in // block_size * type_size


# --- model shapes -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    arch: str                 # llama | qwen3moe | qwen2moe
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int                 # dense FFN width (qwen*moe: the HF intermediate_size llama.cpp records but does not use)
    n_expert: int             # 0: dense (llama only)
    n_expert_used: int
    n_ff_exp: int             # width of one expert (llama MoE: written as feed_forward_length, as mixtral's)
    n_ff_shexp: int           # qwen2moe shared expert width
    n_ctx_train: int
    rope_base: float
    rms_eps: float
    tied: bool                # no output.weight: token_embd is the output head
    vocab: str                # file name in the fixtures' vocab/ directory, or a path
    hybrid: Hybrid | None = None   # qwen3next / qwen35moe: the GDN layers and MTP blocks (tools/hybrid_plan.py)
    q4exp: Qwen4ExpShape | None = None   # qwen4exp: HC, QSA, PLE and the rest (tools/qwen4exp_plan.py)


@dataclass(frozen=True)
class Preset:
    shape: Shape
    note: str
    zipf_s: float             # router norm exponent that puts this shape's routing on bench.routing's TARGET
    types: dict | None = None  # default quant type per size class where not make_moe's (the real files' types)
    packs: bool = False        # --pack picks the types of one of the published files (tools/qwen4exp_plan.py)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(Shape("qwen3moe", 4, 256, 4, 2, 64, 512, 8, 2, 256, 256, 2048, 1e6, 1e-6, False,
                         "tiny-bpe-1024.gguf"),
                   "a few MB for tests: 4 layers, hidden 256, 4/2 heads of 64, 8 experts (2 used) of width 256",
                   1.3),
    "qwen3-30b-a3b": Preset(Shape("qwen3moe", 48, 2048, 32, 4, 128, 6144, 128, 8, 768, 0, 40960, 1e6, 1e-6, False,
                                  "ggml-vocab-qwen2.gguf"),
                            "Qwen3-30B-A3B's shapes: 48 layers, hidden 2048, 32/4 heads of 128, 128 experts "
                            "(8 used) of width 768, 151936-token vocabulary", 0.2),
    # Qwen3-Next-80B-A3B's real layers are Gated DeltaNet hybrids (llama.cpp arch qwen3next), which the engine
    # does not run yet. Its expert side (512 experts, 10 used, width 512, one shared expert behind a sigmoid gate)
    # is what matters for expert streaming, and qwen2moe is the supported architecture with exactly that layout.
    # llama.cpp's qwen2moe wants n_head * head_dim == n_embd, full rotary and q/k/v biases, so the attention is
    # 8 heads of 256 with Qwen3-Next's 2 KV heads of 256 (the same KV cache per token).
    "qwen3-next-80b": Preset(Shape("qwen2moe", 48, 2048, 8, 2, 256, 5120, 512, 10, 512, 512, 262144, 1e7, 1e-6,
                                   False, "ggml-vocab-qwen2.gguf"),
                             "Qwen3-Next-80B-A3B's expert shapes as arch qwen2moe: 48 layers, hidden 2048, 8/2 "
                             "heads of 256, 512 experts (10 used) of width 512 plus a shared expert of 512", 0.12),
    # gpt-oss: tools/gptoss_plan.py holds the tensor plan, keys and vocabulary (Shape.vocab names the latter)
    "gpt-oss-20b": Preset(Shape("gpt-oss", 24, 2880, 64, 8, 64, 2880, 32, 4, 2880, 0, 131072, 150000.0, 1e-5,
                                False, "harmony-o200k"),
                          "gpt-oss-20b's shapes and types: 24 layers, hidden 2880, 64/8 heads of 64, 32 experts "
                          "(4 used) of width 2880 in MXFP4, the rest Q8_0, window 128 on alternate layers",
                          0.4, gptoss_plan.REAL_TYPES),
    "gpt-oss-120b": Preset(Shape("gpt-oss", 36, 2880, 64, 8, 64, 2880, 128, 4, 2880, 0, 131072, 150000.0, 1e-5,
                                 False, "harmony-o200k"),
                           "gpt-oss-120b's: as gpt-oss-20b with 36 layers and 128 experts", 0.17,
                           gptoss_plan.REAL_TYPES),
    "gpt-oss-tiny": Preset(Shape("gpt-oss", 4, 256, 8, 2, 64, 128, 16, 4, 128, 0, 131072, 150000.0, 1e-5, False,
                                 "harmony-tiny"),
                           "gpt-oss for tests: 4 layers, hidden 256, 8/2 heads of 64, 16 experts (4 used) of "
                           "width 128, window 16, tiny-bpe-1024 with the harmony control tokens", 1.0,
                           gptoss_plan.REAL_TYPES),
    # The Gated DeltaNet hybrids at their published configs' shapes (tools/hybrid_plan.py), with an MTP block
    # (--recipe q4_k_m gives the published files' per-layer types); zipf-s not yet calibrated by bench.routing (0.12
    # as qwen3-next-80b's 512 experts, 0.15 for 256).
    "qwen3next-80b-a3b": Preset(Shape("qwen3next", 48, 2048, 16, 2, 256, 5120, 512, 10, 512, 512, 262144, 1e7, 1e-6,
                                      False, "ggml-vocab-qwen2.gguf",
                                      Hybrid(4, 128, 16, 32, 64, n_nextn=1)),
                                "Qwen3-Next-80B-A3B (qwen3next): 48 layers (36 GDN of 16/32 heads of 128, 12 gated "
                                "attention of 16/2 heads of 256), 512 experts (10 used) of 512 plus a shared one, "
                                "1 MTP block", 0.12),
    "qwen35moe-35b-a3b": Preset(Shape("qwen35moe", 40, 2048, 16, 2, 256, 0, 256, 8, 512, 512, 262144, 1e7, 1e-6,
                                      False, "ggml-vocab-qwen2.gguf",
                                      Hybrid(4, 128, 16, 32, 64, n_nextn=1, rope_sections=(11, 11, 10, 0),
                                             n_vocab=248320, pre="qwen35")),
                                "Qwen3.5-35B-A3B (qwen35moe): 40 layers (30 GDN, 10 gated attention with IMRoPE), "
                                "256 experts (8 used) of 512 plus a shared one, 1 MTP block, the Qwen2 vocabulary "
                                "padded to 248320", 0.15),
    # Tiny ones for tests: every width a multiple of 256 (K-quant rows), 4 experts (llama-quantize treats 8 apart),
    # RoPE base 1e4 so that most of the 8 rotary pairs turn visibly within a 300-token prompt (at 1e7 only 3 do);
    # tiny-qwen35moe's IMRoPE sections 1/1/1/1 put pairs 3 and 7 in the fourth section, which text keeps still.
    "tiny-qwen3next": Preset(Shape("qwen3next", 4, 256, 4, 2, 64, 512, 4, 2, 256, 256, 4096, 1e4, 1e-6, False,
                                   "tiny-bpe-1024.gguf", Hybrid(4, 64, 2, 4, 16, n_nextn=1)),
                             "a few MB for tests: qwen3next, 3 GDN layers (2/4 heads of 64) + 1 gated attention "
                             "(4/2 heads of 64), 4 experts (2 used) of 256 + a shared one, 1 MTP block", 1.0),
    "tiny-qwen35moe": Preset(Shape("qwen35moe", 4, 256, 4, 2, 64, 0, 4, 2, 256, 256, 4096, 1e4, 1e-6, False,
                                   "tiny-bpe-1024.gguf",
                                   Hybrid(4, 64, 2, 4, 16, n_nextn=1, rope_sections=(1, 1, 1, 1), pre="qwen35")),
                             "a few MB for tests: qwen35moe, as tiny-qwen3next with IMRoPE sections 1/1/1/1 and "
                             "the pre-tokenizer qwen35", 1.0),
    # qwen4exp (tools/qwen4exp_plan.py). The tiny one: widths multiples of 256 but the HC rank (64: hc_*_up's rows
    # take no K-quant, as the real rank 320's do not), GDN value heads 3 per key head as the real model's, a QSA
    # budget of 32 tokens (8 blocks: prompts of a few dozen tokens cross into the sparse regime; --qsa-budget N), a
    # 4096-row n-gram table, PLE's EOS the vocabulary's <|endoftext|>.
    "tiny-qwen4exp": Preset(Shape("qwen4exp", 4, 256, 4, 2, 64, 0, 4, 2, 256, 256, 4096, 1e4, 1e-6, False,
                                  "tiny-bpe-1024.gguf",
                                  q4exp=Qwen4ExpShape(64, 128, 2, 6, 16, 4, 32, 32, 1021, ple_rows=4096,
                                                      rope_sections=(3, 3, 2, 0))),
                            "a few MB for tests: qwen4exp, 3 GDN layers (2/6 heads of 128) + 1 QSA layer (4/2 heads "
                            "of 64, indexer 4 heads of 32, budget 32 tokens), 4 HC streams, PLE on layer 1 from a "
                            "4096-row table, 4 experts (2 used) of 256 + a shared one", 1.0),
    "qwen3.8-flash-next": Preset(Shape("qwen4exp", 48, 2560, 24, 2, 256, 0, 512, 10, 640, 640, 262144, 1e7, 1e-6,
                                       False, "ggml-vocab-qwen2.gguf",
                                       q4exp=Qwen4ExpShape(320, 128, 16, 48, 64, 4, 128, 2048, 248044,
                                                           ple_image=248056, n_vocab=248320, pre="qwen35")),
                                 "Qwen3.8-Flash-Next (qwen4exp): 48 layers (36 GDN of 16/48 heads of 128, 12 QSA "
                                 "of 24/2 heads of 256 with a 2048-token indexer budget), 4 HC streams of 2560, 512 "
                                 "experts (10 used) of 640 + a shared one, a 320M-row n-gram table; --pack picks a "
                                 "published file's types (default q2_0)", 0.12,
                                 qwen4exp_plan.pack_types(qwen4exp_plan.DEFAULT_PACK), packs=True),
}
ARCHES = ("llama", "qwen3moe", "qwen2moe", "qwen3", "qwen2", "gpt-oss")   # qwen3/qwen2: dense

# Weight scales. Matrices: RMS 1/sqrt(n_in), so x@W keeps a unit-RMS input at unit RMS. The embedding and the
# output head: RMS 2/sqrt(n_embd), so the logits after the final norm spread with a standard deviation of ~2,
# as trained models' do (a clear top token, not a flat distribution).
HEAD_GAIN = 2.0
NORM_JITTER = 0.05         # norm weights 1 + N(0, 0.05)
BIAS_RMS = 0.02
# Router rows: expert e of layer l has norm ROUTER_NORM / (rank_l(e) + 1)^s, rank_l a random permutation per
# layer. With a unit-RMS hidden state the logit of expert e is ~N(0, norm_e^2), so big-norm experts win the top-k
# more often; ROUTER_NORM sets the logits' spread (std 2 for the top expert: a clear softmax winner among 128).
# Each preset's s puts the hit rate of a frequency-ranked cache on bench/routing.py's TARGET (a trained MoE with a
# load-balancing loss: half of each layer's experts catch ~70% of its routings), measured there on random
# RMS-normed inputs (python -m bench.routing --preset P). The same s skews more with more experts (the norms span
# s*ln(n_expert)), hence one per preset; s = 0.25 on 128 experts (the old default) gave 0.74 at 50%, s = 0 is flat
# (0.50 at 50%). --zipf-s overrides it.
ROUTER_NORM = 2.0
# Attention sharpness, for routing's sake. With unit-RMS q and k the scores q.k/sqrt(head_dim) have a standard
# deviation of 1, so each head's attention is nearly flat and returns about the mean of the context's values: the
# same vector for every token of a prompt. Layer after layer the residual stream fills with it (measured on a
# 48-layer, hidden-2048, Q4_K model: 2/3 of each router input's energy is the prompt's mean from layer ~20 on), so
# every token of a prompt routes to the same experts and an adaptive expert cache hits ~99% whatever the routers
# are: the H200's 0.997. --attn-gain G multiplies q and k by G (qwen3moe: its q/k norm weights; other archs: the
# q/k projections), the scores' spread by G^2: at G = 3 the prompt's mean falls to < 0.1 of the energy and the
# per-prompt hit-rate curve lands on bench/routing.py's TARGET (python -m bench.routing --model M --forward
# --route-preset qwen3-30b-a3b). The default leaves the attention weights as they were.
ATTN_GAIN = 1.0
# Routing over time as a trained model's (bench.routing's TEMPORAL_TARGET, from Qwen3-30B-A3B decode traces: ~45%
# of a token's experts repeat at the next token, ~80% within 8 tokens, an LRU of 40% of the experts hits 90-95%).
# Measured on a 48-layer cut of the 30B shape with 16 experts, 8 used, routed through the preset's 128-expert
# routers (docs/experiments.md): gain 1.0 gives 0.61/0.90/0.94, too sticky; 1.2 gives 0.49/0.85/0.91; 1.5
# 0.30/0.74/0.82. --routing trained is 1.2; --routing spread is 3 (tokens route nearly independently: the pessimistic
# end); decode figures at both bracket what a user sees.
ROUTING_GAINS = {"trained": 1.2, "spread": 3.0}
# gpt-oss routes far less stickily at the same gain (its alternate 128-token windows and attention sinks keep less of
# the prompt's mean in the residual). On a 36-layer cut of the 120b with 16 experts, routed through the preset's
# 128-expert routers (docs/experiments.md, "gpt-oss-120b's expert-cache hit rate"): 1.2 gives 0.16/0.57/0.83, 0.8
# 0.29/0.72/0.93, 0.6 0.36/0.79/0.95, 0.5 0.41/0.82/0.96, 0.4 0.46/0.84/0.96; 0.5 has the smallest largest gap to
# the target (0.036). The 20b (24 layers) shares it, not measured.
ARCH_ROUTING_GAINS = {"gpt-oss": {"trained": 0.5}}


def routing_gain(routing: str, arch: str) -> float:
    """The attention gain --routing ROUTING means for this arch."""
    return ARCH_ROUTING_GAINS.get(arch, {}).get(routing, ROUTING_GAINS[routing])


ZIPF_S = 0.2               # qwen3-30b-a3b's; the default for shapes made with --n-expert


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]    # numpy order, rows first: (n_out, n_in) or (n_expert, n_out, n_in)
    qtype: Q
    group: str                # size class for --dry-run: embd output attn norm bias router ffn experts shexp
    init: str                 # matrix | head | norm | bias | router | shexp_gate
    layer: int = -1

    @property
    def nbytes(self) -> int:
        rows = int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1
        return rows * row_bytes(self.qtype, self.shape[-1])


def _name(t: MT, bid: int | None = None) -> str:
    return gguf.TENSOR_NAMES[t].format(bid=bid) + ".weight"


def _bias(t: MT, bid: int) -> str:
    return gguf.TENSOR_NAMES[t].format(bid=bid) + ".bias"


def plan(shape: Shape, types: dict[str, Q], n_vocab: int) -> list[TensorSpec]:
    """Every tensor of the model, in file order (that of llama.cpp's converters: embedding, output, then blocks)."""
    s = shape
    if s.hybrid:
        return hybrid_plan.plan(s, types, n_vocab, TensorSpec)
    if s.q4exp:
        return qwen4exp_plan.plan(s, types, n_vocab, TensorSpec)
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    specs = [TensorSpec(_name(MT.TOKEN_EMBD), (n_vocab, s.n_embd), types["embd"], "embd", "head"),
             TensorSpec(_name(MT.OUTPUT_NORM), (s.n_embd,), types["norm"], "norm", "norm")]
    if not s.tied:
        specs.append(TensorSpec(_name(MT.OUTPUT), (n_vocab, s.n_embd), types["output"], "output", "head"))
    for i in range(s.n_layer):
        def add(t, shp, group, init, bias=False):
            name = _bias(t, i) if bias else _name(t, i)
            qtype = Q.F32 if group in ("bias", "router") else types[group]
            specs.append(TensorSpec(name, shp, qtype, group, init, i))

        add(MT.ATTN_NORM, (s.n_embd,), "norm", "norm")
        add(MT.FFN_NORM, (s.n_embd,), "norm", "norm")
        if s.arch in ("qwen3moe", "qwen3"):
            add(MT.ATTN_Q_NORM, (s.head_dim,), "norm", "norm")
            add(MT.ATTN_K_NORM, (s.head_dim,), "norm", "norm")
        add(MT.ATTN_Q, (q_dim, s.n_embd), "attn", "matrix")
        add(MT.ATTN_K, (kv_dim, s.n_embd), "attn", "matrix")
        add(MT.ATTN_V, (kv_dim, s.n_embd), "attn", "matrix")
        if s.arch in ("qwen2moe", "qwen2"):
            add(MT.ATTN_Q, (q_dim,), "bias", "bias", bias=True)
            add(MT.ATTN_K, (kv_dim,), "bias", "bias", bias=True)
            add(MT.ATTN_V, (kv_dim,), "bias", "bias", bias=True)
        add(MT.ATTN_OUT, (s.n_embd, q_dim), "attn", "matrix")
        if s.n_expert == 0:
            add(MT.FFN_GATE, (s.n_ff, s.n_embd), "ffn", "matrix")
            add(MT.FFN_UP, (s.n_ff, s.n_embd), "ffn", "matrix")
            add(MT.FFN_DOWN, (s.n_embd, s.n_ff), "ffn", "matrix")
            continue
        # llama.cpp keeps the router in F32 (convert_hf_to_gguf and llama-quantize both exempt ffn_gate_inp)
        add(MT.FFN_GATE_INP, (s.n_expert, s.n_embd), "router", "router")
        add(MT.FFN_GATE_EXP, (s.n_expert, s.n_ff_exp, s.n_embd), "experts", "matrix")
        add(MT.FFN_UP_EXP, (s.n_expert, s.n_ff_exp, s.n_embd), "experts", "matrix")
        add(MT.FFN_DOWN_EXP, (s.n_expert, s.n_embd, s.n_ff_exp), "experts", "matrix")
        if s.arch == "qwen2moe":
            # the shared expert's gate is one row (HF shape [1, n_embd]), F32 like the fixtures' and llama.cpp's
            add(MT.FFN_GATE_INP_SHEXP, (1, s.n_embd), "router", "shexp_gate")
            add(MT.FFN_GATE_SHEXP, (s.n_ff_shexp, s.n_embd), "shexp", "matrix")
            add(MT.FFN_UP_SHEXP, (s.n_ff_shexp, s.n_embd), "shexp", "matrix")
            add(MT.FFN_DOWN_SHEXP, (s.n_embd, s.n_ff_shexp), "shexp", "matrix")
    return specs


# --- tensor data ------------------------------------------------------------------------------------------------

_CHUNK_BYTES = 32 << 20     # rows are generated in chunks of about this size, one random stream per chunk
# A tensor bigger than this (qwen4exp's n-gram table: 29 GB in Q4_0) is made chunk by chunk as it is written.
STREAM_BYTES = 2 << 30


class Streamed:
    """A tensor's bytes made as GGUFWriter.write_tensor_data writes them (its tofile), a batch of chunks at a time,
    never whole in memory; the bytes are those tensor_bytes would return in one array."""

    def __init__(self, nbytes: int, n_chunks: int, make, pool: ThreadPoolExecutor | None):
        self.nbytes, self.n_chunks, self.make, self.pool = nbytes, n_chunks, make, pool

    def tofile(self, f) -> None:
        batch = 16
        for lo in range(0, self.n_chunks, batch):
            cs = range(lo, min(self.n_chunks, lo + batch))
            for part in (self.pool.map(self.make, cs) if self.pool is not None else map(self.make, cs)):
                part.tofile(f)


def _router_norms(shape: Shape, layer: int, seed: int, zipf_s: float) -> np.ndarray:
    rank = np.random.Generator(np.random.SFC64([seed, 7, layer])).permutation(shape.n_expert)
    return ROUTER_NORM / (rank + 1.0) ** zipf_s


def _attn_gain(spec: TensorSpec, shape: Shape, attn_gain: float) -> float:
    """What --attn-gain multiplies this tensor by: qwen3moe's q/k norms, or the other archs' q/k projections."""
    if shape.arch in ("qwen3moe", "qwen3", qwen4exp_plan.ARCH) + hybrid_plan.HYBRID_ARCHS:
        kinds = (MT.ATTN_Q_NORM, MT.ATTN_K_NORM)
    else:
        kinds = (MT.ATTN_Q, MT.ATTN_K)
    return attn_gain if spec.name in {_name(t, spec.layer) for t in kinds} else 1.0


def tensor_bytes(spec: TensorSpec, index: int, shape: Shape, seed: int, zipf_s: float,
                 pool: ThreadPoolExecutor | None = None, attn_gain: float = 1.0,
                 stream_bytes: int = STREAM_BYTES) -> np.ndarray | Streamed:
    """The raw bytes of one tensor, shape (rows, row_bytes), or past stream_bytes a Streamed that writes the same
    bytes. Depends only on (seed, index, spec), not on threads."""
    n_in = spec.shape[-1]
    n_rows = int(np.prod(spec.shape[:-1], dtype=np.int64)) if len(spec.shape) > 1 else 1
    gain = _attn_gain(spec, shape, attn_gain) if spec.layer >= 0 else 1.0

    def rng(chunk: int) -> np.random.Generator:
        return np.random.Generator(np.random.SFC64([seed, index, chunk]))

    values = hybrid_plan.init_values(spec.init, n_in, rng(0))
    if values is not None:
        return _float_bytes(values, spec.qtype)
    if spec.init == "norm":
        x = 1.0 + NORM_JITTER * rng(0).standard_normal(n_in)
        return _float_bytes(gain * x.reshape(1, -1), spec.qtype)
    if spec.init == "bias":
        return random_rows(rng(0), spec.qtype, n_rows, n_in, BIAS_RMS)
    if spec.init == "router":
        w = rng(0).standard_normal((n_rows, n_in))
        w *= (_router_norms(shape, spec.layer, seed, zipf_s) / np.linalg.norm(w, axis=1))[:, None]
        return _float_bytes(w, spec.qtype)
    if spec.init == "shexp_gate":
        return random_rows(rng(0), spec.qtype, 1, n_in, 1.0 / np.sqrt(n_in))
    rms = HEAD_GAIN / np.sqrt(n_in) if spec.init == "head" else gain / np.sqrt(n_in)
    if spec.init == "ple_rows":   # 16 rows make one token's n-gram embedding: the token embedding's spread
        rms = HEAD_GAIN / np.sqrt(shape.n_embd)
    width = row_bytes(spec.qtype, n_in)
    step = max(1, _CHUNK_BYTES // width)

    def chunk(c: int) -> np.ndarray:
        lo = c * step
        return random_rows(rng(c), spec.qtype, min(n_rows, lo + step) - lo, n_in, rms)

    if n_rows * width > stream_bytes:
        return Streamed(n_rows * width, (n_rows + step - 1) // step, chunk, pool)
    out = np.empty((n_rows, width), np.uint8)

    def fill(c: int) -> None:
        out[c * step:c * step + step] = chunk(c)

    chunks = range((n_rows + step - 1) // step)
    if pool is None or len(chunks) == 1:
        for c in chunks:
            fill(c)
    else:
        list(pool.map(fill, chunks))
    return out


def _float_bytes(x: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return x.astype("<f4").view(np.uint8)
    if qtype == Q.F16:
        return x.astype("<f2").view(np.uint8)
    if qtype == Q.BF16:
        u = x.astype(np.float32).view(np.uint32)
        return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype("<u2").view(np.uint8)
    raise ValueError(f"{qtype.name} is not a float type")


# --- metadata ---------------------------------------------------------------------------------------------------

_FILE_TYPE = {Q.F32: "ALL_F32", Q.F16: "MOSTLY_F16", Q.BF16: "MOSTLY_BF16", Q.Q8_0: "MOSTLY_Q8_0",
              Q.Q4_0: "MOSTLY_Q4_0", Q.Q4_1: "MOSTLY_Q4_1", Q.Q5_0: "MOSTLY_Q5_0", Q.Q5_1: "MOSTLY_Q5_1",
              Q.Q2_K: "MOSTLY_Q2_K", Q.Q3_K: "MOSTLY_Q3_K_M", Q.Q4_K: "MOSTLY_Q4_K_M", Q.Q5_K: "MOSTLY_Q5_K_M",
              Q.Q6_K: "MOSTLY_Q6_K", Q.IQ4_NL: "MOSTLY_IQ4_NL", Q.IQ4_XS: "MOSTLY_IQ4_XS",
              Q.IQ2_XXS: "MOSTLY_IQ2_XXS", Q.IQ2_XS: "MOSTLY_IQ2_XS", Q.IQ2_S: "MOSTLY_IQ2_S",
              Q.IQ3_XXS: "MOSTLY_IQ3_XXS", Q.IQ3_S: "MOSTLY_IQ3_S", Q.MXFP4: "MOSTLY_MXFP4_MOE",
              Q.NVFP4: "MOSTLY_NVFP4", Q.Q1_0: "MOSTLY_Q1_0", Q.Q2_0: "MOSTLY_Q2_0"}


# What GGUFWriter cannot write back: surrogateescape's stand-ins for bytes that are not UTF-8.
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


def read_vocab(path: Path) -> list[tuple[str, object, list[GGUFValueType]]]:
    """Every tokenizer.* key of a vocabulary GGUF as (key, value, [type, sub_type]), for GGUFWriter.add_key_value."""
    try:
        header = read_header(path)
    except ModelError as e:
        raise SystemExit(f"make_moe: vocabulary: {e}")
    out = []
    for key, value in header.metadata.items():
        if not key.startswith("tokenizer."):
            continue
        types = header.types[key]
        if types[-1] == GGUFValueType.ARRAY:
            raise SystemExit(f"make_moe: {path}: {key} is an array of arrays, which make_moe does not copy; "
                             f"pass --vocab with another vocabulary")
        strings = [value] if isinstance(value, str) else value if types[1:] == [GGUFValueType.STRING] else []
        if _NOT_UTF8.search("".join(strings)):
            raise SystemExit(f"make_moe: {path}: {key} holds bytes that are not UTF-8, which GGUFWriter cannot "
                             f"write back; pass --vocab with another vocabulary")
        out.append((key, value, types))
    if "tokenizer.ggml.tokens" not in header.metadata:
        raise SystemExit(f"make_moe: {path} has no tokenizer.ggml.tokens; pass --vocab with a vocabulary GGUF")
    return out


def add_metadata(w: gguf.GGUFWriter, shape: Shape, name: str, file_qtype: Q,
                 vocab: list[tuple[str, object, list[GGUFValueType]]], chat_template: str | None) -> None:
    s = shape
    w.add_name(name)
    w.add_block_count(s.n_layer + (s.hybrid.n_nextn if s.hybrid else 0))
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    # mixtral-style llama MoE: feed_forward_length is the expert width (llama.cpp sizes *_exps by n_ff)
    if not s.q4exp:    # qwen4exp has no such key (its config has no intermediate_size)
        w.add_feed_forward_length(s.n_ff_exp if s.arch == "llama" and s.n_expert else s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    if s.arch != "llama" or s.head_dim * s.n_head != s.n_embd:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_rope_dimension_count(s.hybrid.n_rot if s.hybrid else s.q4exp.n_rot if s.q4exp else s.head_dim)
    if s.arch == "gpt-oss":
        gptoss_plan.add_metadata(w, shape)
    if s.n_expert:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        if s.arch != "llama":
            w.add_expert_feed_forward_length(s.n_ff_exp)
        if s.arch == "qwen2moe" or s.hybrid or s.q4exp:
            w.add_expert_shared_feed_forward_length(s.n_ff_shexp)
    if s.hybrid:
        hybrid_plan.metadata(w, s)
    n_vocab = next(len(v) for k, v, _ in vocab if k == "tokenizer.ggml.tokens")
    if s.q4exp:
        qwen4exp_plan.metadata(w, s, n_vocab)
    if s.arch == "llama":
        w.add_vocab_size(n_vocab)
    # file_qtype: a type (uniform files) or a llama_ftype name (a --recipe's, e.g. MOSTLY_Q4_K_M)
    w.add_file_type(ftype_id(file_qtype if isinstance(file_qtype, str) else _FILE_TYPE[file_qtype]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, types in vocab:
        if key == "tokenizer.chat_template" and chat_template is not None:
            continue
        sub = types[1] if types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, value, types[0], sub_type=sub)
    if chat_template is not None:
        w.add_chat_template(chat_template)


# --- sizes, writing, CLI ----------------------------------------------------------------------------------------

GROUPS = ("embd", "output", "hc", "attn", "ssm", "norm", "bias", "router", "ffn", "experts", "shexp", "mtp", "ple")


def size_table(specs: list[TensorSpec]) -> str:
    by: dict[str, tuple[int, int, set]] = {}
    for t in specs:
        n, b, q = by.get(t.group, (0, 0, set()))
        by[t.group] = (n + 1, b + t.nbytes, q | {t.qtype.name})
    total = sum(t.nbytes for t in specs)
    lines = [f"{'class':<8} {'tensors':>7} {'types':<12} {'MB':>10} {'GiB':>8}"]
    for g in GROUPS:
        if g in by:
            n, b, q = by[g]
            lines.append(f"{g:<8} {n:>7} {','.join(sorted(q)):<12} {b / 1e6:>10.1f} {b / 2**30:>8.3f}")
    lines.append(f"{'total':<8} {len(specs):>7} {'':<12} {total / 1e6:>10.1f} {total / 2**30:>8.3f}")
    exp = by.get("experts", (0, 0, set()))[1]
    lines.append(f"experts total: {exp / 1e9:.2f} GB ({exp / 2**30:.2f} GiB, {exp / 1e6:.1f} MB)")
    return "\n".join(lines)


def _resolve_vocab(v: str) -> Path:
    p = Path(v)
    if not p.is_file() and (VOCAB_DIR / v).is_file():
        p = VOCAB_DIR / v
    if not p.is_file():
        raise SystemExit(f"make_moe: vocabulary {v} not found (looked in . and {VOCAB_DIR}); pass --vocab PATH")
    return p


def write_header_only(path: Path, shape: Shape, specs: list[TensorSpec], vocab, name: str, file_qtype: Q) -> int:
    """The model's GGUF header with its data left as a sparse hole: full-size shapes at no disk cost, for llama.cpp
    to check shapes and keys (or plan a recipe) against. Not a model to run. Returns the apparent file size."""
    w = gguf.GGUFWriter(Path(path), shape.arch)
    add_metadata(w, shape, name, file_qtype, vocab, None)
    for t in specs:
        quant_types.add_tensor_info(w, t.name, t.shape, t.qtype)   # GGUFWriter's own table lacks Q2_0
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0] if isinstance(w.fout, list) else w.fout
    f.flush()
    align = gguf.GGUF_DEFAULT_ALIGNMENT
    size = f.tell() + sum((t.nbytes + align - 1) // align * align for t in specs) + (1 << 20)   # slack: alignment
    f.truncate(size)
    w.close()
    return size


def shape_vocab(shape: Shape) -> list:
    """The vocabulary keys a shape's file carries: Shape.vocab's (gpt-oss: the harmony vocabulary made from it)."""
    if shape.arch == "gpt-oss":
        vocab = gptoss_plan.harmony_vocab(shape, read_vocab(_resolve_vocab(gptoss_plan.BASE_VOCAB)))
    else:
        vocab = read_vocab(_resolve_vocab(shape.vocab))
    if shape.hybrid or shape.q4exp:
        vocab = hybrid_plan.adjust_vocab(vocab, shape.hybrid or shape.q4exp)
    return vocab


def shape_plan(shape: Shape, types: dict, n_vocab: int) -> list[TensorSpec]:
    """Every tensor of the shape's file, in order (gpt-oss: tools/gptoss_plan.py's plan)."""
    return gptoss_plan.plan(shape, types, n_vocab, TensorSpec) if shape.arch == "gpt-oss" else \
        plan(shape, types, n_vocab)


def write_preset_header(path: Path, preset: str) -> int:
    """A preset's GGUF header with its data left as a sparse hole (write_header_only), in the preset's own types,
    for llama.cpp to check shapes and keys against. Returns the apparent file size."""
    args = parse_args(["--preset", preset])
    shape = resolve_shape(args)
    vocab = shape_vocab(shape)
    n_vocab = next(len(v) for k, v, _ in vocab if k == "tokenizer.ggml.tokens")
    types = {g: getattr(args, g) for g in ("experts", "shexp", "attn", "ffn", "embd", "output", "norm")}
    return write_header_only(Path(path), shape, shape_plan(shape, types, n_vocab), vocab, f"header-only {preset}",
                             types["experts"] if shape.n_expert else types["ffn"])


def write_model(path: Path, shape: Shape, specs: list[TensorSpec], vocab, name: str, file_qtype: Q, seed: int,
                zipf_s: float, chat_template: str | None = None, threads: int | None = None,
                progress: bool = True, attn_gain: float = ATTN_GAIN) -> None:
    """Stream the model to path+'.part' tensor by tensor, then rename it to path."""
    total = sum(t.nbytes for t in specs)
    path.parent.mkdir(parents=True, exist_ok=True)
    free = _free_bytes(path.parent)
    if free is not None and free < total + (64 << 20):
        raise SystemExit(f"make_moe: {path.parent} has {free / 1e9:.1f} GB free, the model needs "
                         f"{total / 1e9:.1f} GB; free space or choose another --out")
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(tmp, shape.arch)
    add_metadata(w, shape, name, file_qtype, vocab, chat_template)
    for t in specs:
        quant_types.add_tensor_info(w, t.name, t.shape, t.qtype)   # GGUFWriter's own table lacks Q2_0
    threads = threads or min(16, os.cpu_count() or 1)
    t0, done, last = time.monotonic(), 0, 0.0
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with ThreadPoolExecutor(threads) as pool, ThreadPoolExecutor(1) as ahead:
            # make tensor i+1 while tensor i is being written
            nxt = ahead.submit(tensor_bytes, specs[0], 0, shape, seed, zipf_s, pool, attn_gain)
            for i, t in enumerate(specs):
                data = nxt.result()
                if i + 1 < len(specs):
                    nxt = ahead.submit(tensor_bytes, specs[i + 1], i + 1, shape, seed, zipf_s, pool, attn_gain)
                w.write_tensor_data(data)
                done += t.nbytes
                now = time.monotonic()
                if progress and (now - last > 0.5 or i + 1 == len(specs)):
                    last = now
                    rate = done / max(now - t0, 1e-9) / 1e9
                    print(f"\rmake_moe: {done / 1e9:7.2f} / {total / 1e9:.2f} GB written, {rate:.2f} GB/s",
                          end="", file=sys.stderr, flush=True)
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    if progress:
        print(f"\nmake_moe: wrote {path} ({total / 1e9:.2f} GB in {time.monotonic() - t0:.1f} s)",
              file=sys.stderr)


def _free_bytes(d: Path) -> int | None:
    try:
        st = os.statvfs(d)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def _qtype(s: str) -> Q:
    try:
        q = Q[s.upper()]
    except KeyError:
        q = None
    if q not in SUPPORTED_TYPES:
        raise argparse.ArgumentTypeError(f"unknown quant type {s!r}; one of {', '.join(t.name for t in SUPPORTED_TYPES)}")
    return q


def build_parser() -> argparse.ArgumentParser:
    presets = "\n".join(f"  {k}: {p.note}" for k, p in PRESETS.items())
    ap = argparse.ArgumentParser(
        prog="python -m tools.make_moe", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Make a random-weight GGUF with llama.cpp's tensor names and metadata keys.",
        epilog=f"presets:\n{presets}\n\nqwen3-next-80b is Qwen3-Next's expert side as arch qwen2moe (shared expert "
               f"with a sigmoid gate);\nqwen3next-80b-a3b is the real architecture "
               f"(Gated DeltaNet), which both backends run.\n"
               f"Router rows have Zipf-like norms {ROUTER_NORM}/(rank+1)^s, a random rank order per layer; s\n"
               f"(--zipf-s) sets how skewed expert usage is. Per preset, s and the hit rate of a frequency-ranked\n"
               f"cache holding 25/41/50/67% of each layer's experts (python -m bench.routing --preset P\n"
               f"--zipf-s S, random RMS-normed router inputs; target 0.45/0.61/0.70/0.83):\n"
               f"  qwen3-30b-a3b s=0.2: 0.46/0.62/0.70/0.82 (s=0.25, the old default: 0.51/0.67/0.74/0.85;\n"
               f"                       s=0: 0.25/0.41/0.50/0.67, flat)\n"
               f"  qwen3-next-80b s=0.12: 0.49/0.64/0.71/0.82; tiny s=1.3 (8 experts, 2 used): 0.42/0.57/0.70/0.79\n"
               f"  at 25/38/50/63% (whole experts)\n"
               f"  gpt-oss-20b s=0.4: 0.46/0.62/0.70/0.82; gpt-oss-120b s=0.17: 0.49/0.63/0.70/0.82\n"
               f"These are the routers alone. A random-weight model's nearly flat attention gives every token of\n"
               f"a prompt much the same hidden state, so within a prompt routing concentrates far beyond this\n"
               f"(48 layers, Q4_K: 0.94/0.96/0.98 at 41/50/67% with an adaptive cache); --attn-gain 3 brings it\n"
               f"to 0.62/0.70/0.83 (python -m bench.routing --model M --forward --route-preset qwen3-30b-a3b).\n"
               f"The routers (ffn_gate_inp*) and attention biases are always F32, as llama.cpp keeps them.\n"
               f"gpt-oss presets default to the published files' types (MXFP4 experts, Q8_0 otherwise).\n"
               f"TYPE: {', '.join(t.name for t in SUPPORTED_TYPES)}")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", type=Path, help="output .gguf (written as OUT.part, renamed when complete)")
    ap.add_argument("--arch", choices=ARCHES, help="override the preset's architecture")
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--n-expert", type=int, help="number of experts (with --arch llama: a mixtral-style MoE)")
    ap.add_argument("--n-expert-used", type=int)
    ap.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                    help="tie the output head to token_embd (no output.weight)")
    ap.add_argument("--vocab", help="vocabulary GGUF whose tokenizer.* keys are copied (default: the preset's, "
                                    f"from {VOCAB_DIR})")
    ap.add_argument("--chat-template", type=Path, help="a .jinja file to use instead of the vocabulary's template")
    ap.add_argument("--seed", type=int, default=0, help="the same seed gives the same file, byte for byte")
    ap.add_argument("--zipf-s", type=float, help="router norm exponent s: 0 is flat, larger is more skewed "
                                                  "(default: the preset's, see below)")
    ap.add_argument("--attn-gain", type=float, default=ATTN_GAIN, metavar="G",
                    help=f"multiply attention q and k by G (default {ATTN_GAIN}); 3 keeps a random model's tokens "
                         f"from all routing alike (see below)")
    ap.add_argument("--routing", choices=sorted(ROUTING_GAINS),
                    help="set --attn-gain for routing over time like a trained model's (trained: 1.2, gpt-oss "
                         f"{ARCH_ROUTING_GAINS['gpt-oss']['trained']:g}) or nearly independent per token (spread: 3)")
    ap.add_argument("--threads", type=int, help="generator threads (default: CPU count, at most 16)")
    ap.add_argument("--dry-run", action="store_true", help="print the sizes, write nothing")
    ap.add_argument("--recipe", choices=sorted(RECIPES),
                    help="every tensor's type as llama-quantize's recipe would give it (tools/recipes.py: Q6_K "
                         "ffn_down on Q4_K_M's more-bits layers, ...), instead of the per-class types below")
    for group, default, what in (("experts", "Q4_K", "the routed experts, ffn_{gate,up,down}_exps"),
                                 ("shexp", "Q4_K", "qwen2moe's shared expert, ffn_{gate,up,down}_shexp"),
                                 ("attn", "Q4_K", "attn_q/k/v/output"),
                                 ("ffn", "Q4_K", "a dense llama's ffn_gate/up/down"),
                                 ("embd", "Q4_K", "token_embd"), ("output", "Q4_K", "output (the head)"),
                                 ("norm", "F32", "the RMSNorm weights: F32, F16 or BF16; llama.cpp expects F32"),
                                 ("hc", "BF16", "qwen4exp's hyper-connection matrices, hc_* and output_hc_*"),
                                 ("ple", "BF16", "qwen4exp's n-gram table, per_layer_token_embd")):
        ap.add_argument(f"--{group}", type=_qtype, default=_qtype(default), metavar="TYPE",
                        help=f"{what} (default {default})")
    q4 = ap.add_argument_group("qwen4exp")
    q4.add_argument("--pack", choices=sorted(qwen4exp_plan.PACKS),
                    help="qwen3.8-flash-next: every tensor's type as in that published file (default "
                         f"{qwen4exp_plan.DEFAULT_PACK}; the flags above override a class); Q2_0 is sized by "
                         "--dry-run but cannot be written until the engine's quant-type table has it")
    q4.add_argument("--qsa-budget", type=int, metavar="N",
                    help="the QSA indexer budget in tokens (attention.indexer.top_k, a multiple of the block of 4): "
                         "prompts longer than it leave dense attention")
    q4.add_argument("--ple-rows", type=int, metavar="N",
                    help="an n-gram table of at most N rows (the 16 hash heads' primes from the largest base that "
                         "fits) instead of the published 320,001,536: every n-gram then hashes to other rows of a "
                         "table as random as the full one, more n-grams share a row, each token still reads 16 rows, "
                         "no other tensor changes; a run sees a smaller file and a higher row-cache hit rate")
    return ap


def resolve_shape(args: argparse.Namespace) -> Shape:
    s = PRESETS[args.preset].shape
    if args.arch:
        s = replace(s, arch=args.arch)
        if args.arch == "llama" and args.n_expert is None:
            s = replace(s, n_expert=0, n_expert_used=0, rope_base=10000.0)   # llama means dense unless asked
        if args.arch in ("qwen3", "qwen2"):
            s = replace(s, n_expert=0, n_expert_used=0)
    if (args.qsa_budget is not None or args.ple_rows is not None) and not s.q4exp:
        raise SystemExit("make_moe: --qsa-budget and --ple-rows go with the qwen4exp presets")
    if args.qsa_budget is not None:
        if args.qsa_budget <= 0 or args.qsa_budget % s.q4exp.compress_ratio:
            raise SystemExit(f"make_moe: --qsa-budget must be a positive multiple of {s.q4exp.compress_ratio} "
                             f"tokens (whole indexer blocks), not {args.qsa_budget}")
        s = replace(s, q4exp=replace(s.q4exp, qsa_budget=args.qsa_budget))
    if args.ple_rows is not None:
        s = replace(s, q4exp=replace(s.q4exp, ple_rows=args.ple_rows))
    if args.n_layer is not None:
        s = replace(s, n_layer=args.n_layer)
    if args.n_expert is not None:
        s = replace(s, n_expert=args.n_expert)
    if args.n_expert_used is not None:
        s = replace(s, n_expert_used=args.n_expert_used)
    if args.tied is not None:
        s = replace(s, tied=args.tied)
    if args.vocab:
        if s.arch == "gpt-oss":
            raise SystemExit("make_moe: gpt-oss presets make their own harmony vocabulary; drop --vocab")
        s = replace(s, vocab=args.vocab)
    if (s.arch == "gpt-oss") != (s.vocab in gptoss_plan.EXTRA):
        raise SystemExit("make_moe: --arch gpt-oss goes with a gpt-oss preset only (and they with no other arch)")
    if s.arch in ("qwen3", "qwen2") and s.n_expert:
        raise SystemExit(f"make_moe: arch {s.arch} is dense; use {s.arch}moe for experts")
    if s.arch in ("qwen3moe", "qwen2moe", "gpt-oss") and s.n_expert == 0:
        raise SystemExit(f"make_moe: arch {s.arch} needs experts; pass --n-expert N (or --arch llama for dense)")
    if s.arch == "qwen2moe" and s.tied:
        raise SystemExit("make_moe: llama.cpp's qwen2moe needs output.weight; drop --tied for arch qwen2moe")
    if s.arch == "qwen2moe" and s.n_head * s.head_dim != s.n_embd:
        raise SystemExit(f"make_moe: llama.cpp's qwen2moe needs heads x head_dim = hidden, not "
                         f"{s.n_head} x {s.head_dim} != {s.n_embd}")
    if s.n_expert and not 0 < s.n_expert_used <= s.n_expert:
        raise SystemExit(f"make_moe: --n-expert-used must be between 1 and {s.n_expert}, not {s.n_expert_used}")
    if s.n_layer < 1:
        raise SystemExit("make_moe: --n-layer must be at least 1")
    return s


def zipf_s(args: argparse.Namespace) -> float:
    """--zipf-s, or the preset's when the experts are the preset's (another count wants its own s)."""
    if args.zipf_s is not None:
        return args.zipf_s
    if args.n_expert is not None:
        return ZIPF_S
    return PRESETS[args.preset].zipf_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, a preset's own default types (gpt-oss: the published files') under the flags given."""
    ap = build_parser()
    args = ap.parse_args(argv)
    p = PRESETS[args.preset]
    types = p.types
    if args.pack and not p.packs:
        raise SystemExit(f"make_moe: --pack goes with {', '.join(k for k, v in PRESETS.items() if v.packs)}")
    if args.pack and args.recipe:
        raise SystemExit("make_moe: pass --pack (a published file's types) or --recipe (llama-quantize's), not both")
    if p.packs:
        # --recipe starts, as llama-quantize does, from the converter's file: BF16, the routers F32
        types = qwen4exp_plan.pack_types(args.pack or qwen4exp_plan.DEFAULT_PACK) if not args.recipe else \
            {g: Q.BF16 for g in ("experts", "shexp", "attn", "embd", "output", "hc", "ple")}
    if types:
        ap.set_defaults(**types)
        args = ap.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.zipf_s is not None and args.zipf_s < 0:
        raise SystemExit(f"make_moe: --zipf-s must be 0 (flat) or more, not {args.zipf_s}")
    if args.routing and args.attn_gain != ATTN_GAIN:
        raise SystemExit("make_moe: pass --routing or --attn-gain, not both")
    if not args.attn_gain > 0:
        raise SystemExit(f"make_moe: --attn-gain must be more than 0, not {args.attn_gain}")
    shape = resolve_shape(args)
    if args.routing:
        args.attn_gain = routing_gain(args.routing, shape.arch)
    vocab = shape_vocab(shape)
    n_vocab = next(len(v) for k, v, _ in vocab if k == "tokenizer.ggml.tokens")
    types = {g: getattr(args, g) for g in ("experts", "shexp", "attn", "ffn", "embd", "output", "norm", "hc", "ple")}
    # a pack's classes that no flag sets (qwen4exp_plan.plan's experts_down, router, ...)
    types |= {g: getattr(args, g) for g in qwen4exp_plan.PACK_ONLY if hasattr(args, g)}
    if types["norm"] not in FLOAT_TYPES:
        raise SystemExit(f"make_moe: --norm must be F32, F16 or BF16 (norms are 1-D), not {types['norm'].name}")
    specs = shape_plan(shape, types, n_vocab)
    if args.recipe:
        # llama.cpp counts a hybrid's MTP blocks among the layers (n_layer_all) when it picks ffn_down's types
        n_all = shape.n_layer + (shape.hybrid.n_nextn if shape.hybrid else 0)
        specs = apply_recipe(specs, args.recipe, Hparams(n_all, shape.n_head, shape.n_head_kv, shape.n_expert))
    for t in specs:
        block = SIZES[t.qtype][0]
        if t.shape[-1] % block:
            raise SystemExit(f"make_moe: {t.name} has rows of {t.shape[-1]} values, not a multiple of "
                             f"{t.qtype.name}'s block of {block}; choose another --{t.group} type")
    arch_desc = shape.arch + (f" MoE {shape.n_expert}x{shape.n_expert_used}" if shape.n_expert else " dense")
    print(f"make_moe: preset {args.preset}, {arch_desc}, {shape.n_layer} layers, hidden {shape.n_embd}, "
          f"vocab {n_vocab}, seed {args.seed}" + (f", router zipf-s {zipf_s(args)}" if shape.n_expert else ""))
    print(size_table(specs))
    if args.dry_run:
        return 0
    if args.out is None:
        raise SystemExit("make_moe: pass --out PATH.gguf (or --dry-run)")
    if args.out.is_dir():
        raise SystemExit(f"make_moe: --out {args.out} is a directory; give the file name, e.g. {args.out}/model.gguf")
    template = None
    if args.chat_template is not None:
        try:
            template = args.chat_template.read_text(encoding="utf-8")
        except OSError as e:
            raise SystemExit(f"make_moe: cannot read --chat-template {args.chat_template}: {e.strerror}")
    file_qtype = types["experts"] if shape.n_expert else types["ffn"]
    if args.recipe:
        file_qtype = RECIPES[args.recipe][0]
    name = f"strata-random-{args.preset}-{shape.arch}"
    write_model(args.out, shape, specs, vocab, name, file_qtype, args.seed, zipf_s(args), template, args.threads,
                attn_gain=args.attn_gain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
