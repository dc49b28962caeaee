"""Session against a small fake backend whose logits depend on the whole cached history.

Because the fake's next token is a function of every token it holds, a wrong truncate or a wrong token fed after a
decode step changes the output, so prefix reuse and the decode loop are checked by the tokens themselves.
"""
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from engine import protocol
from engine.backend import Backend
from engine.session import BackendBroken, Session

V = 50


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, max_context=128, chunk=4, eog_after=None):
        cfg = SimpleNamespace(n_vocab=V, n_ctx_train=256)
        super().__init__(SimpleNamespace(config=cfg), max_context)
        self.held: list[int] = []
        self.chunk = chunk
        self.fed: list[list[int]] = []
        self.fail_next = None
        self.on_forward = None

    def prompt_chunk_size(self):
        return self.chunk

    def truncate(self, n):
        super().truncate(n)
        del self.held[n:]

    def forward(self, tokens, all_logits=False):
        if self.fail_next:
            e, self.fail_next = self.fail_next, None
            raise e
        assert len(self.held) == self.n_cached
        self.fed.append(list(tokens))
        self.held.extend(int(t) for t in tokens)
        self.n_cached += len(tokens)
        if self.on_forward:
            self.on_forward(self)
        h = 0
        for t in self.held:
            h = (h * 31 + t + 7) % 1_000_003
        logits = np.zeros(V, np.float32)
        logits[h % (V - 1)] = 5.0  # never token V-1: the tests use it as the end-of-generation id
        return logits


def run(session, max_new, prompt, stop=None, **params):
    lines = []
    done = session.run(protocol.GenRequest(max_new=max_new, prompt=prompt, params=params), lines.append, stop)
    return lines, done


def tokens_of(lines):
    return [int(l.split()[1]) for l in lines if l.startswith("T ")]


def kinds(lines):
    return [protocol.kind(l) for l in lines]


def test_order_of_lines_and_done_fields():
    s = Session(FakeBackend(chunk=4), eog_ids=[V - 1])
    lines, done = run(s, 5, list(range(1, 11)))
    k = kinds(lines)
    assert k == ["RESUME"] + ["PP"] * 3 + ["REUSED"] + ["T"] * 5 + ["DONE"]
    assert [protocol.parse_pp(l)[0] for l in lines if l.startswith("PP")] == [4, 8, 10]
    d = protocol.parse_done(lines[-1])
    assert (d.generated, d.prompt, d.finish, d.reused, d.prompt_read) == (5, 10, "length", 0, 10)
    assert (done.generated, done.finish) == (5, "length")


def test_prefix_reuse_gives_the_same_tokens_as_a_cold_run():
    prompt = list(range(1, 20))
    warm = Session(FakeBackend(), eog_ids=[V - 1])
    first, _ = run(warm, 6, prompt)
    follow = prompt + tokens_of(first) + [3, 4, 5]
    second, d2 = run(warm, 6, follow)
    cold, _ = run(Session(FakeBackend(), eog_ids=[V - 1]), 6, follow)
    # the cache held the prompt and 5 of the 6 generated tokens (the last one was never fed)
    assert second[0] == f"RESUME {len(prompt) + 5}"
    assert d2.reused == len(prompt) + 5 and d2.prompt_read == len(follow) - d2.reused
    assert tokens_of(second) == tokens_of(cold)


def test_identical_prompt_rereads_its_last_token():
    s = Session(FakeBackend(), eog_ids=[V - 1])
    a, _ = run(s, 3, [1, 2, 3, 4])
    b, d = run(s, 3, [1, 2, 3, 4])
    assert d.reused == 3 and d.prompt_read == 1
    assert tokens_of(a) == tokens_of(b)


def test_diverging_prompt_truncates_the_cache():
    be = FakeBackend()
    s = Session(be, eog_ids=[V - 1])
    run(s, 4, [1, 2, 3, 4, 5, 6])
    b, d = run(s, 4, [1, 2, 9, 9, 9])
    cold, _ = run(Session(FakeBackend(), eog_ids=[V - 1]), 4, [1, 2, 9, 9, 9])
    assert d.reused == 2 and tokens_of(b) == tokens_of(cold)


def test_the_token_fed_after_each_step_is_the_sampled_one():
    be = FakeBackend(chunk=100)
    s = Session(be, eog_ids=[V - 1])
    lines, _ = run(s, 4, [1, 2, 3])
    toks = tokens_of(lines)
    assert be.fed == [[1, 2, 3]] + [[t] for t in toks[:-1]]


def test_eog_ends_with_stop_and_is_not_emitted():
    be = FakeBackend()
    s = Session(be, eog_ids=[V - 1])
    probe, _ = run(Session(FakeBackend(), eog_ids=[V - 1]), 3, [5, 6, 7])
    second = tokens_of(probe)[1]
    s2 = Session(FakeBackend(), eog_ids=[second])
    lines, d = run(s2, 10, [5, 6, 7])
    assert tokens_of(lines) == tokens_of(probe)[:1]
    assert d.finish == "stop" and d.generated == 1


def test_max_new_zero_reads_the_prompt_only():
    be = FakeBackend(chunk=3)
    lines, d = run(Session(be, eog_ids=[]), 0, [1, 2, 3, 4, 5])
    assert kinds(lines) == ["RESUME", "PP", "PP", "REUSED", "DONE"]
    assert (d.generated, d.finish, d.prompt_read) == (0, "length", 5)
    assert be.n_cached == 5


def test_stop_mid_prompt_cancels_with_partial_prompt_read():
    be = FakeBackend(chunk=2)
    stop = threading.Event()
    be.on_forward = lambda b: stop.set() if b.n_cached >= 4 else None
    s = Session(be, eog_ids=[])
    lines, d = run(s, 5, list(range(1, 21)), stop=stop)
    assert d.finish == "cancel" and d.prompt_read == 4 and d.generated == 0
    assert "REUSED" not in kinds(lines) and "T" not in kinds(lines)
    # what was read stays usable: the next request resumes from it
    _, d2 = run(s, 2, list(range(1, 21)))
    assert d2.reused == 4


def test_stop_mid_decode_cancels_between_tokens():
    be = FakeBackend(chunk=100)
    stop = threading.Event()
    be.on_forward = lambda b: stop.set() if b.n_cached >= 6 else None
    lines, d = run(Session(be, eog_ids=[]), 50, [1, 2, 3], stop=stop)
    assert d.finish == "cancel" and 0 < d.generated < 50


@pytest.mark.parametrize("prompt,max_new,needle", [
    ([1, 2, V], 4, f"outside this model's vocabulary (0..{V - 1})"),
    ([1, -2], 4, "outside"),
    (list(range(1, 40)) * 3, 4, "exceeds the context of 128"),
    ([1, 2], 119, "lower max_new to 118"),
])
def test_refused_requests_say_why_and_the_session_keeps_serving(prompt, max_new, needle):
    s = Session(FakeBackend(max_context=128), eog_ids=[])
    lines, d = run(s, max_new, prompt)
    assert d is None and len(lines) == 1 and lines[0].startswith("ERR ") and needle in lines[0]
    lines, d = run(s, 2, [1, 2])
    assert d.finish == "length"


def test_exception_inside_a_request_is_an_err_and_the_cache_restarts_cold():
    be = FakeBackend(chunk=100)
    s = Session(be, eog_ids=[])
    run(s, 2, [1, 2, 3])
    be.fail_next = RuntimeError("boom")
    lines, d = run(s, 2, [1, 2, 3, 4])
    assert d is None and lines[-1] == "ERR request failed: RuntimeError: boom"
    lines, d = run(s, 2, [1, 2, 3, 4])
    assert d.reused == 0 and d.finish == "length"
    cold, _ = run(Session(FakeBackend(), eog_ids=[]), 2, [1, 2, 3, 4])
    assert tokens_of(lines) == tokens_of(cold)


def test_broken_backend_raises_after_its_err():
    be = FakeBackend()
    s = Session(be, eog_ids=[])
    be.fail_next = BackendBroken("illegal address")
    lines = []
    with pytest.raises(BackendBroken):
        s.run(protocol.GenRequest(2, [1, 2]), lines.append)
    assert lines[-1].startswith("ERR ") and "illegal address" in lines[-1]


def test_seeded_sampling_is_reproducible_through_the_session():
    a, _ = run(Session(FakeBackend(), eog_ids=[]), 8, [1, 2, 3], temperature=5.0, seed=11)
    b, _ = run(Session(FakeBackend(), eog_ids=[]), 8, [1, 2, 3], temperature=5.0, seed=11)
    assert tokens_of(a) == tokens_of(b)
