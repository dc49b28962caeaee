"""Prefix reuse over a recurrent state (engine/checkpoints.py), against a fake backend whose state is a hash of
every token it has read since its last cold start.

The fake keeps engine/backend.py's contract for recurrent backends: truncate(n) only to 0 or n_cached, and
restore_state() of a snapshot cuts the K/V back to the snapshot's position. Its logits depend on the state and on the
K/V it holds, so a resume from the wrong place (a state that has read tokens the session no longer holds, or one that
lacks some) changes the generated tokens: every test compares them with a cold run's.
"""
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from engine import protocol
from engine.backend import Backend, RecurrentSnapshot
from engine.checkpoints import CHECKPOINT_TAIL, CheckpointStore
from engine.session import Session

V = 50
SNAP_BYTES = 1000


def _mix(h, t):
    return (h * 1_000_003 + t + 7) % (1 << 61)


class RecurrentFake(Backend):
    name = "fake-recurrent"
    recurrent = True

    def __init__(self, max_context=512, chunk=8, snap_bytes=SNAP_BYTES):
        super().__init__(SimpleNamespace(config=SimpleNamespace(n_vocab=V, n_ctx_train=512)), max_context)
        self.held: list[int] = []       # the K/V: one entry per position
        self.state = 0                  # the recurrent state: every token read since the last truncate(0)
        self.chunk = chunk
        self.snap_bytes = snap_bytes
        self.snapshots = self.restores = 0
        self.on_forward = None
        self.fail_next = None

    def prompt_chunk_size(self):
        return self.chunk

    def forward(self, tokens, all_logits=False):
        if self.fail_next:
            e, self.fail_next = self.fail_next, None
            raise e
        for t in tokens:
            self.state = _mix(self.state, int(t))
        self.held.extend(int(t) for t in tokens)
        self.n_cached += len(tokens)
        if self.on_forward:
            self.on_forward(self)
        h = _mix(self.state, len(self.held))
        for t in self.held[-3:]:
            h = _mix(h, t)
        logits = np.zeros(V, np.float32)
        logits[h % (V - 1)] = 5.0          # never V-1: the tests' end-of-generation id
        return logits

    def truncate(self, n):
        if n not in (0, self.n_cached):
            raise ValueError(f"a recurrent state cannot be rewound to {n} of {self.n_cached}")
        super().truncate(n)
        if n == 0:
            self.held, self.state = [], 0

    def state_bytes(self):
        return self.snap_bytes

    def snapshot_state(self):
        self.snapshots += 1
        return RecurrentSnapshot(self.n_cached, self.snap_bytes, (self.state, tuple(self.held)))

    def restore_state(self, snap):
        super().restore_state(snap)
        self.restores += 1
        state, held = snap.data
        # the session's promise: positions 0..n_tokens-1 still hold what they held at the snapshot
        assert tuple(self.held[:snap.n_tokens]) == held, "restored over K/V that changed since the snapshot"
        self.state, self.held = state, self.held[:snap.n_tokens]


def run(session, max_new, prompt, stop=None):
    lines = []
    done = session.run(protocol.GenRequest(max_new=max_new, prompt=list(prompt)), lines.append, stop)
    return lines, done


def toks(lines):
    return [int(l.split()[1]) for l in lines if l.startswith("T ")]


def cold(max_new, prompt, **kw):
    return toks(run(Session(RecurrentFake(**kw), eog_ids=[V - 1]), max_new, prompt)[0])


def session(every=16, mib=1.0, **kw):
    be = RecurrentFake(**kw)
    return be, Session(be, eog_ids=[V - 1], checkpoint_every=every, checkpoint_mib=mib)


PROMPT = [(i * 7 + 3) % (V - 1) for i in range(60)]


def test_the_fake_catches_a_resume_from_the_wrong_state():
    # the tests' premise: a state that has read tokens the K/V no longer holds gives other tokens than a cold run
    stale, fresh = RecurrentFake(), RecurrentFake()
    stale.forward([1, 2, 3])
    stale.held, stale.n_cached = [], 0    # K/V cut back, state not: a rewind without a restore
    picks = [(int(np.argmax(stale.forward([t]))), int(np.argmax(fresh.forward([t])))) for t in PROMPT[:10]]
    assert all(a != b for a, b in picks)


def test_a_second_turn_that_rewrites_the_prompts_tail_resumes_from_a_checkpoint():
    be, s = session(every=0)
    first, _ = run(s, 5, PROMPT)
    # as Qwen3.5's template does in the next request: the end of the last prompt (its generation prompt) changes
    follow = PROMPT[:-2] + [11, 12] + toks(first) + [20, 21, 22]
    lines, d = run(s, 6, follow)
    assert d.reused == len(PROMPT) - CHECKPOINT_TAIL and lines[0] == f"RESUME {d.reused}"
    assert d.prompt_read == len(follow) - d.reused and be.restores == 1
    assert toks(lines) == cold(6, follow)
    info = [protocol.parse_info(l) for l in lines if l.startswith("INFO")]
    assert len(info) == 1 and lines[-2].startswith("INFO") and int(info[0]["checkpoints"]) >= 2


def test_an_extended_conversation_resumes_from_the_live_state():
    be, s = session()
    first, d1 = run(s, 5, PROMPT)
    follow = PROMPT + toks(first) + [20, 21]
    lines, d = run(s, 4, follow)
    assert d.reused == len(PROMPT) + 4 and be.restores == 0        # the 5th token was never fed
    assert toks(lines) == cold(4, follow)


def test_the_same_prompt_again_gives_the_same_tokens():
    be, s = session(every=0)
    a, _ = run(s, 6, PROMPT)
    b, d = run(s, 6, PROMPT)
    assert d.reused == len(PROMPT) - CHECKPOINT_TAIL and toks(a) == toks(b)


def test_a_change_early_in_a_long_prompt_resumes_from_the_periodic_checkpoint():
    be, s = session(every=16)
    run(s, 3, PROMPT)
    edited = PROMPT[:37] + [1] + PROMPT[38:]
    lines, d = run(s, 3, edited)
    assert d.reused == 32 and toks(lines) == cold(3, edited)


def test_a_change_before_every_checkpoint_reads_all_again():
    be, s = session(every=16)
    run(s, 3, PROMPT)
    edited = [1] + PROMPT[1:]
    lines, d = run(s, 3, edited)
    assert d.reused == 0 and be.restores == 0 and toks(lines) == cold(3, edited)


def test_stop_mid_prompt_then_new_requests_give_a_cold_runs_tokens():
    be, s = session(every=16, chunk=8)
    stop = threading.Event()
    be.on_forward = lambda b: stop.set() if b.n_cached >= 40 else None
    lines, d = run(s, 5, PROMPT, stop=stop)
    assert d.finish == "cancel" and d.prompt_read == 40 and "T" not in [protocol.kind(l) for l in lines]
    be.on_forward = None
    # the whole prompt again: it resumes where the cancelled pass stopped
    again, d2 = run(s, 5, PROMPT)
    assert d2.reused == 40 and toks(again) == cold(5, PROMPT)
    # then one that diverges inside what was read: from a checkpoint, still a cold run's tokens
    other = PROMPT[:20] + [5] * 10
    lines, d3 = run(s, 5, other)
    assert d3.reused == 16 and toks(lines) == cold(5, other)


def test_random_conversations_always_equal_cold_runs():
    rng = np.random.default_rng(5)
    for every, mib, chunk in ((8, 1.0, 5), (0, 0.003, 3), (16, 0.0, 8)):   # 0.003 MiB: three checkpoints
        be, s = session(every=every, mib=mib, chunk=chunk)
        prompt = [int(t) for t in rng.integers(0, V - 1, 30)]
        for _ in range(25):
            max_new = int(rng.integers(0, 6))
            stop = None
            if rng.random() < 0.2:
                stop = threading.Event()
                at = be.n_cached + int(rng.integers(1, 30))
                be.on_forward = lambda b, at=at, stop=stop: stop.set() if b.n_cached >= at else None
            lines, d = run(s, max_new, prompt, stop)
            be.on_forward = None
            assert s.checkpoints.nbytes <= s.checkpoints.budget
            assert all(p <= len(s.tokens) for p in s.checkpoints.positions())
            if d.finish != "cancel":
                assert toks(lines) == cold(max_new, prompt, chunk=chunk), (every, mib, prompt)
            # the next prompt: this one (plus the answer) cut somewhere, edited or not, extended
            held = prompt + toks(lines)
            cut = int(rng.integers(1, len(held) + 1))
            prompt = held[:cut] + [int(t) for t in rng.integers(0, V - 1, int(rng.integers(1, 12)))]
            if len(prompt) > 200:
                prompt = prompt[-40:]
    assert be.restores == 0   # mib 0: no checkpoint ever, so every rewind was a cold start


def test_a_failure_forgets_the_checkpoints_too():
    be, s = session()
    run(s, 3, PROMPT)
    assert len(s.checkpoints) > 0
    be.fail_next = RuntimeError("boom")
    lines, d = run(s, 3, PROMPT[:50] + [1, 2])
    assert d is None and lines[-1] == "ERR request failed: RuntimeError: boom" and len(s.checkpoints) == 0
    lines, d = run(s, 3, PROMPT)
    assert d.reused == 0 and toks(lines) == cold(3, PROMPT)


def test_pp_lines_follow_chunks_not_checkpoints():
    be, s = session(every=5, chunk=8)
    lines, _ = run(s, 2, PROMPT[:30])
    assert [protocol.parse_pp(l)[0] for l in lines if l.startswith("PP")] == [8, 16, 24, 30]
    assert s.checkpoints.positions() == [5, 10, 14, 15, 20, 25, 31]   # 14: 30 - CHECKPOINT_TAIL; 31: the end


def test_a_backend_without_recurrent_state_keeps_no_checkpoints():
    from test_session import FakeBackend
    s = Session(FakeBackend(), eog_ids=[V - 1])
    lines, _ = run(s, 3, PROMPT)
    assert s.checkpoints is None and not any(l.startswith("INFO") for l in lines)


# --- the store alone -------------------------------------------------------------------------------------------------
def snap(n, nbytes=10):
    return RecurrentSnapshot(n, nbytes, n)


def test_store_keeps_within_budget_and_evicts_the_cheapest_loss():
    st = CheckpointStore(40)
    for n in (100, 200, 210, 400):
        st.add(snap(n))
    assert st.positions() == [100, 200, 210, 400] and st.nbytes == 40
    st.add(snap(500))                 # 210 is 10 past 200: losing it costs least
    assert st.positions() == [100, 200, 400, 500]
    st.add(snap(520))                 # 500 -> 100 past 400, 100 -> 100 past 0: the oldest of the tie
    assert st.positions() == [200, 400, 500, 520]
    assert st.latest_at_or_before(450).n_tokens == 400 and st.latest_at_or_before(199) is None
    st.drop_after(450)
    assert st.positions() == [200, 400]


def test_store_refuses_what_cannot_fit_and_replaces_a_position():
    st = CheckpointStore(25)
    assert not st.fits(30) and not st.fits(0) and st.fits(25)
    with pytest.raises(ValueError):
        st.add(snap(5, 30))
    st.add(snap(5))
    st.add(snap(5, 20))
    assert st.positions() == [5] and st.nbytes == 20
    st.add(snap(9, 25))               # the one being added is never the one evicted
    assert st.positions() == [9]
