"""qwen4exp's prompt GDN at the published heads (16 key / 48 value heads of 128): gdn.cu's chunked delta rule, which
Q4Prompt runs there (families/qwen4exp.py fast_gdn), against the family's own token-by-token q4_gdn_delta path
(q4ops.Gdn.prompt) and the float64 reference (q4ops.ref_gdn), over chunks that carry the state, outputs poisoned
first. The chunked rule takes fp16 mma inputs: held to test_cuda_gdn.py's PROMPT_TOL; the plain path to 1e-4."""
from types import SimpleNamespace as NS

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from engine.cuda.families import q4ops  # noqa: E402
from engine.cuda.families.qwen4exp import Q4Prompt, fast_gdn  # noqa: E402

PROMPT_TOL = 3e-3
PLAIN_TOL = 1e-4
N_K, N_V, D, K = 16, 48, 128, 4


def cfg():
    return NS(arch="qwen4exp", n_embd=2560, rms_eps=1e-6, ssm_k_heads=N_K, ssm_v_heads=N_V, ssm_state=D, ssm_conv=K,
              ssm_inner=N_V * D, recurrent_layers=[True, True, False], family_params=NS(hc_count=4, hc_rank=320))


def rel(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize("chunks", [(1,), (37,), (64, 65), (200, 3, 512)])
def test_the_chunked_rule_is_the_plain_path_and_the_reference(chunks):
    from engine.cuda.kernels import Kernels
    c = cfg()
    shape = fast_gdn(c)
    assert shape is not None and shape.sigmoid_gate and not shape.grouped
    from engine.cuda.families.gdn import GdnKernels
    fast = GdnKernels(shape)
    kern = Kernels([], ("qwen4exp.cu",))
    plain = q4ops.Gdn(kern, None, q4ops.q4_shape(c))
    rng = np.random.default_rng(sum(chunks))
    C = shape.channels
    w = NS(conv=rng.standard_normal((C, K)) * 0.5, dt_bias=np.log(np.expm1(rng.uniform(0.001, 0.1, N_V))),
           a=-rng.uniform(1.0, 16.0, N_V), norm=1.0 + 0.1 * rng.standard_normal(D))
    w = NS(**{k: np.asarray(v, np.float32).astype(np.float64) for k, v in vars(w).items()})
    dev_w = NS(**{k: cp.asarray(v, cp.float32) for k, v in vars(w).items()})
    conv0 = np.asarray(rng.standard_normal((K - 1, C)), np.float32).astype(np.float64)
    S0 = np.asarray(0.1 * rng.standard_normal((N_V, D, D)), np.float32).astype(np.float64)
    states = {name: (cp.asarray(conv0, cp.float32), cp.asarray(S0, cp.float32)) for name in ("fast", "plain")}
    ref_conv, ref_S = conv0, S0
    scratch = fast.scratch(max(chunks))
    for T in chunks:
        ins = [np.asarray(rng.standard_normal(s), np.float32) for s in ((T, C), (T, N_V * D), (T, N_V), (T, N_V))]
        qkv, z, b, a = (cp.asarray(x) for x in ins)
        q64, z64, b64, a64 = (x.astype(np.float64) for x in ins)
        want, ref_conv, ref_S = q4ops.ref_gdn(q64, ref_conv, w.conv, b64, a64, w.dt_bias, w.a, ref_S, z64, w.norm,
                                              N_K, D, 1e-6)
        g = NS(qkv=qkv, z=z, beta=b, alpha=a, conv=dev_w.conv, dt_bias=dev_w.dt_bias, a=dev_w.a, norm=dev_w.norm,
               slot=0)
        proj = lambda W, X: W      # noqa: E731  (the projections are the random inputs themselves)
        # through the prompt program's own mixer (fast_gdn set), its scratch poisoned
        scratch.act16.fill(cp.nan)
        prog = NS(fast_gdn=fast, gdn=plain, gdn_scratch=scratch, cfg=c,
                  state=NS(conv=lambda slot: states["fast"][0], delta=lambda slot: states["fast"][1]))
        out = Q4Prompt.gdn_mixer(prog, g, None, T, proj)
        got_plain = plain.prompt(g, None, *states["plain"], T, proj)
        e_fast, e_plain = rel(out.get(), want), rel(got_plain.get(), want)
        print(f"\nT={T}: chunked out rel err {e_fast:.2e} (state {rel(states['fast'][1].get(), ref_S):.2e}), "
              f"plain {e_plain:.2e}")
        assert np.isfinite(out.get()).all()
        assert e_fast < PROMPT_TOL and rel(states["fast"][1].get(), ref_S) < PROMPT_TOL
        assert e_plain < PLAIN_TOL and rel(states["plain"][1].get(), ref_S) < PLAIN_TOL
        assert rel(states["fast"][0].get(), ref_conv) < 1e-6 and rel(states["plain"][0].get(), ref_conv) < 1e-6
