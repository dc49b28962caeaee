"""Grammar-constrained decoding and log-probabilities in the worker (engine/grammar.py, engine/sampling.py).

A backend with random logits over the tiny 1,024-token vocabulary: whatever the logits, a constrained request's
answer must parse and match its schema, and each T line's log-probabilities must be the masked distribution's.
"""
import json
from types import SimpleNamespace

import numpy as np
import pytest

from engine import protocol
from engine.backend import Backend
from engine.grammar import Grammars, apply_mask, encode, mask_words
from engine.sampling import PickSpec, logprobs_of, pick
from engine.session import Session

llguidance = pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}


class RandomBackend(Backend):
    def __init__(self, n_vocab, seed):
        super().__init__(SimpleNamespace(config=SimpleNamespace(n_vocab=n_vocab, n_ctx_train=4096)), 4096)
        self.rng = np.random.default_rng(seed)
        self.last = None

    def forward(self, tokens, all_logits=False):
        self.n_cached += len(tokens)
        self.last = (self.rng.standard_normal(self.config.n_vocab) * 3).astype(np.float32)
        return self.last


@pytest.fixture(scope="module")
def tiny(fixtures_dir):
    from engine.tokenizer import Tokenizer
    return Tokenizer.from_gguf(fixtures_dir / "vocab" / "tiny-bpe-1024.gguf")


def test_apply_mask_matches_the_bits():
    rng = np.random.default_rng(1)
    for n in (1, 31, 32, 33, 1000, 151_936):
        logits = rng.standard_normal(n).astype(np.float32)
        allowed = rng.random(n) < 0.3
        words = np.packbits(np.concatenate([allowed, np.zeros(mask_words(n) * 32 - n, bool)]),
                            bitorder="little").view(np.int32)
        out = apply_mask(logits, words)
        assert np.array_equal(np.isfinite(out), allowed) and np.array_equal(out[allowed], logits[allowed])


def test_logprobs_of_is_log_softmax_and_sorted():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(500).astype(np.float32)
    lp, top = logprobs_of(x, 7, 5)
    ref = x.astype(np.float64) - np.log(np.sum(np.exp(x.astype(np.float64))))
    assert lp == pytest.approx(ref[7])
    assert [i for i, _ in top] == list(np.argsort(-ref)[:5]) and [v for _, v in top] == pytest.approx(sorted(ref)[::-1][:5])
    got = pick(x, PickSpec(logprobs=3))
    assert got.id == top[0][0] and got.logprob == pytest.approx(top[0][1])   # greedy: the top entry is the pick
    assert got.top == tuple(top[:3])


@pytest.mark.parametrize("seed,temperature", [(0, 0.0), (1, 0.0), (2, 0.8), (3, 1.5), (4, 1.0)])
def test_a_constrained_answer_parses_and_matches_the_schema(tiny, seed, temperature):
    backend = RandomBackend(tiny.n_vocab, seed)
    eog = sorted(tiny.eog_ids)
    session = Session(backend, eog, grammars=Grammars(lambda: tiny, eog))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    lines = []
    req = protocol.GenRequest(300, tiny.encode("hi", add_special=False), {"temperature": temperature, "seed": seed},
                              logprobs=2, grammar=encode(grammar))
    done = session.run(req, lines.append)
    assert done is not None and done.finish == "stop", lines[-1]
    toks = [protocol.parse_token(ln)[0] for ln in lines if ln.startswith("T ")]
    obj = json.loads(tiny.decode(toks))
    assert set(obj) == {"color", "ok"} and obj["color"] in ("red", "green", "blue") and isinstance(obj["ok"], bool)
    for ln in lines:
        if ln.startswith("T "):
            tok, lp, top = protocol.parse_token(ln)
            assert lp <= 0 and all(v <= 0 for _, v in top) and len(top) >= 1
            if temperature == 0:
                assert top[0][0] == tok


def test_a_bad_grammar_is_an_err_and_no_grammar_support_too(tiny):
    eog = sorted(tiny.eog_ids)
    session = Session(RandomBackend(tiny.n_vocab, 0), eog, grammars=Grammars(lambda: tiny, eog))
    lines = []
    assert session.run(protocol.GenRequest(4, [1, 2], grammar="%%%"), lines.append) is None
    assert lines[-1].startswith("ERR") and "base64" in lines[-1]
    lines = []
    assert session.run(protocol.GenRequest(4, [1, 2], grammar=encode('{"grammars": [{"lark_grammar": "start: ("}]}')),
                       lines.append) is None
    assert lines[-1].startswith("ERR") and "grammar" in lines[-1]
    lines = []
    assert Session(RandomBackend(tiny.n_vocab, 0), eog).run(protocol.GenRequest(4, [1, 2], grammar=encode("{}")),
                                                            lines.append) is None
    assert "llguidance" in lines[-1]


def test_gen_round_trips_the_request_keys():
    req = protocol.GenRequest(5, [1, 2, 3], {"temperature": 0.5}, req=12, logprobs=3, grammar=encode('{"a": 1}'))
    back = protocol.parse_gen(protocol.format_gen(req))
    assert (back.req, back.logprobs, back.grammar, back.params) == (12, 3, req.grammar, {"temperature": 0.5})
    with pytest.raises(protocol.ProtocolError, match="logprobs"):
        protocol.parse_gen("GEN 5 logprobs=21 1,2")
    assert protocol.with_req("RESUME 3", 12) == "RESUME 3 12" and protocol.with_req("ERR bad", 12) == "ERR req=12 bad"
    assert protocol.parse_err("ERR req=12 bad thing") == ("bad thing", 12)
    assert protocol.parse_token("T 5 -0.5000 5:-0.5000,7:-1.2500") == (5, -0.5, [(5, -0.5), (7, -1.25)])
    for bad in ("T", "T abc", "T 5 x -", "T 5 -0.5"):
        with pytest.raises(protocol.ProtocolError):
            protocol.parse_token(bad)
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_token("T 2000", n_vocab=1024)
