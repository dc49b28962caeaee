"""Split a streamed answer into reasoning and content, so the server can send `reasoning_content` and `content`.

Two marker families:
- think tags: `<think>` ... `</think>` (Qwen3, DeepSeek-R1, SmolLM3, ...). `<think>` counts only at the very start
  of the answer (as llama.cpp parses it), so an answer that mentions the tag later is left alone. Templates that put
  `<think>` into the generation prompt (Qwen3.5, DeepSeek-R1 distills) make the model start inside reasoning:
  `ReasoningSplitter.for_prompt(template, prompt)` sees that in the rendered prompt.
- gpt-oss (harmony) channels: `<|channel|>analysis<|message|>` ... `<|end|>` is reasoning,
  `<|channel|>final<|message|>` and a commentary preamble (`<|channel|>commentary<|message|>`) are the answer; the
  framing (`<|end|>`, `<|start|>assistant`) is dropped and anything else (commentary `to=functions.NAME`: tool calls)
  stays in the content, so nothing the model wrote is lost.

Text arrives in arbitrary pieces (one token's worth, or less); a marker split across pieces is still recognised,
because a tail that could begin a marker is held back until the next piece decides it. Reasoning is trimmed of
surrounding whitespace and the content after it of leading whitespace, as llama.cpp returns them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

REASONING, CONTENT, START = "reasoning", "content", "start"   # START: nothing but whitespace seen yet


@dataclass(frozen=True)
class Markers:
    """For each state, the markers that end it and the state each leads to."""
    transitions: dict = field(default_factory=dict)

    def active(self, state: str) -> dict:
        return self.transitions.get(state, {})


THINK = Markers({START: {"<think>": REASONING}, REASONING: {"</think>": CONTENT}})
_H_ANALYSIS, _H_FINAL = "<|channel|>analysis<|message|>", "<|channel|>final<|message|>"
# A commentary message with no recipient is a preamble for the user (as llama.cpp's gpt-oss parser reads it): content.
_H_ALL = {_H_ANALYSIS: REASONING, _H_FINAL: CONTENT, "<|channel|>commentary<|message|>": CONTENT, "<|end|>": CONTENT,
          "<|start|>assistant": None}
# gpt-oss-20b at times writes a stray commentary header before the analysis or final one (llama.cpp's parser allows
# it too): the pair counts as the second header alone.
_H_ALL.update({stray + head: state for stray in ("<|channel|>commentary", "<|channel|>commentary to=assistant")
               for head, state in ((_H_ANALYSIS, REASONING), (_H_FINAL, CONTENT))})
HARMONY = Markers({START: _H_ALL, REASONING: _H_ALL, CONTENT: _H_ALL})


def markers_for_template(template: str | None) -> Markers:
    return HARMONY if template and "<|channel|>" in template else THINK


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open <think> (the template wrote it into the generation
    prompt), so the model's first words are reasoning."""
    return prompt.rfind("<think>") > prompt.rfind("</think>")


class ReasoningSplitter:
    """feed(text) -> (reasoning_delta, content_delta); flush() -> the same for what was held back at the end."""

    def __init__(self, template_or_markers=None, start_in_reasoning: bool = False):
        if isinstance(template_or_markers, Markers):
            self.markers = template_or_markers
        else:
            self.markers = markers_for_template(template_or_markers)
        self.state = REASONING if start_in_reasoning else START
        self._buf = ""            # text not yet attributed: it may be the start of a marker
        self._ws = ""             # trailing whitespace of the reasoning, emitted only if more reasoning follows
        self._lead = True         # strip leading whitespace of the current segment

    @classmethod
    def for_prompt(cls, template: str | None, prompt: str) -> "ReasoningSplitter":
        return cls(template, start_in_reasoning=prompt_opens_reasoning(prompt))

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        r, c = [], []
        while True:
            active = self.markers.active(self.state)
            at, hit = earliest_marker(self._buf, active)
            if hit is None:
                keep = partial_marker_len(self._buf, active)
                self._emit(self._buf[:len(self._buf) - keep], r, c)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            self._emit(self._buf[:at], r, c)
            self._buf = self._buf[at + len(hit):]
            nxt = active[hit]
            if nxt is not None and (nxt != self.state or nxt == REASONING):
                self._ws = ""
                self._lead = True
                self.state = nxt
        return "".join(r), "".join(c)

    def flush(self) -> tuple[str, str]:
        r, c = [], []
        self._emit(self._buf, r, c)
        self._buf = ""
        self._ws = ""   # reasoning that ends the answer is trimmed too
        return "".join(r), "".join(c)

    def _emit(self, text: str, r: list, c: list) -> None:
        if not text:
            return
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        if self.state == START:
            self.state = CONTENT   # real text before any opening marker: from here on it is the answer
        if self.state == REASONING:
            body = text.rstrip()
            if body:
                r.append(self._ws + body)
                self._ws = ""
            self._ws += text[len(body):]
        else:
            c.append(text)


def earliest_marker(buf: str, markers) -> tuple[int, str | None]:
    """(position, marker) of the marker found first in buf (the longer one where two start there), or (-1, None)."""
    hit, at = None, -1
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (at < 0 or i < at or (i == at and len(m) > len(hit))):
            hit, at = m, i
    return at, hit


def partial_marker_len(buf: str, markers) -> int:
    """Length of the longest tail of buf that is a proper prefix of one of the markers."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best
