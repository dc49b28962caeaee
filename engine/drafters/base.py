"""What every drafter is (engine/drafters/__init__.py says what each does): Draft, the Drafter interface and the
error a drafter the model cannot have raises. Apart from the package, so the drafters import it without the
package's make_drafter importing them back."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class DraftError(ValueError):
    """A drafter this model or backend cannot have; the message says what to choose instead."""


@dataclass
class Draft:
    tokens: list[int]
    probs: list[np.ndarray] | None = None   # the distribution each token was drawn from; None: proposed for sure


class Drafter:
    name = "none"
    needs_hidden = False        # observe() needs the backend's hidden rows (Backend.keep_hidden)

    def rewind(self, n: int) -> None:
        """The session now holds its first n tokens (no more than before)."""

    def observe(self, tokens: list[int], hidden) -> None:
        """The backend read these tokens after the ones held; hidden: their rows (needs_hidden), else None."""

    def propose(self, last: int, k: int, sampler=None) -> Draft:
        """Up to k tokens to follow `last`. sampler (engine/sampling.Sampler): the request's, for a drafter that
        samples its drafts when the request samples."""
        return Draft([])
