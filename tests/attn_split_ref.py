"""NumPy references for cuda_src/attn_split.cu (tests/test_cuda_attn_split.py, bench/attn_decode.py): a window of n_q
query tokens at positions P0 .. P0 + n_q - 1 over a KV cache, causal among them, with gpt-oss's window and sinks."""
from __future__ import annotations

import numpy as np


def ref_window(q, Kc, Vc, group: int, scale: float, P0: int, n_q: int, sinks=None, n_swa: int = 0):
    """q (n_q, n_head * hd); Kc, Vc (n_kv, >= P0 + n_q, hd) in position order; -> (n_q, n_head * hd) float64.
    Token t sees positions lo .. P0 + t (lo = 0, or P0 + t - n_swa + 1 with a window); sinks (n_head,) joins each
    softmax denominator as exp(sink) (engine/arch/gptoss.py sink_softmax)."""
    n_kv, _, hd = Kc.shape
    q = np.asarray(q, np.float64).reshape(n_q, n_kv, group, hd) * scale
    out = np.empty((n_q, n_kv, group, hd))
    sk = None if sinks is None else np.asarray(sinks, np.float64).reshape(n_kv, group, 1)
    for t in range(n_q):
        hi = P0 + t + 1
        lo = max(0, hi - n_swa) if n_swa > 0 else 0
        s = np.einsum("kgd,knd->kgn", q[t], Kc[:, lo:hi])
        m = s.max(-1, keepdims=True)
        if sk is not None:
            m = np.maximum(m, sk)
        p = np.exp(s - m)
        den = p.sum(-1, keepdims=True) + (0.0 if sk is None else np.exp(sk - m))
        out[t] = np.einsum("kgn,knd->kgd", p, Vc[:, lo:hi]) / den
    return out.reshape(n_q, n_kv * group * hd)


def quantize_rows_i8(x):
    """kv_int8.cuh's layout for rows x (..., hd): int8 values and one scale per 32 (absmax / 127, round to nearest)."""
    b = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    s = np.abs(b).max(-1) / 127
    qv = np.rint(np.divide(b, s[..., None], out=np.zeros_like(b), where=s[..., None] > 0))
    return qv.reshape(x.shape).astype(np.int8), s.astype(np.float32)


def dequant_i8(qv, s):
    """The values an int8 cache holds, float64 (value = scale * q)."""
    return qv.astype(np.float64) * np.repeat(s.astype(np.float64), 32, axis=-1)
