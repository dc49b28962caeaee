"""qwen3next / qwen35moe on the CUDA backend: what their layers add to the qwen3moe path (engine/arch/qwen3next.py is
the reference). The expert path (router, cache, prefetch, ring, memory modes) is the qwen3moe one unchanged, with
post_attention_norm as the FFN norm and the shared expert's sigmoid gate as qwen2moe's.

- Gated attention: attn_q gives each head [query | gate]; its rows are split on loading into the query rows (wq, so
  the Q/K/V mat-vecs, q/k norms, partial RoPE and attention are the plain path's) and the gate rows (attn_gate); the
  attention output is multiplied by sigmoid(gate) before attn_output (the prompt pass: cuda_src/attn_gate.cu; the
  decode step: in attn_output's launch, dense.cu mv_gated). qwen35moe's IMRoPE
  is its rotary table with the still pairs kept at position 0's angle.
- Gated DeltaNet: the projections (attn_qkv, attn_gate = z, beta, alpha) with the mat-vec / GEMM kernels, then
  engine/cuda/gdn.py's kernels (conv, delta rule, gated norm) on the state in VRAM, then ssm_out. In the decode step
  the four projections share one launch (Launcher.mv_many; one matrix in another quant type, as the Q4_K_M recipe's
  Q6_K attn_qkv, joins through mv_mixed.cu) and the conv runs in attn_qkv's epilogue, so a GDN layer's mixer is 3
  launches (was 7); a gated attention layer's is 3 likewise (q/k/v/gate, attention, gated attn_output; was 5 to 7).
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
from engine.cuda.kv import KVCache
from engine.cuda.launch import I64, load_mixed, mixed_pairs, ptr
from engine.cuda.rope import rope_table
from engine.cuda.weights import DevMatrix, Layer, _shape, upload_matrix

GATE_BLOCK = 256


# --- weights ----------------------------------------------------------------------------------------------------

@dataclass
class GdnLayer:
    """One Gated DeltaNet layer's weights, as engine/cuda/gdn.py reads their projections. qkv, z: attn_qkv (conv
    channels: q of every key head, then k, then v) and attn_gate; beta, alpha: qwen35moe's ssm_beta and ssm_alpha, or
    qwen3next's whole ssm_ba as beta (grouped per key head, which the kernels read) and alpha None; conv (conv_dim,
    d_conv), dt_bias, a (= ssm_a, -exp(A_log)), norm (head width): float32; out: ssm_out."""
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


def rows_matrix(t, rows: np.ndarray) -> DevMatrix:
    """A DevMatrix of some rows of tensor t (in the given order), from its quantized bytes: rows are independent."""
    q, n, cols, rb = _shape(t)
    data = np.ascontiguousarray(t.data).reshape(n, rb)[np.asarray(rows, dtype=np.int64)]
    return DevMatrix(cp.asarray(np.ascontiguousarray(data)), q.id, len(rows), cols, rb)


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


def hybrid_layer(model, il: int, f32) -> Layer:
    """Layer il of a hybrid: gated attention (wq the query rows, attn_gate the gate rows) or GDN (gdn set); the FFN
    norm is post_attention_norm. The MoE part is load_weights' own."""
    cfg, b = model.config, f"blk.{il}."
    L = Layer(attn_norm=f32(b + "attn_norm.weight"), wq=None, wk=None, wv=None, wo=None,
              ffn_norm=f32(b + "post_attention_norm.weight"))
    if not cfg.recurrent_layers[il]:
        q_rows, g_rows = attn_q_rows(cfg)
        t = model.tensor(b + "attn_q.weight")
        L.wq, L.attn_gate = rows_matrix(t, q_rows), rows_matrix(t, g_rows)
        L.wk, L.wv, L.wo = (upload_matrix(model.tensor(b + n)) for n in ("attn_k.weight", "attn_v.weight",
                                                                          "attn_output.weight"))
        L.q_norm, L.k_norm = f32(b + "attn_q_norm.weight"), f32(b + "attn_k_norm.weight")
        return L
    if model.has(b + "ssm_in.weight"):
        qkv_rows, z_rows = ssm_in_rows(cfg)
        t = model.tensor(b + "ssm_in.weight")
        qkv, z = rows_matrix(t, qkv_rows), rows_matrix(t, z_rows)
    else:
        qkv, z = upload_matrix(model.tensor(b + "attn_qkv.weight")), upload_matrix(model.tensor(b + "attn_gate.weight"))
    if cfg.arch == "qwen3next":
        beta, alpha = upload_matrix(model.tensor(b + "ssm_ba.weight")), None
    else:
        beta, alpha = (upload_matrix(model.tensor(b + n)) for n in ("ssm_beta.weight", "ssm_alpha.weight"))
    conv = cp.asarray(model.dequant(b + "ssm_conv1d.weight").reshape(-1, cfg.ssm_conv).astype(np.float32))
    slot = sum(cfg.recurrent_layers[:il])
    L.gdn = GdnLayer(qkv=qkv, z=z, beta=beta, alpha=alpha, conv=conv, dt_bias=f32(b + "ssm_dt.bias"),
                     a=f32(b + "ssm_a"), norm=f32(b + "ssm_norm.weight"),
                     out=upload_matrix(model.tensor(b + "ssm_out.weight")), slot=slot)
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
    buffer (one copy per checkpoint); conv(slot) and delta(slot) are views of it, in engine/cuda/gdn.py's layout."""

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


# --- the decode step's mixers -----------------------------------------------------------------------------------

def gdn_kernels(cfg):
    """engine/cuda/gdn.py's kernels for this model's GDN shape (compiled now, before any capture)."""
    from engine.cuda.gdn import GdnKernels, GdnShape
    return GdnKernels(GdnShape.from_config(cfg))


def mixer_projections(layer) -> tuple:
    """The matrices a hybrid layer's decode mixer projects the normed x with, in HybridDecode's order (None: absent)."""
    g = layer.gdn
    if g is None:
        return layer.wq, layer.wk, layer.wv, layer.attn_gate
    return g.qkv, g.z, g.beta, g.alpha


class HybridDecode:
    """The decode step's attention block for a hybrid layer (DecodeStep.enqueue_attention_block hands it over):
    gated attention, or GDN on the state in VRAM. Buffers sized once; nothing per step is an argument."""

    def __init__(self, step, state: GdnState, gdn):
        self.step, self.state, self.gdn, c = step, state, gdn, step.cfg
        # the two-type projection kernels this model's layers need, compiled now (before any capture)
        load_mixed(step.kernels, mixed_pairs(mixer_projections(L) for L in step.weights.layers))
        f32 = lambda n: cp.zeros(n, dtype=cp.float32)
        with step.stream:
            self.gate = f32(c.n_head * c.head_dim)
            self.qkv, self.z, self.o = f32(state.conv_dim), f32(c.ssm_inner), f32(c.ssm_inner)
            self.beta, self.alpha = f32(2 * c.ssm_v_heads), f32(c.ssm_v_heads)    # beta: qwen3next's whole ssm_ba

    def enqueue_mixer(self, li: int) -> None:
        st, mv = self.step, self.step.launcher
        layer = st.weights.layers[li]
        if layer.gdn is None:
            c = st.cfg
            mv.mv_many(mixer_projections(layer), st.x, (st.q, st.k_new, st.v_new, self.gate), norm=layer.attn_norm,
                       tag="qkv", mixed=True)
            st.attn.step(st.kernel, li, st.q, st.k_new, st.v_new, layer.q_norm, layer.k_norm, st.rope, st.att,
                         st.state, np.float32(c.attn_scale or 1.0 / np.sqrt(c.head_dim)))
            mv.mv_gated(layer.wo, st.att, self.gate, st.x, tag="wo")     # x += wo @ (att * sigmoid(gate))
            return
        g = layer.gdn
        # the projections (one launch, or two for a 2 + 2 type split), the conv in qkv's epilogue, its state in place
        mv.mv_many(mixer_projections(layer), st.x, (self.qkv, self.z, self.beta, self.alpha), norm=layer.attn_norm,
                   conv=(self.state.conv(g.slot), g.conv, g.conv.shape[1]), tag="gdn_in", mixed=True)
        if st.keeps("gdn"):     # q/k l2 norms, delta rule, gated norm: the delta state in place
            self.gdn.delta_decode(self.qkv, self.beta[:g.beta.rows], None if g.alpha is None else self.alpha,
                                  g.dt_bias, g.a, self.state.delta(g.slot), self.z, g.norm, self.o, qk_norm=True)
        mv.mv(g.out, self.o, st.x, accumulate=True, tag="gdn_out")


def attach_decode(step, state: GdnState) -> None:
    step.set_hybrid(HybridDecode(step, state, gdn_kernels(step.cfg)))


# --- the prompt pass's mixers -----------------------------------------------------------------------------------

class HybridPrefill:
    """The prompt pass's hybrid parts (engine/cuda/prefill.py calls them): the attention output gate, and a GDN
    layer's mixer for a chunk of T tokens, the state carried from the chunk before."""

    def __init__(self, prefill, state: GdnState, gdn):
        self.p, self.state, self.gdn = prefill, state, gdn
        self.gate_fn = gate_kernel()
        with prefill.step.stream:
            self.scratch = gdn.scratch(prefill.chunk)     # chunk_plan's "gdn_scratch"

    def gate(self, layer, xh, att, T: int) -> None:
        """att (T, n_head * head_dim) *= sigmoid(xn @ attn_gate^T); xh: the layer's normed input in fp16."""
        c, p = self.p.cfg, self.p
        g = p.linear_f16(layer.attn_gate, xh, p._view("gate", T, c.n_head * c.head_dim))
        gate_mul(self.gate_fn, att, g, T * c.n_head * c.head_dim)

    def mixer(self, li: int, layer, x, xn, T: int) -> None:
        """x += the GDN mixer of rmsnorm(x) * attn_norm for T tokens."""
        c, p, g = self.p.cfg, self.p, layer.gdn
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


def attach_prefill(prefill, state: GdnState) -> None:
    prefill.set_hybrid(HybridPrefill(prefill, state, gdn_kernels(prefill.cfg)))
