"""Tools for a model whose chat template has no tool-calling format (SmolLM2, many small models).

A request's tools are never dropped. When the template teaches no format server/tool_calls.py knows, the tools go
into the system message in words, with one generic way of calling them (the tags format: `<tool_call>` + a JSON
object + `</tool_call>`, which the tags parser reads back); earlier calls and tool results in the conversation are
written in the same form. llama.cpp's server does the same for templates without tool support.
"""
from __future__ import annotations

import json

INSTRUCTIONS = (
    "You can call functions (tools). Their JSON schemas:\n{tools}\n\n"
    "To call a function, answer with a JSON object of the function's name and arguments inside tags, and nothing "
    "else:\n<tool_call>\n{{\"name\": \"<function name>\", \"arguments\": {{<arguments as JSON>}}}}\n</tool_call>\n"
    "{choice}"
    "A function's result comes back in a message inside <tool_response></tool_response> tags."
)
CHOICE = {
    "auto": "Call a function when it helps to answer; otherwise answer in plain text.\n",
    "required": "You must call one of the functions now.\n",
}


def tool_choice_line(tool_choice) -> str:
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        if name:
            return f"You must call the function {name} now.\n"
    return CHOICE.get(tool_choice or "auto", CHOICE["auto"])


def system_text(tools: list, tool_choice=None) -> str:
    specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return INSTRUCTIONS.format(tools=specs, choice=tool_choice_line(tool_choice))


def messages_with_tools(messages: list[dict], tools: list, tool_choice=None) -> list[dict]:
    """The conversation for a template that knows no tools: the tools in the system message, assistant tool calls as
    tagged JSON in the assistant's text, tool results as user messages in <tool_response> tags."""
    out: list[dict] = []
    intro = system_text(tools, tool_choice)
    if messages and messages[0].get("role") == "system":
        out.append({"role": "system", "content": f"{messages[0].get('content') or ''}\n\n{intro}".strip()})
        rest = messages[1:]
    else:
        out.append({"role": "system", "content": intro})
        rest = messages
    for m in rest:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                f = c.get("function") or {}
                args = f.get("arguments") or "{}"
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    pass        # shown as the client sent it
                calls.append("<tool_call>\n" + json.dumps({"name": f.get("name"), "arguments": args},
                                                          ensure_ascii=False) + "\n</tool_call>")
            text = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append(m)
    return out
