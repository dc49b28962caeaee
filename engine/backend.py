"""What the session needs from a backend (cpu: NumPy reference; cuda: CuPy engine).

A backend holds one model and one sequence's KV cache. The session owns prefix reuse and the decode loop; the
backend only runs tokens forward from its current position and picks the next token.

Recurrent state (the hybrids qwen3next / qwen35moe: Gated DeltaNet layers beside attention layers). Such a backend
has `recurrent = True` and keeps, beside the KV cache of its attention layers, each GDN layer's conv state (the
last d_conv-1 inputs of its causal conv1d) and delta state (one S_v x S_v matrix per value head). That state sums
up every position so far and cannot be rewound, so:
- truncate(n) works only for n == n_cached (a no-op) or n == 0 (a cold start: the state is zeroed); any other n
  raises ValueError: the session must restore_state() a snapshot instead.
- snapshot_state() -> RecurrentSnapshot: a copy of the recurrent state at n_cached (snap.n_tokens == n_cached,
  snap.nbytes its size; state_bytes() tells the size before taking one). The snapshot holds no K/V.
- restore_state(snap): the recurrent state becomes the snapshot's and the KV cache is cut to snap.n_tokens
  (n_cached = snap.n_tokens <= the current n_cached). Valid only while KV positions 0..snap.n_tokens-1 still hold
  what they held when the snapshot was taken: a session that rewinds to p drops its snapshots past p.
A backend without recurrent state has `recurrent = False` and may still be driven through the same calls
(snapshot_state() then holds only n_tokens), so a session can treat every model alike.

The pick: decode(tokens, spec, all_positions=False) -> [Pick] runs tokens as forward() does and picks with the
PickSpec (engine/sampling.py): one pick, after the last token, or with all_positions one after each token (a verify
window), the pick after position i exactly what a one-token call with spec.after(tokens[:i]) would return. A grammar
mask limits one pick, so a call with a mask returns one. The backend reads the spec and writes nothing back: the
mask, the penalties and the NaN rule (engine/sampling.py refuse) are applied in one place on each backend. The
default below is the reference (forward, then engine/sampling.py pick); the CUDA backend picks on the GPU.
spec.more is the caller's hint that a one-token call fed this pick will follow: the CUDA backend then launches that
step before it returns this pick (engine/cuda/pipeline.py) and discards it, leaving no trace, on any other call.

Verify windows (engine/speculate.py; the contract: docs/design.md "Speculation"): decode(..., all_positions=True),
`rewinds_windows`, window_cost(n), and hidden() for an MTP drafter.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.sampling import Pick, PickSpec, pick


@dataclass
class RecurrentSnapshot:
    """The recurrent state after the first n_tokens positions; `data` is the backend's own (opaque to the session)."""
    n_tokens: int
    nbytes: int
    data: object = None


@dataclass
class ExpertStats:
    """Counters since the last reset_stats(): the DONE fields that describe where experts came from."""
    hits: int = 0          # expert-cache hits while decoding
    lookups: int = 0       # expert look-ups while decoding
    ram_blobs: int = 0     # experts read from (pinned) RAM
    file_blobs: int = 0    # experts read from the model file (mmap modes)
    file_mb: float = 0.0


# The longest verify window in tokens (the CUDA decode kernels' windows, issue 34, take 1 to 8 tokens a step).
MAX_WINDOW = 8


class Backend:
    name = "base"
    recurrent = False               # True: the model has per-layer recurrent state (see the module docstring)
    rewinds_windows = False         # True: truncate(n) works inside the last window, recurrent state included
    judges_drafts = False           # True: decode() applies the spec's draft distributions (the reference pick)

    def __init__(self, model, max_context: int):
        self.model = model              # engine.gguf_model.GGUFModel
        self.config = model.config      # engine.gguf_model.ModelConfig
        self.max_context = max_context
        self.n_cached = 0               # tokens whose K/V are in the cache, positions 0..n_cached-1

    # --- must implement -------------------------------------------------------------------------------------
    def forward(self, tokens, all_logits: bool = False) -> np.ndarray:
        """Run tokens at positions n_cached.. onward, append their K/V, advance n_cached.

        Returns float32 logits for the last token, shape (n_vocab,), or for every token, (len(tokens), n_vocab).
        """
        raise NotImplementedError

    def truncate(self, n: int) -> None:
        """Forget the K/V of positions >= n (n <= n_cached)."""
        if n > self.n_cached:
            raise ValueError(f"cannot truncate to {n}: only {self.n_cached} cached")
        self.n_cached = n

    # --- recurrent state (a backend with recurrent = True overrides all three) -------------------------------
    def state_bytes(self) -> int:
        """Bytes one snapshot_state() takes (0 without recurrent state): what a checkpoint budget counts."""
        return 0

    def snapshot_state(self) -> RecurrentSnapshot:
        """A copy of the recurrent state at n_cached."""
        return RecurrentSnapshot(self.n_cached, 0)

    def restore_state(self, snap: RecurrentSnapshot) -> None:
        """Go back to the snapshot: recurrent state copied in, K/V of positions >= snap.n_tokens dropped."""
        if snap.n_tokens > self.n_cached:
            raise ValueError(f"cannot restore a snapshot at {snap.n_tokens}: only {self.n_cached} cached")
        self.n_cached = snap.n_tokens

    # --- may override ----------------------------------------------------------------------------------------
    def read_ahead(self, tokens) -> None:
        """A hint: the forward()/decode() call after the next one will start with these tokens, so a backend may
        gather their host-side inputs while the next call runs (the CUDA qwen4exp pass: its n-gram rows). What is
        computed must not depend on it. Nothing here."""

    def prompt_chunk_size(self) -> int:
        """Largest number of prompt tokens forward() takes at once (the session splits prompts by this)."""
        return 256

    def decode(self, tokens, spec: PickSpec, all_positions: bool = False) -> list[Pick]:
        """Feed tokens (as forward), then pick with spec: [the pick after the last token], or with all_positions the
        pick after each token (the module docstring's contract). Raises engine.sampling.SamplingError by its rule."""
        tokens = decode_tokens(tokens, spec, all_positions)
        logits = self.forward(tokens, all_logits=all_positions)
        if not all_positions:
            return [pick(logits, spec, tokens)]
        return [pick(row, spec.after(tokens[:i]), tokens[i:i + 1]) for i, row in enumerate(logits)]

    # --- speculation (the module docstring's verify windows) --------------------------------------------------
    def window_cost(self, n_tokens: int) -> float:
        """One window of n tokens in one-token steps: here one step a token (the CUDA backend's windows for now)."""
        return float(n_tokens)

    def keep_hidden(self, on: bool) -> bool:
        """From now on keep the hidden rows of each call's tokens for hidden(); False: this backend cannot."""
        return False

    def hidden(self) -> np.ndarray:
        """(tokens of the last forward/decode call, n_embd) float32: the last layer's output after the output norm
        (what the vocabulary projection reads; llama.cpp's h_nextn), for an MTP drafter."""
        raise NotImplementedError(f"the {self.name} backend keeps no hidden rows")

    def reset_stats(self) -> None:
        self.stats = ExpertStats()

    def get_stats(self) -> ExpertStats:
        return getattr(self, "stats", ExpertStats())

    def info(self) -> dict:
        """Facts for INFO lines (key -> value without spaces)."""
        return {}

    def request_info(self) -> dict:
        """Facts about the last request for the INFO line before its DONE (counters since reset_stats())."""
        return {}

    def cache_picture(self):
        """(n_layer, n_expert, resident bool array, heat uint8 array) or None: for the CACHE line."""
        return None

    def close(self) -> None:
        """Save what must be saved (e.g. the learned expert profile), free memory."""


def decode_tokens(tokens, spec: PickSpec, all_positions: bool) -> list[int]:
    """decode()'s tokens as ints, after the contract's checks (a backend's decode starts here)."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("decode() needs at least one token")
    if spec.mask is not None and all_positions and len(tokens) > 1:
        raise ValueError("a grammar mask limits one pick: decode a window (all_positions) without a mask, or feed "
                         "one token")
    if spec.drafts and all_positions:
        # the pick after position i judges drafts[i], the window's next token (the last pick may judge one more)
        drafted = [int(t) for t, _ in spec.drafts]
        if len(drafted) > len(tokens) or drafted[:len(tokens) - 1] != tokens[1:len(drafted) + 1]:
            raise ValueError(f"the spec's drafts {drafted} are not the window's tokens after the first "
                             f"{tokens[1:]}")
    return tokens
