"""Chat templates: every fixture template renders a full conversation; Qwen3 and SmolLM3 to hand-written strings."""
import json
import logging

import pytest

from server.chat import ChatTemplateError, render_chat

CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "Simple arithmetic."},
    {"role": "user", "content": "And the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call12345", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "{\"temp_c\": 21}"},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

TEMPLATES = ["HuggingFaceTB-SmolLM3-3B", "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "Qwen3-Coder", "Qwen3.5-4B",
             "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "meta-llama-Llama-3.1-8B-Instruct",
             "mistralai-Mistral-Nemo-Instruct-2407", "openai-gpt-oss-120b"]


def _template(fixtures_dir, name):
    return (fixtures_dir / "templates" / f"{name}.jinja").read_text()


def test_every_fixture_template_is_covered(fixtures_dir):
    assert sorted(p.stem for p in (fixtures_dir / "templates").glob("*.jinja")) == sorted(TEMPLATES)


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_template_renders_the_conversation(fixtures_dir, name, tools):
    text = render_chat(_template(fixtures_dir, name), CONVERSATION, bos_token="<s>", eos_token="</s>", tools=tools)
    for needle in ("What is 2+2?", "And the weather in Paris?", "4."):
        assert needle in text
    if name != "HuggingFaceTB-SmolLM3-3B":   # SmolLM3's template drops tool calls; the others must show the call
        assert "get_weather" in text and "Paris" in text
    assert "21" in text


QWEN3_EXPECTED = (
    "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n4.<|im_end|>\n"                 # reasoning of turns before the last query is dropped
    "<|im_start|>user\nAnd the weather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n{\"temp_c\": 21}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_qwen3_exact(fixtures_dir):
    tpl = _template(fixtures_dir, "Qwen-Qwen3-0.6B")
    assert render_chat(tpl, CONVERSATION) == QWEN3_EXPECTED
    assert render_chat(tpl, CONVERSATION, enable_thinking=False) == QWEN3_EXPECTED + "<think>\n\n</think>\n\n"
    # the reasoning of an answer after the last user turn is kept, inside <think>
    assert render_chat(tpl, CONVERSATION[1:3], add_generation_prompt=False) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nSimple arithmetic.\n</think>\n\n4.<|im_end|>\n")


def _smollm3(reasoning_mode, assistant_prefix, gen_suffix):
    return (
        "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\n"
        f"Reasoning Mode: {reasoning_mode}\n\n## Custom Instructions\n\nYou are a concise assistant.\n\n<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        f"<|im_start|>assistant\n{assistant_prefix}4.<|im_end|>\n"
        "<|im_start|>user\nAnd the weather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n{assistant_prefix}<|im_end|>\n"
        "<|im_start|>user\n{\"temp_c\": 21}<|im_end|>\n"
        f"<|im_start|>assistant\n{gen_suffix}"
    )


def test_smollm3_exact(fixtures_dir):
    tpl = _template(fixtures_dir, "HuggingFaceTB-SmolLM3-3B")
    assert render_chat(tpl, CONVERSATION) == _smollm3("/think", "", "")
    assert render_chat(tpl, CONVERSATION, enable_thinking=False) == \
        _smollm3("/no_think", "<think>\n\n</think>\n", "<think>\n\n</think>\n")


def test_smollm2_own_template_reproduces_reference_text(fixtures_dir):
    from engine.default_model import DefaultModelError, default_model_path
    from engine.tokenizer import Tokenizer
    try:
        path = default_model_path()
    except DefaultModelError as e:
        pytest.skip(f"default model unavailable (no network?): {e}")
    template = Tokenizer.from_gguf(path).chat_template
    ref = json.loads((fixtures_dir / "reference" / "smollm2-135m-chat.json").read_text())
    for case in ref["cases"]:
        assert render_chat(template, case["messages"]) == case["text"]


def test_no_template_is_chatml_with_a_note(caplog):
    with caplog.at_level(logging.WARNING, logger="strata.chat"):
        text = render_chat(None, [{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert "ChatML" in caplog.text


def test_template_exception_names_its_message(fixtures_dir):
    tpl = _template(fixtures_dir, "mistralai-Mistral-Nemo-Instruct-2407")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(tpl, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat("{% for %}", [])


def test_helpers_and_sandbox():
    tpl = ("{{ strftime_now('%Y') | length }} {{ {'é': [1, 2]} | tojson }} "
           "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}"
           "{{ i }}{% endfor %} {% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}")
    assert render_chat(tpl, []) == '4 {"é": [1, 2]} 02 2'
    with pytest.raises(ChatTemplateError):   # the sandbox keeps templates away from Python internals
        render_chat("{{ messages.__class__.__mro__ }}", [])
    with pytest.raises(ChatTemplateError):   # and immutable: no appending to the caller's lists
        render_chat("{{ messages.append(1) }}", [])
