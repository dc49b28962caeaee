"""Backend.read_ahead: the session names each next part of the prompt before it feeds a part (engine/session.py), so
a backend may gather the next part's host inputs meanwhile (the CUDA qwen4exp pass's n-gram rows); every hint is
the part fed next, checkpoint splits included, and none follows the last part."""
from engine.session import Session, _next_part
from tests.test_session import V, run
from tests.test_session_checkpoints import PROMPT, RecurrentFake


class Hinted(RecurrentFake):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.log = []

    def read_ahead(self, tokens):
        self.log.append(("ahead", list(tokens)))

    def forward(self, tokens, all_logits=False):
        self.log.append(("fed", list(tokens)))
        return super().forward(tokens, all_logits)


def _check(log):
    fed = [t for k, t in log if k == "fed"]
    for i, (kind, toks) in enumerate(log):
        if kind == "ahead":      # the hint comes right before a part is fed, and names the part after it
            assert log[i + 1][0] == "fed"
            j = fed.index(log[i + 1][1])
            assert toks == fed[j + 1]
    return fed


def test_every_hint_is_the_next_part_fed():
    be = Hinted(chunk=8)
    s = Session(be, eog_ids=[V - 1], checkpoint_every=16, checkpoint_mib=1.0)
    run(s, 3, PROMPT)
    fed = _check(be.log)
    prompt_parts = fed[:len(fed) - 2]           # then the two decode steps
    assert sum(len(p) for p in prompt_parts) == len(PROMPT)
    assert [t for k, t in be.log if k == "ahead"] == prompt_parts[1:]
    assert any(len(p) < 8 for p in prompt_parts[:-1])          # a checkpoint split a chunk


def test_next_part_follows_the_loop():
    prompt = list(range(20))
    assert _next_part(prompt, 4, 8, 8, set()) == list(range(4, 8))         # the rest of the chunk
    assert _next_part(prompt, 8, 8, 8, set()) == list(range(8, 16))        # the next chunk
    assert _next_part(prompt, 8, 8, 8, {11}) == list(range(8, 11))         # cut at a checkpoint
    assert _next_part(prompt, 16, 16, 8, set()) == list(range(16, 20))
    assert _next_part(prompt, 20, 20, 8, set()) == []
