"""Text to token ids and back, from a GGUF's `tokenizer.*` metadata alone, exactly as llama.cpp does it.

Two vocabulary kinds: `gpt2` (byte-level BPE with merges, after a pre-tokenizer split chosen by `tokenizer.ggml.pre`)
and `llama` (SentencePiece: score-ordered merges of characters, `▁` for spaces, `<0xNN>` byte fallback).

Exactness notes (llama.cpp's src/llama-vocab.cpp and src/unicode.cpp are the reference):
- llama.cpp runs its pre-tokenizer regexes on a "collapsed" copy of the text in which every non-ASCII code point is
  replaced by one stand-in byte for its Unicode category (letter, number, punctuation, mark, symbol, other) and
  non-ASCII whitespace by \\x0b; \\p{L} then means "A-Za-z or the letter stand-in" (so \\p{Lu} is any letter, too).
  We do the same with Python's `re` (ASCII mode, like std::regex in the C locale), which needs no \\p{...} support and
  reproduces llama.cpp's quirks. Its hand-written splitters for the GPT-2 and Llama 3 patterns give the same words as
  the regexes they stand for.
- Special tokens are cut out of the text first (longest first); control tokens only when the caller allows
  (parse_special), user-defined ones always, as llama.cpp does.
- Every pre-token word is BPE-merged once and cached; merges go through a heap, so a long word is n log n.
"""
from __future__ import annotations

import heapq
import re
import sys
import unicodedata
from functools import lru_cache
from pathlib import Path

from engine.gguf_model import ModelError, read_header

# llama.cpp's token attributes (bit flags); GGUF stores a token *type* that maps onto one of them.
ATTR_UNDEFINED, ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL = 0, 1, 2, 4
ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_BYTE = 8, 16, 32
ATTR_LSTRIP, ATTR_RSTRIP = 128, 256
_TYPE_TO_ATTR = {1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL, 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED,
                 6: ATTR_BYTE}

# End-of-generation, as llama.cpp decides it (llama-vocab.cpp): eos/eot/eom ids, every token with one of these texts
# whatever its declared type (llama.cpp overrides the type to CONTROL, warning that the model is wrong), and the FIM
# pad/repo/file-separator tokens (tokenizer.ggml.<key>, else the first text found). eog_ids_from_metadata applies it;
# the worker (where generation stops) and the server's Tokenizer (what it hides) both call it.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
             "<end_of_utterance>", "<｜end▁of▁sentence｜>")
FIM_EOG = (("fim_pad_token_id", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>")),
           ("fim_rep_token_id", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
           ("fim_sep_token_id", ("<|file_sep|>",)))

_C_SPACE = " \t\n\v\f\r"   # C isspace(): what lstrip/rstrip special tokens strip
_SPM_SPACE = "\u2581"       # ▁


class TokenizerError(Exception):
    """A vocabulary that cannot be used; the message says which key or value and what to do."""


# --------------------------------------------------------------------------------------------------------------------
# GGUF metadata

def read_gguf_metadata(path) -> dict:
    """All key-value pairs of a GGUF header (a model or a vocabulary-only file), arrays as lists."""
    try:
        return read_header(path).metadata
    except ModelError as e:
        raise TokenizerError(str(e)) from None


# --------------------------------------------------------------------------------------------------------------------
# Unicode categories the way llama.cpp collapses them

_WHITESPACE = frozenset([0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                         0x2028, 0x2029, 0x202F, 0x205F, 0x3000])   # Unicode White_Space, as regex \s
_CAT_STANDIN = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_OTHER_STANDIN = "\xd0"
# What a \p{X} becomes inside a character class of a collapsed regex: the stand-in plus the ASCII members.
_CLASS_BODY = {
    "N": "\xd10-9",
    "L": "\xd2A-Za-z",
    "P": "\xd3" + r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    "M": "\xd4",
    "S": "\xd5" + r"\$\+<->\^`\|",
}
for _sub in ("Lu", "Ll", "Lt", "Lm", "Lo"):   # llama.cpp maps every letter subcategory to "any letter"
    _CLASS_BODY[_sub] = _CLASS_BODY["L"]


class _Collapse(dict):
    """str.translate table: ASCII stays, other code points become their category's stand-in (filled on demand)."""

    def __missing__(self, cp):
        if cp < 128:
            v = cp
        elif cp in _WHITESPACE:
            v = "\x0b"
        else:
            v = _CAT_STANDIN.get(unicodedata.category(chr(cp))[0], _OTHER_STANDIN)
        self[cp] = v
        return v


class _WideSpace(dict):
    """str.translate table for regexes without \\p{...}: only non-ASCII whitespace changes (to \\x0b), because
    llama.cpp's std::wregex \\s does not know it."""

    def __missing__(self, cp):
        v = "\x0b" if cp >= 128 and cp in _WHITESPACE else cp
        self[cp] = v
        return v


_COLLAPSE = _Collapse()
_WIDESPACE = _WideSpace()
_PCAT = re.compile(r"\\p\{(\w+)\}")


def _compile_pretok(expr: str) -> tuple[re.Pattern, bool]:
    """llama.cpp regex -> (Python pattern, runs on the collapsed text?)."""
    collapsed = any(m.group(1) in _CLASS_BODY for m in _PCAT.finditer(expr))
    out, i, inside = [], 0, False
    while i < len(expr):
        c = expr[i]
        if c == "\\":
            m = _PCAT.match(expr, i)
            if m and m.group(1) in _CLASS_BODY:
                body = _CLASS_BODY[m.group(1)]
                out.append(body if inside else f"[{body}]")
                i = m.end()
                continue
            if m:
                raise TokenizerError(f"pre-tokenizer regex uses \\p{{{m.group(1)}}}, which is not supported")
            out.append(expr[i:i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        elif c == "$" and not inside:
            c = r"\Z"   # ECMAScript's $ is the end of the input only; Python's also matches before a final \n
        out.append(c)
        i += 1
    return re.compile("".join(out), re.ASCII), collapsed


# --------------------------------------------------------------------------------------------------------------------
# Pre-tokenizers: tokenizer.ggml.pre -> the regexes llama.cpp applies one after the other, plus its vocabulary flags

_CONTR = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTR + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
           r"|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTR + r"?|[^\r\n\p{L}\p{N}]?"
          r"((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTR + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])"
           r"([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek LLM's letter class (the cased letters of these blocks). Written with escapes where it matters: several
# Greek and letterlike code points here are NFC singletons that an editor or a copy would silently normalise.
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00B5\u00C0-\u00D6\u00D8-\u00F6\u00F8-\u01BA\u01BC-\u01BF\u01C4-\u0293\u0295-\u02AF"
    "\u0370-\u0373\u0376\u0377\u037B-\u037D\u037F\u0386\u0388-\u038A\u038C\u038E-\u03A1\u03A3-\u03F5"
    "\u03F7-\u0481\u048A-\u052F\u0531-\u0556\u10A0-\u10C5\u13A0-\u13F5\u13F8-\u13FD\u1C90-\u1CBA"
    "\u1CBD-\u1CBF\u1D00-\u1D2B\u1D6B-\u1D77\u1D79-\u1D9A"
    "\u1E00-\u1F15\u1F18-\u1F1D\u1F20-\u1F45\u1F48-\u1F4D\u1F50-\u1F57\u1F59\u1F5B\u1F5D\u1F5F-\u1F7D"
    "\u1F80-\u1FB4\u1FB6-\u1FBC\u1FBE\u1FC2-\u1FC4\u1FC6-\u1FCC\u1FD0-\u1FD3\u1FD6-\u1FDB\u1FE0-\u1FEC"
    "\u1FF2-\u1FF4\u1FF6-\u1FFC"
    "\u2102\u2107\u210A-\u2113\u2115\u2119-\u211D\u2124\u2126\u2128\u212A-\u212D\u212F-\u2134\u2139"
    "\u213C-\u213F\u2145-\u2149\u214E\u2183\u2184\u2C00-\u2C7B\u2C7E-\u2CE4\u2CEB-\u2CEE\u2CF2\u2CF3"
    "\uA640-\uA66D\uA680-\uA69B\uA722-\uA76F\uA771-\uA787\uA78B-\uA78E\uAB70-\uABBF\uFB00-\uFB06"
    "\uFB13-\uFB17\uFF21-\uFF3A\uFF41-\uFF5A\U00010400-\U0001044F\U000104B0-\U000104D3\U000104D8-\U000104FB"
    "\U00010C80-\U00010CB2\U00010CC0-\U00010CF2\U000118A0-\U000118DF\U0001E900-\U0001E943")

# name -> (regexes, {flag: value}); flags as llama.cpp sets them for that pre-tokenizer before the GGUF's own keys.
_PRE = {}


def _pre(names, regexes, **flags):
    for n in names.split():
        _PRE[n] = (tuple(regexes), flags)


_pre("default", [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"])
_pre("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2", [_LLAMA3], ignore_merges=True, add_bos=True)
_pre("dbrx smaug-bpe", [_LLAMA3])
_pre("deepseek-llm", ["[\r\n]", r"\s?[" + _DEEPSEEK_LLM_LETTERS + "]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$",
                      "[一-龥ࠀ-一가-퟿]+", r"\p{N}+"])
_pre("deepseek-coder", ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"])
_pre("deepseek-v3", [r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                     r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                     r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"])
_pre("falcon", [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"])
_pre("starcoder refact command-r smollm codeshell exaone minerva-7b", [r"\p{N}", _GPT2])
_pre("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de mpt olmo jais exaone4 trillion granite-docling",
     [_GPT2])
_pre("stablelm2 qwen2 deepseek-r1-qwen megrez hunyuan", [_QWEN2])
_pre("qwen35", [_QWEN35])
_pre("poro-chat bloom gpt3-finnish", [r" ?[^(\s|.,!?…。，、।۔،)]+"])
_pre("chatglm-bpe glm4", [_LLAMA3], bos_id=None)
_pre("viking", [r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"])
_pre("tekken", [_TEKKEN], ignore_merges=True, add_bos=True)
_pre("gpt-4o llama4", [_GPT4O])
_pre("bailingmoe bailingmoe2 llada-moe", [r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+"
                                          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"])
_pre("seed-coder", [_CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"])
_pre("grok-2", [_QWEN2])

PRE_TOKENIZERS = tuple(sorted(_PRE))


@lru_cache(maxsize=None)
def _compiled(pre: str):
    return [_compile_pretok(e) for e in _PRE[pre][0]]


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


_BYTE_CHARS = _bytes_to_unicode()
_BYTE_ENCODE = {b: c for b, c in enumerate(_BYTE_CHARS)}          # latin-1 code point -> BPE character
_BYTE_DECODE = {c: b for b, c in enumerate(_BYTE_CHARS)}
_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def special_id(md: dict, key: str, default: int | None, n_vocab: int) -> int | None:
    """The token id md[key] when it is one of the n_vocab ids, else default when that is one, else None."""
    v = md.get(key)
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n_vocab:
        return v
    return default if default is not None and 0 <= default < n_vocab else None


def _harmony_end(vocab) -> bool:
    """gpt-oss (harmony): <|end|> closes one message, not the answer, when <|return|> and <|call|> exist."""
    return "<|end|>" in vocab and ({"<|return|>", "<|call|>"} <= vocab.keys() or
                                   {"<|calls|>", "<|flush|>"} <= vocab.keys())


def eog_ids_from_metadata(md: dict) -> set[int]:
    """End-of-generation ids by llama.cpp's rule (see EOG_TEXTS), from GGUF metadata alone: the worker needs them
    without building a tokenizer. Metadata without a vocabulary gives the empty set."""
    tokens = md.get("tokenizer.ggml.tokens") or []
    n = len(tokens)
    vocab = dict(zip(reversed(tokens), range(n - 1, -1, -1)))    # the first id of a text, as llama.cpp looks it up
    k = "tokenizer.ggml."
    # Only the ids the metadata declares: llama.cpp would add its per-kind default eos (11 for gpt2, 2 for llama) when
    # the key is missing, but in gpt2 vocabularies that id is ",", and an answer must not end (or lose) its commas.
    ids = {special_id(md, k + "eos_token_id", None, n), special_id(md, k + "eot_token_id", None, n),
           special_id(md, k + "eom_token_id", None, n)}
    ids |= {vocab[t] for t in EOG_TEXTS if t in vocab}
    for key, names in FIM_EOG:
        found = special_id(md, k + key, None, n)
        ids.add(found if found is not None else next((vocab[t] for t in names if t in vocab), None))
    if _harmony_end(vocab):
        ids.discard(vocab["<|end|>"])
    ids.discard(None)
    return ids


# --------------------------------------------------------------------------------------------------------------------

class Tokenizer:
    """A GGUF vocabulary: encode text to ids, decode ids to text, the end-of-generation ids and the chat template."""

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        md = read_gguf_metadata(path)
        try:
            return cls.from_metadata(md)
        except TokenizerError as e:
            raise TokenizerError(f"{Path(path).name}: {e}") from None

    @classmethod
    def from_metadata(cls, md: dict) -> "Tokenizer":
        return cls(md)

    def __init__(self, md: dict):
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("no tokenizer.ggml.model key: this GGUF carries no vocabulary")
        tokens = md.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("no tokenizer.ggml.tokens: this GGUF carries no vocabulary")
        self.model = model
        self.tokens: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = self.n_vocab = len(self.tokens)
        self.vocab: dict[str, int] = dict(zip(self.tokens, range(n)))
        if len(self.vocab) != n:
            seen = {}
            for i, t in enumerate(self.tokens):
                if seen.setdefault(t, i) != i:
                    raise TokenizerError(f"duplicate token in vocabulary: {t!r} has ids {seen[t]} and {i}")
        types = md.get("tokenizer.ggml.token_type") or [1] * n
        scores = md.get("tokenizer.ggml.scores") or [0.0] * n
        if len(types) < n or len(scores) < n:
            raise TokenizerError(f"tokenizer.ggml.token_type or .scores is shorter than the {n} tokens; the file is "
                                 f"damaged: download or convert it again")
        self.attr = [_TYPE_TO_ATTR.get(t, ATTR_UNDEFINED) for t in types[:n]]
        self.scores = [float(x) for x in scores[:n]]
        self.chat_template: str | None = md.get("tokenizer.chat_template")

        self.pre = None
        self.ignore_merges = False
        bos, eos, unk = None, None, None
        if model == "llama":
            self.kind = "spm"
            bos, eos, unk = 1, 2, 0
            self.add_bos, self.add_space_prefix = True, True
        elif model == "gpt2":
            self.kind = "bpe"
            pre = md.get("tokenizer.ggml.pre") or "default"
            if pre not in _PRE:
                raise TokenizerError(f"unknown pre-tokenizer tokenizer.ggml.pre={pre!r} (supported: "
                                     f"{', '.join(PRE_TOKENIZERS)}); this model's vocabulary needs support added "
                                     f"in engine/tokenizer.py")
            self.pre = pre
            flags = _PRE[pre][1]
            self.ignore_merges = flags.get("ignore_merges", False)
            self.add_bos, self.add_space_prefix = flags.get("add_bos", False), False
            bos = eos = 11
            if "bos_id" in flags:
                bos = flags["bos_id"]
            merges = md.get("tokenizer.ggml.merges")
            if merges is None:
                raise TokenizerError("a gpt2 (BPE) vocabulary without tokenizer.ggml.merges; the file is incomplete: "
                                     "convert it again with llama.cpp's convert_hf_to_gguf.py")
            # Keyed by the merge line itself ("left right"): byte-level symbols never hold a space (it is "Ġ"), so
            # looking up left + " " + right finds exactly llama.cpp's pair; reversed so the first duplicate wins.
            self.ranks: dict[str, int] = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
            self._pretok = _compiled(pre)
        else:
            raise TokenizerError(f"tokenizer.ggml.model={model!r} is not supported (only 'gpt2' BPE and 'llama' "
                                 f"SentencePiece vocabularies)")
        self.add_eos = False
        self.add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", self.add_space_prefix))

        def tok_id(key, default):
            return special_id(md, key, default, n)

        self.bos_id = tok_id("tokenizer.ggml.bos_token_id", bos)
        self.eos_id = tok_id("tokenizer.ggml.eos_token_id", eos)
        self.unk_id = tok_id("tokenizer.ggml.unknown_token_id", unk)
        self.eot_id = tok_id("tokenizer.ggml.eot_token_id", None)
        self.eom_id = tok_id("tokenizer.ggml.eom_token_id", None)
        self.pad_id = tok_id("tokenizer.ggml.padding_token_id", None)
        if "tokenizer.ggml.add_bos_token" in md:
            self.add_bos = bool(md["tokenizer.ggml.add_bos_token"])
        if "tokenizer.ggml.add_eos_token" in md:
            self.add_eos = bool(md["tokenizer.ggml.add_eos_token"])
        if self.add_bos and self.bos_id is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true, but there is no valid bos_token_id")
        if self.add_eos and self.eos_id is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is true, but there is no valid eos_token_id")
        self._mark_specials(md)
        self.eog_ids = eog_ids_from_metadata(md)
        # Tokens cut out of the text before the tokenizer proper: longest first, as llama.cpp's cache is sorted.
        self._specials = sorted((i for i, a in enumerate(self.attr)
                                 if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)),
                                key=lambda i: -len(self.tokens[i]))
        name = str(md.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:   # llama.cpp's per-model attributes: Phi-3 eats spaces after specials
            for i in self._specials:
                self.attr[i] |= ATTR_RSTRIP
            for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if t in self.vocab:
                    self.attr[self.vocab[t]] = (self.attr[self.vocab[t]] | ATTR_RSTRIP) if on else \
                        (self.attr[self.vocab[t]] & ~ATTR_RSTRIP)
        self._cache: dict[str, tuple[int, ...]] = {}
        self._spm_pairs: set[str] | None = None

    # ----------------------------------------------------------------------------------------------------------------
    def _mark_specials(self, md: dict) -> None:
        """The eot/eom and FIM tokens that the metadata leaves out, found by text as llama.cpp does; tokens found by
        text become control tokens, so that typed text never produces them. (Which ids end a generation is
        eog_ids_from_metadata's rule.)"""
        def find(keys, names):
            for key in keys:
                v = special_id(md, key, None, self.n_vocab)
                if v is not None:
                    return v
            for t in names:
                if t in self.vocab:
                    self.attr[self.vocab[t]] |= ATTR_CONTROL
                    return self.vocab[t]
            return None

        k = "tokenizer.ggml."
        if self.eot_id is None:
            self.eot_id = find((), ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                                    "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
                                    "<end_of_utterance>"))
        if self.eom_id is None:
            self.eom_id = find((), ("<|eom_id|>",))
        find((k + "fim_pre_token_id", k + "prefix_token_id"),
             ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
              "<|code_prefix|>"))
        find((k + "fim_suf_token_id", k + "suffix_token_id"),
             ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
              "<|code_suffix|>"))
        find((k + "fim_mid_token_id", k + "middle_token_id"),
             ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
              "<|code_middle|>"))
        for key, names in FIM_EOG:
            find((k + key,), names)
        for t in EOG_TEXTS:
            if t in self.vocab:
                self.attr[self.vocab[t]] |= ATTR_CONTROL
        if _harmony_end(self.vocab):
            self.attr[self.vocab["<|end|>"]] = ATTR_USER_DEFINED
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):   # llama.cpp: always rendered
            if t in self.vocab:
                self.attr[self.vocab[t]] = ATTR_USER_DEFINED

    # ----------------------------------------------------------------------------------------------------------------
    def token_text(self, i: int) -> str:
        return self.tokens[i]

    def is_control(self, i: int) -> bool:
        return bool(self.attr[i] & (ATTR_CONTROL | ATTR_UNKNOWN))

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids for text. add_special: BOS/EOS as the vocabulary asks. parse_special: control tokens written in
        the text (e.g. a rendered chat template) become those tokens; keep it False for text a user typed."""
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        frags = self._partition(text, parse_special) if text else []
        if self.kind == "bpe":
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                else:
                    out.extend(self._encode_bpe(f))
        else:
            prev_special = True   # SentencePiece adds its space at the start and after every special token
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    prev_special = True
                else:
                    if self.add_space_prefix and prev_special:
                        f = " " + f
                    out.extend(self._encode_spm(f.replace(" ", _SPM_SPACE)))
                    prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list:
        """Cut special tokens out of the text: a list of str pieces and int ids, in order."""
        frags: list = [text]
        for tid in self._specials:
            a = self.attr[tid]
            if not parse_special and a & (ATTR_CONTROL | ATTR_UNKNOWN):
                continue
            tok = self.tokens[tid]
            if not any(isinstance(f, str) and tok in f for f in frags):
                continue
            out = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    out.append(f)
                    continue
                pos = 0
                while (i := f.find(tok, pos)) >= 0:
                    left = f[pos:i]
                    if a & ATTR_LSTRIP:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        out.append(left)
                    out.append(tid)
                    pos = i + len(tok)
                    if a & ATTR_RSTRIP:
                        while pos < len(f) and f[pos] in _C_SPACE:
                            pos += 1
                if pos < len(f):
                    out.append(f[pos:])
            frags = out
        return frags

    # ---- byte-level BPE --------------------------------------------------------------------------------------------
    def pretokenize(self, text: str) -> list[str]:
        """The words the pre-tokenizer regexes cut the text into (before byte encoding)."""
        spans = [(0, len(text))]
        views = {}
        for pat, collapsed in self._pretok:
            if collapsed not in views:
                views[collapsed] = text.translate(_COLLAPSE if collapsed else _WIDESPACE)
            view = views[collapsed]
            new = []
            for s, e in spans:
                pos = s
                for m in pat.finditer(view, s, e):
                    a, b = m.span()
                    if a == b:
                        continue
                    if a > pos:
                        new.append((pos, a))
                    new.append((a, b))
                    pos = b
                if pos < e:
                    new.append((pos, e))
            spans = new
        return [text[s:e] for s, e in spans]

    def _encode_bpe(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._cache
        for word in self.pretokenize(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(word.encode("utf-8", errors="surrogatepass").decode("latin-1")
                                     .translate(_BYTE_ENCODE))
                if len(cache) < 500_000:
                    cache[word] = ids
            out.extend(ids)
        return out

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        vocab = self.vocab
        if self.ignore_merges and word in vocab:
            return (vocab[word],)
        ranks = self.ranks
        syms = self._merge(list(word), lambda a, b: ranks.get(a + " " + b))
        out = []
        for s in syms:
            i = vocab.get(s)
            if i is not None:
                out.append(i)
            else:   # llama.cpp's fallback: the symbol's single-byte pieces that are tokens (ASCII ones only can be)
                out.extend(vocab[c] for c in s if ord(c) < 128 and c in vocab)
        return tuple(out)

    @staticmethod
    def _merge(syms: list[str], priority) -> list[str]:
        """Merge neighbours by priority (lower first; ties: leftmost) until none can merge; n log n with a heap."""
        n = len(syms)
        if n < 2:
            return syms
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            r = priority(syms[i], syms[i + 1])
            if r is not None:
                heap.append((r, i, i + 1, syms[i] + syms[i + 1]))
        heapq.heapify(heap)
        while heap:
            _r, left, right, text = heapq.heappop(heap)
            a, b = syms[left], syms[right]
            if not a or not b or nxt[left] != right or a + b != text:
                continue   # outdated: one side merged since
            syms[left], syms[right] = text, ""
            nxt[left] = nr = nxt[right]
            if nr >= 0:
                prv[nr] = left
            pl = prv[left]
            if pl >= 0:
                r = priority(syms[pl], text)
                if r is not None:
                    heapq.heappush(heap, (r, pl, left, syms[pl] + text))
            if nr >= 0:
                r = priority(text, syms[nr])
                if r is not None:
                    heapq.heappush(heap, (r, left, nr, text + syms[nr]))
        return [s for s in syms if s]

    # ---- SentencePiece ---------------------------------------------------------------------------------------------
    def _encode_spm(self, text: str) -> list[int]:
        """SentencePiece works on the whole text, but no merge can cross a place where the two characters either
        side occur together in no token: cut there (before a ▁) and the pieces tokenize alone, exactly as in one
        piece, so they can be cached like BPE words and the heap stays small."""
        if self._spm_pairs is None:
            self._spm_pairs = {t[i:i + 2] for t in self.tokens for i in range(len(t) - 1)}
        pairs, cache, out = self._spm_pairs, self._cache, []
        start, i = 0, text.find(_SPM_SPACE, 1)
        while i >= 0 or start < len(text):
            if i < 0:
                i = len(text)
            elif text[i - 1:i + 1] in pairs:
                i = text.find(_SPM_SPACE, i + 1)
                continue
            piece = text[start:i]
            ids = cache.get(piece)
            if ids is None:
                ids = self._spm_piece(piece)
                if len(cache) < 500_000:
                    cache[piece] = ids
            out.extend(ids)
            start, i = i, (text.find(_SPM_SPACE, i + 1) if i < len(text) else -1)
        return out

    def _spm_piece(self, text: str) -> tuple[int, ...]:
        vocab, scores = self.vocab, self.scores

        def priority(a, b):
            i = vocab.get(a + b)
            return None if i is None else -scores[i]   # highest score first

        out = []
        for s in self._merge(list(text), priority):
            i = vocab.get(s)
            if i is not None:
                out.append(i)
            else:
                out.extend(self._byte_token(b) for b in s.encode("utf-8", errors="surrogatepass"))
        return tuple(out)

    def _byte_token(self, b: int) -> int:
        i = self.vocab.get(f"<0x{b:02X}>")
        if i is None:
            i = self.vocab.get(chr(b)) if b < 128 else None
        if i is None:
            raise TokenizerError(f"the vocabulary has no byte token <0x{b:02X}> for a character it cannot spell")
        return i

    # ---- decoding --------------------------------------------------------------------------------------------------
    def token_bytes(self, i: int, special: bool = False) -> bytes:
        """The bytes one token stands for; control tokens give b"" unless special (as llama.cpp's token_to_piece)."""
        a, t = self.attr[i], self.tokens[i]
        if a & (ATTR_CONTROL | ATTR_UNKNOWN):
            return t.encode("utf-8", errors="surrogatepass") if special else b""
        if a & ATTR_USER_DEFINED:
            return t.encode("utf-8", errors="surrogatepass")
        if a & ATTR_NORMAL:
            if self.kind == "spm":
                return t.replace(_SPM_SPACE, " ").encode("utf-8", errors="surrogatepass")
            try:
                return bytes(_BYTE_DECODE[c] for c in t)
            except KeyError:   # a token outside the byte alphabet (malformed vocabulary): its own text
                return t.encode("utf-8", errors="surrogatepass")
        if a & ATTR_BYTE:
            m = _HEX_BYTE.fullmatch(t)
            return bytes([int(m.group(1), 16)]) if m else t.encode("utf-8", errors="surrogatepass")
        return b""

    def decode(self, ids, special: bool = False) -> str:
        """Text for ids. SentencePiece's added leading space (add_space_prefix) is not part of the text: dropped."""
        parts = [self.token_bytes(i, special) for i in ids]
        if self.add_space_prefix:
            for k, i in enumerate(ids):
                if parts[k]:
                    if not self.is_control(i) and parts[k].startswith(b" "):
                        parts[k] = parts[k][1:]
                    break
        return b"".join(parts).decode("utf-8", errors="replace")


class StreamDecoder:
    """Token-by-token decoding that only ever emits whole UTF-8 characters (a multi-byte character split across
    tokens waits until its last byte arrives); the pieces join to exactly decode(all ids)."""

    def __init__(self, tok: Tokenizer, special: bool = False):
        self.tok, self.special = tok, special
        self._buf = b""

    def feed(self, token_id: int) -> str:
        self._buf += self.tok.token_bytes(token_id, self.special)
        cut = _complete_prefix(self._buf)
        text, self._buf = self._buf[:cut], self._buf[cut:]
        return text.decode("utf-8", errors="replace")

    def flush(self) -> str:
        text, self._buf = self._buf, b""
        return text.decode("utf-8", errors="replace")


def _complete_prefix(b: bytes) -> int:
    """Length of b without a trailing, still incomplete UTF-8 sequence."""
    n = len(b)
    for back in range(1, min(4, n) + 1):
        c = b[n - back]
        if c < 0x80:
            return n                     # ASCII: complete
        if c >= 0xC0:                    # a lead byte: does its sequence fit?
            need = 2 if c < 0xE0 else 3 if c < 0xF0 else 4
            return n if back >= need else n - back
    return n                             # only continuation bytes: invalid anyway, let "replace" show it


# --------------------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    """python -m engine.tokenizer VOCAB.gguf < FILE: texts separated by lines __ggml_vocab_test__ in, one line of
    space-separated ids per text out (the fixtures' .inp/.out format; no BOS/EOS, special tokens not parsed)."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m engine.tokenizer", description=main.__doc__)
    ap.add_argument("vocab", help="a .gguf model or vocabulary")
    ap.add_argument("--add-special", action="store_true", help="add BOS/EOS as the vocabulary asks")
    ap.add_argument("--parse-special", action="store_true", help="turn special-token text into special tokens")
    args = ap.parse_args(argv)
    try:
        tok = Tokenizer.from_gguf(args.vocab)
    except TokenizerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    data = sys.stdin.buffer.read().decode("utf-8", errors="surrogateescape")
    texts = data.split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()
    out = sys.stdout
    for t in texts:
        ids = tok.encode(t, add_special=args.add_special, parse_special=args.parse_special)
        out.write("".join(f" {i}" for i in ids) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
