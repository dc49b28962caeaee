"""attn_split.cu's scheme (tests/attn_split_emu.py: chunks, key slices, hi/lo rows, both merges) against ref_window,
on the CPU: the split changes nothing but roundings, at any chunk limit, window, sinks and window size."""
import numpy as np
import pytest

pytest.importorskip("cupy")             # engine.cuda.kv (the chunk rules) imports it; no GPU is needed

from attn_split_emu import emulate, f16  # noqa: E402
from attn_split_ref import ref_window  # noqa: E402

CASES = [(2, 8, 128, 777, 1, 0, False, 66), (2, 8, 128, 300, 8, 0, False, 3), (1, 8, 256, 130, 2, 0, False, 66),
         (2, 8, 64, 300, 5, 128, True, 66), (2, 8, 64, 200, 3, 0, True, 1), (1, 3, 64, 33, 3, 0, False, 66),
         (2, 16, 64, 129, 4, 0, False, 2), (1, 8, 64, 5, 5, 0, False, 66)]


@pytest.mark.parametrize("n_kv,G,hd,L,n_q,n_swa,with_sinks,max_chunks", CASES)
def test_scheme_matches_the_reference(n_kv, G, hd, L, n_q, n_swa, with_sinks, max_chunks):
    rng = np.random.default_rng(L * 31 + n_q)
    Kc, Vc = f16(rng.standard_normal((n_kv, L, hd))), f16(rng.standard_normal((n_kv, L, hd)))
    q = (rng.standard_normal((n_q, n_kv * G, hd)) * 3).astype(np.float32)
    sinks = (rng.standard_normal(n_kv * G) * 2).astype(np.float32) if with_sinks else None
    scale = 1 / np.sqrt(hd)
    got = emulate(q, Kc, Vc, G, scale, L - n_q, n_q, max_chunks, sinks, n_swa)
    want = ref_window(q.reshape(n_q, -1), Kc.astype(np.float64), Vc.astype(np.float64), G, scale, L - n_q, n_q,
                      sinks, n_swa)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
