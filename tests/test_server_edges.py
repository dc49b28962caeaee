"""Hardened edges of the HTTP front end (issue 18, item 5): every refusal is JSON, nothing leaks, nothing floods."""
import http.client
import io
import json
import socket
import sys
import time

import pytest
import requests

from fakes.server_kit import make_config, running_server, tiny_codec

VOCAB = "vocab/tiny-bpe-1024.gguf"


@pytest.fixture
def server(tmp_path, fixtures_dir):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB)
    with running_server(cfg, tiny_codec(fixtures_dir)) as (httpd, base):
        yield httpd, base


def raw(httpd, data: bytes) -> tuple[int, dict, bytes]:
    """Send bytes as they are; (status, headers, body) of the answer."""
    with socket.create_connection(("127.0.0.1", httpd.server_address[1]), timeout=20) as s:
        s.sendall(data)
        resp = http.client.HTTPResponse(s)
        resp.begin()
        return resp.status, dict(resp.getheaders()), resp.read()


def json_error(body: bytes) -> str:
    obj = json.loads(body)
    assert isinstance(obj["error"]["message"], str) and obj["error"]["message"]
    return obj["error"]["message"]


def test_deeply_nested_json_is_a_400(server):
    httpd, base = server
    for depth in (1000, 100_000):
        body = '{"prompt": ' + "[" * depth + "]" * depth + "}"
        r = requests.post(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"},
                          timeout=30)
        assert r.status_code == 400 and "nested too deeply" in json_error(r.content)
    assert requests.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).ok


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH"])
def test_other_methods_get_a_json_405(server, method):
    _, base = server
    r = requests.request(method, base + "/v1/chat/completions", json={}, timeout=10)
    assert r.status_code == 405 and "GET" in r.headers["Allow"]
    assert "not allowed" in json_error(r.content)


def test_oversized_headers_and_request_line_are_json(server):
    httpd, _ = server
    status, headers, body = raw(httpd, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 70_000 +
                                b"\r\n\r\n")
    assert status == 431 and headers["Content-Type"] == "application/json" and "headers" in json_error(body)
    status, headers, body = raw(httpd, b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status == 414 and headers["Content-Type"] == "application/json" and "request line" in json_error(body)
    status, headers, body = raw(httpd, b"BREW /pot HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status == 501 and "not supported" in json_error(body)


def test_a_client_that_leaves_leaves_no_traceback(server, monkeypatch):
    httpd, _ = server
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    for exc in (BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset")):
        try:
            raise exc
        except OSError:
            httpd.handle_error(None, ("127.0.0.1", 1))
    assert err.getvalue() == ""
    try:
        raise ValueError("a real bug")
    except ValueError:
        httpd.handle_error(None, ("127.0.0.1", 1))
    assert "a real bug" in err.getvalue()           # real errors still show


def test_a_non_loopback_host_needs_an_api_key(tmp_path, fixtures_dir):
    from server.config import ConfigError
    for host in ("0.0.0.0", "192.168.1.5", "::", "example.org"):
        with pytest.raises(ConfigError, match="api_key"):
            make_config(tmp_path, fixtures_dir / VOCAB, host=host)
        assert make_config(tmp_path, fixtures_dir / VOCAB, host=host, api_key="k").host == host
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert make_config(tmp_path, fixtures_dir / VOCAB, host=host).host == host


def test_metrics_carry_a_per_second_token_series(server):
    _, base = server
    r = requests.post(base + "/v1/completions", json={"prompt": "hello there", "max_tokens": 8}, timeout=30)
    m = requests.get(base + "/metrics", timeout=10).json()
    series = m["tok_s_series"]
    assert len(series) == 300 and sum(series) == r.json()["usage"]["completion_tokens"] > 0


def test_a_worker_that_cannot_start_is_a_503_without_paths(tmp_path, fixtures_dir, caplog):
    cfg = make_config(tmp_path, fixtures_dir / VOCAB, worker=[str(tmp_path / "no" / "such-worker")])
    with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
        r = requests.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        msg = json_error(r.content)
        assert r.status_code == 503 and "could not start the worker" in msg
        assert str(tmp_path) not in msg and "such-worker" in caplog.text      # the command goes to the server log


def test_a_bug_in_a_handler_is_a_json_500_and_a_logged_traceback(server, caplog):
    httpd, base = server
    httpd.service.snapshot = lambda: 1 / 0
    r = requests.get(base + "/metrics", timeout=10)
    assert r.status_code == 500 and "ZeroDivisionError" in json_error(r.content)
    assert "Traceback" in caplog.text and "internal error answering GET /metrics" in caplog.text


def _loaded(base):
    deadline = time.monotonic() + 30
    while requests.get(base + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the model did not load"
        time.sleep(0.05)


@pytest.mark.parametrize("path", ["/", "/health", "/v1/models", "/metrics", "/favicon.ico"])
def test_head_answers_as_get_without_a_body(server, path):
    httpd, base = server
    _loaded(base)
    get = requests.get(base + path, timeout=10)
    conn = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=10)
    try:
        conn.request("HEAD", path)
        r = conn.getresponse()
        assert r.status == get.status_code == 200 and r.read() == b""
        assert r.getheader("Content-Type") == get.headers["Content-Type"]
        if path not in ("/metrics",):        # /metrics' body changes from call to call
            assert int(r.getheader("Content-Length")) == len(get.content)
        # the connection stays in step: no body bytes were sent after the headers
        conn.request("GET", "/health")
        r2 = conn.getresponse()
        assert r2.status == 200 and json.loads(r2.read())["status"] == "ok"
    finally:
        conn.close()


def test_the_web_app_declares_an_icon_that_is_served(server):
    _, base = server
    page = requests.get(base + "/", timeout=10).text
    assert '<link rel="icon" href="favicon.svg"' in page
    for path in ("/favicon.svg", "/favicon.ico"):
        r = requests.get(base + path, timeout=10)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("image/svg+xml")
        assert r.text.startswith("<svg") and len(r.content) < 2048


def _client_hello() -> bytes:
    """The first bytes a TLS client sends (a real ClientHello, from Python's own ssl module)."""
    import ssl
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def _answer_until_close(httpd, data: bytes, wait_s: float = 10.0) -> tuple[bytes, float]:
    t0 = time.monotonic()
    got = b""
    with socket.create_connection(("127.0.0.1", httpd.server_address[1]), timeout=wait_s) as s:
        s.sendall(data)
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        except socket.timeout:
            pytest.fail(f"no answer and no close within {wait_s:g} s (got {got[:60]!r})")
        except ConnectionResetError:
            pass
    return got, time.monotonic() - t0


def test_a_tls_hello_on_the_plain_port_is_answered_at_once(server):
    httpd, _ = server
    hello = _client_hello()
    assert hello[:1] == b"\x16"
    got, took = _answer_until_close(httpd, hello)
    assert took < 5.0
    assert got == b"" or got.startswith(b"HTTP/1.1 400 "), got[:80]
    if got:
        assert b"plain HTTP, not TLS" in got
    # a TLS client sees a prompt failure (not a timeout)
    import ssl
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", httpd.server_address[1]), timeout=10) as s:
        with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)) as e:
            ctx.wrap_socket(s, server_hostname="localhost")
    assert not isinstance(e.value, socket.timeout) and time.monotonic() - t0 < 5.0


def test_an_http2_preface_gets_an_http11_505_with_a_status_line(server):
    httpd, _ = server
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"   # + an empty SETTINGS
    got, took = _answer_until_close(httpd, preface)
    assert took < 5.0 and got.startswith(b"HTTP/1.1 505 "), got[:80]
    status, headers, body = raw(httpd, preface)
    assert status == 505 and headers["Content-Type"] == "application/json" and "HTTP/1.1" in json_error(body)


@pytest.mark.parametrize("line, status", [(b"GET /\r\n", 400), (b"GET / HTTP/1.1 x\r\n\r\n", 400),
                                          (b"GET / FTP/1.0\r\n\r\n", 400), (b"GET / HTTP/3.0\r\n\r\n", 505)])
def test_a_malformed_request_line_gets_a_status_line(server, line, status):
    httpd, _ = server
    got, took = _answer_until_close(httpd, line)
    assert took < 5.0 and got.startswith(f"HTTP/1.1 {status} ".encode()), got[:80]
    assert raw(httpd, line)[0] == status
