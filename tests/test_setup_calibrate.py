"""The CALIBRATE line contract (docs/design.md, "Calibration") and running a worker's --calibrate."""
import sys
import textwrap
from pathlib import Path

import pytest

from setup import calibrate as cal

EXAMPLE = """\
INFO engine=0.1.0 backend=cuda
CALIBRATE gpu="NVIDIA H200" vram_total_mib=143771 pcie_gbps=55.5
CALIBRATE vram_free_mib=120000 expert_slots=6144 experts_total=6144
CALIBRATE decode_tok_s=210.4 prompt_tok_s=8123.0 arg.vram-budget-mib=131000
CALIBRATE why="all 6144 experts fit in VRAM: no PCIe traffic while decoding"
READY 4096 stop
"""


def test_the_contracts_example_parses():
    design = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()
    contract = design.split("## Calibration", 1)[1].split("\n## ", 1)[0]
    for line in EXAMPLE.splitlines():                # the example here is the one the contract shows
        if line.startswith("CALIBRATE"):
            assert line in contract, line
    r = cal.parse(EXAMPLE)
    assert r["pcie_gbps"] == 55.5 and r["vram_free_mib"] == 120000 and isinstance(r["vram_free_mib"], int)
    assert r["gpu"] == "NVIDIA H200"
    assert r["why"].startswith("all 6144 experts")
    assert cal.chosen_args(r) == ["--vram-budget-mib", "131000"]


def test_later_keys_replace_earlier_ones_and_flags():
    r = cal.parse("CALIBRATE pcie_gbps=1 vram_free_mib=2 decode_tok_s=3 prompt_tok_s=4\n"
                  "CALIBRATE pcie_gbps=9.5 arg.mmap-experts=true arg.no-graph=false arg.expert-slots=12\n")
    assert r["pcie_gbps"] == 9.5
    assert cal.chosen_args(r) == ["--mmap-experts", "--expert-slots", "12"]


@pytest.mark.parametrize("text,msg", [
    ("INFO x=1\n", "did not report pcie_gbps, vram_free_mib, decode_tok_s, prompt_tok_s (no CALIBRATE lines"),
    ("CALIBRATE pcie_gbps=1 vram_free_mib=2 decode_tok_s=3\n", "did not report prompt_tok_s"),
    ("CALIBRATE pcie_gbps\n", "expected key=value"),
    ('CALIBRATE why="unterminated\n', "unreadable calibration line"),
])
def test_bad_answers_name_what_is_wrong(text, msg):
    with pytest.raises(cal.CalibrationError, match=msg.replace("(", r"\(")):
        cal.parse(text)


def test_run_a_worker_and_its_failures(tmp_path):
    good = tmp_path / "w.py"
    good.write_text(textwrap.dedent('''
        import sys
        assert sys.argv[-1] == "--calibrate" and sys.argv[1] == "--model"
        assert sys.stdin.read() == ""          # stdin is closed: the worker must not wait for GEN lines
        print("CALIBRATE pcie_gbps=20 vram_free_mib=5000 decode_tok_s=40 prompt_tok_s=700")
    '''))
    r = cal.run([sys.executable, str(good)], tmp_path / "m.gguf", ["--ctx", "4096"], tmp_path)
    assert r["pcie_gbps"] == 20
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nprint('oom while pinning', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(cal.CalibrationError, match="exited with status 3:\noom while pinning"):
        cal.run([sys.executable, str(bad)], tmp_path / "m.gguf", [], tmp_path)
    with pytest.raises(cal.CalibrationError, match="cannot start the worker"):
        cal.run([str(tmp_path / "nope")], tmp_path / "m.gguf", [], tmp_path)


def test_saved_result_is_for_one_model_on_the_same_gpus(tmp_path):
    p = tmp_path / "c.json"
    r = cal.parse(EXAMPLE)
    cal.save(p, tmp_path / "m.gguf", ["H200"], r)
    assert cal.load(p, tmp_path / "m.gguf", ["H200"]) == r
    assert cal.load(p, tmp_path / "m.gguf", ["RTX 4070"]) is None
    assert cal.load(p, tmp_path / "other.gguf", ["H200"]) is None
    assert cal.load(tmp_path / "none.json", tmp_path / "m.gguf", ["H200"]) is None


def test_prefetch_choice_keeps_the_default_unless_the_other_is_clearly_faster():
    assert cal.prefetch_choice("on", {"on": 100.0, "off": 110.0})[0] == "off"
    assert cal.prefetch_choice("on", {"on": 100.0, "off": 102.0})[0] is None        # within the margin: noise
    assert cal.prefetch_choice("off", {"off": 300.0, "on": 250.0})[0] is None
    pick, why = cal.prefetch_choice("off", {"off": 300.0, "on": None})
    assert pick is None and "gave no rate" in why
    assert cal.prefetch_matters({"prefetch": "on", "expert_slots": 10, "experts_total": 32})
    assert not cal.prefetch_matters({"prefetch": "off", "expert_slots": 32, "experts_total": 32})
    assert not cal.prefetch_matters({"expert_slots": 10, "experts_total": 32})     # a worker that does not say


def test_tune_keys_become_one_tune_flag_each():
    r = cal.parse("CALIBRATE pcie_gbps=50 vram_free_mib=2 decode_tok_s=3 prompt_tok_s=4 arg.tune=prefetch=off "
                  "arg.tune.cpu_share=auto arg.tune.cpu_gbps=25.5\n")
    assert cal.chosen_args(r) == ["--tune", "prefetch=off", "--tune", "cpu_share=auto", "--tune", "cpu_gbps=25.5"]
