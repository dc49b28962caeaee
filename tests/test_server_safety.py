"""API key, CORS, Host/Origin (DNS rebinding) and body-size rules: each with a refused and an accepted request."""
import http.client
import json

import pytest
import requests

from fakes.server_kit import make_config, running_server, tiny_codec

KEY = "s3cret-key"
SITE = "http://localhost:3000"


@pytest.fixture(scope="module")
def server(tmp_path_factory, fixtures_dir):
    tmp = tmp_path_factory.mktemp("safety")
    cfg = make_config(tmp, fixtures_dir / "vocab" / "tiny-bpe-1024.gguf", api_key=KEY, cors_origins=[SITE])
    with running_server(cfg, tiny_codec(fixtures_dir)) as (httpd, base):
        yield httpd, base


def raw(server, method, path, headers, body=None):
    """A request with exactly these headers (requests would set Host itself)."""
    conn = http.client.HTTPConnection("127.0.0.1", server[0].server_address[1], timeout=30)
    conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    for k, v in headers.items():
        conn.putheader(k, v)
    conn.endheaders(body)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r, data


def test_api_key_required(server):
    _, base = server
    body = dict(prompt="abc", max_tokens=5)
    r = requests.post(base + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = requests.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401
    assert requests.get(base + "/metrics", timeout=30).status_code == 401
    r = requests.post(base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"
    r = requests.post(base + "/v1/completions", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 200
    assert requests.get(base + "/health", timeout=30).status_code == 200     # open: for monitors


def test_cors_only_for_configured_origins(server):
    _, base = server
    auth = {"Authorization": f"Bearer {KEY}"}
    r = requests.get(base + "/v1/models", headers={**auth, "Origin": SITE}, timeout=30)
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == SITE
    r = requests.options(base + "/v1/chat/completions", timeout=30, headers={
        "Origin": SITE, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert r.status_code == 204 and "Authorization" in r.headers["Access-Control-Allow-Headers"]
    r = requests.get(base + "/v1/models", headers={**auth, "Origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 403 and "Access-Control-Allow-Origin" not in r.headers
    assert "cors_origins" in r.json()["error"]["message"]
    r = requests.options(base + "/v1/chat/completions", headers={"Origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 403


def test_own_origin_is_allowed_without_cors(server):
    _, base = server
    port = server[0].server_address[1]
    r = requests.get(base + "/v1/models", timeout=30,
                     headers={"Authorization": f"Bearer {KEY}", "Origin": f"http://127.0.0.1:{port}"})
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers


def test_foreign_host_refused(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    r, data = raw(server, "GET", "/v1/models", {**auth, "Host": "attacker.example:8080"})
    assert r.status == 403 and "DNS rebinding" in json.loads(data)["error"]["message"]
    r, _ = raw(server, "GET", "/health", {"Host": "attacker.example"})
    assert r.status == 403
    for host in ("localhost:8080", "127.0.0.1", "[::1]:8080", "app.localhost"):
        r, _ = raw(server, "GET", "/v1/models", {**auth, "Host": host})
        assert r.status == 200, host


def test_body_size_limit(server, monkeypatch):
    import server.openai_api as api
    monkeypatch.setattr(api, "MAX_BODY", 1000)
    auth = {"Authorization": f"Bearer {KEY}", "Host": "127.0.0.1", "Content-Type": "application/json"}
    big = json.dumps(dict(prompt="x" * 2000, max_tokens=1)).encode()
    r, data = raw(server, "POST", "/v1/completions", {**auth, "Content-Length": str(len(big))}, big)
    assert r.status == 413 and "limit is 1000" in json.loads(data)["error"]["message"]
    small = json.dumps(dict(prompt="x" * 20, max_tokens=1)).encode()
    r, _ = raw(server, "POST", "/v1/completions", {**auth, "Content-Length": str(len(small))}, small)
    assert r.status == 200


def test_binds_loopback_by_default(tmp_path, fixtures_dir):
    from server.config import validate
    cfg = validate({"model": str(fixtures_dir / "vocab" / "tiny-bpe-1024.gguf")}, tmp_path)
    assert cfg.host == "127.0.0.1" and cfg.port == 8080


def test_refused_post_does_not_poison_the_connection(server):
    # A 401 sent before the body was read must close the connection, or the body would be parsed as a request.
    s = requests.Session()
    _, base = server
    r = s.post(base + "/v1/completions", json=dict(prompt="abc", max_tokens=2), timeout=30)
    assert r.status_code == 401 and r.headers.get("Connection") == "close"
    r = s.post(base + "/v1/completions", json=dict(prompt="abc", max_tokens=2), timeout=30,
               headers={"x-api-key": KEY})
    assert r.status_code == 200
    r, _ = raw(server, "GET", "/health", {"Host": "[::1"})
    assert r.status == 400
