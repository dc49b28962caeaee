"""Find the model's tool calls in its streamed answer, so the server can send them as `tool_calls` / `tool_use`.

Each chat template teaches its model one way of writing a call; `format_for_template` picks it from the markers the
template text contains:
- tags (Qwen2.5/Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, and in the same tags
  the XML of Qwen3-Coder/Qwen3.5: `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`.
- harmony (gpt-oss): a commentary-channel message `to=functions.NAME ... <|message|>{json}<|call|>`. This parser sees
  the content after server/reasoning.py dropped the harmony framing, and `<|call|>` is an end-of-generation token
  (never text), so a call may also end with the answer.
- llama3 (Llama 3.1): `{"name": ..., "parameters": {...}}` as the whole answer (after `<|python_tag|>`, a control
  token that decodes to nothing, but is recognised when it does show).
- mistral (Mistral Nemo): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; `[TOOL_CALLS]` is a control token
  too, so a whole answer that is such a JSON array counts as well.

Text arrives in arbitrary pieces; a marker cut across pieces is still recognised, because a tail that could begin
one is held back until the next piece decides it. Text outside calls stays content; a call that does not parse goes
back into the content as the model wrote it (logged), so nothing is lost.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

from server.reasoning import earliest_marker, partial_marker_len

log = logging.getLogger("strata.tools")


@dataclass
class ToolCall:
    name: str
    arguments: str                    # a JSON object, as text (what OpenAI's API sends)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


class ToolCallError(ValueError):
    """The text between the markers is not a call in the expected shape."""


@dataclass(frozen=True)
class Format:
    name: str
    starts: tuple[str, ...]            # markers that open a call anywhere in the answer
    ends: tuple[str, ...]              # markers that close it; none: the call runs to the end of the answer
    whole: str                         # first characters that make the whole answer a candidate call ("" = never)
    parse: Callable[[str, dict], list[ToolCall]]   # (text between the markers, parameter types) -> calls
    id_len: int = 0                    # ids of exactly this many letters and digits (0: "call_<hex>")


# --- the formats' parsers --------------------------------------------------------------------------------------------
def _args_text(args, where: str) -> str:
    if isinstance(args, str):        # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            raise ToolCallError(f"{where}: arguments are a string that is not JSON") from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ToolCallError(f"{where}: arguments are not a JSON object")
    return json.dumps(args, ensure_ascii=False)


def _json_call(obj, args_keys: tuple[str, ...]) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ToolCallError("a call must be a JSON object with a 'name'")
    for k in args_keys:
        if k in obj:
            return ToolCall(obj["name"], _args_text(obj[k], obj["name"]))
    return ToolCall(obj["name"], "{}")


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise ToolCallError(f"not JSON ({e})") from None


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _xml_value(text: str, kind: str | None):
    # The template writes "\n" around each value; a string parameter keeps everything else as written.
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    if kind in (None, "string"):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _leftover(text: str, pattern: re.Pattern) -> str:
    return pattern.sub("", text).strip()


def parse_tags(body: str, types: dict) -> list[ToolCall]:
    """The text between <tool_call> and </tool_call>: Hermes JSON, or Qwen3-Coder's XML."""
    if body.lstrip().startswith("<function="):
        calls = []
        for m in _FUNCTION.finditer(body):
            name, inner = m.group(1).strip(), m.group(2)
            if _leftover(inner, _PARAMETER):
                raise ToolCallError(f"{name}: text outside <parameter=...> tags")
            kinds = types.get(name, {})
            args = {p.group(1).strip(): _xml_value(p.group(2), kinds.get(p.group(1).strip()))
                    for p in _PARAMETER.finditer(inner)}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        if not calls or _leftover(body, _FUNCTION):
            raise ToolCallError("expected <function=NAME>...</function>")
        return calls
    return [_json_call(_loads(body.strip()), ("arguments", "parameters"))]


_HARMONY_NAME = re.compile(r"([\w.\-]+)")


def parse_harmony(body: str, types: dict) -> list[ToolCall]:
    """After `to=functions.`: `NAME<|channel|>commentary json<|message|>{...}` (or `NAME <|constrain|>json...`)."""
    m = _HARMONY_NAME.match(body)
    _, sep, args = body.partition("<|message|>")
    if not m or not sep:
        raise ToolCallError("expected to=functions.NAME ... <|message|>{arguments}")
    return [ToolCall(m.group(1), _args_text(_loads(args.strip()), m.group(1)))]


def _json_calls(body: str, keys: tuple[str, str], allow_empty: bool) -> list[ToolCall]:
    """One JSON call object or a list of them; keys: where the arguments are, in the order the format prefers."""
    obj = _loads(body.strip())
    objs = obj if isinstance(obj, list) else [obj]
    if not objs and not allow_empty:
        raise ToolCallError("an empty list of calls")
    return [_json_call(o, keys) for o in objs]


def parse_llama3(body: str, types: dict) -> list[ToolCall]:
    return _json_calls(body, ("parameters", "arguments"), allow_empty=True)


def parse_mistral(body: str, types: dict) -> list[ToolCall]:
    return _json_calls(body, ("arguments", "parameters"), allow_empty=False)


TAGS = Format("tags", ("<tool_call>",), ("</tool_call>",), "", parse_tags)
HARMONY = Format("harmony", ("<|channel|>commentary to=functions.", "to=functions."), ("<|call|>",), "",
                 parse_harmony)
LLAMA3 = Format("llama3", ("<|python_tag|>",), (), "{", parse_llama3)
# Mistral's template refuses (in the next turn) any call id that is not 9 letters and digits.
MISTRAL = Format("mistral", ("[TOOL_CALLS]",), (), "[", parse_mistral, id_len=9)


def format_for_template(template: str | None) -> Format | None:
    """The call format the template teaches (by the markers its text contains); None when it teaches none."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MISTRAL
    if "<|channel|>" in t and "<|call|>" in t:
        return HARMONY
    if "<tool_call>" in t:
        return TAGS
    if "<|python_tag|>" in t:
        return LLAMA3
    return None


def parameter_types(tools) -> dict:
    """{function name: {parameter: JSON-schema type}} from OpenAI-style tools (XML values are typed by these)."""
    out = {}
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        props = (fn.get("parameters") or fn.get("input_schema") or {})
        props = props.get("properties") if isinstance(props, dict) else None
        out[fn["name"]] = {k: v.get("type") for k, v in (props or {}).items() if isinstance(v, dict)}
    return out


# --- the streaming parser --------------------------------------------------------------------------------------------
_START, _OUT, _IN, _WHOLE = "start", "out", "in", "whole"   # _START: nothing but whitespace seen yet


class ToolCallParser:
    """feed(text) -> (content_delta, finished calls); flush() -> the same for what was held back at the end."""

    def __init__(self, fmt: Format, tools=None):
        self.fmt = fmt
        self.types = parameter_types(tools)
        self.state = _START
        self._buf = ""            # content not yet emitted (may begin a marker)
        self._marker = ""         # the start marker of the call being read (and the whitespace before it)
        self._ws = ""             # whitespace held back: dropped if a call follows it
        self._after_call = False  # drop the whitespace that follows a call
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content, calls = [], []
        while self._step(content, calls):
            pass
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        if self.state in (_IN, _WHOLE):
            self._finish_call(self._buf, "", content, calls)
        else:
            self._emit(self._buf, content)
        content.append(self._ws)      # whitespace after text (never after a call): the model's own
        self._buf = self._ws = ""
        self.state = _OUT
        return "".join(content), calls

    # One move of the state machine; False when it needs more text.
    def _step(self, content: list, calls: list) -> bool:
        if self.state == _START:
            body = self._buf.lstrip()
            if not body:
                return False
            if any(m.startswith(body[:len(m)]) for m in self.fmt.starts):
                if not any(body.startswith(m) for m in self.fmt.starts):
                    return False      # it may still become a start marker
            elif self.fmt.whole and body[0] in self.fmt.whole:
                self._marker, self._buf, self.state = self._buf[:len(self._buf) - len(body)], body, _WHOLE
                return False
            self.state = _OUT
            return True
        if self.state == _WHOLE:
            return False
        if self.state == _OUT:
            at, hit = earliest_marker(self._buf, self.fmt.starts)
            if hit is None:
                keep = partial_marker_len(self._buf, self.fmt.starts)
                self._emit(self._buf[:len(self._buf) - keep], content)
                self._buf = self._buf[len(self._buf) - keep:]
                return False
            self._emit(self._buf[:at], content)
            # the whitespace before a call only separated it from the text (kept if the call does not parse)
            self._marker, self._ws = self._ws + hit, ""
            self._buf, self.state = self._buf[at + len(hit):], _IN
            return True
        # _IN
        at, hit = earliest_marker(self._buf, self.fmt.ends)
        if hit is None:
            return False
        body, self._buf = self._buf[:at], self._buf[at + len(hit):]
        self.state = _OUT
        self._finish_call(body, hit, content, calls)
        return True

    def _finish_call(self, body: str, end: str, content: list, calls: list) -> None:
        try:
            found = self.fmt.parse(body, self.types)
        except ToolCallError as e:
            log.warning("a %s tool call did not parse (%s); it stays in the content as written", self.fmt.name, e)
            self._after_call = False
            self._emit(self._marker + body + end, content)
            return
        if self.fmt.id_len:
            for k in found:
                k.id = uuid.uuid4().hex[:self.fmt.id_len]
        calls += found
        self.calls += found
        self._after_call = True

    def _emit(self, text: str, content: list) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            content.append(self._ws + body)
            self._ws = ""
        self._ws += text[len(body):]
