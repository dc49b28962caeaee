"""The qwen4exp CUDA family's host side on the CPU (engine/cuda/families/qwen4exp.py, q4ops.py): the registry and the
worker take qwen4exp on CUDA; its layer dataclasses hold the file's bytes in the layout the kernels read (Upload with
numpy.asarray); its recurrent state has the reference cache's shapes; the PLE rows it uploads are the reference's,
chunk by chunk with the context carried; the kernels' NumPy references agree with engine/arch/qwen4exp.py."""
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest

pytest.importorskip("cupy")     # the family modules import CuPy (no GPU needed)

from engine.arch import qwen4exp as ref  # noqa: E402
from engine.arch.qwen3next import gated_delta_net, sigmoid  # noqa: E402
from engine.cuda.families import q4ops  # noqa: E402
from engine.cuda.families.hybrid import attn_q_rows  # noqa: E402
from engine.cuda.families.qwen4exp import Qwen4ExpFamily, ple_rows, qsa_blocks, state_layout  # noqa: E402
from engine.cuda.families.registry import family_for  # noqa: E402
from engine.cuda.weights import DevMatrix, Upload  # noqa: E402
from engine.gguf_model import open_model  # noqa: E402
from engine.row_cache import RowCache  # noqa: E402
from engine.supported import archs_for, runs_on  # noqa: E402

HERE = Path(__file__).resolve().parent / "fixtures" / "qwen4exp"
FILES = ("f16", "iq2_xs", "q2_0", "q4_k_m")


@pytest.fixture(scope="module", params=FILES)
def loaded(request):
    model = open_model(HERE / f"tiny-qwen4exp-{request.param}.gguf")
    fam = family_for(model.config)
    w = fam.load_weights(model, Upload(model, np.asarray))
    yield model, fam, w
    fam.close()


def _rows(model, name):
    t = model.tensor(name)
    return np.ascontiguousarray(t.data).reshape(int(np.prod(t.shape[:-1])), -1)


def _same(m, model, name, rows=None):
    want = _rows(model, name)
    want = want if rows is None else want[rows]
    assert isinstance(m, DevMatrix) and isinstance(m.data, np.ndarray)
    assert (m.rows, m.row_bytes, m.qt) == (want.shape[0], want.shape[1], int(model.tensor(name).qtype))
    np.testing.assert_array_equal(m.data, want)


def test_the_worker_runs_qwen4exp_on_cuda_and_setup_does_not_offer_it_yet():
    assert isinstance(family_for(NS(arch="qwen4exp")), Qwen4ExpFamily)
    assert runs_on("qwen4exp", "cuda", preview=True) and not runs_on("qwen4exp", "cuda")
    assert "qwen4exp" not in archs_for("cuda")


def test_layers_hold_the_files_bytes(loaded):
    model, fam, w = loaded
    cfg, p = model.config, model.config.family_params
    assert w.output_norm is None and w.output is w.tok_embd      # tied; the final HC read is the norm
    _same(w.hc_out.down, model, "output_hc_down.weight")
    _same(w.hc_out.up, model, "output_hc_up.weight")
    assert w.hc_out.inject is None
    np.testing.assert_array_equal(w.hc_out.gamma, model.dequant("output_hc_norm.weight").astype(np.float32))
    q_rows, g_rows = attn_q_rows(cfg)
    for il, L in enumerate(w.layers):
        b = f"blk.{il}."
        assert L.attn_norm is None and L.ffn_norm is None
        for half, hc in (("attn", L.hc_attn), ("ffn", L.hc_ffn)):
            for part in ("down", "up", "inject"):
                _same(getattr(hc, part), model, f"{b}hc_{half}_{part}.weight")
        _same(L.router, model, b + "ffn_gate_inp.weight")
        _same(L.sh_gate_inp, model, b + "ffn_gate_inp_shexp.weight")
        for k in ("gate", "up", "down"):
            _same(getattr(L, f"sh_{k}"), model, f"{b}ffn_{k}_shexp.weight")
        if cfg.recurrent_layers[il]:
            assert L.qsa is None and L.wq is None
            g = L.gdn
            assert g.slot == sum(cfg.recurrent_layers[:il])
            for field, name in (("qkv", "attn_qkv"), ("z", "attn_gate"), ("beta", "ssm_beta"), ("alpha", "ssm_alpha"),
                                ("out", "ssm_out")):
                _same(getattr(g, field), model, f"{b}{name}.weight")
            assert g.conv.shape == (2 * cfg.ssm_k_heads * cfg.ssm_state + cfg.ssm_inner, cfg.ssm_conv)
        else:
            assert L.gdn is None and L.qsa.ratio == p.compress_ratios[il] > 0
            _same(L.wq, model, b + "attn_q.weight", q_rows)
            _same(L.qsa.gate, model, b + "attn_q.weight", g_rows)
            _same(L.qsa.idx_q, model, b + "indexer.q_proj.weight")
            _same(L.qsa.idx_k, model, b + "indexer.k_proj.weight")
        if il in p.ple_layers:
            _same(L.ple.key, model, b + "ple_key.weight")
            _same(L.ple.value, model, b + "ple_value.weight")
            assert L.ple.conv.shape == (cfg.n_embd * p.hc_count, p.ple_conv) and L.ple.conv.dtype == np.float32
        else:
            assert L.ple is None
    assert {m.qt for m in w.hc_out.matrices()} <= w.qtype_ids()


def test_attn_q_rows_split_the_head_interleave():
    cfg = NS(n_head=3, head_dim=4)
    q, g = attn_q_rows(cfg)
    assert q.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert g.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


def test_state_layout_is_the_reference_caches(loaded):
    model, fam, _ = loaded
    cfg = model.config
    cache = ref.Qwen4ExpCache(cfg, 64)
    lay = state_layout(cfg)
    gdn = cache.gdn_layers
    assert lay["conv"] == (len(gdn), *cache.conv[gdn[0]].shape)
    assert lay["delta"] == (len(gdn), *cache.delta[gdn[0]].shape)
    assert lay["ple_conv"] == cache.ple_conv.shape
    floats = sum(int(np.prod(s)) for s in lay.values())
    assert 4 * floats + cache.ple_ids.nbytes == cache.state_bytes()
    for li in cache.qsa_layers:
        assert qsa_blocks(cfg, 64, li) == 64 // cfg.family_params.compress_ratios[li] + 1


def test_ple_rows_are_the_references_chunk_by_chunk():
    model = open_model(HERE / "tiny-qwen4exp-iq2_xs.gguf")
    p = model.config.family_params
    rows = RowCache(model.tensor(ref.PLE_TABLE), 1 << 16)
    try:
        toks = np.array([650, 730, p.ple_eos, p.ple_eos, 741, 205, 315, p.ple_eos, 42, 583, 38], np.int64)
        start = np.full(p.ngram_size - 1, p.ple_eos, np.int64)
        ctx = ref.ple_context(toks, start, p.ple_eos)
        ids = ref.ple_row_ids(ctx, p.multipliers, p.head_sizes, p.head_offsets, p.heads_per_ngram)
        table = model.dequant(ref.PLE_TABLE)
        want = table[ids].reshape(len(toks), -1)
        got, before = [], start
        for a, b in ((0, 3), (3, 4), (4, 9), (9, 11)):      # a decode step is a chunk of one
            eta, before = ple_rows(p, rows, toks[a:b], before)
            got.append(eta)
        np.testing.assert_array_equal(np.concatenate(got), want.astype(np.float32))
        np.testing.assert_array_equal(before, toks[-(p.ngram_size - 1):])
        assert rows.lookups == len(toks) * p.n_ple_heads and rows.hits >= 0
    finally:
        rows.close()


def test_request_info_counts_the_rows(loaded):
    model, fam, _ = loaded
    p = model.config.family_params
    fam.reset_stats()
    fam.ple_rows([5, 6, 7, 5, 6, 7], np.full(p.ngram_size - 1, p.ple_eos))
    info = fam.request_info()
    assert info["ple_row_lookups"] == 6 * p.n_ple_heads and info["ple_row_hits"] > 0    # "5 6 7" comes again
    fam.reset_stats()
    assert fam.request_info() == {"ple_row_lookups": 0, "ple_row_hits": 0}


def test_prompt_buffers_are_transient_and_grow_with_the_chunk(loaded):
    model, fam, _ = loaded
    a, b = fam.prompt_buffers(8), fam.prompt_buffers(64)
    assert all(not x.keep for x in a + b)
    assert sum(x.nbytes for x in b) > sum(x.nbytes for x in a) > 0


def test_int8_kv_is_refused_before_any_vram():
    model = open_model(HERE / "tiny-qwen4exp-iq2_xs.gguf")
    with pytest.raises(ValueError, match="--kv f16"):
        family_for(model.config).kv_cache(64, "int8", 8, print)


# --- the kernels' NumPy references against the model's ---------------------------------------------------------

def test_gdn_reference_is_the_models_with_the_sigmoid_gate():
    rng = np.random.default_rng(1)
    T, n_k, n_v, D, K = 5, 2, 4, 16, 4
    C = (2 * n_k + n_v) * D
    cfg = NS(ssm_k_heads=n_k, ssm_v_heads=n_v, ssm_state=D, rms_eps=1e-6)
    tensors = {"b.ssm_dt.bias": rng.standard_normal(n_v), "b.ssm_a": -np.exp(rng.standard_normal(n_v)),
               "b.ssm_conv1d.weight": rng.standard_normal((C, K)), "b.ssm_norm.weight": 1 + rng.standard_normal(D),
               "b.ssm_out.weight": np.eye(n_v * D)}
    w = NS(get=lambda name: tensors[name.replace("blk.", "b.")] if name.startswith("blk.") else tensors[name])
    qkv, z = rng.standard_normal((T, C)), rng.standard_normal((T, n_v * D))
    b, a = rng.standard_normal((T, n_v)), rng.standard_normal((T, n_v))
    conv0, S0 = rng.standard_normal((K - 1, C)), 0.1 * rng.standard_normal((n_v, D, D))
    want, conv1, S1 = gated_delta_net(w, "b.", cfg, qkv, z.reshape(T, n_v, D), b, a, conv0, S0, True, sigmoid,
                                      states=[])
    got, gconv, gS = q4ops.ref_gdn(qkv, conv0, tensors["b.ssm_conv1d.weight"], b, a, tensors["b.ssm_dt.bias"],
                                   tensors["b.ssm_a"], S0, z, tensors["b.ssm_norm.weight"], n_k, D, 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gconv, conv1, rtol=1e-12)
    np.testing.assert_allclose(gS, S1, rtol=1e-10, atol=1e-12)


def test_ple_reference_is_the_models_mix():
    rng = np.random.default_rng(2)
    T, N, H, P = 6, 16, 4, 32
    D = N * H
    x, eta = rng.standard_normal((T, D)), rng.standard_normal((T, P))
    wk, wv = rng.standard_normal((D, P)), rng.standard_normal((N, P))
    gk, gq, gc = (1 + 0.1 * rng.standard_normal(D) for _ in range(3))
    conv, hist = rng.standard_normal((D, 4)), rng.standard_normal((9, D))
    add, hist1 = ref.ple_mix(x, eta, wk, wv, gk, gq, gc, conv, hist, H, 3, 1e-6)
    got, ghist = q4ops.ref_ple(x, eta @ wk.T, eta @ wv.T, gk, gq, gc, conv, hist, H, 3, 1e-6)
    np.testing.assert_allclose(got, x + add, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ghist, hist1, rtol=1e-12)


def test_the_gdn_runs_on_gdn_cu_at_heads_of_128_only(loaded):
    """q4ops.gdn_cu_shape: gdn.cu's sigmoid-gate build at the published heads (tiled: value head h reads key head
    h % n_k, as q4_gdn_delta), None where it is not built (the tiny fixtures' heads of 16: qwen4exp.cu's kernels)."""
    from engine.cuda.families.q4ops import gdn_cu_shape
    model, fam, _ = loaded
    assert model.config.ssm_state != 128 and gdn_cu_shape(model.config, 1e-6) is None
    cfg = NS(ssm_k_heads=16, ssm_v_heads=48, ssm_state=128, ssm_conv=4)
    shape = gdn_cu_shape(cfg, 1e-6)
    assert shape.sigmoid_gate and not shape.grouped and shape.channels == 2 * 16 * 128 + 48 * 128
    assert gdn_cu_shape(NS(**{**vars(cfg), "ssm_conv": 9}), 1e-6) is None


def test_the_gdn_references_agree_at_the_published_heads():
    """q4ops.ref_gdn (q4_gdn_delta's reference) and gdn.ref_layer (gdn.cu's, sigmoid gate, tiled heads) are the same
    arithmetic, so the chunked prompt kernels compute what the family's own did (to their fp16 tolerance)."""
    from engine.cuda.families.gdn import GdnShape, ref_layer
    rng = np.random.default_rng(0)
    for nk, nv, T in ((2, 6, 5), (16, 48, 9)):
        D, C = 128, (2 * nk + nv) * 128
        sh = GdnShape(nk, nv, D, 4, False, 1e-6, True)
        qkv, z = rng.standard_normal((T, C)), rng.standard_normal((T, nv * D))
        b, a = rng.standard_normal((T, nv)), rng.standard_normal((T, nv))
        conv_w, cs = rng.standard_normal((C, 4)) * 0.5, rng.standard_normal((3, C))
        dt_bias, ssm_a = np.log(np.expm1(rng.uniform(0.001, 0.1, nv))), -rng.uniform(1, 16, nv)
        norm_w, S = 1 + 0.1 * rng.standard_normal(D), 0.1 * rng.standard_normal((nv, D, D))
        got = q4ops.ref_gdn(qkv, cs, conv_w, b, a, dt_bias, ssm_a, S, z, norm_w, nk, D, 1e-6)
        want = ref_layer(sh, qkv, z, b, a, dt_bias, ssm_a, conv_w, norm_w, cs, S)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
