"""Resumable, verified downloads from the Hugging Face hub (or a mirror named by HF_ENDPOINT).

- The hub's resolve URL answers a HEAD with the file's LFS object id (`X-Linked-Etag`, the SHA-256 of the
  content) and size (`X-Linked-Size`) before redirecting to the storage; the file is checked against the catalog's
  pinned sha256, or that id when the catalog pins none (a hub hash that differs from the pin stops the download).
- Bytes go to `<name>.part`; a cut transfer (in this run or an earlier one) continues with `Range: bytes=<have>-`.
  The SHA-256 is computed while the bytes arrive (the part already on disk is read once first), so a 100 GB file is
  not read twice.
- A finished file whose hash is wrong is deleted and fetched once more; a second wrong hash stops with a message.
- A verified file gets a `<name>.sha256` note beside it (hash and size), so a later run trusts it without reading
  or asking the network again.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK = 1 << 20
MAX_RESUMES = 8            # cut transfers continued within one run before giving up
HEX64 = re.compile(r"^[0-9a-f]{64}$")


class DownloadError(RuntimeError):
    pass


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_url(repo: str, revision: str, filename: str, base: str | None = None) -> str:
    return f"{(base or endpoint()).rstrip('/')}/{repo}/resolve/{revision}/{filename}"


def _headers() -> dict:
    h = {"User-Agent": "strata-setup/0.1"}
    token = os.environ.get("HF_TOKEN")
    if token:
        h["Authorization"] = f"Bearer {token}"
    return h


def _reason(e: Exception) -> str:
    """The innermost cause of a requests error ("Connection refused"), not urllib3's nested repr."""
    m = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", str(e))
    return m.group(1).strip() if m else f"{type(e).__name__}: {str(e)[:160]}"


@dataclass
class Remote:
    size: int | None
    sha256: str | None         # the LFS object id, when the hub published one


def probe(url: str, session: requests.Session | None = None, timeout: float = 30) -> Remote:
    s = session or requests.Session()
    where = url
    for _ in range(5):
        try:
            r = s.head(where, headers=_headers(), allow_redirects=False, timeout=timeout)
        except requests.RequestException as e:
            raise DownloadError(f"cannot reach {url} ({_reason(e)}); check the network, or set HF_ENDPOINT "
                                f"to a mirror, or download by hand and use --gguf-dir") from None
        # A relative redirect stays on the hub (a renamed repository): follow it to the answer that carries the
        # X-Linked headers; an absolute one goes to the storage, and the headers are on this answer already.
        location = r.headers.get("Location", "")
        linked = r.headers.get("X-Linked-Etag") or r.headers.get("X-Linked-Size")   # case-insensitive look-ups
        if r.is_redirect and location.startswith("/") and not linked:
            where = requests.compat.urljoin(where, location)
            continue
        break
    if r.status_code in (401, 403):
        raise DownloadError(f"{url} refused access (HTTP {r.status_code}); set HF_TOKEN if the repository is gated")
    if r.status_code == 404:
        raise DownloadError(f"{url} does not exist (HTTP 404): the catalog may be out of date; "
                            f"use --gguf with a file you have")
    if r.status_code >= 400:
        raise DownloadError(f"{url} answered HTTP {r.status_code}")
    etag = (r.headers.get("X-Linked-Etag") or "").strip().strip('"').removeprefix("W/").strip('"').lower()
    size = r.headers.get("X-Linked-Size") or (r.headers.get("Content-Length") if r.status_code == 200 else None)
    return Remote(size=int(size) if size and size.isdigit() else None, sha256=etag if HEX64.match(etag) else None)


class Progress:
    """One line on stderr: percent, bytes, MB/s (of this run's bytes) and time left. Plain lines when not a tty."""

    def __init__(self, label: str, total: int | None, start: int = 0, stream=None):
        self.label, self.total, self.done = label, total, start
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()
        self.base = start
        self.last = 0.0

    def update(self, n: int, force: bool = False) -> None:
        self.done += n
        now = time.monotonic()
        if not force and now - self.last < (0.5 if self.tty else 10.0):
            return
        self.last = now
        rate = (self.done - self.base) / max(now - self.t0, 1e-6)
        if self.total:
            left = (self.total - self.done) / rate if rate > 0 else float("inf")
            eta = "?" if left == float("inf") else time.strftime("%H:%M:%S", time.gmtime(left))
            line = (f"  {self.label}  {100 * self.done / self.total:5.1f}%  {self.done / 1e9:.2f}/"
                    f"{self.total / 1e9:.2f} GB  {rate / 1e6:.1f} MB/s  {eta} left")
        else:
            line = f"  {self.label}  {self.done / 1e9:.2f} GB  {rate / 1e6:.1f} MB/s"
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        self.update(0, force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _hash_existing(part: Path, label: str) -> "hashlib._Hash":
    h = hashlib.sha256()
    size = part.stat().st_size
    if size:
        prog = Progress(f"{label} (checking the {size / 1e9:.2f} GB already here)", size)
        with open(part, "rb") as f:
            while block := f.read(CHUNK * 8):
                h.update(block)
                prog.update(len(block))
        prog.close()
    return h


def _transfer(url: str, part: Path, size: int | None, label: str, session: requests.Session,
              timeout: float) -> str:
    """Fill `part` up to `size` bytes (resuming), return the SHA-256 of the whole file."""
    h = _hash_existing(part, label) if part.exists() else hashlib.sha256()
    have = part.stat().st_size if part.exists() else 0
    prog = Progress(label, size, start=have)
    resumes = 0
    while True:
        if size is not None and have == size:
            break
        headers = _headers()
        if have:
            headers["Range"] = f"bytes={have}-"
        try:
            with session.get(url, headers=headers, stream=True, timeout=timeout) as r:
                if r.status_code == 416 and size is None:
                    break          # the part already holds the whole file
                if r.status_code == 416 or (have and r.status_code == 200):
                    # The server will not continue this part (it changed, or ignores Range): start it again.
                    h, have = hashlib.sha256(), 0
                    part.unlink(missing_ok=True)
                    prog = Progress(label, size, start=0)
                    if r.status_code == 416:
                        continue
                elif r.status_code == 206:
                    start = int(re.match(r"bytes (\d+)-", r.headers.get("Content-Range", "bytes 0-")).group(1))
                    if start != have:
                        raise DownloadError(f"{url}: asked for bytes from {have}, the server sent from {start}")
                elif r.status_code != 200:
                    raise DownloadError(f"{url} answered HTTP {r.status_code} while downloading")
                if size is None and r.status_code == 200 and r.headers.get("Content-Length", "").isdigit():
                    size = int(r.headers["Content-Length"])
                    prog.total = size
                with open(part, "ab") as f:
                    for block in r.iter_content(CHUNK):
                        f.write(block)
                        h.update(block)
                        have += len(block)
                        prog.update(len(block))
                        resumes = 0
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
            resumes += 1
            if resumes > MAX_RESUMES:
                prog.close()
                raise DownloadError(f"{label}: the transfer kept breaking ({type(e).__name__}); {have / 1e9:.2f} GB "
                                    f"are kept in {part} and the next run continues from there") from None
            time.sleep(min(2 ** resumes * 0.1, 10))
            continue
        if size is None or have >= size:
            break
        resumes += 1           # the body ended early without an error: continue from where it stopped
        if resumes > MAX_RESUMES:
            prog.close()
            raise DownloadError(f"{label}: the server keeps ending the transfer early; {have / 1e9:.2f} GB are kept "
                                f"in {part} and the next run continues from there")
    prog.close()
    if size is not None and have != size:
        raise DownloadError(f"{label}: got {have} bytes, expected {size}")
    return h.hexdigest()


def note_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".sha256")


def verified(dest: Path) -> bool:
    """True when dest was verified by an earlier run and has not changed size since."""
    note = note_path(dest)
    if not (dest.is_file() and note.is_file()):
        return False
    try:
        digest, size = note.read_text().split()[:2]
        return int(size) == dest.stat().st_size and bool(HEX64.match(digest))
    except (ValueError, OSError):
        return False


def write_note(dest: Path, digest: str, checked: bool) -> None:
    note_path(dest).write_text(f"{digest} {dest.stat().st_size} {'verified' if checked else 'unverified'}\n")


def fetch(url: str, dest: Path, size: int | None = None, sha256: str | None = None, label: str | None = None,
          session: requests.Session | None = None, timeout: float = 60, say=print) -> str:
    """Download url to dest (resuming dest.part), check its SHA-256; return it. Raises DownloadError."""
    dest = Path(dest)
    label = label or dest.name
    s = session or requests.Session()
    remote = probe(url, s)
    # The catalog's pinned hash wins: the hub's only stands in when the catalog pins none. A hub that publishes
    # another hash means the file changed upstream, and a changed file is not the one the catalog vouches for.
    want = sha256.lower() if sha256 else remote.sha256
    if remote.sha256 and sha256 and remote.sha256 != sha256.lower():
        raise DownloadError(f"{label}: the hub publishes SHA-256 {remote.sha256}, the catalog pins {sha256.lower()}: "
                            f"the file changed upstream and is not fetched. Check the new file and update the "
                            f"catalog, or download a copy you trust by hand and use --gguf-dir")
    expected = remote.size if remote.size is not None else size
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    if dest.is_file() and not part.exists():
        # A file already there without our note (put by hand, or an older run): check it rather than fetch it again;
        # as a part file it is hashed once, and only a wrong or short one costs a download.
        os.replace(dest, part)
    have = part.stat().st_size if part.exists() else 0
    if expected is not None:
        free = shutil.disk_usage(dest.parent).free
        if expected - have > free:
            raise DownloadError(f"{label} needs {(expected - have) / 1e9:.1f} GB more and {dest.parent} has "
                                f"{free / 1e9:.1f} GB free; free some space (or use --data-dir on a bigger disk) and "
                                f"run again: the {have / 1e9:.2f} GB already fetched are kept")
    for attempt in (1, 2):
        got = _transfer(url, part, expected, label, s, timeout)
        if want is None or got == want:
            os.replace(part, dest)
            write_note(dest, got, checked=want is not None)
            if want is None:
                say(f"[!] {label}: the hub published no SHA-256 and the catalog pins none; only the size was checked")
            return got
        part.unlink(missing_ok=True)
        if attempt == 1:
            say(f"[!] {label}: SHA-256 {got[:16]}... is not the published {want[:16]}...; "
                f"the file was deleted and is fetched once more")
    raise DownloadError(f"{label}: the download had the wrong SHA-256 twice (got {got}, expected {want}); "
                        f"stopped. The server ({endpoint()}) may hold a bad copy: try later, another HF_ENDPOINT, "
                        f"or download it by hand and use --gguf-dir")
