"""bench/host_ram.py: the free RAM from /proc/meminfo and the cgroup, and the resident budget 'auto' picks from it;
bench.decode's helpers that carry it (resident_budget, dump). Fake /proc and /sys files; no GPU."""
from __future__ import annotations

import json

import pytest

from bench import host_ram
from bench.host_ram import GiB


def _meminfo(tmp_path, avail_kib):
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       134217728 kB\nMemFree:         1000 kB\nMemAvailable:   {avail_kib} kB\n")
    return p


def _cgroup(tmp_path, limit, current):
    d = tmp_path / "cg"
    d.mkdir()
    (d / "memory.max").write_text(f"{limit}\n")
    (d / "memory.current").write_text(f"{current}\n")
    return d


def test_available_is_the_smaller_of_meminfo_and_the_cgroup(tmp_path):
    mi = _meminfo(tmp_path, 70 * 1024 * 1024)                  # 70 GiB
    assert host_ram.available_bytes(mi, tmp_path / "none") == 70 * GiB
    cg = _cgroup(tmp_path, 128 * GiB, 100 * GiB)                 # 28 GiB of room in the cgroup
    assert host_ram.available_bytes(mi, cg) == 28 * GiB
    (cg / "memory.max").write_text("max\n")                      # no limit: meminfo's
    assert host_ram.available_bytes(mi, cg) == 70 * GiB


def test_available_without_either_says_what_to_pass(tmp_path):
    with pytest.raises(RuntimeError, match="--resident-budget-gib N"):
        host_ram.available_bytes(tmp_path / "none", tmp_path / "none")


def test_auto_budget():
    experts = 60914 * 10**6                                      # gpt-oss-120b's 56.73 GiB
    assert host_ram.auto_budget_gib(experts, 200 * GiB) is None  # all fit beside the headroom: the whole arena
    # 128 GiB less the 59 GiB file in /dev/shm and ~5 GiB used: 64 GiB free, 12 kept back
    assert host_ram.auto_budget_gib(experts, 64 * GiB) == pytest.approx(52.0)
    assert host_ram.auto_budget_gib(experts, 10 * GiB) == 0.0    # less than the headroom: pin none
    assert host_ram.auto_budget_gib(experts, 64 * GiB, headroom_gib=4) is None     # 60 GiB of room holds 56.73
    assert host_ram.auto_budget_gib(experts, 64 * GiB, headroom_gib=8.5) == pytest.approx(55.5)


def test_resolve(tmp_path):
    mi = _meminfo(tmp_path, 64 * 1024 * 1024)
    said = []
    assert host_ram.resolve(None, 10 * GiB) is None
    assert host_ram.resolve("7.5", 10 * GiB) == 7.5
    got = host_ram.resolve("auto", 60 * GiB, log=said.append, meminfo=mi, cgroup=tmp_path / "none")
    assert got == pytest.approx(52.0)
    assert "52 GiB of the 60.00 GiB of experts pinned" in said[0]
    assert host_ram.resolve("auto", 40 * GiB, log=said.append, meminfo=mi, cgroup=tmp_path / "none") is None
    assert "every expert pinned" in said[-1]
    for bad in ("lots", "-1"):
        with pytest.raises(SystemExit, match="--resident-budget-gib"):
            host_ram.resolve(bad, GiB)


def test_decode_helpers(tmp_path):
    from bench import decode
    from engine.gguf_model import open_model
    from tools import make_moe
    path = tmp_path / "tiny.gguf"
    make_moe.main(["--preset", "tiny", "--out", str(path), "--threads", "1"])
    model = open_model(path)
    assert decode.resident_budget(None, model, print) is None
    assert decode.resident_budget("0.5", model, print) == 0.5
    out = tmp_path / "rows.json"
    decode.dump(out, {"memory": "budget"}, [{"budget": "12", "tok_s": 1.0}])
    decode.dump(out, {"memory": "budget"}, [{"budget": "12", "tok_s": 1.0}, {"budget": "24", "tok_s": 2.0}])
    assert [r["budget"] for r in json.loads(out.read_text())["rows"]] == ["12", "24"]
    assert not (tmp_path / "rows.json.part").exists()
    decode.dump(None, {}, [])           # no --out: nothing written
