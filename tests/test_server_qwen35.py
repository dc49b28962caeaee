"""A chat with Qwen3.5's own template through the official openai client: thinking apart from the answer, tool calls
in Qwen3.5's XML, and the next turn's history rendered back as the template wants it.

The server runs the real template, tokenizer (the tiny vocabulary) and text layer over the fake worker answering a
script (--replies): the model's side is what a Qwen3.5 writes after its generation prompt `<|im_start|>assistant\\n
<think>\\n`, so the answer starts inside the thought.
"""
import json
import re

import pytest

from fakes.server_kit import make_config, running_server, tiny_codec

openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install -r requirements-test.txt")

TEMPLATE = "Qwen3.5-4B.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
# Turn 1: a thought, a sentence, then a call; turn 2 (after the tool's answer): a thought and the answer;
# turn 3 (thinking off, so the generation prompt closed the thought): the answer only.
CALL = ("The user wants Paris, two days.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
ANSWER = "It said sunny.\n</think>\n\nSunny in Paris for both days."
PLAIN = "Bonjour!"


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory, fixtures_dir):
    codec = tiny_codec(fixtures_dir, TEMPLATE)
    tmp = tmp_path_factory.mktemp("qwen35")
    replies = tmp / "replies.json"
    replies.write_text(json.dumps([codec.encode_special(t) for t in (CALL, CALL, ANSWER, PLAIN)]))
    cfg = make_config(tmp, fixtures_dir / "vocab" / "tiny-bpe-1024.gguf", ["--ctx", "4096", "--replies", str(replies)],
                      engine_silence_s=30.0)
    with running_server(cfg, codec) as (httpd, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield client, codec, tmp / "worker.log"


def prompts_sent(log_path):
    return [[int(t) for t in m.group(1).split(",")] for m in re.finditer(r"prompt=([\d,]+)", log_path.read_text())]


def test_thinking_content_and_tool_calls_apart_then_the_next_turn(qwen35):
    client, codec, log_path = qwen35
    # 1: non-streaming, the call
    r = client.chat.completions.create(model="any", messages=QUESTION, tools=TOOLS, max_tokens=500)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "The user wants Paris, two days."
    assert msg.content == "Let me check." and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2})]
    first = codec.tok.decode(prompts_sent(log_path)[-1], special=True)
    assert first.startswith("<|im_start|>system\n# Tools\n") and '"name": "get_weather"' in first
    assert first.endswith("<|im_start|>user\nWhat is the weather in Paris for two days?<|im_end|>\n"
                          "<|im_start|>assistant\n<think>\n")

    # 2: streaming, the same request: the thought, the content and the call arrive in their own deltas
    reasoning, content, calls = "", "", {}
    for chunk in client.chat.completions.create(model="any", messages=QUESTION, tools=TOOLS, max_tokens=500,
                                                stream=True):
        d = chunk.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
    assert reasoning == msg.model_extra["reasoning_content"] and content.strip() == "Let me check."
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("get_weather", {"city": "Paris", "days": 2})]

    # 3: the tool's answer goes back; the template renders the thought and the call of this turn again
    history = QUESTION + [msg.model_dump(exclude_none=True)] + \
        [{"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="any", messages=history, tools=TOOLS, max_tokens=500)
    m2 = r.choices[0].message
    assert m2.model_extra["reasoning_content"] == "It said sunny."
    assert m2.content == "Sunny in Paris for both days." and not m2.tool_calls and r.choices[0].finish_reason == "stop"
    second = codec.tok.decode(prompts_sent(log_path)[-1], special=True)
    assert second.endswith(
        "<|im_start|>assistant\n<think>\nThe user wants Paris, two days.\n</think>\n\nLet me check.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert second.startswith(first[:first.index("<|im_start|>assistant\n<think>\n")])   # the cached prefix holds

    # 4: a new question with thinking off: the earlier turns lose their thoughts, the answer is all content
    history += [m2.model_dump(exclude_none=True), {"role": "user", "content": "Thanks! Say hello in French."}]
    r = client.chat.completions.create(model="any", messages=history, max_tokens=500,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m3 = r.choices[0].message
    assert m3.content == "Bonjour!" and not (m3.model_extra or {}).get("reasoning_content")
    third = codec.tok.decode(prompts_sent(log_path)[-1], special=True)
    assert "<think>" not in third[:third.rindex("<|im_start|>assistant\n")]
    assert third.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def real_qwen35(tmp_path_factory, fixtures_dir):
    """The real worker (CPU) on a tiny random qwen35moe model carrying Qwen3.5's template."""
    import sys
    from fakes.server_kit import ROOT
    from server.config import validate
    from server.text import TextCodec
    from tools import make_moe
    tmp = tmp_path_factory.mktemp("qwen35-real")
    model = tmp / "tiny-qwen35moe.gguf"
    assert make_moe.main(["--preset", "tiny-qwen35moe", "--out", str(model), "--chat-template",
                          str(fixtures_dir / "templates" / TEMPLATE)]) == 0
    cfg = validate(dict(model=str(model), worker=[sys.executable, str(ROOT / "strata_worker.py")],
                        args=["--backend", "cpu", "--ctx", "512"], port=0, log=str(tmp / "worker.log"),
                        engine_silence_s=120), tmp)
    with running_server(cfg, TextCodec.from_gguf(model)) as (httpd, base):
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_real_hybrid_worker_resumes_the_next_turn_from_a_checkpoint(real_qwen35):
    from engine.checkpoints import CHECKPOINT_TAIL
    client = real_qwen35
    r1 = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=6)
    m1 = r1.choices[0].message
    # a random model never closes the thought its generation prompt opened: everything is reasoning
    assert r1.choices[0].finish_reason == "length" and r1.usage.completion_tokens == 6 and not m1.content
    assert isinstance(m1.model_extra.get("reasoning_content", ""), str)
    # The next turn drops that thought from the history, so it differs from the last prompt a few tokens before
    # that prompt's end: the worker resumes from its checkpoint CHECKPOINT_TAIL tokens before it.
    turn2 = QUESTION + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And in Rome?"}]
    r2 = client.chat.completions.create(model="any", messages=turn2, max_tokens=6)
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens - CHECKPOINT_TAIL
    # the same turn again: the same answer, from the checkpoint near the end of its prompt
    r3 = client.chat.completions.create(model="any", messages=turn2, max_tokens=6)
    assert r3.usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens - CHECKPOINT_TAIL
    thought = r2.choices[0].message.model_extra.get("reasoning_content")
    assert thought and r3.choices[0].message.model_extra.get("reasoning_content") == thought
