"""Setup's GPU question (setup/gpus.py, wizard.step_gpus) on fake PCs of one and two cards: asked only where there
are several, the default keeps one card (so --yes never spreads a model on its own), the answer is remembered in the
config and reaches the worker through server/config.py."""
import json
import sys
import textwrap

import pytest

from server.config import validate
from setup import calibrate as cal
from setup import gpus as gpumod
from setup.catalog import GIB
from test_setup_wizard import calibrating, config_of, env, go, hub, machine  # noqa: F401  (fixtures)

QUESTION = "Which GPUs? (one, all, or indices such as 0,1)"


@pytest.fixture
def built(monkeypatch):
    """As when the worker runs several GPUs (engine/cuda/gpus.py STAGES_BUILT)."""
    monkeypatch.setattr(gpumod, "stages_built", lambda: True)


def test_one_gpu_is_never_asked(env, monkeypatch, built):
    monkeypatch.setattr(cal, "default_worker", lambda: calibrating(env))
    rc, out, asked = go(env, "--no-start", "--model", "tiny-moe", machine_=machine((12,), 32), answers=[])
    assert rc == 0, out
    assert QUESTION not in asked and "Step 5: GPUs" not in out and ": GPUs ===" not in out
    cfg = config_of(env, "tiny-moe")
    assert cfg["gpu"] == 0 and cfg["gpus"] is None


def test_two_gpus_while_the_split_is_not_built_run_on_the_larger_one_unasked(env, monkeypatch):
    monkeypatch.setattr(cal, "default_worker", lambda: calibrating(env))
    rc, out, asked = go(env, "--no-start", "--model", "tiny-moe", machine_=machine((12, 24), 64), answers=[])
    assert rc == 0, out
    assert QUESTION not in asked
    assert "this PC has 2 NVIDIA GPUs: GPU 0 Test GPU 12 GB (12.0 GiB); GPU 1 Test GPU 24 GB (24.0 GiB)" in out
    assert "[ok] the service runs on GPU 1 (the layer split across GPUs is not built yet)" in out
    cfg = config_of(env, "tiny-moe")
    assert cfg["gpu"] == 1 and cfg["gpus"] is None
    # a config edited to ask for both: said, and one card written until the split is built
    cfg["gpus"], cfg["gpu"] = [0, 1], None
    (env / "data" / "strata-tiny-moe.json").write_text(json.dumps(cfg))
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "tiny-moe", machine_=machine((12, 24), 64))
    assert "the config asks for GPUs 0,1, but the worker's layer split across GPUs is not built yet" in out
    assert config_of(env, "tiny-moe")["gpu"] == 1 and config_of(env, "tiny-moe")["gpus"] is None


def test_yes_keeps_one_card_and_says_the_recommendation(env, monkeypatch, built):
    monkeypatch.setattr(cal, "default_worker", lambda: calibrating(env))
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "tiny-moe", machine_=machine((24, 24), 64))
    assert rc == 0, out
    assert "=== Step 5: GPUs ===" in out
    assert "[ok] recommended: GPU 0 alone: GPU 0 holds all" in out
    assert f"{QUESTION} [one] -> one (--yes)" in out
    cfg = config_of(env, "tiny-moe")
    assert cfg["gpu"] == 0 and cfg["gpus"] is None


def test_the_answer_is_remembered_and_reaches_the_worker(env, monkeypatch, built):
    monkeypatch.setattr(cal, "default_worker", lambda: calibrating(env))
    rc, out, asked = go(env, "--no-start", "--model", "tiny-moe", machine_=machine((24, 24), 64),
                        answers=["", "0,7", "0,1"])
    assert rc == 0, out
    assert asked.count(QUESTION) == 2
    assert "'0,7': answer one, all, or GPU indices among 0, 1" in out
    assert "[ok] GPUs 0,1: the worker splits the layers across them (its auto split)" in out
    cfg = config_of(env, "tiny-moe")
    assert cfg["gpus"] == [0, 1] and cfg["gpu"] is None and "layer_split" not in cfg
    served = validate(cfg, env / "data")
    cmd = served.worker_command()
    assert cmd[cmd.index("--gpus") + 1] == "auto"
    assert served.worker_env() == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}
    # a rerun with --yes keeps the answer; a layer_split the person wrote is kept with it
    cfg["layer_split"] = [3, 1]
    (env / "data" / "strata-tiny-moe.json").write_text(json.dumps(cfg))
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "tiny-moe", machine_=machine((24, 24), 64))
    assert f"{QUESTION} [0,1] -> 0,1 (--yes)" in out
    again = config_of(env, "tiny-moe")
    assert again["gpus"] == [0, 1] and again["layer_split"] == [3, 1]
    # one card chosen again: the split goes with the gpus
    rc, out, _ = go(env, "--no-start", "--model", "tiny-moe", machine_=machine((24, 24), 64), answers=["1"])
    once = config_of(env, "tiny-moe")
    assert once["gpu"] == 1 and once["gpus"] is None and "layer_split" not in once
    # ... and remembered as that card
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "tiny-moe", machine_=machine((24, 24), 64))
    assert f"{QUESTION} [1] -> 1 (--yes)" in out and config_of(env, "tiny-moe")["gpu"] == 1


def test_a_card_gone_since_is_said_and_chosen_again(env, monkeypatch, built):
    monkeypatch.setattr(cal, "default_worker", lambda: calibrating(env))
    go(env, "--no-start", "--model", "tiny-moe", machine_=machine((24, 24, 24), 64), answers=["", "1,2"])
    assert config_of(env, "tiny-moe")["gpus"] == [1, 2]
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "tiny-moe", machine_=machine((24, 24), 64))
    assert "the config's GPU 2 is not on this PC any more (nvidia-smi lists 0, 1); choosing again" in out
    assert config_of(env, "tiny-moe")["gpu"] == 0


def test_update_keeps_the_cards(env, monkeypatch, built):
    monkeypatch.setattr(cal, "default_worker", lambda: calibrating(env))
    go(env, "--no-start", "--model", "tiny-moe", machine_=machine((24, 24), 64), answers=["", "all"])
    assert config_of(env, "tiny-moe")["gpus"] == [0, 1]
    rc, out, _ = go(env, "--update", machine_=machine((24, 24), 64))
    assert rc == 0, out
    assert config_of(env, "tiny-moe")["gpus"] == [0, 1]
    monkeypatch.setattr(gpumod, "stages_built", lambda: False)
    rc, out, _ = go(env, "--update", machine_=machine((24, 24), 64))
    assert "tiny-moe: the config asks for GPUs 0,1, but the worker's layer split across GPUs is not built yet" in out
    cfg = config_of(env, "tiny-moe")
    assert cfg["gpus"] is None and cfg["gpu"] == 0


def test_calibration_runs_on_the_card_the_config_names(env, monkeypatch):
    fake = env / "env_worker.py"
    fake.write_text(textwrap.dedent('''
        import os
        print('CALIBRATE pcie_gbps=20 vram_free_mib=9000 decode_tok_s=50 prompt_tok_s=800 '
              f'gpu={os.environ.get("CUDA_VISIBLE_DEVICES", "unset")}:{os.environ.get("CUDA_DEVICE_ORDER", "unset")}')
    '''))
    monkeypatch.setattr(cal, "default_worker", lambda: [sys.executable, str(fake)])
    go(env, "--yes", "--no-start", "--model", "tiny-moe", machine_=machine((12, 24), 64))
    result = json.loads((env / "data" / "strata-tiny-moe.calibration.json").read_text())["result"]
    assert result["gpu"] == "1:PCI_BUS_ID" and config_of(env, "tiny-moe")["gpu"] == 1


def test_the_recommendation_follows_what_one_card_caches():
    two = machine((24, 24), 128)
    dense, kv = 4 * GIB, 2 * GIB
    rec, why = gpumod.recommend(two, 10 * GIB, dense, kv, 700)
    assert rec == [0] and "holds all" in why
    rec, why = gpumod.recommend(two, 60 * GIB, dense, kv, 700)
    assert rec == [0, 1] and "all 2 together" in why
    # a second card of 3 GiB adds under a tenth of 60 GiB of experts
    small = machine((24, 3), 128)
    rec, why = gpumod.recommend(small, 60 * GIB, dense, kv, 700)
    assert rec == [0] and "too little more" in why
    assert gpumod.recommend(two, 0, dense, kv, 700)[0] == [0]


@pytest.mark.parametrize("answer,want", [("one", [1]), ("all", [0, 1, 2]), ("2,0", [2, 0]), (" 1 ", [1]),
                                         ("0,0", str), ("3", str), ("both", str), ("", str)])
def test_answers(answer, want):
    got = gpumod.parse_answer(answer, machine((12, 24, 12), 64))
    assert (isinstance(got, str) if want is str else got == want)
