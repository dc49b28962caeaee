"""attn_split.cu's algorithm in NumPy, block by block and warp by warp (not its mma fragments): the chunks the
device cuts (kv.split_range), each warp's 16-key slices with its own online softmax, q and the weights as fp16 hi/lo
pairs, the block's merge of its warps, attn_split_reduce's merge of the chunks. tests/test_attn_split_emu.py holds it
to ref_window on the CPU, so the scheme itself is checked where no GPU is; on a GPU failure, its partials are the
kernel's to compare."""
import numpy as np

from engine.cuda.kv import split_range, split_tile, split_warps

LOG2E = 1.4426950408889634


def f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def emulate(q, Kc, Vc, G, scale, P0, n_q, max_chunks, sinks=None, n_swa=0):
    """As ref_window's arguments (q (n_q, n_head, hd) fp32, Kc / Vc fp16-valued) -> (n_q, n_head * hd) fp32."""
    n_kv, _, hd = Kc.shape
    BN = split_tile(hd)
    R = n_q * G; MT, ks = split_warps(G, n_q, hd)
    kb, kend, clen, n = split_range(P0, n_q, n_swa, max_chunks, hd)
    out = np.full((n_q, n_kv * G, hd), np.nan, np.float32)
    part_o = np.full((n, n_kv, R, hd), np.nan, np.float32); part_ml = np.full((n, n_kv, R, 2), np.nan, np.float32)
    for kvh in range(n_kv):
        for c in range(n):
            c0 = kb + c * clen; c1 = min(kend, c0 + clen)
            n_tiles = -(-(c1 - c0) // BN)
            # q padded rows
            Qp = np.zeros((8 * MT, hd), np.float32)
            for i in range(8 * MT):
                r = min(i, R - 1)
                Qp[i] = q[r // G, kvh * G + r % G] * np.float32(scale * LOG2E)
            Qhi = f16(Qp); Qlo = f16(Qp - Qhi)
            slots = {}
            for mt in range(MT):
                for kq in range(ks):
                    rows = np.arange(8 * mt, 8 * mt + 8)
                    my_r = np.minimum(rows, R - 1)
                    lim = P0 + my_r // G
                    lo = lim - n_swa + 1 if n_swa > 0 else np.zeros(8, int)
                    o = np.zeros((8, hd), np.float32); m = np.full(8, -np.inf, np.float32); l = np.zeros(8, np.float32)
                    for t in range(n_tiles):
                        p = c0 + t * BN
                        for sub in range(kq, BN // 16, ks):
                            k0 = p + 16 * sub
                            if k0 >= c1: break
                            keys = np.arange(k0, k0 + 16)
                            ok = keys < c1
                            Kt = np.zeros((16, hd), np.float32); Vt = np.zeros((16, hd), np.float32)
                            Kt[ok] = Kc[kvh, keys[ok]]; Vt[ok] = Vc[kvh, keys[ok]]
                            s = Qhi[rows] @ Kt.T + Qlo[rows] @ Kt.T
                            vis = (keys[None] < c1) & (keys[None] <= lim[:, None]) & (keys[None] >= lo[:, None])
                            x = np.where(vis, s, -np.inf).astype(np.float32)
                            mx = x.max(1); mn = np.maximum(m, mx)
                            rf = np.where(mn == -np.inf, 0, mn)
                            cc = np.exp2(m - rf); m = mn
                            pw = np.exp2(x - rf[:, None]).astype(np.float32)
                            l = l * cc + pw.sum(1); o *= cc[:, None]
                            phi = f16(pw); plo = f16(pw - phi)
                            o += phi @ Vt + plo @ Vt
                    for j in range(8):
                        slots[(kq, 8 * mt + j)] = (m[j], l[j], o[j].copy())
            for i in range(R):
                ms = [slots[(k, i)][0] for k in range(ks)]
                M = max(ms)
                L = 0.0; O = np.zeros(hd, np.float32)
                for k in range(ks):
                    mk, lk, ok_ = slots[(k, i)]
                    w = 0 if mk == -np.inf else np.exp2(mk - M)
                    L += w * lk; O += w * ok_
                h = kvh * G + i % G
                if n == 1:
                    if sinks is not None: L += np.exp2(sinks[h] * LOG2E - M)
                    out[i // G, h] = O / L
                else:
                    part_o[c, kvh, i] = O; part_ml[c, kvh, i] = (M, L)
    if n > 1:
        for kvh in range(n_kv):
            for r in range(R):
                M = part_ml[:, kvh, r, 0].max()
                w = np.where(part_ml[:, kvh, r, 0] == -np.inf, 0, np.exp2(part_ml[:, kvh, r, 0] - M))
                L = (w * part_ml[:, kvh, r, 1]).sum(); O = (w[:, None] * part_o[:, kvh, r]).sum(0)
                h = kvh * G + r % G
                if sinks is not None: L += np.exp2(sinks[h] * LOG2E - M)
                out[r // G, h] = O / L
    return out.reshape(n_q, -1)
