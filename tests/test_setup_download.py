"""setup/download.py against a local HTTP server playing the Hugging Face hub (no network).

FakeHub answers HEAD on /<repo>/resolve/<rev>/<file> with a redirect carrying X-Linked-Etag / X-Linked-Size (as the
hub does), serves the bytes with HTTP Range, and can cut a transfer half-way, ignore Range, or serve a wrong file.
It records every request, so the tests check what the client actually asked for.
"""
import hashlib
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from setup import download as dl


class FakeHub:
    def __init__(self):
        self.files: dict[str, bytes] = {}     # "repo/rev/name" -> content
        self.publish_hash = True
        self.cut_next = 0                     # cut this many of the next GETs half-way through
        self.wrong_next = 0                   # serve this many of the next GETs with wrong bytes
        self.ignore_range = False
        self.renamed: dict[str, str] = {}     # old repo -> new repo: a relative redirect, as the hub does
        self.requests: list[tuple[str, str, str | None]] = []   # (method, path, Range header)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _key(self):
                m = re.match(r"^/(.+)/resolve/([^/]+)/(.+)$", self.path)
                return f"{m.group(1)}/{m.group(2)}/{m.group(3)}" if m else None

            def _empty(self, status, **headers):
                """A bodiless answer: the status, these headers, Content-Length 0."""
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k.replace("_", "-"), v)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _renamed(self):
                for old, new in hub.renamed.items():
                    if self.path.startswith(f"/{old}/"):
                        self._empty(307, Location=self.path.replace(f"/{old}/", f"/{new}/", 1))
                        return True
                return False

            def do_HEAD(self):
                hub.requests.append(("HEAD", self.path, self.headers.get("Range")))
                if self._renamed():
                    return
                key = self._key()
                if key not in hub.files:
                    return self._empty(404)
                data = hub.files[key]
                linked = {"x_linked_etag": '"%s"' % hashlib.sha256(data).hexdigest()} if hub.publish_hash else {}
                self._empty(302, Location="/cdn/" + key, **linked, x_linked_size=str(len(data)))

            def do_GET(self):
                hub.requests.append(("GET", self.path, self.headers.get("Range")))
                if self.path.startswith("/cdn/"):
                    return self._serve(self.path[len("/cdn/"):])
                if self._renamed():
                    return
                key = self._key()
                if key not in hub.files:
                    return self._empty(404)
                self._empty(302, Location="/cdn/" + key)

            def _serve(self, key):
                data = hub.files[key]
                if hub.wrong_next:
                    hub.wrong_next -= 1
                    data = bytes(b ^ 0xFF for b in data)
                start = 0
                rng = self.headers.get("Range")
                if rng and not hub.ignore_range:
                    start = int(re.match(r"bytes=(\d+)-", rng).group(1))
                    if start >= len(data):
                        return self._empty(416)
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if hub.cut_next:
                    hub.cut_next -= 1
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def add(self, repo, name, data, rev="main"):
        self.files[f"{repo}/{rev}/{name}"] = data

    def gets(self):
        return [r for r in self.requests if r[0] == "GET" and r[1].startswith("/cdn/")]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub():
    h = FakeHub()
    yield h
    h.close()


def payload(n=3 * 1024 * 1024 + 17, seed=1):
    block = bytes((i * 131 + seed) % 251 for i in range(4099))
    return (block * (n // len(block) + 1))[:n]


def test_download_checks_the_hubs_lfs_hash_and_leaves_a_note(hub, tmp_path):
    data = payload()
    hub.add("org/model-GGUF", "m.gguf", data)
    dest = tmp_path / "m.gguf"
    digest = dl.fetch(dl.hub_url("org/model-GGUF", "main", "m.gguf", hub.url), dest, say=lambda s: None)
    assert digest == hashlib.sha256(data).hexdigest()
    assert dest.read_bytes() == data
    assert not (tmp_path / "m.gguf.part").exists()
    assert dl.verified(dest)
    assert "verified" in dl.note_path(dest).read_text()


def test_cut_transfer_resumes_with_a_range_request(hub, tmp_path):
    data = payload()
    hub.add("org/r", "m.gguf", data)
    hub.cut_next = 1
    dest = tmp_path / "m.gguf"
    dl.fetch(dl.hub_url("org/r", "main", "m.gguf", hub.url), dest, say=lambda s: None)
    assert dest.read_bytes() == data
    gets = hub.gets()
    assert len(gets) == 2
    assert gets[0][2] is None
    # the server cut after half the body: the client continued from what it had written (whole chunks), not from 0
    start = int(gets[1][2].removeprefix("bytes=").rstrip("-"))
    assert 0 < start <= len(data) // 2


def test_part_file_from_an_earlier_run_is_continued(hub, tmp_path):
    data = payload()
    hub.add("org/r", "m.gguf", data)
    dest = tmp_path / "m.gguf"
    (tmp_path / "m.gguf.part").write_bytes(data[:1000])
    dl.fetch(dl.hub_url("org/r", "main", "m.gguf", hub.url), dest, say=lambda s: None)
    assert dest.read_bytes() == data
    assert [g[2] for g in hub.gets()] == ["bytes=1000-"]


def test_server_ignoring_range_restarts_the_file(hub, tmp_path):
    data = payload()
    hub.add("org/r", "m.gguf", data)
    hub.ignore_range = True
    dest = tmp_path / "m.gguf"
    (tmp_path / "m.gguf.part").write_bytes(b"junk" * 100)
    dl.fetch(dl.hub_url("org/r", "main", "m.gguf", hub.url), dest, say=lambda s: None)
    assert dest.read_bytes() == data


def test_wrong_hash_is_deleted_and_fetched_once_more(hub, tmp_path):
    data = payload()
    hub.add("org/r", "m.gguf", data)
    hub.wrong_next = 1
    said = []
    dest = tmp_path / "m.gguf"
    dl.fetch(dl.hub_url("org/r", "main", "m.gguf", hub.url), dest, say=said.append)
    assert dest.read_bytes() == data
    assert len(hub.gets()) == 2 and all(g[2] is None for g in hub.gets())
    assert any("fetched once more" in s for s in said)


def test_second_wrong_hash_stops_with_a_clear_message(hub, tmp_path):
    hub.add("org/r", "m.gguf", payload())
    hub.wrong_next = 2
    dest = tmp_path / "m.gguf"
    with pytest.raises(dl.DownloadError, match="wrong SHA-256 twice"):
        dl.fetch(dl.hub_url("org/r", "main", "m.gguf", hub.url), dest, say=lambda s: None)
    assert not dest.exists() and not (tmp_path / "m.gguf.part").exists()


def test_catalog_hash_is_used_when_the_hub_publishes_none(hub, tmp_path):
    data = payload(5000)
    hub.add("org/r", "m.gguf", data)
    hub.publish_hash = False
    url = dl.hub_url("org/r", "main", "m.gguf", hub.url)
    with pytest.raises(dl.DownloadError, match="twice"):
        dl.fetch(url, tmp_path / "a.gguf", sha256="0" * 64, say=lambda s: None)
    assert dl.fetch(url, tmp_path / "b.gguf", sha256=hashlib.sha256(data).hexdigest(),
                    say=lambda s: None) == hashlib.sha256(data).hexdigest()
    said = []
    dl.fetch(url, tmp_path / "c.gguf", say=said.append)
    assert any("only the size was checked" in s for s in said)
    assert "unverified" in dl.note_path(tmp_path / "c.gguf").read_text()


def test_missing_file_is_a_clear_error(hub, tmp_path):
    with pytest.raises(dl.DownloadError, match="HTTP 404"):
        dl.fetch(dl.hub_url("org/r", "main", "nope.gguf", hub.url), tmp_path / "x.gguf", say=lambda s: None)


def test_hf_endpoint_is_honoured(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example:9000/")
    assert dl.hub_url("a/b", "main", "Q4/x.gguf") == "http://mirror.example:9000/a/b/resolve/main/Q4/x.gguf"
    monkeypatch.delenv("HF_ENDPOINT")
    assert dl.hub_url("a/b", "rev1", "x.gguf") == "https://huggingface.co/a/b/resolve/rev1/x.gguf"


def test_note_goes_stale_when_the_file_changes(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(100))
    dl.write_note(f, "a" * 64, checked=True)
    assert dl.verified(f)
    with open(f, "ab") as fh:
        fh.write(b"x")
    assert not dl.verified(f)


def test_progress_line_has_rate_and_time_left(tmp_path):
    class Stream:
        def __init__(self):
            self.text = ""

        def isatty(self):
            return False

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    s = Stream()
    p = dl.Progress("m.gguf", 10_000_000, stream=s)
    p.update(5_000_000, force=True)
    assert "50.0%" in s.text and "MB/s" in s.text and "left" in s.text
    assert os.linesep in s.text or "\n" in s.text


def test_a_file_already_there_is_checked_not_fetched_again(hub, tmp_path):
    data = payload()
    hub.add("org/r", "m.gguf", data)
    dest = tmp_path / "m.gguf"
    dest.write_bytes(data)                       # put there by hand: no note beside it
    dl.fetch(dl.hub_url("org/r", "main", "m.gguf", hub.url), dest, say=lambda s: None)
    assert hub.gets() == [] and dl.verified(dest)
    bad = tmp_path / "b.gguf"
    hub.add("org/r", "b.gguf", data)
    bad.write_bytes(bytes(len(data)))            # same size, wrong bytes: deleted and fetched
    said = []
    dl.fetch(dl.hub_url("org/r", "main", "b.gguf", hub.url), bad, say=said.append)
    assert bad.read_bytes() == data and len(hub.gets()) == 1
    assert any("fetched once more" in s for s in said)


def test_not_enough_disk_is_said_before_fetching(hub, tmp_path, monkeypatch):
    hub.add("org/r", "m.gguf", payload(10_000))
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: type("U", (), {"free": 5_000})())
    with pytest.raises(dl.DownloadError, match="needs 0.0 GB more .* has 0.0 GB free"):
        dl.fetch(dl.hub_url("org/r", "main", "m.gguf", hub.url), tmp_path / "m.gguf", say=lambda s: None)
    assert hub.gets() == []


def test_unreachable_hub_names_the_cause():
    with pytest.raises(dl.DownloadError, match=r"cannot reach http://127.0.0.1:9/a/b/resolve/main/x.gguf "
                                               r"\(Connection refused\); .*HF_ENDPOINT"):
        dl.probe(dl.hub_url("a/b", "main", "x.gguf", "http://127.0.0.1:9"))


def test_a_renamed_repository_is_followed_to_its_hash(hub, tmp_path):
    data = payload(20_000)
    hub.add("new-org/r", "m.gguf", data)
    hub.renamed["old-org/r"] = "new-org/r"
    dest = tmp_path / "m.gguf"
    digest = dl.fetch(dl.hub_url("old-org/r", "main", "m.gguf", hub.url), dest, say=lambda s: None)
    assert digest == hashlib.sha256(data).hexdigest() and "unverified" not in dl.note_path(dest).read_text()


def test_the_catalogs_pinned_hash_is_never_overridden_by_the_hubs(hub, tmp_path):
    data = payload(5000)
    hub.add("org/r", "m.gguf", data)          # the hub publishes this file's own hash
    url = dl.hub_url("org/r", "main", "m.gguf", hub.url)
    with pytest.raises(dl.DownloadError, match="changed upstream"):
        dl.fetch(url, tmp_path / "a.gguf", sha256="ab" * 32, say=lambda s: None)
    assert not (tmp_path / "a.gguf").exists() and not hub.gets()     # nothing fetched, nothing kept
    assert dl.fetch(url, tmp_path / "b.gguf", sha256=hashlib.sha256(data).hexdigest(),
                    say=lambda s: None) == hashlib.sha256(data).hexdigest()

