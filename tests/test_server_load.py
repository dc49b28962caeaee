"""The model loads when the service starts (issue 33): ready when it says it started, lazy only when the config says
so. /health answers during the load (503 "loading", as llama.cpp's server does), a failed load is reported and the
next request tries again, /unload and idle_unload_s keep working, and shutdown QUITs the worker (or abandons a load).
The worker is tests/fake_worker.py (--load-delay S: a slow load; --plan: the first start fails)."""
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import requests

from fakes.server_kit import FAKE_WORKER, ROOT, make_config, metrics, running_server, tiny_codec

VOCAB = "vocab/tiny-bpe-1024.gguf"


def plan(tmp_path, *starts):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(list(starts)))
    return ["--plan", str(p)]


def wait_for(check, what, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def health(base):
    r = requests.get(base + "/health", timeout=10)
    return r.status_code, r.json()


def complete(base, prompt="hello there", **kw):
    return requests.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 16, **kw}, timeout=60)


def test_the_service_is_idle_with_the_worker_loaded_right_after_start(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB)
    assert cfg.load_at_start
    with running_server(cfg, tiny_codec(fixtures_dir)) as (httpd, base):
        m = wait_for(lambda: (lambda m: m if m["phase"] == "idle" else None)(metrics(base)), "the load at start")
        assert m["worker"]["alive"] and m["worker"]["starts"] == 1 and m["totals"]["requests"] == 0
        assert health(base) == (200, {"status": "ok", "phase": "idle", "model": "fake"})
        log = (tmp_path / "worker.log").read_text()
        assert "starting the worker" in log and "fake worker pid" in log      # the start, as the log narrates it
        pid = m["worker"]["pid"]
        r = complete(base)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello there"
        assert metrics(base)["worker"]["pid"] == pid and metrics(base)["worker"]["starts"] == 1   # no second load


def test_lazy_loading_is_a_config_option(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, load_at_start=False)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        time.sleep(1.0)
        m = metrics(base)
        assert m["phase"] == "unloaded" and not m["worker"]["alive"] and m["worker"]["starts"] == 0
        assert health(base) == (200, {"status": "ok", "phase": "unloaded", "model": "fake"})   # a request loads it
        r = complete(base)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello there"
        m = metrics(base)
        assert m["phase"] == "idle" and m["worker"]["alive"] and m["worker"]["starts"] == 1


def test_health_answers_while_the_model_loads_and_requests_wait_for_it(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--load-delay", "3"])
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        t0 = time.monotonic()
        status, body = health(base)
        assert time.monotonic() - t0 < 2.0
        assert status == 503 and body["status"] == "loading" and body["phase"].startswith("loading")
        # the narrated phase, once the worker's first INFO line is in
        wait_for(lambda: health(base)[1]["phase"] == "loading: loading the model", "the narrated phase")
        assert requests.get(base + "/health", timeout=10).headers["Retry-After"] == "1"
        assert requests.get(base + "/v1/models", timeout=10).status_code == 200
        u = requests.post(base + "/unload", timeout=10)
        assert u.status_code == 409 and "loading" in u.json()["error"]["message"]
        r = complete(base)                       # queued behind the load, answered once the model is in
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello there"
        assert time.monotonic() - t0 >= 2.5
        assert health(base)[0] == 200 and metrics(base)["worker"]["starts"] == 1


def test_a_failed_load_at_start_is_reported_and_the_next_request_tries_again(tmp_path, fixtures_dir, caplog):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, plan(tmp_path, "--exit-before-ready", ""))
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        status, body = wait_for(lambda: (lambda h: h if h[1]["phase"] == "failed" else None)(health(base)),
                                "the failed start")
        assert status == 503 and body["status"] == "error"
        assert "before it was ready" in body["error"] and "next request tries again" in body["error"]
        assert "could not be loaded at start" in caplog.text and "told to fail" in caplog.text   # the server's log
        r = complete(base)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello there"
        m = metrics(base)
        assert m["worker"]["starts"] == 2 and m["worker"]["failures"] == 1 and m["phase"] == "idle"
        assert health(base)[0] == 200


def test_unload_and_load_after_the_load_at_start(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        wait_for(lambda: metrics(base)["phase"] == "idle", "the load at start")
        assert requests.post(base + "/unload", timeout=30).status_code == 200
        m = metrics(base)
        assert m["phase"] == "unloaded" and not m["worker"]["alive"]
        assert "fake worker: QUIT" in (tmp_path / "worker.log").read_text()      # unloaded politely
        assert health(base)[0] == 200
        assert requests.post(base + "/load", timeout=30).json()["phase"] == "idle"
        assert metrics(base)["worker"]["starts"] == 2


def test_idle_unload_counts_from_the_load_at_start(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, idle_unload_s=0.5)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        wait_for(lambda: metrics(base)["worker"]["starts"] == 1, "the load at start")
        wait_for(lambda: metrics(base)["phase"] == "unloaded", "the idle unload")
        r = complete(base)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello there"
        assert metrics(base)["worker"]["starts"] == 2


def test_shutdown_during_the_load_abandons_it_at_once(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--load-delay", "60"], engine_silence_s=120)
    from server.app import build
    httpd = build(cfg, tiny_codec(fixtures_dir))
    t = threading.Thread(target=httpd.serve_forever, kwargs=dict(poll_interval=0.1), daemon=True)
    t.start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        pid = wait_for(lambda: metrics(base)["worker"]["pid"], "the worker's spawn")
        waiting = {}
        client = threading.Thread(target=lambda: waiting.setdefault("r", complete(base)))
        client.start()
        wait_for(lambda: metrics(base)["queue"]["waiting"] == 1, "the queued request")
    finally:
        httpd.shutdown()
        httpd.server_close()
        t0 = time.monotonic()
        httpd.service.close(timeout_s=20)
        took = time.monotonic() - t0
    assert took < 5.0, f"close() waited {took:.1f} s for a load it should abandon"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    client.join(10)
    assert waiting["r"].status_code == 503 and "shutting down" in waiting["r"].json()["error"]["message"]
    assert "killing the worker" in (tmp_path / "worker.log").read_text()


def test_python_m_server_loads_at_start_and_quits_the_worker_on_sigterm(tmp_path, fixtures_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = tmp_path / "strata-fake.json"
    p.write_text(json.dumps(dict(model=str(fixtures_dir / VOCAB), worker=[sys.executable, str(FAKE_WORKER)],
                                 port=port, log=str(tmp_path / "w.log"))))
    proc = subprocess.Popen([sys.executable, "-m", "server", "--config", str(p)], cwd=str(ROOT),
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def loaded():
            try:
                return metrics(base)["phase"] == "idle"
            except requests.ConnectionError:
                assert proc.poll() is None, "the server exited"
                return False
        wait_for(loaded, "the load at start")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "fake worker: QUIT" in (tmp_path / "w.log").read_text()
        err = proc.stderr.read()
        assert "strata: loading the model" in err and "worker" in err and ": ready" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_setup_follows_the_load_through_health(tmp_path, fixtures_dir):
    from setup.start import wait_ready
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--load-delay", "1.5"])
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        phases = []
        assert wait_ready(base + "/", 30, phases.append) == ("ready", None)
        assert phases[0].startswith("loading") and phases[-1] == "idle"
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--exit-before-ready"])
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        state, err = wait_ready(base + "/", 30)
        assert state == "failed" and "before it was ready" in err
