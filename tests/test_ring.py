"""The expert ring's schedule and runner (engine/cuda/ring.py) driven by fake streams and events, executed by a small
simulator that runs the two streams in random interleavings with CUDA's event semantics (a wait binds to the last
record enqueued before it). Invariants: every non-resident expert copied exactly once per chunk in the fixed order,
no resident one; a slot is never overwritten before its reader has released it (each read sees its expert); one
wait and one record per batch on each stream; every slot released at the end; no deadlock."""
import numpy as np
import pytest

from engine.cuda.ring import BATCH_MAX, Device, RingRunner, batch_size, overlap_ms, schedule

STRIDE = 1000


class Event:
    def __init__(self, n):
        self.id = n
        self.enqueued = 0       # records enqueued
        self.done = 0           # records executed


class FakeDevice(Device):
    copy_stream = "copy"
    compute_stream = "compute"

    def __init__(self):
        self.queues = {"copy": [], "compute": []}
        self.events = []

    def event(self, timing=False):
        self.events.append(Event(len(self.events)))
        return self.events[-1]

    def elapsed_ms(self, a, b):
        return 1.0

    def record(self, stream, ev):
        ev.enqueued += 1
        self.queues[stream].append(("record", ev))

    def wait(self, stream, ev):
        self.queues[stream].append(("wait", ev, ev.enqueued))

    def copy(self, stream, dst, src, nbytes):
        assert nbytes == STRIDE
        self.queues[stream].append(("copy", dst, src))

    def use(self, addrs, experts):
        self.queues["compute"].append(("use", tuple(addrs), tuple(experts)))


def simulate(dev, rng, memory, log):
    """Run both queues to the end in a random interleaving; memory maps a slot address to the source it holds."""
    pos = {"copy": 0, "compute": 0}
    while True:
        ready = []
        for s, q in dev.queues.items():
            if pos[s] < len(q):
                op = q[pos[s]]
                if op[0] != "wait" or op[1].done >= op[2]:
                    ready.append(s)
        if not ready:
            stuck = [s for s, q in dev.queues.items() if pos[s] < len(q)]
            assert not stuck, f"deadlock: {stuck} wait forever"
            return
        s = ready[rng.integers(len(ready))]
        op = dev.queues[s][pos[s]]
        pos[s] += 1
        if op[0] == "record":
            op[1].done += 1
        elif op[0] == "copy":
            memory[op[1]] = op[2]
            log.append(op[2])
        elif op[0] == "use":
            for a, src in zip(op[1], op[2]):
                assert memory.get(a) == src, f"slot {a} holds {memory.get(a)} when expert {src} is read"


def src(layer, e, n_expert):
    return 10**6 + layer * n_expert + e


def run_chunks(resident, depth, n_chunks, rng, batch=None, drop_every=0):
    n_layer, n_expert = resident.shape
    dev = FakeDevice()
    slots = [5000 + 7 * i for i in range(depth)]
    r = RingRunner(dev, slots, STRIDE)
    memory, log = {}, []
    sched = schedule(resident, depth, batch)
    for _ in range(n_chunks):
        dev.queues = {"copy": [], "compute": []}
        r.begin_chunk(sched, lambda l, e: src(l, e, n_expert))
        for layer in range(n_layer):
            for b in r.of_layer(layer):
                addrs = r.acquire(b)
                # a batch the routing did not need (drop_every) is released without a read
                if not drop_every or b.index % drop_every:
                    dev.use(addrs, [src(b.layer, e, n_expert) for e in b.experts])
                r.release(b)
        r.end_chunk()
        ops = dev.queues
        waits_c = [o for o in ops["compute"] if o[0] == "wait"]
        recs_c = [o for o in ops["compute"] if o[0] == "record"]
        assert len(waits_c) == len(recs_c) == len(sched)
        n_copy_waits = sum(o[0] == "wait" for o in ops["copy"])
        n_copy_records = sum(o[0] == "record" for o in ops["copy"])
        assert n_copy_waits <= len(sched) and n_copy_records == len(sched)
        start = len(log)
        simulate(dev, rng, memory, log)
        want = [src(l, e, n_expert) for l in range(n_layer) for e in range(n_expert) if not resident[l, e]]
        assert log[start:] == want          # each non-resident expert once, in the fixed order
    assert all(h is None for h in r._held)
    return r


@pytest.mark.parametrize("depth", [1, 2, 3, 7, 16, 64, 500])
def test_ring_orders_copies_and_never_overwrites_a_slot_in_use(depth):
    rng = np.random.default_rng(depth)
    resident = rng.random((6, 24)) < 0.3
    r = run_chunks(resident, depth, n_chunks=3, rng=rng)
    assert r.bytes_copied == 3 * int((~resident).sum()) * STRIDE


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_explicit_batch_sizes_and_unneeded_batches(batch):
    rng = np.random.default_rng(batch)
    resident = rng.random((4, 16)) < 0.5
    run_chunks(resident, 6, n_chunks=2, rng=rng, batch=batch, drop_every=3)


def test_everything_resident_streams_nothing_and_all_streamed():
    rng = np.random.default_rng(0)
    assert schedule(np.ones((3, 8), bool), 4) == []
    run_chunks(np.ones((3, 8), bool), 4, 2, rng)
    run_chunks(np.zeros((3, 8), bool), 4, 2, rng)


def test_schedule_shape():
    resident = np.zeros((2, 10), bool)
    resident[0, [1, 4]] = True
    s = schedule(resident, depth=4)
    assert [b.layer for b in s] == [0, 0, 0, 0, 1, 1, 1, 1, 1]
    items = [it for b in s for it in b.items]
    assert [it.index for it in items] == list(range(18))
    assert [it.slot for it in items] == [i % 4 for i in range(18)]
    assert [it.expert for it in items[:8]] == [0, 2, 3, 5, 6, 7, 8, 9]
    assert all(len(b.items) <= batch_size(4) == 2 for b in s)
    assert batch_size(2) == 1 and batch_size(1000) == BATCH_MAX


def test_misuse_is_refused():
    dev = FakeDevice()
    r = RingRunner(dev, [1, 2, 3, 4], STRIDE)
    s = schedule(np.zeros((2, 8), bool), 4)
    r.begin_chunk(s, lambda l, e: l * 8 + e)
    with pytest.raises(RuntimeError, match="out of order"):
        r.acquire(s[1])
    r.acquire(s[0])
    with pytest.raises(RuntimeError, match="released but"):
        r.release(s[1])
    with pytest.raises(RuntimeError, match="unused"):
        r.end_chunk()
    with pytest.raises(ValueError, match="at least one slot"):
        schedule(np.zeros((1, 2), bool), 0)
    with pytest.raises(ValueError, match="1 to 4"):
        schedule(np.zeros((1, 2), bool), 4, batch=5)
    with pytest.raises(ValueError, match="no slots"):
        RingRunner(dev, [], STRIDE)
    big = RingRunner(FakeDevice(), [1, 2], STRIDE)
    with pytest.raises(ValueError, match="slot 3 of a ring of 2"):
        big.begin_chunk(s, lambda l, e: 0)


def test_timing_spans_do_not_add_waits():
    dev = FakeDevice()
    r = RingRunner(dev, [1, 2, 3, 4], STRIDE, timing=True)
    s = schedule(np.zeros((2, 8), bool), 4)
    r.begin_chunk(s, lambda l, e: 10**6 + l * 8 + e)
    for b in s:
        r.acquire(b)
        r.release(b)
    r.end_chunk()
    assert len(r.spans) == len(s) and r.busy_ms() == len(s)
    assert sum(o[0] == "wait" for o in dev.queues["copy"]) <= len(s)
    simulate(dev, np.random.default_rng(1), {}, [])


def test_copies_run_ahead_by_the_ring_depth():
    """Before the compute stream has released anything, the copy stream holds a full ring's worth of batches."""
    dev = FakeDevice()
    depth = 8
    r = RingRunner(dev, list(range(100, 100 + depth)), STRIDE)
    s = schedule(np.zeros((3, 16), bool), depth)
    r.begin_chunk(s, lambda l, e: l * 16 + e)
    copies = [o for o in dev.queues["copy"] if o[0] == "copy"]
    assert len(copies) == depth
    r.acquire(s[0])
    r.release(s[0])
    copies = [o for o in dev.queues["copy"] if o[0] == "copy"]
    assert len(copies) == depth + len(s[1].items)


def test_copy_busy_within_the_streamed_layers_window():
    """bench.prefill's 'link busy in streamed layers': copying clipped to the window between two compute-stream
    events, every time measured from one reference event."""
    assert overlap_ms([(0, 2), (3, 5), (6, 9)], 1, 7) == 1 + 2 + 1
    assert overlap_ms([(0, 1)], 2, 3) == 0 and overlap_ms([], 0, 5) == 0

    class Timed(FakeDevice):
        def elapsed_ms(self, a, b):
            return float(self.at[b.id])
    dev = Timed()
    r = RingRunner(dev, [1, 2, 3, 4], STRIDE, timing=True)
    s = schedule(np.zeros((1, 8), bool), 4)        # 4 batches of 2
    ref = dev.event(True)
    r.begin_chunk(s, lambda l, e: 10**6 + l * 8 + e)
    for b in s:
        r.acquire(b)
        r.release(b)
    lo, hi = dev.event(True), dev.event(True)
    dev.at = {ref.id: 0, lo.id: 3, hi.id: 10}
    for k, (a, b) in enumerate(r.spans):            # copies at [0,2], [2,4], [5,7], [8,12]
        dev.at[a.id], dev.at[b.id] = [(0, 2), (2, 4), (5, 7), (8, 12)][k]
    busy, window = r.busy_within_ms(ref, lo, hi)
    assert (busy, window) == (0 + 1 + 2 + 2, 7)


def test_each_layer_copies_its_own_blob_bytes():
    """A file whose layers' blobs differ (a llama-quantize recipe): slots of the largest blob, each item copying its
    layer's bytes, and the bytes counted so."""
    class Sized(FakeDevice):
        def copy(self, stream, dst, src, nbytes):
            self.queues[stream].append(("copy", dst, src, nbytes))
    dev = Sized()
    sizes = [600, STRIDE, 800]
    r = RingRunner(dev, [1, 2, 3, 4], STRIDE, layer_bytes=sizes)
    s = schedule(np.zeros((3, 4), bool), 4)
    r.begin_chunk(s, lambda l, e: 10**6 + l * 4 + e)
    for b in s:
        r.acquire(b)
        r.release(b)
    r.end_chunk()
    copies = [o for o in dev.queues["copy"] if o[0] == "copy"]
    assert [(o[2] - 10**6) // 4 for o in copies] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(o[3] == sizes[(o[2] - 10**6) // 4] for o in copies)
    assert r.bytes_copied == 4 * sum(sizes)
    with pytest.raises(ValueError, match="do not fit"):
        RingRunner(dev, [1, 2], 700, layer_bytes=sizes)
