"""The moe family: qwen2moe, qwen3moe and llama files with experts (mixtral), and as its dense-FFN case llama, qwen2
and qwen3 (every layer a SwiGLU FFN: the case a family with leading dense layers needs anyway). A layer is attention
(optional q/k norms, q/k/v biases), then a dense FFN or routed experts with an optional (gated) shared expert.

Its decode layer (MoeDecode) and prompt layer (MoePrompt) are also the building blocks the other families compose:
the attention block, the router, the routed experts through the cache's pointer table, the shared expert. A family
that differs overrides the phase that differs (hybrid: the mixer; gptoss: attention, router and experts).
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy as cp
import numpy as np

from engine.cuda.kv import PLAIN, DecodeAttention, KVCache
from engine.cuda.launch import (F32, I32, I64, MOE_DOWN_TILE_ROWS, MV_WARPS, NULL, SMEM_DEFAULT, U64,
                               moe_down_tiled_bytes, moe_down_tiled_fits, ptr)
from engine.cuda.prefill import attn_kernel
from engine.cuda.quant_types import qtype
from engine.cuda.rope import rope_table
from engine.cuda.weights import DevMatrix, load_weights


# --- weights ----------------------------------------------------------------------------------------------------

@dataclass
class MoeLayer:
    attn_norm: cp.ndarray
    wq: DevMatrix | None
    wk: DevMatrix | None
    wv: DevMatrix | None
    wo: DevMatrix | None
    ffn_norm: cp.ndarray
    q_norm: cp.ndarray | None = None
    k_norm: cp.ndarray | None = None
    bq: cp.ndarray | None = None
    bk: cp.ndarray | None = None
    bv: cp.ndarray | None = None
    # dense FFN (no experts)
    w_gate: DevMatrix | None = None
    w_up: DevMatrix | None = None
    w_down: DevMatrix | None = None
    # MoE
    router: DevMatrix | None = None
    sh_gate: DevMatrix | None = None
    sh_up: DevMatrix | None = None
    sh_down: DevMatrix | None = None
    sh_gate_inp: DevMatrix | None = None

    def matrices(self) -> list[DevMatrix]:
        """Every quantized matrix of the layer (the kernel table is built for their types)."""
        return [v for v in vars(self).values() if isinstance(v, DevMatrix)]


def attention_fields(up, b: str, ffn_norm: str) -> dict:
    """A plain attention layer's fields, uploaded in this order: the norms, Q/K/V/O, q/k norms and q/k/v biases."""
    return dict(attn_norm=up.f32(b + "attn_norm.weight"), wq=up.mat(b + "attn_q.weight"),
                wk=up.mat(b + "attn_k.weight"), wv=up.mat(b + "attn_v.weight"), wo=up.mat(b + "attn_output.weight"),
                ffn_norm=up.f32(b + ffn_norm), q_norm=up.opt_f32(b + "attn_q_norm.weight"),
                k_norm=up.opt_f32(b + "attn_k_norm.weight"), bq=up.opt_f32(b + "attn_q.bias"),
                bk=up.opt_f32(b + "attn_k.bias"), bv=up.opt_f32(b + "attn_v.bias"))


def load_ffn(up, L, b: str, cfg) -> None:
    """The layer's FFN into L: the router and shared expert of an MoE model, else the dense gate/up/down."""
    if cfg.is_moe:
        L.router = up.mat(b + "ffn_gate_inp.weight")
        if cfg.shared_expert:
            L.sh_gate, L.sh_up, L.sh_down = (up.mat(b + f"ffn_{k}_shexp.weight") for k in ("gate", "up", "down"))
        if cfg.shared_expert_gate:
            L.sh_gate_inp = up.mat(b + "ffn_gate_inp_shexp.weight")
    else:
        L.w_gate, L.w_up, L.w_down = (up.mat(b + f"ffn_{k}.weight") for k in ("gate", "up", "down"))


# --- the family -------------------------------------------------------------------------------------------------

class MoeFamily:
    """What the shared engine asks a family (engine/cuda/families/__init__.py lists the questions)."""
    name = "moe"
    archs: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")
    kernel_files: tuple[str, ...] = ()      # engine kernel files beyond kernels.ENGINE_FILES
    ffn_norm = "ffn_norm.weight"            # llama.cpp's name of the FFN norm
    # Decode steps may run one ahead of the pick's read (engine/cuda/pipeline.py): held to the unpipelined run on
    # the H200 (tests/test_cuda_pipeline.py) for this family only; a family that has not passed there says False.
    run_ahead = True
    # A decode layer hands the next one only the residual x (and the step state): a pipeline stage may end after any
    # layer (engine/cuda/staged_decode.py copies those two). A family carrying more across layers says False.
    stage_split = True

    def __init__(self, cfg):
        self.cfg = cfg

    def load_layer(self, up, i: int) -> MoeLayer:
        b = f"blk.{i}."
        L = MoeLayer(**attention_fields(up, b, self.ffn_norm))
        load_ffn(up, L, b, self.cfg)
        return L

    def load_weights(self, model, up=None):
        return load_weights(model, self.load_layer, up)

    def check_experts(self, layout) -> None:
        """Refuses an expert layout the family's kernels do not take (ValueError naming the fix)."""

    def kv_cache(self, max_ctx: int, dtype: str, chunk: int, log) -> KVCache:
        """chunk: the prompt chunk the cache must take at once (a window ring's spare rows)."""
        return KVCache(self.cfg, max_ctx, dtype)

    def rope_table(self, n_pos: int) -> np.ndarray:
        return rope_table(self.cfg, n_pos)

    def recurrent_state(self, stream):
        """The state carried between tokens besides K/V (snapshot / restore / zero / nbytes), or None."""
        return None

    def prompt_buffers(self, T: int) -> list:
        """The prompt pass's buffers for a chunk of T tokens beyond chunk_plan's own (chunk_plan.Buffer)."""
        return []

    def prompt_attention(self, mod, int8: bool):
        """The prompt pass's flash attention kernel of prefill_attn build `mod` (prefill.attn_kernel)."""
        return attn_kernel(mod, int8)

    def decode_layers(self, step, recurrent=None) -> "MoeDecode":
        return MoeDecode(step)

    def window_program(self):
        """(the decode layer class, the window step class of engine/cuda/decode_window.py standing for it), or None
        where a verify window runs one step a token (decode_window.why_not checks the step's layers are that class)."""
        from engine.cuda.decode_window import WindowStep
        return MoeDecode, WindowStep

    def prompt_layers(self, prefill, recurrent=None) -> "MoePrompt":
        return MoePrompt(prefill)

    def request_info(self) -> dict:
        """The family's own counters for the INFO line before DONE, since reset_stats() (Backend.request_info)."""
        return {}

    def reset_stats(self) -> None:
        pass

    def info(self) -> dict:
        """The family's own facts for the INFO lines (Backend.info)."""
        return {}

    def close(self) -> None:
        """What the family holds beyond the backend's buffers (files it reads)."""


# --- the decode layer -------------------------------------------------------------------------------------------

class MoeDecode:
    """The decode step's layer program (engine/cuda/decode.py runs it): embed, per layer mixer / router / ffn, output.
    It reads and writes the step's shared buffers (x the residual, ids / wts the routing, logits) and owns the rest.
    The router may be launched by the prefetch instead (router_args, router_extra, biased_router say how)."""
    biased_router = False       # router_fused_bias and the prefetch's _bias kernels (gpt-oss)

    def __init__(self, step, attn_variant=PLAIN):
        self.step, self.cfg = step, step.cfg
        c = self.cfg
        f32 = lambda n: cp.zeros(n, dtype=cp.float32)      # noqa: E731
        with step.stream:
            self.q = f32(c.n_head * c.head_dim)
            self.k_new = f32(c.n_head_kv * c.head_dim)      # this token's K and V rows
            self.v_new = f32(c.n_head_kv * c.head_dim)
            self.att = f32(c.n_head * c.head_dim)
            self.attn = DecodeAttention(step.kernels, c, step.kv, variant=attn_variant)   # K/V layout from kv.dtype
            top_k = max(c.n_expert_used, 1)
            self.h = f32(max(c.n_ff, top_k * c.n_ff_exp, 8))
            self.h2 = f32(max(c.n_ff_shexp, 8))
            self.sgate = f32(1)

    def set_inputs(self, token: int, pos: int) -> None:
        """The host's part of a step's inputs, before its launch (DecodeStep.set_inputs): none here."""

    # The RMSNorms have no launches: each kernel that reads a normed vector stages rmsnorm(x) * w per block (the
    # consumer recomputes sum(x^2); no inter-block sync), measured faster than the producer writing the next norm.
    def embed(self):
        st, te = self.step, self.step.weights.tok_embd
        st.kernel("embed", te.qt)((1,), (256,), (U64(te.ptr), I64(te.row_bytes), NULL, st.params.dptr,
                                               ptr(st.state), ptr(st.x), I32(self.cfg.n_embd)))

    def mixer(self, li):
        """The layer's attention half (everything before its router), added to the residual x."""
        self.attention(li, self.step.weights.layers[li])

    def attention(self, li, layer, out_bias=None):
        """Attention norm, Q/K/V, RoPE + KV store, attention, and wo (+ out_bias) added to the residual x."""
        st, c, mv = self.step, self.cfg, self.step.launcher
        scale = F32(c.attn_scale or 1.0 / np.sqrt(c.head_dim))
        mv.mv3((layer.wq, layer.wk, layer.wv), st.x, (self.q, self.k_new, self.v_new), (layer.bq, layer.bk, layer.bv),
               norm=layer.attn_norm)
        self.attn.step(st.kernel, li, self.q, self.k_new, self.v_new, layer.q_norm, layer.k_norm, st.rope,
                       self.att, st.state, scale)
        mv.mv(layer.wo, self.att, st.x, bias=out_bias, accumulate=True, tag="wo")

    def router_args(self, li):
        """router_fused's arguments for layer li (router_predict takes them too, then its prediction's): the router
        rows, the FFN-normed input, the routing out, the cache's table, counts and stats."""
        st, c, cache = self.step, self.cfg, self.step.cache
        layer = st.weights.layers[li]
        R = layer.router
        rows = (U64(R.ptr), I64(R.row_bytes))
        normed_x = (ptr(st.x), ptr(layer.ffn_norm), F32(c.rms_eps), I32(R.cols))
        # gpt-oss weights the top k by a softmax over their logits alone: the renormalized top-k softmax, the same
        renorm = c.expert_weights_norm or self.biased_router
        routing = (ptr(st.rlogits), I32(c.n_expert), I32(c.n_expert_used), I32(1 if renorm else 0),
                   F32(c.expert_weights_scale), ptr(st.ids), ptr(st.wts))
        table = (U64(cache.table.data.ptr + 8 * li * c.n_expert), U64(cache.slot_lo), U64(cache.slot_hi),
                 U64(cache.counts.data.ptr + 4 * li * c.n_expert), ptr(cache.stats))
        return (*rows, *normed_x, *routing, *table)

    def router_extra(self, li) -> tuple:
        """What the biased router kernels take after their plain arguments (gpt-oss: layer li's router bias)."""
        return ()

    def router(self, li):
        """For MoE layers the router (on the FFN-normed x, the norm fused): afterwards the step's ids / wts hold
        layer li's routing. Dense layers: nothing (their FFN kernels apply the norm)."""
        if not self.cfg.is_moe:
            return
        st = self.step
        R = st.weights.layers[li].router
        f = st.kernel("router_fused_bias" if self.biased_router else "router_fused", R.qt, "router")
        f(((R.rows + MV_WARPS - 1) // MV_WARPS,), (32 * MV_WARPS,),
          (*self.router_args(li), ptr(st.counter), *self.router_extra(li)),
          shared_mem=st.launcher.smem(f, R.cols, True))

    def ffn(self, li):
        """The layer's FFN half, added to x: the routed experts and the shared expert, or the dense FFN."""
        layer = self.step.weights.layers[li]
        if not self.cfg.is_moe:
            mv = self.step.launcher
            mv.swiglu(layer.w_gate, layer.w_up, self.step.x, self.h, norm=layer.ffn_norm)
            mv.mv(layer.w_down, self.h, self.step.x, accumulate=True)
            return
        self.experts(li, layer)

    def expert_launch(self, li):
        """Layer li's blob layout (its quant types and offsets: a graph node each), table row and gate/up grid."""
        blob, cache, c = self.step.layout.layer(li), self.step.cache, self.cfg
        table = U64(cache.table.data.ptr + 8 * li * c.n_expert)
        return blob, table, ((blob.n_ff + MV_WARPS - 1) // MV_WARPS, c.n_expert_used, 1)

    def experts(self, li, layer, out=None):
        """The routed experts of the FFN-normed x (gate/up then down, weighted) and the shared expert, added to out:
        the residual x itself, unless a family whose residual is not x gives its own."""
        st, c, mv = self.step, self.cfg, self.step.launcher
        norm, x = layer.ffn_norm, st.x
        out = x if out is None else out
        blob, table, grid = self.expert_launch(li)
        top_k = c.n_expert_used
        if blob.qt_up < 0:
            f = st.kernel("moe_gate_up", blob.qt_gate_up)
            f(grid, (32 * MV_WARPS,),
              (table, ptr(st.ids), I64(blob.up_off), I64(blob.rb_gate_up), ptr(x), ptr(norm), F32(c.rms_eps),
               ptr(self.h), I32(blob.n_ff), I32(c.n_embd), I32(top_k)),
              shared_mem=mv.smem(f, c.n_embd, True))
        else:           # gate and up in different types: one launch each (moe.cu moe_proj)
            for qt, off, rb, mul in ((blob.qt_gate_up, 0, blob.rb_gate_up, 0),
                                     (blob.qt_up, blob.up_off, blob.rb_up, 1)):
                f = st.kernel("moe_proj", qt, "moe_gate_up")
                f(grid, (32 * MV_WARPS,),
                  (table, ptr(st.ids), I64(off), I64(rb), ptr(x), ptr(norm), F32(c.rms_eps), ptr(self.h),
                   I32(blob.n_ff), I32(c.n_embd), I32(top_k), I32(mul)),
                  shared_mem=mv.smem(f, c.n_embd, True))
        shared = layer.sh_up is not None
        if shared:      # the shared expert reads x before moe_down adds to it
            if layer.sh_gate_inp is not None:
                mv.mv(layer.sh_gate_inp, x, self.sgate, tag="shexp", norm=norm)
            mv.swiglu(layer.sh_gate, layer.sh_up, x, self.h2, norm=norm, tag="shexp")
        down_args = (table, ptr(st.ids), ptr(st.wts), I64(blob.down_off), I64(blob.rb_down), ptr(self.h), ptr(out),
                     I32(c.n_embd), I32(blob.n_ff), I32(top_k))
        if moe_down_tiled_fits(qtype(blob.qt_down).name, c.n_embd, blob.n_ff, top_k):
            # Q6_K rows are 2-byte aligned: moe_down_q6k copies 8 rows of each expert as 16-byte loads into shared
            # memory (bench.decode_kernels q3_down: Qwen3-30B-A3B's layer, 18.2 us with moe_down on the H200)
            f = st.kernel("moe_down_q6k", None, "moe_down")
            sm = moe_down_tiled_bytes(top_k, blob.n_ff, blob.rb_down)
            if sm > SMEM_DEFAULT and getattr(f, "max_dynamic_shared_size_bytes", 0) < sm:
                f.max_dynamic_shared_size_bytes = sm
            f((c.n_embd // MOE_DOWN_TILE_ROWS, 1), (256,), down_args, shared_mem=sm)
        else:
            f = st.kernel("moe_down", blob.qt_down)
            sm = mv.smem(f, top_k * blob.n_ff, False, optional_max=100 * 1024)   # e.g. 8 x 1536 (Qwen3-235B): 50 KiB
            f(((c.n_embd + MV_WARPS - 1) // MV_WARPS, 1), (32 * MV_WARPS,), (*down_args, I32(1 if sm else 0)),
              shared_mem=sm)
        if shared:
            mv.mv(layer.sh_down, self.h2, out, gate_logit=self.sgate if layer.sh_gate_inp is not None else None,
                  accumulate=True, tag="shexp")

    def output(self):
        """The output mat-vec (of the final-normed x, the norm fused) into the step's logits."""
        st = self.step
        st.launcher.output_logits(st.weights, st.x, st.logits)


# --- the prompt layer -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertGemms:
    """One layer's grouped expert GEMMs (cuda_src/moe_gemm.cu) and what each takes beyond the shared arguments."""
    gate_up: object
    gate_up_rows: tuple         # gate's row bytes (and up's when its type differs)
    down: object
    gate_up_extra: tuple = ()
    down_extra: tuple = ()


class MoePrompt:
    """The prompt pass's layer program (engine/cuda/prefill.py runs layer() per chunk): the attention half, then the
    FFN half, on the pass's buffers and through its building blocks (linear_f16, route, experts)."""
    biased_router = False

    def __init__(self, prefill):
        self.p, self.cfg = prefill, prefill.cfg

    def begin_chunk(self, tokens, pos0: int) -> None:
        """Before a chunk's first layer (Prefill.forward), with its token ids: nothing here."""

    def read_ahead(self, tokens) -> None:
        """After begin_chunk, when the chunk after this one is known (its token ids): nothing here (qwen4exp gathers
        its n-gram rows meanwhile)."""

    def host_facts(self) -> dict:
        """The last chunk's host-side facts for the prompt benches (Prefill.forward's facts): none here."""
        return {}

    def layer(self, li, layer, x, xn, T: int, pos0: int) -> None:
        """x (T, n_embd) through layer li for a chunk of T tokens at positions pos0...; xn: scratch of x's shape."""
        self.mixer(li, layer, x, xn, T, pos0)
        self.ffn(li, layer, x, xn, T)

    def mixer(self, li, layer, x, xn, T, pos0):
        self.attention(li, layer, x, xn, T, pos0)

    def attention(self, li, layer, x, xn, T, pos0, extra=(), gate=None, out_bias=None):
        """x += attention of rmsnorm(x) * attn_norm: Q/K/V GEMMs (+ biases), K/V into the cache, flash attention
        (extra: the attention kernel's arguments after the shared ones), gate(xh, att) on its output, wo (+ out_bias)."""
        p, c = self.p, self.cfg
        qw, kw = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        q, k, v = p._view("q", T, qw), p._view("k", T, kw), p._view("v", T, kw)
        att = p._view("att", T, qw)
        p.launcher.rmsnorm(x, layer.attn_norm, xn, rows=T)
        xh = p.to_half(xn, T, c.n_embd)
        p.linear_f16(layer.wq, xh, q)
        p.linear_f16(layer.wk, xh, k)
        p.linear_f16(layer.wv, xh, v)
        if layer.bq is not None:
            q += layer.bq
            k += layer.bk
            v += layer.bv
        p._mark("dense")
        # q/k norms, RoPE, and K/V into the cache in whatever layout kv.py allocated (--kv f16|int8)
        p.kv.store(p.kernels, c, li, q, k, v, layer.q_norm, layer.k_norm, p.step.rope, None, pos0, T)
        if p.kv.dtype == "int8":
            kq, ks, vq, vs = p.kv.layer_i8(li)
            kv_args = (U64(kq), U64(vq), U64(ks), U64(vs))
        else:
            kv_args = tuple(U64(a) for a in p.kv.layer(li))
        scale = F32(c.attn_scale or 1.0 / np.sqrt(c.head_dim))
        p.attend(T, c.n_head, c.n_head_kv, (q, *kv_args, att, I32(T), I32(pos0), I32(c.n_head), I32(c.n_head_kv),
                                            I32(c.head_dim), I32(p.kv.rows[li]), scale, *extra))
        if gate is not None:
            gate(xh, att)
        p._mark("attention")
        p.linear_f16(layer.wo, p.to_half(att, T, qw), x, accumulate=True)      # x += att @ wo^T
        if out_bias is not None:
            x += out_bias
        p._mark("dense")

    def ffn(self, li, layer, x, xn, T):
        """x += the FFN of rmsnorm(x) * ffn_norm: the routed experts and the shared expert, or the dense FFN."""
        p, c = self.p, self.cfg
        p.launcher.rmsnorm(x, layer.ffn_norm, xn, rows=T)
        p._mark("other")
        if not c.is_moe:
            x += p.ffn(layer.w_gate, layer.w_up, layer.w_down, xn)
            p._mark("dense")
            return
        logits = self.router_logits(li, layer, xn, T)
        p.route(li, logits, T, c.expert_weights_norm or self.biased_router)
        p.experts(li, xn, x, T, self.expert_gemms(li, layer, p.layout.layer(li)))
        if layer.sh_up is not None:
            sh = p.ffn(layer.sh_gate, layer.sh_up, layer.sh_down, xn)
            if layer.sh_gate_inp is not None:
                sg = p.linear(layer.sh_gate_inp, xn)
                sh *= 1.0 / (1.0 + cp.exp(-sg))
            x += sh
            p._mark("dense")

    def router_logits(self, li, layer, xn, T):
        """(T, n_expert) router logits in fp32 (the pass's "router_logits" buffer)."""
        return self.p.linear_into(layer.router, xn, self.p._view("router_logits", T, self.cfg.n_expert))

    def expert_gemms(self, li, layer, blob) -> ExpertGemms:
        mod = self.p.moe_mod
        if blob.qt_up < 0:
            gu = mod.get_function(f"moe_gemm_gate_up<{blob.qt_gate_up}>")
            rows = (I64(blob.rb_gate_up),)
        else:           # gate and up in different types (a community quant's layer)
            gu = mod.get_function(f"moe_gemm_gate_up_mixed<{blob.qt_gate_up}, {blob.qt_up}>")
            rows = (I64(blob.rb_gate_up), I64(blob.rb_up))
        return ExpertGemms(gu, rows, mod.get_function(f"moe_gemm_down<{blob.qt_down}>"))

