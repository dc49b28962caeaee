"""What a restart keeps: the expert profile a QUIT saved is the one the next start loads, through the server's own
command line (`python -m server --config`), and the start is narrated in the server's log and in /metrics' phase.
The worker is tests/fake_worker.py --moe, which saves and loads real profiles (engine/profile.py) as the CUDA
worker does; the GPU side of the same path is tests/test_cuda_profile.py's."""
import json
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

from engine import protocol
from engine.profile import load_profile
from fakes.server_kit import FAKE_WORKER, ROOT, make_config, metrics, running_server, tiny_codec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(config, log):
    with open(log, "ab") as err:       # the server's own log (its stderr), as setup/start.py keeps it
        return subprocess.Popen([sys.executable, "-m", "server", "--config", str(config), "--preload"],
                                cwd=str(ROOT), stderr=err)


def _wait_loaded(port, proc):
    deadline = time.monotonic() + 30
    while True:
        try:
            m = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).json()
            if m["worker"]["alive"] and m["phase"] == "idle":      # loaded
                return m
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "the server did not come up"
        time.sleep(0.1)


def _quit(proc):
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_quit_saves_the_profile_and_the_next_start_loads_it(tmp_path, fixtures_dir):
    port = _free_port()
    profile = tmp_path / "strata-fake.profile.bin"
    config = tmp_path / "strata-fake.json"
    config.write_text(json.dumps({
        "model": str(fixtures_dir / "vocab" / "tiny-bpe-1024.gguf"), "model_name": "fake",
        "worker": [sys.executable, str(FAKE_WORKER)], "args": ["--moe"], "log": str(tmp_path / "w.log"),
        "port": port, "expert_profile_save": profile.name}))      # relative: the config folder's
    first = _serve(config, tmp_path / "server.log")
    try:
        m = _wait_loaded(port, first)
        assert "expert_profile" not in m["worker"]["info"]       # nothing saved yet: a cold first start
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                          timeout=30)
        assert r.status_code == 200, r.text
        assert not profile.exists()                               # saved at QUIT (or every N minutes), not before
        _quit(first)
    finally:
        if first.poll() is None:
            first.kill()
    saved = load_profile(profile, 4, 16)                          # a whole, valid profile
    top = int(saved.flat_order()[0])

    second = _serve(config, tmp_path / "server.log")
    try:
        info = _wait_loaded(port, second)["worker"]["info"]
        assert info["expert_profile"] == str(profile) and int(info["profile_top"]) == top
        _quit(second)
    finally:
        if second.poll() is None:
            second.kill()
    log = (tmp_path / "w.log").read_text()
    starts = [ln for ln in log.splitlines() if "starting the worker:" in ln]
    assert len(starts) == 2 and "--expert-profile " not in starts[0]
    assert f"--expert-profile {profile}" in starts[1]
    # the narrated start, in the server's own log
    server_log = (tmp_path / "server.log").read_text()
    for words in ("loading the model", "pinning experts in RAM: 100% of 0.5 GiB at 10.0 GiB/s",
                  "VRAM expert cache filled (0.1 GiB)", "ready"):
        assert words in server_log, words


def test_metrics_phase_narrates_the_start(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / "vocab" / "tiny-bpe-1024.gguf", flags=["--moe", "--load-delay", "1.5"],
                      engine_silence_s=10.0)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (httpd, base):
        import threading
        load = threading.Thread(target=lambda: requests.post(base + "/load", json={}, timeout=20))
        load.start()                                   # /load answers once loaded; watch /metrics meanwhile
        seen = set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            phase = metrics(base)["phase"]
            seen.add(phase)
            if phase == "idle":
                break
            time.sleep(0.05)
        load.join()
        assert "loading: loading the model" in seen and "idle" in seen, seen


@pytest.mark.parametrize("info, words", [
    ({}, None),
    ({"phase": "loading"}, "loading the model"),
    ({"phase": "arena", "phase_done": "0.450", "phase_gib": "16.00", "phase_gib_s": "12.3"},
     "pinning experts in RAM: 45% of 16.0 GiB at 12.3 GiB/s"),
    ({"phase": "cache", "phase_done": "0.000", "phase_gib": "11.20"}, "filling the VRAM expert cache (11.2 GiB)"),
    ({"phase": "cache", "phase_done": "1.000", "phase_gib": "11.20"}, "VRAM expert cache filled (11.2 GiB)"),
    ({"phase": "ready"}, "ready"),
])
def test_phase_lines_round_trip(info, words):
    if info:
        line = protocol.format_phase(info["phase"], *(float(info[k]) if k in info else None
                                                      for k in ("phase_done", "phase_gib", "phase_gib_s")))
        assert protocol.parse_info(line) == info
    assert protocol.describe_phase(info) == words


def test_unknown_phase_is_refused():
    with pytest.raises(protocol.ProtocolError, match="unknown start phase"):
        protocol.format_phase("warming")


def test_calibration_decodes_the_warm_up_chats(tmp_path, fixtures_dir):
    """setup's step 6 tail: the worker's --calibrate decodes the chats of --calibrate-chats (rendered by setup with
    the model's template) after the timing, and reports how fast they went (CPU backend here; on the GPU the adaptive
    tier learns from them and --expert-profile-save keeps it)."""
    import shlex
    from setup import calibrate as cal
    model = fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"
    chats = cal.write_chats(model, tmp_path / "chats.json")
    assert chats is not None and len(json.loads(chats.read_text())) == len(cal.WARMUP_CHATS)
    p = subprocess.run([sys.executable, str(ROOT / "strata_worker.py"), "--model", str(model), "--backend", "cpu",
                        "--ctx", "256", "--calibrate", "--calibrate-chats", str(chats)],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("CALIBRATE "))
    facts = dict(t.split("=", 1) for t in shlex.split(line[len("CALIBRATE "):]))
    per = cal.CHAT_TOKENS // len(cal.WARMUP_CHATS)
    assert int(facts["chat_decode_tokens"]) == len(cal.WARMUP_CHATS) * (per - 1)   # the first of each is the prompt's
    assert float(facts["chat_decode_tok_s"]) > 0
    assert "INFO phase=loading" in p.stdout and "phase=ready" not in p.stdout     # calibration never serves


def test_a_bad_chats_file_fails_the_calibration_plainly(tmp_path, fixtures_dir):
    bad = tmp_path / "chats.json"
    bad.write_text('{"not": "a list"}')
    p = subprocess.run([sys.executable, str(ROOT / "strata_worker.py"), "--model",
                        str(fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"), "--backend", "cpu", "--ctx", "64",
                        "--calibrate", "--calibrate-chats", str(bad)],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 1 and "expected a JSON list of non-empty lists of token ids" in p.stderr


@pytest.mark.gpu
def test_cuda_restart_through_the_servers_worker_command_loads_what_quit_saved(tmp_path, fixtures_dir):
    """The same path with the real CUDA worker: a start from the config's command, a request with a cache smaller
    than the model's experts (so the adaptive tier learns), QUIT saves the profile, and the next start from the same
    config fills VRAM from it; both starts are narrated."""
    from engine.protocol import GenRequest
    from server.config import validate
    from server.worker import Worker
    model = fixtures_dir / "reference" / "tiny-qwen3moe-q4k.gguf"
    cfg = validate({"model": str(model),
                    "args": ["--backend", "cuda", "--expert-slots", "8", "--tune", "adapt_every=4"],
                    "expert_profile_save": "p.bin", "log": str(tmp_path / "w.log"), "engine_silence_s": 120},
                   tmp_path)
    profile = tmp_path / "p.bin"

    def start():
        w = Worker(cfg.worker_command(), cfg.cwd, cfg.log, cfg.worker_env(), silence_s=cfg.engine_silence_s)
        w.start()
        return w

    w = start()
    try:
        assert w.info["phase"] == "ready" and "expert_profile" not in w.info
        events = list(w.generate(GenRequest(24, [1021, 1022, 87, 301, 45, 600, 12, 999, 250, 77, 31, 402])))
        assert events and not profile.exists()
    finally:
        w.close()
    learned = load_profile(profile, 4, 8).flat_order()
    w = start()
    try:
        assert w.info["expert_profile"] == str(profile)
        assert w.info["phase"] == "ready"
    finally:
        w.close()
    log = (tmp_path / "w.log").read_text()
    assert f"expert cache filled from profile {profile}: 8 experts" in log
    assert len(learned) > 0


@pytest.mark.parametrize("content, kept", [("good", True), ("foreign", False), ("damaged", False)])
def test_the_workers_own_saved_profile_never_stops_a_start(tmp_path, content, kept):
    """--expert-profile P --expert-profile-save P (what the server passes after a QUIT saved P): a P that does not fit
    the model is dropped with a warning and learned again; the same file named alone still fails the start (the
    engine's own check)."""
    import argparse
    import strata_worker
    from engine.profile import from_flat, save_profile
    cfg = argparse.Namespace(n_layer=4, n_expert=8)
    p = tmp_path / "p.bin"
    save_profile(p, from_flat(*((4, 8) if content != "foreign" else (48, 128)), [1, 2, 3]))
    if content == "damaged":
        p.write_bytes(p.read_bytes()[:-3])
    args = argparse.Namespace(expert_profile=str(p), expert_profile_save=str(p))
    strata_worker.drop_unusable_own_profile(args, cfg)
    assert (args.expert_profile == str(p)) == kept
    named = argparse.Namespace(expert_profile=str(p), expert_profile_save=None)
    strata_worker.drop_unusable_own_profile(named, cfg)
    assert named.expert_profile == str(p)
