"""The memory modes' host-side parts on the CPU: which experts a budget pins, the staging LRU and its fences, reading
a blob from the memory-mapped GGUF, the per-layer decode loop (against fakes), and the DONE fields end to end."""
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from engine import protocol
from engine.backend import Backend, ExpertStats
from engine.cuda.decode_paged import PagedDecode
from engine.cuda.expert_layout import ExpertLayout, blob_layout, layer_layout
from engine.cuda.expert_source import (ExpertSource, StagingLRU, merged_order, pinned_mask, read_blob,
                                       router_norm_order, staging_slots)
from engine.gguf_model import open_model
from engine.session import Session

MODEL = "tiny-qwen3moe-q4k"


@pytest.fixture(scope="module")
def model(fixtures_dir):
    return open_model(fixtures_dir / "reference" / f"{MODEL}.gguf")


def layout_of(model):
    """The blob layout, checked against the file itself (gate | up | down, each expert's slab)."""
    lay = blob_layout(model)
    g, u, d = (model.expert_bytes(0, k, 0).size for k in ("gate", "up", "down"))
    assert (lay.layer(0).up_off, lay.layer(0).down_off, lay.nbytes) == (g, g + u, g + u + d)
    assert lay.uniform and lay.stride == (g + u + d + 255) // 256 * 256
    return lay


# --- placement ---------------------------------------------------------------------------------------------------
def test_pinned_mask_takes_the_order_within_the_budget():
    order = [5, 2, 7, 0, 1, 3, 4, 6]
    assert pinned_mask(8, 100, None, order).all()
    assert not pinned_mask(8, 100, 0, order).any()
    m = pinned_mask(8, 100, 350, order)           # three whole blobs fit
    assert list(np.flatnonzero(m)) == [2, 5, 7]
    assert pinned_mask(8, 100, 10_000, order).all()
    with pytest.raises(ValueError, match="every expert"):
        pinned_mask(8, 100, 350, [0, 1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        pinned_mask(8, 100, -1, order)


def test_the_budget_goes_to_the_experts_after_those_vram_holds():
    from engine.cuda.expert_source import vram_aware_order
    order = [5, 2, 7, 0, 1, 3, 4, 6]
    assert list(vram_aware_order(order, 0)) == order
    assert list(vram_aware_order(order, 3)) == [0, 1, 3, 4, 6, 7, 2, 5]     # VRAM's three last, coldest first
    assert list(vram_aware_order(order, 99)) == order[::-1]
    m = pinned_mask(8, 100, 300, vram_aware_order(order, 3))
    assert list(np.flatnonzero(m)) == [0, 1, 3]


def test_profile_order_first_then_the_fallback():
    out = merged_order(6, [4, 1], [0, 1, 2, 3, 4, 5])
    assert list(out) == [4, 1, 0, 2, 3, 5]
    assert list(merged_order(3, None, [2, 0, 1])) == [2, 0, 1]


def test_router_norm_order_ranks_by_norm_within_each_layer(model):
    cfg = model.config
    order = router_norm_order(model)
    assert sorted(order) == list(range(cfg.n_layer * cfg.n_expert))
    for li in range(cfg.n_layer):
        norms = np.linalg.norm(model.dequant(f"blk.{li}.ffn_gate_inp.weight"), axis=1)
        mine = [int(g) % cfg.n_expert for g in order if int(g) // cfg.n_expert == li]
        assert list(np.argsort(-norms, kind="stable")) == mine


def test_staging_slots_hold_a_layer_and_a_ring_batch():
    assert staging_slots(48, 8, 1 << 20, 10_000) == 512          # 2 steps = 768 blobs, capped at 512 MiB
    assert staging_slots(48, 8, 2 << 20, 10_000) == 256
    assert staging_slots(4, 8, 1 << 20, 10_000) == 2 * 4 * 8
    assert staging_slots(48, 8, 64 << 20, 10_000) == 9           # 512 MiB holds 8 blobs: the minimum k + 1
    assert staging_slots(48, 8, 64 << 20, 10_000, ring_batch=64) == 65
    assert staging_slots(4, 2, 1000, 3) == 3                     # never more than the file-only experts ...
    assert staging_slots(4, 2, 1000, 1) == 3                     # ... but always one layer's k plus one
    assert staging_slots(4, 2, 1000, 30, requested=5) == 5
    with pytest.raises(ValueError, match="at least 3"):
        staging_slots(4, 2, 1000, 30, requested=2)
    # the streamed pass's in-place group (a layer's file-only experts at once) is a floor too: Qwen3-235B-sized
    # blobs (10.6 MB) fit 50 times in 512 MiB, fewer than a layer's 128 experts
    assert staging_slots(94, 8, 10_600_000, 12_032, ring_batch=64, group=128) == 129
    with pytest.raises(ValueError, match="in-place group 128"):
        staging_slots(94, 8, 10_600_000, 12_032, ring_batch=64, group=128, requested=100)


def _plan(model, budget_gib, n_vram, profile=None):
    from engine.cuda.memory_mode import MemoryMode
    opts = SimpleNamespace(mmap_experts=False, resident_budget_gib=budget_gib, expert_profile=profile)
    return MemoryMode.plan(model, opts, layout_of(model), lambda m: None, n_vram=n_vram)


def test_the_budget_skips_only_experts_the_vram_cache_will_hold(model, tmp_path):
    """Without a profile VRAM starts empty: the budget pins the hottest by router norm whatever the slot count (else
    the hottest would be neither in VRAM nor pinned, read from the file). With one, VRAM holds the profile's first
    min(slots, ranked) experts and the budget goes to those after them."""
    from engine.profile import from_flat, save_profile
    cfg = model.config
    n_total = cfg.n_layer * cfg.n_expert
    stride = layout_of(model).stride
    gib = 4 * stride / 2**30                                # four blobs
    norm = router_norm_order(model)
    for n_vram in (0, 5):
        assert set(np.flatnonzero(_plan(model, gib, n_vram).pinned)) == set(norm[:4].tolist())
    ranked = norm[::-1][:3]                                 # a profile ranking three experts
    path = tmp_path / "p.bin"
    save_profile(path, from_flat(cfg.n_layer, cfg.n_expert, ranked))
    rest = merged_order(n_total, ranked, norm)[3:]
    assert set(np.flatnonzero(_plan(model, gib, 10, str(path)).pinned)) == set(rest[:4].tolist())
    assert set(np.flatnonzero(_plan(model, gib, 2, str(path)).pinned)) == \
        set(merged_order(n_total, ranked, norm)[2:6].tolist())


def test_read_blob_lays_out_gate_up_down(model):
    lay = layout_of(model)
    dst = np.full(lay.stride, 0xAA, dtype=np.uint8)
    n = read_blob(model, lay, 2, 5, dst)
    assert n == lay.nbytes
    want = np.concatenate([model.expert_bytes(2, k, 5).ravel() for k in ("gate", "up", "down")])
    np.testing.assert_array_equal(dst[:lay.nbytes], want)
    assert (dst[lay.nbytes:] == 0xAA).all()


# --- the staging LRU ---------------------------------------------------------------------------------------------
class Ev:
    def __init__(self, done=False):
        self.done = done
        self.waited = 0

    def synchronize(self):
        self.waited += 1
        self.done = True


def make_source(model, n_slots, pinned=(), log=None):
    cfg = model.config
    lay = layout_of(model)
    n_total = cfg.n_layer * cfg.n_expert
    arena = np.zeros(n_total, dtype=np.uint64)
    for g in pinned:
        arena[g] = 10_000_000 + g * lay.stride
    buf = np.zeros(n_slots * lay.stride, dtype=np.uint8)
    evicted = []
    src = ExpertSource(model, lay, arena, n_slots, alloc=lambda n: (buf, 1 << 40), threads=2,
                       on_evict=evicted.append)
    return src, buf, lay, evicted


def test_lru_picks_the_least_recent_unpinned_slot():
    lru = StagingLRU(3)
    for s, g in enumerate((10, 11, 12)):
        assert lru.assign(lru.victim(), g) == -1
    assert lru.lookup(10) == 0                # 10 is now the most recent: 11 goes first
    assert lru.victim() == 1
    lru.pin(1)
    assert lru.victim() == 2
    lru.pin(2)
    lru.pin(0)
    with pytest.raises(RuntimeError, match="too small"):
        lru.victim()
    lru.unpin(0)
    with pytest.raises(RuntimeError):
        lru.unpin(0)


def test_stage_reads_once_then_hits_and_evicts_in_lru_order(model):
    E = model.config.n_expert
    src, buf, lay, evicted = make_source(model, 3, pinned=[0])
    addrs, n = src.stage([0, 1, E + 3])
    assert n == 2 and addrs[0] == src.arena_ptr[0]          # pinned: its arena address, nothing read
    assert src.addr(1) == addrs[1] and src.addr(E + 3) == addrs[2] and src.addr(2) == 0
    s = (addrs[2] - (1 << 40)) // lay.stride
    want = np.concatenate([model.expert_bytes(1, k, 3).ravel() for k in ("gate", "up", "down")])
    np.testing.assert_array_equal(buf[s * lay.stride:s * lay.stride + lay.nbytes], want)
    ev = Ev()
    src.release([0, 1, E + 3], ev)
    _, n = src.stage([1])                                   # staged already: a hit, no read
    assert n == 0 and src.staged_hits == 1
    src.release([1])
    assert (src.file_blobs, src.file_bytes) == (2, 2 * lay.nbytes)
    src.stage([2, 4])                                       # one free slot, then the least recent (E + 3)
    assert evicted == [E + 3] and ev.waited == 1            # its fence was waited on before the refill
    assert src.addr(E + 3) == 0
    src.release([2, 4])


def test_pinned_slots_are_never_evicted_and_visible_ones_wait_for_the_table(model):
    src, _, _, evicted = make_source(model, 3)
    src.stage([1, 2, 3])
    with pytest.raises(RuntimeError, match="pinned"):
        src.stage([4])
    src.release([1, 2, 3])
    src.mark_visible([1])
    tf = Ev()
    src.note_table_reads(tf)
    src.stage([4])                     # evicts 1, which the pointer table pointed at: waits for the table's readers
    assert evicted == [1] and tf.waited == 1


def test_a_failed_file_read_leaves_nothing_pinned(model, monkeypatch):
    import engine.cuda.expert_source as es
    src, _, _, _ = make_source(model, 3)

    def boom(*a):
        raise es.ExpertFileError("no")
    monkeypatch.setattr(es, "read_blob", boom)
    with pytest.raises(es.ExpertFileError):
        src.stage([1, 2])
    assert not src.lru.pins.any() and src.addr(1) == 0 and src.file_blobs == 0


def test_staging_more_than_the_free_slots_leaves_nothing_pinned(model):
    """A stage() that runs out of unpinned slots part-way must give back the pins it took, or every later stage()
    fails the same way and the worker is wedged."""
    src, _, _, _ = make_source(model, 3)
    src.stage([1])                                  # pinned by a caller
    with pytest.raises(RuntimeError, match="pinned"):
        src.stage([2, 3, 4])                        # 2 and 3 fit, 4 does not
    assert src.lru.pins.sum() == 1 and src.addr(2) == 0 and src.addr(3) == 0
    src.release([1])
    addrs, n = src.stage([2, 3, 4])
    assert n == 3 and all(addrs)
    src.release([2, 3, 4])


def test_a_failed_read_waits_for_the_others_before_giving_their_slots_back(model, monkeypatch):
    import time
    import engine.cuda.expert_source as es
    src, _, _, _ = make_source(model, 3)
    finished = []

    def read(model, lay, layer, e, dst):
        if e == 1:
            raise es.ExpertFileError("no")
        time.sleep(0.2)
        finished.append(e)
        return 0
    monkeypatch.setattr(es, "read_blob", read)
    with pytest.raises(es.ExpertFileError):
        src.stage([1, 2])
    assert finished == [2]                          # the other read had ended before stage() gave its slot back
    assert not src.lru.pins.any() and src.addr(2) == 0
    src.close()


def test_read_blob_names_the_flags_when_the_map_fails():
    class Broken:
        def expert_bytes(self, *a):
            raise OSError("mmap not supported")
    lay = ExpertLayout((layer_layout("Q8_0", "Q8_0", "Q8_0", 32, 32),))
    import engine.cuda.expert_source as es
    with pytest.raises(es.ExpertFileError, match="--mmap-experts"):
        read_blob(Broken(), lay, 0, 0, np.zeros(8, np.uint8))


# --- the per-layer decode loop -----------------------------------------------------------------------------------
class FakeStep:
    def __init__(self, n_layer, n_expert, routing):
        self.cfg = SimpleNamespace(n_layer=n_layer, n_expert=n_expert)
        self.routing = routing            # per layer: the ids the router picks
        self.calls = []
        self.params = SimpleNamespace(view=[0, 0])
        self.stream = _Stream()
        self.ids = None

    def launch(self, token, pos, pick="greedy", use_graph=True):
        self.calls.append(("graph", token, pos))

    def set_inputs(self, token, pos):
        self.params.view[:] = [token, pos]

    def note_launch(self, pos):
        self.calls.append(("launched", pos))

    def program(self, pick="greedy"):
        """DecodeStep.program's parts over the fake launches."""
        parts = [("head", -1, self.enqueue_embed)]
        for li in range(self.cfg.n_layer):
            parts.append(("route", li, lambda li=li: (self.enqueue_attention_block(li), self.enqueue_router(li))))
            parts.append(("ffn", li, lambda li=li: self.enqueue_experts(li)))
        return parts + [("tail", -1, lambda: (self.enqueue_output(), self.enqueue_pick(pick)))]

    def enqueue_embed(self):
        self.calls.append("embed")

    def enqueue_attention_block(self, li):
        self.calls.append(f"attn{li}")

    def enqueue_router(self, li):
        self.calls.append(f"router{li}")
        self.ids = _Ids(self.routing[li])

    def enqueue_experts(self, li):
        self.calls.append(f"experts{li}")

    def enqueue_output(self):
        self.calls.append("output")

    def enqueue_pick(self, pick):
        self.calls.append("pick" if pick == "greedy" else f"pick {pick}")


class _Stream:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _Ids:
    def __init__(self, v):
        self.v = np.asarray(v, dtype=np.int32)

    def get(self, stream=None):
        return self.v


class FakeCache:
    """ExpertCache's host side: table_host, slot_of, stage() through the source."""

    def __init__(self, source, n_total, in_vram=()):
        self.source = source
        self.slot_of = np.full(n_total, -1)
        self.table_host = source.addrs()
        for g in in_vram:
            self.slot_of[g] = 0
            self.table_host[g] = 123
        self.on_entries = []

    def reachable(self):
        return bool(self.table_host.all())

    def stage(self, gs, stream):
        addrs, n = self.source.stage(gs)
        self.table_host[np.asarray(gs)] = addrs
        self.on_entries.append(list(map(int, gs)))
        return addrs, n


def test_paged_decode_stages_each_layer_before_its_experts(model):
    cfg = model.config
    E = cfg.n_expert
    routing = [[0, 1], [2, 3], [0, 1], [4, 5]]
    src, _, _, _ = make_source(model, 6, pinned=[1])
    cache = FakeCache(src, cfg.n_layer * E, in_vram=[2 * E + 0])
    step = FakeStep(cfg.n_layer, E, routing)
    pd = PagedDecode(step, cache, src, new_event=lambda: Ev(True), use_graphs=False)
    assert pd.launch(7, 3) == "paged"
    assert step.params.view == [7, 3]
    assert step.calls == ["embed"] + sum(([f"attn{i}", f"router{i}", f"experts{i}"] for i in range(4)), []) + \
        ["output", "pick", ("launched", 3)]   # the step's event after its last part
    # layer 0: expert 0 read (1 is pinned); layer 1: 2 and 3; layer 2: 0 is in VRAM, 1 read; layer 3: 4 and 5
    assert cache.on_entries == [[0], [E + 2, E + 3], [2 * E + 1], [3 * E + 4, 3 * E + 5]]
    assert pd.decode_file_blobs == 6 and src.file_blobs == 6
    assert not src.lru.pins.any()                     # every pin released after its layer
    # the same routing again: all six are staged (six slots), nothing is read, and now every entry the routing
    # needs is readable
    pd.launch(8, 4)
    assert pd.decode_file_blobs == 6 and src.staged_hits == 6
    # a seventh expert evicts the least recently used one (layer 3's expert 4, not routed this step)
    step.routing[3] = [6, 5]
    pd.launch(9, 5)
    assert pd.decode_file_blobs == 7 and src.addr(3 * E + 4) == 0 and src.addr(0) != 0
    # a sampled pick: the per-layer parts pick greedily, the sampled pick follows on the same stream
    step.calls.clear()
    assert pd.launch(10, 6, "sampled") == "paged" and step.calls[-3:] == ["pick", "pick sampled", ("launched", 6)]


def test_paged_decode_uses_the_whole_step_graph_when_everything_is_reachable(model):
    cfg = model.config
    n_total = cfg.n_layer * cfg.n_expert
    src, _, _, _ = make_source(model, 3, pinned=range(n_total))
    cache = FakeCache(src, n_total)
    step = FakeStep(cfg.n_layer, cfg.n_expert, [[0, 1]] * cfg.n_layer)
    pd = PagedDecode(step, cache, src, new_event=lambda: Ev(True))
    assert pd.launch(5, 9) == "graph"
    assert step.calls == [("graph", 5, 9)] and src.table_fence is not None


# --- DONE fields through the session and the protocol ------------------------------------------------------------
class StatsBackend(Backend):
    name = "fake"

    def __init__(self, stats):
        super().__init__(SimpleNamespace(config=SimpleNamespace(n_vocab=8, n_ctx_train=64)), 64)
        self._stats = stats

    def forward(self, tokens, all_logits=False):
        self.n_cached += len(tokens)
        lg = np.zeros(8, np.float32)
        lg[3] = 1.0
        return lg

    def get_stats(self):
        return self._stats


def test_done_carries_ram_and_file_blobs():
    st = ExpertStats(hits=5, lookups=12, ram_blobs=4, file_blobs=3, file_mb=2.5)
    lines = []
    Session(StatsBackend(st), eog_ids=()).run(protocol.GenRequest(2, [1, 2]), lines.append, threading.Event())
    done = protocol.parse_done(lines[-1])
    assert (done.hits, done.lookups, done.ram_blobs, done.file_blobs, done.file_mb) == (5, 12, 4, 3, 2.5)


# --- the flags ---------------------------------------------------------------------------------------------------
def test_worker_refuses_both_memory_flags_and_bad_budgets(fixtures_dir):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    model = str(fixtures_dir / "reference" / f"{MODEL}.gguf")
    for flags, says in ((["--mmap-experts", "--resident-budget-gib", "1"], "not allowed with"),
                        (["--resident-budget-gib", "-1"], "size in GiB"),
                        (["--resident-budget-gib", "lots"], "size in GiB")):
        p = subprocess.run([sys.executable, str(root / "strata_worker.py"), "--model", model, "--backend", "cpu",
                            *flags], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert p.returncode == 2 and says in p.stderr, (flags, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1


def test_advise_hints_only_file_only_unstaged_experts(model, monkeypatch):
    import os
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, adv: calls.append((off, n, adv)), raising=False)
    src, _, lay, _ = make_source(model, 3, pinned=[0])
    src.stage([1])
    src.release([1])
    assert src.advise([0, 1, 2]) == 1            # 0 is pinned, 1 is staged: only 2
    t = model.tensor(model.expert_name(0, "up"))
    per = t.data[0].nbytes
    assert (t.offset + 2 * per, per, os.POSIX_FADV_WILLNEED) in calls and len(calls) == 3
    src.close()
