"""--calibrate's CPU half (engine/cpu_calibrate.py, strata_worker.calibrate_cpu): the CPU experts' rate measured on a
model's own experts, from the GGUF's mapping and from arena-laid blobs, the split it gives, and the config args it
writes, which the worker's parser takes back."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine import cpu_calibrate, cpu_experts as ce
from engine.gguf_model import open_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("cpu_calibrate") / "tiny.gguf"
    r = subprocess.run([sys.executable, "-m", "tools.make_moe", "--preset", "tiny", "--out", str(path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return open_model(path)


def _worker_opts(args):
    from engine.cuda.args import CudaOptions, add_cuda_args
    p = argparse.ArgumentParser()
    add_cuda_args(p)
    return CudaOptions.from_args(p.parse_args(args))


@pytest.mark.parametrize("where", ["mapped", "arena"])
def test_cpu_facts_measure_and_choose(tiny, where):
    arena = None
    if where == "arena":
        buf, ptr, layouts = ce.pack_blobs(tiny)
        arena = SimpleNamespace(host_ptr=ptr, layout=SimpleNamespace(layers=layouts), keep=buf)
    table = cpu_calibrate.host_table(tiny, arena)
    assert (table.gate[table.gate != 0].size == tiny.config.n_expert * sum(t is not None for t in table.types))
    facts = cpu_calibrate.cpu_facts(tiny, 50.0, arena, threads=1, hit_rate=0.0, calls=3)
    assert facts["cpu_gbps"] > 0 and facts["cpu_threads"] == 1
    c, n = (int(v) for v in facts["cpu_share_typical"].split(" of "))
    assert n == tiny.config.n_expert_used and 0 <= c <= n
    assert facts["arg.tune.cpu_share"] == ("auto" if c else "off")
    from setup import calibrate as cal
    args = cal.chosen_args(facts)
    assert args == ["--tune", f"cpu_share={facts['arg.tune.cpu_share']}", "--tune", f"cpu_gbps={facts['cpu_gbps']}",
                    "--tune", "link_gbps=50.0", "--tune", "cpu_threads=1"]
    o = _worker_opts(args)      # what setup writes, the worker reads back
    assert (o.cpu_gbps, o.link_gbps, o.cpu_threads) == (facts["cpu_gbps"], 50.0, 1)
    assert o.cpu_share == (None if c else 0.0)


def test_a_fast_cpu_beside_a_slow_link_takes_a_share(tiny, monkeypatch):
    import engine.cpu_expert_pool as pool
    monkeypatch.setattr(pool, "measure_gbps", lambda *a, **k: 40.0)
    facts = cpu_calibrate.cpu_facts(tiny, 2.0, threads=1)
    c, n = (int(v) for v in facts["cpu_share_typical"].split(" of "))
    assert c == n and facts["arg.tune.cpu_share"] == "auto" and "40.0 GB/s" in facts["cpu_why"]


def test_the_worker_takes_the_hit_rate_it_measured(tiny, monkeypatch):
    sys.path.insert(0, str(ROOT))
    import strata_worker
    seen = {}

    def fake(model, link, arena, threads, hit):
        seen.update(link=link, arena=arena, threads=threads, hit=hit)
        return {"cpu_gbps": 1.0}
    monkeypatch.setattr(cpu_calibrate, "cpu_facts", fake)
    backend = SimpleNamespace(model=tiny, arena=None, opts=_worker_opts(["--tune", "cpu_threads=3"]))
    assert strata_worker.calibrate_cpu(backend, {"pcie_gbps": 49.5, "chat_hit_pct": 80.0}) == {"cpu_gbps": 1.0}
    assert seen == {"link": 49.5, "arena": None, "threads": 3, "hit": 0.8}
    strata_worker.calibrate_cpu(backend, {"pcie_gbps": 49.5, "expert_slots": 30, "experts_total": 120})
    assert seen["hit"] == 0.25


@pytest.mark.gpu
def test_the_pinned_arenas_blobs_give_the_mapped_files_results(tiny):
    """On the GPU machine: the table over a real ExpertArena (mapped pinned memory, host_ptr) computes what the
    mapped GGUF's does, bit for bit, and calibration measures through it."""
    import numpy as np
    pytest.importorskip("cupy")
    from engine.cuda.arena import ExpertArena
    arena = ExpertArena(tiny, log=lambda m: None)
    try:
        by_arena, by_file = cpu_calibrate.host_table(tiny, arena), cpu_calibrate.host_table(tiny)
        rng = np.random.default_rng(2)
        x = rng.standard_normal(tiny.config.n_embd).astype(np.float32)
        k = tiny.config.n_expert_used
        for il in range(tiny.config.n_layer):
            ids = rng.choice(tiny.config.n_expert, k, replace=False)
            w = rng.uniform(0.1, 0.5, k).astype(np.float32)
            outs = [ce.experts_ffn(t, il, ids, w, x, np.full(tiny.config.n_embd, np.nan, np.float32))
                    for t in (by_arena, by_file)]
            assert np.array_equal(outs[0], outs[1]), il
        facts = cpu_calibrate.cpu_facts(tiny, 50.0, arena, threads=1, calls=2)
        assert facts["cpu_gbps"] > 0
    finally:
        arena.close()
