"""A new user's path on this machine: `python -m setup --yes --no-start`, then the server from the written config
answers a chat request with the default model on the CPU, then stops. Real processes, no hub (the default model is
the one from PyPI, already fetched into data/models when it is there)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = ROOT / "data" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _new_user(tmp_path) -> tuple[int, dict]:
    """A data dir holding the default model (when this checkout has it), a free port, and a non-interactive env."""
    models = tmp_path / "models"
    models.mkdir()
    if SMOLLM2.is_file():
        # the same file setup would fetch from PyPI; linking it keeps the test off the network
        (models / SMOLLM2.name).symlink_to(SMOLLM2)
    env = {k: v for k, v in os.environ.items() if k not in ("STRATA_SETUP_MACHINE", "DISPLAY", "WAYLAND_DISPLAY")}
    env["CI"] = "1"
    return _free_port(), env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_and_chat(tmp_path, cfg_path, cfg, env, port, ready_s) -> dict:
    """The server from the written config (its output in tmp_path/server.out), answering on port within ready_s,
    answers one greedy 8-token chat (HTTP 200); returns the response body. The server (its whole session) is stopped
    either way."""
    log = open(tmp_path / "server.out", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "server", "--config", str(cfg_path)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ready_s
        while True:
            assert proc.poll() is None, (tmp_path / "server.out").read_text()
            try:
                if requests.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, f"the server did not answer within {ready_s} s"
            time.sleep(0.3)
        r = requests.post(url + "/v1/chat/completions", timeout=600, json={
            "model": cfg["model_name"], "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        return r.json()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.mark.slow
def test_setup_yes_then_the_server_answers_a_chat(tmp_path):
    port, env = _new_user(tmp_path)
    res = subprocess.run([sys.executable, "-m", "setup", "--yes", "--no-start", "--data-dir", str(tmp_path),
                          "--port", str(port), "--backend", "cpu"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "=== Step 7: write the config and start the service ===" in res.stdout
    assert "not started (--no-start)" in res.stdout
    cfg_path = tmp_path / "strata-smollm2-135m.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["port"] == port and "--backend" in cfg["args"]
    body = _serve_and_chat(tmp_path, cfg_path, cfg, env, port, ready_s=120)
    text = body["choices"][0]["message"]["content"]
    assert isinstance(text, str) and text.strip(), body
    assert body["usage"]["completion_tokens"] >= 1


@pytest.mark.slow
def test_setup_yes_starts_the_server_itself_and_a_rerun_finds_it_running(tmp_path):
    port, env = _new_user(tmp_path)
    cmd = [sys.executable, "-m", "setup", "--yes", "--data-dir", str(tmp_path), "--port", str(port),
           "--backend", "cpu"]
    pid_file = tmp_path / "strata-smollm2-135m.pid"
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"Strata is running (pid " in res.stdout and f"open http://127.0.0.1:{port}/" in res.stdout
        assert "not opening a browser (running in CI)" in res.stdout
        r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=600, json={
            "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]})
        assert r.status_code == 200, r.text
        again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "already running (pid" in again.stdout
    finally:
        if pid_file.is_file():
            pid = int(pid_file.read_text())
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


TINY_FLASH = ROOT / "tests" / "fixtures" / "qwen4exp" / "tiny-qwen4exp-q2_0.gguf"


@pytest.mark.parametrize("backend", [pytest.param("cpu", marks=pytest.mark.slow),
                                     pytest.param("cuda", marks=pytest.mark.gpu)])
def test_setup_with_a_qwen4exp_file_then_the_server_answers_through_it(tmp_path, backend):
    """Issue 35's "the service answers through them": a qwen4exp GGUF (the tiny Q2_0 fixture, a published pack's
    types) through `python -m setup --gguf`, on the CPU backend and on CUDA, where qwen4exp is a preview (setup says
    so and calibrates it on the GPU); the server from the written config answers a chat through it."""
    port, env = _new_user(tmp_path)
    res = subprocess.run([sys.executable, "-m", "setup", "--yes", "--no-start", "--data-dir", str(tmp_path),
                          "--port", str(port), "--backend", backend, "--gguf", str(TINY_FLASH)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("CUDA support for qwen4exp is a preview" in res.stdout) == (backend == "cuda")
    cfg_path = next(tmp_path.glob("strata-*.json"))
    cfg = json.loads(cfg_path.read_text())
    assert cfg["args"][cfg["args"].index("--backend") + 1] == backend
    body = _serve_and_chat(tmp_path, cfg_path, cfg, env, port, ready_s=300)
    assert body["usage"]["completion_tokens"] >= 1, body
    assert isinstance(body["choices"][0]["message"]["content"], str), body
