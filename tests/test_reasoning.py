"""Streaming split of reasoning from the answer, whatever the piece boundaries."""
import random

import pytest

from server.chat import render_chat
from server.reasoning import HARMONY, THINK, ReasoningSplitter, prompt_opens_reasoning
from engine.tokenizer import StreamDecoder, Tokenizer

THINK_TEXT = "<think>\nThe user wants 2+2. That is 4.\n\n</think>\n\nThe answer is **4**."
THINK_WANT = ("The user wants 2+2. That is 4.", "The answer is **4**.")
HARMONY_TEXT = ("<|channel|>analysis<|message|>User asks 2+2; trivial.<|end|><|start|>assistant"
                "<|channel|>final<|message|>It is 4.")
HARMONY_WANT = ("User asks 2+2; trivial.", "It is 4.")


def _run(splitter, pieces):
    r_all, c_all = "", ""
    for p in pieces:
        r, c = splitter.feed(p)
        r_all, c_all = r_all + r, c_all + c
    r, c = splitter.flush()
    return r_all + r, c_all + c


@pytest.mark.parametrize("markers,text,want", [(THINK, THINK_TEXT, THINK_WANT), (HARMONY, HARMONY_TEXT, HARMONY_WANT)])
def test_every_split_point(markers, text, want):
    assert _run(ReasoningSplitter(markers), [text]) == want
    assert _run(ReasoningSplitter(markers), list(text)) == want          # one character at a time
    for i in range(len(text) + 1):                                        # every place a marker can be cut
        assert _run(ReasoningSplitter(markers), [text[:i], text[i:]]) == want, i
    rnd = random.Random(1)
    for _ in range(200):
        cuts = sorted(rnd.sample(range(1, len(text)), rnd.randint(1, 12)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _run(ReasoningSplitter(markers), pieces) == want


def test_markers_through_real_tokens(fixtures_dir):
    # Qwen2's vocabulary (Qwen3 shares it): markers arrive as several tokens or inside one; decode token by token
    tok = Tokenizer.from_gguf(fixtures_dir / "vocab" / "ggml-vocab-qwen2.gguf")
    for markers, text, want in ((THINK, THINK_TEXT, THINK_WANT), (HARMONY, HARMONY_TEXT, HARMONY_WANT)):
        dec, sp = StreamDecoder(tok), ReasoningSplitter(markers)
        pieces = [dec.feed(i) for i in tok.encode(text, add_special=False)] + [dec.flush()]
        assert _run(sp, pieces) == want


def test_answer_without_reasoning_keeps_a_later_tag():
    text = "Use the <think> tag like this: <think>x</think>."
    assert _run(ReasoningSplitter(THINK), list(text)) == ("", text)


def test_no_end_marker_is_all_reasoning_and_partial_marker_is_kept():
    assert _run(ReasoningSplitter(THINK), ["<think>still thinking</thi"]) == ("still thinking</thi", "")
    assert _run(ReasoningSplitter(THINK), ["Answer <thi"]) == ("", "Answer <thi")


def test_generation_prompt_that_opens_think(fixtures_dir):
    conv = [{"role": "user", "content": "2+2?"}]
    qwen35 = (fixtures_dir / "templates" / "Qwen3.5-4B.jinja").read_text()
    prompt = render_chat(qwen35, conv)
    assert prompt.endswith("<think>\n") and prompt_opens_reasoning(prompt)
    sp = ReasoningSplitter.for_prompt(qwen35, prompt)
    assert _run(sp, list("Easy: 4.\n</think>\n\n4")) == ("Easy: 4.", "4")
    # thinking switched off: the prompt closes the block itself, so the model's words are the answer
    prompt = render_chat(qwen35, conv, enable_thinking=False)
    assert not prompt_opens_reasoning(prompt)
    assert _run(ReasoningSplitter.for_prompt(qwen35, prompt), ["4"]) == ("", "4")
    # Qwen3: the model writes <think> itself
    qwen3 = (fixtures_dir / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    prompt = render_chat(qwen3, conv)
    assert _run(ReasoningSplitter.for_prompt(qwen3, prompt), [THINK_TEXT]) == THINK_WANT


def test_template_picks_the_markers(fixtures_dir):
    gpt_oss = (fixtures_dir / "templates" / "openai-gpt-oss-120b.jinja").read_text()
    assert ReasoningSplitter(gpt_oss).markers is HARMONY
    assert ReasoningSplitter(None).markers is THINK
    # a tool call on the commentary channel stays in the content
    text = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}")
    r, c = _run(ReasoningSplitter(gpt_oss), list(text))
    assert r == "Need weather." and "functions.get_weather" in c and "{\"city\":\"Paris\"}" in c
