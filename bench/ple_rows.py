"""The host's share of qwen4exp's n-gram rows, without a GPU: what the CUDA prompt pass does on the host per chunk
(engine/cuda/families/qwen4exp.py Q4Prompt.begin_chunk: ple_ids, then RowsAhead / RowCache.gather into a buffer; the
dequantize is the GPU's) and what a decode step does (ple_rows of one token, dequantized on the host).

    python -m bench.ple_rows --model F.gguf [--tokens 4096,32768] [--reps 5] [--busy-ms 500] [--out rows.json]

Per chunk length, on fresh random tokens each rep (a 64 MiB slab, as the family's): the hash alone, the gather when
asked (cold slab first, then warm), and the gather ahead on RowsAhead's worker while this thread runs --busy-ms of
Python (as the thread that enqueues a chunk's layers): how long take() then waits. Min and median wall ms, and CPU ms
of the process (all threads), over the reps. Then one decode token's rows (median and p90 us over 2,000 tokens).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def _busy(seconds: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sum(range(100))


def _stats(xs) -> dict:
    xs = np.asarray(xs, dtype=float) * 1000
    return dict(min=round(float(xs.min()), 1), median=round(float(np.median(xs)), 1))


def measure(model_path: Path, lengths, reps: int, busy_s: float, decode_tokens: int = 2000, seed: int = 0) -> dict:
    from engine.arch import qwen4exp as ref
    from engine.cuda.families.qwen4exp import ple_ids, ple_rows
    from engine.gguf_model import open_model
    from engine.row_ahead import RowsAhead
    from engine.row_cache import RowCache
    model = open_model(model_path)
    p, n_vocab = model.config.family_params, model.config.n_vocab
    table = model.tensor(ref.PLE_TABLE)
    rng = np.random.default_rng(seed)
    eos = np.full(p.ngram_size - 1, p.ple_eos, np.int64)
    out = dict(model=str(model_path), table_rows=int(table.shape[0]), row_bytes=int(table.data.shape[1]),
               qtype=int(table.qtype), chunks=[])
    for T in lengths:
        rows = RowCache(table, ref.PLE_CACHE_BYTES)
        ahead = RowsAhead(rows, lambda tk, bf: ple_ids(p, tk, bf))
        row = dict(tokens=T, rows=T * p.n_ple_heads)
        hash_s, now_w, now_c, wait, worker = [], [], [], [], []
        try:
            for r in range(reps):
                tok = rng.integers(0, n_vocab, T)
                t0 = time.perf_counter()
                ple_ids(p, tok, eos)
                hash_s.append(time.perf_counter() - t0)
                w, c = time.perf_counter(), time.process_time()
                g = ahead.take(tok, eos)
                now_w.append(time.perf_counter() - w)
                now_c.append(time.process_time() - c)
                if r == 0:
                    row["cold_ms"] = round(now_w[0] * 1000, 1)
                nxt = rng.integers(0, n_vocab, T)
                ahead.ahead(nxt, g.after)
                _busy(busy_s)
                g2 = ahead.take(nxt, g.after)
                assert g2.ahead
                wait.append(g2.wait_s)
                worker.append(g2.gather_s)
        finally:
            ahead.close()
            rows.close()
        row.update(hash_ms=_stats(hash_s), gather_ms=_stats(now_w), gather_cpu_ms=_stats(now_c),
                   busy_ms=round(busy_s * 1000), ahead_wait_ms=_stats(wait), ahead_gather_ms=_stats(worker))
        out["chunks"].append(row)
    rows = RowCache(table, ref.PLE_CACHE_BYTES)
    try:
        before, ts = eos, []
        for _ in range(decode_tokens):
            t0 = time.perf_counter()
            _, before = ple_rows(p, rows, [int(rng.integers(0, n_vocab))], before)
            ts.append(time.perf_counter() - t0)
    finally:
        rows.close()
    ts = np.asarray(ts) * 1e6
    out["decode_token_us"] = dict(median=round(float(np.median(ts)), 1), p90=round(float(np.percentile(ts, 90)), 1))
    return out


def print_table(res: dict) -> None:
    print(f"{res['model']}: {res['table_rows']:,} rows of {res['row_bytes']} bytes (type {res['qtype']})")
    print("| tokens | rows | hash ms | gather when asked ms (cold) | its CPU ms | ahead: take waited ms "
          "| ahead: gather on the worker ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in res["chunks"]:
        f = lambda d: f"{d['min']:.1f} / {d['median']:.1f}"      # noqa: E731
        print(f"| {r['tokens']} | {r['rows']} | {f(r['hash_ms'])} | {f(r['gather_ms'])} ({r['cold_ms']:.1f}) | "
              f"{f(r['gather_cpu_ms'])} | {f(r['ahead_wait_ms'])} (main thread busy {r['busy_ms']} ms) | "
              f"{f(r['ahead_gather_ms'])} |")
    d = res["decode_token_us"]
    print(f"(min / median over the reps) decode: one token's rows {d['median']:.0f} us median, {d['p90']:.0f} us p90")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a qwen4exp GGUF (tools.make_moe --preset "
                    "qwen3.8-flash-next --n-layer 4 makes a real-shape one)")
    ap.add_argument("--tokens", default="4096,32768", help="chunk lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--busy-ms", type=float, default=500.0,
                    help="Python work on this thread while a chunk is gathered ahead")
    ap.add_argument("--decode-tokens", type=int, default=2000)
    ap.add_argument("--out", type=Path, help="the figures as JSON")
    a = ap.parse_args(argv)
    res = measure(a.model, [int(x) for x in a.tokens.split(",")], a.reps, a.busy_ms / 1000, a.decode_tokens)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    print_table(res)


if __name__ == "__main__":
    main()
