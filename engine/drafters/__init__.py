"""Drafters for speculative decoding (engine/speculate.py): what proposes the tokens a verify window checks.

A drafter follows the sequence the session's backend holds: observe(tokens, hidden) after every call that fed
tokens (prompt chunks, windows: the kept part), rewind(n) when the session cuts back to n tokens, and propose(last,
k, sampler) for up to k tokens to follow `last` (the pick not yet fed). Drafts only cost time: whatever a drafter
proposes, the output is the target's (engine/sampling.py).

    ngram   prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n-gram
    mtp     the MTP (nextn) block of qwen3next / qwen35moe files, with its own KV cache (needs hidden rows)
    oracle  benchmarks and tests only: the true continuation with probability a per token (engine/drafters/oracle.py)

make_drafter(name, backend, model) builds the worker's --draft choice: off, ngram, mtp or auto (mtp where the model
has a block this engine runs and the backend gives hidden rows, else ngram).
"""
from __future__ import annotations

from engine.drafters.base import Draft, DraftError, Drafter  # noqa: F401  (the package's names)

CHOICES = ("off", "ngram", "mtp", "auto")


def make_drafter(name: str, backend, model, sampled: bool = False) -> Drafter | None:
    """The worker's --draft: None for off; raises DraftError for a drafter this model or backend cannot have.
    sampled: the MTP drafter draws its drafts when a request samples (engine/drafters/mtp.py)."""
    if name not in CHOICES:
        raise DraftError(f"--draft {name!r}: choose one of {', '.join(CHOICES)}")
    if name == "off":
        return None
    from engine.drafters.ngram import NgramDrafter
    if name == "ngram":
        return NgramDrafter()
    from engine.drafters.mtp import MTPDrafter, mtp_unsupported
    why = mtp_unsupported(backend, model)
    if why is None:
        return MTPDrafter.for_backend(backend, model, sampled)
    if name == "mtp":
        raise DraftError(f"--draft mtp: {why}; use --draft ngram")
    return NgramDrafter()
