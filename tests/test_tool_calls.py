"""The tool-call parser: each template's format, cut at every point of the text; malformed calls stay content."""
import json

import pytest

from server.reasoning import ReasoningSplitter
from server.tool_calls import HARMONY, LLAMA3, MISTRAL, TAGS, ToolCallParser, format_for_template

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}}}}}]


def take(out, content, calls):
    """One (content, calls) answer of ToolCallParser.feed/flush added to the running lists."""
    c, k = out
    content.append(c)
    calls += k


def run(fmt, pieces, tools=WEATHER):
    p = ToolCallParser(fmt, tools)
    content, calls = [], []
    for piece in pieces:
        take(p.feed(piece), content, calls)
    take(p.flush(), content, calls)
    return "".join(content), [(k.name, json.loads(k.arguments)) for k in calls]


def every_cut(fmt, text, tools=WEATHER):
    """The answer in two pieces at every cut point, and one character at a time: all must agree."""
    whole = run(fmt, [text], tools)
    for i in range(len(text) + 1):
        assert run(fmt, [text[:i], text[i:]], tools) == whole, f"cut at {i}: {text[:i]!r} | {text[i:]!r}"
    assert run(fmt, list(text), tools) == whole
    return whole


def test_formats_chosen_from_the_templates(fixtures_dir):
    t = fixtures_dir / "templates"
    assert format_for_template((t / "Qwen-Qwen3-0.6B.jinja").read_text()) is TAGS
    assert format_for_template((t / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()) is TAGS
    assert format_for_template((t / "Qwen3-Coder.jinja").read_text()) is TAGS
    assert format_for_template((t / "Qwen3.5-4B.jinja").read_text()) is TAGS
    assert format_for_template((t / "openai-gpt-oss-120b.jinja").read_text()) is HARMONY
    assert format_for_template((t / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()) is LLAMA3
    assert format_for_template((t / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()) is MISTRAL
    assert format_for_template(None) is None
    assert format_for_template("{{ messages[0]['content'] }}") is None


def test_qwen_json_calls_between_text():
    text = ('Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>')
    content, calls = every_cut(TAGS, text)
    assert content == "Let me look."
    assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})]


def test_qwen_xml_call_typed_by_the_schema():
    text = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
            "<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>")
    content, calls = every_cut(TAGS, text)
    assert content == "I will check."
    # a string stays a string even when it looks like a number; unknown parameters stay strings
    assert calls == [("get_weather", {"city": "New York", "days": 3, "metric": True, "note": "line one\nline two"})]
    _, calls = run(TAGS, ["<tool_call><function=get_weather><parameter=city>42</parameter></function></tool_call>"])
    assert calls == [("get_weather", {"city": "42"})]


def test_harmony_call_after_the_splitter():
    # What server/reasoning.py leaves of `<|start|>assistant<|channel|>commentary to=functions.get_weather ...`;
    # <|call|> ends generation, so the call may also just end with the answer.
    for text in ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>',
                 ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}',
                 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'):
        content, calls = every_cut(HARMONY, text)
        assert (content, calls) == ("", [("get_weather", {"city": "Oslo"})]), text


def test_llama3_whole_answer_and_python_tag():
    text = ' {"name": "get_weather", "parameters": {"city": "Lima"}}'
    assert every_cut(LLAMA3, text) == ("", [("get_weather", {"city": "Lima"})])
    text = 'Calling it now <|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}'
    assert every_cut(LLAMA3, text) == ("Calling it now", [("get_weather", {"city": "Lima"})])


def test_mistral_with_and_without_the_marker():
    body = '[{"name": "get_weather", "arguments": {"city": "Bern"}}, {"name": "get_weather", "arguments": {"city": "Graz"}}]'
    want = [("get_weather", {"city": "Bern"}), ("get_weather", {"city": "Graz"})]
    assert every_cut(MISTRAL, "[TOOL_CALLS]" + body) == ("", want)
    assert every_cut(MISTRAL, body) == ("", want)     # [TOOL_CALLS] is a control token: it may decode to nothing


@pytest.mark.parametrize("fmt,text", [
    (TAGS, "The capital of France is Paris."),
    (TAGS, "Use <tool_call> tags like <this>."),                         # never closed: stays content
    (TAGS, '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'),     # broken JSON
    (TAGS, "<tool_call><function=get_weather>no parameters tag</function></tool_call>"),
    (HARMONY, "to=functions.get_weather but no message follows"),
    (HARMONY, 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": '),   # cut short
    (LLAMA3, ' \n{"not": "a call"}'),
    (LLAMA3, "{ a brace, then prose }"),
    (MISTRAL, "[1, 2, 3] are numbers"),
    (MISTRAL, "Plain text with a [ bracket\n\n"),
])
def test_text_that_is_not_a_call_stays_content_unchanged(fmt, text):
    content, calls = every_cut(fmt, text)
    assert calls == [] and content == text


def test_text_around_a_broken_call_is_kept_in_order():
    text = "before <tool_call>{oops}</tool_call> after"
    assert every_cut(TAGS, text) == (text, [])


def test_ids_are_unique_and_arguments_json_text():
    p = ToolCallParser(TAGS)
    _, calls = p.feed('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>')
    assert [c.name for c in calls] == ["a", "b"] and [c.arguments for c in calls] == ["{}", "{}"]
    assert calls[0].id != calls[1].id and all(c.id.startswith("call_") for c in calls)


def through_the_splitter(template, prompt, text, cut):
    """The server's order: the thinking split first, then the calls in what it leaves as content."""
    splitter = ReasoningSplitter.for_prompt(template, prompt)
    parser = ToolCallParser(format_for_template(template), WEATHER)
    reasoning, content, calls = [], [], []
    for piece in (text[:cut], text[cut:]):
        r, c = splitter.feed(piece)
        reasoning.append(r)
        take(parser.feed(c), content, calls)
    r, c = splitter.flush()
    reasoning.append(r)
    take(parser.feed(c), content, calls)
    take(parser.flush(), content, calls)
    return "".join(reasoning), "".join(content), [(k.name, json.loads(k.arguments)) for k in calls]


def test_gpt_oss_call_after_its_analysis(fixtures_dir):
    template = (fixtures_dir / "templates" / "openai-gpt-oss-120b.jinja").read_text()
    for text in ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
                 'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}',
                 '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather'
                 '<|channel|>commentary json<|message|>{"city": "Oslo"}'):
        for cut in range(len(text) + 1):
            got = through_the_splitter(template, "<|start|>assistant", text, cut)
            assert got == ("Need the weather.", "", [("get_weather", {"city": "Oslo"})]), (text, cut)


def test_qwen35_call_after_its_thought(fixtures_dir):
    template = (fixtures_dir / "templates" / "Qwen3.5-4B.jinja").read_text()
    text = ("I should call it.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n</function>\n</tool_call>")
    for cut in range(len(text) + 1):
        got = through_the_splitter(template, "<|im_start|>assistant\n<think>\n", text, cut)
        assert got == ("I should call it.", "", [("get_weather", {"city": "Paris"})]), cut


@pytest.mark.parametrize("template_file,answer", [
    ("Qwen-Qwen3-0.6B.jinja", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("Qwen3-Coder.jinja", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                          "</tool_call>"),
    ("Qwen3.5-4B.jinja", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                         "</tool_call>"),
    ("openai-gpt-oss-120b.jinja", 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
])
def test_a_parsed_call_goes_back_through_its_template(fixtures_dir, template_file, answer):
    """The next turn of an agent: the call as the API returned it, then the tool's answer. The template must take
    it (Mistral's refuses ids that are not 9 letters and digits) and write the call as the model wrote it."""
    from server.chat import render_chat
    template = (fixtures_dir / "templates" / template_file).read_text()
    parser = ToolCallParser(format_for_template(template), WEATHER)
    _, calls = parser.feed(answer)
    calls += parser.flush()[1]
    assert [c.name for c in calls] == ["get_weather"]
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                   for c in calls]},
               {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
    text = render_chat(template, history, tools=WEATHER)
    assert "get_weather" in text and "Paris" in text and "sunny" in text
