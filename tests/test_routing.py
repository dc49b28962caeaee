"""bench/routing.py: the frequency-ranked cache curve, and make_moe's routers landing on its TARGET. CPU only."""
import argparse
from dataclasses import replace

import numpy as np
import pytest

from bench import routing as rt
from tools import make_moe as mm


def test_hit_curve_counts_what_a_ranked_cache_holds():
    # learn: expert 0 five times, 1 three times, 2 once, 3 never; measure: 0, 1, 2, 3 once each
    learn = np.array([[0], [0], [0], [0], [0], [1], [1], [1], [2]])
    measure = np.array([[3], [2], [1], [0]])
    got = rt.hit_curve(learn, measure, 4, fractions=(0.25, 0.5, 0.75, 1.0))
    np.testing.assert_allclose(got, [0.25, 0.5, 0.75, 1.0])
    skewed = np.array([[0], [0], [0], [1]])
    np.testing.assert_allclose(rt.hit_curve(learn, skewed, 4, fractions=(0.25, 0.5)), [0.75, 1.0])
    # one cache for both layers: layer 1's expert 2 is the hottest pair
    g = rt.global_curve([learn, np.array([[2]] * 9)], [measure, np.array([[2], [2]])], 4, fractions=(1 / 8,))
    np.testing.assert_allclose(g, [2 / 6])


def test_target_is_concave_and_interpolates():
    xs = [0.0, *rt.TARGET]
    ys = [0.0, *rt.TARGET.values()]
    slopes = np.diff(ys) / np.diff(xs)
    assert np.all(np.diff(slopes) < 0) and np.all(slopes > 0)
    assert rt.target_at(0.5) == rt.TARGET[0.5]
    assert rt.TARGET[0.25] < rt.target_at(0.375) < rt.TARGET[0.41]
    np.testing.assert_allclose(rt.cached_fractions(8), [0.25, 0.375, 0.5, 0.625, 1.0])


def _curve(preset: str, n_layer: int | None = None, zipf_s: float | None = None):
    p = mm.PRESETS[preset]
    shape = p.shape if n_layer is None else replace(p.shape, n_layer=n_layer)
    routers = rt.preset_routers(shape, 0, zipf_s=p.zipf_s if zipf_s is None else zipf_s)
    per_layer, glob = rt.curves(routers, shape.n_expert_used, rt.random_prompts(routers, 8, 512, 0.0, 1))
    return per_layer, glob, shape.n_expert


@pytest.mark.parametrize("preset, n_layer", [("tiny", None), ("qwen3-30b-a3b", 3)])
def test_default_routers_land_on_the_target(preset, n_layer):
    per_layer, glob, n_expert = _curve(preset, n_layer)
    assert rt.off_target(per_layer.mean(0), n_expert) <= rt.BAND
    assert rt.off_target(glob, n_expert) <= rt.BAND
    for curve in per_layer:       # no layer far off either (a layer's own ranking noise is ~0.02)
        assert rt.off_target(curve, n_expert) <= rt.BAND + 0.04
        assert np.all(np.diff(curve) > 0) and curve[-1] == 1.0


@pytest.mark.parametrize("zipf_s", [0.0, 0.4])
def test_band_rejects_flat_and_overskewed_routers(zipf_s):
    per_layer, _, n_expert = _curve("qwen3-30b-a3b", 2, zipf_s)
    assert rt.off_target(per_layer.mean(0), n_expert) > rt.BAND
    if zipf_s == 0.0:     # flat: a cache of f of the experts catches f of the routings
        np.testing.assert_allclose(per_layer.mean(0), rt.cached_fractions(n_expert), atol=0.02)


@pytest.mark.parametrize("preset", ["tiny", "gpt-oss-tiny"])
def test_file_routers_are_the_in_memory_ones_and_forward_runs(tmp_path, preset):
    # gpt-oss: its own tensor plan, post_attention_norm as the FFN norm, and a router bias
    gm = pytest.importorskip("engine.gguf_model")
    path = tmp_path / f"{preset}.gguf"
    assert mm.main(["--preset", preset, "--seed", "5", "--out", str(path)]) == 0
    model = gm.open_model(path)
    p = mm.PRESETS[preset]
    from_file = rt.file_routers(model)
    in_memory = rt.preset_routers(p.shape, 5, zipf_s=p.zipf_s)
    assert len(from_file) == len(in_memory) == 4
    for f, m in zip(from_file, in_memory):
        assert all(np.array_equal(a, b) for a, b in zip(f, m))
    assert np.any(in_memory[0][2] != 0) == (preset == "gpt-oss-tiny")
    k = p.shape.n_expert_used
    hidden = rt.forward_inputs(model, 2, 32, 0)
    assert [h.shape for h in hidden] == [(2, 32, 256)] * 4
    assert all(np.isfinite(h).all() for h in hidden)
    # the router input is RMS-normed: unit RMS before the norm weight
    np.testing.assert_allclose(np.sqrt(np.mean((hidden[1] / in_memory[1][1]) ** 2, axis=-1)), 1, rtol=1e-3)
    if preset == "gpt-oss-tiny":     # the routing is the engine's, bias included: its router's ids for the inputs
        from engine.backend_cpu import CPUBackend
        engine_ids, _ = CPUBackend(model, 32, warm=False).net.router(1, hidden[1][0])
        ids = rt.route(from_file[1], hidden[1][0], k)
        assert np.array_equal(np.sort(ids, axis=1), np.sort(engine_ids, axis=1))
    fs = (0.25, 0.5, 1.0)
    per_layer, glob = rt.curves(from_file, k, hidden, fs)
    within = rt.prompt_curves(from_file, k, hidden, fs)
    lru = rt.lru_curve(from_file, k, hidden, fs)
    for c in (per_layer, within, lru):
        assert c.shape == (4, len(fs)) and np.all(np.diff(c, axis=1) >= 0)
    assert np.all(per_layer[:, -1] == 1.0) and np.all(within[:, -1] == 1.0)
    # an LRU of every expert misses only an expert's first routing in the prompt (those in the first half uncounted)
    for il in range(4):
        first_seen = []
        for x in hidden[il]:
            flat = rt.route(from_file[il], x, k).ravel()
            seen_before = np.array([e in flat[:i] for i, e in enumerate(flat)])
            first_seen.append(seen_before[len(flat) // 2:].mean())
        assert lru[il, -1] == pytest.approx(np.mean(first_seen))


def test_cli_prints_the_curve_beside_the_target(capsys):
    assert rt.main(["--preset", "qwen3-30b-a3b", "--n-layer", "2", "--prompts", "4", "--layers"]) == 0
    out = capsys.readouterr().out
    assert "zipf-s 0.2" in out and "| 1 |" in out and "| TARGET | 0.450 | 0.606 | 0.700 | 0.831 | 1.000 |" in out
    assert "within the band" in out and "an adaptive cache" in out
    assert rt.main(["--preset", "qwen3-30b-a3b", "--n-layer", "1", "--prompts", "2", "--fractions", "1,0.15"]) == 0
    out = capsys.readouterr().out       # 0.15 of 128 experts is 19: 14.8%
    assert "| layer | 14.8% | 100.0% |" in out and "| LRU |" in out
    assert rt._fractions("0.5,0.15,0.5") == (0.15, 0.5)
    for bad in ("0", "1.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="fractions of the experts"):
            rt._fractions(bad)
    for argv, message in ((["--preset", "tiny", "--forward"], "need --model"),
                          (["--model", "x.gguf", "--route-preset", "tiny"], "--route-preset needs --forward"),
                          (["--prompts", "1"], "at least 2")):
        with pytest.raises(SystemExit, match=message):
            rt.main(argv)


def test_a_shared_per_prompt_component_concentrates_routing_within_the_prompt():
    # What a random-weight model's deep layers do to routing (their tokens share ~2/3 of their energy), whatever
    # the router: the reason the H200's measured hit rates were far above these curves.
    p = mm.PRESETS["qwen3-30b-a3b"]
    routers = rt.preset_routers(replace(p.shape, n_layer=1), 0, zipf_s=p.zipf_s)
    alone = rt.prompt_curves(routers, 8, rt.random_prompts(routers, 4, 512, 0.0, 3))[0]
    shared = rt.prompt_curves(routers, 8, rt.random_prompts(routers, 4, 512, 0.67, 3))[0]
    assert shared[2] > 0.97 and alone[2] < 0.8


def test_attn_gain_keeps_a_prompts_tokens_from_sharing_one_hidden_state(tmp_path):
    # The mechanism behind the H200's 0.997: nearly flat attention puts the prompt's mean into every token. Sharper
    # attention (make_moe --attn-gain) takes it out; 8 layers of the tiny shape show it as 48 real ones do.
    gm = pytest.importorskip("engine.gguf_model")
    shares = {}
    for gain in (1.0, 3.0):
        path = tmp_path / f"g{gain}.gguf"
        assert mm.main(["--preset", "tiny", "--n-layer", "8", "--attn-gain", str(gain), "--out", str(path)]) == 0
        hidden = rt.forward_inputs(gm.open_model(path), 2, 64, 0)
        shares[gain] = rt.shared_energy(hidden[-1])
    assert shares[1.0] > 0.3 and shares[3.0] < 0.15
    x = np.random.default_rng(0).standard_normal((2, 64, 32))
    assert rt.shared_energy(x) < 0.05 and rt.shared_energy(np.ones((2, 64, 32)) + 0.01 * x) > 0.99


def test_temporal_stats_count_repeats_windows_and_lru_hits():
    ids = np.array([[0, 1], [1, 2], [2, 3], [0, 1]])
    # next token: 1 of 2, 1 of 2, 0 of 2; within 2 tokens (from t=2): 1 of 2, 1 of 2; LRU of 4: t1's 1, t2's 2,
    # t3's 0 and 1 hit
    assert rt.temporal_stats(ids, 8, window=2, lru_fraction=0.5) == {"repeat_next": 2 / 6, "within_2": 0.5,
                                                                      "lru_50": 0.5}
    assert rt.lru_hits(np.array([[0], [1], [2], [0]]), 2) == 0.0      # 0 was evicted by 2
    assert rt.lru_hits(np.array([[0], [1], [0], [2], [0]]), 2) == 0.4  # 0 kept fresh, 1 evicted
    assert rt.lru_hits(np.array([[0], [1], [0], [2], [0]]), 2, warm=2) == 2 / 3   # t2 and t4 hit, t3 misses
    rng = np.random.default_rng(0)
    chance = rt.temporal_stats(np.array([rng.choice(128, 8, replace=False) for _ in range(3000)]), 128)
    assert chance["repeat_next"] == pytest.approx(8 / 128, abs=0.01)   # the 6% the trained traces compare with
    assert chance["lru_40"] == pytest.approx(0.4, abs=0.03)


def test_forward_attn_gain_is_make_moes(tmp_path):
    gm = pytest.importorskip("engine.gguf_model")
    plain, gained = tmp_path / "g1.gguf", tmp_path / "g2.gguf"
    for path, gain in ((plain, "1"), (gained, "2")):
        assert mm.main(["--preset", "tiny", "--n-layer", "2", "--attn-gain", gain, "--out", str(path)]) == 0
    a = rt.forward_inputs(gm.open_model(plain), 2, 16, 0, attn_gain=2.0)
    b = rt.forward_inputs(gm.open_model(gained), 2, 16, 0)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
