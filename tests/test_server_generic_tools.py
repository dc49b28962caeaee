"""Tools with a chat template that teaches no tool-call format: rendered in words, parsed back (issue 18, item 4)."""
import json

import requests

from fakes.server_kit import make_config, running_server, tiny_codec
from server.generic_tools import messages_with_tools

VOCAB = "vocab/tiny-bpe-1024.gguf"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_tools_reach_the_prompt_and_calls_are_parsed(fixtures_dir):
    codec = tiny_codec(fixtures_dir)
    assert codec.generic_tools            # the tiny ChatML template has no tool markers
    _, text = codec.chat_prompt([{"role": "user", "content": "weather in Paris?"}], tools=TOOLS)
    assert "get_weather" in text and "<tool_call>" in text and '"city"' in text
    _, plain = codec.chat_prompt([{"role": "user", "content": "weather in Paris?"}], tools=TOOLS, tool_choice="none")
    assert "get_weather" not in plain
    parser = codec.tool_parser(TOOLS, "auto")
    assert parser is not None
    content, calls = parser.feed('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                 '\n</tool_call>')
    rest, more = parser.flush()
    calls += more
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert (content + rest).strip() == "Let me check."


def test_history_with_calls_and_results_renders_as_text():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    out = messages_with_tools(msgs, TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert "You must call the function get_weather" in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}


def test_the_server_sends_the_tools_to_the_worker(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB)
    codec = tiny_codec(fixtures_dir)
    with running_server(cfg, codec) as (_, base):
        r = requests.post(base + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 4})
        assert r.status_code == 200, r.text
    gen = [ln for ln in open(cfg.log).read().splitlines() if "fake worker: GEN" in ln][-1]
    ids = [int(t) for t in gen.rsplit("prompt=", 1)[1].split(",")]
    assert "get_weather" in codec.tok.decode(ids)
