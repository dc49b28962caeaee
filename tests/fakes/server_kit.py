"""Helpers for the server tests: a server on a free port over a fake worker, SSE reading, the tiny vocabulary."""
from __future__ import annotations

import contextlib
import json
import sys
import threading
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
FAKE_WORKER = ROOT / "tests" / "fake_worker.py"


def tiny_codec(fixtures_dir, template_file: str | None = None):
    """The tiny 1,024-token vocabulary (its ChatML template, or a real model's template from the fixtures)."""
    from engine.tokenizer import Tokenizer
    from server.text import TextCodec
    tok = Tokenizer.from_gguf(fixtures_dir / "vocab" / "tiny-bpe-1024.gguf")
    template = (fixtures_dir / "templates" / template_file).read_text() if template_file else tok.chat_template
    return TextCodec(tok, template)


def make_config(tmp_path, model, flags=(), **over):
    from server.config import validate
    raw = dict(model=str(model), model_name="fake", worker=[sys.executable, str(FAKE_WORKER), *flags],
               log=str(tmp_path / "worker.log"), port=0, engine_silence_s=2.0)
    raw.update(over)
    return validate(raw, tmp_path)


@contextlib.contextmanager
def running_server(cfg, codec):
    from server.app import build
    httpd = build(cfg, codec)
    t = threading.Thread(target=httpd.serve_forever, kwargs=dict(poll_interval=0.1), daemon=True)
    t.start()
    try:
        yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        httpd.service.close(timeout_s=20)
        w = httpd.service.worker
        assert w is None or not w.alive, "the worker outlived the server"


def sse_events(resp):
    """Parsed `data:` payloads of a server-sent-events response, up to [DONE]."""
    for raw in resp.iter_lines():
        if not raw or not raw.startswith(b"data: "):
            continue
        data = raw[6:]
        if data == b"[DONE]":
            return
        yield json.loads(data)


def metrics(base):
    return requests.get(base + "/metrics", timeout=10).json()
