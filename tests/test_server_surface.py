"""The OpenAI/Anthropic surface clients use (issue 18): logprobs, n > 1, GET /v1/models/{id}, count_tokens, and the
grammar a response_format or forced tool_choice sends to the worker. The stand-in worker echoes the prompt and
gives every token the log-probability -0.5 (tests/fake_worker.py)."""
import json

import pytest
import requests

from engine.grammar import decode
from fakes.server_kit import make_config, running_server, sse_events, tiny_codec

VOCAB = "vocab/tiny-bpe-1024.gguf"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture
def server(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (httpd, base):
        yield httpd, base


def last_gen(httpd) -> str:
    return [ln for ln in open(httpd.cfg.log).read().splitlines() if "fake worker: GEN" in ln][-1]


def sent_lines(httpd) -> list[str]:
    return [ln for ln in open(httpd.cfg.log).read().splitlines() if "fake worker: GEN" in ln]


def test_chat_logprobs_whole_and_streamed(server):
    httpd, base = server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
    r = requests.post(base + "/v1/chat/completions", json=body, timeout=30).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] == 5
    for e in content:
        assert e["logprob"] == -0.5 and len(e["top_logprobs"]) == 2 and bytes(e["bytes"]).decode() == e["token"]
    with requests.post(base + "/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=30) as s:
        entries = [e for c in sse_events(s) if c["choices"] for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert [e["token"] for e in entries] == [e["token"] for e in content]
    r = requests.post(base + "/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None},
                      timeout=30).json()
    assert r["choices"][0]["logprobs"] is None


def test_completion_logprobs_legacy_shape(server):
    _, base = server
    r = requests.post(base + "/v1/completions", json={"prompt": "hello there", "max_tokens": 4, "logprobs": 1},
                      timeout=30).json()
    lp = r["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == r["choices"][0]["text"] and lp["token_logprobs"] == [-0.5] * 4
    assert lp["text_offset"][0] == 0 and all(len(t) == 1 for t in lp["top_logprobs"])


def test_n_answers_one_after_another(server):
    httpd, base = server
    r = requests.post(base + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 3, "seed": 7}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 9
    seeds = [json.loads(ln.split("params=")[1].split(" prompt=")[0])["seed"] for ln in sent_lines(httpd)[-3:]]
    assert seeds == [7, 8, 9]
    r = requests.post(base + "/v1/completions", json={"prompt": "hey", "max_tokens": 2, "n": 2}, timeout=30).json()
    assert len(r["choices"]) == 2


def test_n_answers_streamed_one_after_another(server):
    _, base = server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 3, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True}
    with requests.post(base + "/v1/chat/completions", json=body, stream=True, timeout=30) as r:
        chunks = list(sse_events(r))
    order = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    assert order == sorted(order) and set(order) == {0, 1, 2}
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == [0, 1, 2]
    assert chunks[-1]["usage"]["completion_tokens"] == 9 and not chunks[-1]["choices"]
    texts = {}
    for c in chunks:
        if c["choices"]:
            texts[c["choices"][0]["index"]] = texts.get(c["choices"][0]["index"], "") + \
                (c["choices"][0]["delta"].get("content") or "")
    assert len(set(texts.values())) == 1                    # the echo worker answers each the same
    with requests.post(base + "/v1/completions", stream=True, timeout=30,
                       json={"prompt": "hey you", "max_tokens": 2, "n": 2, "stream": True}) as r:
        idx = [c["choices"][0]["index"] for c in sse_events(r)]
    assert idx[0] == 0 and idx[-1] == 1 and sorted(idx) == idx
    r = requests.post(base + "/v1/messages", json={"model": "x", "max_tokens": 2, "n": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400


def test_one_model_by_id(server):
    httpd, base = server
    r = requests.get(base + "/v1/models/fake", timeout=10)
    assert r.status_code == 200 and r.json()["id"] == "fake" and r.json()["object"] == "model"
    r = requests.get(base + "/v1/models/gpt-4o", timeout=10)
    assert r.status_code == 404 and "fake" in r.json()["error"]["message"]


def test_anthropic_count_tokens(server, fixtures_dir):
    httpd, base = server
    body = {"model": "fake", "system": "be brief", "messages": [{"role": "user", "content": "hello there"}]}
    r = requests.post(base + "/v1/messages/count_tokens", json=body, timeout=10)
    codec = tiny_codec(fixtures_dir)
    want, _ = codec.chat_prompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    assert r.status_code == 200 and r.json() == {"input_tokens": len(want)}
    with_tools = requests.post(base + "/v1/messages/count_tokens", timeout=10, json={**body, "tools": [
        {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]}).json()["input_tokens"]
    assert with_tools > len(want)              # the tools are part of the prompt
    assert httpd.service.snapshot()["totals"]["requests"] == 0     # counted without running the model


def test_response_format_and_forced_tools_send_a_grammar(server):
    httpd, base = server
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for rf, marker in (({"type": "json_object"}, '"json_schema"'),
                       ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, '"required"')):
        r = requests.post(base + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "response_format": rf})
        assert r.status_code == 200, r.text
        grammar = [kv for kv in open(httpd.cfg.log).read().split() if kv.startswith("grammar=")]
        assert grammar and marker in decode(grammar[-1][len("grammar="):])
    r = requests.post(base + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert r.status_code == 200, r.text
    g = decode([kv for kv in open(httpd.cfg.log).read().split() if kv.startswith("grammar=")][-1][8:])
    assert "<tool_call>" in g and '"const": "get_weather"' in g


def test_anthropic_tool_choice_tool_sends_a_grammar(server):
    httpd, base = server
    r = requests.post(base + "/v1/messages", timeout=30, json={
        "model": "fake", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert r.status_code == 200, r.text
    g = decode([kv for kv in open(httpd.cfg.log).read().split() if kv.startswith("grammar=")][-1][8:])
    assert '"const": "get_weather"' in g
