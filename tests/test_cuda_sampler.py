"""The GPU sampler (cuda_src/sample.cu, engine/cuda/sampler.py) against engine/sampling.py's Sampler.

Kernel tests: the penalized logits equal the host's bit for bit; the kept set equals the host Sampler's filter and
the probabilities its probabilities (1e-5); the pick equals the NumPy draw with the same uniform (the GPU's u is
uniform(seed, step), checked against the Python mirror); outputs poisoned first. End to end: seeded sampled tokens
reproduce (graph and eager alike), top_k=1 equals greedy, greedy with penalties equals the host's pick on the same
logits. The host-side pieces (the RNG mirror, the packed settings, the penalty window, keeping the device state in
step with the specs) run on CPU."""
from collections import deque

import numpy as np
import pytest

import re
from pathlib import Path

from engine.cuda import sampler as sampler_mod
from engine.cuda.sampler import (ALL_TIES, CAND_CAP, HIST_BINS, PARAMS_DTYPE, STATE_DTYPE, GpuSampler, Held,
                                 pack_params, uniform, window_ids, window_length)
from engine.sampling import PickSpec, Sampler, SamplingParams, pick

P = SamplingParams.of

gpu = pytest.mark.gpu
SIZES = (1000, 49152, 151936)


# --- host side (CPU) -----------------------------------------------------------------------------------------------
def test_uniform_is_splitmix64():
    # splitmix64's first output for state 0 is 0xe220a8397b1dcdaf (Vigna's reference implementation)
    assert uniform(0, 0) == (0xE220A8397B1DCDAF >> 11) / 2.0 ** 53
    us = np.array([uniform(12345, s) for s in range(20000)])
    assert ((us >= 0) & (us < 1)).all()
    assert abs(us.mean() - 0.5) < 0.01 and len(set(us.tolist())) == len(us)
    # reproducible: draw s is output s + 1 of the seed's splitmix64 stream (Vigna's next outputs for state 0)
    assert [uniform(0, s) for s in (1, 2, 3)] == [(v >> 11) / 2.0 ** 53 for v in (
        0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC)]
    assert uniform(7, 0) != uniform(8, 0)
    assert 0 <= uniform(-1, 3) < 1 and 0 <= uniform(2 ** 70, 3) < 1      # any int seed folds into 64 bits


def test_struct_layouts_match_the_kernel():
    assert PARAMS_DTYPE.itemsize == 56 and STATE_DTYPE.itemsize == 72
    assert PARAMS_DTYPE.fields["top_k"][1] == 40 and PARAMS_DTYPE.fields["window"][1] == 48
    assert STATE_DTYPE.fields["step"][1] == 16 and STATE_DTYPE.fields["bkey"][1] == 56
    assert STATE_DTYPE.fields["pick"][1] == 64 and STATE_DTYPE.fields["cut"][1] == 12
    assert STATE_DTYPE.fields["nc"][1] == 68


def test_launch_constants_match_the_kernel_defines():
    # the launches' grids, blocks and buffer sizes are Python constants; the kernels size shared memory, loops and
    # __launch_bounds__ from the .cu defines: a change on one side only must fail here, not as a wrong pick
    src = (Path(__file__).resolve().parent.parent / "cuda_src" / "sample.cu").read_text()
    defines = {m[1]: int(m[2], 0) for m in re.finditer(r"^#define (\w+) (0x[0-9a-fA-F]+|\d+)\b", src, re.M)}
    pairs = {"SAMPLE_GRID": "SAMPLE_GRID", "SAMPLE_THREADS": "SAMPLE_THREADS", "SELECT_THREADS": "SEL_THREADS",
             "CUT_THREADS": "CUT_THREADS", "HIST_BINS": "HIST_BINS", "CAND_CAP": "CAND_CAP", "ALL_TIES": "ALL_TIES"}
    assert {py: getattr(sampler_mod, py) for py in pairs} == {py: defines[cu] for py, cu in pairs.items()}


def test_pack_params():
    s = P({"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "penalty_repeat": 1.1})
    p = pack_params(s, 1000, seed=-1)[0]
    assert p["seed"] == 2 ** 64 - 1 and p["top_k"] == 40 and p["penalties"] == 1 and p["window"] == 64
    assert p["top_p"] == 0.9 and p["log_min_p"] == np.log(0.05) and np.float32(p["temp"]) == np.float32(0.7)
    g = pack_params(P({}), 1000, seed=1)[0]
    assert g["temp"] == 0 and g["penalties"] == 0 and g["window"] == 0 and np.isneginf(g["log_min_p"])


def test_penalty_window_length_and_tokens():
    ring = 100
    assert window_length(P({"penalty_repeat": 1.2}), ring) == 64
    assert window_length(P({"penalty_repeat": 1.2, "penalty_last_n": -1}), ring) == ring
    assert window_length(P({"penalty_repeat": 1.2, "penalty_last_n": 500}), ring) == ring
    assert window_length(P({"penalty_repeat": 1.2, "penalty_last_n": 0}), ring) == 0
    assert window_length(P({"temperature": 1.0}), ring) == 0
    spec = Sampler({"penalty_freq": 0.5, "penalty_last_n": 3}).spec([5, 6, 7, 2000])
    held = _Bookkeeping(1000, ring).state_for(spec, [8])
    assert held.window == (7, 2000, 8)
    np.testing.assert_array_equal(window_ids(held.window, 1000), [7, -1, 8])


class _Bookkeeping(GpuSampler):
    """GpuSampler's bookkeeping without device buffers: load() records what it would write."""

    def __init__(self, n=1000, ring_cap=100):
        self.n, self.ring_cap, self.held, self.loads = n, ring_cap, None, []

    def load(self, held):
        self.loads.append(held)
        self.held = held


def test_the_device_state_follows_the_sessions_loop_without_reloads():
    """The session's loop: the prompt's pick, then each pick fed back with the history before it. One load, at the
    prompt; after that the state picked() follows is what every spec asks for."""
    s = Sampler({"temperature": 1.0, "penalty_repeat": 1.3, "penalty_last_n": 3, "seed": 5})
    gs = _Bookkeeping()
    prompt = [1, 2, 3, 4]
    gs.prepare(s.spec([]), prompt)
    assert gs.loads == [Held(s.params, 5, 0, (2, 3, 4))]
    seq, tok = list(prompt), 9
    gs.picked(tok, 0)
    s.advance()
    for nxt in (5, 9, 9, 7):
        gs.prepare(s.spec(seq), [tok])
        assert len(gs.loads) == 1 and gs.held == Held(s.params, 5, s.draws, tuple((seq + [tok])[-3:]))
        seq.append(tok)
        gs.picked(nxt, 0)
        s.advance()
        tok = nxt
    assert gs.held.draws == s.draws == 5


def test_the_device_state_reloads_when_a_spec_asks_for_another():
    s = Sampler({"temperature": 1.0, "penalty_repeat": 1.3, "penalty_last_n": 3, "seed": 5})
    gs = _Bookkeeping()
    gs.prepare(s.spec([]), [1, 2, 3])
    gs.picked(9, 0)
    s.advance()
    gs.prepare(s.spec([1, 2, 3]), [8])            # not the pick fed back: the window differs
    assert len(gs.loads) == 2 and gs.held.window == (2, 3, 8)
    gs.picked(4, 0)
    gs.prepare(s.spec([1, 2, 3]), [8])            # the same spec again (the pick was not counted): the counter differs
    assert len(gs.loads) == 3 and gs.held.draws == 1
    again = Sampler({"temperature": 1.0, "penalty_repeat": 1.3, "penalty_last_n": 3, "seed": 5})
    gs.picked(4, 0)
    gs.prepare(again.spec([1, 2]), [3, 4])        # a new request with the same settings and seed: from draw 0
    assert len(gs.loads) == 4 and gs.held == Held(again.params, 5, 0, (2, 3, 4))
    gs.picked(0, 3)                               # NaN: the kernels advanced nothing, the mirror is dropped
    assert gs.held is None
    gs.prepare(again.spec([1, 2]), [3, 4])
    assert len(gs.loads) == 5
    gs.picked(-1, -1)                             # every logit -inf: the same
    assert gs.held is None
    other = Sampler({"temperature": 0.5, "penalty_repeat": 1.3, "penalty_last_n": 3, "seed": 5})
    gs.prepare(again.spec([1, 2]), [3, 4])
    gs.prepare(other.spec([1, 2]), [3, 4])        # other settings
    assert len(gs.loads) == 7


def test_the_device_state_of_greedy_penalties_and_whole_context_windows():
    greedy_pen = Sampler({"penalty_repeat": 2.0})
    gs = _Bookkeeping()
    gs.prepare(greedy_pen.spec([]), [1, 2])
    gs.picked(4, 0)
    greedy_pen.advance()
    assert gs.held.draws == greedy_pen.draws == 0     # greedy picks draw no random number
    gs.prepare(greedy_pen.spec([1, 2]), [4])
    assert len(gs.loads) == 1
    whole = Sampler({"temperature": 1.0, "penalty_present": 0.5, "penalty_last_n": -1, "seed": 1})
    gs = _Bookkeeping(ring_cap=12)
    seq = list(range(10))
    gs.prepare(whole.spec([]), seq)
    for t in (3, 4, 5, 6):                          # the ring (max_context + 1) keeps the last ring_cap
        gs.picked(t, 0)
        whole.advance()
        gs.prepare(whole.spec(seq), [t])
        seq.append(t)
    assert len(gs.loads) == 1 and gs.held.window == tuple(seq[-12:])
    plain = Sampler({"temperature": 1.0, "seed": 2})  # no penalties: no window at all
    gs.prepare(plain.spec([1, 2, 3]), [4])
    assert gs.held.window == ()


# --- NumPy reference of the GPU's draw ---------------------------------------------------------------------------
def sortable(x: np.ndarray) -> np.ndarray:
    b = (np.asarray(x, np.float32) + np.float32(0)).view(np.uint32)      # -0 ties with +0, as in the kernels
    return np.where(b & 0x80000000, ~b, b | 0x80000000).astype(np.uint32)


def key_value(k) -> np.ndarray:
    """The float32 value of sort keys (the kernels' key_value)."""
    k = np.asarray(k, np.uint32)
    return np.where(k & 0x80000000, k & 0x7FFFFFFF, ~k).astype(np.uint32).view(np.float32)


def min_p_floor(sampler, vmax: np.float32, kmax: int) -> int:
    """The key of vmax + log(min_p) rounded up to float32 (0: off), at most the top key."""
    if sampler.min_p <= 0:
        return 0
    x = float(vmax) + float(np.log(sampler.min_p))
    f = np.float32(x)
    if float(f) < x:
        f = np.nextafter(f, np.float32(np.inf))
    return min(int(sortable(np.array([f]))[0]), kmax)


def reference_cut(work, sampler, z) -> tuple[int, int]:
    """sample_cut in NumPy: (the candidates' lowest key, 0 when they are at most CAND_CAP, else -1); z: the total
    untempered mass (the state's zk when top_k is off)."""
    n = len(work)
    k_on, p_on = 0 < sampler.top_k < n, sampler.top_p < 1.0
    if sampler.greedy or np.isnan(work).any() or np.isneginf(work).all() or not (k_on or p_on or sampler.min_p > 0):
        return 0, -1
    keys = sortable(work)
    kmax = int(keys.max())
    vmax = key_value(kmax)
    hist = np.bincount(keys >> 20, minlength=HIST_BINS)
    suf_c = np.cumsum(hist[::-1])[::-1]
    if k_on:
        reach = suf_c >= sampler.top_k
    elif p_on:                                  # the suffix's mass bounded below, or Z less the mass below bounded above
        b = np.arange(HIST_BINS, dtype=np.uint32)
        lo, hi = key_value(b << 20), key_value(((b + 1) << 20) - 1)
        with np.errstate(invalid="ignore", over="ignore"):
            lb = np.where(np.isnan(lo) | (hist == 0), 0.0, hist * np.exp((lo - vmax).astype(np.float64)))
            ub = hist * np.where(np.isnan(hi), 1.0, np.minimum(1.0, np.exp((hi - vmax).astype(np.float64))))
        below = np.concatenate([[0.0], np.cumsum(ub)[:-1]])
        target = sampler.top_p * z * (1 + 1e-9)
        reach = (np.cumsum(lb[::-1])[::-1] >= target) | (z - below >= target)
    else:
        reach = np.zeros(HIST_BINS, bool)
    bins = np.nonzero(reach & (hist > 0))[0]
    cut = int(bins.max()) << 20 if len(bins) else 0
    if not (k_on and p_on):                     # top_p within top_k needs every top_k survivor, below min_p too
        cut = max(cut, min_p_floor(sampler, vmax, kmax))
    return cut, (0 if suf_c[cut >> 20] <= CAND_CAP else -1)


def check_candidates(r, sampler, work, st) -> int:
    """The cut, the bitmap and the count of candidates the kernels used against reference_cut; returns nc."""
    cut, mode = reference_cut(work, sampler, st["zk"])
    assert (int(st["cut"]), int(mode < 0)) == (cut, int(st["nc"] < 0))
    if mode == 0:
        inside = sortable(work) >= cut
        words = np.packbits(np.pad(inside, (0, -len(inside) % 32)), bitorder="little").view("<u4")
        np.testing.assert_array_equal(r.gs.bitmap.get(), words)
        assert st["nc"] == inside.sum() <= CAND_CAP
    return int(st["nc"])


def test_the_cut_holds_every_kept_key():
    """sample_cut's guarantee, on its NumPy mirror (the GPU tests hold the kernel to the mirror bit for bit): the keys
    at or above the cut include the whole kept set, for peaked, flat, tied and -inf-laden logits under every kind of
    chain, min_p above the top_k-th key included. CPU only."""
    rng = np.random.default_rng(7)
    n = 20000
    checked = 0
    for trial in range(300):
        kind = trial % 4
        x = lm_logits(rng, n) if kind == 0 else rng.standard_normal(n).astype(np.float32) * rng.uniform(0.2, 4)
        if kind == 2:
            x = np.round(x * 2) / 2                              # ties everywhere
        if kind == 3:
            x[rng.random(n) < 0.3] = -np.inf
            x[rng.choice(n, 5, replace=False)] = x.max() + rng.uniform(0, 3, 5).astype(np.float32)
        params = {"temperature": 1.0, "seed": 1,
                  "top_k": int(rng.choice([0, 1, 5, 40, 300, 5000])),
                  "top_p": float(rng.choice([1.0, 1.0, 0.0, 0.3, 0.9, 0.99, 0.999999])),
                  "min_p": float(rng.choice([0.0, 0.0, 0.01, 0.05, 0.5]))}
        s = P(params)
        z = float(np.exp((x[np.isfinite(x)] - x.max()).astype(np.float64)).sum())
        cut, mode = reference_cut(x, s, z)
        if mode < 0:
            continue
        kept = order_filter(x, s.top_k, s.top_p, s.min_p)
        inside = sortable(x) >= cut
        assert not (kept & ~inside).any(), (trial, params, int(kept.sum()), int(inside.sum()))
        assert inside.sum() <= CAND_CAP
        if 0 < s.top_k < n and s.top_p < 1.0:                  # every top_k survivor, for top_p's mass
            assert inside.sum() >= s.top_k
        checked += 1
    assert checked > 150, checked                               # most chains run from candidates


def kept_from_state(work, st) -> np.ndarray:
    """The kept set the kernels chose: key > bkey, or key == bkey among the first m such ids."""
    k = sortable(work)
    tie = k == st["bkey"]
    rank = np.cumsum(tie) - 1
    return (k > st["bkey"]) | (tie & ((st["m"] == ALL_TIES) | (rank < st["m"])))


def order_filter(x, top_k, top_p, min_p) -> np.ndarray:
    """The chain's definition by a full stable sort (ties by lower id), as the kernels order them."""
    x = x.astype(np.float64)
    order = np.argsort(-x, kind="stable")
    n = len(x)
    keep = n if not 0 < top_k < n else top_k
    if top_p < 1.0:
        v = x[order[:keep]]
        p = np.exp(v - v[0])
        cum = np.cumsum(p / p.sum())
        keep = min(keep, int(np.searchsorted(cum, top_p, side="left")) + 1)
    if min_p > 0:
        keep = min(keep, int((x >= x[order[0]] + np.log(min_p)).sum()))
    out = np.zeros(n, bool)
    out[order[:max(keep, 1)]] = True
    return out


def reference_draw(probs: np.ndarray, u: float) -> int:
    """The inverse CDF over the kept ids in id order (what sample_select does), on the host's probabilities."""
    ids = np.nonzero(probs > 0)[0]
    cum = np.cumsum(probs[ids])
    return int(ids[min(int(np.searchsorted(cum, u * cum[-1], side="right")), len(ids) - 1)])


def lm_logits(rng, n):
    """Peaked like a language model's: a few large values over a wide low floor."""
    return (rng.standard_normal(n) * 2 + np.where(rng.random(n) < 0.01, 8, 0)).astype(np.float32)


# --- kernels (GPU) -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kern():
    pytest.importorskip("cupy")
    from engine.cuda import kernels
    mod = kernels.load("sample")
    return lambda name, qt=None, tag=None: mod.get_function(name)


class Run:
    """One GpuSampler over one vocabulary, poisoned buffers, a mapped output."""

    def __init__(self, kern, n, ring_cap=4096):
        import cupy as cp
        from engine.cuda.launch import MappedInts
        self.cp, self.kern = cp, kern
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.gs = GpuSampler(kern, n, ring_cap, self.stream)
        self.out = MappedInts(2)

    def pick(self, spec, logits, load=True):
        cp, gs = self.cp, self.gs
        with self.stream:
            if load:
                gs.load(gs.state_for(spec))
            for a in (gs.work, gs.pw, gs.qw):
                a.fill(np.nan)
            gs.bitmap.fill(0xA5A5A5A5)
            self.out.view[:] = -7
            gs.enqueue(self.kern, cp.asarray(logits), self.out.dptr)
        self.stream.synchronize()
        return int(self.out.view[0]), int(self.out.view[1])

    def close(self):
        self.gs.close()
        self.out.close()


CHAINS = [  # temperature, top_k, top_p, min_p, penalties
    (1.0, 0, 1.0, 0.0, {}),
    (0.8, 40, 0.95, 0.0, {}),
    (1.2, 0, 0.9, 0.0, {}),
    (0.7, 0, 1.0, 0.05, {}),
    (1.0, 3000, 0.99, 0.001, {"penalty_repeat": 1.3, "penalty_freq": 0.2, "penalty_present": 0.1}),
    (1.5, 0, 0.5, 0.02, {"penalty_repeat": 0.8, "penalty_last_n": -1}),
    (0.9, 1000, 1.0, 0.0, {"penalty_present": 1.5, "penalty_last_n": 16}),
    (1.0, 0, 0.0, 0.0, {}),
]


@gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chain", range(len(CHAINS)))
def test_pick_matches_the_host_sampler(kern, n, chain):
    temp, top_k, top_p, min_p, pen = CHAINS[chain]
    rng = np.random.default_rng(n * 31 + chain)
    logits = lm_logits(rng, n)
    seed = int(rng.integers(0, 2 ** 63))
    history = rng.integers(0, n, size=200).tolist()
    history[-5:] = [int(np.argmax(logits))] * 5         # the top token repeated: penalties move the top
    spec = Sampler({"temperature": temp, "top_k": top_k, "top_p": top_p, "min_p": min_p, "seed": seed,
                    **pen}).spec(history)
    s, counted = spec.params, spec.counted()
    r = Run(kern, n)
    try:
        tok, err = r.pick(spec, logits)
        st = r.gs.read_state()
        work = r.gs.work.get()
        np.testing.assert_array_equal(work, s.apply_penalties(logits, counted))
        assert err == 0 and st["step"] == 1 and st["u"] == uniform(seed, 0)
        kept = kept_from_state(work, st)
        np.testing.assert_array_equal(kept, np.isfinite(s.filter(work)))
        np.testing.assert_array_equal(kept, order_filter(work, top_k, top_p, min_p))
        probs = s.probabilities(logits, counted)
        gpu_probs = np.where(kept, r.gs.qw.get(), 0.0) / st["total"]
        np.testing.assert_allclose(gpu_probs, probs, rtol=1e-5, atol=1e-9)
        assert tok == st["pick"] == reference_draw(probs, st["u"])
        nc = check_candidates(r, s, work, st)
        if n == 151936 and chain in (1, 2, 3):    # top_k 40 + top_p, top_p alone, min_p alone: from candidates
            assert 0 < nc <= CAND_CAP
        if chain == 0:                            # temperature alone keeps every key: no candidates
            assert nc == -1
        if s.penalties_active:              # the pick entered the window (and the oldest left a full one)
            win = list(deque(window_ids(r.gs.state_for(spec).window, n).tolist() + [tok],
                             maxlen=window_length(s, 4096)))
            np.testing.assert_array_equal(r.gs.counts.get(), np.bincount(win, minlength=n))
    finally:
        r.close()


@gpu
@pytest.mark.parametrize("n", SIZES)
def test_ties_keep_the_lowest_ids(kern, n):
    rng = np.random.default_rng(n)
    logits = np.round(lm_logits(rng, n) * 2) / 2         # many equal values (and -0 beside +0): cuts inside ties
    r = Run(kern, n)
    try:
        for top_k, top_p in ((37, 1.0), (0, 0.8), (500, 0.6)):
            s = P({"temperature": 1.0, "top_k": top_k, "top_p": top_p, "seed": 3})
            r.pick(PickSpec(s, seed=3), logits)
            st = r.gs.read_state()
            kept = kept_from_state(r.gs.work.get(), st)
            np.testing.assert_array_equal(kept, order_filter(logits, top_k, top_p, 0.0))
            assert kept.sum() == np.isfinite(s.filter(logits)).sum()
            check_candidates(r, s, logits, st)
    finally:
        r.close()


@gpu
@pytest.mark.parametrize("case", ["one bin", "top_k past the cap", "flat top_p", "top_p alone", "min_p and -inf",
                                  "top_p 0", "min_p above the k-th"])
def test_candidates_or_the_whole_vocabulary_pick_the_same(kern, case):
    n = 151936
    rng = np.random.default_rng(len(case))
    logits = lm_logits(rng, n)
    params, want = {"temperature": 0.9, "seed": 5}, None
    if case == "one bin":                       # every key in one histogram bin: more than CAND_CAP candidates
        logits = np.zeros(n, np.float32)
        params.update(top_k=40)
        want = "whole"
    elif case == "top_k past the cap":
        params.update(top_k=CAND_CAP + 500)
        want = "whole"
    elif case == "flat top_p":                  # most of the vocabulary kept: the radix select with mass over all
        logits = rng.standard_normal(n).astype(np.float32)
        params.update(top_p=0.9)
        want = "whole"
    elif case == "top_p alone":                 # the mass bound picks the bin
        params.update(top_p=0.5)
        want = "candidates"
    elif case == "min_p and -inf":
        logits[rng.random(n) < 0.5] = -np.inf
        params.update(min_p=0.02, top_p=0.9)
        want = "candidates"
    elif case == "top_p 0":                     # top_p 0 keeps the top key only
        params.update(top_p=0.0)
        want = "candidates"
    else:   # ten keys within min_p's reach, top_k 40 reaching into the bulk, top_p (of the 40's mass) keeping fewer
        logits = rng.standard_normal(n).astype(np.float32)
        logits[rng.choice(n, 10, replace=False)] = 10 - 0.25 * np.arange(10)
        params.update(top_k=40, top_p=0.5, min_p=0.05)
        want = "candidates"
    s = P(params)
    r = Run(kern, n)
    try:
        tok, err = r.pick(PickSpec(s, seed=5), logits)
        st = r.gs.read_state()
        work = r.gs.work.get()
        kept = kept_from_state(work, st)
        np.testing.assert_array_equal(kept, order_filter(work, s.top_k, s.top_p, s.min_p))
        # the host's top_k keeps arbitrary ids among ties, the kernels the lowest (test_ties_keep_the_lowest_ids)
        probs = kept / kept.sum() if case == "one bin" else s.probabilities(logits)
        assert err == 0 and tok == reference_draw(probs, st["u"])
        nc = check_candidates(r, s, work, st)
        assert (nc >= 0) == (want == "candidates")
        if case == "top_p 0":
            assert nc >= 1 and kept.sum() == 1 and tok == int(np.argmax(logits))
        if case == "min_p above the k-th":          # all 40 survivors were candidates; top_p, not min_p, bound
            assert nc >= 40 and 1 <= kept.sum() < 10
    finally:
        r.close()


@gpu
@pytest.mark.parametrize("n", SIZES)
def test_greedy_with_penalties_and_top_k_1_are_the_argmax(kern, n):
    rng = np.random.default_rng(n + 5)
    logits = lm_logits(rng, n)
    top = int(np.argmax(logits))
    r = Run(kern, n)
    try:
        s = Sampler({"penalty_repeat": 50.0}).spec([top, 1, 2])     # temperature 0: the penalized argmax
        tok, err = r.pick(s, logits)
        assert err == 0 and tok == pick(logits, s).id != top
        assert r.gs.read_state()["step"] == 0            # greedy draws nothing
        k1 = Sampler({"temperature": 0.9, "top_k": 1, "seed": 11}).spec()
        assert r.pick(k1, logits) == (top, 0)
        nearly = Sampler({"temperature": 1e-6, "seed": 11}).spec()
        assert r.pick(nearly, logits)[0] == top
    finally:
        r.close()


@gpu
def test_seeded_draws_reproduce_and_advance(kern):
    n = 49152
    logits = lm_logits(np.random.default_rng(1), n) / 4     # flat enough that draws differ
    r = Run(kern, n)
    try:
        def run(seed, k=12):
            s = Sampler({"temperature": 1.0, "top_p": 0.95, "seed": seed}).spec()
            toks = [r.pick(s, logits, load=(i == 0))[0] for i in range(k)]
            return toks, r.gs.read_state()
        a, st = run(99)
        assert st["step"] == 12 and st["u"] == uniform(99, 11)
        assert run(99)[0] == a and run(100)[0] != a
        assert len(set(a)) > 1
    finally:
        r.close()


@gpu
def test_sampled_frequencies_follow_the_probabilities(kern):
    n = 1000
    logits = np.full(n, -5.0, np.float32)
    logits[[10, 500, 999, 3, 77, 600]] = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5]
    s = Sampler({"temperature": 0.8, "top_k": 5, "seed": 2024}).spec()
    probs = s.params.probabilities(logits)
    r = Run(kern, n)
    try:
        draws = [r.pick(s, logits, load=(i == 0))[0] for i in range(3000)]
    finally:
        r.close()
    ids = np.nonzero(probs)[0]
    assert set(draws) <= set(ids.tolist())               # never a filtered token (600 is the 6th)
    obs = np.array([draws.count(int(i)) for i in ids])
    exp = probs[ids] * len(draws)
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < 30.0, (chi2, obs, exp)                 # 4 degrees of freedom: p < 1e-5 if the draw were right


@gpu
def test_nan_and_all_neg_inf_are_reported(kern):
    n = 1000
    r = Run(kern, n)
    try:
        s = Sampler({"temperature": 1.0, "seed": 1}).spec()
        x = lm_logits(np.random.default_rng(0), n)
        x[17] = np.nan
        assert r.pick(s, x)[1] > 0
        assert r.pick(s, np.full(n, -np.inf, np.float32)) == (-1, -1)
        assert r.gs.read_state()["step"] == 0            # a failed pick advances nothing
    finally:
        r.close()


# --- end to end (GPU) --------------------------------------------------------------------------------------------
E2E_MODELS = ("tiny-qwen3moe-q4k", "tiny-llama-legacy")


def _sampled(be, prompt, params, n=32):
    """n picks as the session makes them: each spec's history the sequence before the token fed."""
    s = Sampler(params)
    toks = [be.decode(prompt, s.spec([]))[0].id]
    s.advance()
    while len(toks) < n:
        toks.append(be.decode([toks[-1]], s.spec(prompt + toks[:-1]))[0].id)
        s.advance()
    return toks


@gpu
@pytest.mark.parametrize("name", E2E_MODELS)
def test_backend_seeded_sampling_reproduces_and_top_k_1_is_greedy(fixtures_dir, name):
    import json

    from engine.cuda.backend import CUDABackend, CudaOptions
    from engine.gguf_model import open_model
    from gpu_compare import greedy
    model = open_model(fixtures_dir / "reference" / f"{name}.gguf")
    prompt = list(json.loads((fixtures_dir / "reference" / f"{name}.json").read_text())["cases"][0]["prompt_ids"])
    params = {"temperature": 1.3, "top_p": 0.95, "min_p": 0.01, "seed": 1234, "penalty_repeat": 1.1}
    be = CUDABackend(model, 256, CudaOptions())
    try:
        a = _sampled(be, prompt, params)
        be.truncate(0)
        assert _sampled(be, prompt, params) == a
        be.truncate(0)
        g = greedy(be, prompt, 32)
        be.truncate(0)
        assert _sampled(be, prompt, {"temperature": 0.7, "top_k": 1, "seed": 5}) == g
        be.truncate(0)
        # greedy with a repeat penalty (on the GPU) equals the host's pick on the same step's logits
        pen = Sampler({"penalty_repeat": 1.5})
        seq = list(prompt)
        tok = be.decode(prompt, pen.spec([]))[0].id
        for _ in range(8):
            lg = be.forward([tok])                   # the step's logits (greedy graph) ...
            be.truncate(be.n_cached - 1)
            spec = pen.spec(seq)
            nxt = be.decode([tok], spec)[0].id       # ... and the same step again through the sampled graph
            top2 = np.sort(spec.params.apply_penalties(lg, spec.counted([tok])))[-2:]
            if top2[1] - top2[0] > 1e-3:             # a near-tie may part on a last-bit difference of the logits
                assert nxt == pick(lg, spec, [tok]).id
            seq.append(tok)
            tok = nxt
    finally:
        be.close()
    eager = CUDABackend(model, 256, CudaOptions(no_graph=True))
    try:
        assert _sampled(eager, prompt, params) == a
    finally:
        eager.close()


@gpu
@pytest.mark.parametrize("params", [{}, {"temperature": 1.1, "top_p": 0.95, "seed": 42, "penalty_repeat": 1.2,
                                         "penalty_last_n": 8}])
def test_backend_window_picks_equal_one_token_picks(fixtures_dir, params):
    """decode(window, spec, all_positions=True) returns at position i what a one-token call with
    spec.after(window[:i]) returns from the same cache: the device's counter and penalty window kept in step with
    the specs across the window and after a rewind."""
    import json

    from engine.cuda.backend import CUDABackend, CudaOptions
    from engine.gguf_model import open_model
    name = "tiny-qwen3moe-q4k"
    model = open_model(fixtures_dir / "reference" / f"{name}.gguf")
    prompt = list(json.loads((fixtures_dir / "reference" / f"{name}.json").read_text())["cases"][0]["prompt_ids"])
    be = CUDABackend(model, 256, CudaOptions())
    try:
        s = Sampler(params)
        first = be.decode(prompt, s.spec([]))[0].id
        s.advance()
        n0 = be.n_cached
        for window in ([first, 5, 17, 99], [first, first, 3]):
            spec = s.spec(prompt)
            picks = [p.id for p in be.decode(window, spec, all_positions=True)]
            be.truncate(n0)
            assert picks == [be.decode([t], spec.after(window[:i]))[0].id for i, t in enumerate(window)]
            be.truncate(n0)
    finally:
        be.close()


@gpu
def test_sampled_variant_with_prefetch_restores_the_table_and_reproduces(fixtures_dir):
    """Half the experts in VRAM: the sampled graph variant carries the next-layer prefetch's fork/join (the pick's
    kernels between the restore's fork and its join). After sampled steps the device table equals the host's (the
    restore ran in that variant too), and a seeded run reproduces."""
    import json

    from engine.cuda.backend import CUDABackend, CudaOptions
    from engine.gguf_model import open_model
    name = "tiny-qwen3moe-q4k"
    model = open_model(fixtures_dir / "reference" / f"{name}.gguf")
    prompt = list(json.loads((fixtures_dir / "reference" / f"{name}.json").read_text())["cases"][0]["prompt_ids"])
    total = model.config.n_layer * model.config.n_expert
    params = {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 77, "penalty_present": 0.5}
    be = CUDABackend(model, 256, CudaOptions(expert_slots=total // 2, prefetch=True, adapt_every=0))
    try:
        assert be.step.prefetch is not None
        a = _sampled(be, prompt, params)
        assert set(be.step.graphs) == {"greedy", "sampled"}
        np.testing.assert_array_equal(be.cache.table.get(stream=be.stream), be.cache.table_host)
        assert be.prefetch_stats().predicted > 0
        be.truncate(0)
        assert _sampled(be, prompt, params) == a
        np.testing.assert_array_equal(be.cache.table.get(stream=be.stream), be.cache.table_host)
    finally:
        be.close()
