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


# --- the staged backend's pieces that need no GPU (engine/cuda/expert_cache.py, engine/cuda/staged_backend.py) ----

def test_a_stage_cache_splits_its_slots_among_its_own_experts_pools():
    from engine.cuda.expert_cache import served_split
    from engine.cuda.expert_layout import SlotPools
    # 4 layers of 4 experts: layers 0-1 in blobs of 100 bytes, 2 in 200, 3 in 300 (a mixed recipe)
    es = np.repeat([100, 100, 200, 300], 4)
    pools = SlotPools(es)
    first = np.arange(16) < 8                   # a stage of layers 0-1: only the 100-byte pool
    assert served_split(pools, es, first, 5).tolist() == [5, 0, 0]
    assert served_split(pools, es, first, 99).tolist() == [8, 0, 0]
    last = np.arange(16) >= 8                   # layers 2-3: the 200- and 300-byte pools, half each
    assert served_split(pools, es, last, 4).tolist() == [0, 2, 2]
    assert served_split(pools, es, np.ones(16, bool), 16).tolist() == pools.split(16).tolist()
    assert served_split(pools, es, np.zeros(16, bool), 3).tolist() == [0, 0, 0]


def test_the_learned_order_is_resident_then_counted_then_the_prior():
    from engine.cuda.expert_cache import learned_order
    slot_of = np.array([-1, 3, -1, 0, -1, -1])
    heat = np.array([0.0, 1.0, 5.0, 2.0, 0.0, 0.0])
    prior = np.array([-1, -1, -1, -1, 1, 0])
    assert learned_order(slot_of, heat, prior).tolist() == [3, 1, 2, 5, 4]


class _FakeCache:
    """What StageCaches asks of an ExpertCache, recording the stream each call was given."""

    def __init__(self, serves, heat, resident, stats, landed=True):
        self.serves, self.heat = np.asarray(serves, dtype=bool), np.asarray(heat, dtype=np.float64)
        self._resident, self._stats, self._landed = np.asarray(resident), stats, landed
        self.n_layer, self.n_expert, self.n_total, self.stride = 2, 2, 4, 64
        self.arena, self.n_slots, self.counts_taken = None, int(np.asarray(resident).sum()), False
        self.prior = np.full(4, -1)
        self.calls = []

    def poll(self, stream, wait=False):
        self.calls.append(("poll", stream))
        return stream == "s0"

    def adapt_start(self, stream):
        self.calls.append(("adapt_start", stream))
        self.counts_taken = True

    def counts_landed(self):
        return self.counts_taken and self._landed

    def adapt_finish(self, stream):
        self.calls.append(("adapt_finish", stream))
        self.counts_taken = False
        return 1

    def take_counts(self, stream):
        self.calls.append(("take_counts", stream))
        return np.where(self.serves, 1, 0).astype(np.int32)

    def read_stats(self, stream):
        self.calls.append(("read_stats", stream))
        return self._stats

    def reset_stats(self, stream):
        self.calls.append(("reset_stats", stream))

    def resident(self):
        return self._resident


def test_stage_caches_act_each_on_its_own_stream_and_add_up():
    pytest.importorskip("cupy")         # engine.cuda.staged_backend imports CuPy (no GPU needed)
    from engine.cuda.staged_backend import StageCaches
    a = _FakeCache([1, 1, 0, 0], [3.0, 0.0, 0.0, 0.0], [True, False, False, False], (5, 8))
    b = _FakeCache([0, 0, 1, 1], [0.0, 0.0, 1.0, 2.0], [False, False, False, True], (2, 8), landed=False)
    sc = StageCaches([a, b], ["s0", "s1"])
    assert sc.n_slots == 2 and sc.n_total == 4
    assert sc.poll("backend") is True                   # some cache pointed its table at landed swaps
    assert sc.read_stats("backend") == (7, 16)
    sc.reset_stats("backend")
    sc.adapt_start("backend")
    assert sc.counts_taken and not sc.counts_landed()    # the second cache's counts are still on their way
    b._landed = True
    assert sc.counts_landed() and sc.adapt_finish("backend") == 2
    assert sc.take_counts("backend").tolist() == [1, 1, 1, 1]
    for c, s in ((a, "s0"), (b, "s1")):
        assert {stream for _, stream in c.calls} == {s}, c.calls      # never the caller's stream
    assert sc.resident().tolist() == [True, False, False, True]
    assert sc.heat.tolist() == [3.0, 0.0, 1.0, 2.0]
    assert sc.learned_order().tolist() == [0, 3, 2]
    assert sc.heat_u8().tolist() == [255, 0, 85, 170]
    sc.fold_counts()
    assert a.heat.tolist() == [4.0, 1.0, 0.0, 0.0] and b.heat.tolist() == [0.0, 0.0, 2.0, 3.0]


def test_stages_of_takes_the_resolved_split():
    pytest.importorskip("cupy")
    from engine.cuda.args import CudaOptions
    from engine.cuda.staged_backend import stages_of
    specs = stages_of(CudaOptions(gpus=(0, 0), layer_split=(3, 1)), 4)
    assert [(s.device, s.first, s.end) for s in specs] == [(0, 0, 3), (0, 3, 4)]
    with pytest.raises(st.StageError, match="takes the split's layer counts"):
        stages_of(CudaOptions(gpus=(0, 0), layer_split="auto"), 4)
    with pytest.raises(st.StageError, match="two or more stages"):
        stages_of(CudaOptions(gpus=(0,), layer_split=(4,)), 4)
    with pytest.raises(st.StageError, match="covers 5 layers; this model has 4"):
        stages_of(CudaOptions(gpus=(0, 0), layer_split=(3, 2)), 4)


def test_the_staged_prompt_pass_hands_each_chunk_on_and_never_waits_for_a_later_stage():
    """StagedPrefill.forward's order of work (fakes for the stages' passes, streams and hand-offs): each chunk goes
    through the stages in order, each stage's rows to the next through its hand-off, and a stage waits only for its
    own previous rows' copy (wait_landed) before writing the next chunk's, never for a later stage: on two cards
    stage s runs chunk c + 1 while stage s + 1 runs chunk c."""
    pytest.importorskip("cupy")
    from engine.cuda.staged_backend import StagedPrefill
    log = []

    class Stream:
        def __init__(self, i):
            self.i = i

        def __enter__(self):
            log.append(("on", self.i))

        def __exit__(self, *a):
            return False

    class Pass:
        def __init__(self, i):
            self.i, self.step = i, type("Step", (), {"stream": Stream(i)})()

        def forward(self, tokens, pos0, all_logits, ahead=None, x_in=None):
            log.append(("forward", self.i, pos0, x_in, ahead))
            return f"rows{self.i}@{pos0}"

    class Hand:
        def __init__(self, i):
            self.i = i

        def wait_landed(self):
            log.append(("wait_landed", self.i))

        def send(self, src, rows):
            log.append(("send", self.i, src, rows))
            return f"buf{self.i}:{src}"

    sp = StagedPrefill.__new__(StagedPrefill)
    sp.stages, sp.handoffs = [Pass(0), Pass(1), Pass(2)], [Hand(0), Hand(1)]
    nxt = {0: list(range(16, 32)), 16: None}        # the next chunk's tokens, known for the first
    for pos0 in (0, 16):
        assert sp.forward(list(range(16)), pos0, False, ahead=nxt[pos0]) == f"rows2@{pos0}"
    want = []
    for pos0 in (0, 16):
        a = nxt[pos0]
        want += [("on", 0), ("wait_landed", 0), ("forward", 0, pos0, None, a), ("send", 0, f"rows0@{pos0}", 16),
                 ("on", 1), ("wait_landed", 1), ("forward", 1, pos0, f"buf0:rows0@{pos0}", a),
                 ("send", 1, f"rows1@{pos0}", 16),
                 ("on", 2), ("forward", 2, pos0, f"buf1:rows1@{pos0}", a)]
    assert log == want


def test_the_staged_prompt_pass_takes_what_the_backend_passes_a_prompt_pass():
    """CUDABackend._prefill calls its pass's forward with Prefill.forward's arguments (but x_in, a stage's own): the
    staged pass must take each of them (a keyword added to one and not the other failed every staged prompt on the
    GPU)."""
    pytest.importorskip("cupy")
    import inspect

    from engine.cuda.prefill import Prefill
    from engine.cuda.staged_backend import StagedPrefill
    one = set(inspect.signature(Prefill.forward).parameters) - {"x_in"}
    assert one <= set(inspect.signature(StagedPrefill.forward).parameters)
