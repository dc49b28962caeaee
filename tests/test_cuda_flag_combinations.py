"""The CUDA flags: the worker's typed options (CudaOptions, defaults in one place), --tune's keys and values, and
the combinations the backend cannot run, refused before anything loads with one line naming the fix."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_flags import options, parse
from engine.cuda.args import TUNING, CudaOptions, check_cuda_args

ROOT = Path(__file__).resolve().parent.parent


def test_no_flag_gives_the_dataclass_defaults():
    assert options() == CudaOptions()


def test_every_tune_key_is_an_option_and_sets_it():
    names = {f.name for f in dataclasses.fields(CudaOptions)}
    assert set(TUNING) <= names
    samples = dict(prefetch=("off", False), prefetch_depth=("1", 1), fetch_misses=("off", False),
                   embed_host=("on", True), adapt_every=("0", 0), ring=("8", 8), stream_min=("16", 16),
                   pipeline=("off", False),
                   cpu_share=("0.25", 0.25), cpu_gbps=("25.5", 25.5), link_gbps=("49", 49.0), cpu_threads=("15", 15),
                   windows=("off", False))
    assert set(samples) == set(TUNING)
    for key, (raw, typed) in samples.items():
        assert getattr(options("--tune", f"{key}={raw}"), key) == typed
    # several at once, dashes as underscores, the last of a repeated key wins
    o = options("--tune", "prefetch-depth=1", "--tune", "ring=4", "--tune", "ring=6")
    assert (o.prefetch_depth, o.ring) == (1, 6)


@pytest.mark.parametrize("bad", ["prefetch=maybe", "prefetch_depth=3", "adapt_every=-1", "ring=1", "ring=x",
                                 "stream_min=0", "ring", "=2", "vram_budget_mib=100", "embed_host=yes", "pipeline=1"])
def test_bad_tune_values_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        parse("--tune", bad)
    assert "--tune" in capsys.readouterr().err


def test_user_flags_are_typed():
    o = options("--vram-budget-mib", "12288", "--expert-slots", "5", "--kv", "int8", "--no-graph",
                "--resident-budget-gib", "1.5", "--expert-profile-save-every", "0")
    assert (o.vram_budget_mib, o.expert_slots, o.kv, o.no_graph, o.resident_budget_gib) == (12288, 5, "int8", True,
                                                                                             1.5)
    assert o.expert_profile_save_every == 0.0 and o.mmap_experts is False
    with pytest.raises(SystemExit):
        parse("--mmap-experts", "--resident-budget-gib", "1")


def test_fetch_misses_needs_the_prefetch():
    assert check_cuda_args(parse("--tune", "fetch_misses=on", "--tune", "prefetch=on")) is None
    assert "drop --tune prefetch=off" in check_cuda_args(parse("--tune", "fetch_misses=on", "--tune", "prefetch=off"))
    assert check_cuda_args(parse("--tune", "fetch_misses=off", "--tune", "prefetch=off")) is None
    assert check_cuda_args(parse("--tune", "prefetch=off")) is None     # the default late copy needs no prefetch
    assert check_cuda_args(parse("--kv", "int8")) is None
    assert check_cuda_args(parse()) is None


def test_worker_exits_2_with_one_line(fixtures_dir):
    model = fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"
    p = subprocess.run([sys.executable, str(ROOT / "strata_worker.py"), "--model", str(model), "--backend", "auto",
                        "--tune", "fetch_misses=on", "--tune", "prefetch=off"], capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "strata_worker: --tune fetch_misses=on is part of the decode prefetch: drop --tune prefetch=off "
        "(or --tune fetch_misses=on)"]
