"""Text on the server's side of the boundary: messages to prompt ids, generated ids back to text.

The worker only sees ids. Here: the GGUF's chat template (engine/chat.py), its vocabulary (engine/tokenizer.py), the
split of thinking from the answer (engine/reasoning.py), and stop strings, which act on decoded text.
"""
from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Appended when a thinking budget runs out: the model then answers as if it had closed the thought itself.
THINK_CLOSING_WORDS = "\n</think>\n\n"


class PromptError(ValueError):
    """The messages cannot be turned into a prompt (e.g. the template refuses them); a 400 for the client."""


class TextCodec:
    """One model's vocabulary and chat template, as the service needs them."""

    def __init__(self, tokenizer, template: str | None):
        self.tok = tokenizer
        self.template = template
        self.eog_ids = frozenset(int(i) for i in tokenizer.eog_ids)
        self.thinks = bool(template) and THINK_OPEN in template

    @classmethod
    def from_gguf(cls, path) -> "TextCodec":
        from engine.tokenizer import Tokenizer
        tok = Tokenizer.from_gguf(path)
        return cls(tok, tok.chat_template)

    def _special_text(self, token_id) -> str:
        return self.tok.token_text(token_id) if token_id is not None and token_id >= 0 else ""

    def chat_prompt(self, messages: list[dict], tools=None, template_kwargs: dict | None = None) -> tuple[list[int], str]:
        from engine.chat import ChatTemplateError, render_chat
        bos = self._special_text(getattr(self.tok, "bos_id", None))
        eos = self._special_text(getattr(self.tok, "eos_id", None))
        try:
            text = render_chat(self.template, messages, add_generation_prompt=True, bos_token=bos, eos_token=eos,
                               tools=tools, **(template_kwargs or {}))
        except ChatTemplateError as e:
            raise PromptError(f"the model's chat template refused these messages: {e}") from None
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
        return StreamDecoder(self.tok)

    def splitter(self):
        if not self.thinks:
            return None
        from engine.reasoning import ReasoningSplitter
        return ReasoningSplitter(self.template)


class StopFilter:
    """Holds back text that could be the start of a stop string; cuts the text at the first stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.hit: str | None = None

    def feed(self, text: str) -> str:
        if self.hit is not None:
            return ""
        self.buf += text
        if not self.stops:
            out, self.buf = self.buf, ""
            return out
        first = None
        for s in self.stops:
            i = self.buf.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first:
            out, self.buf, self.hit = self.buf[:first[0]], "", first[1]
            return out
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.buf)), keep, -1):
                if self.buf.endswith(s[:n]):
                    keep = n
                    break
        out = self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.hit is not None else self.buf), ""
        return out


class TextStream:
    """Generated ids in, (reasoning_delta, content_delta) out: decode, stop strings, thinking split."""

    def __init__(self, codec: TextCodec, stops: list[str], thinking_open: bool):
        self.codec = codec
        self.decoder = codec.decoder()
        self.stops = StopFilter(stops)
        self.splitter = codec.splitter()
        self.raw = ""                 # everything decoded so far, before stop strings
        # Thinking state for the budget: open from the prompt (a template that ends in <think>) or from the answer.
        self.thinking = thinking_open
        self.think_tokens = 0
        if self.splitter is not None and thinking_open:
            self.splitter.feed(THINK_OPEN)   # the splitter must know the answer starts inside a thought

    def feed_token(self, token_id: int) -> tuple[str, str]:
        if token_id in self.codec.eog_ids:
            return "", ""
        if self.thinking:
            self.think_tokens += 1
        return self.feed_text(self.decoder.feed(token_id))

    def feed_text(self, text: str) -> tuple[str, str]:
        if not text:
            return "", ""
        before = len(self.raw)
        self.raw += text
        if self.codec.thinks:
            tail = self.raw[max(0, before - len(THINK_CLOSE)):]
            if not self.thinking and THINK_OPEN in tail and THINK_CLOSE not in self.raw[self.raw.rfind(THINK_OPEN):]:
                self.thinking = True
            elif self.thinking and THINK_CLOSE in tail:
                self.thinking = False
        return self._split(self.stops.feed(text))

    def _split(self, text: str) -> tuple[str, str]:
        if not text:
            return "", ""
        if self.splitter is None:
            return "", text
        r, c = self.splitter.feed(text)
        return r or "", c or ""

    def finish(self) -> tuple[str, str]:
        r, c = self._split(self.stops.feed(self.decoder.flush()))
        r2, c2 = self._split(self.stops.flush())
        r, c = r + r2, c + c2
        if self.splitter is not None:
            tail = self.splitter.flush()
            if tail:
                r, c = r + (tail[0] or ""), c + (tail[1] or "")
        return r, c

    @property
    def stop_hit(self) -> str | None:
        return self.stops.hit

    def prompt_ends_thinking_open(self) -> bool:
        return self.thinking
