"""Grammar-constrained decoding in the worker: llguidance turns a grammar into a mask of allowed tokens per step.

The server sends the grammar (server/grammar.py builds it from a JSON schema or a tool choice) as GEN's
`grammar=<base64url>` key: the JSON that llguidance's LLMatcher takes ({"grammars": [...]}). Here each request gets a
Constraint over this model's vocabulary: before each pick, mask() gives the allowed tokens as bitmask words (int32,
bit t % 32 of word t // 32, LSB first: llguidance's layout), which the sampler applies on the CPU (apply_mask) or the
GPU (engine/cuda/logits_mask.py); after it, accept() moves the grammar on. A grammar that is complete allows only the
end-of-generation tokens, and `done` ends the request with `stop`.

llguidance reads tokens as bytes, so the vocabulary is handed over as engine/tokenizer.py decodes each id (special
tokens as their text, which no grammar of ours allows except as end of generation).
"""
from __future__ import annotations

import base64
import threading

import numpy as np


class GrammarError(ValueError):
    """The grammar cannot be used (bad encoding, a grammar llguidance refuses, a token it did not allow)."""


def encode(grammar_json: str) -> str:
    """GEN's grammar= value: base64url without padding (no spaces, no '=' to confuse key=value)."""
    return base64.urlsafe_b64encode(grammar_json.encode()).decode().rstrip("=")


def decode(value: str) -> str:
    try:
        return base64.b64decode(value + "=" * (-len(value) % 4), altchars=b"-_", validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        raise GrammarError("grammar= is not base64url of UTF-8 text") from None


def mask_words(n_vocab: int) -> int:
    return (n_vocab + 31) // 32


def apply_mask(logits: np.ndarray, words: np.ndarray) -> np.ndarray:
    """logits with every token whose bit is 0 set to -inf (ids past the mask's words too). The NumPy reference of
    cuda_src/logits_mask.cu's apply_token_mask."""
    n = logits.shape[0]
    bits = np.unpackbits(np.asarray(words, np.int32).view(np.uint8), bitorder="little")[:n].astype(bool)
    out = np.array(logits, dtype=np.float32, copy=True)
    out[: bits.shape[0]][~bits] = -np.inf
    if bits.shape[0] < n:
        out[bits.shape[0]:] = -np.inf
    return out


class Vocabulary:
    """llguidance's view of one model's vocabulary, built once (a second or so for 150k tokens) and shared."""

    def __init__(self, tokenizer, eog_ids):
        import llguidance
        self.n_vocab = int(tokenizer.n_vocab)
        eog = sorted(int(t) for t in eog_ids) or [int(tokenizer.eos_id)]

        class _Wrapped:          # the object llguidance's TokenizerWrapper reads
            eos_token_id = eog[0]
            bos_token_id = tokenizer.bos_id if getattr(tokenizer, "bos_id", None) is not None \
                and tokenizer.bos_id >= 0 else None
            tokens = [tokenizer.token_bytes(i, special=True) for i in range(self.n_vocab)]
            special_token_ids = [i for i in range(self.n_vocab) if tokenizer.is_control(i)]

            def __call__(self, s):
                text = s.decode("utf-8", "replace") if isinstance(s, bytes) else s
                return tokenizer.encode(text, add_special=False, parse_special=False)

        self.lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped()), n_vocab=self.n_vocab,
                                            eos_token=eog)


class Constraint:
    """One request's grammar state."""

    def __init__(self, vocab: Vocabulary, grammar_json: str):
        import llguidance
        self.n_vocab = vocab.n_vocab
        self.matcher = llguidance.LLMatcher(vocab.lltok, grammar_json, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar was refused: {self.matcher.get_error()}")
        self._words = np.zeros(mask_words(self.n_vocab), np.int32)

    def mask(self) -> np.ndarray:
        """The allowed tokens for the next pick, as bitmask words (a fresh array each call)."""
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed: {self.matcher.get_error()}")
        return self._words.copy()

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)) or self.matcher.is_error():
            raise GrammarError(f"token {token} does not follow the grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end of generation may follow."""
        return self.matcher.is_stopped()


class Grammars:
    """Builds Constraints for a worker; the Vocabulary on first use (most requests have no grammar)."""

    def __init__(self, tokenizer_factory, eog_ids):
        self._factory = tokenizer_factory
        self._eog = eog_ids
        self._vocab: Vocabulary | None = None
        self._lock = threading.Lock()

    def __call__(self, value: str) -> Constraint:
        with self._lock:
            if self._vocab is None:
                try:
                    import llguidance  # noqa: F401
                except ImportError:
                    raise GrammarError("grammar-constrained decoding needs llguidance: pip install -r "
                                       "requirements.txt") from None
                self._vocab = Vocabulary(self._factory(), self._eog)
        return Constraint(self._vocab, decode(value))
