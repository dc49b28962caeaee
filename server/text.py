"""Text on the server's side of the boundary: messages to prompt ids, generated ids back to text.

The worker only sees ids. Here: the GGUF's chat template (server/chat.py), its vocabulary (engine/tokenizer.py), the
split of thinking from the answer (server/reasoning.py), and stop strings, which act on decoded text.
"""
from __future__ import annotations

import logging

from server.reasoning import earliest_marker, partial_marker_len

log = logging.getLogger("strata.text")

# Appended when a thinking budget runs out: the model then answers as if it had closed the thought itself.
THINK_CLOSING_WORDS = "\n</think>\n\n"
HARMONY_CLOSING_WORDS = "<|end|><|start|>assistant<|channel|>final<|message|>"   # gpt-oss: on to the final channel


class PromptError(ValueError):
    """The messages cannot be turned into a prompt (e.g. the template refuses them); a 400 for the client."""


class TextCodec:
    """One model's vocabulary and chat template, as the service needs them."""

    def __init__(self, tokenizer, template: str | None):
        self.tok = tokenizer
        self.template = template
        self.eog_ids = frozenset(int(i) for i in tokenizer.eog_ids)
        # gpt-oss frames reasoning with control tokens, which only show when decoded as special.
        self.harmony = bool(template) and "<|channel|>" in template
        self.closing_words = HARMONY_CLOSING_WORDS if self.harmony else THINK_CLOSING_WORDS

    @classmethod
    def from_gguf(cls, path) -> "TextCodec":
        from engine.tokenizer import Tokenizer
        tok = Tokenizer.from_gguf(path)
        return cls(tok, tok.chat_template)

    def _special_text(self, token_id) -> str:
        return self.tok.token_text(token_id) if token_id is not None and token_id >= 0 else ""

    def chat_prompt(self, messages: list[dict], tools=None, template_kwargs: dict | None = None,
                    tool_choice=None) -> tuple[list[int], str]:
        from server.chat import ChatTemplateError, render_chat
        if tools and tool_choice != "none" and self.generic_tools:
            # the template knows no tools: they go into the system message in words (server/generic_tools.py)
            from server.generic_tools import messages_with_tools
            messages, tools = messages_with_tools(messages, tools, tool_choice), None
        bos = self._special_text(self.tok.bos_id) if getattr(self.tok, "add_bos", False) else ""
        eos = self._special_text(self.tok.eos_id)
        if self.harmony:
            from server.harmony import template_messages
            messages = template_messages(messages)
        try:
            text = render_chat(self.template, messages, add_generation_prompt=True, bos_token=bos, eos_token=eos,
                               tools=tools, **(template_kwargs or {}))
        except ChatTemplateError as e:
            raise PromptError(str(e)) from None
        # The template writes the BOS itself when the model wants one; never add a second.
        add = not (bos and text.startswith(bos))
        return self.tok.encode(text, add_special=add, parse_special=True), text

    def completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list):
            n = self.tok.n_vocab
            bad = [t for t in prompt if not 0 <= t < n]
            if bad:
                raise PromptError(f"token id {bad[0]} is outside this model's vocabulary (0..{n - 1})")
            return list(prompt)
        return self.tok.encode(prompt, add_special=True, parse_special=True)

    def encode_special(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special=False, parse_special=True)

    def decoder(self):
        from engine.tokenizer import StreamDecoder
        return StreamDecoder(self.tok, special=self.harmony)

    def tool_parser(self, tools, tool_choice=None):
        """A parser for the model's tool calls when the request offers tools (and does not say "none"); else None."""
        from server.tool_calls import ToolCallParser
        if not tools or tool_choice == "none":
            return None
        return ToolCallParser(self.tool_format, tools)

    @property
    def generic_tools(self) -> bool:
        """True when the template teaches no tool-call format this server knows (server/generic_tools.py)."""
        from server.tool_calls import format_for_template
        return format_for_template(self.template) is None

    @property
    def tool_format(self):
        """The template's tool-call format, or the tags format that server/generic_tools.py teaches."""
        from server.tool_calls import TAGS, format_for_template
        return format_for_template(self.template) or TAGS

    def splitter(self, prompt_text: str):
        from server.reasoning import ReasoningSplitter
        return ReasoningSplitter.for_prompt(self.template, prompt_text)


class StopFilter:
    """Holds back text that could be the start of a stop string; cuts the text where the first stop string starts.

    The stop that wins is the one the whole text would give, however it arrives in pieces: the earliest start, and
    at an equal start the longest (server.reasoning.earliest_marker). So a stop found in the buffer is acted on only
    once no other stop can still complete at or before its start ("Hu" waits while "Human:" may follow).
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.hit: str | None = None

    def feed(self, text: str) -> str:
        if self.hit is not None:
            return ""
        self.buf += text
        at, hit = earliest_marker(self.buf, self.stops)
        open_from = len(self.buf) - partial_marker_len(self.buf, self.stops)   # where an unfinished stop may start
        if hit is not None and at < open_from:
            return self._cut(at, hit)
        out, self.buf = self.buf[:open_from], self.buf[open_from:]
        return out

    def flush(self) -> str:
        """The end of the answer: what was held back, up to a stop that it completes."""
        if self.hit is not None:
            return ""
        at, hit = earliest_marker(self.buf, self.stops)
        if hit is not None:
            return self._cut(at, hit)
        out, self.buf = self.buf, ""
        return out

    def _cut(self, at: int, hit: str) -> str:
        out, self.buf, self.hit = self.buf[:at], "", hit
        return out


class TextStream:
    """Generated ids in, (reasoning_delta, content_delta) out: decode, stop strings, then the thinking split.

    prompt_text is the rendered chat prompt (it tells whether the answer starts inside a thought); None for plain
    completions, whose text is never split.
    """

    def __init__(self, codec: TextCodec, stops: list[str], prompt_text: str | None):
        self.codec = codec
        self.decoder = codec.decoder()
        self.stops = StopFilter(stops)
        self.splitter = codec.splitter(prompt_text) if prompt_text is not None else None
        self.think_tokens = 0         # tokens generated inside a thought (the budget counts these)

    @property
    def thinking(self) -> bool:
        from server.reasoning import REASONING
        return self.splitter is not None and self.splitter.state == REASONING

    def feed_token(self, token_id: int) -> tuple[str, str]:
        if token_id in self.codec.eog_ids:
            return "", ""
        if self.thinking:
            self.think_tokens += 1
        return self.feed_text(self.decoder.feed(token_id))

    def feed_text(self, text: str) -> tuple[str, str]:
        return self._split(self.stops.feed(text)) if text else ("", "")

    def _split(self, text: str) -> tuple[str, str]:
        if not text:
            return "", ""
        if self.splitter is None:
            return "", text
        return self.splitter.feed(text)

    def finish(self) -> tuple[str, str]:
        r, c = self._split(self.stops.feed(self.decoder.flush()))
        r2, c2 = self._split(self.stops.flush())
        r, c = r + r2, c + c2
        if self.splitter is not None:
            r3, c3 = self.splitter.flush()
            r, c = r + r3, c + c3
        return r, c

    @property
    def stop_hit(self) -> str | None:
        return self.stops.hit
