"""Chat templates: render a GGUF's `tokenizer.chat_template` (jinja2) as Hugging Face's apply_chat_template does.

The model was trained on exactly what its template writes, so the environment copies Hugging Face's: a sandboxed,
immutable jinja2 environment with trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now` and
a `tojson` with json.dumps' own separators and ensure_ascii off. Messages arrive in OpenAI's shape and are brought
into the shape templates expect (see _normalize). A vocabulary without a template gets ChatML, with a logged note.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger("strata.chat")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(Exception):
    """The template could not render this conversation; the message carries the template's own words."""


class _Raised(Exception):
    """raise_exception() called by the template itself."""


def _raise_exception(message):
    raise _Raised(str(message))


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Hugging Face's filter: json.dumps defaults (", " and ": "), non-ASCII kept as is, no HTML escaping.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} (Hugging Face marks assistant text for training masks): renders its
    body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse (line {e.lineno}: {e.message}); "
                                f"fix the GGUF's tokenizer.chat_template or give another template") from None


def _normalize(message: dict) -> dict:
    """An OpenAI-style message in the shape chat templates read (what llama.cpp hands its templates, too):
    content always a string (None -> "", a list of text parts joined by newlines), empty tool_calls removed (some
    templates test `'tool_calls' in message`), tool-call arguments as an object rather than a JSON string (templates
    iterate them or apply tojson), and `thinking` (gpt-oss's name) alongside `reasoning_content`."""
    m = dict(message)
    content = m.get("content")
    if content is None:
        m["content"] = ""
    elif isinstance(content, list):
        m["content"] = "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if not m.get("tool_calls"):
        m.pop("tool_calls", None)
    else:
        calls = []
        for call in m["tool_calls"]:
            call = dict(call)
            fn = call.get("function")
            if isinstance(fn, dict):
                fn = dict(fn)
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args)
                    except ValueError:
                        parsed = None
                    if isinstance(parsed, dict):
                        fn["arguments"] = parsed
                call["function"] = fn
            calls.append(call)
        m["tool_calls"] = calls
    if m.get("reasoning_content") is None:
        m.pop("reasoning_content", None)
    elif "thinking" not in m:
        m["thinking"] = m["reasoning_content"]
    return m


def render_chat(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", tools=None, **template_kwargs) -> str:
    """The prompt text for a conversation. template_kwargs reach the template as variables (enable_thinking,
    reasoning_effort, ...). Raises ChatTemplateError with the template's message when it refuses the conversation."""
    if template is None:
        log.warning("the model has no chat template (tokenizer.chat_template); using ChatML")
        template = CHATML_TEMPLATE
    compiled = _compile(template)
    msgs = [_normalize(m) for m in messages]
    try:
        return compiled.render(messages=msgs, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                               eos_token=eos_token, tools=tools, **template_kwargs)
    except _Raised as e:
        raise ChatTemplateError(f"the chat template refused the conversation: {e}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ChatTemplateError(f"the chat template failed on this conversation ({type(e).__name__}: {e})") from None
