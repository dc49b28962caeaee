"""What the session needs from a backend (cpu: NumPy reference; cuda: CuPy engine).

A backend holds one model and one sequence's KV cache. The session owns prefix reuse and the decode loop; the
backend only runs tokens forward from its current position and picks the next token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ExpertStats:
    """Counters since the last reset_stats(): the DONE fields that describe where experts came from."""
    hits: int = 0          # expert-cache hits while decoding
    lookups: int = 0       # expert look-ups while decoding
    ram_blobs: int = 0     # experts read from (pinned) RAM
    file_blobs: int = 0    # experts read from the model file (mmap modes)
    file_mb: float = 0.0


class Backend:
    name = "base"

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

    # --- may override ----------------------------------------------------------------------------------------
    def prompt_chunk_size(self) -> int:
        """Largest number of prompt tokens forward() takes at once (the session splits prompts by this)."""
        return 256

    def next_token(self, tokens, sampler) -> int:
        """Feed tokens, sample the next id. The CUDA backend overrides this to sample on the GPU."""
        return sampler.sample(self.forward(tokens))

    def reset_stats(self) -> None:
        self.stats = ExpertStats()

    def get_stats(self) -> ExpertStats:
        return getattr(self, "stats", ExpertStats())

    def info(self) -> dict:
        """Facts for INFO lines (key -> value without spaces)."""
        return {}

    def cache_picture(self):
        """(n_layer, n_expert, resident bool array, heat uint8 array) or None: for the CACHE line."""
        return None

    def close(self) -> None:
        """Save what must be saved (e.g. the learned expert profile), free memory."""
