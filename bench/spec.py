"""Speculative decoding's speed: verify windows fed by drafts of a known acceptance, beside plain decode.

    python -m bench.spec [--backend cuda|cpu] [--model M.gguf] [--budgets all,12,8] [--windows 1,2,3,4,5]
                         [--accept 0.5,0.7,0.9] [--prompt 256] [--new 128] [--drafters ngram,mtp] [--out spec.json]

Random weights make a real drafter's acceptance meaningless, so the rows come from the oracle drafter
(engine/drafters/oracle.py): the target's true greedy continuation (a plain run first), each draft right with
probability a. Per budget (CUDA: bench.decode's fresh backend at --vram-budget-mib semantics, after an unmeasured
learning pass; CPU: one row set) and per window length W (tokens a window feeds, FixedWindow) and a: tok/s beside
plain decode, the acceptance and tokens per window measured, and whether the tokens equal plain greedy (they must).
Then each real drafter (n-gram; the MTP block where the model has one and the backend gives hidden rows) at
windows of 4: its own cost per draft token (proposing) and per token followed (observing), its acceptance noted as
what it is on random weights. Where the backend can tell (CPU, through the forward's observer) each window's union
of routed experts: summed over layers, and per token of the window (k per layer without any sharing).
Makes --model with bench.decode's maker (--make-preset/-recipe/-routing) when it is missing (CUDA).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.arch.base import Observer
from engine.drafters.oracle import OracleDrafter
from engine.protocol import GenRequest
from engine.session import Session
from engine.speculate import FixedWindow

ROOT = Path(__file__).resolve().parent.parent


class ExpertUnion(Observer):
    """Each forward's routed experts (the family's router, top-k, recomputed from the FFN's input): the union over
    the call's rows, summed over layers. A forward starts where layer 0's attention input arrives; a verify window,
    which the CPU backend runs as one-token forwards (engine/backend_cpu.py), counts as one call of its rows."""

    def __init__(self, model):
        cfg = model.config
        self.k = cfg.n_expert_used
        self.routers = {}
        for il in range(cfg.n_layer):
            name = f"blk.{il}.ffn_gate_inp.weight"
            if model.has(name):
                bias = f"blk.{il}.ffn_gate_inp.bias"
                self.routers[il] = (model.dequant(name), model.dequant(bias) if model.has(bias) else None)
        self._calls: list[tuple[int, dict]] = []     # (rows, layer -> the experts its rows routed to) per call
        self._pending = 0                           # one-row forwards of the current window still to come

    @property
    def calls(self) -> list[tuple[int, int]]:
        """(rows, union summed over layers) per call."""
        return [(rows, sum(len(ids) for ids in layers.values())) for rows, layers in self._calls]

    @calls.setter
    def calls(self, value) -> None:
        if value:
            raise ValueError("ExpertUnion.calls can only be cleared")
        self._calls, self._pending = [], 0

    def window(self, n):
        self._calls.append((n, {}))
        self._pending = n

    def attention_input(self, il, x):
        if il != 0:
            return
        if self._pending:
            self._pending -= 1
        else:
            self._calls.append((len(x), {}))

    def ffn_input(self, il, x):
        router = self.routers.get(il)
        if router is None or not self._calls:
            return
        w, b = router
        logits = x @ w.T + (b if b is not None else 0.0)
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, :self.k]
        self._calls[-1][1].setdefault(il, set()).update(int(e) for e in ids.ravel())


def timed(be, prompt, n_new, drafter=None, rule=None):
    """One request on a cold cache: (tokens, tok/s of the decode after the first pick, Done, session)."""
    be.truncate(0)
    s = Session(be, eog_ids=(), drafter=drafter, rule=rule)
    lines = []
    done = s.run(GenRequest(n_new, list(prompt)), lines.append)
    if done is None:
        raise RuntimeError(f"the request failed: {lines[-1] if lines else '?'}")
    toks = [int(ln.split()[1]) for ln in lines if ln.startswith("T ")]
    tps = (done.generated - 1) / (done.decode_ms / 1000.0) if done.decode_ms > 0 else float("nan")
    return toks, tps, done, s


def window_rows(be, prompt, n_new, windows, accepts, union=None, seed=0, log=print) -> list[dict]:
    """The oracle's rows on one backend: plain first (window 1), then every (window, a)."""
    V = be.config.n_vocab
    plain, plain_tps, _, _ = timed(be, prompt, n_new)
    truth = list(prompt) + plain
    rows = [dict(window=1, accept=None, tok_s=round(plain_tps, 2), speedup=1.0, acceptance=None,
                 tokens_per_window=1.0, exact=True, **_union(union, 1))]
    for w in windows:
        if w == 1:
            continue
        for a in accepts:
            if union is not None:
                union.calls = []
            toks, tps, done, s = timed(be, prompt, n_new, OracleDrafter(truth, a, V, seed), FixedWindow(w))
            st = s.spec_stats
            rows.append(dict(window=w, accept=a, tok_s=round(tps, 2), speedup=round(tps / plain_tps, 3),
                             acceptance=round(st.accepted / st.offered, 3) if st.offered else None,
                             tokens_per_window=round((done.generated - 1) / st.windows, 3) if st.windows else None,
                             exact=toks == plain, **_union(union, w)))
            log(json.dumps(rows[-1]))
    return rows


def _union(union, w) -> dict:
    """The union figures of the windows just run (forwards of 2..w rows; 1: the plain steps), or nothing."""
    if union is None:
        return {}
    calls = [(r, u) for r, u in union.calls[1:] if (r == 1 if w == 1 else 1 < r <= w)]
    union.calls = []
    if not calls or not union.routers:
        return dict(experts_per_window=None, experts_per_token=None)
    return dict(experts_per_window=round(float(np.mean([u for _, u in calls])), 2),
                experts_per_token=round(float(np.mean([u / r for r, u in calls])), 2),
                experts_unshared=union.k * len(union.routers))


def drafter_rows(be, model, prompt, n_new, names, log=print) -> list[dict]:
    """Each real drafter's own cost at windows of 4 (its acceptance is meaningless on random weights)."""
    from engine.drafters import DraftError, make_drafter
    rows = []
    for name in names:
        try:
            d = make_drafter(name, be, model)
        except DraftError as e:
            rows.append(dict(drafter=name, skipped=str(e)))
            continue
        toks, tps, done, s = timed(be, prompt, n_new, d, FixedWindow(4))
        st = s.spec_stats
        fed = len(prompt) + done.generated
        rows.append(dict(drafter=name, tok_s=round(tps, 2), offered=st.offered, accepted=st.accepted,
                         ms_per_draft=round(1000 * st.propose_s / st.offered, 3) if st.offered else None,
                         ms_per_token_followed=round(1000 * st.observe_s / fed, 4),
                         acceptance_random_weights=round(st.accepted / st.offered, 3) if st.offered else None))
        log(json.dumps(rows[-1]))
    return rows


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text):
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", type=Path, default=None,
                    help="GGUF, made with the --make-* settings when missing (default: bench.decode's "
                         "Qwen3-30B-A3B-shaped model; cpu: an existing file)")
    ap.add_argument("--make-recipe", help="when --model is missing, make it in this llama-quantize recipe")
    ap.add_argument("--make-preset", default="qwen3-30b-a3b")
    ap.add_argument("--make-routing", choices=("trained", "spread"), default="trained")
    ap.add_argument("--budgets", default="all,12,8", help="GiB, comma-separated (cuda); 'all' = no budget")
    ap.add_argument("--windows", default="1,2,3,4,5", help="window lengths in tokens (1 = plain decode)")
    ap.add_argument("--accept", default="0.5,0.7,0.9", help="the oracle's acceptance per draft")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--drafters", default="ngram,mtp", help="real drafters whose own cost to measure ('' none)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, help="the rows as JSON")
    a = ap.parse_args(argv)
    windows, accepts = _ints(a.windows), _floats(a.accept)
    if not windows or min(windows) < 1 or max(windows) > 8:
        raise SystemExit("bench.spec: --windows takes lengths 1 to 8")
    if any(not 0.0 <= x <= 1.0 for x in accepts):
        raise SystemExit("bench.spec: --accept takes probabilities in [0, 1]")
    log = lambda m: print(f"bench.spec: {m}", file=sys.stderr, flush=True)
    from engine.gguf_model import open_model
    path = a.model
    if a.backend == "cpu" and (path is None or not path.is_file()):
        raise SystemExit("bench.spec: --backend cpu needs an existing --model (a tiny one: make_moe --preset tiny)")
    if path is None or not path.is_file():
        from bench.decode import DEFAULT_MODEL, make_model
        path = path or DEFAULT_MODEL
        if not path.is_file():
            make_model(path, recipe=a.make_recipe, routing=a.make_routing, preset=a.make_preset)
    model = open_model(path)
    ctx = a.prompt + a.new + 16
    rng = np.random.default_rng(a.seed)
    prompt = [int(t) for t in rng.integers(0, model.config.n_vocab, a.prompt)]
    names = [n for n in a.drafters.split(",") if n.strip()]
    out = dict(model=str(path), backend=a.backend, prompt=a.prompt, new=a.new, budgets=[])
    budgets = ["all"] if a.backend == "cpu" else a.budgets.split(",")
    profile = Path(tempfile.mkdtemp(prefix="bench-spec-")) / "learned.profile"
    for budget in budgets:
        t0 = time.perf_counter()
        union = None
        if a.backend == "cpu":
            from engine.backend_cpu import CPUBackend
            union = ExpertUnion(model) if model.config.is_moe else None
            be = CPUBackend(model, ctx, observer=union)
        else:
            from bench.decode import fresh_backend
            be = fresh_backend(model, ctx, budget, profile)
            learn = [int(t) for t in rng.integers(0, model.config.n_vocab, a.prompt)]
            timed(be, learn, a.new)             # unmeasured: the adaptive tier learns the routing
        log(f"budget {budget}: backend ready in {time.perf_counter() - t0:.1f} s")
        rows = window_rows(be, prompt, a.new, windows, accepts, union, a.seed, log)
        costs = drafter_rows(be, model, prompt, a.new, names, log) if names else []
        out["budgets"].append(dict(budget=budget, rows=rows, drafters=costs))
        be.close()
        if a.out:
            a.out.write_text(json.dumps(out, indent=1))
    for b in out["budgets"]:
        print(f"\nbudget {b['budget']}: tok/s (speedup over plain), by window and oracle acceptance")
        print("| window | " + " | ".join(f"a={x}" for x in accepts) + " |")
        print("| ---: |" + " ---: |" * len(accepts))
        plain = b["rows"][0]
        print(f"| 1 (plain) | {plain['tok_s']} |" + " |" * (len(accepts) - 1))
        for w in windows:
            if w == 1:
                continue
            cells = [r for r in b["rows"] if r["window"] == w]
            print(f"| {w} | " + " | ".join(f"{r['tok_s']} ({r['speedup']}x)" + ("" if r["exact"] else " NOT EXACT")
                                          for r in cells) + " |")
        for d in b["drafters"]:
            if "skipped" in d:
                text = d["skipped"]
            else:
                cost = f"{d['ms_per_draft']} ms per draft token" if d["offered"] else "no drafts offered"
                text = f"{cost}, {d['ms_per_token_followed']} ms per token followed"
            print(f"drafter {d['drafter']}: {text}")
    bad = [r for b in out["budgets"] for r in b["rows"] if not r["exact"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
