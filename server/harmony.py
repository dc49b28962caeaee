"""gpt-oss (harmony) conversations in the shape its chat template takes them back.

An assistant turn that called a tool comes back with its reasoning (rendered as the analysis message before the
call) and possibly the preamble it wrote on the commentary channel as content; the template refuses both at once
("Cannot pass both content and thinking"), so, as llama.cpp's gpt-oss handler does, such a turn keeps its reasoning
and drops the content.
"""
from __future__ import annotations


def template_messages(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls") and isinstance(m.get("reasoning_content"), str) \
                and m.get("content"):
            m = dict(m, content="")
        out.append(m)
    return out
