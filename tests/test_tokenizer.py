"""The tokenizer against llama.cpp's own outputs (the fixtures' .inp/.out) and the default model's recorded prompts."""
import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from engine.tokenizer import StreamDecoder, Tokenizer, TokenizerError, eog_ids_from_metadata, read_gguf_metadata

VOCABS = ["gpt-2", "llama-bpe", "llama-spm", "phi-3", "qwen2"]
SEP = "\n__ggml_vocab_test__\n"


@lru_cache(maxsize=None)
def _tok(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(path)


def _vocab(fixtures_dir, name) -> Tokenizer:
    return _tok(str(fixtures_dir / "vocab" / f"ggml-vocab-{name}.gguf"))


def _cases(fixtures_dir, name):
    base = fixtures_dir / "vocab" / f"ggml-vocab-{name}.gguf"
    texts = base.with_name(base.name + ".inp").read_text(encoding="utf-8").split(SEP)
    outs = base.with_name(base.name + ".out").read_text().split("\n")
    assert texts[-1] == "" and outs[-1] == ""
    texts, outs = texts[:-1], outs[:-1]
    assert len(texts) == len(outs) > 40
    return list(zip(texts, [[int(x) for x in o.split()] for o in outs]))


@pytest.mark.parametrize("name", VOCABS)
def test_ids_equal_llama_cpp(fixtures_dir, name):
    tok = _vocab(fixtures_dir, name)
    wrong = [(text, want, got) for text, want in _cases(fixtures_dir, name)
             if (got := tok.encode(text, add_special=False)) != want]
    assert not wrong, f"{len(wrong)} texts differ; first: {wrong[0]!r}"


@pytest.mark.parametrize("name", VOCABS)
def test_decode_encode_round_trip(fixtures_dir, name):
    tok = _vocab(fixtures_dir, name)
    for text, _ in _cases(fixtures_dir, name):
        assert tok.decode(tok.encode(text, add_special=True)) == text


def test_smollm2_chat_prompts_match_llama_cpp(fixtures_dir):
    from engine.default_model import DefaultModelError, default_model_path
    try:
        path = default_model_path()
    except DefaultModelError as e:
        pytest.skip(f"default model unavailable (no network?): {e}")
    tok = _tok(str(path))
    ref = json.loads((fixtures_dir / "reference" / "smollm2-135m-chat.json").read_text())
    assert tok.pre == "smollm"
    for case in ref["cases"]:
        assert tok.encode(case["text"], add_special=True, parse_special=True) == case["prompt_ids"]
        assert tok.decode(case["prompt_ids"], special=True) == case["text"]
    assert tok.vocab["<|im_end|>"] in tok.eog_ids and tok.eos_id in tok.eog_ids


def test_special_tokens_only_where_allowed(fixtures_dir):
    tok = _vocab(fixtures_dir, "qwen2")
    end = tok.vocab["<|im_end|>"]
    typed = "hi<|im_end|>there"
    assert end not in tok.encode(typed, parse_special=False)
    assert tok.decode(tok.encode(typed, parse_special=False)) == typed
    ids = tok.encode(typed, parse_special=True)
    assert ids.count(end) == 1 and tok.decode(ids) == "hithere"   # control tokens are not text
    assert tok.decode(ids, special=True) == typed
    assert {end, tok.vocab["<|endoftext|>"]} <= tok.eog_ids
    assert tok.vocab["<|im_start|>"] not in tok.eog_ids


def test_eog_ids_come_from_metadata_and_end_texts():
    md = {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 7,
          "tokenizer.ggml.tokens": ["a", "<|im_end|>", "b", "<|endoftext|>", "<|eot_id|>", "<|im_start|>", "c", "d",
                                    "<|file_sep|>"],
          "tokenizer.ggml.token_type": [1, 3, 1, 1, 3, 3, 1, 1, 3]}
    # like llama.cpp: end texts count whatever their declared type; <|im_start|> is not an end
    assert eog_ids_from_metadata(md) == {1, 2, 3, 4, 7, 8}
    assert eog_ids_from_metadata({}) == set()
    harmony = {"tokenizer.ggml.tokens": ["<|end|>", "<|return|>", "<|call|>", "x"]}
    assert eog_ids_from_metadata(harmony) == {1, 2}
    assert eog_ids_from_metadata({"tokenizer.ggml.tokens": ["<|end|>", "x"]}) == {0}


def test_eog_is_only_what_the_metadata_declares(fixtures_dir):
    """Without an eos_token_id key llama.cpp falls back to a per-kind default id (11 in gpt2 vocabularies: ","); the
    generation must not end at (and the server must not hide) an ordinary token, so only declared ids count."""
    for name, default in (("qwen2", 11), ("llama-spm", 2)):
        md = dict(read_gguf_metadata(fixtures_dir / "vocab" / f"ggml-vocab-{name}.gguf"))
        del md["tokenizer.ggml.eos_token_id"]
        tok = Tokenizer.from_metadata(md)
        assert tok.eos_id == default                       # still what add_eos would append, as llama.cpp does
        assert default not in tok.eog_ids and default not in eog_ids_from_metadata(md)
        assert tok.eog_ids == eog_ids_from_metadata(md)


def test_bos_eos_as_the_metadata_says(fixtures_dir):
    spm = _vocab(fixtures_dir, "llama-spm")
    assert spm.encode("Hello")[0] == spm.bos_id == 1 and spm.encode("Hello", add_special=False)[0] != 1
    assert spm.encode("") == [1] and spm.encode("", add_special=False) == []
    l3 = _vocab(fixtures_dir, "llama-bpe")   # llama-bpe adds BOS by default (no add_bos_token key in this file)
    assert l3.encode("Hello")[0] == 128000
    assert _vocab(fixtures_dir, "qwen2").encode("Hello") == _vocab(fixtures_dir, "qwen2").encode("Hello", False)


STREAM_TEXT = "Привет, мир! 日本語のテキスト 🦙🔥👩‍👩‍👧 naïve café — ok"


@pytest.mark.parametrize("name", ["qwen2", "llama-spm", "gpt-2"])
def test_streaming_decode_never_splits_a_character(fixtures_dir, name):
    tok = _vocab(fixtures_dir, name)
    ids = tok.encode(STREAM_TEXT, add_special=False)
    dec = StreamDecoder(tok)
    pieces = [dec.feed(i) for i in ids] + [dec.flush()]
    assert all("\ufffd" not in p for p in pieces)
    joined = "".join(pieces)
    if tok.add_space_prefix:
        assert joined == " " + STREAM_TEXT   # the stream keeps SentencePiece's leading space; decode() drops it
    else:
        assert joined == STREAM_TEXT
    # the test means something only if some token ends inside a character
    assert any(p == "" and tok.token_bytes(i) for p, i in zip(pieces, ids))


def test_stream_decoder_holds_partial_bytes(fixtures_dir):
    tok = _vocab(fixtures_dir, "llama-spm")
    # 🦙 is four bytes, spelled by four byte tokens in this vocabulary
    ids = [tok.vocab[f"<0x{b:02X}>"] for b in "🦙".encode()]
    dec = StreamDecoder(tok)
    assert [dec.feed(i) for i in ids] == ["", "", "", "🦙"]
    dec.feed(ids[0])
    assert dec.flush() == "\ufffd"   # a sequence cut off for good is shown, not silently dropped


def test_unknown_pre_tokenizer_is_named(fixtures_dir):
    md = read_gguf_metadata(fixtures_dir / "vocab" / "tiny-bpe-1024.gguf")
    md["tokenizer.ggml.pre"] = "no-such-pre"
    with pytest.raises(TokenizerError, match="no-such-pre"):
        Tokenizer.from_metadata(md)
    md["tokenizer.ggml.model"] = "bert"
    with pytest.raises(TokenizerError, match="bert"):
        Tokenizer.from_metadata(md)


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("hello")
    with pytest.raises(TokenizerError, match="not a GGUF"):
        Tokenizer.from_gguf(p)


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_vocabulary(fixtures_dir, tmp_path, keep):
    src = (fixtures_dir / "vocab" / "tiny-bpe-1024.gguf").read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(src[:int(len(src) * keep)])
    with pytest.raises(TokenizerError, match="truncated") as e:
        Tokenizer.from_gguf(p)
    assert "\n" not in str(e.value)


def test_tiny_vocab_and_template(fixtures_dir):
    tok = _tok(str(fixtures_dir / "vocab" / "tiny-bpe-1024.gguf"))
    assert tok.n_vocab == 1024 and "<|im_start|>" in tok.chat_template
    text = "<|im_start|>user\nHello there, how are you?<|im_end|>\n"
    ids = tok.encode(text, parse_special=True)
    assert ids[0] == tok.vocab["<|im_start|>"] and tok.decode(ids, special=True) == text


def test_long_word_and_long_text(fixtures_dir):
    tok = _vocab(fixtures_dir, "qwen2")
    word = "漢字仮名交じり文" * 2000      # one pre-token word of 16k characters: the heap merge keeps it n log n
    assert tok.decode(tok.encode(word)) == word
    text = ("The quick brown fox, 1234567 times; " * 3000)
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text) / 2


def test_cli_matches_out_file(fixtures_dir):
    base = fixtures_dir / "vocab" / "ggml-vocab-qwen2.gguf"
    res = subprocess.run([sys.executable, "-m", "engine.tokenizer", str(base)],
                         stdin=open(str(base) + ".inp", "rb"), capture_output=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.decode() == (fixtures_dir / "vocab" / "ggml-vocab-qwen2.gguf.out").read_text()


def test_every_pre_tokenizer_compiles_and_loses_nothing(fixtures_dir):
    from engine.tokenizer import PRE_TOKENIZERS
    md = read_gguf_metadata(fixtures_dir / "vocab" / "tiny-bpe-1024.gguf")
    for name in ("default", "gpt-2", "llama-bpe", "qwen2", "smollm", "phi-2", "deepseek-llm", "deepseek-coder",
                 "starcoder", "falcon", "mpt", "command-r", "refact", "qwen35"):
        assert name in PRE_TOKENIZERS
    text = "Héllo  wörld's 12345 东京タワー 👋🏽\t\n\n  x = a+b; // Дом\u00a0!\r\n  "
    for name in PRE_TOKENIZERS:
        tok = Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": name})
        words = tok.pretokenize(text)
        assert "".join(words) == text and all(words), name
        assert tok.decode(tok.encode(text)) == text, name


def test_pre_tokenizer_splits():
    md_words = {  # hand-checked against the regexes llama.cpp uses for these pre-tokenizers
        "gpt-2": ["Hello", "'s", " 1234", "  ", " world", "!!", "\n"],
        "llama-bpe": ["Hello", "'s", " ", "123", "4", "  ", " world", "!!\n"],
        "qwen2": ["Hello", "'s", " ", "1", "2", "3", "4", "  ", " world", "!!\n"],
    }
    text = "Hello's 1234   world!!\n"
    for pre, want in md_words.items():
        tok = Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                                       "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": [],
                                       "tokenizer.ggml.add_bos_token": False})
        assert tok.pretokenize(text) == want, pre


@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_spm_cut_points_change_nothing(fixtures_dir, name):
    # SentencePiece text is cut where no token can span; the ids must equal one merge over the whole text
    from bench.tokenizer import mixed_text
    from engine.tokenizer import _SPM_SPACE
    tok = Tokenizer.from_gguf(fixtures_dir / "vocab" / f"ggml-vocab-{name}.gguf")
    text = mixed_text(20_000, seed=3) + "  a\u00a0  b\n\n\n  \t x  "
    whole = list(tok._spm_piece((" " + text).replace(" ", _SPM_SPACE)))
    assert tok.encode(text, add_special=False) == whole


def test_qwen35_pre_tokenizer_equals_llama_cpp(fixtures_dir):
    """Qwen3.5's pattern (combining marks stay in the word) over Qwen2's merges, against llama.cpp's ids
    (tests/data/qwen35-pretokenizer.json, made by tools/tokenizer_reference.py)."""
    import hashlib
    ref = json.loads((Path(__file__).parent / "data" / "qwen35-pretokenizer.json").read_text(encoding="utf-8"))
    path = fixtures_dir / "vocab" / ref["vocab"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["vocab_sha256"]
    md = dict(read_gguf_metadata(path))
    md["tokenizer.ggml.pre"] = ref["pre"]
    tok = Tokenizer.from_metadata(md)
    assert tok.pre == "qwen35" and len(ref["cases"]) > 60
    for case in ref["cases"]:
        assert tok.encode(case["text"], add_special=False) == case["ids"], case["text"]
        assert tok.encode(case["text"], add_special=False, parse_special=True) == case["ids_parse_special"]
    # not vacuous: Qwen2's pattern cuts some of these texts elsewhere
    md["tokenizer.ggml.pre"] = "qwen2"
    qwen2 = Tokenizer.from_metadata(md)
    assert sum(qwen2.encode(c["text"], add_special=False) != c["ids"] for c in ref["cases"]) >= 3
