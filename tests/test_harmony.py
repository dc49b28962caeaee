"""Harmony pieces on the server's side, without a worker: channels as the model writes them, the turn that goes back
into gpt-oss's real template, and the reasoning effort."""
import json

import pytest

from server.chat import render_chat
from server.effort import effort_kwargs
from server.harmony import template_messages
from server.reasoning import ReasoningSplitter
from server.schema import ApiError
from server.tool_calls import HARMONY, ToolCallParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def template(fixtures_dir):
    return (fixtures_dir / "templates" / "openai-gpt-oss-120b.jinja").read_text()


def split(template, text, pieces=1):
    """(reasoning, content, calls) of an answer fed in pieces of `pieces` characters."""
    sp, tp = ReasoningSplitter(template), ToolCallParser(HARMONY, TOOLS)
    r, c = [], []
    for i in range(0, len(text), pieces):
        a, b = sp.feed(text[i:i + pieces])
        r.append(a)
        c.append(b)
    a, b = sp.flush()
    r.append(a)
    c.append(b)
    content, calls = tp.feed("".join(c))
    rest, more = tp.flush()
    return "".join(r), content + rest, [(k.name, json.loads(k.arguments)) for k in calls + more]


@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_channels_as_the_model_writes_them(template, pieces):
    # analysis, a preamble on commentary, a call with the recipient in the channel header
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            "<|message|>{\"city\": \"Oslo\"}")
    assert split(template, text, pieces) == ("Need the weather.", "Checking.", [("get_weather", {"city": "Oslo"})])
    # the recipient in the role header instead
    text = ("<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant to=functions.get_weather"
            "<|channel|>commentary json<|message|>{\"city\": \"Rome\"}")
    assert split(template, text, pieces) == ("Need it.", "", [("get_weather", {"city": "Rome"})])
    # reasoning, then the final channel
    text = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    assert split(template, text, pieces) == ("Easy.", "It is 4.", [])
    # gpt-oss-20b's stray commentary header before the real one
    text = ("<|channel|>commentary to=assistant<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant"
            "<|channel|>commentary<|channel|>final<|message|>It is 4.")
    assert split(template, text, pieces) == ("Easy.", "It is 4.", [])


def test_a_called_turn_goes_back_with_its_reasoning_and_without_its_preamble(template):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the weather.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    with pytest.raises(Exception, match="both content and thinking"):
        render_chat(template, msgs, tools=TOOLS)          # the template alone refuses the turn as the API gave it
    text = render_chat(template, template_messages(msgs), tools=TOOLS)
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\"}"
            "<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"rain\"<|end|>"
            "<|start|>assistant") in text
    assert msgs[1]["content"] == "Checking."              # the caller's messages are left as they were
    plain = [{"role": "assistant", "content": "Hi.", "reasoning_content": "r"}]
    assert template_messages(plain) == plain              # no call: the template drops the reasoning itself


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_the_effort_reaches_the_system_message(template, effort):
    for body, anthropic in (({"reasoning_effort": effort}, False), ({"output_config": {"effort": effort}}, True),
                            ({"reasoning_effort": effort}, True)):
        kw = effort_kwargs(body, anthropic)
        assert f"Reasoning: {effort}\n" in render_chat(template, [{"role": "user", "content": "hi"}], **kw)
    assert effort_kwargs({}) == {} and effort_kwargs({"output_config": {}}, True) == {}


@pytest.mark.parametrize("body,anthropic,param", [({"reasoning_effort": "max"}, False, "reasoning_effort"),
                                                   ({"reasoning_effort": 2}, False, "reasoning_effort"),
                                                   ({"output_config": {"effort": "x"}}, True, "output_config.effort"),
                                                   ({"output_config": "high"}, True, "output_config")])
def test_an_unknown_effort_is_a_400_that_names_the_field(body, anthropic, param):
    with pytest.raises(ApiError) as e:
        effort_kwargs(body, anthropic)
    assert e.value.status == 400 and param in e.value.message
