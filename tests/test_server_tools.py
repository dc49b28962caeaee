"""Tool calls through the HTTP API, against the fake worker.

The fake worker answers with the prompt's own tokens, so a template that renders only the last message's text makes
that text the model's answer. Each template names the markers of one format in a comment, which is what the server
reads to choose its parser.
"""
import json

import pytest
import requests

from fakes.server_kit import make_config, running_server, sse_events, tiny_codec

VOCAB = "vocab/tiny-bpe-1024.gguf"
ECHO = "{{ messages[-1]['content'] }}"
TEMPLATES = {
    "tags": "{# <tool_call> </tool_call> #}" + ECHO,
    "harmony": "{# <|channel|> <|call|> #}" + ECHO,
    "mistral": "{# [TOOL_CALLS] #}" + ECHO,
    "llama3": "{# <|python_tag|> #}" + ECHO,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
QWEN = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n'
        '</parameter>\n</function>\n</tool_call>')
WANT = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})]


def codec_with(fixtures_dir, template):
    codec = tiny_codec(fixtures_dir)
    codec.template = template
    return codec


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def server(request, tmp_path_factory, fixtures_dir):
    tmp = tmp_path_factory.mktemp("tools")
    cfg = make_config(tmp, fixtures_dir / VOCAB, ["--ctx", "1024"])
    with running_server(cfg, codec_with(fixtures_dir, TEMPLATES[request.param])) as (_, base):
        yield request.param, base


def post(base, path, stream=False, **body):
    body.setdefault("max_tokens", 500)
    r = requests.post(base + path, json=dict(body, stream=stream), timeout=30, stream=stream)
    assert r.status_code == 200, r.text
    return r


def user(text):
    return [{"role": "user", "content": text}]


def calls_of(tool_calls):
    assert all(c["type"] == "function" and (c["id"].startswith("call_") or len(c["id"]) == 9) for c in tool_calls)
    assert len({c["id"] for c in tool_calls}) == len(tool_calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def answer_for(kind):
    """(the model's answer, the content left, the calls) for the server's format."""
    if kind == "tags":
        return QWEN, "Let me look.", WANT
    if kind == "harmony":
        return ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}',
                None, [("get_weather", {"city": "Oslo"})])
    if kind == "llama3":
        return '{"name": "get_weather", "parameters": {"city": "Lima"}}', None, [("get_weather", {"city": "Lima"})]
    return '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Bern", "days": 1}}]', None, \
        [("get_weather", {"city": "Bern", "days": 1})]


def test_chat_non_stream(server):
    kind, base = server
    text, content, want = answer_for(kind)
    b = post(base, "/v1/chat/completions", messages=user(text), tools=TOOLS).json()
    c = b["choices"][0]
    assert c["finish_reason"] == "tool_calls"
    assert c["message"]["content"] == content and calls_of(c["message"]["tool_calls"]) == want


def test_chat_stream(server):
    kind, base = server
    text, content, want = answer_for(kind)
    evs = list(sse_events(post(base, "/v1/chat/completions", stream=True, messages=user(text), tools=TOOLS)))
    deltas = [e["choices"][0]["delta"] for e in evs]
    got = "".join(d.get("content") or "" for d in deltas)
    assert got == (content or "")
    parts = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [p["index"] for p in parts] == list(range(len(want)))
    assert calls_of(parts) == want
    assert [e["choices"][0]["finish_reason"] for e in evs if e["choices"][0]["finish_reason"]] == ["tool_calls"]


def streamed_content(evs) -> str:
    """The content deltas of a streamed chat completion, joined."""
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in evs)


def test_without_tools_or_with_tool_choice_none_the_answer_is_unchanged(server):
    kind, base = server
    text, _, _ = answer_for(kind)
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        b = post(base, "/v1/chat/completions", messages=user(text), **extra).json()
        c = b["choices"][0]
        assert c["message"]["content"] == text and "tool_calls" not in c["message"] and c["finish_reason"] == "stop"
        evs = list(sse_events(post(base, "/v1/chat/completions", stream=True, messages=user(text), **extra)))
        assert streamed_content(evs) == text
        assert all("tool_calls" not in e["choices"][0]["delta"] for e in evs)


def test_a_malformed_call_stays_content(server):
    kind, base = server
    text = {"tags": "Sure <tool_call>{not json}</tool_call> done",
            "harmony": "to=functions.get_weather<|channel|>commentary json<|message|>{broken",
            "mistral": "[TOOL_CALLS][{broken",
            "llama3": '{"name": "get_weather", "parameters": '}[kind]
    c = post(base, "/v1/chat/completions", messages=user(text), tools=TOOLS).json()["choices"][0]
    assert c["message"]["content"] == text and "tool_calls" not in c["message"] and c["finish_reason"] == "stop"
    evs = list(sse_events(post(base, "/v1/chat/completions", stream=True, messages=user(text), tools=TOOLS)))
    assert streamed_content(evs) == text


def test_messages_non_stream(server):
    kind, base = server
    text, content, want = answer_for(kind)
    b = post(base, "/v1/messages", messages=user(text), tools=ANTHROPIC_TOOLS).json()
    assert b["stop_reason"] == "tool_use"
    uses = [x for x in b["content"] if x["type"] == "tool_use"]
    assert [(u["name"], u["input"]) for u in uses] == want and all(u["id"].startswith("toolu_") for u in uses)
    assert [x["text"] for x in b["content"] if x["type"] == "text"] == ([content] if content else [])


def test_messages_stream(server):
    kind, base = server
    text, content, want = answer_for(kind)
    r = post(base, "/v1/messages", stream=True, messages=user(text), tools=ANTHROPIC_TOOLS)
    evs = list(sse_events(r))
    starts = [e for e in evs if e["type"] == "content_block_start"]
    stops = [e["index"] for e in evs if e["type"] == "content_block_stop"]
    assert [s["index"] for s in starts] == stops == list(range(len(starts)))    # blocks open and close in order
    uses, inputs, texts = {}, {}, []
    for e in evs:
        if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use":
            uses[e["index"]] = e["content_block"]["name"]
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            inputs[e["index"]] = inputs.get(e["index"], "") + e["delta"]["partial_json"]
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta":
            texts.append(e["delta"]["text"])
    assert [(uses[i], json.loads(inputs[i])) for i in sorted(uses)] == want
    assert "".join(texts) == (content or "")
    assert [e["delta"]["stop_reason"] for e in evs if e["type"] == "message_delta"] == ["tool_use"]


def test_messages_history_with_tool_use_and_tool_result(server):
    # The conversation an agent sends back after running the tool: the template gets tool_calls and a tool message.
    kind, base = server
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    b = post(base, "/v1/messages", messages=msgs, tools=ANTHROPIC_TOOLS).json()
    # the echo template renders the last message: the tool result
    assert b["content"] == [{"type": "text", "text": "sunny"}] and b["stop_reason"] == "end_turn"


def test_the_openai_client_reads_the_calls_and_sends_them_back(server):
    openai = pytest.importorskip("openai", reason="the openai client is a test dependency")
    kind, base = server
    text, content, want = answer_for(kind)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
    r = client.chat.completions.create(model="any", messages=user(text), tools=TOOLS, max_tokens=500)
    msg = r.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == want
    calls = {}
    for chunk in client.chat.completions.create(model="any", messages=user(text), tools=TOOLS, max_tokens=500,
                                                stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments
    assert [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())] == want
    # the next turn, as an agent sends it: the assistant's calls and one tool message per call
    history = user(text) + [msg.model_dump(exclude_none=True)] + \
        [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in msg.tool_calls]
    r = client.chat.completions.create(model="any", messages=history, tools=TOOLS, max_tokens=500)
    assert r.choices[0].message.content == "sunny" and r.choices[0].finish_reason == "stop"
