"""A NumPy model of the CUDA backend's roundings: the NumPy backend's forward (engine/arch) with the fp16 steps the
CUDA prompt pass and decode step take, and no kernel's own error. Its distance from the CPU backend is what a
bug-free CUDA engine shows on that file: a CUDA figure near the model's is the roundings (and routing near-ties), one
far above it a bug. `python -m tools.cuda_roundings --model FILE` prints the figures; tools/new_quant_diag.py puts them
beside the GPU's.

The roundings (PASS, DECODE; Roundings switches them one by one):
- prompt pass (engine/cuda/prefill.py, families/moe.py MoePrompt): fp16 operands of the q/k/v/o GEMMs (to_half,
  dequant_rows_f16) and of the grouped expert GEMMs, whose SwiGLU output h is saturated to fp16 (moe_gemm.cu);
  K/V stored in fp16 (norm_rope.cu qk_rope_store); the flash attention's q (times scale * log2 e) and P in fp16,
  its row sums in fp32 (prefill_attn.cu); routers, shared experts, dense FFNs and the head in fp32.
- decode step: fp32 throughout, K/V in fp16 (engine/cuda/kv.py's default cache).
Covered: the archs of the CUDA moe family (llama, qwen2, qwen3, qwen2moe, qwen3moe); others are refused.

Route following (tests/route_ties.py's rule, for the model's own use): with `follow` {(position, layer): expert
set}, a row whose top-k gap is under `tie` takes those experts; every place they differed goes to `parted`.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np

from engine.arch import base, dense, family, qwen2moe, qwen3moe
from engine.backend_cpu import CPUBackend
from engine.gguf_model import ModelError, open_model

ROUTE_TIE = 0.1             # tests/route_ties.py's ROUTE_TIE: a gap the streamed pass's roundings may part
LOG2E = np.float32(1.4426950408889634)


@dataclass(frozen=True)
class Roundings:
    kv: bool = False        # K and V stored as fp16
    gemm: bool = False      # fp16 operands of the attention and expert GEMMs, fp16 SwiGLU h
    flash: bool = False     # the flash attention's fp16 q and P


NONE = Roundings()
DECODE = Roundings(kv=True)
PASS = Roundings(kv=True, gemm=True, flash=True)


def half(a) -> np.ndarray:
    """fp32 -> fp16 -> fp32, saturating at fp16's largest finite value as the kernels' conversions do."""
    a = np.asarray(a, dtype=np.float32)
    return np.clip(a, -65504.0, 65504.0).astype(np.float16).astype(np.float32)


class RoundedWeights(base.Weights):
    """base.Weights whose attention matrices and experts come rounded to fp16 while `gemm` is set (the pass's GEMM
    operands); every other tensor (routers, shared experts, norms, the head) as float32."""

    ATTN = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")

    def __init__(self, model):
        super().__init__(model)
        self.gemm = False
        self._half: dict = {}

    def get(self, name: str) -> np.ndarray:
        w = super().get(name)
        if not self.gemm or not name.endswith(self.ATTN):
            return w
        if name not in self._half:
            self._half[name] = half(w)
        return self._half[name]

    def expert(self, layer: int, e: int, decoding: bool):
        mats = super().expert(layer, e, decoding)
        return tuple(half(m) for m in mats) if self.gemm else mats


class _Rounded:
    """Mixed in before a family's Transformer (_CLASSES): the roundings in attention, attend and the MoE FFN."""

    def __init__(self, model, weights: RoundedWeights, max_context: int):
        super().__init__(model, weights, max_context)
        self.routes: dict = {}          # (position, layer) -> the experts taken, every row run so far
        self.margins: dict = {}         # (position, layer) -> the k-th minus the (k+1)-th router logit
        self.parted: list = []          # (position, layer, gap, ours, followed) wherever `follow` differed
        self._pos0 = 0
        self.configure(NONE)

    def configure(self, roundings: Roundings, follow: dict | None = None, tie: float = ROUTE_TIE) -> None:
        self.roundings, self.follow, self.tie = roundings, follow or {}, tie
        self.w.gemm = roundings.gemm

    def forward(self, tokens, pos0, kv, all_logits):
        self._pos0 = pos0
        return super().forward(tokens, pos0, kv, all_logits)

    def attention(self, il, x, pos0, kv):
        # base.attention reads x only as the q/k/v GEMMs' input
        return super().attention(il, half(x) if self.roundings.gemm else x, pos0, kv)

    def attend(self, il, q, k, v, pos0, kv):
        r = self.roundings
        if r.kv:
            k, v = half(k), half(v)
        out = self._flash(il, q, k, v, pos0, kv) if r.flash else super().attend(il, q, k, v, pos0, kv)
        return half(out) if r.gemm else out           # attend's output is only wo's input

    def _flash(self, il, q, k, v, pos0, kv):
        """base.attend with prefill_attn.cu's roundings: q * scale * log2 e in fp16, exp2 weights P in fp16 for P V,
        their sum in fp32."""
        T, H, Hkv, D = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
        S = pos0 + T
        kv.k[il][:, pos0:S] = k.transpose(1, 0, 2)
        kv.v[il][:, pos0:S] = v.transpose(1, 0, 2)
        K, V = kv.k[il][:, :S], kv.v[il][:, :S]
        G = H // Hkv
        qg = half(q * (np.float32(self.attn_scale) * LOG2E)).reshape(T, Hkv, G, D).transpose(1, 2, 0, 3)
        s = (qg.reshape(Hkv, G * T, D) @ K.transpose(0, 2, 1)).reshape(Hkv, G, T, S)
        if T > 1:
            s[:, :, np.arange(S)[None, :] > (pos0 + np.arange(T))[:, None]] = -np.inf
        p = np.exp2(s - s.max(axis=-1, keepdims=True))
        o = (half(p).reshape(Hkv, G * T, S) @ V).reshape(Hkv, G, T, -1) / p.sum(axis=-1, keepdims=True)
        return o.transpose(2, 0, 1, 3).reshape(T, -1)

    def ffn(self, il, x, decoding):
        cfg, w, b = self.cfg, self.w, f"blk.{il}."
        if not cfg.is_moe or not cfg.is_moe_layer(il):
            return super().ffn(il, x, decoding)        # dense: fp32 in the pass too (Prefill.ffn)
        logits = x @ w.get(b + "ffn_gate_inp.weight").T
        ids, wts = base.route(logits, cfg.n_expert_used, cfg.expert_weights_norm, cfg.expert_weights_scale)
        self._follow(il, logits, ids, wts)
        xe = half(x) if self.roundings.gemm else x
        out = np.zeros_like(x)
        for e in np.unique(ids):
            rows, slot = np.nonzero(ids == e)
            gate, up, down = w.expert(il, int(e), decoding)
            h = base.silu(xe[rows] @ gate.T) * (xe[rows] @ up.T)
            out[rows] += wts[rows, slot][:, None] * ((half(h) if self.roundings.gemm else h) @ down.T)
        if cfg.shared_expert:                           # qwen2moe's, fp32 in the pass (Prefill.ffn / linear)
            shared = base.dense_ffn(w, b, x, "_shexp")
            if cfg.shared_expert_gate:
                shared = shared / (1.0 + np.exp(-(x @ w.get(b + "ffn_gate_inp_shexp.weight").T)))
            out = out + shared
        return out

    def _follow(self, il, logits, ids, wts):
        """Records the rows' routes and gaps; rows under the tie take `follow`'s experts (ids, wts in place)."""
        cfg, k = self.cfg, self.cfg.n_expert_used
        s = np.sort(logits, axis=-1)
        gaps = s[:, -k] - s[:, -k - 1]
        probs = base.softmax(logits.astype(np.float32))
        for t in range(len(ids)):
            key = (self._pos0 + t, il)
            self.margins[key] = float(gaps[t])
            want = self.follow.get(key)
            if want is not None and want != frozenset(ids[t].tolist()):
                self.parted.append((*key, float(gaps[t]), sorted(ids[t].tolist()), sorted(want)))
                if gaps[t] < self.tie:
                    ids[t] = sorted(want, key=lambda e: -probs[t, e])
                    p = probs[t, ids[t]]
                    wts[t] = (p / p.sum() if cfg.expert_weights_norm else p) * np.float32(cfg.expert_weights_scale)
            self.routes[key] = frozenset(int(e) for e in ids[t])


FAMILIES = (dense.Dense, qwen3moe.Qwen3MoE, qwen2moe.Qwen2MoE)
_CLASSES = {f: type(f"Rounded{f.__name__}", (_Rounded, f), {}) for f in FAMILIES}


class RoundedModel:
    """The NumPy backend's forward with a choice of the CUDA backend's roundings per call, over one K/V cache (a
    decode after a prompt pass reads the pass's fp16 K/V, as on the GPU), in prompt chunks of `chunk` tokens."""

    def __init__(self, model, ctx: int, chunk: int = 64):
        f = family(model.config.arch, model.config.is_moe)
        if f is None or f.MODEL not in _CLASSES:
            raise ValueError(f"the rounding model covers the CUDA moe family's archs (llama, qwen2, qwen3, "
                             f"qwen2moe, qwen3moe), not {model.config.arch}")
        self.net = _CLASSES[f.MODEL](model, RoundedWeights(model), ctx)
        self.kv = self.net.new_cache(ctx)
        self.chunk, self.n = chunk, 0

    @property
    def routes(self) -> dict:
        """{(position, layer): the experts taken}, every row run so far."""
        return self.net.routes

    @property
    def parted(self) -> list:
        return self.net.parted

    def forward(self, tokens, all_logits: bool = False, roundings: Roundings = NONE, follow=None,
                tie: float = ROUTE_TIE) -> np.ndarray:
        self.net.configure(roundings, follow, tie)
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        outs = []
        for s in range(0, len(tokens), self.chunk):
            part = tokens[s:s + self.chunk]
            outs.append(self.net.forward(part, self.n, self.kv, all_logits))
            self.n += len(part)
        return np.concatenate(outs, axis=0) if all_logits else outs[-1]

    def truncate(self, n: int) -> None:
        self.n = n


def rel_rows(a, b) -> np.ndarray:
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def distances(model, tokens, ctx: int = 512, chunk: int = 64, tie: float = ROUTE_TIE) -> dict:
    """The model's distances from the CPU backend on `tokens` (teacher-forced, every row): `pass` / `decode` the
    largest relative row distance from the CPU backend's own logits; `pass_routed` / `decode_routed` from the CPU
    backend following the model's routes at its near-ties (tests/route_ties.py's measure); `clear_parts`: routes the
    model took against a gap of `tie` or more (none expected: the roundings part only near-ties)."""
    rm = RoundedModel(model, ctx, chunk)
    cpu = CPUBackend(model, ctx, chunk=chunk)
    try:
        want = cpu.forward(tokens, all_logits=True)
    finally:
        cpu.close()
    passed = rm.forward(tokens, all_logits=True, roundings=PASS)
    pass_routes = dict(rm.routes)
    rm.truncate(0)
    stepped = np.stack([rm.forward([t], roundings=DECODE) for t in tokens])
    decode_routes = dict(rm.routes)
    out = {"pass": float(rel_rows(passed, want).max()), "decode": float(rel_rows(stepped, want).max())}
    clear = []
    for name, got, routes in (("pass_routed", passed, pass_routes), ("decode_routed", stepped, decode_routes)):
        ref = RoundedModel(model, ctx, chunk)
        ref_logits = ref.forward(tokens, all_logits=True, follow=routes, tie=tie)
        out[name] = float(rel_rows(got, ref_logits).max())
        clear += [p for p in ref.parted if p[2] >= tie]
    out["clear_parts"] = clear
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.cuda_roundings",
                                 description="How far a bug-free CUDA backend sits from the CPU backend on a file: "
                                             "the CUDA roundings modelled in NumPy (see the module docstring).")
    ap.add_argument("--model", required=True, metavar="FILE",
                    help="a GGUF file of the CUDA moe family (llama, qwen2, qwen3, qwen2moe, qwen3moe)")
    ap.add_argument("--tokens", type=int, default=40, help="prompt length (random token ids, seed 5; default 40)")
    ap.add_argument("--chunk", type=int, default=64, help="the prompt pass's chunk (default 64)")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.chunk < 1:
        ap.error("--tokens and --chunk must be at least 1")
    try:
        model = open_model(args.model)
        prompt = np.random.default_rng(5).integers(3, min(model.config.n_vocab, 1000), args.tokens).tolist()
        d = distances(model, prompt, ctx=args.tokens, chunk=args.chunk)
    except (ModelError, ValueError) as e:
        print(f"cuda_roundings: {e}", file=sys.stderr)
        return 2
    print(f"{args.model}: prompt pass {d['pass']:.4f} (routed {d['pass_routed']:.4f})  decode {d['decode']:.4f} "
          f"(routed {d['decode_routed']:.4f})  routes against a clear gap: {len(d['clear_parts'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
