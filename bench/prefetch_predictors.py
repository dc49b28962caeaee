"""Expert-prediction variants for the decode prefetch, scored offline against the NumPy backend's own routing.

    python -m bench.prefetch_predictors [--model M] [--prompt 128] [--new 192] [--cache 0.71,0.85] [--fit-lambda L,..]

engine/cuda/prefetch.py predicts layer m's experts from layer m-2's FFN input (depth 2) and copies the predicted
experts that have no VRAM slot; the routed experts it missed are copied late, on the critical path. Which predictor
misses fewest is a question about the model's hidden states, not the GPU: here the NumPy backend decodes a random
prompt, every MoE layer's normed FFN input is recorded, and each variant is scored against the routing those inputs
give, with a static cache holding the hottest --cache share of the experts (as the adaptive tier would after a
while). Per variant: the share of the k routed experts predicted (acc), the late misses a token (routed, not in the
cache, not predicted; layer 0 has no prediction, so all of its misses are late), the copies a token (predicted, not
in the cache) and the share of them never routed.

The default model is bench.decode's Qwen3-30B-A3B shape cut to 12 layers (made here with tools/make_moe.py when it
is not there: 4.6 GB), since the NumPy backend decodes the 48-layer one at ~15 s a token on two cores (this one ~4 s).
Only routers on blk.N.ffn_gate_inp.weight with plain top-k (qwen3moe, mixtral) are scored.

--fit-lambda adds learned predictors: per layer, a matrix of the router's shape fitted (ridge, toward the engine's
predictor) to map the prompt's FFN inputs two layers back to the router logits they led to, scored on the decoded
rows like the rest. It would cost the step nothing (the same kernel, other rows); on this synthetic model it gains
nothing either (the note of the commit that added it has the figures).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "data" / "models" / "qwen3-30b-a3b-q4k-g3-12l.gguf"
BONUS = (0.25, 0.5, 1.0)      # the previous token's experts' logits raised by these many standard deviations


def record(model, n_prompt: int, n_new: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every MoE layer's normed FFN input and normed attention input (the residual after the layer before's experts),
    one row a token (prompt rows first), greedy decode of a random prompt."""
    from engine.arch.base import Observer
    from engine.backend_cpu import CPUBackend
    rows: list[list[np.ndarray]] = [[] for _ in range(model.config.n_layer)]
    att_rows: list[list[np.ndarray]] = [[] for _ in range(model.config.n_layer)]

    class Inputs(Observer):
        def attention_input(self, il, x):
            att_rows[il].append(np.array(x, dtype=np.float32))

        def ffn_input(self, il, x):
            rows[il].append(np.array(x, dtype=np.float32))

    be = CPUBackend(model, n_prompt + n_new + 8, expert_cache_mb=3000, observer=Inputs())
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    tok = int(np.argmax(be.forward(rng.integers(0, model.config.n_vocab, size=n_prompt).tolist())))
    for i in range(n_new):
        tok = int(np.argmax(be.forward([tok])))
        if i % 32 == 31:
            print(f"bench.prefetch_predictors: {i + 1}/{n_new} tokens, {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    be.close()
    return [np.concatenate(r) for r in rows], [np.concatenate(r) for r in att_rows]


def topk(logits: np.ndarray, n: int) -> np.ndarray:
    """The n largest per row, ties to the lower id (as the routers rank)."""
    return np.argsort(-logits, axis=-1, kind="stable")[:, :n]


def hottest(ids: list[np.ndarray], n_expert: int, share: float) -> np.ndarray:
    """(layers, experts) bool: the hottest share of all experts by how often they were routed, over every layer."""
    cnt = np.zeros((len(ids), n_expert))
    for li, a in enumerate(ids):
        np.add.at(cnt[li], a.reshape(-1), 1)
    order = np.argsort(-cnt.reshape(-1), kind="stable")
    res = np.zeros(cnt.size, dtype=bool)
    res[order[:int(share * cnt.size)]] = True
    return res.reshape(cnt.shape)


def score(pred: list[np.ndarray | None], ids: list[np.ndarray], resident: np.ndarray) -> dict:
    """pred[m]: (tokens, n) predicted experts of layer m (None: no prediction, layer 0); ids[m]: (tokens, k) routed."""
    k = ids[0].shape[1]
    n_tok = ids[0].shape[0]
    right = late = copies = wasted = predicted = 0
    for m, (p, a) in enumerate(zip(pred, ids)):
        for t in range(n_tok):
            routed = set(a[t].tolist())
            guess = set() if p is None else set(p[t].tolist())
            if p is not None:
                right += len(guess & routed)
                predicted += k
            late += sum(1 for e in routed if not resident[m, e] and e not in guess)
            c = [e for e in guess if not resident[m, e]]
            copies += len(c)
            wasted += sum(1 for e in c if e not in routed)
    return dict(acc=right / max(predicted, 1), late=late / n_tok, copies=copies / n_tok,
                wasted=wasted / max(copies, 1))


def ridge_predictors(X: np.ndarray, Y: np.ndarray, M0: np.ndarray, lams: list[float]) -> list[np.ndarray]:
    """Per lambda, M (experts x n_embd) minimising |X M^T - Y|^2 + lam |M - M0|^2: the engine's predictor M0 (a
    router's rows scaled by the predicted layer's norm weights) corrected by the rows X (normed FFN inputs, no norm
    weights) and the router logits Y they should have predicted. The Gram matrix is formed once for all lambdas."""
    G, B = X.T @ X, X.T @ (Y - X @ M0.T)
    eye = np.eye(X.shape[1])
    return [M0 + np.linalg.solve(G + lam * eye, B).T for lam in lams]


def fitted(P: list[np.ndarray], H: list[np.ndarray], R: list[np.ndarray], W: list[np.ndarray], k: int,
           lams: list[float]):
    """(name, pred per layer): depth 2 (layer 0 for layer 1) through ridge_predictors fitted on the prompt's rows P
    (normed FFN inputs, as H) for each lambda: whether a learned linear predictor, the same size and kernel as the
    router, would beat the predicted layer's own router."""
    preds: list[list] = [[None] for _ in lams]
    for m in range(1, len(H)):
        src = max(m - 2, 0)
        x = H[src] / W[src]
        for pred, M in zip(preds, ridge_predictors(P[src] / W[src], P[m] @ R[m].T, R[m] * W[m], lams)):
            pred.append(topk(x @ M.T, k))
    return [(f"depth 2, ridge-fitted on the prompt's rows (lambda {lam:g})", pred) for lam, pred in zip(lams, preds)]


def variants(H: list[np.ndarray], R: list[np.ndarray], W: list[np.ndarray], prev_ids: list[np.ndarray], k: int,
             A: list[np.ndarray] | None = None, Wa: list[np.ndarray] | None = None):
    """(name, pred per layer) for the rows of H (H[l]: layer l's FFN inputs normed with its weights W[l]; R[m]: the
    routers; prev_ids[m]: layer m's routing of the token before each row; A[l], Wa[l]: layer l's attention inputs,
    normed with its attention norm weights, when recorded)."""
    L = len(H)

    def logits(m, depth, own_norm=True):
        src = max(m - depth, 0)
        x = H[src] / W[src] * W[m] if own_norm else H[src]
        return x @ R[m].T

    def per_layer(f):
        return [None] + [f(m) for m in range(1, L)]

    def prev(m):
        return prev_ids[m]

    out = [("depth 2, the predicting layer's norm weights", per_layer(lambda m: topk(logits(m, 2, False), k))),
           ("depth 2, the predicted layer's norm weights", per_layer(lambda m: topk(logits(m, 2), k))),
           ("depth 1, the predicted layer's norm weights", per_layer(lambda m: topk(logits(m, 1), k))),
           ("the previous token's routing", per_layer(prev))]
    for beta in BONUS:
        def bonus(m, beta=beta):
            lg = logits(m, 2)
            b = np.zeros_like(lg)
            np.put_along_axis(b, prev(m), 1.0, axis=1)
            return topk(lg + beta * lg.std(axis=1, keepdims=True) * b, k)
        out.append((f"depth 2 + {beta:g} sd for the previous token's", per_layer(bonus)))
    out.append((f"depth 2, top-{k + 2}", per_layer(lambda m: topk(logits(m, 2), k + 2))))
    out.append(("depth 3, the predicted layer's norm weights", per_layer(lambda m: topk(logits(m, 3), k))))
    if A is not None:
        # the residual once layer m-2's experts have added to it (layer m-1's attention input): later than depth 2
        # (after layer m-2's experts, not its router), earlier than depth 1
        out.append(("after layer m-2's experts (layer m-1's attention input)",
                    per_layer(lambda m: topk((A[m - 1] / Wa[m - 1] * W[m]) @ R[m].T, k))))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=192)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cache", default="0.71,0.85", help="shares of the experts held in VRAM, comma-separated")
    ap.add_argument("--fit-lambda", default="",
                    help="also score ridge-fitted predictors (fitted on the prompt's rows: give --prompt well above "
                         "n_embd) for these lambdas, comma-separated")
    a = ap.parse_args(argv)
    shares = [float(s) for s in a.cache.split(",")]
    lams = [float(s) for s in a.fit_lambda.split(",") if s.strip()]
    if a.new < 2 or a.prompt < 1 or not all(0.0 <= s <= 1.0 for s in shares):
        raise SystemExit("bench.prefetch_predictors: --prompt >= 1, --new >= 2, --cache shares in [0, 1]")

    from engine.arch.base import route
    from engine.gguf_model import open_model
    if not a.model.is_file():
        from bench.decode import make_model
        make_model(a.model, n_layer=12)
    model = open_model(a.model)
    cfg = model.config
    names = [f"blk.{li}.ffn_gate_inp.weight" for li in range(cfg.n_layer)]
    if not cfg.n_expert or not all(model.has(n) for n in names):
        raise SystemExit(f"bench.prefetch_predictors: {a.model} has no router on every layer")

    R32 = [model.dequant(n) for n in names]
    R = [r.astype(np.float64) for r in R32]
    W = [model.dequant(f"blk.{li}.ffn_norm.weight").astype(np.float64) for li in range(cfg.n_layer)]
    k = cfg.n_expert_used
    # the decode rows and the prompt's last (the token before the first decoded one), and the routing they give: the
    # backend's own (its float32 logits, engine.arch.base.route)
    ffn_in, att_in = record(model, a.prompt, a.new, a.seed)
    H32 = [h[a.prompt - 1:] for h in ffn_in]
    A = [h[a.prompt:].astype(np.float64) for h in att_in]
    Wa = [model.dequant(f"blk.{li}.attn_norm.weight").astype(np.float64) for li in range(cfg.n_layer)]
    all_ids = [route(h @ r.T, k, cfg.expert_weights_norm)[0] for h, r in zip(H32, R32)]
    H = [h[1:].astype(np.float64) for h in H32]
    P = [h[:a.prompt - 1].astype(np.float64) for h in ffn_in]     # the prompt's rows but its last: the fits' data
    ids, prev_ids = [i[1:] for i in all_ids], [i[:-1] for i in all_ids]
    print(f"model {a.model.name}: {cfg.n_layer} layers, {cfg.n_expert} experts, top-{k}; prompt {a.prompt}, "
          f"{a.new} decoded tokens scored")
    fits = fitted(P, H, R, W, k, lams) if lams else []
    for share in shares:
        res = hottest(ids, cfg.n_expert, share)
        missed = sum(int((~res[m][a_]).sum()) for m, a_ in enumerate(ids)) / len(ids[0])
        print(f"\ncache {share:g} of the experts: hit rate {1 - missed / (cfg.n_layer * k):.3f}, "
              f"{missed:.2f} missed a token")
        print("| predictor | acc | late a token | copies a token | wasted |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, pred in variants(H, R, W, prev_ids, k, A, Wa) + fits:
            s = score(pred, ids, res)
            print(f"| {name} | {s['acc']:.3f} | {s['late']:.2f} | {s['copies']:.2f} | {s['wasted']:.2f} |")


if __name__ == "__main__":
    main()
