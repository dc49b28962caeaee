"""The RoPE cos/sin table for every position, from the NumPy reference's own rope_tables (ggml's formulas with none /
linear / YaRN scaling), so the kernels only read (cos, sin) at their position and every variant matches the CPU."""
from __future__ import annotations

import numpy as np

from engine.arch.base import rope_tables


def rope_table(cfg, n_pos: int) -> np.ndarray:
    """(n_pos, n_rot/2, 2) float32: cos and sin of each position's angle for each rotated pair, mscale applied."""
    cos, sin = rope_tables(cfg, n_pos)
    return np.ascontiguousarray(np.stack([cos, sin], axis=-1).astype(np.float32))
