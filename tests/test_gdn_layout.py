"""The buffer layouts engine/cuda/families/gdn.py documents (and tests/test_cuda_gdn.py holds the kernels to) are the
model's: its NumPy reference (ref_layer), fed the projections as the docstring says the wiring makes them, equals the
CPU backend's own GDN mixer (Qwen3Next.gdn) on the tiny fixture models of both architectures, prompt and decode, with
the conv and delta state carried in HybridCache's layout."""
from pathlib import Path

import numpy as np
import pytest

from engine.backend_cpu import CPUBackend
from engine.cuda.families.gdn import GdnShape, ref_layer
from engine.gguf_model import open_model

HERE = Path(__file__).resolve().parent / "fixtures" / "hybrid"


@pytest.mark.parametrize("name", ["qwen3next-q4_k_m", "qwen35moe-q4_k_m"])
def test_reference_in_the_kernels_layout_is_the_models_gdn(name):
    be = CPUBackend(open_model(HERE / f"tiny-{name}.gguf"), 256)
    net, cfg, w = be.net, be.net.cfg, be.net.w
    sh = GdnShape.from_config(cfg)
    assert sh.grouped == (cfg.arch == "qwen3next")
    il = cfg.recurrent_layers.index(True)
    b = f"blk.{il}."
    cache = net.new_cache(256, np.float64)
    rng = np.random.default_rng()
    conv, S = cache.conv[il].copy(), cache.delta[il].copy()
    for T in (70, 1, 1):                       # a prompt longer than a chunk, then decode steps
        x = rng.standard_normal((T, cfg.n_embd))
        want = net.gdn(il, x, cache)           # (T, n_embd), after ssm_out; updates cache
        qkv, z = net.qkv_z(il, x)
        if sh.grouped:
            ba, a = x @ w.get(b + "ssm_ba.weight").T, None
        else:
            ba, a = x @ w.get(b + "ssm_beta.weight").T, x @ w.get(b + "ssm_alpha.weight").T
        out, conv, S = ref_layer(sh, qkv, z.reshape(T, -1), ba, a, w.get(b + "ssm_dt.bias"), w.get(b + "ssm_a"),
                                 w.get(b + "ssm_conv1d.weight"), w.get(b + "ssm_norm.weight"), conv, S,
                                 chunked=T > 1)
        got = out @ w.get(b + "ssm_out.weight").T
        assert np.abs(got - want).max() < 1e-9 * max(1.0, np.abs(want).max())
        assert np.array_equal(conv, cache.conv[il])
        assert np.abs(S - cache.delta[il]).max() < 1e-9 * max(1.0, np.abs(S).max())


def test_scratch_and_state_sizes():
    from engine.cuda.families.gdn import scratch_bytes, state_bytes
    sh = GdnShape(16, 32, 128, 4, True, 1e-6)            # Qwen3-Next-80B-A3B's GDN layers
    # act16 4096 x 8192 fp16 (64 MiB), gcum 32 x 4096 fp32, tcat 32 x 64 x 64 x 128 fp16, qkm half of tcat
    assert scratch_bytes(sh, 4096) == 4096 * 8192 * 2 + 32 * 4096 * 4 + 32 * 64 * 64 * 128 * 2 + 32 * 64 * 64 * 64 * 2
    # one more token: its row, and a whole chunk more of gcum, tcat and qkm
    assert scratch_bytes(sh, 4097) - scratch_bytes(sh, 4096) == 8192 * 2 + 32 * 64 * (4 + 128 * 2 + 64 * 2)
    be = CPUBackend(open_model(HERE / "tiny-qwen3next-q4_k_m.gguf"), 64)
    n_gdn = sum(be.net.cfg.recurrent_layers)
    assert n_gdn * state_bytes(GdnShape.from_config(be.net.cfg)) == be.kv.state_bytes()


def test_sigmoid_gate_reference_is_qwen4exps_gdn():
    """qwen4exp's GDN (spec 4.5: tiled value heads, the sigmoid output gate) in the kernels' layout: ref_layer with
    GdnShape.sigmoid_gate equals engine/arch/qwen3next.py gated_delta_net as Qwen4Exp.gdn calls it (gate=sigmoid),
    prompt then decode, on random weights; the silu shape's output differs."""
    from types import SimpleNamespace

    from engine.arch.qwen3next import gated_delta_net, sigmoid
    rng = np.random.default_rng()
    n_k, n_v, D, K, n_embd = 2, 6, 128, 4, 32
    sh = GdnShape(n_k, n_v, D, K, False, 1e-6, sigmoid_gate=True)
    C = sh.channels
    w = {"ssm_dt.bias": rng.uniform(-3, -1, n_v), "ssm_a": -rng.uniform(1, 16, n_v),
         "ssm_conv1d.weight": rng.standard_normal((C, K)) * 0.5, "ssm_norm.weight": 1 + 0.1 * rng.standard_normal(D),
         "ssm_out.weight": rng.standard_normal((n_embd, n_v * D)) * 0.1}
    W = SimpleNamespace(get=lambda name: w[name[len("blk.0."):]])
    cfg = SimpleNamespace(ssm_k_heads=n_k, ssm_v_heads=n_v, ssm_state=D, rms_eps=1e-6)
    conv, S = np.zeros((K - 1, C)), np.zeros((n_v, D, D))
    mine_conv, mine_S = conv.copy(), S.copy()
    for T in (70, 1, 1):
        qkv, z = rng.standard_normal((T, C)), rng.standard_normal((T, n_v * D))
        b, a = rng.standard_normal((T, n_v)), rng.standard_normal((T, n_v))
        args = (qkv, z, b, a, w["ssm_dt.bias"], w["ssm_a"], w["ssm_conv1d.weight"], w["ssm_norm.weight"])
        silu_out, _, _ = ref_layer(GdnShape(n_k, n_v, D, K, False, 1e-6), *args, mine_conv, mine_S, chunked=T > 1)
        want, conv, S = gated_delta_net(W, "blk.0.", cfg, qkv, z.reshape(T, n_v, D), b, a, conv, S, True, sigmoid)
        out, mine_conv, mine_S = ref_layer(sh, *args, mine_conv, mine_S, chunked=T > 1)
        got = out @ w["ssm_out.weight"].T
        assert np.abs(got - want).max() < 1e-9 * max(1.0, np.abs(want).max())
        assert np.abs(silu_out @ w["ssm_out.weight"].T - want).max() > 1e-3
        assert np.array_equal(mine_conv, conv)
        assert np.abs(mine_S - S).max() < 1e-9 * max(1.0, np.abs(S).max())


def test_sigmoid_gate_shape():
    """gdn.cu builds the sigmoid gate for heads of 128 (qwen4exp's); another width is refused with the fix named."""
    assert GdnShape(16, 48, 128, 4, False, 1e-6, True).sigmoid_gate
    assert not GdnShape(16, 48, 128, 4, False, 1e-6).sigmoid_gate
    with pytest.raises(ValueError, match="GDN_GATE_SIGMOID"):
        GdnShape(2, 4, 64, 4, False, 1e-6, True)
