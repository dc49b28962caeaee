"""Expert profiles (docs/design.md: files): which experts to keep in VRAM, hottest first.

File (.bin, little-endian): b"STRP", uint32 version=1, n_layers, n_expert, n_ranked, n_ranked; then n_ranked pairs of
(uint16 layer, uint16 expert), hottest first; then int32 ranks[n_layers * n_expert] (-1 = not ranked). A file is
valid only when it holds all of that; saving writes a temporary file and renames it over the target, so a crash
never leaves half a profile.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"STRP"
VERSION = 1
_HEAD = struct.Struct("<4s5I")


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file and what to do."""


@dataclass
class ExpertProfile:
    n_layers: int
    n_expert: int
    order: np.ndarray          # (n_ranked, 2) uint16: (layer, expert), hottest first

    def ranks(self) -> np.ndarray:
        r = np.full(self.n_layers * self.n_expert, -1, dtype=np.int32)
        r[self.flat_order()] = np.arange(len(self.order), dtype=np.int32)
        return r

    def flat_order(self) -> np.ndarray:
        """Global expert ids (layer * n_expert + expert), hottest first."""
        return self.order[:, 0].astype(np.int64) * self.n_expert + self.order[:, 1].astype(np.int64)


def from_flat(n_layers: int, n_expert: int, flat_ids) -> ExpertProfile:
    flat = np.asarray(flat_ids, dtype=np.int64)
    if len(np.unique(flat)) != len(flat):
        raise ValueError("an expert profile ranks each expert at most once")
    order = np.stack([flat // n_expert, flat % n_expert], axis=1).astype(np.uint16)
    return ExpertProfile(n_layers, n_expert, order)


def save_profile(path, prof: ExpertProfile) -> None:
    path = Path(path)
    n = len(prof.order)
    data = (_HEAD.pack(MAGIC, VERSION, prof.n_layers, prof.n_expert, n, n)
            + np.ascontiguousarray(prof.order, dtype="<u2").tobytes()
            + prof.ranks().astype("<i4").tobytes())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_profile(path, n_layers: int | None = None, n_expert: int | None = None) -> ExpertProfile:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ProfileError(f"cannot read the expert profile {path} ({e.strerror}); check --expert-profile") from None
    if len(data) < _HEAD.size or data[:4] != MAGIC:
        raise ProfileError(f"{path} is not a Strata expert profile (no STRP header); check --expert-profile")
    _, version, nl, ne, n1, n2 = _HEAD.unpack_from(data)
    if version != VERSION or n1 != n2:
        raise ProfileError(f"{path}: profile version {version} is not readable here (expected {VERSION}); "
                           f"delete it and let the engine learn a new one")
    need = _HEAD.size + 4 * n1 + 4 * nl * ne
    if len(data) != need:
        raise ProfileError(f"{path} is truncated or damaged ({len(data)} bytes, expected {need}); delete it and "
                           f"let the engine learn a new one")
    if (n_layers is not None and nl != n_layers) or (n_expert is not None and ne != n_expert):
        raise ProfileError(f"{path} was made for {nl} layers x {ne} experts, this model has {n_layers} x "
                           f"{n_expert}; use the profile made for this model")
    order = np.frombuffer(data, dtype="<u2", count=2 * n1, offset=_HEAD.size).reshape(n1, 2).astype(np.uint16)
    if n1 and (order[:, 0].max() >= nl or order[:, 1].max() >= ne):
        raise ProfileError(f"{path} names an expert outside {nl} x {ne}; the file is damaged")
    return ExpertProfile(nl, ne, order)
