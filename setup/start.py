"""Step 7's second half: start the server from its config, wait until it answers, open a browser where one exists."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import webbrowser
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent


class StartError(RuntimeError):
    pass


def url_of(cfg: dict) -> str:
    host = cfg["host"]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{cfg['port']}/"


def answering(url: str, timeout: float = 2.0) -> bool:
    """True when an HTTP server answers at url (any status: 401 from a keyed server is an answer too)."""
    try:
        requests.get(url + "v1/models", timeout=timeout)
        return True
    except requests.RequestException:
        return False


def pid_path(config_path: Path) -> Path:
    return config_path.with_suffix(".pid")


def running_pid(config_path: Path) -> int | None:
    """The pid of a server this wizard started for this config, if it is still alive."""
    try:
        pid = int(pid_path(config_path).read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def start(config_path: Path, cfg: dict, wait_s: float = 180) -> int:
    """Start `python -m server --config ...` detached (it outlives the wizard); return its pid once it answers.
    The server loads the model as it starts (unless the config says "load_at_start": false): wait_ready follows."""
    # The server's own lines go beside the worker's log (cfg["log"], which the server appends the worker's stderr to).
    log = Path(cfg["log"]).with_suffix(".server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "server", "--config", str(config_path)], cwd=ROOT,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    pid_path(config_path).write_text(f"{proc.pid}\n")
    url = url_of(cfg)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StartError(f"the server exited with status {proc.returncode} before answering; the end of "
                             f"{log}:\n" + tail(log))
        if answering(url):
            return proc.pid
        time.sleep(0.5)
    raise StartError(f"the server (pid {proc.pid}) did not answer at {url} within {wait_s:.0f} s; it is left "
                     f"running; see {log}")


def wait_ready(url: str, wait_s: float = 600, on_phase=None) -> tuple[str, str | None]:
    """Follow GET /health while the model loads: ("ready", None), ("failed", the server's error) or ("loading",
    None) when wait_s passes first. on_phase(text) is called with each new phase ("loading: pinning experts ...")."""
    deadline = time.monotonic() + wait_s
    seen = None
    while time.monotonic() < deadline:
        try:
            body = requests.get(url + "health", timeout=5).json()
        except (requests.RequestException, ValueError):
            body = {}
        status, phase = body.get("status"), body.get("phase")
        # One line a step ("loading: pinning experts in RAM"), not one for each percent of it.
        step = ":".join(phase.split(":")[:2]) if isinstance(phase, str) else None
        if step and step != seen and on_phase is not None:
            on_phase(phase)
        seen = step or seen
        if status == "ok":
            return "ready", None
        if status == "error":
            return "failed", body.get("error") or "the server reports an error without a message"
        time.sleep(0.5)
    return "loading", None


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def can_open_browser() -> tuple[bool, str]:
    if os.environ.get("CI"):
        return False, "running in CI"
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        return False, "no display (DISPLAY is not set)"
    if sys.platform.startswith("linux") and not (shutil.which("xdg-open") or shutil.which("x-www-browser")):
        return False, "no browser found"
    return True, ""


def open_browser(url: str) -> bool:
    try:
        return webbrowser.open(url)
    except webbrowser.Error:
        return False
