"""The qwen4exp family (Qwen3.8-Flash-Next; engine/arch/qwen4exp.py is the reference, ../shared/qwen4exp.md the spec):
the hybrid family's layers (Gated DeltaNet, here with a sigmoid output gate, or gated attention, then 512 experts with
a sigmoid-gated shared expert on the moe expert path: VRAM cache, prefetch, in-place misses, prompt ring, memory
modes) with

- hyper-connections instead of the layer norms: the residual is H streams of N (the family's own buffer, H N floats a
  token); around every half-layer an HC read mixes the normalised streams into the block input, which the family
  writes into the step's x (so the router, the prefetch's predictions and the experts read it as any family's FFN
  input, with no norm: ffn_norm None), and an HC write adds the block's output o to each raw stream. The final HC read
  is the output norm (output_norm None);
- QSA on the attention layers: the indexer's raw keys per position and pooled block keys per complete block (Q4KV,
  beside the K/V of the attention layers), block scores, the top budget/r blocks plus the tail, attention over
  those positions (dense while at most budget/r blocks are complete); the position is read on the device, so the
  decode graph serves both regimes;
- the PLE n-gram embedding at its layer: rows hashed on the host from the token n-grams (ple_ids: exact uint64, the
  EOS reset) and read through engine/row_cache.py's bounded LRU. Decode: dequantized on the host into a pinned
  buffer the decode graph uploads at its start. Prompt: a chunk's raw rows gathered into a pinned buffer, on a
  worker thread while the chunk before runs when the next chunk is known (engine/row_ahead.py), uploaded raw (a
  ninth of the float32 bytes at Q4_0) and dequantized on the GPU by the engine's dequant_rows; then its
  projections, gates and dilated conv with history on the GPU. The row counts go out as INFO ple_row_lookups /
  ple_row_hits (request_info).
- the recurrent state (Q4State): every GDN layer's conv window and delta matrices, the PLE conv history (VRAM) and
  the PLE token context (host), snapshot and restored whole by the worker's checkpoints. QSA's indexer keys and
  pooled keys are per position like K/V: a rewind keeps the positions before it, and the blocks they complete.

Each part is one call into engine/cuda/families/q4ops.py: Hc and Qsa on cuda_src/hc.cu and qsa.cu (engine/cuda/hc.py,
qsa.py), Gdn on cuda_src/gdn.cu's sigmoid-gate build at heads of 128 (the published models': decode and the chunked
prompt rule) or on qwen4exp.cu's generic kernels at other widths (the tiny fixtures' 16), Ple on qwen4exp.cu. Only
f16 K/V (--kv f16).
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy as cp
import numpy as np

from engine.arch import qwen4exp as ref
from engine.cuda.chunk_plan import Buffer
from engine.cuda.families.gdn import scratch_bytes
from engine.cuda.families.hybrid import GdnLayer, HybridKV, attn_q_rows
from engine.cuda.families.moe import MoeDecode, MoeFamily, MoeLayer, MoePrompt, load_ffn
from engine.cuda.families.q4ops import Gdn, Hc, HcWeights, Ple, Qsa, gdn_cu_shape, q4_shape
from engine.cuda.launch import load_mixed, mixed_pairs, ptr
from engine.cuda.weights import DeviceWeights, DevMatrix, Upload
from engine.row_ahead import RowsAhead
from engine.row_cache import RowCache

MiB = 1 << 20


# --- weights ----------------------------------------------------------------------------------------------------

@dataclass
class QsaWeights:
    """A QSA layer's own weights beyond MoeLayer's (wq: attn_q's query rows, wk, wv, wo, q_norm, k_norm): gate,
    attn_q's gate rows; the indexer's projections and norms (float32); its block size r (compress ratio)."""
    gate: DevMatrix
    idx_q: DevMatrix
    idx_k: DevMatrix
    idx_q_norm: object
    idx_k_norm: object
    ratio: int


@dataclass
class PleWeights:
    """The PLE layer's: key (D x P), value (N x P) projections of the n-gram embedding; the three grouped norms (D,)
    and the depthwise conv taps (D, K), float32."""
    key: DevMatrix
    value: DevMatrix
    norm_key: object
    norm_query: object
    norm_conv: object
    conv: object


@dataclass(kw_only=True)
class Q4Layer(MoeLayer):
    """A qwen4exp layer: its two HC modules, a GDN layer (gdn) or a QSA layer (wq, wk, wv, wo, q_norm, k_norm and
    qsa), the PLE on its layer (ple), and the MoE FFN (router, shared expert with its gate). attn_norm and ffn_norm
    are None: the HC reads are the norms."""
    hc_attn: HcWeights
    hc_ffn: HcWeights
    qsa: QsaWeights | None = None
    gdn: GdnLayer | None = None
    ple: PleWeights | None = None

    def matrices(self) -> list[DevMatrix]:
        mats = super().matrices() + self.hc_attn.matrices() + self.hc_ffn.matrices()
        for part in (self.qsa, self.gdn, self.ple):
            if part is not None:
                mats += [v for v in vars(part).values() if isinstance(v, DevMatrix)]
        return mats


@dataclass
class Q4Weights(DeviceWeights):
    """DeviceWeights with the final HC read (output_hc_*) in place of output_norm (None); ple_qt: the n-gram table's
    quant type (the prompt pass dequantizes its rows with dequant_rows), None without a PLE layer."""
    hc_out: HcWeights | None = None
    ple_qt: int | None = None

    def qtype_ids(self) -> set[int]:
        ids = super().qtype_ids() | {m.qt for m in self.hc_out.matrices()}
        return ids | ({int(self.ple_qt)} if self.ple_qt is not None else set())


def hc_weights(up, prefix: str, inject: bool = True) -> HcWeights:
    return HcWeights(up.f32(prefix + "_norm.weight"), up.mat(prefix + "_down.weight"), up.mat(prefix + "_up.weight"),
                     up.mat(prefix + "_inject.weight") if inject else None)


def q4_layer(up, cfg, il: int) -> Q4Layer:
    """Layer il's weights (spec section 2) without its FFN."""
    p, b = cfg.family_params, f"blk.{il}."
    L = Q4Layer(attn_norm=None, wq=None, wk=None, wv=None, wo=None, ffn_norm=None,
                hc_attn=hc_weights(up, b + "hc_attn"), hc_ffn=hc_weights(up, b + "hc_ffn"))
    if cfg.recurrent_layers[il]:
        L.gdn = GdnLayer(qkv=up.mat(b + "attn_qkv.weight"), z=up.mat(b + "attn_gate.weight"),
                         beta=up.mat(b + "ssm_beta.weight"), alpha=up.mat(b + "ssm_alpha.weight"),
                         conv=up.f32(b + "ssm_conv1d.weight", (-1, cfg.ssm_conv)), dt_bias=up.f32(b + "ssm_dt.bias"),
                         a=up.f32(b + "ssm_a"), norm=up.f32(b + "ssm_norm.weight"), out=up.mat(b + "ssm_out.weight"),
                         slot=sum(cfg.recurrent_layers[:il]))
    else:
        q_rows, g_rows = attn_q_rows(cfg)       # attn_q interleaves [q_h | gate_h] per head (spec 2.3)
        L.wq = up.rows(b + "attn_q.weight", q_rows)
        L.wk, L.wv, L.wo = (up.mat(b + n) for n in ("attn_k.weight", "attn_v.weight", "attn_output.weight"))
        L.q_norm, L.k_norm = up.f32(b + "attn_q_norm.weight"), up.f32(b + "attn_k_norm.weight")
        L.qsa = QsaWeights(gate=up.rows(b + "attn_q.weight", g_rows), idx_q=up.mat(b + "indexer.q_proj.weight"),
                           idx_k=up.mat(b + "indexer.k_proj.weight"), idx_q_norm=up.f32(b + "indexer.q_norm.weight"),
                           idx_k_norm=up.f32(b + "indexer.k_norm.weight"), ratio=int(p.compress_ratios[il]))
    if il in p.ple_layers:
        L.ple = PleWeights(key=up.mat(b + "ple_key.weight"), value=up.mat(b + "ple_value.weight"),
                           norm_key=up.f32(b + "ple_norm_key.weight"), norm_query=up.f32(b + "ple_norm_query.weight"),
                           norm_conv=up.f32(b + "ple_norm_conv.weight"),
                           conv=up.f32(b + "ple_conv1d.weight", (-1, p.ple_conv)))
    return L


# --- the PLE rows (host) ----------------------------------------------------------------------------------------

def ple_ids(p, tokens, before) -> tuple[np.ndarray, np.ndarray]:
    """The table rows of tokens (T, heads) int64 in head order (spec 4.8: the context of each token with the EOS
    reset, hashed in exact uint64), and the last ngram_size - 1 ids after them (the context the next tokens
    continue). before: the ids ahead of tokens (EOS at the sequence start)."""
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    ctx = ref.ple_context(tokens, before, p.ple_eos)
    ids = ref.ple_row_ids(ctx, p.multipliers, p.head_sizes, p.head_offsets, p.heads_per_ngram)
    after = np.concatenate([np.asarray(before, np.int64), tokens])[-(p.ngram_size - 1):]
    return ids, after


def ple_rows(p, rows: RowCache, tokens, before) -> tuple[np.ndarray, np.ndarray]:
    """The n-gram embedding of tokens (T, P) float32, read through the row cache, and the context after them
    (ple_ids)."""
    ids, after = ple_ids(p, tokens, before)
    return rows.rows(ids).reshape(len(ids), -1), after


# --- the KV cache with QSA's indexer keys -----------------------------------------------------------------------

def qsa_blocks(cfg, max_ctx: int, li: int) -> int:
    """Rows of layer li's pooled block keys: every block a context of max_ctx can complete, and one spare."""
    return max_ctx // cfg.family_params.compress_ratios[li] + 1


class Q4KV(HybridKV):
    """HybridKV (K/V of the QSA layers, fp16) and per QSA layer its raw indexer keys (max_ctx, indexer_dim) and pooled
    block keys (qsa_blocks, indexer_dim), float32 as the reference keeps them."""

    def __init__(self, cfg, max_ctx: int, dtype: str = "f16"):
        if dtype != "f16":
            raise ValueError(f"qwen4exp's QSA attention reads the fp16 KV cache (cuda_src/qwen4exp.cu "
                             f"q4_qsa_attend); --kv {dtype} is not built for it: run with --kv f16")
        super().__init__(cfg, max_ctx, dtype)
        di = cfg.family_params.indexer_dim
        self.qsa_layers = [i for i, r in enumerate(cfg.recurrent_layers) if not r]
        self.index_keys = {li: cp.zeros((max_ctx, di), dtype=cp.float32) for li in self.qsa_layers}
        self.pooled = {li: cp.zeros((qsa_blocks(cfg, max_ctx, li), di), dtype=cp.float32) for li in self.qsa_layers}


# --- the recurrent state ----------------------------------------------------------------------------------------

def state_layout(cfg) -> dict[str, tuple[int, ...]]:
    """Q4State's float32 arrays, in the order they sit in its one VRAM buffer: conv (GDN layers, d_conv - 1,
    conv channels), delta (GDN layers, n_v, S, S: S[h, i, j] value i, key j, as the reference's), ple_conv
    (ngram_size * (ple_conv - 1), H N: the PLE conv's history of normed gated values, oldest first)."""
    p = cfg.family_params
    n = sum(cfg.recurrent_layers)
    conv_dim = 2 * cfg.ssm_k_heads * cfg.ssm_state + cfg.ssm_inner
    return {"conv": (n, cfg.ssm_conv - 1, conv_dim), "delta": (n, cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_state),
            "ple_conv": (p.ngram_size * (p.ple_conv - 1), cfg.n_embd * p.hc_count)}


class Q4State:
    """The state carried between tokens besides K/V and the indexer keys: state_layout's arrays in one VRAM buffer
    (one copy per checkpoint) and, on the host, the PLE token context (the last ngram_size - 1 ids; EOS at the start)."""

    def __init__(self, cfg, stream):
        p = cfg.family_params
        self.layout = state_layout(cfg)
        self.conv_dim = self.layout["conv"][2]
        self.stream = stream
        sizes = {k: int(np.prod(s)) for k, s in self.layout.items()}
        with stream:
            self.mem = cp.zeros(sum(sizes.values()), dtype=cp.float32)
        self.views, off = {}, 0
        for k, s in self.layout.items():
            self.views[k] = self.mem[off:off + sizes[k]].reshape(s)
            off += sizes[k]
        self.eos, self.n_ids = p.ple_eos, p.ngram_size - 1
        self.ids = np.full(self.n_ids, self.eos, np.int64)

    @property
    def nbytes(self) -> int:
        return int(self.mem.nbytes + self.ids.nbytes)

    def conv(self, slot: int):
        return self.views["conv"][slot]

    def delta(self, slot: int):
        return self.views["delta"][slot]

    @property
    def ple_conv(self):
        return self.views["ple_conv"]

    def zero(self) -> None:
        with self.stream:
            self.mem.fill(0)
        self.ids = np.full(self.n_ids, self.eos, np.int64)

    def snapshot(self):
        """(a copy in pinned host memory after everything queued on the stream, the PLE ids)."""
        import cupyx
        host = cupyx.empty_pinned((self.mem.size,), dtype=np.float32)
        self.mem.get(stream=self.stream, out=host)
        self.stream.synchronize()
        return host, self.ids.copy()

    def restore(self, data) -> None:
        host, ids = data
        if host.shape != self.mem.shape or ids.shape != self.ids.shape:
            raise ValueError(f"a snapshot of {host.size} floats and {ids.size} ids for a state of {self.mem.size} and "
                             f"{self.ids.size}: another model's?")
        self.mem.set(host, stream=self.stream)
        self.stream.synchronize()
        self.ids = ids.copy()


# --- the family -------------------------------------------------------------------------------------------------

class Qwen4ExpFamily(MoeFamily):
    name = "qwen4exp"
    archs = ("qwen4exp",)
    kernel_files = ("qwen4exp.cu",)
    ffn_norm = None
    # A step's PLE rows are hashed on the host from its token (Q4Decode.set_inputs), which a step fed on the device
    # by the one before (engine/cuda/pipeline.py) does not give: never run ahead.
    run_ahead = False
    # Its hyper-connection streams (xs) and the PLE rows (eta) cross layers besides x: no stage boundary yet.
    stage_split = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.rows: RowCache | None = None       # the n-gram table's row cache (load_weights opens it)
        self.ahead: RowsAhead | None = None     # the prompt pass's rows gathered ahead (rows_ahead() makes it)

    def load_layer(self, up, i: int) -> Q4Layer:
        L = q4_layer(up, self.cfg, i)
        load_ffn(up, L, f"blk.{i}.", self.cfg)
        return L

    def load_weights(self, model, up=None) -> Q4Weights:
        cfg = self.cfg
        up = up or Upload(model)
        tok = up.mat("token_embd.weight")
        out = tok if cfg.tied_embeddings or not model.has("output.weight") else up.mat("output.weight")
        w = Q4Weights(tok_embd=tok, output=out, output_norm=None, hc_out=hc_weights(up, "output_hc", inject=False))
        for i in range(cfg.n_layer):
            w.layers.append(self.load_layer(up, i))
        self.close()
        self.rows = RowCache(model.tensor(ref.PLE_TABLE), ref.PLE_CACHE_BYTES)
        w.ple_qt = int(self.rows.tensor.qtype)
        return w

    def rows_ahead(self, alloc=None) -> RowsAhead:
        """The prompt pass's RowsAhead over the row cache (made at the first call; alloc: its buffers', pinned on
        CUDA)."""
        if self.ahead is None:
            self.ahead = RowsAhead(self.rows, lambda tokens, before: ple_ids(self.cfg.family_params, tokens, before),
                                   alloc)
        return self.ahead

    def kv_cache(self, max_ctx: int, dtype: str, chunk: int, log) -> Q4KV:
        return Q4KV(self.cfg, max_ctx, dtype)

    def recurrent_state(self, stream) -> Q4State:
        return Q4State(self.cfg, stream)

    def prompt_buffers(self, T: int) -> list[Buffer]:
        """The prompt layer's CuPy temporaries (transient): a few (T, H N) arrays for the HC reads and the PLE, the
        GDN projections and outputs, the QSA projections and qsa.py's prompt scratch (its block scores of a sub-batch
        of queries: Qsa.PROMPT_SCORE_BYTES at most); where gdn.cu runs the GDN layers, its chunk scratch (allocated by
        Q4Prompt)."""
        c, p = self.cfg, self.cfg.family_params
        D = c.n_embd * p.hc_count
        conv = 2 * c.ssm_k_heads * c.ssm_state + c.ssm_inner
        gdn = 2 * conv + 2 * c.ssm_inner + 2 * c.ssm_v_heads
        qsa = 3 * c.n_head * c.head_dim + 2 * (p.indexer_heads * p.indexer_dim + p.indexer_dim)
        # + the chunk's raw n-gram rows (uploaded, then dequantized into one of the (T, H N)-or-smaller arrays)
        raw = p.n_ple_heads * (self.rows.row_bytes if self.rows is not None else 4 * p.ple_width)
        per_token = 4 * (5 * D + max(gdn, qsa) + 4 * c.n_embd) + raw
        bufs = [Buffer("q4_prompt", T * per_token + Qsa.PROMPT_SCORE_BYTES, 1, False)]
        gshape = gdn_cu_shape(c, float(c.rms_eps))
        if any(c.recurrent_layers) and gshape is not None:
            bufs.append(Buffer("gdn_scratch", scratch_bytes(gshape, T), 1, False))
        return bufs

    def decode_layers(self, step, recurrent=None) -> "Q4Decode":
        return Q4Decode(step, recurrent, self)

    def prompt_layers(self, prefill, recurrent=None) -> "Q4Prompt":
        return Q4Prompt(prefill, recurrent, self)

    def ple_rows(self, tokens, before):
        return ple_rows(self.cfg.family_params, self.rows, tokens, before)

    def request_info(self) -> dict:
        return {"ple_row_lookups": self.rows.lookups, "ple_row_hits": self.rows.hits} if self.rows else {}

    def reset_stats(self) -> None:
        if self.rows is not None:
            self.rows.reset_counts()

    def info(self) -> dict:
        return {"ple_row_cache_mib": round(self.rows.nbytes / MiB)} if self.rows else {}

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None
        if self.rows is not None:
            self.rows.close()
            self.rows = None


# --- the decode layer -------------------------------------------------------------------------------------------

def hc_up_types(weights) -> set[int]:
    """The quant types of every HC up projection (hc.cu's hc_up_mix is built per type)."""
    ups = [weights.hc_out.up] + [hc.up for L in weights.layers for hc in (L.hc_attn, L.hc_ffn)]
    return {int(m.qt) for m in ups}


def _zero(a) -> None:
    """a = 0 on the current stream (a memset node in a captured graph)."""
    cp.cuda.runtime.memsetAsync(int(ptr(a)), 0, a.nbytes, cp.cuda.get_current_stream().ptr)


class Q4Decode(MoeDecode):
    """The decode layer program: the residual streams xs (H N) are the family's; st.x holds each half-layer's block
    input (the HC read's y); o each block's output before the HC write. Buffers sized once; the position is read on
    the device (st.state[1]); the PLE rows of the step's token are put in a pinned buffer by set_inputs (the host,
    before the launch) and uploaded by the step's first node."""

    def __init__(self, step, state: Q4State, fam: Qwen4ExpFamily):
        super().__init__(step)
        self.state, self.fam = state, fam
        c, p = self.cfg, self.cfg.family_params
        self.shape = q4_shape(c)
        kern = step.kernel
        self.hc = Hc(kern, step.launcher, self.shape, hc_up_types(step.weights))
        self.qsa = Qsa(step.launcher, self.shape, step.kv)
        self.gdn = Gdn(kern, step.launcher, self.shape)
        # the two-type kernels of the shared-input launches (GDN projections, QSA's q / gate / k / v), compiled now
        # (before any capture)
        shared = [self.qsa_projections(L) for L in step.weights.layers if L.gdn is None]
        if self.gdn.gk is not None:
            shared += [Gdn.projections(L.gdn) for L in step.weights.layers if L.gdn is not None]
        load_mixed(step.kernels, mixed_pairs(shared))
        self.ple_op = Ple(kern, step.launcher, self.shape)
        N, D, H = c.n_embd, self.shape.D, self.shape.H
        f32 = lambda n: cp.zeros(n, dtype=cp.float32)      # noqa: E731
        with step.stream:
            self.xs = f32(D)
            self.o = f32(N)
            self.inj_attn, self.inj_ffn = f32(H), f32(H)
            self.hc_sc = self.hc.scratch()
            self.pending = None         # the last half-layer's HC write (o, iota), until the next read runs it
            self.gdn_sc = self.gdn.scratch(1)
            self.qsa_sc = self.qsa.decode_scratch()
            self.gate = f32(c.n_head * c.head_dim)
            self.ple_layer = next((L.ple for L in step.weights.layers if L.ple is not None), None)
            if self.ple_layer is not None:
                import cupyx
                P = p.n_ple_heads * p.ple_width
                self.eta = f32(P)
                self.eta_host = cupyx.empty_pinned((P,), dtype=np.float32)
                self.eta_host[:] = 0
                self.ple_sc = self.ple_op.scratch(1)

    def set_inputs(self, token: int, pos: int) -> None:
        """The step's token's n-gram rows into the pinned buffer (and the PLE context moves on by it)."""
        if self.ple_layer is None:
            return
        eta, self.state.ids = self.fam.ple_rows([token], self.state.ids)
        self.eta_host[:] = eta.reshape(-1)

    def embed(self):
        self.pending = None
        super().embed()                                        # st.x = the token's embedding row
        self.hc.broadcast(self.step.x, self.xs, 1)             # every stream a copy
        if self.ple_layer is not None:
            cp.cuda.runtime.memcpyAsync(int(ptr(self.eta)), self.eta_host.ctypes.data, self.eta.nbytes,
                                        cp.cuda.runtime.memcpyHostToDevice, cp.cuda.get_current_stream().ptr)

    # Each half-layer's HC write (x_c += iota_c o) waits for the next read and runs in its GroupNorm's launch
    # (engine/cuda/hc.py read_decode: write_norm, one mv_many of [W_down; W_inj], up_mix): 3 launches a half-layer
    # instead of 5. The PLE layer reads x before its read (its query norm), so the write lands before it there.
    def hc_read(self, w, y, iota) -> None:
        o, iota_prev = self.pending or (None, None)
        self.pending = None
        self.hc.hk.read_decode(self.step.launcher, self.xs, w, self.hc_sc, y, iota=iota, o=o, iota_prev=iota_prev)

    def hc_flush(self) -> None:
        if self.pending is not None:
            o, iota = self.pending
            self.pending = None
            self.hc.write(self.xs, o, iota, rows=1)

    def mixer(self, li):
        st = self.step
        L = st.weights.layers[li]
        if L.ple is not None:
            self.hc_flush()
            self.ple_op.decode(L.ple, self.eta, self.xs, self.state.ple_conv, self.ple_sc)
        self.hc_read(L.hc_attn, st.x, self.inj_attn)
        if L.gdn is not None:
            g = L.gdn
            self.gdn.decode(g, st.x, self.state.conv(g.slot), self.state.delta(g.slot), self.gdn_sc, keeps=st.keeps)
            st.launcher.mv(g.out, self.gdn_sc.out, self.o, tag="gdn_out")
        else:
            self.attention_qsa(li, L)
        self.pending = (self.o, self.inj_attn)
        self.hc_read(L.hc_ffn, st.x, self.inj_ffn)    # the FFN input, in st.x (the write above fused in)

    @staticmethod
    def qsa_projections(L) -> tuple:
        """A QSA layer's projections of its block input, in attention_qsa's order (one mv_many)."""
        return L.wq, L.qsa.gate, L.wk, L.wv

    def attention_qsa(self, li, L) -> None:
        st, mv = self.step, self.step.launcher
        mv.mv_many(self.qsa_projections(L), st.x, (self.q, self.gate, self.k_new, self.v_new), tag="qkv", mixed=True)
        # K/V stored at state[1], att = the attention over the kept positions * sigmoid(gate)
        self.qsa.decode(li, L, self.q, self.k_new, self.v_new, self.gate, st.x, st.rope, st.state, self.att,
                        self.qsa_sc)
        mv.mv(L.wo, self.att, self.o, tag="wo")

    def ffn(self, li):
        L = self.step.weights.layers[li]
        _zero(self.o)
        self.experts(li, L, out=self.o)     # routed + sigmoid-gated shared expert of st.x (no norm) into o
        self.pending = (self.o, self.inj_ffn)      # written by the next read (hc_read)

    def output(self):
        """The final HC read (no inject) is the output norm: its y into st.x, then the head's mat-vec."""
        st = self.step
        self.hc_read(st.weights.hc_out, st.x, None)     # the last FFN write fused in
        st.launcher.mv(st.weights.output, st.x, st.logits, tag="output")


# --- the prompt layer -------------------------------------------------------------------------------------------

class Q4Prompt(MoePrompt):
    """The prompt layer program for a chunk of T tokens: the residual streams (T, H N) are a chunk temporary of the
    family's (the pass's x holds the embeddings at the start and the final HC read's y at the end, where the output
    head reads them); matrices through the pass's fp32 projections (linear), experts through its grouped GEMMs."""

    def __init__(self, prefill, state: Q4State, fam: Qwen4ExpFamily):
        super().__init__(prefill)
        self.state, self.fam = state, fam
        self.shape = q4_shape(self.cfg)
        kern = prefill.kernels
        self.hc = Hc(kern, prefill.launcher, self.shape, hc_up_types(prefill.weights), prefill)
        self.qsa = Qsa(prefill.launcher, self.shape, prefill.kv, prefill.chunk)
        has_gdn = any(L.gdn is not None for L in prefill.weights.layers)
        with prefill.step.stream:       # its prompt scratch: prompt_buffers' "gdn_scratch"
            self.gdn = Gdn(kern, prefill.launcher, self.shape, prompt_chunk=prefill.chunk if has_gdn else 0)
        self.ple_op = Ple(kern, prefill.launcher, self.shape)
        self.xs = self.eta = None
        self.has_ple = any(L.ple is not None for L in prefill.weights.layers)
        self._raw = None              # the chunk's raw rows in VRAM (grown to the largest chunk's)
        self._facts = {}
        if self.has_ple:
            import cupyx
            self._dev = dev = cp.cuda.Device()      # the worker thread allocates and waits on this device's behalf

            def pinned(n):
                with dev:
                    return cupyx.empty_pinned((n,), dtype=np.uint8)
            self.ahead = fam.rows_ahead(pinned)

    def begin_chunk(self, tokens, pos0: int) -> None:
        """Before the chunk's first layer (prefill.py): the chunk's n-gram rows (gathered ahead when read_ahead named
        this chunk), uploaded raw from their pinned buffer and dequantized on the GPU into eta (T, P); the PLE
        context moves on."""
        if not self.has_ple:
            return
        g = self.ahead.take(tokens, self.state.ids)
        self.state.ids = g.after
        self.fam.rows.count(g.lookups, g.hits)
        rows = self.fam.rows
        n = g.raw.size
        if self._raw is None or self._raw.size < n:
            self._raw = None
            self._raw = cp.empty(n, dtype=cp.uint8)
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(int(ptr(self._raw)), g.raw.ctypes.data, n, cp.cuda.runtime.memcpyHostToDevice,
                                    stream.ptr)
        done = cp.cuda.Event(disable_timing=True)
        done.record(stream)

        def fence(dev=self._dev):
            with dev:
                done.synchronize()
        self.ahead.fence(g, fence)                # the pinned buffer is written again only after the copy
        self.eta = self.p.dequant(int(ptr(self._raw)), int(rows.tensor.qtype), rows.row_bytes, g.lookups,
                                  rows.width).reshape(len(tokens), -1)
        # wait: what begin_chunk spent on the rows (all of the gather when it was not ahead)
        self._facts = dict(rows_gather_ms=g.gather_s * 1000, rows_wait_ms=(g.wait_s if g.ahead else g.gather_s) * 1000,
                           rows_ahead=g.ahead)

    def read_ahead(self, tokens) -> None:
        """After begin_chunk: the next chunk will be `tokens`; gather its rows on the worker meanwhile."""
        if self.has_ple and len(tokens):
            self.ahead.ahead(tokens, self.state.ids)

    def host_facts(self) -> dict:
        """The last chunk's PLE rows: the gather's ms, how long begin_chunk spent on them, whether they ran ahead."""
        return dict(self._facts)

    def layer(self, li, layer, x, xn, T: int, pos0: int) -> None:
        p, L, H = self.p, layer, self.shape.H
        proj = lambda W, X: p.linear(W, X)     # noqa: E731  (fp32: T rows of X @ W^T)
        if li == 0:
            self.xs = cp.empty((T, self.shape.D), dtype=cp.float32)
            self.hc.broadcast(x, self.xs, T)
        xs = self.xs
        if L.ple is not None:
            self.ple_op.prompt(L.ple, self.eta, xs, self.state.ple_conv, T, proj)
            p._mark("other")
        inj = cp.empty((T, H), dtype=cp.float32)
        y = self.hc.read_rows(xs, L.hc_attn, inj, T)
        p._mark("other")
        if L.gdn is not None:
            g = L.gdn
            o = proj(g.out, self.gdn.prompt(g, y, self.state.conv(g.slot), self.state.delta(g.slot), T, proj))
            p._mark("gdn")
        else:
            o = self.attention_qsa(li, L, y, T, pos0, proj)
        self.hc.write(xs, o, inj, rows=T)
        y = self.hc.read_rows(xs, L.hc_ffn, inj, T)
        p._mark("other")
        o = cp.zeros((T, self.cfg.n_embd), dtype=cp.float32)
        self.moe(li, L, y, o, T)
        self.hc.write(xs, o, inj, rows=T)
        if li == self.cfg.n_layer - 1:     # the final HC read into the pass's x, which the output head reads
            x[...] = self.hc.read_rows(xs, p.weights.hc_out, None, T)
            self.xs = None
            p._mark("other")

    def attention_qsa(self, li, L, y, T: int, pos0: int, proj):
        p = self.p
        q, gate, k, v = (proj(W, y) for W in (L.wq, L.qsa.gate, L.wk, L.wv))
        p._mark("dense")
        att = self.qsa.prompt(li, L, q, k, v, gate, y, p.step.rope, T, pos0, proj)     # gated
        p._mark("attention")
        o = proj(L.wo, att)
        p._mark("dense")
        return o

    def moe(self, li, L, y, o, T: int) -> None:
        """o += the routed experts of y (softmax top k, renormalised) and the shared expert times sigmoid(w_sg . y)."""
        p = self.p
        logits = self.router_logits(li, L, y, T)
        p.route(li, logits, T, True)
        p.experts(li, y, o, T, self.expert_gemms(li, L, p.layout.layer(li)))
        sh = p.ffn(L.sh_gate, L.sh_up, L.sh_down, y)
        sh *= 1.0 / (1.0 + cp.exp(-p.linear(L.sh_gate_inp, y)))
        o += sh
        p._mark("dense")
