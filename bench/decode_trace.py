"""Where a decode step's time goes at one VRAM budget: a kernel timeline of a few steps, summarized per stream.

    python -m bench.decode_trace [--budget 12] [--steps 16] [--prefetch on|off] [--prefetch-depth 1|2]
                                 [--fetch-misses on|off] [--pipeline on|off] [--trace trace.json]

bench.decode's per-kind profile replays a graph of one kind of kernel at a time, so it cannot show what the step
waits on when experts cross PCIe: the main stream idling until a prefetch copy lands, a copy idling until the next
prediction exists. Here CUPTI (through PyTorch's profiler, which sees every kernel of the process, CuPy's graph
nodes included) records each kernel's start, end and stream over a few replayed steps of the real graph. Printed:
per stream its busy time per step; per kernel name its time per step and the main stream's idle time right before
it (what that kernel waited for: an event from the copy stream, or the host); the copy kernel's rate; the host gap
per step: the main stream's idle time between one step's last kernel and the next step's first (its embed), which
the decode pipeline (engine/cuda/pipeline.py, --pipeline) exists to remove.
Needs PyTorch (the GPU machine has it); the model is bench.decode's.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from bench.decode import DEFAULT_MODEL, free_vram, fresh_backend, make_model, run_pass


def short(name: str) -> str:
    """A kernel's readable name: a mangled one's identifier (_Z<length><identifier>...), else the text up to its
    template or argument list."""
    m = re.match(r"_Z(\d+)", name)
    if m:
        return name[m.end():m.end() + int(m.group(1))]
    return re.split(r"[(<]", name.replace("void ", ""))[0].strip()


def kernels_of(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]


def summarize(ev: list[dict], steps: int) -> list[str]:
    by_stream = defaultdict(list)
    for e in ev:
        by_stream[e["args"].get("stream", -1)].append(e)
    main = max(by_stream, key=lambda s: len(by_stream[s]))
    span = (max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev))
    out = [f"{len(ev)} kernels over {span / 1e3:.2f} ms ({steps} steps: {span / steps:.0f} us a step, host gaps "
           "between steps included)", "", "| stream | kernels/step | busy us/step |", "| --- | ---: | ---: |"]
    for s, es in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        out.append(f"| {s}{' (main)' if s == main else ''} | {len(es) / steps:.0f} | "
                   f"{sum(e['dur'] for e in es) / steps:.0f} |")
    tot, idle, cnt = defaultdict(float), defaultdict(float), defaultdict(int)
    ms = sorted(by_stream[main], key=lambda e: e["ts"])
    gaps = host_gaps(ms)
    if gaps:
        out.insert(1, f"host gap between steps (main stream idle before each step's embed): mean {np.mean(gaps):.0f} "
                      f"us, max {np.max(gaps):.0f} us over {len(gaps)} gaps")
    for prev, e in zip([None] + ms[:-1], ms):
        n = short(e["name"])
        tot[n] += e["dur"]
        cnt[n] += 1
        if prev is not None:
            gap = e["ts"] - (prev["ts"] + prev["dur"])
            if gap < 200:            # longer: the host between steps (reading the token), not a wait inside the step
                idle[n] += max(0.0, gap)
    out += ["", "main stream, per step: each kernel's time and the idle time just before it",
            "| kernel | launches/step | us/step | idle before, us/step |", "| --- | ---: | ---: | ---: |"]
    for n in sorted(tot, key=lambda n: -(tot[n] + idle[n])):
        out.append(f"| {n} | {cnt[n] / steps:.0f} | {tot[n] / steps:.0f} | {idle[n] / steps:.0f} |")
    out.append(f"| (all) | {len(ms) / steps:.0f} | {sum(tot.values()) / steps:.0f} | {sum(idle.values()) / steps:.0f} |")
    for s, es in by_stream.items():
        if s == main:
            continue
        d = np.array([e["dur"] for e in es])
        out.append(f"\nstream {s}: {', '.join(sorted({short(e['name']) for e in es}))}: {len(es) / steps:.0f} a step, "
                   f"median {np.median(d):.1f} us, p90 {np.percentile(d, 90):.1f} us, {d.sum() / steps:.0f} us a step")
    return out


def host_gaps(ms: list[dict]) -> list[float]:
    """The main stream's idle us before each step's first kernel (embed), the first step's excepted: ms are its
    kernels in time order."""
    return [max(0.0, e["ts"] - (p["ts"] + p["dur"])) for p, e in zip(ms, ms[1:]) if short(e["name"]) == "embed"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--budget", type=float, default=12.0, help="GiB")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--prefetch", choices=("on", "off"), default=None)
    ap.add_argument("--prefetch-depth", type=int, choices=(1, 2), default=None)
    ap.add_argument("--fetch-misses", choices=("on", "off"), default=None,
                    help="the late-miss copy (default: the engine's); it shows as prefetch_copy on the main stream")
    ap.add_argument("--pipeline", choices=("on", "off"), default=None,
                    help="launch each step before the previous pick is read (default: the engine's, on)")
    ap.add_argument("--trace", type=Path, help="write the chrome trace here")
    a = ap.parse_args(argv)

    import shutil
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.gguf_model import open_model
    from engine.sampling import PickSpec

    if not a.model.is_file():
        make_model(a.model)
    model = open_model(a.model)
    opts = dict(adapt_every=32)
    if a.prefetch:
        opts["prefetch"] = a.prefetch == "on"
    if a.prefetch_depth:
        opts["prefetch_depth"] = a.prefetch_depth
    if a.fetch_misses:
        opts["fetch_misses"] = a.fetch_misses == "on"
    if a.pipeline:
        opts["pipeline"] = a.pipeline == "on"
    learned = Path(tempfile.mkdtemp(prefix="bench-trace-")) / "learned.profile"
    rng = np.random.default_rng(1)
    be = fresh_backend(model, a.prompt + 512, "all", learned, **opts)
    run_pass(be, rng, a.prompt, 256)                      # learn the routing with every expert resident
    be.close()                                            # (the profile the next backend starts from)
    be = fresh_backend(model, a.prompt + 512, str(a.budget), learned, **opts)
    run_pass(be, rng, a.prompt, 256)                      # and at this budget (the adaptive tier settles)
    be.truncate(0)
    greedy = PickSpec()
    tok = be.decode(rng.integers(0, be.config.n_vocab, size=a.prompt).tolist(), greedy)[0].id
    for _ in range(8):
        tok = be.decode([tok], greedy)[0].id
    torch.cuda.synchronize()
    be.reset_stats()
    last = PickSpec(more=False)             # the last step runs none ahead: the trace holds `steps` steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(a.steps):
            tok = be.decode([tok], greedy if i < a.steps - 1 else last)[0].id
        torch.cuda.synchronize()
    st = be.get_stats()
    path = a.trace or Path("/tmp/decode_trace.json")
    prof.export_chrome_trace(str(path))
    ev = kernels_of(json.loads(path.read_text()))
    print(f"bench.decode_trace: budget {a.budget} GiB, slots {be.cache.n_slots}/{be.cache.n_total}, hit rate "
          f"{st.hits / max(st.lookups, 1):.3f}, prefetch {'on' if be.step.prefetch else 'off'}, pipeline "
          f"{'on' if be.pipelined else 'off'} ({be.pipeline_counts.kept} steps kept of "
          f"{be.pipeline_counts.ahead} run ahead)")
    print("\n".join(summarize(ev, a.steps)))
    be.close()
    free_vram()
    shutil.rmtree(learned.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
