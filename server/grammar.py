"""Constraints a request asks for, as the grammar the worker applies token by token (engine/grammar.py).

- response_format {"type": "json_object"}: any JSON object; {"type": "json_schema", "json_schema": {"schema": ...}}:
  JSON that validates against the schema.
- tool_choice "required" or a named function: the answer is one call in the tags form
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the form of Qwen/Hermes templates and the one
  server/generic_tools.py teaches), its arguments held to the function's parameters schema.

The grammar text goes to the worker as GEN's grammar= value; llguidance checks it here first, so a schema it cannot
use is the client's 400, not a failed request.
"""
from __future__ import annotations

import json


class GrammarRequestError(ValueError):
    """The request's schema or tool choice cannot become a grammar; the message says why (a 400)."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarRequestError("structured output needs the llguidance package on the server: "
                                  "pip install -r requirements.txt") from None
    return llguidance


def _checked(grammar: str, what: str) -> str:
    err = _llguidance().LLMatcher.validate_grammar(grammar)
    if err:
        raise GrammarRequestError(f"{what} cannot be used: {err}")
    return grammar


# Compact JSON (no whitespace between tokens of the syntax): without it a small model fills answers with newlines
# and indentation until max_tokens cuts them.
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def json_schema_grammar(schema: dict, what: str = "the JSON schema") -> str:
    return _checked(_llguidance().LLMatcher.grammar_from_json_schema(json.dumps({**schema, **COMPACT})), what)


def response_format_grammar(rf) -> str | None:
    """The grammar for OpenAI's response_format (None for text or absent)."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise GrammarRequestError("'response_format' must be an object with a 'type'")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarRequestError("'response_format.json_schema' must be an object with a 'schema' object")
        return json_schema_grammar(spec.get("schema") or {"type": "object"}, "response_format.json_schema.schema")
    raise GrammarRequestError(f"'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", "
                              f"got {kind!r}")


def forced_function(tool_choice) -> str | None:
    """The function name a tool_choice names (OpenAI's {"type": "function", "function": {"name"}}), else None."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")
        if isinstance(name, str) and name:
            return name
    return None


def tool_call_grammar(tools: list, tool_choice) -> str | None:
    """The grammar for tool_choice "required" or a named function (None for "auto", "none" or absent)."""
    name = forced_function(tool_choice)
    if tool_choice != "required" and name is None:
        return None
    if not tools:
        raise GrammarRequestError("'tool_choice' asks for a tool call but the request has no 'tools'")
    funcs = [t.get("function", t) for t in tools if isinstance(t, dict)]
    if name is not None:
        funcs = [f for f in funcs if f.get("name") == name]
        if not funcs:
            known = ", ".join(str(t.get("function", t).get("name")) for t in tools if isinstance(t, dict))
            raise GrammarRequestError(f"'tool_choice' names the function {name!r}, which is not among the tools "
                                      f"({known})")
    calls = [{"type": "object", "properties": {"name": {"const": f.get("name")},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in funcs]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), **COMPACT}
    lark = 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(schema)
    return _checked(lark, "the tools' parameter schemas")
