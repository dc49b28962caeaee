"""llama.cpp's speed on a model file at the VRAM budgets Strata's benches use: the figure every bench table puts beside
ours (`python -m bench.llama_bench --model M --budgets all,12,8`).

llama.cpp runs a model bigger than VRAM by keeping the experts of the first N layers on the CPU (`-ncmoe N`). For each
budget this picks N from the file: the run at N = 0 is measured (its peak VRAM, sampled with nvidia-smi), and N is the
fewest layers whose expert bytes bring that peak under the budget; each run's own peak is then measured and printed,
so the table says how close to the budget llama.cpp really was. The binary is the anchors' llama-bench (CUDA sm_90,
the reference version): --bench names it, or its .gz / .xz, unpacked to /tmp once.
"""
from __future__ import annotations

import argparse
import gzip
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

GIB = 2 ** 30
OVER_GIB = 0.25     # a run this far over its budget is measured again with more layers' experts on the CPU
PROBE_PROMPT = 512  # --probe: llama-bench's default batch, one of it
# llama.cpp's LLM_FFN_EXPS_REGEX (common/common.h): what -ncmoe keeps on the CPU for each of the first N layers
EXPS = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")


def expert_bytes(path: Path) -> list[int]:
    """Bytes of each layer's routed-expert tensors (weights and biases), in layer order."""
    from engine.gguf_model import read_header
    from engine.quant_types import SIZES     # every type the engine reads, Q2_0 too (gguf's enum stops at 41)
    h = read_header(path)
    n_layer = max((int(m.group(1)) for t in h.tensors if (m := EXPS.match(t.name))), default=-1) + 1
    per = [0] * n_layer
    for t in h.tensors:
        m = EXPS.match(t.name)
        if m:
            block, size = SIZES[t.type_id]
            per[int(m.group(1))] += t.dims[0] // block * size * int(np.prod(t.dims[1:], dtype=np.int64))
    return per


def layers_for(budget_gib: float, peak0_gib: float, per_layer: list[int]) -> int | None:
    """The fewest first layers whose experts, kept on the CPU, bring the all-in-VRAM peak under the budget (None:
    even every layer's experts on the CPU would not)."""
    need = (peak0_gib - budget_gib) * GIB
    moved = 0
    for n in range(len(per_layer) + 1):
        if moved >= need:
            return n
        if n < len(per_layer):
            moved += per_layer[n]
    return None


def unpack(bench: Path) -> Path:
    """The llama-bench binary: bench itself, or its .gz / .xz unpacked to /tmp (once)."""
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(bench.suffix)
    if opener is None:
        return bench
    out = Path("/tmp") / bench.stem
    if not out.is_file():
        with opener(bench, "rb") as src, open(out.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        out.with_suffix(".part").rename(out)
        out.chmod(0o755)
    return out


def bench_env() -> dict:
    """llama-bench's CUDA libraries: the toolkit's and the nvidia wheels' (cuBLAS 13), as the anchors' README says."""
    env = dict(os.environ)
    libs = ["/usr/local/cuda/lib64"]
    try:
        import nvidia
        libs += [os.path.join(p, "cu13", "lib") for p in nvidia.__path__]
    except ImportError:
        pass
    env["LD_LIBRARY_PATH"] = ":".join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    return env


def vram_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


class PeakVram:
    """The most VRAM in use while the block runs, less what was in use before it (sampled every 0.2 s)."""

    def __enter__(self):
        self.base = vram_used_mib()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, vram_used_mib())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def gib(self) -> float:
        return (self.peak - self.base) / 1024


def run_bench(binary: Path, model: Path, ncmoe: int, a, probe: bool = False) -> dict:
    """One llama-bench run (pp and tg); its tok/s and peak VRAM. probe: one unwarmed batch of PROBE_PROMPT tokens
    and no generation, for the peak VRAM alone (the compute buffers, the CPU experts' copies among them, are sized
    by the batch, not the prompt; the probe's KV cache is the shorter prompt's)."""
    p, n, r = (PROBE_PROMPT, 0, 1) if probe else (a.prompt, a.gen, a.reps)
    cmd = [str(binary), "-m", str(model), "-ngl", "99", "-fa", "on", "-ncmoe", str(ncmoe), "-p", str(p),
           "-n", str(n), "-r", str(r), "-t", str(a.threads), "-o", "json"] + (["--no-warmup"] if probe else [])
    if a.depth and not probe:   # the probe picks -ncmoe: a depth's KV is small beside the experts it moves
        cmd += ["-d", str(a.depth)]
    print("bench.llama_bench:", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with PeakVram() as vram:
        p = subprocess.run(cmd, capture_output=True, text=True, env=bench_env(), timeout=a.timeout)
    if p.returncode != 0:
        raise SystemExit(f"bench.llama_bench: llama-bench exited {p.returncode}: {p.stderr.strip()[-800:]}")
    rows = json.loads(p.stdout)
    ts = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in rows}
    return {"ncmoe": ncmoe, "vram_gib": round(vram.gib, 2), **({"depth": a.depth} if a.depth and not probe else {}), **({"probe": True} if probe else {}), "pp_tok_s": round(ts.get("pp", 0.0), 1),
            "tg_tok_s": round(ts.get("tg", 0.0), 1), "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--budgets", default="all,12", help="GiB, comma-separated; 'all' = every expert in VRAM")
    ap.add_argument("--bench", type=Path, default=Path("/tmp/llama-bench"),
                    help="llama-bench, or its .gz/.xz (../shared/anchors/llama-bench.gz)")
    ap.add_argument("--prompt", type=int, default=4096, help="llama-bench -p")
    ap.add_argument("--gen", type=int, default=128, help="llama-bench -n")
    ap.add_argument("--depth", type=int, default=0,
                    help="llama-bench -d: the context already in the KV cache before each pp and tg test (each rep "
                         "prefills it again, so a deep run at a small budget takes minutes)")
    ap.add_argument("--reps", type=int, default=2, help="llama-bench -r")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 16, help="llama-bench -t")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    ap.add_argument("--probe", action="store_true",
                    help="pick -ncmoe from short runs (one batch of 512 prompt tokens, no warm-up, no generation: the "
                         "same VRAM peak but for the prompt's KV) and measure each budget once at the layer count "
                         "picked; for models whose CPU-expert runs take minutes (gpt-oss-120b)")
    ap.add_argument("--out", type=Path, help="append the rows here as JSON lines, each as it is measured")
    a = ap.parse_args(argv)
    if not a.model.is_file():
        raise SystemExit(f"bench.llama_bench: no model at {a.model}; make it with tools.make_moe (see bench.decode)")
    if not a.bench.is_file():
        raise SystemExit(f"bench.llama_bench: no llama-bench at {a.bench}; pass --bench ../shared/anchors/llama-bench.gz")
    binary = unpack(a.bench)
    per_layer = expert_bytes(a.model)
    budgets = [b.strip() for b in a.budgets.split(",") if b.strip()]
    rows = []

    def emit(row):
        rows.append(row)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps({"model": a.model.name, **row}) + "\n")

    first = run_bench(binary, a.model, 0, a, probe=a.probe and "all" not in budgets)
    for b in budgets:
        if b == "all":
            emit({"budget": "all", **first})
            continue
        n = layers_for(float(b), first["vram_gib"], per_layer)
        if n is None:
            emit({"budget": b, "ncmoe": None, "note": "does not fit even with every expert on the CPU"})
            continue
        r = first if n == 0 else run_bench(binary, a.model, n, a, probe=a.probe)
        # the prompt pass's buffers grow when experts sit on the CPU (their weights cross to the GPU per batch):
        # once over the budget, move as many more layers as the excess needs and measure again
        over = r["vram_gib"] - float(b)
        if over > OVER_GIB and n < len(per_layer):
            more = layers_for(float(b), r["vram_gib"], per_layer[n:])
            n = len(per_layer) if more is None else n + max(1, more)
            r = run_bench(binary, a.model, n, a, probe=a.probe)
        if r.get("probe"):      # the layer count is picked: the measured run (its own VRAM peak is what is shown)
            r = run_bench(binary, a.model, n, a)
        emit({"budget": b, **r})
    print(f"llama.cpp on {a.model.name} ({len(per_layer)} MoE layers, {sum(per_layer) / GIB:.2f} GiB of experts; "
          f"-p {a.prompt} -n {a.gen} -r {a.reps} -t {a.threads}{f' -d {a.depth}' if a.depth else ''})")
    print("| budget GiB | -ncmoe | VRAM used GiB | pp tok/s | tg tok/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        if r.get("ncmoe") is None:
            print(f"| {r['budget']} | - | - | - | - |  {r['note']}")
        else:
            print(f"| {r['budget']} | {r['ncmoe']} | {r['vram_gib']:.1f} | {r['pp_tok_s']:,.0f} | {r['tg_tok_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
