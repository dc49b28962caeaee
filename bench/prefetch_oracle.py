"""What a better expert prediction would give the decode prefetch: each step replayed with its copies fed the step's
own routing, all of it or a share of what the prediction missed.

    python -m bench.prefetch_oracle [--model M] [--budget 12] [--prompt 512] [--new 256] [--upgrade 0,0.5,1]

Issue 4's third target, 70% of the PCIe-bound ceiling at 12 GiB, asks how much of the step the link's useful bytes
fill. Two things stand between: the prediction (late bytes wait on the critical path, wrong guesses take link time)
and the overlap (the link idles while the next prediction is not yet made). This bench takes the first away and
measures what is left.

Every decode step runs twice at the same position. First the real graph (as bench.decode: the router launches
predict, the copies follow). Then, per --upgrade q, a graph recorded with the predictions written to a sink
(the tracer's pred_sink, engine/cuda/trace.py), so the copies read `pred` as the bench filled it between the runs:
each layer's prediction from the real run with each wrong guess replaced, with probability q, by a routed expert the guess missed. q = 0 is
the real prediction again (the method's control: its row must match the real one); q = 1 a perfect predictor (layer
0 still copies late: nothing predicts it). Every replay computes the same token (checked) and writes the same KV.

Per row: the step's GPU time (CUDA events around the graph launch: no host time, so the real row runs a little
faster than bench.decode's wall clock), the prediction accuracy the step's own counters saw, MB a token staged, of
them wasted, and copied late, and the ratio to the PCIe-bound ceiling at the real steps' hit rate (missed bytes /
51 GB/s, as bench.decode). The adaptive tier counts every replay's routing (the same routing 1 + len(q) times, so
its order is the real one's) and adapts every adapt_every real steps (the backend's own count).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import astuple
from pathlib import Path

import numpy as np

from bench.decode import DEFAULT_MODEL, PCIE_BPS, free_vram, fresh_backend, make_model, run_pass
from engine.cuda.prefetch import STATS, PrefetchStats
from engine.cuda.trace import Tracer


def upgrade(pred: np.ndarray, actual: np.ndarray, q: float, rng, first: int = 1) -> np.ndarray:
    """pred (n_layer x k ids) with each guess not in the layer's actual routing replaced, with probability q, by a
    routed expert the guess missed (in order); layers before `first` (no prediction) are left as they are."""
    out = np.array(pred, dtype=np.int32, copy=True)
    for m in range(first, out.shape[0]):
        a = actual[m].tolist()
        p = out[m]
        wrong = [j for j in range(len(p)) if int(p[j]) not in a]
        missed = [e for e in a if e not in p.tolist()]
        for j, e in zip(wrong, missed):
            if rng.random() < q:
                p[j] = e
    return out


class _Tally:
    """One row's sums: GPU milliseconds, steps, and the step counters' deltas."""

    def __init__(self):
        self.ms, self.steps, self.hits, self.lookups = 0.0, 0, 0, 0
        self.pf = np.zeros(STATS, dtype=np.int64)      # PrefetchStats' fields
        self.mismatches = 0


class OracleReplays(Tracer):
    """The backend's tracer for this bench: while armed, each real decode step is timed (events around its launch)
    and then, before the position advances, replayed once per q with the oracle graph (module docstring)."""

    def __init__(self):
        self.armed = False

    def arm(self, be, qs: list[float], rng):
        import cupy as cp
        step, pf = be.step, be.step.prefetch
        sink = Tracer()
        sink.pred_sink = cp.zeros_like(pf.pred)     # the oracle graph's router launches predict into the sink,
        self.oracle = step.record("greedy", sink)   # so pred is ours to fill between the runs
        self.qs, self.rng = qs, rng
        self.rows = {"real": _Tally(), **{f"q={q:g}": _Tally() for q in qs}}
        self.a, self.b = cp.cuda.Event(), cp.cuda.Event()
        self.armed = True

    def disarm(self):
        self.armed = False
        self.oracle = None

    @staticmethod
    def counters(be):
        st = be.get_stats()
        return st.hits, st.lookups, np.array(astuple(be.step.prefetch.read_stats()), dtype=np.int64)

    def _tally(self, be, row: _Tally, before) -> None:
        import cupy as cp
        self.b.synchronize()
        h0, l0, c0 = before
        h1, l1, c1 = self.counters(be)
        row.ms += cp.cuda.get_elapsed_time(self.a, self.b)
        row.steps += 1
        row.hits += h1 - h0
        row.lookups += l1 - l0
        row.pf += c1 - c0

    def before_step(self, be):
        if self.armed:
            self.before = self.counters(be)
            self.a.record(be.stream)

    def launched(self, be):
        if self.armed:
            self.b.record(be.stream)

    def after_step(self, be, token: int, pos: int):
        if not self.armed:
            return
        self._tally(be, self.rows["real"], self.before)
        step, pf, s = be.step, be.step.prefetch, be.stream
        nxt, nan = step.result()
        if nan:
            raise SystemExit("bench.prefetch_oracle: the model produced NaN logits")
        with s:
            actual = pf.actual.get(stream=s).reshape(pf.n_layer, pf.top_k)
            pred = pf.pred.get(stream=s).reshape(pf.n_layer, pf.top_k)
        for q in self.qs:
            with s:
                pf.pred.set(upgrade(pred, actual, q, self.rng).reshape(-1), stream=s)
            row = self.rows[f"q={q:g}"]
            before = self.counters(be)
            step.set_inputs(token, pos)
            self.a.record(s)
            self.oracle.launch(s)
            self.b.record(s)
            self._tally(be, row, before)
            out, nan = step.result()
            if nan:
                raise SystemExit("bench.prefetch_oracle: the model produced NaN logits")
            if out != nxt:
                row.mismatches += 1


def oracle_pass(be, prompt: list[int], n_new: int, qs: list[float], seed: int = 0) -> dict:
    """Decode n_new tokens greedily after the prompt, each step as the real graph and then once per q as the oracle
    graph (module docstring); the rows by name ('real', 'q=...'). The backend must have been built with an
    OracleReplays tracer. The adaptive tier runs as the backend's options say, counted in real steps."""
    from engine.sampling import PickSpec

    tracer = be.tracer
    if not isinstance(tracer, OracleReplays):
        raise SystemExit("bench.prefetch_oracle: build the backend with tracer=OracleReplays()")
    if be.step.prefetch is None:
        raise SystemExit("bench.prefetch_oracle: the decode step does not prefetch here (every expert has a VRAM "
                         "slot, or --tune prefetch=off): use a smaller --budget")
    if be.mem:
        raise SystemExit("bench.prefetch_oracle: the memory modes decode layer by layer, not in the one graph")
    be.truncate(0)
    greedy = PickSpec()
    tok = be.decode(prompt, greedy)[0].id
    tracer.arm(be, qs, np.random.default_rng(seed))
    try:
        for _ in range(n_new - 1):
            tok = be.decode([tok], greedy)[0].id
    finally:
        rows = tracer.rows
        tracer.disarm()
    return rows


def summarize(rows: dict, blob: int) -> list[dict]:
    """The table's rows: tok/s from the GPU time, the accuracy the counters saw, MB a token, the ratio to the PCIe
    ceiling at the real rows' hit rate."""
    base = rows["real"]
    miss = (base.lookups - base.hits) * blob / max(base.steps, 1)
    ceiling = PCIE_BPS / miss if miss else float("inf")
    out = []
    for name, r in rows.items():
        ps = PrefetchStats.from_counters(r.pf)
        tps = 1000.0 * r.steps / r.ms if r.ms else 0.0
        acc_n, acc_d = ps.correct + ps.correct2, ps.predicted + ps.predicted2
        link = (r.lookups - r.hits) * blob / max(r.steps, 1) + (ps.staged - ps.used) * blob / max(r.steps, 1)
        out.append(dict(row=name, steps=r.steps, tok_s=round(tps, 1), step_ms=round(r.ms / max(r.steps, 1), 3),
                        hit_rate=round(r.hits / max(r.lookups, 1), 4),
                        pred_accuracy=round(acc_n / acc_d, 4) if acc_d else None,
                        **{key: v for key, v in ps.summary(blob, r.steps).items()
                           if key in ("prefetch_mb_per_token", "prefetch_wasted", "late_mb_per_token")},
                        link_mb_per_token=round(link / 1e6, 2), of_pcie_ceiling=round(tps / ceiling, 3),
                        pcie_ceiling_tok_s=round(ceiling, 1), mismatches=r.mismatches))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--budget", type=float, default=12.0, help="VRAM budget, GiB")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--adapt-every", type=int, default=32)
    ap.add_argument("--upgrade", default="0,0.5,1", help="shares q of the wrong guesses made right, comma-separated")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    qs = [float(q) for q in a.upgrade.split(",") if q.strip()]
    if a.new < 2 or a.prompt < 1 or not all(0.0 <= q <= 1.0 for q in qs) or a.budget <= 0:
        raise SystemExit("bench.prefetch_oracle: --prompt >= 1, --new >= 2, --budget > 0, --upgrade shares in [0, 1]")

    import shutil
    import tempfile

    from engine.gguf_model import open_model
    if not a.model.is_file():
        make_model(a.model)
    model = open_model(a.model)
    ctx = a.prompt + a.new + 16
    profile = Path(tempfile.mkdtemp(prefix="bench-oracle-")) / "learned.profile"
    rng = np.random.default_rng(a.seed)
    t0 = time.perf_counter()
    try:
        # as bench.decode: the routing learned with everything resident (the profile its close saves), then a
        # learning pass at the budget
        be = fresh_backend(model, ctx, "all", profile, adapt_every=a.adapt_every)
        try:
            run_pass(be, rng, a.prompt, a.new)
        finally:
            be.close()
        be = fresh_backend(model, ctx, str(a.budget), profile, OracleReplays(), adapt_every=a.adapt_every,
                           calibrate=True, prefetch=True)
        try:
            run_pass(be, rng, a.prompt, a.new)
            print(f"bench.prefetch_oracle: {be.cache.n_slots} of {be.cache.n_total} experts in VRAM, learned in "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            prompt = rng.integers(0, model.config.n_vocab, size=a.prompt).tolist()
            rows = summarize(oracle_pass(be, prompt, a.new, qs, a.seed), be.layout.nbytes)
        finally:
            be.close()
    finally:
        free_vram()
        shutil.rmtree(profile.parent, ignore_errors=True)
    for r in rows:
        print(f"bench.prefetch_oracle: {json.dumps(r)}", file=sys.stderr, flush=True)
    cols = ("row", "tok_s", "pred_accuracy", "prefetch_mb_per_token", "prefetch_wasted", "late_mb_per_token",
            "link_mb_per_token", "of_pcie_ceiling", "mismatches")
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
