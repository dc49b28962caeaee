"""The HTTP API's shapes and checks, against a fake worker (answers echo the prompt's tokens)."""
import json
import time

import pytest
import requests

from fakes.server_kit import make_config, metrics, running_server, sse_events, tiny_codec

VOCAB = "vocab/tiny-bpe-1024.gguf"


@pytest.fixture(scope="module")
def server(tmp_path_factory, fixtures_dir):
    tmp = tmp_path_factory.mktemp("api")
    cfg = make_config(tmp, fixtures_dir / VOCAB, ["--moe", "--ctx", "256"], sampling={"temperature": 0.5})
    with running_server(cfg, tiny_codec(fixtures_dir)) as (httpd, base):
        yield httpd, base


def chat(base, **kw):
    body = dict(messages=[{"role": "user", "content": "hi"}])
    body.update(kw)
    return requests.post(base + "/v1/chat/completions", json=body, timeout=30, stream=bool(kw.get("stream")))


def test_chat_non_stream_shape(server):
    _, base = server
    r = chat(base, max_tokens=100)
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["object"] == "chat.completion" and b["model"] == "fake"
    c = b["choices"][0]
    assert c["message"]["role"] == "assistant" and c["message"]["content"].startswith("user\nhi")
    assert c["finish_reason"] == "stop"
    u = b["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and "cached_tokens" in u["prompt_tokens_details"]
    assert set(b["timings"]) == {"cache_n", "prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                                 "predicted_per_second"}


def test_chat_stream_shape_and_usage(server):
    _, base = server
    r = chat(base, max_tokens=5, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["Content-Type"] == "text/event-stream"
    evs = list(sse_events(r))
    assert evs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert evs[-2]["choices"][0]["finish_reason"] == "length" and "timings" in evs[-2]
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == 5


def test_second_turn_reports_cached_tokens(server):
    _, base = server
    msgs = [{"role": "user", "content": "a question about caching"}]
    chat(base, messages=msgs, max_tokens=3)
    r = chat(base, messages=msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
             max_tokens=3)
    b = r.json()
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert b["timings"]["cache_n"] + b["timings"]["prompt_n"] == b["usage"]["prompt_tokens"]


def test_completions_stop_string_across_tokens(server):
    _, base = server
    r = requests.post(base + "/v1/completions", json=dict(prompt="one two three four", max_tokens=50,
                                                          stop=["hree f"]), timeout=30)
    c = r.json()["choices"][0]
    assert c["text"] == "one two t" and c["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_ties_the_same_streamed_or_not(server, stream):
    """Earliest start wins, then the longest stop at that start (the fake worker answers with the prompt)."""
    _, base = server

    def messages(content, stops):
        r = requests.post(base + "/v1/messages", stream=stream, timeout=30, json=dict(
            max_tokens=100, stream=stream, stop_sequences=stops, messages=[{"role": "user", "content": content}]))
        if not stream:
            b = r.json()
            return b["content"][-1]["text"], b["stop_reason"], b["stop_sequence"]
        text, end = "", None
        for ln in r.iter_lines(decode_unicode=True):
            if ln.startswith("data: "):
                ev = json.loads(ln[6:])
                text += ev.get("delta", {}).get("text", "") if ev["type"] == "content_block_delta" else ""
                end = ev["delta"] if ev["type"] == "message_delta" else end
        return text, end["stop_reason"], end["stop_sequence"]

    text, reason, seq = messages("one two three four", ["thr", "four", "three f"])
    assert text.endswith("one two ") and (reason, seq) == ("stop_sequence", "three f")
    # the answer ends while a longer stop could still have followed: the end decides for the shorter one
    text, reason, seq = messages("one two thr", ["three", "thr"])
    assert text.endswith("one two ") and "thr" not in text and (reason, seq) == ("stop_sequence", "thr")


def test_completions_stream(server):
    _, base = server
    r = requests.post(base + "/v1/completions", json=dict(prompt="stream me", max_tokens=50, stream=True),
                      stream=True, timeout=30)
    evs = list(sse_events(r))
    assert "".join(e["choices"][0]["text"] for e in evs) == "stream me"
    assert evs[-1]["choices"][0]["finish_reason"] == "stop" and evs[-1]["usage"]["completion_tokens"] > 0


def test_max_tokens_zero_means_rest_of_context(server):
    _, base = server
    r = requests.post(base + "/v1/completions", json=dict(prompt=list(range(300, 340)), max_tokens=0), timeout=30)
    assert r.json()["usage"]["completion_tokens"] == 40      # the echo ends by itself before the context
    gen = [ln for ln in open(server[0].cfg.log).read().splitlines() if "GEN" in ln][-1]
    assert "max_new=208" in gen                              # 256 - 40 - 8


def test_max_tokens_unset_means_rest_of_context(server):
    _, base = server
    requests.post(base + "/v1/completions", json=dict(prompt=list(range(300, 310))), timeout=30)
    gen = [ln for ln in open(server[0].cfg.log).read().splitlines() if "GEN" in ln][-1]
    assert "max_new=238" in gen                              # 256 - 10 - 8


def test_prompt_too_long_is_a_400_never_truncated(server):
    _, base = server
    r = requests.post(base + "/v1/completions", json=dict(prompt=list(range(300, 550))), timeout=30)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "250 tokens" in msg and "context holds 256" in msg and "--ctx" in msg
    r = chat(base, messages=[{"role": "user", "content": "word " * 300}], stream=True)
    assert r.status_code == 400 and "context holds 256" in r.json()["error"]["message"]


def test_a_prompt_the_codec_refuses_is_a_400(server):
    _, base = server
    r = requests.post(base + "/v1/completions", json=dict(prompt=[5, 99999]), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "token id 99999 is outside" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, param", [
    (dict(messages="hi"), "messages"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "messages"),
    (dict(messages=[{"role": "user", "content": "x"}], temperature="hot"), "temperature"),
    (dict(messages=[{"role": "user", "content": "x"}], temperature=-1), "temperature"),
    (dict(messages=[{"role": "user", "content": "x"}], max_tokens="10"), "max_tokens"),
    (dict(messages=[{"role": "user", "content": "x"}], max_tokens=True), "max_tokens"),
    (dict(messages=[{"role": "user", "content": "x"}], stream="yes"), "stream"),
    (dict(messages=[{"role": "user", "content": "x"}], top_p=0), "top_p"),
    (dict(messages=[{"role": "user", "content": "x"}], stop=[1, 2]), "stop"),
    (dict(messages=[{"role": "user", "content": "x"}], n=0), "n"),
    (dict(messages=[{"role": "user", "content": "x"}], n=17), "n"),
    (dict(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(messages=[{"role": "user", "content": "x"}], top_logprobs=2), "top_logprobs"),
    (dict(messages=[{"role": "user", "content": "x"}], response_format={"type": "xml"}), "response_format"),
    (dict(messages=[{"role": "user", "content": "x"}], response_format={"type": "json_schema",
                                                                        "json_schema": {"schema": {"type": "bogus"}}}),
     "response_format"),
    (dict(messages=[{"role": "user", "content": "x"}], tool_choice="required"), "tool_choice"),
    (dict(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    (dict(messages=[{"role": "user", "content": "x"}], seed=1.5), "seed"),
])
def test_field_type_checks(server, body, param):
    _, base = server
    r = requests.post(base + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_bad_json_and_unknown_endpoint(server):
    _, base = server
    r = requests.post(base + "/v1/chat/completions", data=b"{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = requests.post(base + "/v1/chat/completions", data=b"[1]", timeout=30)
    assert r.status_code == 400
    assert requests.get(base + "/v1/nothing", timeout=30).status_code == 404


def test_sampling_defaults_from_config_and_request(server):
    httpd, base = server

    def last_params():
        gen = [ln for ln in open(httpd.cfg.log).read().splitlines() if "fake worker: GEN" in ln][-1]
        return json.loads(gen.split("params=")[1].split(" prompt=")[0])

    chat(base, max_tokens=1)
    assert last_params() == {"temperature": 0.5}
    chat(base, max_tokens=1, temperature=0, top_k=5, frequency_penalty=0.5, seed=7)
    assert last_params() == {"top_k": 5, "penalty_freq": 0.5, "seed": 7}


def test_messages_anthropic_shape(server):
    _, base = server
    r = requests.post(base + "/v1/messages", timeout=30, json=dict(
        max_tokens=50, system="be brief", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]))
    b = r.json()
    assert r.status_code == 200 and b["type"] == "message" and b["content"][-1]["type"] == "text"
    assert b["content"][-1]["text"].startswith("system\nbe brief") and b["stop_reason"] == "end_turn"
    assert b["usage"]["input_tokens"] > 0 and b["usage"]["output_tokens"] > 0
    r = requests.post(base + "/v1/messages", timeout=30, json=dict(messages=[{"role": "user", "content": "x"}]))
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]


def test_messages_stream_events(server):
    _, base = server
    r = requests.post(base + "/v1/messages", stream=True, timeout=30,
                      json=dict(max_tokens=4, stream=True, messages=[{"role": "user", "content": "hi"}]))
    names = [ln[7:] for ln in r.iter_lines(decode_unicode=True) if ln.startswith("event: ")]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert "content_block_delta" in names and names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_models_health_metrics(server):
    _, base = server
    assert requests.get(base + "/v1/models", timeout=30).json()["data"][0]["id"] == "fake"
    assert requests.get(base + "/health", timeout=30).json()["status"] == "ok"
    m = metrics(base)
    assert m["cache"]["n_layer"] == 4 and m["cache"]["n_expert"] == 16 and len(m["cache"]["heat"]) == 4
    assert m["worker"]["info"]["backend"] == "fake" and m["totals"]["requests"] >= 1
    text = requests.get(base + "/metrics?format=prometheus", timeout=30).text
    assert 'strata_requests_total{model="fake",finish="stop"}' in text
    assert "# TYPE strata_generated_tokens_total counter" in text
    t = m["totals"]
    assert t["file_blobs"] == t["generated"] > 0       # the fake worker reads one expert a token from the file
    assert f'strata_expert_file_reads_total{{model="fake"}} {t["file_blobs"]}' in text
    assert "# TYPE strata_expert_ram_reads_total counter" in text


def test_unload_refused_while_busy_then_load(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--token-delay", "0.05"])
    with running_server(cfg, tiny_codec(fixtures_dir)) as (httpd, base):
        r = requests.post(base + "/v1/completions", json=dict(prompt="x" * 40, max_tokens=40, stream=True),
                          stream=True, timeout=30)
        next(sse_events(r))
        u = requests.post(base + "/unload", timeout=30)
        assert u.status_code == 409 and "running or waiting" in u.json()["error"]["message"]
        r.close()
        deadline = time.monotonic() + 20
        while httpd.service.busy():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert requests.post(base + "/unload", timeout=30).status_code == 200
        assert metrics(base)["phase"] == "unloaded" and not metrics(base)["worker"]["alive"]
        assert requests.post(base + "/load", timeout=30).status_code == 200
        assert metrics(base)["worker"]["alive"]


def test_idle_unload(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, idle_unload_s=0.3)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        requests.post(base + "/v1/completions", json=dict(prompt="abc"), timeout=30)
        deadline = time.monotonic() + 20
        while metrics(base)["worker"]["alive"]:
            assert time.monotonic() < deadline, "the idle worker was not unloaded"
            time.sleep(0.1)
        assert metrics(base)["phase"] == "unloaded"
        r = requests.post(base + "/v1/completions", json=dict(prompt="abc"), timeout=30)
        assert r.json()["choices"][0]["text"] == "abc" and metrics(base)["worker"]["starts"] == 2


def test_web_app_is_served(server):
    _, base = server
    r = requests.get(base + "/", timeout=30)
    assert r.status_code == 200 and "<html" in r.text.lower() and "text/html" in r.headers["Content-Type"]
    for name in ("app.js", "app.css"):
        assert requests.get(f"{base}/{name}", timeout=30).status_code == 200
    assert requests.get(base + "/../server/config.py", timeout=30).status_code == 404


def test_json_bodies_round_trip_unicode(server):
    _, base = server
    r = requests.post(base + "/v1/completions", timeout=30,
                      data=json.dumps(dict(prompt="héllo wörld ✓", max_tokens=50)).encode())
    assert r.json()["choices"][0]["text"] == "héllo wörld ✓"


def test_stream_keepalive_while_a_prompt_is_read(tmp_path, fixtures_dir, monkeypatch):
    import server.openai_api as api
    monkeypatch.setattr(api, "KEEPALIVE_S", 0.2)
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, ["--chunk", "4", "--pp-delay", "0.3"])
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        r = requests.post(base + "/v1/completions", json=dict(prompt=list(range(300, 316)), max_tokens=2,
                                                              stream=True), stream=True, timeout=30)
        lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
        assert ": keep-alive" in lines and lines[-1] == "data: [DONE]"
        assert lines.index(": keep-alive") < min(i for i, ln in enumerate(lines) if ln.startswith("data:"))
