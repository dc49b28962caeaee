"""Models whose expert tensors differ by layer, as llama-quantize's recipes and community quants write them: made with
tools/make_moe.py's plan and writer, the routed experts' types set per layer and per tensor (gate, up, down).

    python tests/mixed_models.py --layout q4_k_m --out M.gguf -- --preset qwen3-30b-a3b --attn-gain 3

(the arguments after -- are make_moe's). Layouts: q4_k_m (ffn_down_exps Q6_K on llama.cpp's "more bits" layers,
Q4_K elsewhere: llama-quant.cpp llama_tensor_get_type, use_more_bits), and mix (q4_k_m plus a layer whose gate and
up differ, a Q8_0 layer and a BF16 layer: the engine's tests). tools/make_moe.py --recipe is the full rule set.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType as Q  # noqa: E402

from tools import make_moe  # noqa: E402

KINDS = ("gate", "up", "down")


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's use_more_bits (C++ integer division; its first clause covers the negative remainders)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def layer_types(layout: str, n_layer: int) -> list[dict[str, Q]]:
    """Per layer, the quant type of gate, up and down."""
    out = [{"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q6_K if use_more_bits(i, n_layer) else Q.Q4_K}
           for i in range(n_layer)]
    if layout == "q4_k_m":
        return out
    if layout != "mix":
        raise ValueError(f"unknown layout {layout!r}: q4_k_m or mix")
    if n_layer < 6:
        raise ValueError("the mix layout needs at least 6 layers")
    out[2] = {"gate": Q.Q4_K, "up": Q.Q5_K, "down": Q.Q4_K}           # gate and up differ
    out[4] = {"gate": Q.Q8_0, "up": Q.Q8_0, "down": Q.Q8_0}           # a layer kept at Q8_0
    out[5] = {"gate": Q.BF16, "up": Q.Q6_K, "down": Q.BF16}           # BF16, and gate/up differ again
    return out


def write(out: Path, layout: str, make_moe_args: list[str], progress: bool = False) -> list[dict[str, Q]]:
    """Write the model make_moe_args describe with the routed experts in `layout`; returns the per-layer types."""
    args = make_moe.build_parser().parse_args(list(make_moe_args))
    shape = make_moe.resolve_shape(args)
    vocab = make_moe.read_vocab(make_moe._resolve_vocab(shape.vocab))
    n_vocab = next(len(v) for k, v, _ in vocab if k == "tokenizer.ggml.tokens")
    types = {g: getattr(args, g) for g in ("experts", "shexp", "attn", "ffn", "embd", "output", "norm")}
    per_layer = layer_types(layout, shape.n_layer)
    specs = []
    for t in make_moe.plan(shape, types, n_vocab):
        kind = next((k for k in KINDS if t.name.endswith(f".ffn_{k}_exps.weight")), None)
        specs.append(replace(t, qtype=per_layer[t.layer][kind]) if kind else t)
    name = f"strata-random-{args.preset}-{shape.arch}-{layout}"
    make_moe.write_model(out, shape, specs, vocab, name, Q.Q4_K, args.seed, make_moe.zipf_s(args), None,
                         args.threads, progress=progress, attn_gain=args.attn_gain)
    return per_layer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/mixed_models.py")
    ap.add_argument("--layout", choices=("q4_k_m", "mix"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then make_moe's arguments")
    a = ap.parse_args(argv)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    per_layer = write(a.out, a.layout, rest, progress=True)
    print("expert types by layer:", " ".join("/".join(t[k].name for k in KINDS) for t in per_layer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
