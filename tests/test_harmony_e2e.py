"""Harmony (gpt-oss's chat format) end to end: the openai client and the Anthropic shape against the server running
the real worker (CPU backend) on a gpt-oss model, over two turns: reasoning, a tool call, then the tool's result
back in the prompt as the template writes it, reasoning again and a final answer, each in its field.

The model is tests/harmony_model.py's: two gpt-oss layers whose greedy answers are the script below, looked up from
the context (the last tokens and which tokens occur). The script also answers the second turn rendered without the
first's reasoning, and the first turn at each effort, with other words, so a server that dropped the reasoning or the
effort gets those words back, not the expected ones.
"""
from __future__ import annotations

import json
import sys

import pytest
import requests

from fakes.server_kit import ROOT, running_server
from harmony_model import build

openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install -r requirements-test.txt")

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The current weather in a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# Each reasoning holds a word the prompt does not ("Quick", "asks", "says"): by the last tokens and which tokens occur,
# the model could not tell the second <|channel|> of an answer from its first without one (harmony_model.py).
REASONING_1 = {"low": "Quick: call get_weather.",
               "high": "The user asks about Paris, so I should call get_weather with that city."}
ARGS = {"city": "Paris"}
RESULT = '{"sky": "sunny", "temp_c": 21}'
REASONING_2 = "The tool says sunny and 21 C."
FINAL = "It is sunny in Paris (21 C)."


def answer_1(effort: str) -> str:
    return (f"<|channel|>analysis<|message|>{REASONING_1[effort]}<|end|><|start|>assistant<|channel|>commentary "
            f"to=functions.get_weather <|constrain|>json<|message|>{json.dumps(ARGS)}<|call|>")


# What the model says when the second turn comes without the first's reasoning (a server that dropped it)
FORGOT = "<|channel|>final<|message|>My reasoning did not come back.<|return|>"
ANSWER_2 = f"<|channel|>analysis<|message|>{REASONING_2}<|end|><|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>"


def turn_2(effort: str, call_id: str = "call_1", reasoning: bool = True) -> list[dict]:
    """The conversation after the call, as an OpenAI client sends it back (the reasoning too, as llama.cpp's)."""
    return USER + [
        {"role": "assistant", "content": None, "reasoning_content": REASONING_1[effort] if reasoning else None,
         "tool_calls": [{"id": call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from engine.tokenizer import Tokenizer
    from server.config import validate
    from server.text import TextCodec
    from tools import gptoss_plan, make_moe
    tmp = tmp_path_factory.mktemp("harmony")
    vocab = gptoss_plan.harmony_vocab(make_moe.PRESETS["gpt-oss-tiny"].shape,
                                      make_moe.read_vocab(make_moe.VOCAB_DIR / gptoss_plan.BASE_VOCAB))
    md = {k: v for k, v, _ in vocab}
    codec = TextCodec(Tokenizer.from_metadata(md), md["tokenizer.chat_template"])
    convs = []
    for effort in ("low", "high"):
        kw = {"reasoning_effort": effort}
        convs.append((codec.chat_prompt(USER, tools=TOOLS, template_kwargs=kw)[0], codec.encode_special(answer_1(effort))))
        convs.append((codec.chat_prompt(turn_2(effort), tools=TOOLS, template_kwargs=kw)[0],
                      codec.encode_special(ANSWER_2)))
        convs.append((codec.chat_prompt(turn_2(effort, reasoning=False), tools=TOOLS, template_kwargs=kw)[0],
                      codec.encode_special(FORGOT)))
    model = tmp / "harmony-script.gguf"
    built = build(model, convs)
    assert built["flags"], "the script needs the context beyond the last tokens (two turns end alike)"
    cfg = validate(dict(model=str(model), worker=[sys.executable, str(ROOT / "strata_worker.py")],
                        args=["--backend", "cpu", "--ctx", "2048"], port=0, log=str(tmp / "worker.log"),
                        engine_silence_s=120), tmp)
    with running_server(cfg, TextCodec.from_gguf(model)) as (httpd, base):
        yield base, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def extra(message, name):
    """A field the openai client keeps outside its schema (reasoning_content)."""
    return (message.model_extra or {}).get(name)


@pytest.mark.parametrize("effort", ["low", "high"])
def test_openai_client_two_turns(server, effort):
    _, client = server
    r = client.chat.completions.create(model="any", messages=USER, tools=TOOLS, max_tokens=200,
                                       reasoning_effort=effort)
    c = r.choices[0]
    assert extra(c.message, "reasoning_content") == REASONING_1[effort]   # the effort reached the template
    assert c.finish_reason == "tool_calls" and not c.message.content
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS
    r2 = client.chat.completions.create(model="any", messages=turn_2(effort, call.id), tools=TOOLS, max_tokens=200,
                                        reasoning_effort=effort)
    c2 = r2.choices[0]
    assert (c2.message.content, extra(c2.message, "reasoning_content")) == (FINAL, REASONING_2)
    assert c2.finish_reason == "stop" and not c2.message.tool_calls
    # the script tells the renderings apart: without the reasoning the template writes no analysis message
    r3 = client.chat.completions.create(model="any", messages=turn_2(effort, reasoning=False), tools=TOOLS,
                                        max_tokens=200, reasoning_effort=effort)
    assert r3.choices[0].message.content == "My reasoning did not come back."


def test_openai_client_streams_the_same(server):
    _, client = server
    deltas = [ch.choices[0].delta for ch in client.chat.completions.create(
        model="any", messages=USER, tools=TOOLS, max_tokens=200, reasoning_effort="low", stream=True) if ch.choices]
    assert "".join(extra(d, "reasoning_content") or "" for d in deltas) == REASONING_1["low"]
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("get_weather", ARGS)]
    deltas = [ch.choices[0].delta for ch in client.chat.completions.create(
        model="any", messages=turn_2("low"), tools=TOOLS, max_tokens=200, reasoning_effort="low", stream=True)
        if ch.choices]
    assert "".join(d.content or "" for d in deltas) == FINAL
    assert "".join(extra(d, "reasoning_content") or "" for d in deltas) == REASONING_2


def test_anthropic_messages_two_turns(server):
    base, _ = server

    def post(messages, stream=False):
        r = requests.post(base + "/v1/messages", json=dict(
            model="any", max_tokens=200, tools=ANTHROPIC_TOOLS, messages=messages, stream=stream,
            output_config={"effort": "high"}), timeout=120, stream=stream)
        assert r.status_code == 200, r.text
        return r

    b = post(USER).json()
    assert b["stop_reason"] == "tool_use"
    assert [x["type"] for x in b["content"]] == ["thinking", "tool_use"]
    thinking, use = b["content"]
    assert thinking["thinking"] == REASONING_1["high"]
    assert (use["name"], use["input"]) == ("get_weather", ARGS)
    # the assistant turn goes back as the client got it (thinking block included), the result as a tool_result
    history = USER + [{"role": "assistant", "content": b["content"]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                    "content": RESULT}]}]
    b2 = post(history).json()
    assert b2["stop_reason"] == "end_turn"
    assert [(x["type"], x.get("thinking") or x.get("text")) for x in b2["content"]] == \
        [("thinking", REASONING_2), ("text", FINAL)]
    events = [json.loads(line[6:]) for line in post(history, stream=True).iter_lines()
              if line.startswith(b"data: ")]
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    think = "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
    assert (think, text) == (REASONING_2, FINAL)


def test_unknown_effort_is_refused(server):
    base, _ = server
    r = requests.post(base + "/v1/chat/completions", json=dict(messages=USER, reasoning_effort="extreme",
                                                               max_tokens=5), timeout=30)
    assert r.status_code == 400 and "reasoning_effort" in r.json()["error"]["message"]
    r = requests.post(base + "/v1/messages", json=dict(messages=USER, output_config={"effort": 3}, max_tokens=5),
                      timeout=30)
    assert r.status_code == 400 and "output_config.effort" in r.json()["error"]["message"]


