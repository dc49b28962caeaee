"""Constraints a request asks for, as the grammar the worker applies token by token (engine/grammar.py).

- response_format {"type": "json_object"}: any JSON object; {"type": "json_schema", "json_schema": {"schema": ...}}:
  JSON that validates against the schema; with "strict": true, against its closed form (below).
- tool_choice "required" or a named function: the answer is one call in the tags form
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the form of Qwen/Hermes templates and the one
  server/generic_tools.py teaches), its arguments held to the closed form of the function's parameters schema.

The closed form (closed_schema) is what OpenAI's strict mode and llama.cpp's tool grammars give: an object that lists
its properties takes no others unless it says so. JSON Schema's own default lets any other property in, and a small
model fills that room (`{"city": "Paris", "type": "string", ...}` until max_tokens).

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


# Keys whose value is one schema, a list of schemas, or a map of names to schemas (JSON Schema 2020-12 and draft 7);
# every other key's value is data (enum, const, default, ...) or a keyword's argument, left as it is.
_ONE = ("items", "additionalItems", "unevaluatedItems", "contains", "not", "if", "then", "else", "propertyNames",
        "additionalProperties")
_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")   # "says otherwise"


def closed_schema(schema: dict) -> dict:
    """A copy of schema in which every object schema that lists its properties and says nothing of others (no
    additionalProperties, patternProperties or unevaluatedProperties) has "additionalProperties": false.

    An object that lists no properties stays free-form, as in llama.cpp (closing it would allow only {}). allOf
    branches are not closed one by one (each would refuse the others' properties); their parent is, over the
    properties all its branches name (local $refs followed), and a $defs entry that an allOf branch names stays
    open for the same reason."""
    in_all_of = set()

    def note_refs(node):
        if isinstance(node, dict):
            for b in node.get("allOf") or []:
                if isinstance(b, dict) and isinstance(b.get("$ref"), str):
                    in_all_of.add(b["$ref"])
            for v in node.values():
                note_refs(v)
        elif isinstance(node, list):
            for v in node:
                note_refs(v)

    def resolve(node, seen=()):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if isinstance(ref, str) and ref.startswith("#/") and ref not in seen:
            target = schema
            for part in ref[2:].split("/"):
                target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
            return resolve(target, (*seen, ref)) if isinstance(target, dict) else node
        return node

    def names(node, depth=0) -> set:
        node = resolve(node)
        if not isinstance(node, dict) or depth > 32:
            return set()
        out = set(node.get("properties") or {}) if isinstance(node.get("properties"), dict) else set()
        for b in node.get("allOf") or []:
            out |= names(b, depth + 1)
        return out

    def close(node, ref_path=None, branch=False):
        if isinstance(node, list):
            return [close(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for k, v in node.items():
            if k in _MAP and isinstance(v, dict):
                top = k in ("$defs", "definitions") and node is schema
                out[k] = {n: close(s, f"#/{k}/{n}" if top else None) for n, s in v.items()}
            elif k == "allOf" and isinstance(v, list):
                out[k] = [close(b, branch=True) for b in v]
            elif k in _ONE or k in _LIST:
                out[k] = close(v)
            else:
                out[k] = v
        if branch or ref_path in in_all_of or any(k in out for k in _OPENERS):
            return out
        if isinstance(out.get("allOf"), list):
            listed = set().union(*(names(b) for b in out["allOf"]))
            if listed:
                out["properties"] = {**{n: {} for n in sorted(listed)}, **(out.get("properties") or {})}
        if isinstance(out.get("properties"), dict):
            out["additionalProperties"] = False
        return out

    note_refs(schema)
    return close(schema)


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
        strict = spec.get("strict", False)
        if strict is not None and not isinstance(strict, bool):
            raise GrammarRequestError("'response_format.json_schema.strict' must be true or false")
        schema = spec.get("schema") or {"type": "object"}
        return json_schema_grammar(closed_schema(schema) if strict else schema, "response_format.json_schema.schema")
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


def _parameters(f: dict) -> dict:
    params = f.get("parameters")
    if params is None:
        return {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise GrammarRequestError(f"the function {f.get('name')!r} has 'parameters' that are not a JSON schema object")
    return params


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
    # A function without parameters takes none (OpenAI: "omitting parameters defines a function with an empty
    # parameter list"): its arguments are {}.
    calls = [{"type": "object", "properties": {"name": {"const": f.get("name")},
                                               "arguments": closed_schema(_parameters(f))},
              "required": ["name", "arguments"], "additionalProperties": False} for f in funcs]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), **COMPACT}
    lark = 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(schema)
    return _checked(lark, "the tools' parameter schemas")
