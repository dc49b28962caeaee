"""bench/prefetch_predictors.py's scoring (the NumPy decode it scores is minutes long: run by hand)."""
import numpy as np

from bench.prefetch_predictors import hottest, score, topk, variants


def test_score_counts_right_late_copies_and_waste():
    ids = [np.array([[0, 1], [2, 3]]), np.array([[4, 5], [6, 7]])]       # 2 layers, 2 tokens, top-2
    resident = np.zeros((2, 8), dtype=bool)
    resident[1, 4] = True                                               # layer 1's expert 4 in VRAM
    pred = [None, np.array([[4, 0], [6, 7]])]                           # token 0: 4 right (resident), 0 wrong
    s = score(pred, ids, resident)
    assert s["acc"] == 3 / 4                                            # of layer 1's 4 routed, 3 predicted
    # layer 0: all 4 routed experts late (no prediction); layer 1: token 0's 5 (outside VRAM, not predicted)
    assert s["late"] == (4 + 1) / 2
    assert s["copies"] == 3 / 2 and s["wasted"] == 1 / 3               # 0, 6, 7 copied; 0 never routed


def test_hottest_takes_the_most_routed_over_all_layers():
    ids = [np.array([[0, 1], [0, 2]]), np.array([[3, 0], [3, 1]])]
    res = hottest(ids, 4, 2 / 8)
    assert res.sum() == 2 and res[0, 0] and res[1, 3]


def test_variants_predict_every_layer_but_the_first():
    rng = np.random.default_rng(0)
    L, T, E, n, k = 4, 5, 16, 8, 2
    H = [rng.standard_normal((T, n)) for _ in range(L)]
    R = [rng.standard_normal((E, n)) for _ in range(L)]
    W = [np.ones(n) for _ in range(L)]
    prev = [topk(h @ r.T, k) for h, r in zip(H, R)]
    out = dict(variants(H, R, W, prev, k))
    for name, pred in out.items():
        assert pred[0] is None and all(p.shape[0] == T for p in pred[1:]), name
    # with unit norm weights the two depth-2 variants agree; the previous token's routing is passed through
    np.testing.assert_array_equal(out["depth 2, the predicting layer's norm weights"][2],
                                  out["depth 2, the predicted layer's norm weights"][2])
    np.testing.assert_array_equal(out["the previous token's routing"][3], prev[3])
    assert out[f"depth 2, top-{k + 2}"][1].shape == (T, k + 2)
    np.testing.assert_array_equal(out["depth 3, the predicted layer's norm weights"][3], topk(H[0] @ R[3].T, k))
    assert "after layer m-2's experts (layer m-1's attention input)" not in out


def test_the_post_experts_variant_reads_the_attention_input_of_the_layer_between():
    rng = np.random.default_rng(1)
    L, T, E, n, k = 4, 5, 16, 8, 2
    H = [rng.standard_normal((T, n)) for _ in range(L)]
    A = [rng.standard_normal((T, n)) for _ in range(L)]
    R = [rng.standard_normal((E, n)) for _ in range(L)]
    W = [np.full(n, 2.0) for _ in range(L)]
    Wa = [np.full(n, 4.0) for _ in range(L)]
    prev = [topk(h @ r.T, k) for h, r in zip(H, R)]
    out = dict(variants(H, R, W, prev, k, A, Wa))
    pred = out["after layer m-2's experts (layer m-1's attention input)"]
    assert pred[0] is None
    for m in range(1, L):           # A[m-1] re-normed with layer m's FFN weights: scale 2/4, same ranking
        np.testing.assert_array_equal(pred[m], topk(A[m - 1] @ R[m].T, k))


def test_ridge_predictor_recovers_a_linear_map_and_keeps_the_prior():
    from bench.prefetch_predictors import ridge_predictors
    rng = np.random.default_rng(3)
    X = rng.standard_normal((400, 24))
    M1, M0 = rng.standard_normal((6, 24)), rng.standard_normal((6, 24))
    exact, prior, mid = ridge_predictors(X, X @ M1.T, M0, [1e-9, 1e12, 400.0])
    np.testing.assert_allclose(exact, M1, atol=1e-6)
    np.testing.assert_allclose(prior, M0, atol=1e-6)
    # lambda 400: between the two, nearer the data's map
    assert np.abs(mid - M1).max() < np.abs(M0 - M1).max()
    assert np.abs(mid - M0).max() > 0.1


def test_fitted_variants_predict_every_layer_but_the_first():
    from bench.prefetch_predictors import fitted
    rng = np.random.default_rng(4)
    L, E, D, k = 4, 16, 12, 3
    R = [rng.standard_normal((E, D)) for _ in range(L)]
    W = [1 + 0.05 * rng.standard_normal(D) for _ in range(L)]
    P = [rng.standard_normal((60, D)) * w for w in W]
    H = [rng.standard_normal((9, D)) * w for w in W]
    out = fitted(P, H, R, W, k, [1.0, 1e12])
    assert [name.endswith(f"(lambda {lam:g})") for (name, _), lam in zip(out, [1.0, 1e12])] == [True, True]
    for _, pred in out:
        assert pred[0] is None and all(p.shape == (9, k) for p in pred[1:])
    # an infinite lambda is the engine's depth-2 predictor (layer 0's input for layer 1)
    for m in range(1, L):
        src = max(m - 2, 0)
        want = np.argsort(-((H[src] / W[src] * W[m]) @ R[m].T), axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(out[1][1][m], want)
