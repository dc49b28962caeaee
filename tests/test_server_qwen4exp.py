"""qwen4exp's text side through the server (issue 29 item 5): the tokenizer and chat template taken from the tiny
qwen4exp GGUF (tests/fixtures/qwen4exp/: Qwen3.5's template and pre-tokenizer, as the published model carries
them), reasoning and tool calls split as for Qwen3.5, over two turns, through the openai client and through
Anthropic's /v1/messages.

The model's side is a script (tests/fake_worker.py --replies): what a Qwen3.5-style model writes after its
generation prompt `<|im_start|>assistant\\n<think>\\n`, so each answer starts inside the thought. The prompts the
server sends are read back from the worker's log and checked against the template's own rendering.
"""
import json
import re
from pathlib import Path

import pytest
import requests

from fakes.server_kit import make_config, running_server, sse_events

openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install -r requirements-test.txt")

MODEL = Path(__file__).resolve().parent / "fixtures" / "qwen4exp" / "tiny-qwen4exp-f16.gguf"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
CALL = ("The user wants Paris, two days.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
ANSWER = "It said sunny.\n</think>\n\nSunny in Paris for both days."
# turn 1 (non-streaming), turn 1 again (streaming), turn 2: the same for the openai client and for Anthropic's API
SCRIPT = (CALL, CALL, ANSWER)


@pytest.fixture(scope="module")
def codec():
    from server.text import TextCodec
    return TextCodec.from_gguf(MODEL)


@pytest.fixture()
def served(tmp_path, codec):
    replies = tmp_path / "replies.json"
    replies.write_text(json.dumps([codec.encode_special(t) for t in SCRIPT]))
    cfg = make_config(tmp_path, MODEL, ["--ctx", "4096", "--replies", str(replies)], engine_silence_s=30.0)
    with running_server(cfg, codec) as (httpd, base):
        yield base, tmp_path / "worker.log"


def prompts_sent(codec, log_path) -> list[str]:
    return [codec.tok.decode([int(t) for t in m.group(1).split(",")], special=True)
            for m in re.finditer(r"prompt=([\d,]+)", log_path.read_text())]


def test_the_gguf_carries_qwen35s_text_side(codec, fixtures_dir):
    assert codec.tok.pre == "qwen35"
    assert codec.template == (fixtures_dir / "templates" / "Qwen3.5-4B.jinja").read_text()
    assert codec.tok.token_text(codec.tok.eos_id) == "<|im_end|>"


def test_tokenizer_equals_llama_cpp_on_the_gguf():
    """engine/tokenizer.py on the tiny GGUF's own metadata (pre qwen35) against llama_tokenize on the same file
    (tokenizer/llama-cpp.json, made by python -m tools.tokenizer_reference --vocab <it> --pre qwen35)."""
    import hashlib
    from engine.tokenizer import Tokenizer
    ref = json.loads((MODEL.parent / "tokenizer" / "llama-cpp.json").read_text(encoding="utf-8"))
    assert ref["vocab_sha256"] == hashlib.sha256(MODEL.read_bytes()).hexdigest() and ref["pre"] == "qwen35"
    tok = Tokenizer.from_gguf(MODEL)
    for case in ref["cases"]:
        assert tok.encode(case["text"], add_special=False) == case["ids"], case["text"]
        assert tok.encode(case["text"], add_special=False, parse_special=True) == case["ids_parse_special"]


def test_openai_client_two_turns_reasoning_tool_call_answer(served, codec):
    base, log = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="any", messages=QUESTION, tools=TOOLS, max_tokens=500)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "The user wants Paris, two days."
    assert msg.content == "Let me check." and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2})]
    first = prompts_sent(codec, log)[-1]
    assert first.startswith("<|im_start|>system\n# Tools\n") and '"name": "get_weather"' in first
    assert first.endswith("<|im_start|>user\nWhat is the weather in Paris for two days?<|im_end|>\n"
                          "<|im_start|>assistant\n<think>\n")

    reasoning, content, calls = "", "", {}
    for chunk in client.chat.completions.create(model="any", messages=QUESTION, tools=TOOLS, max_tokens=500,
                                                stream=True):
        d = chunk.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
    assert reasoning == "The user wants Paris, two days." and content.strip() == "Let me check."
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("get_weather", {"city": "Paris", "days": 2})]

    history = QUESTION + [msg.model_dump(exclude_none=True)] + \
        [{"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="any", messages=history, tools=TOOLS, max_tokens=500)
    m2 = r.choices[0].message
    assert m2.model_extra["reasoning_content"] == "It said sunny."
    assert m2.content == "Sunny in Paris for both days." and not m2.tool_calls and r.choices[0].finish_reason == "stop"
    second = prompts_sent(codec, log)[-1]
    assert second.endswith(
        "<|im_start|>assistant\n<think>\nThe user wants Paris, two days.\n</think>\n\nLet me check.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert second.startswith(first[:first.index("<|im_start|>assistant\n<think>\n")])


def _post(base, **body):
    r = requests.post(base + "/v1/messages", json={"model": "any", "max_tokens": 500, **body},
                      headers={"anthropic-version": "2023-06-01", "x-api-key": "unused"}, timeout=60,
                      stream=bool(body.get("stream")))
    assert r.status_code == 200, r.text
    return r


def test_anthropic_messages_two_turns_thinking_tool_use_answer(served, codec):
    base, log = served
    thinking = {"type": "enabled", "budget_tokens": 400}
    b = _post(base, messages=QUESTION, tools=ANTHROPIC_TOOLS, thinking=thinking).json()
    assert b["stop_reason"] == "tool_use"
    kinds = [x["type"] for x in b["content"]]
    assert kinds == ["thinking", "text", "tool_use"], kinds
    assert b["content"][0]["thinking"] == "The user wants Paris, two days."
    assert b["content"][1]["text"] == "Let me check."
    use = b["content"][2]
    assert (use["name"], use["input"]) == ("get_weather", {"city": "Paris", "days": 2})

    evs = list(sse_events(_post(base, messages=QUESTION, tools=ANTHROPIC_TOOLS, thinking=thinking, stream=True)))
    think = "".join(e["delta"]["thinking"] for e in evs
                    if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta")
    args = "".join(e["delta"]["partial_json"] for e in evs
                   if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    assert think == "The user wants Paris, two days." and json.loads(args) == {"city": "Paris", "days": 2}
    assert [e["delta"]["stop_reason"] for e in evs if e["type"] == "message_delta"] == ["tool_use"]

    history = QUESTION + [{"role": "assistant", "content": b["content"]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                        "content": "sunny, 21 C"}]}]
    b2 = _post(base, messages=history, tools=ANTHROPIC_TOOLS, thinking=thinking).json()
    assert b2["stop_reason"] == "end_turn"
    assert [(x["type"], x.get("thinking", x.get("text"))) for x in b2["content"]] == \
        [("thinking", "It said sunny."), ("text", "Sunny in Paris for both days.")]
    second = prompts_sent(codec, log)[-1]
    assert second.endswith(
        "<|im_start|>assistant\n<think>\nThe user wants Paris, two days.\n</think>\n\nLet me check.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")
