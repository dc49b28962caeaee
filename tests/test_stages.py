"""engine/cuda/stages.py's bookkeeping (no GPU): which layers a stage owns, the VRAM shares of stages on one device,
each stage's share of the expert profile."""
import numpy as np
import pytest

from engine.cuda import stages as st
from engine.profile import ExpertProfile


def test_stages_own_consecutive_layers_the_first_embeds_the_last_heads():
    specs = st.stage_specs([0, 0, 1], [5, 4, 3], 12)
    assert [(s.device, s.first, s.end) for s in specs] == [(0, 0, 5), (0, 5, 9), (1, 9, 12)]
    assert [s.embeds for s in specs] == [True, False, False]
    assert [s.heads for s in specs] == [False, False, True]
    assert list(specs[1].layers) == [5, 6, 7, 8]
    owners = [next(s.index for s in specs if s.owns(li)) for li in range(12)]
    assert owners == [0] * 5 + [1] * 4 + [2] * 3
    assert st.shared_devices(specs) and not st.shared_devices(st.stage_specs([0, 1], [6, 6], 12))
    one = st.stage_specs([0], [12], 12)[0]
    assert one.embeds and one.heads


@pytest.mark.parametrize("devices,counts,n,msg", [
    ([0, 1], [6], 12, "1 layer counts for 2 GPU"),
    ([0, 1], [6, 0], 6, "at least one layer"),
    ([0, 1], [6, 5], 12, "covers 11 layers; this model has 12"),
    ([], [], 0, "at least one stage"),
])
def test_a_split_that_cannot_run_says_what_to_change(devices, counts, n, msg):
    with pytest.raises(st.StageError, match=msg):
        st.stage_specs(devices, counts, n)


def test_stages_on_one_device_share_its_vram_by_their_layers_bytes():
    specs = st.stage_specs([0, 0, 1], [2, 2, 2], 6)
    layer_bytes = [10, 10, 30, 30, 7, 7]
    shares = st.device_shares(specs, layer_bytes, {0: 1001, 1: 500})
    assert shares[0] == 1001 * 20 // 80 and shares[1] == 1001 - shares[0]     # the rest to the device's last
    assert shares[2] == 500                                                   # alone on its device: all of it
    assert sum(shares[:2]) == 1001
    equal = st.device_shares(st.stage_specs([0, 0], [3, 3], 6), [5] * 6, {0: 1 << 30})
    assert equal == [1 << 29, 1 << 29]
    with pytest.raises(st.StageError, match="no free VRAM figure for GPU 1"):
        st.device_shares(specs, layer_bytes, {0: 1})
    with pytest.raises(st.StageError, match="5 layer sizes for 6 layers"):
        st.device_shares(specs, layer_bytes[:5], {0: 1, 1: 1})


def test_each_stage_gets_the_profile_of_its_own_layers_hottest_first():
    rng = np.random.default_rng(3)
    n_layer, n_expert = 6, 8
    flat = rng.permutation(n_layer * n_expert)[:30]
    order = np.stack([flat // n_expert, flat % n_expert], axis=1).astype(np.uint16)
    prof = ExpertProfile(n_layer, n_expert, order)
    specs = st.stage_specs([0, 0], [4, 2], n_layer)
    parts = st.profile_shares(prof, specs)
    for s, p in zip(specs, parts):
        assert p.n_layers == n_layer and p.n_expert == n_expert
        assert all(s.owns(int(li)) for li in p.order[:, 0])
        want = [tuple(r) for r in order if s.owns(int(r[0]))]          # the global order, kept
        assert [tuple(r) for r in p.order] == want
    assert sum(len(p.order) for p in parts) == len(order)


def test_every_cuda_family_says_whether_a_stage_may_end_after_any_layer():
    pytest.importorskip("cupy")     # the family modules import CuPy (no GPU needed)
    from engine.cuda.families.registry import FAMILIES
    split = {fam.name: fam.stage_split for fam in FAMILIES}
    assert split["moe"] and split["hybrid"] and split["gptoss"]
    assert split["qwen4exp"] is False       # its hyper-connection streams cross layers besides x
