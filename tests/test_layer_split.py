"""engine/cuda/layer_split.py: the stage planner of the multi-GPU layer split, on the CPU (no CuPy)."""
import itertools

import numpy as np
import pytest

from engine.cuda import layer_split as ls
from engine.cuda.layer_split import GiB, MiB, Card, LayerCost, SplitError, plan_layer_split
from engine.profile import from_flat

# A Qwen3-Next-80B-like layer: 512 experts of ~3 MiB, top 10, ~20 MiB of attention and router, a 4K f16 KV.
LAYER = LayerCost(20 * MiB, 16 * MiB, 3 * MiB, 512, 10)


def cards(*spec):
    """(GiB free, GB/s) pairs -> cards 0, 1, ..."""
    return [Card(i, f"card{i}", int(g * GiB), float(link)) for i, (g, link) in enumerate(spec)]


def test_equal_cards_get_equal_stages_and_the_same_step_as_one_card_of_their_sum():
    p = plan_layer_split([LAYER] * 48, cards((12, 25), (12, 25)))
    assert p.counts == [24, 24]
    assert [s.card.index for s in p.stages] == [0, 1]
    assert (p.stages[0].first, p.stages[0].end, p.stages[1].first, p.stages[1].end) == (0, 24, 24, 48)
    assert p.stages[0].slots == p.stages[1].slots > 0
    one = plan_layer_split([LAYER] * 48, cards((24, 25)))
    assert one.counts == [48] and one.handoff_us == 0
    # the same VRAM and link in all: the same misses, plus one hand-off
    assert p.step_us == pytest.approx(one.step_us + p.handoff_us, rel=1e-3)
    assert abs(p.stages[0].us - p.stages[1].us) < 1e-6 * p.step_us
    assert p.slowest_us < 0.51 * p.step_us


def test_four_equal_cards():
    p = plan_layer_split([LAYER] * 48, cards(*[(12, 25)] * 4))
    assert p.counts == [12, 12, 12, 12]


def test_a_larger_card_gets_more_layers():
    p = plan_layer_split([LAYER] * 48, cards((16, 25), (8, 25)))
    assert p.counts[0] > p.counts[1] and sum(p.counts) == 48
    # balanced: the stages' times come out near each other
    assert abs(p.stages[0].us - p.stages[1].us) < 0.1 * p.slowest_us


def test_misses_go_to_the_faster_link():
    p = plan_layer_split([LAYER] * 48, cards((12, 25), (12, 5)))
    slow = p.stages[1]
    assert p.counts[0] > p.counts[1]
    assert slow.miss_us < p.stages[0].miss_us
    # the slow card's cache holds more of its layers' routings than the fast card's
    assert slow.hit > p.stages[0].hit


def test_the_chosen_split_follows_the_rule_against_brute_force():
    rng = np.random.default_rng(7)
    for trial in range(6):
        n, S = int(rng.integers(5, 11)), int(rng.integers(2, 4))
        layers = []
        for _ in range(n):
            e = int(rng.integers(4, 17))
            use = rng.random(e) ** 3
            layers.append(LayerCost(int(rng.integers(1, 40)) * MiB, int(rng.integers(0, 20)) * MiB,
                                    int(rng.integers(1, 9)) * MiB, e, 2, tuple(use / use.sum() * 2)))
        cs = [Card(i, "c", int(rng.integers(60, 260)) * MiB, float(rng.integers(3, 30)),
                   mem_gbps=float(rng.integers(300, 1500))) for i in range(S)]
        kw = dict(embd_bytes=5 * MiB, head_bytes=7 * MiB, work_bytes=3 * MiB)
        runs = {}
        for cuts in itertools.combinations(range(1, n), S - 1):
            counts = np.diff([0, *cuts, n]).tolist()
            try:
                runs[tuple(counts)] = plan_layer_split(layers, cs, counts, **kw)
            except SplitError:
                pass
        if not runs:
            with pytest.raises(SplitError, match="no split|cannot hold even"):
                plan_layer_split(layers, cs, **kw)
            continue
        best = min(r.step_us for r in runs.values())
        near = [r for r in runs.values() if r.step_us <= best * (1 + ls.SUM_TOLERANCE) + 1e-6]
        want = min(r.slowest_us for r in near)
        got = plan_layer_split(layers, cs, **kw)
        assert got.how == "auto"
        assert got.step_us <= best * (1 + ls.SUM_TOLERANCE) + 1e-6, trial
        assert got.slowest_us == pytest.approx(want), trial
        # the auto plan's stages are the given plan's for the same counts
        again = runs[tuple(got.counts)]
        assert [s.us for s in again.stages] == pytest.approx([s.us for s in got.stages])


def test_a_card_too_small_for_one_layer_is_named():
    with pytest.raises(SplitError, match=r"GPU 1 .*cannot hold even one layer.*leave it out of --gpus"):
        plan_layer_split([LAYER] * 8, [Card(0, "big", 12 * GiB, 25.0), Card(1, "tiny", 30 * MiB, 25.0)])


def test_no_split_fits_says_how_many_layers_each_card_holds():
    # 36 MiB of weights and KV a layer: 10 layers hold about 0.35 GiB
    with pytest.raises(SplitError, match=r"no split of the 48 layers fits.*GPU 0 at most \d+.*GPU 1 at most \d+"):
        plan_layer_split([LAYER] * 48, cards((0.4, 25), (0.4, 25)))


def test_the_head_and_embedding_take_room_on_the_end_stages():
    p = plan_layer_split([LAYER] * 8, cards((2, 25), (2, 25)), [4, 4], embd_bytes=500 * MiB, head_bytes=300 * MiB)
    first, last = p.stages
    assert first.fixed_bytes == 4 * (36 * MiB) + 500 * MiB
    assert last.fixed_bytes == 4 * (36 * MiB) + 300 * MiB
    tied = plan_layer_split([LAYER] * 8, cards((2, 25), (2, 25)), [4, 4], embd_bytes=500 * MiB, tied=True)
    assert tied.stages[1].fixed_bytes == 4 * (36 * MiB) + 500 * MiB
    single = plan_layer_split([LAYER] * 8, cards((4, 25)), embd_bytes=500 * MiB, tied=True)
    assert single.stages[0].fixed_bytes == 8 * (36 * MiB) + 500 * MiB     # held once


def test_a_given_split():
    p = plan_layer_split([LAYER] * 48, cards((12, 25), (12, 25)), [30, 18])
    assert p.counts == [30, 18] and p.how == "given"
    assert p.step_us >= plan_layer_split([LAYER] * 48, cards((12, 25), (12, 25))).step_us - 1e-6


@pytest.mark.parametrize("split,msg", [
    ([24, 23], r"adds up to 47 layers; the model has 48"),
    ([16, 16, 16], r"3 stage\(s\) for 2 GPU\(s\)"),
    ([48, 0], r"at least one layer"),
])
def test_a_given_split_that_does_not_match(split, msg):
    with pytest.raises(SplitError, match=msg):
        plan_layer_split([LAYER] * 48, cards((12, 25), (12, 25)), split)


def test_a_given_split_too_large_for_its_card():
    with pytest.raises(SplitError, match=r"GPU 1 \(card1\) cannot hold layers 8-47: .* give it fewer layers"):
        plan_layer_split([LAYER] * 48, cards((12, 25), (1, 25)), [8, 40])


def test_more_cards_than_layers_or_a_card_named_twice():
    with pytest.raises(SplitError, match="every GPU needs at least one layer"):
        plan_layer_split([LAYER] * 2, cards((12, 25), (12, 25), (12, 25)))
    with pytest.raises(SplitError, match="names a card twice"):
        plan_layer_split([LAYER] * 4, [Card(0, "a", GiB, 25.0), Card(0, "a", GiB, 25.0)])


def test_each_cache_holds_the_hottest_experts_of_its_own_layers():
    use = np.zeros(512)
    use[:40] = 10 / 40                   # every routing goes to the first 40 experts
    hot = LayerCost(20 * MiB, 16 * MiB, 3 * MiB, 512, 10, tuple(use))
    p = plan_layer_split([hot] * 8, cards((2, 25), (2, 25)))
    for s in p.stages:
        assert s.slots >= 40 * s.n_layers and s.hit == pytest.approx(1.0) and s.miss_us == 0


def test_dense_layers_balance_by_compute():
    dense = [LayerCost(200 * MiB, 16 * MiB)] * 10
    p = plan_layer_split(dense, cards((2, 25), (2, 25)))
    assert p.counts == [5, 5] and all(s.hit == 1.0 and s.miss_us == 0 for s in p.stages)


def test_format_plan_names_every_stage():
    p = plan_layer_split([LAYER] * 48, cards((12, 25), (12, 25)))
    lines = ls.format_plan(p)
    assert lines[0].startswith("layer split (auto): 24,24 over GPUs 0,1; predicted decode step")
    assert "GPU 0 (card0): layers 0-23 (24)" in lines[1] and "GPU 1 (card1): layers 24-47 (24)" in lines[2]


def test_share_profile_gives_each_stage_its_own_layers_hottest_first():
    rng = np.random.default_rng(3)
    L, E = 6, 8
    flat = rng.permutation(L * E)[:30]
    prof = from_flat(L, E, flat)
    p = plan_layer_split([LayerCost(MiB, MiB, MiB, E, 2)] * L, cards((1, 25), (1, 25)), [2, 4])
    parts = ls.share_profile(prof, p)
    assert len(parts) == 2
    for part, st in zip(parts, p.stages):
        want = [g for g in flat if st.first <= g // E < st.end]
        assert part.flat_order().tolist() == want
        assert (part.n_layers, part.n_expert) == (L, E)
    assert sorted(np.concatenate([q.flat_order() for q in parts]).tolist()) == sorted(flat.tolist())


def test_layer_costs_of_a_real_file(fixtures_dir):
    from engine.gguf_model import open_model
    m = open_model(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf")
    cfg = m.config
    mc = ls.model_layer_costs(m, 256)
    assert len(mc.layers) == cfg.n_layer
    total = sum(m.tensor(n).nbytes for n in m.tensor_names())
    experts = sum(m.tensor(n).nbytes for n in m.tensor_names() if "_exps." in n)
    assert sum(lc.weights_bytes for lc in mc.layers) + mc.embd_bytes + mc.head_bytes == total - experts
    for i, lc in enumerate(mc.layers):
        raw = sum(m.tensor(m.expert_name(i, k)).nbytes for k in ("gate", "up", "down")) // cfg.n_expert
        assert raw <= lc.expert_bytes < raw + ls.BLOB_ALIGN and lc.expert_bytes % ls.BLOB_ALIGN == 0
        assert lc.kv_bytes == 2 * cfg.n_head_kv * 256 * cfg.head_dim * 2
        assert (lc.n_expert, lc.n_used) == (cfg.n_expert, cfg.n_expert_used)
    assert mc.tied == (not m.has("output.weight"))
    int8 = ls.model_layer_costs(m, 256, "int8")
    assert int8.layers[0].kv_bytes < mc.layers[0].kv_bytes
    p = mc.plan(cards((1, 25), (1, 25)))
    assert sum(p.counts) == cfg.n_layer and len(p.counts) == 2


def test_recurrent_layers_count_their_state_not_a_kv_cache():
    from pathlib import Path

    from engine.gguf_model import open_model
    m = open_model(Path(__file__).parent / "fixtures" / "hybrid" / "tiny-qwen3next-q4_k_m.gguf")
    cfg = m.config
    kv = ls.layer_kv_bytes(cfg, 1024)
    rec = cfg.recurrent_layers
    assert any(rec) and not all(rec)
    attn = [k for k, r in zip(kv, rec) if not r]
    state = [k for k, r in zip(kv, rec) if r]
    assert set(attn) == {2 * cfg.n_head_kv * 1024 * 2 * cfg.head_dim}
    # families/hybrid.py's HybridCache: conv inputs (d_conv - 1, conv channels) and S (v heads, D, D), fp32
    conv_dim = 2 * cfg.ssm_k_heads * cfg.ssm_state + cfg.ssm_inner
    assert set(state) == {4 * ((cfg.ssm_conv - 1) * conv_dim + cfg.ssm_v_heads * cfg.ssm_state ** 2)}
    assert set(ls.layer_kv_bytes(cfg, 2048)[i] for i in range(cfg.n_layer) if rec[i]) == set(state)


def test_routing_counts_become_expected_routings():
    tensors = [("blk.0.attn_q.weight", 1000), ("blk.0.ffn_gate_exps.weight", 4 * 300),
               ("blk.0.ffn_up_exps.weight", 4 * 300), ("blk.0.ffn_down_exps.weight", 4 * 300),
               ("token_embd.weight", 5000), ("output_norm.weight", 10), ("output.weight", 5000)]
    counts = np.array([[6, 2, 0, 0]])
    mc = ls.layer_costs_from_tensors(tensors, 1, 4, 2, [64], counts)
    lc = mc.layers[0]
    assert (lc.weights_bytes, lc.kv_bytes, lc.expert_bytes) == (1000, 64, 1024)
    assert lc.routings().tolist() == [1.5, 0.5, 0.0, 0.0]
    assert (mc.embd_bytes, mc.head_bytes, mc.tied) == (5000, 5010, False)
