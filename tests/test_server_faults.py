"""The service under worker faults and client bursts: no answer ever reaches the wrong client (issue 18).

The stand-in worker (tests/fake_worker.py) answers each prompt with the prompt's own tokens, so a client can tell
its tokens from anyone else's; --fault makes it break the line protocol in one way, --chaos at random.
"""
import json
import random
import threading
import time

import pytest
import requests

from fakes.server_kit import make_config, metrics, running_server, sse_events, tiny_codec

VOCAB = "vocab/tiny-bpe-1024.gguf"
WORDS = "apple river stone cloud maple tiger lemon piano candle forest silver window garden rocket violet".split()

# Faults that break the protocol while a request runs: the request gets a 503 and the worker is replaced.
MID_REQUEST = ["t-not-a-number", "bare-t", "short-pp", "short-done", "oov", "garbage", "ready-again",
               "wrong-req-done", "count-mismatch", "resume-twice"]


def plan(tmp_path, *starts):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(list(starts)))
    return ["--plan", str(p)]


def prompt_of(i: int) -> str:
    r = random.Random(i)
    return f"client {i} " + " ".join(r.choice(WORDS) for _ in range(4))


def complete(base, prompt, **kw):
    return requests.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 64, **kw}, timeout=60)


@pytest.mark.parametrize("fault", MID_REQUEST + ["no-req"])
def test_a_protocol_violation_ends_the_worker_and_no_later_request_reads_its_lines(tmp_path, fixtures_dir, fault):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB,
                      ["--token-delay", "0.01"] + plan(tmp_path, f"--fault {fault}", ""))
    with running_server(cfg, tiny_codec(fixtures_dir)) as (httpd, base):
        r = complete(base, "hello there my friend")
        if fault == "no-req":
            # RESUME without the number: caught before the worker took the request, so it is replayed on a new one
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello there my friend"
        else:
            assert r.status_code == 503, r.text
            msg = r.json()["error"]["message"]
            assert "broke the line protocol" in msg and "next request starts it again" in msg
        for i in range(4):
            p = prompt_of(i)
            r = complete(base, p)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == p        # its own tokens, never the failed request's
        assert metrics(base)["worker"]["starts"] == 2


@pytest.mark.parametrize("fault", ["tokens-after-done", "early-done"])
def test_tokens_after_done_never_reach_the_next_request(tmp_path, fixtures_dir, fault):
    # A DONE (early or on time) followed by more tokens: the request ends at its DONE, and the stray lines are
    # found before the next request is taken (the worker is replaced and that request replayed).
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, plan(tmp_path, f"--fault {fault} --fault-gen 1", ""))
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        text = complete(base, "hello there").json()["choices"][0]["text"]
        assert text == "hello there" if fault == "tokens-after-done" else "hello there".startswith(text)
        time.sleep(0.3)     # the stray lines are queued before the next GEN goes out
        for i in range(3):
            r = complete(base, prompt_of(i))
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == prompt_of(i)
        assert metrics(base)["worker"]["starts"] == 2


@pytest.mark.parametrize("stream", [True, False])
def test_a_line_cut_short_by_the_workers_death_delivers_nothing(tmp_path, fixtures_dir, stream):
    # The worker dies while writing its third `T <id>` (no newline, then EOF): the two whole tokens are all the
    # client sees, and the request fails as a dead worker's does; the next request gets a fresh worker.
    codec = tiny_codec(fixtures_dir)
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, plan(tmp_path, "--fault truncated-t --fault-gen 1", ""))
    prompt = "hello there my friend"
    ids = codec.completion_prompt(prompt)
    with running_server(cfg, codec) as (httpd, base):
        if stream:
            with requests.post(base + "/v1/completions", stream=True, timeout=60,
                               json={"prompt": prompt, "max_tokens": 64, "stream": True}) as r:
                assert r.status_code == 200
                text, errors = "", []
                for ev in sse_events(r):
                    if "error" in ev:
                        errors.append(ev["error"]["message"])
                        break
                    text += ev["choices"][0]["text"] if ev["choices"] else ""
            assert text == codec.tok.decode(ids[:2]) and len(errors) == 1, (text, errors)
            assert "the worker exited mid-request" in errors[0]
        else:
            r = complete(base, prompt)
            assert r.status_code == 503 and "the worker exited mid-request" in r.json()["error"]["message"]
        assert metrics(base)["history"][-1]["generated"] == 2
        assert "ended inside a line, which was ignored" in (tmp_path / "worker.log").read_text()
        r = complete(base, prompt_of(1))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == prompt_of(1)
        assert metrics(base)["worker"]["starts"] == 2


@pytest.mark.parametrize("fault", ["bad-cache", "bad-info"])
def test_a_bad_stats_line_leaves_metrics_and_the_answer_alone(tmp_path, fixtures_dir, fault):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--moe", "--fault", fault])
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        for i in range(3):
            r = complete(base, prompt_of(i))
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == prompt_of(i)
            m = requests.get(base + "/metrics", timeout=10)
            assert m.status_code == 200 and m.json()["cache"]["n_expert"] == 16    # the last good picture
            p = requests.get(base + "/metrics?format=prometheus", timeout=10)
            assert p.status_code == 200 and "strata_worker_up" in p.text


def test_a_burst_of_64_streaming_clients_is_answered(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB)
    n = 64
    results: list = [None] * n
    go = threading.Barrier(n)

    def client(i):
        go.wait()
        try:
            with requests.post(cfg_base[0] + "/v1/completions", stream=True, timeout=120,
                               json={"prompt": prompt_of(i), "max_tokens": 32, "stream": True}) as r:
                text = "".join(c["choices"][0]["text"] for c in sse_events(r) if c.get("choices"))
                results[i] = (r.status_code, text)
        except requests.RequestException as e:
            results[i] = ("no answer", repr(e))

    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        cfg_base = [base]
        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    assert [r for r in results if r is None or r[0] != 200] == []
    assert all(results[i][1] == prompt_of(i) for i in range(n))


def _stream_client(base, i, leave_after, out, deadline_s):
    """One streaming client; leave_after: drop the connection after that many content chunks (None: read on)."""
    p = prompt_of(i)
    t0 = time.monotonic()
    try:
        r = requests.post(base + "/v1/completions", stream=True, timeout=deadline_s,
                          json={"prompt": p, "max_tokens": 48, "stream": True})
    except requests.RequestException as e:
        out[i] = ("no answer", repr(e), time.monotonic() - t0)
        return
    with r:
        if r.status_code != 200:
            body = r.json()          # a refused request: well-formed JSON with an error object
            assert isinstance(body["error"]["message"], str)
            out[i] = ("error", body["error"]["message"], time.monotonic() - t0)
            return
        text, n = "", 0
        for raw in r.iter_lines():
            if not raw.startswith(b"data: "):
                continue
            if raw == b"data: [DONE]":
                out[i] = ("done", text, time.monotonic() - t0)
                return
            ev = json.loads(raw[6:])         # every event is well-formed JSON
            if "error" in ev:
                assert isinstance(ev["error"]["message"], str) and ev["error"]["code"] >= 400
                out[i] = ("stream error", text, time.monotonic() - t0)
                return
            text += ev["choices"][0]["text"] if ev["choices"] else ""
            n += 1
            if leave_after is not None and n >= leave_after:
                out[i] = ("left", text, time.monotonic() - t0)
                return
        out[i] = ("cut", text, time.monotonic() - t0)


def test_fault_suite_32_streaming_clients_under_chaos(tmp_path, fixtures_dir):
    """32 concurrent streaming clients (some leave midway) against a worker that misbehaves at random: nobody
    receives another's tokens, nobody waits past the deadline, errors are well-formed, and the service serves on."""
    codec = tiny_codec(fixtures_dir)
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--chaos", "0.35", "--token-delay", "0.002"],
                      engine_silence_s=1.0)
    n, deadline_s = 32, 120
    out: list = [None] * n
    with running_server(cfg, codec) as (httpd, base):
        threads = [threading.Thread(target=_stream_client, args=(base, i, 3 if i % 5 == 0 else None, out, deadline_s))
                   for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(deadline_s + 30)
        assert not any(t.is_alive() for t in threads), "a request hung past its deadline"
        for i, (what, text, _) in enumerate(out):
            assert what != "no answer", text
            assert what != "cut", f"client {i}: the stream ended without [DONE] or an error event"
            if what in ("done", "left", "stream error"):
                # its own answer or a piece of it (an early DONE ends an answer short), never another's
                assert prompt_of(i).startswith(text), (i, text)
        assert any(o[0] == "done" and o[1] == prompt_of(i) for i, o in enumerate(out))
        # the service serves on: a request after the storm (retried while chaos hits it) gets its own answer; chaos
        # is still on, so a 200 may be cut short by an early DONE, but it is never another's text
        for _ in range(20):
            r = complete(base, "hello there")
            if r.status_code == 200:
                text = r.json()["choices"][0]["text"]
                assert "hello there".startswith(text), text
                if text == "hello there":
                    break
                continue
            assert r.status_code == 503 and "message" in r.json()["error"]
        else:
            pytest.fail("no request was served after the storm")
        assert httpd.service.worker is None or httpd.service.busy() is False
