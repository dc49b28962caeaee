"""qwen4exp's pieces (engine/arch/qwen4exp.py) against direct transcriptions of ../shared/qwen4exp.md, and the forward
on tiny-qwen4exp: chunks equal one pass, checkpoints equal cold runs, the keys read exactly.

The references are the spec's formulas written again with plain loops and Python integers, on fresh random data at
several sizes, or hand-made cases whose answer is stated; the model tests compare the engine with itself (chunks
against one pass, a restored state against a cold run). q4refs' fixtures hold the comparison with transformers.
"""
from __future__ import annotations

import contextlib
import io
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.arch import qwen4exp as q4
from engine.backend_cpu import CPUBackend
from engine.gguf_model import ModelError, open_model, read_header
from tools import make_moe

rng = np.random.default_rng


def sig(x):
    return 1.0 / (1.0 + np.exp(-x))


# --- 4.2 / 4.3 / 4.9: hyper-connections -----------------------------------------------------------------------

def hc_read_spec(x, gamma, w_down, w_up, w_inj, H, eps):
    """4.2 steps 1-5, one token at a time, stream by stream."""
    N = x.shape[1] // H
    ys, iotas = [], []
    for xt in x.astype(np.float64):
        u = np.concatenate([xt[c * N:(c + 1) * N] / np.sqrt(np.mean(xt[c * N:(c + 1) * N] ** 2) + eps)
                            * gamma[c * N:(c + 1) * N] for c in range(H)])
        z = w_down @ u / H
        a = z * sig(z)
        s = sig(w_up @ a)
        ys.append(sum(s[c * N:(c + 1) * N] * u[c * N:(c + 1) * N] for c in range(H)) / H)
        if w_inj is not None:
            iotas.append(2 * sig(w_inj @ u / H))
    return np.array(ys), (np.array(iotas) if w_inj is not None else None)


@pytest.mark.parametrize("T,N,H,R", [(1, 8, 2, 4), (5, 32, 4, 8), (17, 64, 4, 16), (3, 40, 3, 12)])
def test_hc_read_and_write_follow_the_spec(T, N, H, R):
    g = rng(T * 1000 + N)
    D = N * H
    x = g.standard_normal((T, D)).astype(np.float32) * g.uniform(0.1, 3, D).astype(np.float32)
    gamma = (1 + 0.3 * g.standard_normal(D)).astype(np.float32)
    w_down = (g.standard_normal((R, D)) / np.sqrt(D)).astype(np.float32)
    w_up = (g.standard_normal((D, R)) / np.sqrt(R)).astype(np.float32)
    w_inj = (g.standard_normal((H, D)) / np.sqrt(D)).astype(np.float32)
    y, iota = q4.hc_read(x, gamma, w_down, w_up, w_inj, H, 1e-6)
    y_ref, iota_ref = hc_read_spec(x, gamma, w_down, w_up, w_inj, H, 1e-6)
    assert y.shape == (T, N) and iota.shape == (T, H)
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(iota, iota_ref, rtol=2e-5, atol=2e-6)
    y_head, none = q4.hc_read(x, gamma, w_down, w_up, None, H, 1e-6)     # 4.9: the final read has no inject
    assert none is None
    np.testing.assert_allclose(y_head, y_ref, rtol=2e-5, atol=2e-6)
    o = g.standard_normal((T, N)).astype(np.float32)
    out = q4.hc_write(x, o, iota)
    ref = np.concatenate([x[:, c * N:(c + 1) * N] + iota[:, c:c + 1] * o for c in range(H)], axis=1)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_zero_inject_logits_are_a_plain_residual_add():
    # gotcha 4: iota = 2 sigmoid(0) = 1 when the inject weights are zero
    x = rng(1).standard_normal((3, 16)).astype(np.float32)
    _, iota = q4.hc_read(x, np.ones(16, np.float32), np.zeros((4, 16), np.float32), np.zeros((16, 4), np.float32),
                         np.zeros((4, 16), np.float32), 4, 1e-6)
    assert np.all(iota == 1)


# --- 4.6: QSA -------------------------------------------------------------------------------------------------

def test_pooled_keys_pool_then_norm_then_rotate_at_the_block_start():
    g = rng(2)
    r, d, n_rot, nb = 4, 16, 8, 5
    raw = g.standard_normal((nb * r, d)).astype(np.float32)
    gamma = (1 + 0.2 * g.standard_normal(d)).astype(np.float32)
    theta = 1e4
    pos = np.arange(nb) * r
    freq = theta ** (-2.0 * np.arange(n_rot // 2) / n_rot)
    cos, sin = np.cos(pos[:, None] * freq).astype(np.float32), np.sin(pos[:, None] * freq).astype(np.float32)
    got = q4.pooled_block_keys(raw, gamma, cos, sin, n_rot, r, 1e-6)
    for b in range(nb):
        m = raw[b * r:(b + 1) * r].astype(np.float64).mean(axis=0)
        k = m / np.sqrt(np.mean(m * m) + 1e-6) * gamma
        want = k.copy()
        for i in range(n_rot // 2):   # NeoX pairs (i, i + n_rot/2), angle pos * theta^(-2i/n_rot)
            a, c, phi = k[i], k[i + n_rot // 2], pos[b] * freq[i]
            want[i], want[i + n_rot // 2] = a * np.cos(phi) - c * np.sin(phi), c * np.cos(phi) + a * np.sin(phi)
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,Hi,d,nb", [(1, 4, 8, 3), (6, 4, 32, 10), (9, 2, 16, 1)])
def test_block_scores_apply_relu_per_head_before_the_sum(T, Hi, d, nb):
    g = rng(T + nb)
    q = g.standard_normal((T, Hi, d)).astype(np.float32)
    k = g.standard_normal((nb, d)).astype(np.float32)
    got = q4.block_scores(q, k)
    want = np.array([[sum(max(0.0, float(q[t, h] @ k[b])) for h in range(Hi)) / math.sqrt(d) for b in range(nb)]
                     for t in range(T)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # a head with a negative dot product adds nothing (a sum before the ReLU would subtract it)
    assert np.any([(q[t] @ k[b]).sum() < 0 < got[t, b] for t in range(T) for b in range(nb)]) or nb == 1


def selected(scores, p, r, B):
    """The attended positions of one query at p, from select_tokens."""
    n_keys = p + 1
    return set(np.nonzero(q4.select_tokens(np.asarray(scores, np.float32)[None], np.array([p]), n_keys, r, B)[0])[0])


def test_dense_below_and_at_the_budget():
    r, B = 4, 3
    for p in range(0, r * (B + 1) - 1):    # n_b = (p+1)//4 <= 3: every visible token
        n_b = (p + 1) // r
        scores = rng(p).standard_normal(max(n_b, 1))
        assert selected(scores[:max(n_b, 1)], p, r, B) == set(range(p + 1)), p
    # exactly at the budget: p = 14 sees 3 complete blocks and a tail of 3: still dense whatever the scores
    assert selected([-5.0, 9.0, 0.0], 14, r, B) == set(range(15))


def test_crossing_keeps_the_top_blocks_and_the_tail():
    r, B = 4, 3
    # p = 17: 4 complete blocks (0..15) > 3, tail 16..17; block 1 scores lowest and is dropped
    assert selected([3.0, 0.5, 2.0, 1.0], 17, r, B) == set(range(0, 4)) | set(range(8, 16)) | {16, 17}
    # the tail stays even when every block outscores anything it could have
    assert {16, 17} <= selected([9.0, 9.0, 9.0, 9.0], 17, r, B)
    # p = 16: a tail of one token, itself
    assert selected([1.0, 4.0, 3.0, 2.0], 16, r, B) == set(range(4, 16)) | {16}


def test_a_complete_own_block_competes_and_can_be_dropped():
    r, B = 4, 3
    # p = 19: (p+1) % 4 == 0, 5 complete blocks, no tail; the query's own block 4 scores lowest and goes
    got = selected([5.0, 4.0, 3.0, 2.0, 1.0], 19, r, B)
    assert got == set(range(0, 12)) and 19 not in got
    # with the best score it stays, as any block would
    assert set(range(16, 20)) <= selected([5.0, 4.0, 3.0, 2.0, 9.0], 19, r, B)


def test_ties_go_to_the_lower_block():
    r, B = 4, 2
    # ReLU scores are exactly 0 for every block whose heads all point away: ties are common
    assert selected([0.0, 0.0, 0.0, 0.0], 16, r, B) == set(range(0, 8)) | {16}
    assert selected([1.0, 0.0, 2.0, 0.0, 0.0], 21, r, B) == set(range(0, 4)) | set(range(8, 12)) | {20, 21}


def test_each_query_of_a_chunk_selects_for_itself():
    r, B, n = 4, 2, 24
    g = rng(5)
    scores = g.standard_normal((n, n // r)).astype(np.float32)
    pos = np.arange(n)
    mask = q4.select_tokens(scores, pos, n, r, B)
    for p in pos:
        nb = (p + 1) // r
        assert set(np.nonzero(mask[p])[0]) == selected(scores[p, :max(nb, 1)], p, r, B)
        assert not mask[p, p + 1:].any()


@pytest.mark.parametrize("T,Hq,Hkv,S", [(1, 4, 2, 5), (3, 6, 2, 9), (4, 8, 1, 12)])
def test_masked_attention_softmaxes_over_the_selection_only(T, Hq, Hkv, S):
    g = rng(T * S)
    d = 8
    q = g.standard_normal((T, Hq, d)).astype(np.float32)
    K = g.standard_normal((Hkv, S, d)).astype(np.float32)
    V = g.standard_normal((Hkv, S, d)).astype(np.float32)
    mask = g.random((T, S)) < 0.5
    mask[:, 0] = True
    got = q4.masked_attention(q, K, V, mask, 0.25)
    G = Hq // Hkv
    for t in range(T):
        for i in range(Hq):
            j = i // G
            sel = np.nonzero(mask[t])[0]
            s = np.array([q[t, i] @ K[j, k] * 0.25 for k in sel], np.float64)
            p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            np.testing.assert_allclose(got[t, i * d:(i + 1) * d], p @ V[j, sel], rtol=1e-5, atol=1e-6)


# --- 4.8: PLE -------------------------------------------------------------------------------------------------

PUBLISHED_MULTIPLIERS = (23703573157769, 20109073645365, 8052911324071)
PUBLISHED_SIZES = (20000003, 20000023, 20000033, 20000047, 20000059, 20000063, 20000069, 20000077, 20000081,
                   20000093, 20000107, 20000147, 20000153, 20000159, 20000161, 20000171)
PUBLISHED_OFFSETS = (0, 20000003, 40000026, 60000059, 80000106, 100000165, 120000228, 140000297, 160000374,
                     180000455, 200000548, 220000655, 240000802, 260000955, 280001114, 300001275)


def test_hash_constants_reproduce_the_published_ones():
    assert q4.layer_multipliers(248320, 3) == PUBLISHED_MULTIPLIERS
    sizes = q4.head_vocab_sizes(20_000_000, 16)
    assert sizes == PUBLISHED_SIZES
    # the 16 primes from 2e7 on, none skipped: every number between them is composite
    assert all(q4.is_prime(s) for s in sizes)
    assert not any(q4.is_prime(n) for n in range(20_000_000, sizes[-1]) if n not in sizes)
    assert q4.head_offsets(sizes) == PUBLISHED_OFFSETS
    assert sum(sizes) == 320_001_446 and q4.table_rows(sizes) == 320_001_536
    assert all(m % 2 == 1 and m * 248319 < 2 ** 63 for m in PUBLISHED_MULTIPLIERS)


def test_splitmix64_known_values():
    # splitmix64 from state 0 (Vigna's reference generator: the first output is splitmix64(0) with one gamma added)
    assert q4.splitmix64(0) == 0xE220A8397B1DCDAF
    assert q4.splitmix64(q4.GAMMA) == 0x6E789E6AA1B965F4


def test_row_ids_are_exact_uint64_arithmetic():
    g = rng(6)
    ctx = g.integers(0, 248320, (500, 3))
    ctx[:5] = 248319
    got = q4.ple_row_ids(ctx, PUBLISHED_MULTIPLIERS, PUBLISHED_SIZES, PUBLISHED_OFFSETS, 8)
    m = PUBLISHED_MULTIPLIERS
    for t, (a, b, c) in enumerate(ctx.tolist()):
        mu2 = (a * m[0]) ^ (b * m[1])
        mu3 = mu2 ^ (c * m[2])
        want = [mu2 % PUBLISHED_SIZES[h] + PUBLISHED_OFFSETS[h] for h in range(8)] + \
               [mu3 % PUBLISHED_SIZES[h] + PUBLISHED_OFFSETS[h] for h in range(8, 16)]
        assert got[t].tolist() == want
    # float64 would not do: the products pass 2^53
    assert max(a * m[0] for a in ctx[:, 0].tolist()) > 2 ** 53
    assert got.max() < q4.table_rows(PUBLISHED_SIZES)


def test_context_resets_after_eos_and_not_at_the_token_itself():
    E = 9
    ctx = q4.ple_context(np.array([1, 2, E, 3, 4, E, E, 5]), np.array([E, E]), E)
    assert ctx.tolist() == [[1, E, E], [2, 1, E], [E, 2, 1], [3, E, E], [4, 3, E], [E, 4, 3], [E, E, E],
                            [5, E, E]]
    # the ids before the chunk carry the history, and an EOS among them resets it too
    assert q4.ple_context(np.array([7, 8]), np.array([5, 6]), E).tolist() == [[7, 6, 5], [8, 7, 6]]
    assert q4.ple_context(np.array([7, 8]), np.array([5, E]), E).tolist() == [[7, E, E], [8, 7, E]]
    assert q4.ple_context(np.array([7]), np.array([E, 6]), E).tolist() == [[7, 6, E]]


def test_context_over_chunks_equals_one_pass():
    g = rng(7)
    E = 3
    toks = g.integers(0, 8, 60)
    whole = q4.ple_context(toks, np.array([E, E]), E)
    before, parts = np.array([E, E]), []
    for lo, hi in ((0, 1), (1, 2), (2, 13), (13, 14), (14, 60)):
        parts.append(q4.ple_context(toks[lo:hi], before, E))
        before = np.concatenate([before, toks[lo:hi]])[-2:]
    assert (np.concatenate(parts) == whole).all()


@pytest.mark.parametrize("T,C,K,dil", [(1, 4, 4, 3), (7, 8, 4, 3), (20, 16, 3, 2)])
def test_dilated_conv_follows_the_formula_and_carries_history(T, C, K, dil):
    g = rng(T * C)
    x = g.standard_normal((T, C)).astype(np.float32)
    past = g.standard_normal((dil * (K - 1), C)).astype(np.float32)
    w = g.standard_normal((C, K)).astype(np.float32)
    out, new = q4.dilated_conv(x, past, w, dil)
    seq = np.concatenate([past, x])
    n = len(past)
    for t in range(T):
        want = sum(w[:, k] * seq[n + t - dil * (K - 1 - k)] for k in range(K))
        np.testing.assert_allclose(out[t], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new, seq[-n:])
    if T > 2:
        a, pa = q4.dilated_conv(x[:2], past, w, dil)
        b, pb = q4.dilated_conv(x[2:], pa, w, dil)
        np.testing.assert_allclose(np.concatenate([a, b]), out, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(pb, new)


def test_ple_mix_follows_the_post_ops():
    g = rng(8)
    T, N, H, P, K, dil = 5, 16, 4, 32, 4, 3
    D = N * H
    x = g.standard_normal((T, D)).astype(np.float32)
    eta = g.standard_normal((T, P)).astype(np.float32)
    wk = (g.standard_normal((D, P)) / 6).astype(np.float32)
    wv = (g.standard_normal((N, P)) / 6).astype(np.float32)
    gk, gq, gc = ((1 + 0.2 * g.standard_normal(D)).astype(np.float32) for _ in range(3))
    wc = g.standard_normal((D, K)).astype(np.float32)
    past = g.standard_normal((dil * (K - 1), D)).astype(np.float32)
    got, hist = q4.ple_mix(x, eta, wk, wv, gk, gq, gc, wc, past, H, dil, 1e-6)

    def gn(v, gamma):
        return np.concatenate([v[c * N:(c + 1) * N] / np.sqrt(np.mean(v[c * N:(c + 1) * N] ** 2) + 1e-6)
                               * gamma[c * N:(c + 1) * N] for c in range(H)])

    seq = list(past.astype(np.float64))
    for t in range(T):
        k, v, qq = gn(wk @ eta[t], gk), wv @ eta[t], gn(x[t].astype(np.float64), gq)
        G = []
        for c in range(H):
            lam = k[c * N:(c + 1) * N] @ qq[c * N:(c + 1) * N] / math.sqrt(N)
            lam = math.copysign(math.sqrt(max(abs(lam), 1e-6)), lam)
            G.append(sig(lam) * v)
        G = np.concatenate(G)
        seq.append(gn(G, gc))
        conv = sum(wc[:, k] * seq[len(seq) - 1 - dil * (K - 1 - k)] for k in range(K))
        np.testing.assert_allclose(got[t], G + conv * sig(conv), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(hist, np.array(seq[-len(past):]), rtol=2e-4, atol=2e-5)


# --- the model: tiny-qwen4exp ---------------------------------------------------------------------------------

def make(path, *args) -> str:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert make_moe.main(["--preset", "tiny-qwen4exp", *args, "--out", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make(tmp_path_factory.mktemp("q4exp") / "tiny-qwen4exp.gguf")


def prompt(n, seed=0, eos_every=0):
    toks = rng(seed).integers(0, 1000, n)
    if eos_every:
        toks[eos_every::eos_every] = 1021
    return toks.tolist()


def test_config_reads_every_key(tiny):
    m = open_model(tiny)
    cfg, p = m.config, m.config.family_params
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_rot) == \
        ("qwen4exp", 4, 256, 4, 2, 64, 16)
    assert cfg.recurrent_layers == (True, True, True, False) and cfg.rope_sections == (3, 3, 2, 0)
    assert (cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_conv) == (2, 6, 128, 4)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp, cfg.expert_weights_norm) == \
        (4, 2, 256, 256, True)
    assert (p.hc_count, p.hc_rank, p.indexer_heads, p.indexer_dim, p.qsa_budget) == (4, 64, 4, 32, 32)
    assert p.compress_ratios == (0, 0, 0, 4) and p.ple_layers == (1,) and p.ple_eos == 1021
    assert p.multipliers == q4.layer_multipliers(1024, 3) and p.head_offsets == q4.head_offsets(p.head_sizes)
    assert q4.table_rows(p.head_sizes) <= 4096 and m.tensor(q4.PLE_TABLE).shape[1] == p.ple_width == 16


def test_u64_arrays_are_read_exactly_and_floats_refused(tmp_path):
    import gguf
    big = [2 ** 64 - 1, 2 ** 53 + 1, 23703573157769]
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "x")
    w.add_key_value("x.u64", big, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT64)
    w.add_key_value("x.f32", [1.0, 2.0], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    md = read_header(tmp_path / "a.gguf").metadata
    assert md["x.u64"] == big and all(type(v) is int for v in md["x.u64"])
    with pytest.raises(ModelError, match="not integers"):
        q4._ints(md, "x.f32", "a.gguf")


def _rewrite(src, dst, edit_md=None, drop=()):
    """Copy a GGUF with some keys changed (edit_md(metadata, types)) or tensors left out."""
    import gguf
    h = read_header(src)
    md, types = dict(h.metadata), dict(h.types)
    if edit_md:
        edit_md(md, types)
    w = gguf.GGUFWriter(str(dst), md["general.architecture"])
    for k, v in md.items():
        if k in ("general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"):
            continue
        t = types[k]
        w.add_key_value(k, v, t[0], sub_type=t[1] if len(t) > 1 else None)
    raw = np.memmap(src, np.uint8, mode="r")
    for t in h.tensors:
        if t.name in drop:
            continue
        qt = Q(t.type_id)
        block, size = gguf.GGML_QUANT_SIZES[qt]
        n = t.dims[0] // block * size * int(np.prod(t.dims[1:]))
        start = h.data_offset + t.offset
        data = np.array(raw[start:start + n]).reshape(*reversed(t.dims[1:]), t.dims[0] // block * size)
        w.add_tensor(t.name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_full_attention_interval_stands_in_for_missing_layer_flags(tiny, tmp_path):
    def edit(md, types):
        del md["qwen4exp.attention.recurrent_layers"]
    m = open_model(_rewrite(tiny, tmp_path / "b.gguf", edit))
    assert m.config.recurrent_layers == (True, True, True, False)


@pytest.mark.parametrize("key,value,message", [
    ("qwen4exp.ple.layers", [3], "exactly one GDN layer"),
    ("qwen4exp.ple.head_offsets", list(range(16)), "running sums"),
    ("qwen4exp.hyper_connection.count", 1, "must be > 1"),
    ("qwen4exp.attention.indexer.top_k", 30, "multiple"),
    ("qwen4exp.attention.compress_ratios", [0, 0, 0, 0], "convert again with convert_hf_to_gguf's own pinned"),
    ("qwen4exp.ple.layer_multipliers", [2, 3, 5], "odd multipliers"),
])
def test_inconsistent_keys_are_refused(tiny, tmp_path, key, value, message):
    def edit(md, types):
        md[key] = value
    with pytest.raises(ModelError, match=message):
        open_model(_rewrite(tiny, tmp_path / "c.gguf", edit))


def test_missing_keys_and_tensors_are_refused(tiny, tmp_path):
    def edit(md, types):
        del md["qwen4exp.ple.head_vocab_sizes"]
    with pytest.raises(ModelError, match="lacks the metadata key qwen4exp.ple.head_vocab_sizes"):
        open_model(_rewrite(tiny, tmp_path / "d.gguf", edit))
    with pytest.raises(ModelError, match="no tensor blk.3.indexer.k_norm.weight"):
        open_model(_rewrite(tiny, tmp_path / "e.gguf", drop=("blk.3.indexer.k_norm.weight",)))


def test_chunks_and_single_tokens_give_the_logits_of_one_pass(tiny):
    """Prompts shorter than, equal to and longer than the 32-token budget, in chunks that split blocks, the PLE
    history and the GDN chunks, then one token at a time, in float64 (where only exact ties could differ)."""
    m = open_model(tiny)
    be = CPUBackend(m, 256)
    net = be.net
    toks = np.array(prompt(90, 1, eos_every=13))
    whole = net.forward(toks, 0, net.new_cache(256, np.float64), all_logits=True)
    for cuts in ([0, 90], [0, 1, 2, 3, 35, 36, 37, 70, 90], [0, 33, 66, 89, 90], list(range(0, 91, 7)) + [90]):
        cache = net.new_cache(256, np.float64)
        rows = [net.forward(toks[a:b], a, cache, all_logits=True) for a, b in zip(cuts, cuts[1:]) if b > a]
        np.testing.assert_allclose(np.concatenate(rows), whole, rtol=0, atol=1e-9, err_msg=str(cuts))
    # and the float32 backend: one call against its own prompt chunks and one-token steps
    be32 = CPUBackend(m, 256, chunk=5)
    one = CPUBackend(m, 256).forward(toks.tolist(), all_logits=True)
    np.testing.assert_allclose(be32.forward(toks[:60].tolist(), all_logits=True), one[:60], atol=2e-4)
    steps = np.array([be32.forward([int(t)]) for t in toks[60:]])
    np.testing.assert_allclose(steps, one[60:], atol=2e-4)
    # the prompt reaches the sparse regime: more than budget/r complete blocks
    assert len(toks) // 4 > m.config.family_params.qsa_budget // 4


def test_snapshot_restore_equals_a_cold_run(tiny):
    m = open_model(tiny)
    be = CPUBackend(m, 256, chunk=16)
    a = prompt(45, 2, eos_every=11)       # past the budget, with EOS resets in the PLE context
    be.forward(a)
    snap = be.snapshot_state()
    assert snap.n_tokens == 45 and snap.nbytes == be.state_bytes() > 0
    be.forward(prompt(30, 3))             # a different continuation changes every recurrent state
    be.restore_state(snap)
    assert be.n_cached == 45
    follow = [1021, 5, 6, 7] + prompt(20, 4)
    warm = be.forward(follow, all_logits=True)
    cold = CPUBackend(m, 256, chunk=16)
    cold.forward(a)                       # the same calls as the warm run made: the same arithmetic, bit for bit
    np.testing.assert_array_equal(warm, cold.forward(follow, all_logits=True))


def test_the_snapshot_holds_the_ple_history(tiny):
    # two prefixes that end in different tokens but leave the GDN state alone cannot be told apart without it
    m = open_model(tiny)
    be = CPUBackend(m, 128)
    be.forward(prompt(20, 5))
    snap = be.snapshot_state()
    conv, ids = snap.data[2]["conv"], snap.data[2]["ids"]
    p = m.config.family_params
    assert conv.shape == (p.ngram_size * (p.ple_conv - 1), m.config.n_embd * p.hc_count) and np.any(conv)
    assert ids.tolist() == prompt(20, 5)[-2:]


def test_recurrent_state_is_not_rewound_by_truncate(tiny):
    be = CPUBackend(open_model(tiny), 128)
    be.forward(prompt(10, 6))
    with pytest.raises(ValueError, match="cannot be rewound"):
        be.truncate(5)
    be.truncate(0)
    np.testing.assert_array_equal(be.forward(prompt(10, 7)), CPUBackend(open_model(tiny), 128).forward(prompt(10, 7)))


def test_row_cache_counts_reach_the_request_info(tiny):
    be = CPUBackend(open_model(tiny), 128)
    be.reset_stats()
    be.forward([5, 6, 7, 5, 6, 7])
    info = be.request_info()
    # 16 rows a token; the second "5 6 7" repeats the bigram and trigram rows of the first "6 7"
    assert info["ple_row_lookups"] == 6 * 16 and info["ple_row_hits"] >= 16
    assert be.info()["ple_row_cache_mib"] == q4.PLE_CACHE_BYTES >> 20
    be.reset_stats()
    assert be.request_info() == {"ple_row_lookups": 0, "ple_row_hits": 0}


def test_warm_leaves_the_table_and_experts_unread(tiny):
    be = CPUBackend(open_model(tiny), 64)
    kept = set(be.weights._dense)
    assert q4.PLE_TABLE not in kept and not any("_exps." in n for n in kept)
    assert "blk.3.indexer.q_proj.weight" in kept and "output_hc_up.weight" in kept


F16_ARGS = ["--experts", "F16", "--shexp", "F16", "--attn", "F16", "--embd", "F16", "--output", "F16", "--hc", "F16",
            "--ple", "F16"]


def test_quantized_tiny_reads_its_types_and_runs(tmp_path):
    b = make(tmp_path / "q8.gguf", *F16_ARGS, "--experts", "Q4_K", "--attn", "Q8_0", "--hc", "Q8_0")
    m = open_model(b)
    assert m.tensor("blk.0.hc_attn_up.weight").qtype == Q.Q8_0 and m.tensor(q4.PLE_TABLE).qtype == Q.F16
    assert m.tensor("blk.3.indexer.q_proj.weight").qtype == Q.BF16     # never quantised: BF16 beside Q8_0
    logits = CPUBackend(m, 64).forward(prompt(40, 8), all_logits=True)
    assert np.isfinite(logits).all() and 0.5 < logits.std(axis=1).mean() < 5


@pytest.mark.parametrize("flag,message", [(["--ple", "Q8_0"], "per_layer_token_embd.weight has rows of 16"),
                                          (["--hc", "Q4_K"], "hc_up.weight has rows of 64")])
def test_types_whose_blocks_do_not_fit_the_rows_are_refused(tmp_path, flag, message):
    with pytest.raises(SystemExit, match=message):
        make_moe.main(["--preset", "tiny-qwen4exp", *flag, "--out", str(tmp_path / "x.gguf")])
