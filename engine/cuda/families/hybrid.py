"""The hybrid family: qwen3next / qwen35moe (engine/arch/qwen3next.py is the reference), the moe family's layer with
its attention half a gated attention or a Gated DeltaNet layer. The expert path (router, cache, prefetch, ring,
memory modes) is the moe one unchanged, with post_attention_norm as the FFN norm and the shared expert's sigmoid
gate as qwen2moe's.

- Gated attention: attn_q gives each head [query | gate]; its rows are split on loading into the query rows (wq, so
  the Q/K/V mat-vecs, q/k norms, partial RoPE and attention are the plain path's) and the gate rows (attn_gate); the
  attention output is multiplied by sigmoid(gate) before attn_output (the prompt pass: cuda_src/attn_gate.cu; the
  decode step: in attn_output's launch, dense.cu mv_gated). qwen35moe's IMRoPE
  is its rotary table with the still pairs kept at position 0's angle.
- Gated DeltaNet: the projections (attn_qkv, attn_gate = z, beta, alpha) with the mat-vec / GEMM kernels, then
  engine/cuda/families/gdn.py's kernels (conv, delta rule, gated norm) on the state in VRAM, then ssm_out. In the
  decode step the four projections share one launch (Launcher.mv_many; one matrix in another quant type, as the
  Q4_K_M recipe's Q6_K attn_qkv, joins through mv_mixed.cu) and the conv runs in attn_qkv's epilogue, so a GDN
  layer's mixer is 3 launches (was 7); a gated attention layer's is 3 likewise (q/k/v/gate, attention, gated
  attn_output; was 5 to 7).
- The recurrent state (GdnState): every GDN layer's conv window and delta matrices in one VRAM buffer, updated in
  place; checkpoints copy it whole to pinned host memory (VRAM is what the expert cache needs; the copy is one
  transfer of tens of MiB per checkpoint, docs/experiments.md).
- The KV cache holds the attention layers only (HybridKV): a quarter of the layers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import cupy as cp
import numpy as np

from engine.arch.qwen3next import imrope_still
from engine.cuda import kernels as kernel_loader
from engine.cuda.chunk_plan import Buffer
from engine.cuda.families.gdn import GdnKernels, GdnShape, scratch_bytes
from engine.cuda.families.moe import MoeDecode, MoeFamily, MoeLayer, MoePrompt, load_ffn
from engine.cuda.kv import KVCache
from engine.cuda.launch import I64, load_mixed, mixed_pairs, ptr
from engine.cuda.rope import rope_table
from engine.cuda.weights import DevMatrix

GATE_BLOCK = 256


# --- weights ----------------------------------------------------------------------------------------------------

@dataclass
class GdnLayer:
    """One Gated DeltaNet layer's weights, as engine/cuda/families/gdn.py reads their projections. qkv, z: attn_qkv
    (conv channels: q of every key head, then k, then v) and attn_gate; beta, alpha: qwen35moe's ssm_beta and
    ssm_alpha, or qwen3next's whole ssm_ba as beta (grouped per key head, which the kernels read) and alpha None; conv
    (conv_dim, d_conv), dt_bias, a (= ssm_a, -exp(A_log)), norm (head width): float32; out: ssm_out."""
    qkv: DevMatrix
    z: DevMatrix
    beta: DevMatrix
    alpha: DevMatrix | None
    conv: cp.ndarray
    dt_bias: cp.ndarray
    a: cp.ndarray
    norm: cp.ndarray
    out: DevMatrix
    slot: int                   # its index in GdnState


@dataclass(kw_only=True)
class HybridLayer(MoeLayer):
    """A gated attention layer (wq the query rows of attn_q, attn_gate its gate rows) or a Gated DeltaNet layer (gdn
    set; wq, wk, wv, wo None), then the MoE FFN."""
    attn_gate: DevMatrix | None = None
    gdn: GdnLayer | None = None

    def matrices(self) -> list[DevMatrix]:
        mats = super().matrices()
        return mats if self.gdn is None else mats + [v for v in vars(self.gdn).values() if isinstance(v, DevMatrix)]


def attn_q_rows(cfg) -> tuple[np.ndarray, np.ndarray]:
    """attn_q's query rows and gate rows: each head's 2 * head_dim rows are [query | gate]."""
    H, D = cfg.n_head, cfg.head_dim
    head = np.arange(H)[:, None] * 2 * D
    return (head + np.arange(D)).reshape(-1), (head + D + np.arange(D)).reshape(-1)


def ssm_in_rows(cfg) -> tuple[np.ndarray, np.ndarray]:
    """Legacy qwen3next files' ssm_in (attn_qkv and attn_gate fused, grouped per key head: [q, k, v of its r value
    heads, z of them]): the rows of attn_qkv's order (all q, all k, all v) and of attn_gate's."""
    Hk, D, r = cfg.ssm_k_heads, cfg.ssm_state, cfg.ssm_v_heads // cfg.ssm_k_heads
    w = 2 * D + 2 * r * D
    base = np.arange(Hk)[:, None] * w
    q = (base + np.arange(D)).reshape(-1)
    k = (base + D + np.arange(D)).reshape(-1)
    v = (base + 2 * D + np.arange(r * D)).reshape(-1)
    z = (base + 2 * D + r * D + np.arange(r * D)).reshape(-1)
    return np.concatenate([q, k, v]), z


def hybrid_layer(up, cfg, il: int) -> HybridLayer:
    """Layer il of a hybrid without its FFN: gated attention (wq the query rows, attn_gate the gate rows) or GDN (gdn
    set); the FFN norm is post_attention_norm."""
    b = f"blk.{il}."
    L = HybridLayer(attn_norm=up.f32(b + "attn_norm.weight"), wq=None, wk=None, wv=None, wo=None,
                    ffn_norm=up.f32(b + "post_attention_norm.weight"))
    if not cfg.recurrent_layers[il]:
        q_rows, g_rows = attn_q_rows(cfg)
        L.wq, L.attn_gate = up.rows(b + "attn_q.weight", q_rows), up.rows(b + "attn_q.weight", g_rows)
        L.wk, L.wv, L.wo = (up.mat(b + n) for n in ("attn_k.weight", "attn_v.weight", "attn_output.weight"))
        L.q_norm, L.k_norm = up.f32(b + "attn_q_norm.weight"), up.f32(b + "attn_k_norm.weight")
        return L
    if up.has(b + "ssm_in.weight"):
        qkv_rows, z_rows = ssm_in_rows(cfg)
        qkv, z = up.rows(b + "ssm_in.weight", qkv_rows), up.rows(b + "ssm_in.weight", z_rows)
    else:
        qkv, z = up.mat(b + "attn_qkv.weight"), up.mat(b + "attn_gate.weight")
    if cfg.arch == "qwen3next":
        beta, alpha = up.mat(b + "ssm_ba.weight"), None
    else:
        beta, alpha = (up.mat(b + n) for n in ("ssm_beta.weight", "ssm_alpha.weight"))
    conv = up.f32(b + "ssm_conv1d.weight", (-1, cfg.ssm_conv))
    slot = sum(cfg.recurrent_layers[:il])
    L.gdn = GdnLayer(qkv=qkv, z=z, beta=beta, alpha=alpha, conv=conv, dt_bias=up.f32(b + "ssm_dt.bias"),
                     a=up.f32(b + "ssm_a"), norm=up.f32(b + "ssm_norm.weight"), out=up.mat(b + "ssm_out.weight"),
                     slot=slot)
    return L


# --- KV cache and RoPE ------------------------------------------------------------------------------------------

class HybridKV(KVCache):
    """The KV cache of the attention layers only: layer li's K/V are row attn_slot[li] of the cache's arrays."""

    def __init__(self, cfg, max_ctx: int, dtype: str = "f16"):
        attn = [i for i, r in enumerate(cfg.recurrent_layers) if not r]
        super().__init__(replace(cfg, n_layer=len(attn)), max_ctx, dtype)
        self.attn_slot = {li: s for s, li in enumerate(attn)}
        self.rows = [max_ctx] * cfg.n_layer     # indexed by the model's layer (store(), the prompt pass); no rings

    def layer(self, i: int):
        return super().layer(self.attn_slot[i])

    def layer_i8(self, i: int):
        return super().layer_i8(self.attn_slot[i])


def hybrid_rope_table(cfg, n_pos: int) -> np.ndarray:
    """rope.rope_table, with qwen35moe's IMRoPE still pairs at position 0's angle (as the reference's tables)."""
    table = rope_table(cfg, n_pos)
    still = imrope_still(cfg)
    if still is not None:
        table[:, still] = table[0, still]
    return table


# --- the recurrent state ----------------------------------------------------------------------------------------

class GdnState:
    """Every GDN layer's conv window (d_conv - 1, conv_dim) and delta matrices (n_v, S, S), float32, in one VRAM
    buffer (one copy per checkpoint); conv(slot) and delta(slot) are views of it, in engine/cuda/families/gdn.py's layout."""

    def __init__(self, cfg, stream):
        self.n = sum(cfg.recurrent_layers)
        self.conv_dim = 2 * cfg.ssm_k_heads * cfg.ssm_state + cfg.ssm_inner
        self.conv_shape = (cfg.ssm_conv - 1, self.conv_dim)
        self.delta_shape = (cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_state)
        self.conv_elems = int(np.prod(self.conv_shape))
        self.delta_elems = int(np.prod(self.delta_shape))
        self.stream = stream
        with stream:
            self.mem = cp.zeros(self.n * (self.conv_elems + self.delta_elems), dtype=cp.float32)
        self._conv = self.mem[:self.n * self.conv_elems].reshape(self.n, *self.conv_shape)
        self._delta = self.mem[self.n * self.conv_elems:].reshape(self.n, *self.delta_shape)

    @property
    def nbytes(self) -> int:
        return int(self.mem.nbytes)

    def conv(self, slot: int) -> cp.ndarray:
        return self._conv[slot]

    def delta(self, slot: int) -> cp.ndarray:
        return self._delta[slot]

    def zero(self) -> None:
        with self.stream:
            self.mem.fill(0)

    def snapshot(self) -> np.ndarray:
        """A copy in pinned host memory (after everything queued on the stream)."""
        host = _pinned(self.mem.size)
        self.mem.get(stream=self.stream, out=host)
        self.stream.synchronize()
        return host

    def restore(self, host: np.ndarray) -> None:
        if host.shape != self.mem.shape:
            raise ValueError(f"a snapshot of {host.size} floats for a state of {self.mem.size}: another model's?")
        self.mem.set(host, stream=self.stream)
        self.stream.synchronize()       # the snapshot stays the session's to drop or reuse


def _pinned(n: int) -> np.ndarray:
    import cupyx
    return cupyx.empty_pinned((n,), dtype=np.float32)     # from CuPy's pinned pool: a checkpoint reuses freed ones


# --- the gate ---------------------------------------------------------------------------------------------------

def gate_kernel():
    """cuda_src/attn_gate.cu's sigmoid_gate_mul (loaded at start, before any capture)."""
    return kernel_loader.function("attn_gate", "sigmoid_gate_mul")


def gate_mul(fn, y, g, n: int) -> None:
    """y[:n] *= sigmoid(g[:n]) on the current stream."""
    fn((max(1, min(1024, (n + GATE_BLOCK - 1) // GATE_BLOCK)),), (GATE_BLOCK,), (ptr(y), ptr(g), I64(n)))


# --- the family -------------------------------------------------------------------------------------------------

def gdn_kernels(cfg) -> GdnKernels:
    """engine/cuda/families/gdn.py's kernels for this model's GDN shape (compiled now, before any capture)."""
    return GdnKernels(GdnShape.from_config(cfg))


class HybridFamily(MoeFamily):
    name = "hybrid"
    archs = ("qwen3next", "qwen35moe")
    ffn_norm = "post_attention_norm.weight"
    # On the H200 a pipelined tiny qwen3next parted from the unpipelined run at the first token, greedy and sampled
    # (recurrent state 2e-4 of its largest value apart): not run ahead until tests/test_cuda_pipeline.py passes.
    run_ahead = False

    def load_layer(self, up, i: int) -> HybridLayer:
        L = hybrid_layer(up, self.cfg, i)
        load_ffn(up, L, f"blk.{i}.", self.cfg)
        return L

    def kv_cache(self, max_ctx: int, dtype: str, chunk: int, log) -> KVCache:
        return HybridKV(self.cfg, max_ctx, dtype)

    def rope_table(self, n_pos: int) -> np.ndarray:
        return hybrid_rope_table(self.cfg, n_pos)

    def recurrent_state(self, stream) -> GdnState:
        return GdnState(self.cfg, stream)

    def prompt_buffers(self, T: int) -> list[Buffer]:
        """The attention gate, a GDN layer's projections (beta: qwen3next's whole ssm_ba) and output, and
        GdnScratch for the chunk (allocated by HybridPrompt)."""
        c = self.cfg
        qw = c.n_head * c.head_dim
        conv, inner, Hv = 2 * c.ssm_k_heads * c.ssm_state + c.ssm_inner, c.ssm_inner, c.ssm_v_heads
        return [Buffer("gate", T * qw, 4), Buffer("gdn_qkv", T * conv, 4), Buffer("gdn_z", T * inner, 4),
                Buffer("gdn_beta", T * 2 * Hv, 4), Buffer("gdn_alpha", T * Hv, 4), Buffer("gdn_o", T * inner, 4),
                Buffer("gdn_scratch", scratch_bytes(GdnShape.from_config(c), T), 1, False)]

    def decode_layers(self, step, recurrent=None) -> "HybridDecode":
        return HybridDecode(step, recurrent, gdn_kernels(self.cfg))

    def window_program(self):
        """None: a window runs one step a token (the GDN state would need the state after each window position)."""
        return None

    def prompt_layers(self, prefill, recurrent=None) -> "HybridPrompt":
        return HybridPrompt(prefill, recurrent, gdn_kernels(self.cfg))


# --- the decode layer -------------------------------------------------------------------------------------------

def mixer_projections(layer) -> tuple:
    """The matrices a hybrid layer's decode mixer projects the normed x with, in HybridDecode's order (None: absent)."""
    g = layer.gdn
    if g is None:
        return layer.wq, layer.wk, layer.wv, layer.attn_gate
    return g.qkv, g.z, g.beta, g.alpha


class HybridDecode(MoeDecode):
    """The decode layer with a hybrid's mixer: gated attention, or GDN on the state in VRAM. Buffers sized once;
    nothing per step is an argument."""

    def __init__(self, step, state: GdnState, gdn: GdnKernels):
        super().__init__(step)
        self.state, self.gdn, c = state, gdn, step.cfg
        # the two-type projection kernels this model's layers need, compiled now (before any capture)
        load_mixed(step.kernels, mixed_pairs(mixer_projections(L) for L in step.weights.layers))
        f32 = lambda n: cp.zeros(n, dtype=cp.float32)      # noqa: E731
        with step.stream:
            self.gate = f32(c.n_head * c.head_dim)
            self.qkv, self.z, self.o = f32(state.conv_dim), f32(c.ssm_inner), f32(c.ssm_inner)
            self.beta, self.alpha = f32(2 * c.ssm_v_heads), f32(c.ssm_v_heads)    # beta: qwen3next's whole ssm_ba

    def mixer(self, li: int) -> None:
        st, mv = self.step, self.step.launcher
        layer = st.weights.layers[li]
        if layer.gdn is None:
            c = self.cfg
            mv.mv_many(mixer_projections(layer), st.x, (self.q, self.k_new, self.v_new, self.gate),
                       norm=layer.attn_norm, tag="qkv", mixed=True)
            self.attn.step(st.kernel, li, self.q, self.k_new, self.v_new, layer.q_norm, layer.k_norm, st.rope,
                           self.att, st.state, np.float32(c.attn_scale or 1.0 / np.sqrt(c.head_dim)))
            mv.mv_gated(layer.wo, self.att, self.gate, st.x, tag="wo")     # x += wo @ (att * sigmoid(gate))
            return
        g = layer.gdn
        # the projections (one launch, or two for a 2 + 2 type split), the conv in qkv's epilogue, its state in place
        mv.mv_many(mixer_projections(layer), st.x, (self.qkv, self.z, self.beta, self.alpha), norm=layer.attn_norm,
                   conv=(self.state.conv(g.slot), g.conv, g.conv.shape[1]), tag="gdn_in", mixed=True)
        if st.keeps("gdn"):     # q/k l2 norms, delta rule, gated norm: the delta state in place
            self.gdn.delta_decode(self.qkv, self.beta[:g.beta.rows], None if g.alpha is None else self.alpha,
                                  g.dt_bias, g.a, self.state.delta(g.slot), self.z, g.norm, self.o, qk_norm=True)
        mv.mv(g.out, self.o, st.x, accumulate=True, tag="gdn_out")


# --- the prompt layer -------------------------------------------------------------------------------------------

class HybridPrompt(MoePrompt):
    """The prompt layer with a hybrid's mixer: the attention output gate, or a GDN layer's mixer for a chunk of T
    tokens, the state carried from the chunk before."""

    def __init__(self, prefill, state: GdnState, gdn: GdnKernels):
        super().__init__(prefill)
        self.state, self.gdn = state, gdn
        self.gate_fn = gate_kernel()
        with prefill.step.stream:
            self.scratch = gdn.scratch(prefill.chunk)     # chunk_plan's "gdn_scratch"

    def mixer(self, li, layer, x, xn, T, pos0):
        if layer.gdn is None:
            self.attention(li, layer, x, xn, T, pos0, gate=lambda xh, att: self.gate(layer, xh, att, T))
        else:
            self.gdn_mixer(li, layer, x, xn, T)

    def gate(self, layer, xh, att, T: int) -> None:
        """att (T, n_head * head_dim) *= sigmoid(xn @ attn_gate^T); xh: the layer's normed input in fp16."""
        c, p = self.cfg, self.p
        g = p.linear_f16(layer.attn_gate, xh, p._view("gate", T, c.n_head * c.head_dim))
        gate_mul(self.gate_fn, att, g, T * c.n_head * c.head_dim)

    def gdn_mixer(self, li: int, layer, x, xn, T: int) -> None:
        """x += the GDN mixer of rmsnorm(x) * attn_norm for T tokens."""
        c, p, g = self.cfg, self.p, layer.gdn
        p.launcher.rmsnorm(x, layer.attn_norm, xn, rows=T)
        xh = p.to_half(xn, T, c.n_embd)
        qkv = p.linear_f16(g.qkv, xh, p._view("gdn_qkv", T, self.state.conv_dim))
        z = p.linear_f16(g.z, xh, p._view("gdn_z", T, c.ssm_inner))
        # beta and alpha feed a sigmoid and an exp: fp32 products, as the routers'
        beta = p.linear_into(g.beta, xn, p._view("gdn_beta", T, g.beta.rows))
        alpha = None if g.alpha is None else p.linear_into(g.alpha, xn, p._view("gdn_alpha", T, c.ssm_v_heads))
        p._mark("dense")
        o = p._view("gdn_o", T, c.ssm_inner)
        self.gdn.prefill(qkv, z, beta, alpha, g.dt_bias, g.a, g.conv, g.norm, self.state.conv(g.slot),
                         self.state.delta(g.slot), o, self.scratch, T)
        p._mark("gdn")
        p.linear_f16(g.out, p.to_half(o, T, c.ssm_inner), x, accumulate=True)
        p._mark("dense")
