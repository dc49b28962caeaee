"""The prompt pass, first version: a chunk of tokens at once, every projection as one GEMM (cuBLAS through CuPy) on
weights dequantized to float32 scratch, attention as batched GEMMs over the fp16 KV cache, and the experts grouped
by routing so each routed expert's tokens run together (its weights read through the pointer table: from its VRAM
slot, or in place from the pinned arena)."""
from __future__ import annotations

import cupy as cp
import numpy as np

from engine.cuda.chunk_plan import DEQUANT_SCRATCH_ELEMS
from engine.cuda.launch import I32, I64, U64, F32, NULL, ptr

SCORE_ELEMS = 1 << 27          # attention scores per batch of KV heads (512 MiB)


class Prefill:
    def __init__(self, step):
        self.step = step
        self.k = step.k
        self.cfg = step.cfg
        self.w = step.w
        self.kv = step.kv
        self.cache = step.cache
        self.layout = step.layout
        self.L = step.L

    def dequant(self, addr: int, qt: int, row_bytes: int, rows: int, cols: int) -> cp.ndarray:
        out = cp.empty((rows, cols), dtype=cp.float32)
        blocks = min(4096, (rows * cols // 8 + 255) // 256)
        self.k("dequant_rows", qt)((max(blocks, 1),), (256,),
                                   (U64(addr), I64(row_bytes), ptr(out), I32(rows), I32(cols)))
        return out

    def linear(self, W, X: cp.ndarray) -> cp.ndarray:
        """X @ W^T for a DevMatrix W, dequantized in row blocks."""
        step_rows = max(1, DEQUANT_SCRATCH_ELEMS // W.cols)
        if W.rows <= step_rows:
            return X @ self.dequant(W.ptr, W.qt, W.row_bytes, W.rows, W.cols).T
        out = cp.empty((X.shape[0], W.rows), dtype=cp.float32)
        for r0 in range(0, W.rows, step_rows):
            n = min(step_rows, W.rows - r0)
            out[:, r0:r0 + n] = X @ self.dequant(W.ptr + r0 * W.row_bytes, W.qt, W.row_bytes, n, W.cols).T
        return out

    def forward(self, tokens, pos0: int, all_logits: bool) -> cp.ndarray:
        c, w, L = self.cfg, self.w, self.L
        T = len(tokens)
        tok = cp.asarray(np.asarray(tokens, dtype=np.int32))
        x = cp.empty((T, c.n_embd), dtype=cp.float32)
        te = w.tok_embd
        self.k("embed", te.qt)((T,), (256,), (U64(te.ptr), I64(te.row_bytes), ptr(tok), NULL, NULL, ptr(x),
                                            I32(c.n_embd)))
        xn = cp.empty_like(x)
        for li, ly in enumerate(w.layers):
            L.rmsnorm(x, ly.attn_norm, xn, rows=T)
            q = self.linear(ly.wq, xn)
            k = self.linear(ly.wk, xn)
            v = self.linear(ly.wv, xn)
            if ly.bq is not None:
                q += ly.bq
                k += ly.bk
                v += ly.bv
            q = cp.ascontiguousarray(q)
            kc, vc = self.kv.layer(li)
            self.k("qk_rope_store")((c.n_head + 2 * c.n_head_kv, T), (c.head_dim,),
                                    (q, cp.ascontiguousarray(k), cp.ascontiguousarray(v),
                                     ptr(ly.q_norm), ptr(ly.k_norm), ptr(self.step.rope), NULL, I32(pos0), U64(kc),
                                     U64(vc), I32(c.n_head), I32(c.n_head_kv), I32(c.head_dim), I32(c.n_rot),
                                     I32(1 if c.rope_type == "neox" else 0), F32(c.rms_eps), I32(self.kv.max_ctx)))
            att = self.attention(li, q, pos0, T)
            x += self.linear(ly.wo, att)
            L.rmsnorm(x, ly.ffn_norm, xn, rows=T)
            if c.is_moe:
                x += self.moe(li, ly, xn)
            else:
                x += self.ffn(ly.w_gate, ly.w_up, ly.w_down, xn)
        if not all_logits:
            x = x[-1:]
        xo = cp.empty_like(x)
        L.rmsnorm(cp.ascontiguousarray(x), w.output_norm, xo, rows=x.shape[0])
        return self.linear(w.output, xo)

    def attention(self, li, q, pos0, T):
        c = self.cfg
        G = c.n_head // c.n_head_kv
        n = pos0 + T
        scale = c.attn_scale or 1.0 / np.sqrt(c.head_dim)
        Q = q.reshape(T, c.n_head_kv, G, c.head_dim).transpose(1, 2, 0, 3).reshape(c.n_head_kv, G * T, c.head_dim)
        kpos = cp.arange(n)[None, :]
        qpos = (pos0 + cp.arange(T))[None, :].repeat(G, axis=0).reshape(G * T, 1)
        masked = kpos > qpos                             # (G*T, n): a query sees positions up to its own
        out = cp.empty((c.n_head_kv, G * T, c.head_dim), dtype=cp.float32)
        per = max(1, SCORE_ELEMS // (G * T * n))
        for h0 in range(0, c.n_head_kv, per):
            h1 = min(c.n_head_kv, h0 + per)
            K = self.kv.k[li, h0:h1, :n].astype(cp.float32)
            V = self.kv.v[li, h0:h1, :n].astype(cp.float32)
            S = (Q[h0:h1] @ K.transpose(0, 2, 1)) * scale
            S = cp.where(masked[None], -cp.inf, S)
            S -= S.max(axis=-1, keepdims=True)
            P = cp.exp(S)
            P /= P.sum(axis=-1, keepdims=True)
            out[h0:h1] = P @ V
        return cp.ascontiguousarray(out.reshape(c.n_head_kv, G, T, c.head_dim).transpose(2, 0, 1, 3)
                                    ).reshape(T, c.n_head * c.head_dim)

    def ffn(self, Wg, Wu, Wd, xn):
        g = self.linear(Wg, xn)
        u = self.linear(Wu, xn)
        return self.linear(Wd, g / (1.0 + cp.exp(-g)) * u)

    def moe(self, li, ly, xn):
        c, lay, cache = self.cfg, self.layout, self.cache
        T, k = xn.shape[0], c.n_expert_used
        logits = self.linear(ly.router, xn)
        ids = cp.empty((T, k), dtype=cp.int32)
        wts = cp.empty((T, k), dtype=cp.float32)
        self.k("router_topk")((T,), (32,),
                              (ptr(logits), I32(c.n_expert), I32(k), I32(1 if c.expert_weights_norm else 0),
                               F32(c.expert_weights_scale), ptr(ids), ptr(wts), NULL, U64(0), U64(0),
                               U64(cache.counts.data.ptr + 4 * li * c.n_expert), NULL))
        ids_h = ids.get()
        cache.advise(li * c.n_expert + np.unique(ids_h))      # memory modes: the disk reads ahead of the loop
        out = cp.zeros((T, c.n_embd), dtype=cp.float32)
        for e in np.unique(ids_h):
            t_idx, j_idx = np.nonzero(ids_h == e)
            g = li * c.n_expert + int(e)
            stream = cp.cuda.get_current_stream()
            addr = cache.read_begin(g, stream)      # staged from the file first in the memory modes
            Wg = self.dequant(addr, lay.qt_gate_up, lay.rb_gate_up, lay.n_ff, lay.n_embd)
            Wu = self.dequant(addr + lay.up_off, lay.qt_gate_up, lay.rb_gate_up, lay.n_ff, lay.n_embd)
            Wd = self.dequant(addr + lay.down_off, lay.qt_down, lay.rb_down, lay.n_embd, lay.n_ff)
            cache.read_end(g, stream)
            ti = cp.asarray(t_idx)
            xe = xn[ti]
            g = xe @ Wg.T
            u = xe @ Wu.T
            y = (g / (1.0 + cp.exp(-g)) * u) @ Wd.T
            out[ti] += y * wts[ti, cp.asarray(j_idx)][:, None]
        if ly.sh_up is not None:
            sh = self.ffn(ly.sh_gate, ly.sh_up, ly.sh_down, xn)
            if ly.sh_gate_inp is not None:
                sg = self.linear(ly.sh_gate_inp, xn)          # (T, 1)
                sh *= 1.0 / (1.0 + cp.exp(-sg))
            out += sh
        return out
