"""The worker's --gpus / --layer-split / --show-split (strata_worker.py, engine/cuda/gpus.py) on the CPU: the GPUs
are fakes (their count and probe results given), so the planning, the printed split and every refusal are checked
without CuPy finding a device. The one-GPU start on the named device is a GPU test (tests/test_cuda_gpus.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cuda import gpus
from engine.cuda.args import check_split_args

ROOT = Path(__file__).resolve().parent.parent

# fake GPUs: [[VRAM free in GiB, link GB/s], ...] as argv[1]; the worker sees a CUDA backend
FAKE = """
import json, sys
sys.path.insert(0, {root!r})
import strata_worker
from engine.cuda import gpus, layer_split as ls
cards = json.loads(sys.argv.pop(1))
strata_worker.choose_backend = lambda choice: ("cuda", "requested", "--backend cuda (fake GPUs)")
gpus.device_count = lambda: len(cards)
def probe(ids, reserve, budget):
    out = []
    for i in ids:
        take = max(0, int(cards[i][0] * 2**30) - reserve * 2**20)
        out.append(ls.Card(i, "Fake GPU %d" % i, take if budget is None else min(take, budget * 2**20), cards[i][1]))
    return out
gpus.probe_cards = probe
gpus.use_device = lambda i: print("use GPU %d" % i, file=sys.stderr)
import engine.cuda as cuda
def create_backend(model, ctx, args, phase=None):     # what the backend would start with, then exit 3
    from engine.cuda.args import CudaOptions
    o = CudaOptions.from_args(args)
    print("BACKEND gpus=%s layer_split=%s" % (o.gpus, o.layer_split), file=sys.stderr)
    sys.exit(3)
cuda.create_backend = create_backend
sys.exit(strata_worker.main())
"""


@pytest.fixture
def model(fixtures_dir):
    return fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"     # 4 layers, 8 experts


def worker(model, cards, *flags):
    p = subprocess.run([sys.executable, "-c", FAKE.format(root=str(ROOT)), json.dumps(cards), "--model", str(model),
                        "--ctx", "256", *flags], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL, cwd=ROOT)
    return p.returncode, p.stdout, [l for l in p.stderr.splitlines() if l.strip()]


def test_two_gpus_print_the_auto_split_then_refuse_in_one_line(model):
    rc, out, err = worker(model, [[1, 25], [1, 25]], "--gpus", "0,1")
    assert rc == 2
    assert err[-1] == f"strata_worker: {gpus.NOT_BUILT}"
    plan = [l for l in err if "layer split" in l]
    assert plan == ["strata_worker: layer split (auto): 2,2 over GPUs 0,1; " + plan[0].split("0,1; ", 1)[1]]
    assert any("GPU 0 (Fake GPU 0): layers 0-1 (2)" in l for l in err)
    assert any("GPU 1 (Fake GPU 1): layers 2-3 (2)" in l for l in err)
    assert "READY" not in out


def test_gpus_auto_takes_every_gpu_and_a_given_split_is_kept(model):
    rc, _, err = worker(model, [[1, 25], [1, 25], [1, 25]], "--gpus", "auto", "--layer-split", "1,1,2")
    assert rc == 2 and err[-1] == f"strata_worker: {gpus.NOT_BUILT}"
    assert any("layer split (given): 1,1,2 over GPUs 0,1,2" in l for l in err)


def test_show_split_prints_the_plan_and_exits_0(model):
    rc, out, err = worker(model, [[2, 25], [1, 10]], "--gpus", "1,0", "--show-split")
    assert rc == 0, err
    assert any("over GPUs 1,0" in l for l in err) and not any("not built" in l for l in err)
    rc, _, err = worker(model, [[1, 25]], "--show-split")
    assert rc == 0 and any("layer split (auto): 4 over GPUs 0" in l for l in err)


@pytest.mark.parametrize("cards,flags,line", [
    ([[1, 25], [1, 25]], ["--gpus", "0,2"],
     "strata_worker: --gpus 0,2: there is no GPU 2; CUDA shows 2 here (GPUs 0-1)"),
    ([[1, 25]], ["--gpus", "1"], "strata_worker: --gpus 1: there is no GPU 1; CUDA shows 1 here (GPU 0)"),
    ([[1, 25], [1, 25]], ["--gpus", "0,1", "--layer-split", "2,1"],
     "strata_worker: --layer-split 2,1 adds up to 3 layers; the model has 4"),
    ([[1, 25], [1, 25], [1, 25]], ["--gpus", "auto", "--layer-split", "2,2"],
     "strata_worker: --layer-split 2,2 gives 2 stages for 3 GPU(s) (0,1,2): give one count a GPU"),
    ([[1, 25], [0.75, 25]], ["--gpus", "0,1"], None),     # 0.75 GiB less the reserve: not one layer + workspace
])
def test_what_cannot_run_is_one_line_and_exit_2(model, cards, flags, line):
    rc, out, err = worker(model, cards, *flags)
    assert rc == 2 and "READY" not in out
    if line is None:
        assert "GPU 1 (Fake GPU 1" in err[-1] and "leave it out of --gpus" in err[-1]
    else:
        assert err[-1] == line


@pytest.mark.parametrize("flags,line", [
    (["--layer-split", "4"], "--layer-split 4 gives every layer to one GPU"),
    (["--layer-split", "2,2"], "--layer-split 2,2 needs --gpus naming its 2 GPUs (e.g. --gpus 0,1)"),
    (["--gpus", "0,1,2", "--layer-split", "2,2"], "--layer-split 2,2 gives 2 stages and --gpus 0,1,2 names 3"),
    (["--gpus", "0,1,0"], "--gpus 0,1,0 names a GPU twice beside another: several stages on one GPU (the test "
                          "mode) name only that GPU, e.g. --gpus 0,0"),
    (["--gpus", "one"], "--gpus takes auto or GPU indices such as 0,1; got 'one'"),
    (["--layer-split", "24,0"], "--layer-split takes auto or layer counts >= 1"),
])
def test_flags_that_name_no_split_are_refused_before_loading(model, flags, line):
    rc, out, err = worker(model, [[1, 25], [1, 25]], *flags)
    assert rc == 2 and out == "" and len(err) == 1 and line in err[0], err


def test_the_cpu_backend_refuses_gpu_flags(model):
    p = subprocess.run([sys.executable, str(ROOT / "strata_worker.py"), "--model", str(model), "--backend", "cpu",
                        "--gpus", "0,1"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "strata_worker: --gpus choose GPUs for the CUDA backend, and this worker runs the CPU backend "
        "(--backend cpu); drop it"]


def test_check_split_args_and_resolve():
    assert check_split_args(None, None) is None
    assert check_split_args((0, 1), (3, 1)) is None
    assert check_split_args("auto", (3, 1)) is None          # checked once the GPUs are counted
    assert check_split_args((0,), "auto") is None
    assert gpus.resolve(None, 2) == [0]
    assert gpus.resolve("auto", 3) == [0, 1, 2]
    assert gpus.resolve((1, 0), 2) == [1, 0]
    with pytest.raises(gpus.GpuError, match="no GPU 2"):
        gpus.resolve((0, 2), 2)
    with pytest.raises(gpus.GpuError, match="CUDA shows no GPU"):
        gpus.resolve("auto", 0)


def test_stages_on_one_gpu_start_the_staged_backend_with_the_plans_counts(model):
    """--gpus 0,0 (the test mode): the plan over GPU 0's VRAM halved for each stage, then the backend's options
    carry the stage devices and the plan's counts (engine/cuda/__init__.py builds StagedBackend from them)."""
    pytest.importorskip("cupy")         # the family check imports the CUDA families (no GPU needed)
    rc, out, err = worker(model, [[2, 25]], "--gpus", "0,0")
    assert rc == 3 and "READY" not in out, err
    assert any("layer split (auto): 2,2 over GPUs 0,0" in l for l in err)
    assert any("2 stages on GPU 0 (--gpus 0,0: the test mode" in l for l in err)
    assert err[-1] == "BACKEND gpus=(0, 0) layer_split=(2, 2)"
    rc, _, err = worker(model, [[2, 25]], "--gpus", "0,0,0", "--layer-split", "1,1,2")
    assert rc == 3 and err[-1] == "BACKEND gpus=(0, 0, 0) layer_split=(1, 1, 2)"
    assert any("layer split (given): 1,1,2 over GPUs 0,0,0" in l for l in err)
    # each stage's card is a share of the one GPU: 1/2 of it for two stages
    free = [l for l in err if "GPU 0 (Fake GPU 0)" in l]
    # (2 GiB less the 700 MiB reserve) / 3 = 0.44 GiB
    assert len(free) == 3 and all("GiB of 0.44 GiB free" in l for l in free), free


def test_one_gpu_listed_once_starts_the_plain_backend(model):
    rc, _, err = worker(model, [[1, 25], [1, 25]], "--gpus", "1")
    assert rc == 3 and "use GPU 1" in err and err[-1] == "BACKEND gpus=(1,) layer_split=None"


def test_a_family_that_cannot_split_is_refused_with_what_to_do():
    pytest.importorskip("cupy")
    q4 = ROOT / "tests" / "fixtures" / "qwen4exp" / "tiny-qwen4exp-q2_0.gguf"
    for flags in (["--gpus", "0,0"], ["--gpus", "0,1", "--layer-split", "1,1"]):
        rc, out, err = worker(q4, [[2, 25], [2, 25]], *flags)
        assert rc == 2 and "READY" not in out
        assert err[-1].startswith("strata_worker: the qwen4exp family (qwen4exp) cannot be split into stages: "), err
        assert err[-1].endswith("run it on one GPU: drop --layer-split and name one GPU (--gpus 0)")
