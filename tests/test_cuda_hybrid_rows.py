"""The CUDA backend's reordering of hybrid weight rows on loading (engine/cuda/families/hybrid.py), on the CPU: the
rows it picks give what the NumPy reference computes from the whole tensor (attn_q's per-head [query | gate], legacy
qwen3next ssm_in's per-key-head [q, k, v, z])."""
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cupy")

from engine.backend_cpu import CPUBackend  # noqa: E402
from engine.cuda.families import hybrid as hl  # noqa: E402
from engine.gguf_model import open_model  # noqa: E402

HERE = Path(__file__).resolve().parent / "fixtures" / "hybrid"


@pytest.fixture(scope="module")
def net():
    be = CPUBackend(open_model(HERE / "tiny-qwen3next-q4_k_m.gguf"), 64, warm=False)
    yield be.net
    be.close()


def test_attn_q_rows_split_query_and_gate(net):
    """The rows themselves, compared exactly: a product of a row subset may round differently in BLAS (different
    blocking for a different shape), which says nothing about which rows were picked."""
    cfg, il = net.cfg, net.cfg.recurrent_layers.index(False)
    W = net.w.get(f"blk.{il}.attn_q.weight")
    per_head = W.reshape(cfg.n_head, 2 * cfg.head_dim, cfg.n_embd)
    q_rows, g_rows = hl.attn_q_rows(cfg)
    np.testing.assert_array_equal(W[q_rows], per_head[:, :cfg.head_dim].reshape(-1, cfg.n_embd))
    np.testing.assert_array_equal(W[g_rows], per_head[:, cfg.head_dim:].reshape(-1, cfg.n_embd))


def test_ssm_in_rows_split_qkv_and_z(net):
    """A legacy fused ssm_in built from the file's attn_qkv and attn_gate in llama.cpp's old grouping."""
    cfg = net.cfg
    Hk, D, r = cfg.ssm_k_heads, cfg.ssm_state, cfg.ssm_v_heads // cfg.ssm_k_heads
    qkv, z = net.w.get("blk.0.attn_qkv.weight"), net.w.get("blk.0.attn_gate.weight")
    q, k, v = np.split(qkv, [Hk * D, 2 * Hk * D])
    fused = np.concatenate([np.concatenate([q[h * D:(h + 1) * D], k[h * D:(h + 1) * D],
                                            v[h * r * D:(h + 1) * r * D], z[h * r * D:(h + 1) * r * D]])
                            for h in range(Hk)])
    qkv_rows, z_rows = hl.ssm_in_rows(cfg)
    np.testing.assert_array_equal(fused[qkv_rows], qkv)
    np.testing.assert_array_equal(fused[z_rows], z)
