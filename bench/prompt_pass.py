"""One prompt read on a warmed CUDA backend, chunk by chunk as the worker's session reads it, and the row the prompt
benches print for it (bench.prefill's table; bench.decode --prefill-prompts adds the same rows): tok/s, the ring's
depth, expert bytes streamed per chunk, the link's rate and the copy engine's busy share, GPU time per phase.
"""
from __future__ import annotations

import time


def read_prompt(be, tracer, prompt, profile=True):
    """The prompt chunk by chunk, as engine/session.py reads it; per-chunk facts from the streamed pass through the
    backend's tracer (a trace.ChunkFacts), with its GPU time per phase when profiling (events between phases only, so
    the chunk's own figures barely move)."""
    be.truncate(0)
    tracer.copy_timing, tracer.phase_timing = True, profile       # the measured prompts only
    chunks = []
    t0 = time.perf_counter()
    step = be.prompt_chunk_size()
    for i in range(0, len(prompt), step):
        part = prompt[i:i + step]
        c0 = time.perf_counter()
        if i + step < len(prompt):
            be.read_ahead(prompt[i + step:i + 2 * step])      # as the session hints the next part
        be.forward(part)                      # returns the last logits on the host: the chunk has finished
        dt = time.perf_counter() - c0
        last = dict(tracer.last)
        runner = last.pop("runner", None)
        timer = last.pop("phases", None)
        window = last.pop("window", None)
        busy = runner.busy_ms() / 1000 if runner is not None and runner.spans else 0.0
        # copying between the first streamed layer's start and the last one's end, and that window's length
        busy_w, win = runner.busy_within_ms(*window) if window is not None else (0.0, 0.0)
        chunks.append(dict(tokens=len(part), s=dt, ring=last["ring"], lent=last.get("lent", 0), bytes=last["bytes"],
                           busy_s=busy, busy_streamed_s=busy_w / 1000, streamed_s=win / 1000,
                           host_ms=last.get("host_ms", 0.0), phases=timer.totals() if timer is not None else None,
                           host={k: last[k] for k in HOST_KEYS if k in last}))
    total = time.perf_counter() - t0
    tracer.copy_timing = tracer.phase_timing = False
    return total, chunks


# Prefill.forward's host split of a chunk (ms) and qwen4exp's PLE rows (families/qwen4exp.py Q4Prompt.host_facts)
HOST_KEYS = ("groups_ms", "begin_ms", "layers_ms", "rows_gather_ms", "rows_wait_ms", "rows_ahead")


def host_split(chunks) -> dict:
    """Per chunk, averaged: the host's ms in each part of Prefill.forward (groups: the expert tables; begin: the
    family's per-chunk inputs, qwen4exp's PLE rows taken or gathered; layers: enqueuing the layers, which blocks
    once the GPU is far enough behind), the PLE gather's own ms (on the worker when ahead) and how long begin spent
    on the rows (all of the gather when not ahead), the chunks whose rows were gathered ahead, and after_ms: from
    the last layer enqueued to the logits on the host (the GPU's backlog then, plus the output head)."""
    n = max(len(chunks), 1)
    out = {k: round(sum(c["host"].get(k, 0.0) for c in chunks) / n, 1) for k in HOST_KEYS if k != "rows_ahead"}
    out["rows_ahead"] = sum(bool(c["host"].get("rows_ahead")) for c in chunks)
    out["after_ms"] = round(sum(1000 * c["s"] - c["host_ms"] for c in chunks) / n, 1)
    return out


def streamed_busy(chunks) -> float:
    """The share of the streamed layers' time (each chunk's first streamed layer's start to its last one's end, on
    the compute stream) the copy engine spent copying: issue 5 wants >= 0.8 at 12 GiB. 0 when nothing streamed."""
    win = sum(c.get("streamed_s", 0.0) for c in chunks)
    return sum(c.get("busy_streamed_s", 0.0) for c in chunks) / win if win else 0.0


def prompt_row(be, tracer, budget, n: int, rng, profile: bool = True) -> dict:
    """Read a random prompt of n tokens on a warmed backend (its tracer a ChunkFacts); the table's row."""
    prompt = rng.integers(0, be.config.n_vocab, n).tolist()
    total, chunks = read_prompt(be, tracer, prompt, profile=profile)
    streamed = [c for c in chunks if c["bytes"]]
    nbytes = sum(c["bytes"] for c in chunks)
    busy = sum(c["busy_s"] for c in chunks)
    row = dict(budget=budget, prompt=n, slots=be.cache.n_slots, experts_total=be.cache.n_total,
               resident=int(be.cache.resident().sum()), chunk=be.prompt_chunk_size(),
               ring=max((c["ring"] for c in chunks), default=0),
               lent=max((c["lent"] for c in chunks), default=0), tok_s=round(n / total, 1),
               chunks=len(chunks), mb_per_chunk=round(nbytes / max(len(streamed), 1) / 1e6, 1),
               link_gbps_copying=round(nbytes / busy / 1e9, 1) if busy else 0.0,
               link_gbps_avg=round(nbytes / total / 1e9, 1),
               copy_busy_share=round(busy / total, 3),
               link_busy_streamed=round(streamed_busy(chunks), 3), first_chunk_s=round(chunks[0]["s"], 3),
               host_ms_per_chunk=round(sum(c["host_ms"] for c in chunks) / len(chunks), 1),
               host_split_ms=host_split(chunks))
    if all(c["phases"] for c in chunks):
        row["phase_ms"] = {p: round(sum(c["phases"][p] for c in chunks), 2) for p in chunks[0]["phases"]}
    return row
