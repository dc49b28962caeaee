"""Stop strings on decoded text, and the text pipeline (decode, stop strings, the thinking split)."""
from fakes.server_kit import tiny_codec
from server.text import StopFilter, TextStream


def feed_all(f: StopFilter, pieces):
    return "".join(f.feed(p) for p in pieces) + f.flush()


def test_stop_string_split_across_pieces():
    f = StopFilter(["END"])
    assert f.feed("abc E") == "abc "        # "E" could start the stop string: held back
    assert f.feed("N") == ""
    assert f.feed("Dx") == "" and f.hit == "END"
    assert f.flush() == ""


def test_held_back_text_is_released():
    assert feed_all(StopFilter(["END"]), ["abc E", "Nx", "yz"]) == "abc ENxyz"
    assert feed_all(StopFilter(["END"]), ["abc EN"]) == "abc EN"      # the end of the answer releases it


def test_earliest_of_several_stops_wins():
    f = StopFilter(["world", "lo w"])
    assert f.feed("hello world") == "hel" and f.hit == "lo w"


def test_stop_tie_rule_holds_however_the_text_is_split():
    """Earliest start wins; at an equal start the longest stop is cut and reported, whatever the pieces."""
    cases = [(["Hu", "Human:"], "a Human: b", "a ", "Human:"), (["Human:", "Hu"], "a Human: b", "a ", "Human:"),
             (["Hu", "Human:"], "a Humble", "a ", "Hu"), (["c", "abcd"], "xabcdy", "x", "abcd"),
             (["c", "abcd"], "xabcy", "xab", "c"), (["Hu", "Human:"], "a Hu", "a ", "Hu")]
    for stops, text, out, hit in cases:
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                f = StopFilter(stops)
                assert (feed_all(f, [text[:i], text[i:j], text[j:]]), f.hit) == (out, hit), (stops, text, i, j)


def test_a_stop_that_may_grow_is_held_until_decided():
    f = StopFilter(["Hu", "Human:"])
    assert f.feed("a Hu") == "a " and f.hit is None      # "Human:" may still follow
    assert f.feed("m") == "" and f.hit is None
    assert f.feed("ble") == "" and f.hit == "Hu"


def test_no_stops_passes_through():
    assert feed_all(StopFilter([]), ["a", "b"]) == "ab"
    assert feed_all(StopFilter([""]), ["a", "b"]) == "ab"


def test_text_stream_plain_completion_is_never_split(fixtures_dir):
    codec = tiny_codec(fixtures_dir)
    ts = TextStream(codec, [], None)
    out = [ts.feed_token(i) for i in codec.tok.encode("<think>x</think>y")]
    out.append(ts.finish())
    assert "".join(r for r, _ in out) == "" and "".join(c for _, c in out) == "<think>x</think>y"


def test_text_stream_thinking_from_the_prompt(fixtures_dir):
    codec = tiny_codec(fixtures_dir, "Qwen3.5-4B.jinja")
    ids, prompt = codec.chat_prompt([{"role": "user", "content": "hi"}])
    ts = TextStream(codec, ["STOP"], prompt)
    assert ts.thinking
    out = [ts.feed_token(i) for i in codec.tok.encode("let me see\n</think>\n\nThe answer STOP ignored")]
    out.append(ts.finish())
    assert "".join(r for r, _ in out) == "let me see" and "".join(c for _, c in out) == "The answer "
    assert not ts.thinking and ts.think_tokens > 0 and ts.stop_hit == "STOP"


def test_end_of_generation_tokens_are_not_text(fixtures_dir):
    codec = tiny_codec(fixtures_dir)
    ts = TextStream(codec, [], None)
    eog = min(codec.eog_ids)
    assert ts.feed_token(eog) == ("", "")
