"""Request bodies checked field by field, with errors in OpenAI's shape naming the field and what it must be."""
from __future__ import annotations

import json


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


_KINDS = {
    "str": ((str,), "a string"), "int": ((int,), "an integer"), "num": ((int, float), "a number"),
    "bool": ((bool,), "true or false"), "list": ((list,), "an array"), "dict": ((dict,), "an object"),
}


def field(body: dict, key: str, kind: str, default=None, nullable=True, lo=None, hi=None, lo_open=False):
    if key not in body or (body[key] is None and nullable):
        return default
    v = body[key]
    types, what = _KINDS[kind]
    if (isinstance(v, bool) and kind != "bool") or not isinstance(v, types):
        raise ApiError(400, f"'{key}' must be {what}, got {type(v).__name__} {json.dumps(v)[:40]}", param=key)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ApiError(400, f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {v}", param=key)
    if hi is not None and v > hi:
        raise ApiError(400, f"'{key}' must be <= {hi}, got {v}", param=key)
    return v


def sampling_params(body: dict, defaults: dict) -> dict:
    p = dict(defaults)
    pairs = [("temperature", "temperature", "num", dict(lo=0)), ("top_p", "top_p", "num", dict(lo=0, hi=1, lo_open=True)),
             ("top_k", "top_k", "int", dict(lo=0)), ("min_p", "min_p", "num", dict(lo=0, hi=1)),
             ("seed", "seed", "int", {}), ("frequency_penalty", "penalty_freq", "num", dict(lo=-2, hi=2)),
             ("presence_penalty", "penalty_present", "num", dict(lo=-2, hi=2)),
             ("repeat_penalty", "penalty_repeat", "num", dict(lo=0, lo_open=True)),
             ("repeat_last_n", "penalty_last_n", "int", dict(lo=-1))]
    for key, gen_key, kind, rng in pairs:
        v = field(body, key, kind, **rng)
        if v is not None:
            p[gen_key] = v
    return p


def stop_list(body: dict, key: str = "stop") -> list[str]:
    v = body.get(key)
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v) and len(v) <= 16:
        return v
    raise ApiError(400, f"'{key}' must be a string or an array of up to 16 strings", param=key)


def max_new_tokens(body: dict, *keys: str) -> int | None:
    for key in keys:
        v = field(body, key, "int", lo=-1)
        if v is not None:
            return None if v in (0, -1) else v      # 0 or -1: the rest of the context
    return None


def text_content(content, where: str) -> str:
    """A message's content: a string, or an array of text parts (other parts are refused: text-only models)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ApiError(400, f"{where}.content[{i}] must be an object with a 'type'", param="messages")
            if part["type"] != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}.content[{i}] has type {part['type']!r}: this server reads text only "
                               "(parts of type 'text' with a string 'text')", param="messages")
            out.append(part["text"])
        return "".join(out)
    raise ApiError(400, f"{where}.content must be a string or an array of text parts", param="messages")


def chat_messages(body: dict) -> list[dict]:
    msgs = field(body, "messages", "list")
    if not msgs:
        raise ApiError(400, "'messages' must be a non-empty array of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role must be one of system, developer, user, assistant, tool; "
                           f"got {json.dumps(role)[:40]}", param="messages")
        msg = dict(m)
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = text_content(m.get("content"), f"messages[{i}]")
        for key in ("reasoning_content", "name", "tool_call_id"):
            if key in m and m[key] is not None and not isinstance(m[key], str):
                raise ApiError(400, f"messages[{i}].{key} must be a string", param="messages")
        out.append(msg)
    return out
