"""Lending expert-cache slots to the streamed prompt pass's ring (engine/cuda/expert_cache.py): which slots are lent
(free first, then the coldest occupied, never one a pending swap fills), what lending does to the pointer table and
the cache's books, and the refill when they come back. CPU only: the cache's state is driven without a GPU (its
table uploads and side-stream copies recorded by fakes)."""
import numpy as np
import pytest

pytest.importorskip("cupy")      # the module imports CuPy; nothing here touches a device

from engine.cuda.expert_cache import FREE, LENT, ExpertCache, coldest_order, lend_choice, refill_order  # noqa: E402
from engine.cuda.expert_layout import SlotPools  # noqa: E402

N_EXPERT, N_LAYER = 8, 3
N_TOTAL = N_EXPERT * N_LAYER
STRIDE = 1000
SLOT_LO = 7_000_000
HOME = np.arange(N_TOTAL, dtype=np.uint64) * 10_000 + 1_000_000


def test_coldest_first_by_heat_then_profile_rank():
    owner = np.array([5, -1, 2, 7, -2, 0])
    heat = np.zeros(10)
    heat[[5, 2, 7, 0]] = [3.0, 1.0, 1.0, 0.0]
    prior = np.full(10, -1)
    prior[2], prior[7] = 4, 9          # equal heat: the later profile rank is colder
    assert coldest_order(owner, heat, prior).tolist() == [5, 3, 2, 0]


def test_lend_choice_free_first_then_coldest_never_pending_or_lent():
    owner = np.array([3, FREE, 1, LENT, 4, FREE, 0])
    heat = np.array([5.0, 9.0, 0.0, 0.0, 2.0])
    prior = np.full(5, -1)
    assert lend_choice(owner, heat, prior, 4).tolist() == [1, 5, 0, 4]     # free, then heats 0 and 2
    # slots a swap is copying into are never lent, free or not
    assert lend_choice(owner, heat, prior, 4, pending=[5, 0]).tolist() == [1, 4, 6, 2]
    assert lend_choice(owner, heat, prior, 10, occupied=False).tolist() == [1, 5]      # --ring: free only
    evictable = np.array([True, True, True, False, True])      # expert 3 has no pinned copy (memory modes)
    assert 0 not in lend_choice(owner, heat, prior, 10, evictable=evictable).tolist()
    assert lend_choice(owner, heat, prior, 0).tolist() == []
    got = lend_choice(owner, heat, prior, 99)
    assert 3 not in got.tolist() and len(got) == len(set(got.tolist())) == 6


def test_refill_order_is_hottest_without_a_slot_and_readable():
    slot_of = np.array([-1, 0, -1, -1, -1, 1])
    heat = np.array([1.0, 9.0, 3.0, 0.0, 0.0, 9.0])
    prior = np.array([-1, -1, -1, 5, 2, -1])
    readable = np.array([True, True, True, True, True, True])
    assert refill_order(slot_of, heat, prior, readable).tolist() == [2, 0, 4, 3]
    readable[2] = False                # a file-only expert (entry 0) cannot be copied
    assert refill_order(slot_of, heat, prior, readable).tolist() == [0, 4, 3]


class FakeEvent:
    def __init__(self, done=True):
        self.done = done

    def synchronize(self):
        self.done = True


class FakeArena:
    n_layer, n_expert, n_total = N_LAYER, N_EXPERT, N_TOTAL
    blob_ptr = HOME


def fake_cache(n_slots, expert_stride=None):
    """An ExpertCache's host-side state without device memory: table uploads and copies are recorded.
    expert_stride: blob bytes per expert (pools per size), else STRIDE for all."""
    c = ExpertCache.__new__(ExpertCache)
    c.arena, c.n_layer, c.n_expert, c.n_total, c.stride = FakeArena, N_LAYER, N_EXPERT, N_TOTAL, STRIDE
    c.n_slots, c.slot_lo = n_slots, SLOT_LO
    c.pools = SlotPools(np.full(N_TOTAL, STRIDE) if expert_stride is None else expert_stride)
    c._make_slots(c.pools.split(n_slots))
    c.slot_addr += np.uint64(SLOT_LO)
    c.slot_hi = SLOT_LO + c.nbytes
    c.table_host = HOME.copy()
    c.slot_of = np.full(N_TOTAL, -1, dtype=np.int64)
    c.owner = np.full(n_slots, FREE, dtype=np.int64)
    c.heat = np.zeros(N_TOTAL)
    c.prior = np.full(N_TOTAL, -1, dtype=np.int64)
    c.serves, c.n_served = np.ones(N_TOTAL, dtype=bool), N_TOTAL       # every layer's experts (no stage)
    c._pending, c.source, c.swaps, c.bytes_swapped = None, None, 0, 0
    c.uploads, c.copies = [], []
    c._upload_table = lambda stream: c.uploads.append(c.table_host.copy())

    def start(ids, slots, stream):       # what _start_copies leaves behind, the copies only recorded
        c.copies.append((list(ids), list(slots)))
        c._pending = (FakeEvent(done=False), list(ids), list(slots))
    c._start_copies = start
    return c


def put(c, g, s):
    c.slot_of[g], c.owner[s], c.table_host[g] = s, g, c.slot_ptr(s)


def check_books(c):
    """slot_of and owner agree, and every entry points at the expert's slot or its home."""
    for s, g in enumerate(c.owner):
        if g >= 0:
            assert c.slot_of[g] == s and c.table_host[g] == c.slot_ptr(s)
    for g in np.flatnonzero(c.slot_of < 0):
        assert c.table_host[g] == HOME[g]


def test_lend_evicts_the_coldest_and_give_back_refills_with_the_hottest():
    c = fake_cache(6)
    for s, g in enumerate([0, 1, 2, 3, 4, 5]):
        put(c, g, s)
    c.heat[:] = np.arange(N_TOTAL)[::-1]           # expert 0 hottest; 23 coldest
    c.heat[[7, 9]] = 100.0                         # two hot experts without a slot
    lent = c.lend(2, stream=None)
    assert sorted(lent) == [4, 5]                  # experts 5 and 4 are the coldest resident ones
    assert (c.owner[lent] == LENT).all() and c.slot_of[4] == c.slot_of[5] == -1
    assert len(c.uploads) == 1 and c.uploads[-1][4] == HOME[4] and c.uploads[-1][5] == HOME[5]
    check_books(c)
    # lent slots are no one's: lending more takes the next coldest, and they are not lent twice
    more = c.lend(1, stream=None)
    assert more == [3]
    n = c.give_back(lent + more, stream=None)
    assert n == 3 and c.copies[-1][0] == [7, 9, 3]  # the hottest experts without a slot
    assert sorted(c.copies[-1][1]) == [3, 4, 5]
    # until the copies land, the slots are not pointed at and not lendable
    assert (c.owner[[3, 4, 5]] == FREE).all() and c.slot_of[7] == -1
    assert c.lend(6, stream=None) == [2, 1, 0]
    c.give_back([2, 1, 0], stream=None)             # a swap in flight: waited for, then the next one starts
    c._pending[0].done = True
    assert c.poll(stream=None)
    check_books(c)
    assert (c.owner >= 0).sum() == 6                # every slot occupied again, as before the prompt


def test_pending_swap_slots_are_never_lent():
    c = fake_cache(4)
    put(c, 0, 0)
    put(c, 1, 1)
    c._pending = (FakeEvent(done=False), [9, 10], [2, 3])     # the adaptive tier copying into slots 2 and 3
    c.owner[[2, 3]] = FREE
    assert sorted(c.lend(4, stream=None)) == [0, 1]
    assert c._pending is not None and c.slot_of[9] == -1


def test_giving_back_a_slot_that_was_not_lent_is_refused():
    c = fake_cache(2)
    put(c, 0, 0)
    with pytest.raises(RuntimeError, match="were not lent"):
        c.give_back([0], stream=None)


def test_fill_and_the_adaptive_tier_leave_lent_slots_alone(monkeypatch):
    """fill() takes FREE slots only (a lent one is the ring's until it comes back)."""
    import engine.cuda.expert_cache as ec
    c = fake_cache(3)
    c.owner[1] = LENT
    monkeypatch.setattr(ec.cp.cuda.runtime, "memcpyAsync", lambda *a: None)

    class S:
        ptr = 0

        def synchronize(self):
            pass
    assert c.fill([5, 6, 7], S()) == 2
    assert c.owner[1] == LENT and sorted(c.owner[[0, 2]].tolist()) == [5, 6]


def test_pools_keep_every_expert_in_a_slot_of_its_own_size(monkeypatch):
    """Layers with blobs of different sizes (layer 1's are larger, as Q4_K_M's Q6_K-down layers): fill, the adaptive
    tier, lending and the refill each take a slot of the expert's own pool; only the largest pool is lent."""
    import engine.cuda.expert_cache as ec
    sizes = np.repeat([STRIDE, 2 * STRIDE, STRIDE], N_EXPERT)          # layer 1: the large pool
    c = fake_cache(12, sizes)
    assert list(c.pools.split(12)) == [8, 4] and c.lendable == 4
    assert c.nbytes == 8 * STRIDE + 4 * 2 * STRIDE
    big = c.slot_pool == 1
    assert (c.slot_bytes[big] == 2 * STRIDE).all()
    assert (np.diff(c.slot_addr.astype(np.int64)) == c.slot_bytes[:-1]).all()
    monkeypatch.setattr(ec.cp.cuda.runtime, "memcpyAsync", lambda *a: None)

    class S:
        ptr = 0

        def synchronize(self):
            pass
    order = np.arange(N_TOTAL)[::-1]          # layer 2, then 1, then 0
    assert c.fill(order, S()) == 12
    def pool_ok():
        occ = np.flatnonzero(c.owner >= 0)
        return (c.slot_bytes[occ] == sizes[c.owner[occ]]).all()
    assert pool_ok() and sorted(c.owner[big].tolist()) == [12, 13, 14, 15]   # layer 1's first four in order
    assert sorted(c.owner[~big].tolist()) == list(range(16, 24))            # layer 2 took the small pool
    check_books(c)
    # the tier: hot layer-0 and layer-1 experts come in, each evicting the coldest of its own pool
    c.heat[:] = 1.0
    c.heat[[3, 9]] = 50.0
    c.take_counts, c.max_swaps = (lambda stream: np.zeros(N_TOTAL)), 64
    c.heat /= ec.DECAY                         # adapt() decays first
    assert c.adapt(stream=None) == 2
    ids, slots = c.copies[-1]
    assert sorted(ids) == [3, 9] and all(c.slot_bytes[s] == sizes[g] for g, s in zip(ids, slots))
    c._pending[0].done = True
    c.poll(stream=None)
    assert pool_ok()
    check_books(c)
    # lending takes only large-pool slots; the refill puts large experts back into them
    lent = c.lend(3, stream=None)
    assert len(lent) == 3 and big[lent].all()
    c.heat[[10, 11]] = 40.0
    assert c.give_back(lent, stream=None) == 3
    ids, slots = c.copies[-1]
    assert all(c.slot_bytes[s] == sizes[g] for g, s in zip(ids, slots)) and {10, 11} <= set(ids)
    c._pending[0].done = True
    c.poll(stream=None)
    assert pool_ok()
    check_books(c)


def test_the_first_decode_step_after_a_prompt_gives_the_lent_slots_back_once():
    """CUDABackend._step: the prompt pass's lent slots go back at the first decode step after the prompt, once; the
    steps after it do not call the prompt pass (nor do the steps of a prompt that lent nothing)."""
    from types import SimpleNamespace as NS

    from engine.cuda.backend import CUDABackend
    from engine.cuda.trace import Tracer
    calls = []

    class Prefill:
        lent = []

        def give_back(self, stream):
            calls.append(("give_back", list(self.lent)))
            self.lent = []

    be = CUDABackend.__new__(CUDABackend)
    be.n_cached, be.max_context, be.stream, be.tracer = 0, 64, None, Tracer()
    be.opts = NS(no_graph=False, adapt_every=0, expert_profile_save=None, expert_profile_save_every=0)
    be._tokens_since_adapt = 0
    be.cache = NS(poll=lambda stream: calls.append("poll"))
    be.prefill = Prefill()
    be.decoder = NS(launch=lambda token, pos, pick, use_graph: calls.append(("launch", token, pos)))
    be.step = NS(pick_at=lambda pos: (7, 0))
    be._ahead = None
    be.prefill.lent = [3, 5]                 # a streamed prompt borrowed two slots
    for t in range(3):
        assert be._step(10 + t, "greedy") == (7, 0)
    assert calls == [("give_back", [3, 5]), "poll", ("launch", 10, 0), "poll", ("launch", 11, 1), "poll",
                     ("launch", 12, 2)]


def test_a_stage_cache_takes_only_its_own_layers_experts(monkeypatch):
    """A pipeline stage's cache (serves: its layers' experts, engine/cuda/staged_backend.py): fill skips the others,
    the adaptive tier never swaps one in however hot, give_back refills lent slots only with its own."""
    import engine.cuda.expert_cache as ec
    monkeypatch.setattr(ec.cp.cuda.runtime, "memcpyAsync", lambda *a: None)

    class S:
        ptr = 0

        def synchronize(self):
            pass
    c = fake_cache(4)
    c.max_swaps = 64
    c.serves = np.arange(N_TOTAL) >= N_EXPERT          # layers 1-2 (experts 8..23)
    c.n_served = int(c.serves.sum())
    assert c.fill([0, 1, 8, 2, 9], S()) == 2 and sorted(c.owner.tolist()) == [-1, -1, 8, 9]
    c.heat[:] = 0.0
    c.heat[[0, 3]] = 50.0                              # hot, but layer 0's: another stage's
    c.heat[12] = 5.0
    assert c._round(np.zeros(N_TOTAL), S()) == 1 and c.copies[-1][0] == [12]
    c._pending = None
    c.heat[[10, 11]] = [7.0, 6.0]
    lent = c.lend(1, stream=None)
    assert c.give_back(lent, stream=None) == 1 and c.copies[-1][0] == [10]
