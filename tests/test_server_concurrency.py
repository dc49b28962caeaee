"""16 streaming clients at once against a fast fake worker, a quarter of them leaving at random moments.

The fake worker answers with the prompt's own tokens, so each client can check it got exactly its own answer.
"""
import random
import socket
import threading
import time

import requests

from fakes.server_kit import make_config, metrics, running_server, sse_events, tiny_codec

N_CLIENTS = 16
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def prompt_for(i: int, rng: random.Random) -> str:
    return f"client {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30)))


def finishing_client(base, prompt, out, i):
    r = requests.post(base + "/v1/completions", stream=True, timeout=60,
                      json=dict(prompt=prompt, max_tokens=500, stream=True))
    assert r.status_code == 200, r.text
    text, finish = [], None
    for ev in sse_events(r):
        c = ev["choices"][0]
        text.append(c["text"])
        finish = c["finish_reason"] or finish
        if c["finish_reason"]:
            out[i] = ("".join(text), finish, ev["usage"])


def leaving_client(port, prompt, rng, out, i):
    # A raw socket, so it can leave at any moment: while queued, before the headers, or mid-stream.
    body = ('{"prompt": "%s", "max_tokens": 500, "stream": true}' % prompt).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(rng.uniform(0, 0.3))
    want = rng.randint(0, 2000)
    got = 0
    while got < want:
        chunk = s.recv(min(4096, want - got))
        if not chunk:
            break
        got += len(chunk)
    s.close()
    out[i] = "left"


def test_sixteen_streaming_clients_quarter_leaving(tmp_path, fixtures_dir):
    rng = random.Random(1234)
    codec = tiny_codec(fixtures_dir)
    cfg = make_config(tmp_path, fixtures_dir / "vocab" / "tiny-bpe-1024.gguf", ["--token-delay", "0.002", "--moe"])
    prompts = [prompt_for(i, rng) for i in range(N_CLIENTS)]
    leaving = set(rng.sample(range(N_CLIENTS), N_CLIENTS // 4))
    out: dict = {}
    with running_server(cfg, codec) as (httpd, base):
        port = httpd.server_address[1]
        threads = []
        for i in range(N_CLIENTS):
            if i in leaving:
                t = threading.Thread(target=leaving_client, args=(port, prompts[i], random.Random(i), out, i))
            else:
                t = threading.Thread(target=finishing_client, args=(base, prompts[i], out, i))
            t.start()
            threads.append(t)
            time.sleep(rng.uniform(0, 0.02))
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a client hangs"

        deadline = time.monotonic() + 30
        while True:
            m = metrics(base)
            if m["queue"]["waiting"] == 0 and m["queue"]["running"] is None and m["totals"]["requests"] == N_CLIENTS:
                break
            assert time.monotonic() < deadline, f"the queue does not drain: {m['queue']}, {m['totals']}"
            time.sleep(0.1)

    for i in range(N_CLIENTS):
        if i in leaving:
            assert out.get(i) == "left"
            continue
        text, finish, use = out[i]
        assert text == codec.tok.decode(codec.tok.encode(prompts[i])), f"client {i} got someone else's tokens"
        assert finish == "stop" and use["completion_tokens"] == use["prompt_tokens"]

    t, hist = m["totals"], m["history"]
    assert len(hist) == N_CLIENTS and t["error"] == 0
    assert t["stop"] + t["cancel"] == N_CLIENTS and t["stop"] >= N_CLIENTS - len(leaving) and t["cancel"] >= 1
    for key in ("prompt_tokens", "prompt_read", "cached_tokens", "generated", "hits", "lookups", "ram_blobs",
                "file_blobs"):
        assert t[key] == sum(h[key] for h in hist), key
    assert t["file_blobs"] == t["generated"] and abs(t["file_mb"] - 2.5 * t["generated"]) < 1.0
    for h in hist:
        assert h["prompt_read"] + h["cached_tokens"] <= h["prompt_tokens"]
        if h["finish"] == "stop":
            assert h["generated"] == h["prompt_tokens"]
    assert m["worker"]["starts"] == 1 and t["lookups"] > 0


def test_history_keeps_the_last_500(tmp_path, fixtures_dir):
    from server.service import Job, Result, Service
    cfg = make_config(tmp_path, fixtures_dir / "vocab" / "tiny-bpe-1024.gguf")
    svc = Service(cfg, tiny_codec(fixtures_dir))
    try:
        for i in range(510):
            svc._record(Job("gen", id=f"gen-{i}"), Result("stop", prompt_tokens=3, generated=2), None, time.time())
        snap = svc.snapshot()
        assert len(snap["history"]) == 500 and snap["history"][0]["id"] == "gen-10"
        assert snap["totals"]["requests"] == 510 and snap["totals"]["generated"] == 1020
    finally:
        svc.close()


def test_a_worker_death_among_concurrent_clients_costs_only_its_request(tmp_path, fixtures_dir):
    rng = random.Random(99)
    codec = tiny_codec(fixtures_dir)
    plan = tmp_path / "plan.json"
    plan.write_text('["--die-in-prompt-of-gen 3 --token-delay 0.002", "--token-delay 0.002"]')
    cfg = make_config(tmp_path, fixtures_dir / "vocab" / "tiny-bpe-1024.gguf", ["--plan", str(plan)])
    prompts = [prompt_for(i, rng) for i in range(8)]
    results: dict = {}

    def client(i):
        r = requests.post(base + "/v1/completions", stream=True, timeout=60,
                          json=dict(prompt=prompts[i], max_tokens=500, stream=True))
        if r.status_code != 200:
            results[i] = ("http", r.status_code, r.json()["error"]["message"])
            return
        text = []
        for ev in sse_events(r):
            if "error" in ev:
                results[i] = ("error", "".join(text), ev["error"]["message"])
                return
            text.append(ev["choices"][0]["text"])
        results[i] = ("ok", "".join(text), None)

    with running_server(cfg, codec) as (httpd, base):
        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a client hangs"
        m = metrics(base)
    failed = [i for i, r in results.items() if r[0] != "ok"]
    assert len(failed) == 1 and "exited mid-request" in results[failed[0]][2]
    for i, r in results.items():
        if r[0] == "ok":
            assert r[1] == codec.tok.decode(codec.tok.encode(prompts[i])), f"client {i} got someone else's tokens"
    assert m["worker"]["starts"] == 2 and m["totals"]["error"] == 1 and m["totals"]["stop"] == 7
