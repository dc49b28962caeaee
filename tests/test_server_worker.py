"""Worker supervision through the HTTP API, against fake workers that misbehave (docs/design.md: server).

Each misbehaving worker must cost the request an error that names the cause, leave no process behind, and the next
request must be answered by a fresh worker.
"""
import contextlib
import json
import os
import sys

import psutil
import pytest
import requests

from fakes.server_kit import FAKE_WORKER, make_config, metrics, running_server, sse_events, tiny_codec
from server.worker import Worker, WorkerStartError, likely_cause

VOCAB = "vocab/tiny-bpe-1024.gguf"


def plan(tmp_path, *starts):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(list(starts)))
    return ["--plan", str(p)]


def complete(base, prompt="hello there", **kw):
    return requests.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 64, **kw}, timeout=60)


def worker_pid(base):
    return metrics(base)["worker"]["pid"]


def gone(pid):
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_normal_answer_and_restart_not_needed(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        r = complete(base)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "hello there"
        pid = worker_pid(base)
        assert complete(base).status_code == 200
        assert worker_pid(base) == pid
        assert metrics(base)["worker"]["starts"] == 1


def test_silent_mid_answer_is_killed_and_replaced(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, plan(tmp_path, "--silent-after-tokens 3", ""),
                      engine_silence_s=1.0)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (httpd, base):
        r = complete(base)
        assert r.status_code == 503
        msg = r.json()["error"]["message"]
        assert "printed nothing" in msg and "engine_silence_s=1" in msg and "next request" in msg
        first = httpd.service.worker.proc.pid
        assert gone(first)
        r = complete(base)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "hello there"
        assert worker_pid(base) != first
        m = metrics(base)
        assert m["worker"]["starts"] == 2 and m["totals"]["error"] == 1 and m["totals"]["stop"] == 1


def test_silent_mid_stream_ends_the_stream_with_an_error(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, plan(tmp_path, "--silent-after-tokens 4", ""),
                      engine_silence_s=1.0)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (httpd, base):
        r = requests.post(base + "/v1/chat/completions", stream=True, timeout=60,
                          json=dict(messages=[{"role": "user", "content": "hi"}], stream=True))
        assert r.status_code == 200
        events = list(sse_events(r))
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if "choices" in e)
        assert text == "user\nhi\nassistant\n"[:len(text)] and len(text) > 0
        assert "printed nothing" in events[-1]["error"]["message"]
        first = httpd.service.worker.proc.pid
        assert gone(first)
        r = complete(base)
        assert r.status_code == 200 and worker_pid(base) != first


def test_silent_in_prompt_is_killed(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, plan(tmp_path, "--silent-in-prompt", ""),
                      engine_silence_s=1.0)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        r = complete(base)
        assert r.status_code == 503 and "printed nothing" in r.json()["error"]["message"]
        assert complete(base).status_code == 200


def test_slow_prompt_with_regular_progress_is_not_killed(tmp_path, fixtures_dir):
    # 12 chunks at 0.25 s each: three times the silence limit in all, but never silent for long.
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--chunk", "4", "--pp-delay", "0.25"], engine_silence_s=1.5)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        prompt = list(range(300, 348))
        r = complete(base, prompt=prompt)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == tiny_codec(fixtures_dir).tok.decode(prompt)
        assert body["timings"]["prompt_n"] == 48 and body["timings"]["prompt_ms"] > 1500


def test_ignored_stop_is_killed_within_the_deadline(tmp_path, fixtures_dir):
    # The stop string makes the server send STOP; this worker keeps talking and never finishes the request.
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, plan(tmp_path, "--ignore-stop --token-delay 0.02", ""),
                      engine_silence_s=1.0)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (httpd, base):
        r = complete(base, prompt="abcXdefghij", stop=["X"])
        assert r.status_code == 503
        assert "told to STOP" in r.json()["error"]["message"]
        first = httpd.service.worker.proc.pid
        assert gone(first)
        r = complete(base, prompt="abcXdefghij", stop=["X"])
        assert r.status_code == 200, r.text
        assert worker_pid(base) != first
        assert r.json()["choices"][0]["text"] == "abc" and r.json()["choices"][0]["finish_reason"] == "stop"


def test_death_mid_prompt_reports_log_and_cause(tmp_path, fixtures_dir, caplog):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, plan(tmp_path, "--die-in-prompt", ""))
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        r = complete(base)
        assert r.status_code == 503
        msg = r.json()["error"]["message"]
        assert "exited mid-request" in msg and "out of memory" in msg and "next request restarts it" in msg
        # the log tail (it names files) goes to the server's log, never to the client
        assert "CUDA error: out of memory" not in msg and "CUDA error: out of memory" in caplog.text
        assert str(tmp_path) not in msg
        r = complete(base)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello there"


def test_exit_before_ready_reports_the_last_20_log_lines(tmp_path, fixtures_dir, caplog):
    # lazy: the first request starts the worker, so its failure is that request's (tests/test_server_load.py has
    # the same failure at the service's start)
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--exit-before-ready"], load_at_start=False)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        r = complete(base)
        assert r.status_code == 503
        msg = r.json()["error"]["message"]
        assert "before it was ready" in msg and "status 2" in msg and "loading step" not in msg
        logged = caplog.text
        assert "this fake worker was told to fail" in logged and "loading step 29" in logged
        assert "loading step 10\n" not in logged and "loading step 11" in logged   # exactly the last 20 lines
        assert metrics(base)["worker"]["failures"] == 1


def test_worker_start_failure_shows_only_this_starts_log(tmp_path, fixtures_dir):
    log = tmp_path / "worker.log"
    log.write_text("an old line from yesterday\n" * 50)
    w = Worker([sys.executable, str(FAKE_WORKER), "--model", "m", "--exit-before-ready"], None, log, silence_s=5)
    with pytest.raises(WorkerStartError) as e:
        w.start()
    assert "yesterday" not in e.value.detail and "told to fail" in e.value.detail


def test_close_escalates_quit_term_kill(tmp_path):
    w = Worker([sys.executable, str(FAKE_WORKER), "--model", "m", "--ignore-quit"], None, tmp_path / "w.log",
               silence_s=5, quit_timeout_s=0.3)
    w.start()
    pid = w.pid
    w.close(term_timeout_s=0.3)
    assert not w.alive and gone(pid)
    text = (tmp_path / "w.log").read_text()
    assert "after QUIT; sending SIGTERM" in text and "after SIGTERM" in text


def test_close_quits_politely(tmp_path):
    w = Worker([sys.executable, str(FAKE_WORKER), "--model", "m"], None, tmp_path / "w.log", silence_s=5)
    w.start()
    w.close()
    assert w.proc.returncode == 0 and "fake worker: QUIT" in (tmp_path / "w.log").read_text()


def test_client_gone_mid_stream_is_stopped_and_drained(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--token-delay", "0.02"])
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        r = requests.post(base + "/v1/completions", stream=True, timeout=60,
                          json=dict(prompt="x" * 200, max_tokens=200, stream=True))
        it = sse_events(r)
        for _ in range(3):
            next(it)
        r.close()
        r = complete(base, prompt="the next one")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "the next one"
        m = metrics(base)
        assert [h["finish"] for h in m["history"]] == ["cancel", "stop"]
        cancelled = m["history"][0]
        assert 3 <= cancelled["generated"] < 200 and m["worker"]["starts"] == 1


@contextlib.contextmanager
def _budget_request(tmp_path, fixtures_dir, worker_args):
    """A chat request under a 5-token thinking budget: (response, its message, the worker's GEN log lines, codec).

    Qwen3.5's template opens <think> in the prompt; the fake worker echoes the prompt, so its "thought" is known."""
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, worker_args, reasoning_budget_tokens=5)
    codec = tiny_codec(fixtures_dir, "Qwen3.5-4B.jinja")
    with running_server(cfg, codec) as (_, base):
        r = requests.post(base + "/v1/chat/completions", timeout=60,
                          json=dict(messages=[{"role": "user", "content": "hi"}], max_tokens=60))
        assert r.status_code == 200, r.text
        gens = [ln for ln in (tmp_path / "worker.log").read_text().splitlines() if "fake worker: GEN" in ln]
        yield r, r.json()["choices"][0]["message"], gens, codec, base


def test_thinking_budget_closes_the_thought_and_continues(tmp_path, fixtures_dir):
    with _budget_request(tmp_path, fixtures_dir, ["--token-delay", "0.01"]) as (r, msg, gens, codec, base):
        assert len(gens) == 2
        first = [int(x) for x in gens[0].split("prompt=")[1].split(",")]
        second = [int(x) for x in gens[1].split("prompt=")[1].split(",")]
        closing = codec.encode_special("\n</think>\n\n")
        assert second[:len(first)] == first and second[-len(closing):] == closing
        thought = second[len(first):-len(closing)]
        assert len(thought) in (5, 6) and thought == first[:len(thought)]   # STOP may cross one more token
        assert msg["reasoning_content"] == codec.tok.decode(thought).strip()
        assert msg["content"].startswith("user\nhi")      # the second pass, after the thought was closed
        last = metrics(base)["history"][-1]
        assert last["passes"] == 2 and r.json()["usage"]["completion_tokens"] == last["generated"]


def test_thinking_budget_continues_when_the_model_ended_before_the_stop(tmp_path, fixtures_dir):
    # The worker ends its pass (an end-of-generation token) on the very token that spends the budget, before it can
    # read the STOP: the thought must still be closed and the answer asked for (it used to end with no content).
    with _budget_request(tmp_path, fixtures_dir, ["--answer-len", "5"]) as (r, msg, gens, _, _):
        assert len(gens) == 2
        assert msg["reasoning_content"] and msg["content"].startswith("user")
        assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_engine_silence_validated_at_start(tmp_path, fixtures_dir):
    from server.config import ConfigError
    with pytest.raises(ConfigError, match="engine_silence_s"):
        make_config(tmp_path, fixtures_dir / VOCAB, engine_silence_s=-1)
    with pytest.raises(ConfigError, match="engine_silence_s"):
        make_config(tmp_path, fixtures_dir / VOCAB, engine_silence_s="300")


def test_no_deadline_when_silence_is_zero(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--pp-delay", "0.3"], engine_silence_s=0)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        assert complete(base, prompt="abcdefghijklmnop").status_code == 200
    assert os.path.exists(tmp_path / "worker.log")


def test_a_chunk_may_take_three_times_the_previous_one(tmp_path, fixtures_dir):
    # Every chunk takes twice engine_silence_s: the first is allowed for at 50 tok/s (100 tokens: +2 s), the next
    # at 3x the one before.
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--chunk", "100", "--pp-delay", "1.5"], engine_silence_s=0.7)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        r = complete(base, prompt=list(range(300, 500)))
        assert r.status_code == 200, r.text
        assert r.json()["timings"]["prompt_n"] == 200 and metrics(base)["worker"]["starts"] == 1


def test_cancelled_prompt_counts_what_was_read(tmp_path, fixtures_dir):
    import socket
    import time
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--chunk", "4", "--pp-delay", "0.1"])
    with running_server(cfg, tiny_codec(fixtures_dir)) as (httpd, base):
        body = json.dumps(dict(prompt=list(range(300, 500)), max_tokens=5)).encode()
        s = socket.create_connection(("127.0.0.1", httpd.server_address[1]), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % len(body)
                  + body)
        deadline = time.monotonic() + 20
        while not (metrics(base)["progress"] or {}).get("position"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        s.close()
        while not metrics(base)["history"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        h = metrics(base)["history"][0]
        assert h["finish"] == "cancel" and h["generated"] == 0
        assert 0 < h["prompt_read"] < 200 and h["prompt_read"] % 4 == 0 and h["prompt_tokens"] == 200
        assert metrics(base)["totals"]["prompt_read"] == h["prompt_read"]


def test_likely_cause():
    # SIGKILL alone may come from anyone: the cause says so instead of blaming memory
    assert "SIGKILL" in likely_cause(-9, "loading\n") and "likely out of memory" not in likely_cause(-9, "")
    assert "another process" in likely_cause(137, "")
    assert "out of memory" in likely_cause(1, "RuntimeError: CUDA out of memory. Tried to allocate")
    assert "out-of-memory killer" in likely_cause(-6, "step 3\nKilled")
    assert "watchdog" in likely_cause(3, "watchdog: no progress for 600 s, exiting")
    assert "SIGSEGV" in likely_cause(-11, "")
    assert "status 1" in likely_cause(1, "Traceback ...")


def test_worker_gone_before_it_took_the_request_is_restarted_and_the_request_replayed(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, plan(tmp_path, "--die-on-gen 2", ""))
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        assert complete(base, prompt="first").json()["choices"][0]["text"] == "first"
        r = complete(base, prompt="second")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "second"
        m = metrics(base)
        assert m["worker"]["starts"] == 2 and m["worker"]["failures"] == 1
        assert [h["finish"] for h in m["history"]] == ["stop", "stop"]
        assert "exiting before it answers" in (tmp_path / "worker.log").read_text()
