"""bench.residual_similarity's measure on rows whose answer is known (CPU)."""
import numpy as np

from bench.residual_similarity import similarity


def test_identical_layers_agree_fully_and_unrelated_ones_by_chance():
    rng = np.random.default_rng(0)
    same = [rng.standard_normal((50, 64))] * 5
    cos, overlap = similarity(same, 2, np.random.default_rng(1))
    assert abs(cos - 1) < 1e-12 and overlap == 1.0
    unrelated = [rng.standard_normal((400, 64)) for _ in range(5)]
    cos, overlap = similarity(unrelated, 2, np.random.default_rng(1))
    assert abs(cos) < 0.05 and abs(overlap - 8 / 128) < 0.02      # 8 of 128 ids shared by chance
    # a layer that is half the one two below it and half its own: in between, as its cosine says
    base = rng.standard_normal((400, 64))
    mixed = [base, base, base + rng.standard_normal((400, 64)), base, base]
    cos, overlap = similarity(mixed, 1, np.random.default_rng(1))
    assert 0.6 < cos < 0.95 and 8 / 128 < overlap < 1.0
