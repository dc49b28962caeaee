"""Per-layer expert layouts on the CPU (engine/cuda/expert_layout.py): each layer's blob offsets from its own quant
types, the VRAM cache's slot pools (one per blob size, split in proportion to the experts, monotone in the slot count,
a uniform file's cache exactly as before), the resident budget over blobs of different sizes, and the two-type kernel
instances. The Qwen3-30B-A3B arithmetic behind the pool scheme is checked here too."""
import numpy as np
import pytest

from engine.cuda import kernels
from engine.cuda.expert_layout import ExpertLayout, SlotPools, blob_layout, layer_layout
from engine.cuda.expert_source import pinned_mask
from engine.cuda.quant_types import qtype
from engine.gguf_model import open_model
from mixed_models import layer_types, use_more_bits, write

GiB = 1 << 30


@pytest.fixture(scope="module")
def mix_model(tmp_path_factory, fixtures_dir):
    path = tmp_path_factory.mktemp("mix") / "mix.gguf"
    per_layer = write(path, "mix", ["--preset", "tiny", "--n-layer", "8", "--seed", "3",
                                    "--vocab", str(fixtures_dir / "vocab" / "tiny-bpe-1024.gguf")])
    return open_model(path), per_layer


def test_more_bits_layers_are_llama_cpps():
    # llama-quant.cpp use_more_bits: the first and last eighth, and every third layer between
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    more = [i for i in range(48) if use_more_bits(i, 48)]
    assert more[:6] == list(range(6)) and more[-6:] == list(range(42, 48))
    assert more[6:-6] == list(range(8, 42, 3)) and len(more) == 24


def test_each_layer_has_its_own_blob(mix_model):
    model, per_layer = mix_model
    lay = blob_layout(model)
    assert not lay.uniform
    for i, types in enumerate(per_layer):
        ly = lay.layer(i)
        g, u, d = (model.expert_bytes(i, k, 0).size for k in ("gate", "up", "down"))
        assert (ly.up_off, ly.down_off, ly.nbytes) == (g, g + u, g + u + d)
        assert ly.stride % 256 == 0 and ly.nbytes <= ly.stride < ly.nbytes + 256
        assert (ly.qt_gate_up, ly.up_type, ly.qt_down) == tuple(int(types[k]) for k in ("gate", "up", "down"))
        assert (ly.qt_up >= 0) == (types["gate"] != types["up"])
        if ly.qt_up >= 0:
            assert ly.rb_up == qtype(ly.qt_up).row_bytes(ly.n_embd)
    assert lay.stride == max(lay.strides()) and lay.nbytes == max(ly.nbytes for ly in lay.layers)
    assert lay.qtype_ids() == {int(t) for types in per_layer for t in types.values()}
    np.testing.assert_array_equal(lay.expert_strides(model.config.n_expert),
                                  np.repeat(lay.strides(), model.config.n_expert))


def test_a_uniform_file_has_one_layout(fixtures_dir):
    lay = blob_layout(open_model(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"))
    assert lay.uniform and len(set(lay.strides())) == 1


def test_an_unsupported_type_is_named():
    with pytest.raises(ValueError, match="no CUDA kernel"):
        layer_layout("Q4_K", "TQ1_0", "Q4_K", 256, 256)


@pytest.mark.parametrize("stride", [110_592, 2_654_208])
def test_one_pool_is_the_old_cache(stride):
    p = SlotPools(np.full(1000, stride))
    assert p.n_pools == 1
    for nbytes in [0, stride - 1, stride, 7 * stride + 5, 1000 * stride, 5000 * stride, -3]:
        n = p.slots_for_bytes(nbytes)
        assert n == max(0, min(1000, nbytes // stride))
        assert list(p.split(n)) == [n] and p.bytes_of(n) == n * stride


def test_pools_split_in_proportion_and_never_shrink():
    rng = np.random.default_rng(0)
    strides = np.repeat([300, 200, 100, 500], [40, 80, 24, 16])[rng.permutation(160)]
    p = SlotPools(strides)
    assert list(p.strides) == [100, 200, 300, 500] and list(p.counts) == [24, 80, 40, 16]
    np.testing.assert_array_equal(p.strides[p.expert_pool], strides)
    prev = np.zeros(4, dtype=np.int64)
    for n in range(161):
        s = p.split(n)
        assert s.sum() == n and (s >= prev).all() and (s <= p.counts).all()
        assert (np.abs(s - n * p.counts / 160) <= 1).all()
        assert p.bytes_of(n) == int((s * p.strides).sum())
        prev = s
    for nbytes in rng.integers(0, p.bytes_of(160) + 1000, 200):
        n = p.slots_for_bytes(nbytes)
        assert p.bytes_of(n) <= nbytes and (n == 160 or p.bytes_of(n + 1) > nbytes)


def test_the_q4_k_m_30b_pools_hold_what_its_bytes_allow():
    """Qwen3-30B-A3B (48 layers, 128 experts of 768 x 2048): Q4_K_M's ffn_down_exps is Q6_K on 24 layers. Pools
    hold as many experts as the mean blob allows (slots of the largest blob would hold 6.6% fewer); the uniform Q4_K
    file holds 7.6% more than the Q4_K_M one in the same bytes."""
    n_layer, n_expert, n_ff, n_embd = 48, 128, 768, 2048
    q4 = layer_layout("Q4_K", "Q4_K", "Q4_K", n_ff, n_embd)
    q6 = layer_layout("Q4_K", "Q4_K", "Q6_K", n_ff, n_embd)
    assert (q4.stride, q6.stride) == (2_654_208, 3_059_712)
    km = ExpertLayout(tuple(q6 if use_more_bits(i, n_layer) else q4 for i in range(n_layer)))
    uni = ExpertLayout((q4,) * n_layer)
    budget = 12 * GiB
    n_uni = SlotPools(uni.expert_strides(n_expert)).slots_for_bytes(budget)
    pools = SlotPools(km.expert_strides(n_expert))
    n_km = pools.slots_for_bytes(budget)
    n_largest = budget // km.stride
    assert n_uni == budget // q4.stride == 4854
    assert list(pools.split(n_km)) == [n_km // 2, n_km - n_km // 2] and n_km == 4510
    assert n_largest == 4211 < n_km < n_uni
    mean = (q4.stride + q6.stride) / 2
    assert n_km == pytest.approx(budget / mean, abs=2)


def test_the_resident_budget_counts_each_blob_at_its_size():
    sizes = np.array([100, 300, 100, 300, 500, 100])
    order = [4, 1, 0, 2, 3, 5]
    assert np.flatnonzero(pinned_mask(6, sizes, 899, order)).tolist() == [1, 4]           # 500 + 300
    assert np.flatnonzero(pinned_mask(6, sizes, 999, order)).tolist() == [0, 1, 4]        # + 100
    assert np.flatnonzero(pinned_mask(6, sizes, 1000, order)).tolist() == [0, 1, 2, 4]     # + 100, exactly full
    assert pinned_mask(6, sizes, 10_000, order).all() and not pinned_mask(6, sizes, 99, order).any()
    # a single stride is the old rule: whole blobs within the budget
    assert pinned_mask(6, 100, 450, order).sum() == 4


def test_two_type_kernels_are_instantiated_for_the_pairs_given(tmp_path):
    src = tmp_path / "k2.cu"
    src.write_text("template <int QT> __global__ void one(int a) {}\n"
                   "template <int QG, int QU> __global__ __launch_bounds__(256, 2) void two(int a) {}\n")
    q4, q5, q6 = (qtype(n).id for n in ("Q4_K", "Q5_K", "Q6_K"))
    (b,) = kernels.parse_builds(src, ["Q4_K", "Q6_K"], pairs=[("Q4_K", "Q5_K"), ("Q4_K", "Q5_K")])
    assert b.instances == (f"one<{q4}>", f"one<{q6}>", f"two<{q4}, {q5}>")
    (b,) = kernels.parse_builds(src, ["Q4_K"])
    assert b.instances == (f"one<{q4}>",)                   # a model's types without mixed layers: no pairs
    (b,) = kernels.parse_builds(src)                        # the compile test: representative pairs
    pairs = [tuple(int(x) for x in i[4:-1].split(", ")) for i in b.instances if i.startswith("two<")]
    assert pairs and all(a != u for a, u in pairs) and (q4, q5) in pairs
    assert len([i for i in b.instances if i.startswith("one<")]) == len(kernels.QTYPES)


def test_mix_layout_has_what_the_gpu_tests_need():
    t = layer_types("mix", 8)
    assert any(x["gate"] != x["up"] for x in t)
    assert {x["down"].name for x in t} >= {"Q4_K", "Q6_K", "Q8_0", "BF16"}
