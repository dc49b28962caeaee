"""tools/gpu_bench_families.sh on the CPU: its syntax, the steps DRY_RUN=1 prints (gpt-oss-120b's single call: one
backend a budget for decode and the prompt, the resident budget from RAM, llama-bench's probes), and the stop before
making a model /dev/shm cannot hold."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_bench_families.sh"


def _run(args, tmp_path, **env):
    e = dict(os.environ, OUT=str(tmp_path / "out"), **env)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=e, cwd=tmp_path,
                          timeout=120)


def test_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_dry_run_of_the_120b_is_one_backend_a_budget(tmp_path):
    p = _run(["gpt-oss-120b", "12,24"], tmp_path, DRY_RUN="1")
    assert p.returncode == 0, p.stderr
    steps = [ln for ln in p.stdout.splitlines() if ln.startswith("DRY ")]
    assert [s.split()[1] for s in steps] == ["make", "strata", "llama-bench"]
    strata, llama = steps[1], steps[2]
    for want in ("bench.decode", "--budgets 12,24", "--resident-budget-gib auto", "--prefill-prompts 4096",
                 "--prefill-out", "gpt-oss-120b-prefill.json", "--model /dev/shm/gpt-oss-120b.gguf"):
        assert want in strata
    assert "--probe --reps 1" in llama and "--budgets 12,24" in llama
    # the step limits leave llama-bench the last 215 s and the clean-up 15 s of the 540
    assert int(strata.split("limit ")[1].split("s)")[0]) <= 540 - 215
    assert int(llama.split("limit ")[1].split("s)")[0]) <= 540 - 15


def test_dry_run_of_other_presets_keeps_their_two_benches(tmp_path):
    p = _run(["gpt-oss-20b", "all,8,6"], tmp_path, DRY_RUN="1")
    assert p.returncode == 0, p.stderr
    steps = [ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("DRY ")]
    assert steps[-3:] == ["decode", "prefill", "llama-bench"]
    assert "--resident-budget-gib" not in p.stdout and "--probe" not in p.stdout


def test_routing_names_the_file_and_reaches_the_maker(tmp_path):
    p = _run(["gpt-oss-120b", "12"], tmp_path, DRY_RUN="1", ROUTING="trained")
    assert p.returncode == 0, p.stderr
    # the make step's arguments: the file, the preset, no recipe, the routing
    assert "/dev/shm/gpt-oss-120b-trained.gguf gpt-oss-120b  trained" in p.stdout
    assert "--model /dev/shm/gpt-oss-120b-trained.gguf" in p.stdout
    bad = _run(["gpt-oss-120b", "12"], tmp_path, DRY_RUN="1", ROUTING="sticky")
    assert bad.returncode == 2 and "ROUTING is trained or spread" in bad.stdout


def test_unknown_preset(tmp_path):
    p = _run(["qwen9-1t"], tmp_path, DRY_RUN="1")
    assert p.returncode == 2 and "unknown preset" in p.stdout


@pytest.mark.skipif(shutil.disk_usage("/dev/shm").free > 64e9, reason="this machine's /dev/shm could hold the 120b")
def test_stops_before_making_what_dev_shm_cannot_hold(tmp_path):
    p = _run(["gpt-oss-120b", "12"], tmp_path)
    assert p.returncode == 1
    assert "/dev/shm cannot hold the model: stopping" in p.stdout
    assert not Path("/dev/shm/gpt-oss-120b.gguf").exists()
