"""A decode step over a window of T = 1..MAX_WINDOW tokens at consecutive positions (a speculative verify window,
issue 34 item 4): the T tokens go through every layer in one launch sequence, with logits and the greedy pick for
every position. One CUDA graph per window length, captured the first time that length runs. By default each launch
runs the one-token kernel's blocks for all T tokens side by side (`dense_mode` / `expert_mode` "tokens": window.cu's
mv_tok / mv3_tok / swiglu_tok, moe.cu's kernels with T in their grid), so a matrix comes from HBM about once and the
other tokens' reads of it from L2; "shared" / "union" are window.cu's token-serial kernels (each weight row and each
routed expert loaded once a warp, the tokens' sums one after the other), which the H200 measured at about T
one-token steps a window (bench.decode --window: 4 tokens 14.3 ms against 3.7 ms for one).

It is built over a one-token DecodeStep (engine/cuda/decode.py) and shares its weights, KV cache, expert cache and
pointer table, RoPE table and its attention's split buffers; it owns the window's buffers (T rows of each of the
step's) and reads the tokens and the first position from mapped host memory, so one graph serves every window of
its length.

Per layer, in the order and with the per-token arithmetic of the one-token step (families/moe.py MoeDecode), so that
token t's logits are the ones a one-token step at position pos0 + t gives (within fp32 rounding where the compiler
contracts a kernel's Q4_K sums otherwise):
  - Q/K/V for the T tokens (mv3, or mv per matrix when their types differ);
  - attention (attn_mode "window"): the T tokens' K/V stored at pos0 + t in one launch, then one attn_split launch of
    the T queries, token t over positions 0 .. pos0 + t; or ("tokens", and gpt-oss's window rings) the one-token
    fused launch once a token, on state row t;
  - wo; the router (router_win: the T tokens' logits, each one's routing as router_fused routes it, counts and hit
    statistics as one-token steps count them, and outside "tokens" mode the union of the window's routed experts);
    the experts' gate/up and down (experts(): per (token, expert) pair, or gate/up once per expert of the union);
    the shared expert; or the dense FFN;
  - the output head and an argmax per token.
Experts outside VRAM are read in place through the table, as in the one-token step. The prefetch does not run in a
window (its predictions are one token's), nor do the memory modes' paged layers: the backend keeps one-token steps
there (CUDABackend.window_step).

The K/V written past the accepted prefix of a window stays in the cache until later positions overwrite it (the
cache's length is the host's n_cached; gpt-oss's window layers write their ring rows as one-token steps do). The moe
family (WindowStep) and gpt-oss (families/gptoss.py OssWindowStep: sinks, windows, the biases, SWIGLU_OAI) have a
window program (the family's window_program());
the hybrids keep one step a token (their GDN state would need the state after every position of the window, which
their decode kernels do not keep yet), as do the other cases `why_not` names.
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from engine.backend import MAX_WINDOW
from engine.cuda.kernels import Kernels
from engine.cuda.kv import AS_MAX_ROWS, DecodeAttention
from engine.cuda.launch import (BIG_ROWS, F32, I32, I64, MV_WARPS, NULL, SMEM_DEFAULT, SMEM_MAX, U64, MappedInts,
                                ptr, staged_bytes)

WIN_FILES = ("window.cu",)
SERIAL_FILES = ("window_serial.cu",)     # the token-serial kernels: loaded when a mode asks for them
WIN_MAX_PAIRS = 128         # window.cu: (token, expert) pairs a window; router_win's block (4 warps)
WIN_REC = 2 + MAX_WINDOW    # window.cu: ints of one union record (expert, count, pairs)
DOWN_STAGE_MAX = 100 * 1024     # moe_down's optional staging limit (families/moe.py MoeDecode.experts)
ROW_STATE = 8               # ints of one token's state row (the one-token step's state layout)
Q4_K, MXFP4 = 12, 39        # ggml type ids (engine/cuda/quant_types.py)


# What a window launch of K tokens costs in one-token steps (the window graph's replay over the one-token graph's,
# bench.decode --window, every expert in VRAM: docs/experiments.md "verify windows on the merged tree"), for K
# measured; others interpolated (window_cost). Empty: the rule counts a step a token and offers no drafts. The H200,
# Qwen3-30B-A3B Q4_K_M recipe: K = 2 and 4 with the window attention in one pass (the default kernels); K = 8 from
# the run before it (attention a launch a token), so the rule errs towards shorter windows there.
MEASURED_COST: dict[int, float] | None = {2: 1.636, 4: 2.684, 8: 5.227}


def window_cost(n: int, max_t: int, measured: dict[int, float] | None = None) -> float:
    """One-token steps a window of n tokens costs as launches of at most max_t (the measured table, linear between
    its lengths; n where there is none)."""
    table = MEASURED_COST if measured is None else measured
    if not table:
        return float(n)
    pts = sorted({1: 1.0, **table}.items())

    def one(m: int) -> float:
        for (k0, c0), (k1, c1) in zip(pts, pts[1:]):
            if k0 <= m <= k1:
                return c0 + (c1 - c0) * (m - k0) / (k1 - k0)
        k0, c0 = pts[-1]
        return c0 * m / k0          # past the table: per token as its longest window
    full, rest = divmod(n, max_t)
    return full * one(max_t) + (one(rest) if rest else 0.0)


def why_not(backend) -> str | None:
    """Why this backend keeps one step a token for a window (None: window steps run)."""
    if not backend.opts.windows:
        return "--tune windows=off"
    prog = backend.family.window_program()
    if prog is None or type(backend.step.layers) is not prog[0]:
        return f"the {backend.family.name} family's layers have no window program"
    if backend.recurrent:
        return "a recurrent state would need a state per window position"
    if backend.mem is not None:
        return "the memory modes run the step layer by layer"
    cfg = backend.config
    if cfg.is_moe:
        if any(backend.layout.layer(li).qt_up >= 0 for li in range(cfg.n_layer)):
            return "a layer's expert gate and up differ in type"
        if MAX_WINDOW * cfg.n_expert_used > WIN_MAX_PAIRS:
            return f"{cfg.n_expert_used} experts a token exceed the window's {WIN_MAX_PAIRS} pairs"
    return None


def build(step, family) -> "WindowStep":
    """The window step of the family's program over the one-token step (why_not has said yes)."""
    return family.window_program()[1](step)


def window_tokens(cfg) -> int:
    """The most tokens one window launch takes: MAX_WINDOW, fewer when their staged inputs would not fit in shared
    memory (the expert gate/up stages every token of a slot)."""
    return max(1, min(MAX_WINDOW, SMEM_MAX // staged_bytes(cfg.n_embd)))


def ld(a) -> int:
    """Floats from one row of a (rows, n) float32 array to the next."""
    return a.strides[0] // 4


def down_smem(T: int, k: int, n_ff: int, pairs: bool) -> int:
    """moe_down_win's dynamic shared memory: each warp's partials, T * k * (n_ff / 32 or 32) floats."""
    return MV_WARPS * T * k * (n_ff // 32 if pairs else 32) * 4


class WindowStep:
    biased_router = False       # the router's logits get a bias, and its top k a softmax of their own (gpt-oss)
    files = WIN_FILES           # the kernel files of its table
    # shared memory a dense window launch stages its tokens in: two blocks an SM at least (not measured yet; the
    # expert gate/up and the router stage all T tokens whatever this is)
    stage_budget = SMEM_MAX // 2
    # How the window's tokens share the kernels. "tokens": the one-token kernels' blocks for every token side by side
    # (grid y / z = T: window.cu mv_tok / mv3_tok / swiglu_tok, moe.cu's own moe_gate_up / moe_down), the weights'
    # second and later reads from L2. "shared" / "union": window.cu's token-serial kernels, each weight row (each
    # routed expert) loaded once a warp and the tokens' sums one after the other: the H200 measured those at about T
    # one-token steps a window (the one-token step is bound by latency, not by HBM: 12% of its bandwidth).
    dense_mode = "tokens"       # "tokens" | "shared"
    expert_mode = "tokens"      # "tokens" | "union" | "serial" (experts())
    # "window": the T tokens' K/V stored in one launch (qk_rope_store), then one attn_split launch of n_q = T queries
    # (causal among them) and its merge: 2-3 launches a layer instead of 1-2 a token (the one-token step's fused
    # launch is ~6 us at short contexts, 48 layers: at K = 4 the per-token launches alone were ~1.7 ms, half a step).
    # "tokens": the one-token step's fused launch once a token (token t's K/V written, then its query over 0 .. pos0
    # + t). Window layers' rings (gpt-oss) keep "tokens": kv.store takes no ring at a device position.
    attn_mode = "window"        # "window" | "tokens"

    def __init__(self, step, kernels: Kernels | None = None):
        self.step = step
        self.cfg = c = step.cfg
        self.kernels = step.kernels
        self.kw = kernels or Kernels(step.kernels.qtype_ids, self.files)
        self._serial = kernels      # the token-serial kernels' table (the tests pass one table for all)
        self.stream = step.stream
        self.layers = step.layers               # the one-token layer program: its attention is shared
        self.max_t = window_tokens(c)
        W = self.max_t
        f32 = lambda *shape: cp.zeros(shape, dtype=cp.float32)      # noqa: E731
        top_k = max(c.n_expert_used, 1)
        with self.stream:
            self.x = f32(W, c.n_embd)
            self.q = f32(W, c.n_head * c.head_dim)
            self.k_new = f32(W, c.n_head_kv * c.head_dim)
            self.v_new = f32(W, c.n_head_kv * c.head_dim)
            self.att = f32(W, c.n_head * c.head_dim)
            self.rlogits = f32(W, max(c.n_expert, 1))
            self.ids = cp.zeros((W, top_k), dtype=cp.int32)
            self.wts = f32(W, top_k)
            # the routed experts' h (T, k, n_ff) or the dense FFN's (T, n_ff), flat: views of each layer's width
            self.h = f32(W * max(c.n_ff, top_k * c.n_ff_exp, 8))
            self.h2 = f32(W * max(c.n_ff_shexp, 8))
            self.sgate = f32(W)
            self.logits = f32(W, c.n_vocab)
            self.state = cp.zeros((W, ROW_STATE), dtype=cp.int32)
            self.uni = cp.zeros(1 + WIN_MAX_PAIRS * WIN_REC, dtype=cp.int32)
        self.tokens = MappedInts(W)     # the window's ids: read by win_setup and the embedding
        self.params = MappedInts(2)     # [1]: the first position (common.cuh P_POS)
        self.out = MappedInts(2 * W)    # per token: the greedy pick, NaN count (argmax_finish)
        self.graphs: dict[int, object] = {}
        self.wattn = self._window_attention()

    def _window_attention(self):
        """A DecodeAttention of n_q up to max_t over the step's cache, sharing its kernels and chunk bound (None: the
        one-token attention serves every token, attn_mode "tokens" only)."""
        a, kv = self.layers.attn, self.step.kv
        if not a.split or a.variant.fused_only or any(r != kv.max_ctx for r in kv.rows):
            return None
        n_q = min(self.max_t, AS_MAX_ROWS // a.group)       # query rows a KV head a launch: n_q * group <= 64
        with self.stream:
            return DecodeAttention(self.step.kernels, self.cfg, kv, n_split=a.n_split, fused=False, variant=a.variant,
                                   n_q_max=n_q, split=True)

    serial_files = SERIAL_FILES

    def serial(self, name: str, qt=None):
        """A token-serial kernel (window_serial.cu; gpt-oss: window_oss.cu), its table compiled at the first ask."""
        if self._serial is None:
            self._serial = Kernels(self.kw.qtype_ids, self.serial_files)
        return self._serial(name, qt)

    # --- launches --------------------------------------------------------------------------------------------
    def _smem(self, f, nbytes: int) -> int:
        if nbytes > SMEM_MAX:
            raise ValueError(f"a window launch needs {nbytes} bytes of shared memory (> {SMEM_MAX})")
        if nbytes > SMEM_DEFAULT and getattr(f, "max_dynamic_shared_size_bytes", 0) < nbytes:
            f.max_dynamic_shared_size_bytes = nbytes
        return nbytes

    def _groups(self, T: int, n: int):
        """(first token, tokens) of the launches a staged input of n floats takes: as many tokens a launch as fit in
        stage_budget bytes (a block staging all 8 tokens of a 4096-wide input would leave one block an SM; a second
        launch re-reads the matrix from L2)."""
        g = max(1, min(T, self.stage_budget // staged_bytes(n)))
        return [(t, min(g, T - t)) for t in range(0, T, g)]

    def mv(self, W, x, y, T, bias=None, gate=None, accumulate=False, norm=None):
        """y[t] (+)= W @ xn_t for the window's T rows of x (Launcher.mv's staging rule and rows a warp)."""
        stage = norm is not None or staged_bytes(W.cols) <= SMEM_DEFAULT
        rpw = min(8, max(1, W.rows // BIG_ROWS))
        grid = ((W.rows + MV_WARPS * rpw - 1) // (MV_WARPS * rpw),)
        if self.dense_mode == "tokens":
            f = self.kw("mv_tok", W.qt)
            f((T, grid[0]), (32 * MV_WARPS,),       # a block's T tokens dispatched together (window.cu)
              (U64(W.ptr), I64(W.row_bytes), ptr(x), I32(ld(x)), ptr(y), I32(ld(y)), ptr(bias), ptr(gate),
               I32(W.rows), I32(W.cols), I32(1 if accumulate else 0), ptr(norm), F32(self.cfg.rms_eps),
               I32(1 if stage else 0), I32(rpw)),
              shared_mem=self._smem(f, staged_bytes(W.cols)) if stage else 0)
            return
        f = self.serial("mv_win", W.qt)
        groups = self._groups(T, W.cols) if stage else [(0, T)]
        for t0, n in groups:
            sm = self._smem(f, n * staged_bytes(W.cols)) if stage else 0
            f(grid, (32 * MV_WARPS,),
              (U64(W.ptr), I64(W.row_bytes), ptr(x[t0]), I32(ld(x)), ptr(y[t0]), I32(ld(y)), ptr(bias),
               ptr(gate[t0:]) if gate is not None else NULL, I32(W.rows), I32(W.cols), I32(1 if accumulate else 0),
               ptr(norm), F32(self.cfg.rms_eps), I32(1 if stage else 0), I32(rpw), I32(n)),
              shared_mem=sm)

    def mv3(self, Ws, x, ys, biases, T, norm):
        """Q, K and V of the T tokens: one launch when they share a type and width (Launcher.mv3), else three."""
        if len({(W.qt, W.cols, W.row_bytes) for W in Ws}) != 1:
            for W, y, b in zip(Ws, ys, biases):
                self.mv(W, x, y, T, bias=b, norm=norm)
            return
        n = sum(W.rows for W in Ws)
        if self.dense_mode == "tokens":
            f = self.kw("mv3_tok", Ws[0].qt)
            f((T, (n + MV_WARPS - 1) // MV_WARPS), (32 * MV_WARPS,),
              (*(U64(W.ptr) for W in Ws), I64(Ws[0].row_bytes), ptr(x), I32(ld(x)), ptr(norm),
               F32(self.cfg.rms_eps), *(ptr(y) for y in ys), *(ptr(b) for b in biases), *(I32(W.rows) for W in Ws),
               I32(Ws[0].cols)),
              shared_mem=self._smem(f, staged_bytes(Ws[0].cols)))
            return
        f = self.serial("mv3_win", Ws[0].qt)
        for t0, m in self._groups(T, Ws[0].cols):
            f(((n + MV_WARPS - 1) // MV_WARPS,), (32 * MV_WARPS,),
              (*(U64(W.ptr) for W in Ws), I64(Ws[0].row_bytes), ptr(x[t0]), I32(ld(x)), ptr(norm),
               F32(self.cfg.rms_eps), *(ptr(y[t0]) for y in ys), *(ptr(b) for b in biases),
               *(I32(W.rows) for W in Ws), I32(Ws[0].cols), I32(m)),
              shared_mem=self._smem(f, m * staged_bytes(Ws[0].cols)))

    def swiglu(self, Wg, Wu, x, h, T, norm):
        """h[t] = silu(Wg @ xn_t) * (Wu @ xn_t); h: (at least T, Wg.rows)."""
        if h.shape[1] != Wg.rows:
            raise ValueError(f"swiglu's h rows hold {h.shape[1]} values, the FFN {Wg.rows}")
        if self.dense_mode == "tokens":
            f = self.kw("swiglu_tok", Wg.qt)
            f((T, (Wg.rows + MV_WARPS - 1) // MV_WARPS), (32 * MV_WARPS,),
              (U64(Wg.ptr), U64(Wu.ptr), I64(Wg.row_bytes), ptr(x), I32(ld(x)), ptr(norm), F32(self.cfg.rms_eps),
               ptr(h), I32(Wg.rows), I32(Wg.cols)),
              shared_mem=self._smem(f, staged_bytes(Wg.cols)))
            return
        f = self.serial("swiglu_win", Wg.qt)
        for t0, m in self._groups(T, Wg.cols):
            f(((Wg.rows + MV_WARPS - 1) // MV_WARPS,), (32 * MV_WARPS,),
              (U64(Wg.ptr), U64(Wu.ptr), I64(Wg.row_bytes), ptr(x[t0]), I32(ld(x)), ptr(norm),
               F32(self.cfg.rms_eps), ptr(h[t0]), I32(Wg.rows), I32(Wg.cols), I32(m)),
              shared_mem=self._smem(f, m * staged_bytes(Wg.cols)))

    def rows(self, buf, width: int):
        """buf's leading values as (max_t, width) rows."""
        return buf[:self.max_t * width].reshape(self.max_t, width)

    # --- the program -----------------------------------------------------------------------------------------
    def enqueue(self, T: int) -> None:
        """The whole window's launches on the current stream, for T tokens."""
        if not 1 <= T <= self.max_t:
            raise ValueError(f"a window launch takes 1 to {self.max_t} tokens, got {T}")
        c, K = self.cfg, self.kernels
        self.kw("win_setup")((1,), (32,), (self.tokens.dptr, self.params.dptr, ptr(self.state), I32(T)))
        te = self.step.weights.tok_embd
        K("embed", te.qt)((T,), (256,), (U64(te.ptr), I64(te.row_bytes), self.tokens.dptr, self.params.dptr,
                                         ptr(self.state), ptr(self.x), I32(c.n_embd)))
        for li, layer in enumerate(self.step.weights.layers):
            self.attention(li, layer, T)
            if c.is_moe:
                self.router(li, layer, T)
                self.experts(li, layer, T)
            else:
                h = self.rows(self.h, layer.w_gate.rows)
                self.swiglu(layer.w_gate, layer.w_up, self.x, h, T, layer.ffn_norm)
                self.mv(layer.w_down, h, self.x, T, accumulate=True)
        w = self.step.weights
        self.mv(w.output, self.x, self.logits, T, norm=w.output_norm)
        for t in range(T):
            K("argmax_word")((264,), (256,), (ptr(self.logits[t]), I32(c.n_vocab), ptr(self.state[t])))
            K("argmax_finish")((1,), (1,), (ptr(self.state[t]), U64(int(self.out.dptr) + 8 * t)))

    def attention(self, li, layer, T):
        c = self.cfg
        scale = F32(c.attn_scale or 1.0 / np.sqrt(c.head_dim))
        self.mv3((layer.wq, layer.wk, layer.wv), self.x, (self.q, self.k_new, self.v_new),
                 (layer.bq, layer.bk, layer.bv), T, layer.attn_norm)
        wa = self.wattn
        if wa is not None and self.attn_mode == "window":
            # the T tokens' K/V at state row 0's position + t (q rotated in place), then their queries at once
            wa.store(self.kernels, li, self.q, self.k_new, self.v_new, layer.q_norm, layer.k_norm, self.step.rope,
                     self.state, pos0=0, T=T)
            for t0 in range(0, T, wa.n_q_max):     # (one launch unless group * T > 64 query rows)
                wa.attend(self.kernels, li, self.q[t0:], self.att[t0:], self.state, scale,
                          n_q=min(wa.n_q_max, T - t0), pos0=t0)
        else:
            attn = self.layers.attn
            for t in range(T):      # token t's K/V stored, then its query over 0 .. pos0 + t (state row t)
                attn.step(self.kernels, li, self.q[t], self.k_new[t], self.v_new[t], layer.q_norm, layer.k_norm,
                          self.step.rope, self.att[t], self.state[t], scale)
        self.mv(layer.wo, self.att, self.x, T, bias=self.out_bias(layer), accumulate=True)

    def out_bias(self, layer):
        """The output projection's bias (None: none; gpt-oss's attn_output.bias)."""
        return None

    def router(self, li, layer, T):
        """router_win: the T tokens' router logits, each token's routing (router_fused's, counts and hit statistics
        included) and the window's expert union (self.uni) in one launch."""
        st, c, cache = self.step, self.cfg, self.step.cache
        R = layer.router
        f = self.kw("router_win", R.qt)
        table = (U64(cache.table.data.ptr + 8 * li * c.n_expert), U64(cache.slot_lo), U64(cache.slot_hi),
                 U64(cache.counts.data.ptr + 4 * li * c.n_expert), ptr(cache.stats))
        f(((R.rows + MV_WARPS - 1) // MV_WARPS,), (WIN_MAX_PAIRS,),
          (U64(R.ptr), I64(R.row_bytes), ptr(self.x), I32(ld(self.x)), ptr(layer.ffn_norm), F32(c.rms_eps),
           I32(R.cols), ptr(self.rlogits), I32(c.n_expert), I32(c.n_expert_used),
           I32(1 if c.expert_weights_norm or self.biased_router else 0), F32(c.expert_weights_scale),
           ptr(self.ids), ptr(self.wts), *table,
           ptr(st.counter), NULL if self.expert_mode == "tokens" else ptr(self.uni), I32(T),
           ptr(self.logit_bias(layer))),
          shared_mem=self._smem(f, T * staged_bytes(R.cols)))

    def logit_bias(self, layer):
        """The router's bias added to its logits (None: none; gpt-oss's OssWindowStep has one)."""
        return None

    def experts(self, li, layer, T):
        """The routed experts of the window and the shared expert, added to x in the one-token step's order:
        moe_down's sums, then the shared expert's. expert_mode: "tokens", moe.cu's kernels with the T tokens in the
        grid (a block a (token, expert) pair: an expert two tokens chose is read twice, the second time mostly from
        L2); "union", the gate/up of each expert of the window's union read once for its tokens (window_serial.cu
        moe_gate_up_win: a warp's row against each of those tokens in turn, usually one or two), the down as
        "tokens" (a third of the bytes; a warp a (token, row) as the one-token moe_down); "serial", both over the
        union (moe_down_win: a warp walks every pair of the window for its row)."""
        st, c, mv = self.step, self.cfg, self.step.launcher
        blob = st.layout.layer(li)
        table = U64(st.cache.table.data.ptr + 8 * li * c.n_expert)
        k, norm, x = c.n_expert_used, layer.ffn_norm, self.x
        mode = self.expert_mode
        if mode not in ("tokens", "union", "serial"):
            raise ValueError(f"expert_mode is tokens, union or serial, not {mode!r}")
        gate_up = (table, None, I64(blob.up_off), I64(blob.rb_gate_up), ptr(x), ptr(norm), F32(c.rms_eps),
                   ptr(self.h), I32(blob.n_ff), I32(c.n_embd), I32(k))
        rows = (blob.n_ff + MV_WARPS - 1) // MV_WARPS
        if mode == "tokens":
            f = self.kernels("moe_gate_up", blob.qt_gate_up)
            f((rows, k, T), (32 * MV_WARPS,), (gate_up[0], ptr(self.ids), *gate_up[2:]),
              shared_mem=mv.smem(f, c.n_embd, True))
        else:
            f = self.serial("moe_gate_up_win", blob.qt_gate_up)
            f((rows, min(T * k, c.n_expert)), (32 * MV_WARPS,), (gate_up[0], ptr(self.uni), *gate_up[2:]),  # slots
              shared_mem=self._smem(f, T * staged_bytes(c.n_embd)))
        shared = layer.sh_up is not None
        if shared:      # the shared expert reads x before moe_down adds to it
            if layer.sh_gate_inp is not None:
                self.mv(layer.sh_gate_inp, x, self.sgate[:, None], T, norm=norm)
            self.swiglu(layer.sh_gate, layer.sh_up, x, self.rows(self.h2, layer.sh_gate.rows), T, norm)
        if mode == "serial":
            f = self.serial("moe_down_win", blob.qt_down)
            stage = staged_bytes(k * blob.n_ff) <= DOWN_STAGE_MAX
            pairs = stage and blob.qt_down == Q4_K      # moe_down's (expert, unit) pairs
            f(((c.n_embd + MV_WARPS - 1) // MV_WARPS,), (32 * MV_WARPS,),
              (table, ptr(self.uni), ptr(self.wts), I64(blob.down_off), I64(blob.rb_down), ptr(self.h), ptr(x),
               I32(c.n_embd), I32(blob.n_ff), I32(k), I32(T), I32(1 if stage else 0)),
              shared_mem=self._smem(f, down_smem(T, k, blob.n_ff, pairs)))
        else:
            f = self.kernels("moe_down", blob.qt_down)
            sm = mv.smem(f, k * blob.n_ff, False, optional_max=DOWN_STAGE_MAX)
            f(((c.n_embd + MV_WARPS - 1) // MV_WARPS, T), (32 * MV_WARPS,),
              (table, ptr(self.ids), ptr(self.wts), I64(blob.down_off), I64(blob.rb_down), ptr(self.h), ptr(x),
               I32(c.n_embd), I32(blob.n_ff), I32(k), I32(1 if sm else 0)),
              shared_mem=sm)
        if shared:
            self.mv(layer.sh_down, self.rows(self.h2, layer.sh_gate.rows), x, T,
                    gate=self.sgate if layer.sh_gate_inp is not None else None, accumulate=True)

    # --- running ---------------------------------------------------------------------------------------------
    def record(self, T: int):
        s = self.stream
        s.synchronize()
        s.begin_capture()
        try:
            with s:
                self.enqueue(T)
        finally:
            graph = s.end_capture()
        return graph

    def launch(self, tokens, pos0: int, use_graph: bool = True) -> None:
        """Enqueue the window (its length's graph, captured now the first time); result() waits for it."""
        T = len(tokens)
        if not 1 <= T <= self.max_t:
            raise ValueError(f"a window launch takes 1 to {self.max_t} tokens, got {T}")
        self.tokens.view[:T] = tokens
        self.params.view[1] = pos0
        if not use_graph:
            with self.stream:
                self.enqueue(T)
            return
        graph = self.graphs.get(T)
        if graph is None:
            graph = self.graphs[T] = self.record(T)
        graph.launch(self.stream)

    def result(self, T: int) -> list[tuple[int, int]]:
        """(greedy id, NaN count) after each of the last window's T tokens; waits for it."""
        self.stream.synchronize()
        v = self.out.view
        return [(int(v[2 * t]), int(v[2 * t + 1])) for t in range(T)]

    def close(self):
        self.graphs = {}
        for m in (self.tokens, self.params, self.out):
            m.close()

