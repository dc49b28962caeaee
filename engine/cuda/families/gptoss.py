"""The gptoss family (gpt-oss; engine/arch/gptoss.py is the reference): the moe family's layer with

- attention: the output projection's bias, a sink logit per q head, and on window layers a window of n_swa positions
  whose K/V is a ring of window + prompt chunk rows (kv.py ring_rows; the chunk's own K/V is written before its
  queries read the window behind them). The sinks and the window are compile-time variants of both attention
  kernels (attn_gqa_rope_oss_*, flash_attn_oss_*), so other families run the code they ran before;
- the router's bias, added before the same top-k (a softmax over the chosen k is the renormalized top-k), in the
  decode prefetch's predictions too (its _bias kernels);
- every expert's gate/up/down biases in VRAM indexed by expert id, so the kernels find them wherever the weights sit
  (cache slot, arena, ring); the clamped SwiGLU_OAI of cuda_src/moe_oss.cu (decode) and the OAI/BIAS variants of the
  grouped GEMMs (prompt). Gate and up must share a quant type.
FFN norm: post_attention_norm (llama.cpp's name).
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy as cp

from engine.cuda.decode_window import DOWN_STAGE_MAX, MXFP4, SERIAL_FILES, WindowStep
from engine.cuda.families.moe import ExpertGemms, MoeDecode, MoeFamily, MoeLayer, MoePrompt, attention_fields, \
    load_ffn
from engine.cuda.kv import AttnVariant, KVCache, ring_rows
from engine.cuda.launch import F32, I32, I64, MV_WARPS, U64, ptr, staged_bytes
from engine.cuda.prefill import attn_kernel

MiB = 1 << 20


@dataclass(kw_only=True)
class OssLayer(MoeLayer):
    """MoeLayer and gpt-oss's own: bo (attn_output.bias), sinks (one logit per q head), router_bias, and exp_bias:
    every expert's gate/up/down biases ((n_expert, n_ff), (n_expert, n_ff), (n_expert, n_embd), flat)."""
    bo: cp.ndarray
    sinks: cp.ndarray
    router_bias: cp.ndarray
    exp_bias: tuple


def window(cfg, li: int) -> int:
    """Layer li's attention window for the kernels (0: it attends to every position)."""
    return cfg.n_swa if cfg.is_swa(li) else 0


def attn_variant(cfg, sinks) -> AttnVariant:
    """The decode attention with sinks and windows (kv.DecodeAttention): per layer its sink logits (an n_head fp32
    array) and window; always the fused launch (the rings take K/V there)."""
    return AttnVariant("_oss", True, lambda li: (ptr(sinks[li]), I32(window(cfg, li))))


class GptOssFamily(MoeFamily):
    name = "gptoss"
    archs = ("gpt-oss",)
    kernel_files = ("moe_oss.cu",)
    ffn_norm = "post_attention_norm.weight"
    # On the H200 the step after a discarded run-ahead came out 4e-4 (relative) from the unpipelined backend's (the
    # window ring's rows): not run ahead until tests/test_cuda_pipeline.py passes for it.
    run_ahead = False

    def load_layer(self, up, i: int) -> OssLayer:
        b = f"blk.{i}."
        L = OssLayer(**attention_fields(up, b, self.ffn_norm), bo=up.f32(b + "attn_output.bias"),
                     sinks=up.f32(b + "attn_sinks.weight"), router_bias=up.f32(b + "ffn_gate_inp.bias"),
                     exp_bias=tuple(up.f32(b + f"ffn_{k}_exps.bias") for k in ("gate", "up", "down")))
        load_ffn(up, L, b, self.cfg)
        return L

    def check_experts(self, layout) -> None:
        if any(ly.qt_up >= 0 for ly in layout.layers):
            raise ValueError("this gpt-oss file has gate and up experts in different quant types, which the "
                             "CUDA gpt-oss expert kernels do not take; use --backend cpu or requantize")

    def kv_cache(self, max_ctx: int, dtype: str, chunk: int, log) -> KVCache:
        """Window layers keep a KV ring of the window plus the target prompt chunk (kv.py ring_rows), not the whole
        context."""
        cfg = self.cfg
        if not (cfg.n_swa and any(cfg.swa_layers)):
            return KVCache(cfg, max_ctx, dtype)
        rows = ring_rows(cfg, max_ctx, chunk)
        full = KVCache.nbytes(cfg, max_ctx, dtype)
        saved = full - KVCache.nbytes(cfg, max_ctx, dtype, rows)
        log(f"KV cache: {sum(cfg.swa_layers)} window layers keep {min(rows)} of {max_ctx} rows "
            f"({saved / MiB:.1f} of {full / MiB:.1f} MiB saved for expert slots)")
        return KVCache(cfg, max_ctx, dtype, rows)

    def prompt_attention(self, mod, int8: bool):
        return attn_kernel(mod, int8, oss=True)

    def decode_layers(self, step, recurrent=None) -> "GptOssDecode":
        return GptOssDecode(step)

    def window_program(self):
        return GptOssDecode, OssWindowStep

    def prompt_layers(self, prefill, recurrent=None) -> "GptOssPrompt":
        return GptOssPrompt(prefill)


class GptOssDecode(MoeDecode):
    biased_router = True

    def __init__(self, step):
        super().__init__(step, attn_variant(step.cfg, [L.sinks for L in step.weights.layers]))

    def mixer(self, li):
        layer = self.step.weights.layers[li]
        self.attention(li, layer, out_bias=layer.bo)

    def router_extra(self, li) -> tuple:
        return (ptr(self.step.weights.layers[li].router_bias),)

    def experts(self, li, layer):
        """The routed experts (moe_oss.cu): gate/up with their biases and SWIGLU_OAI, then down with its bias,
        weighted, added to x. No shared expert."""
        st, c, mv = self.step, self.cfg, self.step.launcher
        x = st.x
        blob, table, grid = self.expert_launch(li)
        top_k = c.n_expert_used
        bg, bu, bd = layer.exp_bias
        f = st.kernel("moe_gate_up_oai", blob.qt_gate_up, "moe_gate_up")
        f(grid, (32 * MV_WARPS,),
          (table, ptr(st.ids), I64(blob.up_off), I64(blob.rb_gate_up), ptr(x), ptr(layer.ffn_norm), F32(c.rms_eps),
           ptr(self.h), I32(blob.n_ff), I32(c.n_embd), I32(top_k), ptr(bg), ptr(bu)),
          shared_mem=mv.smem(f, c.n_embd, True))
        f = st.kernel("moe_down_bias", blob.qt_down, "moe_down")
        sm = mv.smem(f, top_k * blob.n_ff, False, optional_max=100 * 1024)
        f(((c.n_embd + MV_WARPS - 1) // MV_WARPS, 1), (32 * MV_WARPS,),
          (table, ptr(st.ids), ptr(st.wts), I64(blob.down_off), I64(blob.rb_down), ptr(self.h), ptr(x),
           I32(c.n_embd), I32(blob.n_ff), I32(top_k), I32(1 if sm else 0), ptr(bd)),
          shared_mem=sm)


class GptOssPrompt(MoePrompt):
    biased_router = True

    def mixer(self, li, layer, x, xn, T, pos0):
        self.attention(li, layer, x, xn, T, pos0, extra=(ptr(layer.sinks), I32(window(self.cfg, li))),
                       out_bias=layer.bo)

    def router_logits(self, li, layer, xn, T):
        """Then the softmax over the chosen k (the renormalized top k)."""
        logits = super().router_logits(li, layer, xn, T)
        logits += layer.router_bias
        return logits

    def expert_gemms(self, li, layer, blob) -> ExpertGemms:
        """Biases and SWIGLU_OAI (moe_gemm.cu OAI / BIAS)."""
        mod = self.p.moe_mod
        return ExpertGemms(mod.get_function(f"moe_gemm_gate_up_oai<{blob.qt_gate_up}>"), (I64(blob.rb_gate_up),),
                           mod.get_function(f"moe_gemm_down_bias<{blob.qt_down}>"),
                           tuple(ptr(b) for b in layer.exp_bias[:2]), (ptr(layer.exp_bias[2]),))


class OssWindowStep(WindowStep):
    """gpt-oss's window program (families/gptoss.py GptOssDecode): attention with its sinks and window (the one-token
    step's DecodeAttention variant, each token's K/V into the ring rows at its position) and the output bias; the
    router's bias; the experts' biases and SWIGLU_OAI (cuda_src/window_oss.cu). No shared expert."""
    biased_router = True
    serial_files = SERIAL_FILES + ("window_oss.cu",)


    def out_bias(self, layer):
        return layer.bo

    def logit_bias(self, layer):
        return layer.router_bias

    def experts(self, li, layer, T):
        """GptOssDecode.experts for the window, in WindowStep.experts' modes (tokens / union / serial)."""
        st, c, mv = self.step, self.cfg, self.step.launcher
        blob, cache = st.layout.layer(li), st.cache
        table = U64(cache.table.data.ptr + 8 * li * c.n_expert)
        k = c.n_expert_used
        bg, bu, bd = layer.exp_bias
        mode = self.expert_mode
        if mode not in ("tokens", "union", "serial"):
            raise ValueError(f"expert_mode is tokens, union or serial, not {mode!r}")
        rows = (blob.n_ff + MV_WARPS - 1) // MV_WARPS
        rest = (I64(blob.up_off), I64(blob.rb_gate_up), ptr(self.x), ptr(layer.ffn_norm), F32(c.rms_eps),
                ptr(self.h), I32(blob.n_ff), I32(c.n_embd), I32(k), ptr(bg), ptr(bu))
        if mode == "tokens":                # GptOssDecode.experts with the T tokens in the grid
            f = self.kernels("moe_gate_up_oai", blob.qt_gate_up)
            f((rows, k, T), (32 * MV_WARPS,), (table, ptr(self.ids), *rest), shared_mem=mv.smem(f, c.n_embd, True))
        else:                               # each expert of the window's union read once for its tokens
            f = self.serial("moe_gate_up_oai_win", blob.qt_gate_up)
            f((rows, min(T * k, c.n_expert)), (32 * MV_WARPS,), (table, ptr(self.uni), *rest),
              shared_mem=self._smem(f, T * staged_bytes(c.n_embd)))
        if mode != "serial":
            f = self.kernels("moe_down_bias", blob.qt_down)
            sm = mv.smem(f, k * blob.n_ff, False, optional_max=DOWN_STAGE_MAX)
            f(((c.n_embd + MV_WARPS - 1) // MV_WARPS, T), (32 * MV_WARPS,),
              (table, ptr(self.ids), ptr(self.wts), I64(blob.down_off), I64(blob.rb_down), ptr(self.h), ptr(self.x),
               I32(c.n_embd), I32(blob.n_ff), I32(k), I32(1 if sm else 0), ptr(bd)),
              shared_mem=sm)
            return
        f = self.serial("moe_down_bias_win", blob.qt_down)
        stage = staged_bytes(k * blob.n_ff) <= DOWN_STAGE_MAX
        per = blob.n_ff // 32 if blob.qt_down == MXFP4 else 32      # MXFP4: (expert, block) pairs
        f(((c.n_embd + MV_WARPS - 1) // MV_WARPS,), (32 * MV_WARPS,),
          (table, ptr(self.uni), ptr(self.ids), ptr(self.wts), I64(blob.down_off), I64(blob.rb_down), ptr(self.h),
           ptr(self.x), I32(c.n_embd), I32(blob.n_ff), I32(k), I32(T), I32(1 if stage else 0), ptr(bd)),
          shared_mem=self._smem(f, MV_WARPS * T * k * per * 4))
