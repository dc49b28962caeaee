"""Helpers for the server tests: a server on a free port over a fake worker, SSE reading, a stand-in tokenizer."""
from __future__ import annotations

import contextlib
import json
import sys
import threading
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
FAKE_WORKER = ROOT / "tests" / "fake_worker.py"


class ByteTokenizer:
    """Stand-in vocabulary: ids 0..255 are bytes, then ChatML specials. Tests only."""
    SPECIALS = {"<|im_start|>": 256, "<|im_end|>": 257, "<|endoftext|>": 258}
    n_vocab = 1024
    bos_id = None
    eos_id = 257
    eog_ids = {257, 258}
    chat_template = None

    def encode(self, text, add_special=True, parse_special=False):
        ids, i = [], 0
        while i < len(text):
            for s, sid in self.SPECIALS.items():
                if parse_special and text.startswith(s, i):
                    ids.append(sid)
                    i += len(s)
                    break
            else:
                ids.extend(text[i].encode())
                i += 1
        return ids

    def token_text(self, i):
        return {v: k for k, v in self.SPECIALS.items()}.get(i, bytes([i]).decode("latin-1") if i < 256 else "")

    def decode(self, ids):
        out, raw = [], bytearray()
        for i in ids:
            if i < 256:
                raw.append(i)
            else:
                out.append(raw.decode("utf-8", "replace"))
                raw = bytearray()
                out.append(self.token_text(i))
        out.append(raw.decode("utf-8", "replace"))
        return "".join(out)


class ByteDecoder:
    def __init__(self, tok):
        self.tok, self.buf = tok, bytearray()

    def feed(self, i):
        if i >= 256:
            out = self.flush()
            return out + self.tok.token_text(i)
        self.buf.append(i)
        try:
            out = self.buf.decode("utf-8")
        except UnicodeDecodeError:
            return ""
        self.buf = bytearray()
        return out

    def flush(self):
        out = self.buf.decode("utf-8", "replace")
        self.buf = bytearray()
        return out


def stand_in_codec(template_thinks: bool = False):
    from server.text import PromptError, TextCodec

    class StandInCodec(TextCodec):
        def __init__(self):
            super().__init__(ByteTokenizer(), "<think>" if template_thinks else None)

        def chat_prompt(self, messages, tools=None, template_kwargs=None):
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            text += "<|im_start|>assistant\n"
            if template_thinks:
                text += "<think>\n"
            return self.tok.encode(text, parse_special=True), text

        def decoder(self):
            return ByteDecoder(self.tok)

        def splitter(self):
            return ThinkSplitter() if template_thinks else None

    return StandInCodec()


class ThinkSplitter:
    """Stand-in for engine.reasoning.ReasoningSplitter with <think> markers (tests only)."""

    def __init__(self):
        self.state, self.buf = "content", ""

    def feed(self, text):
        self.buf += text
        r, c = "", ""
        while self.buf:
            marker = "<think>" if self.state == "content" else "</think>"
            i = self.buf.find(marker)
            if i < 0:
                keep = next((n for n in range(min(len(marker) - 1, len(self.buf)), 0, -1)
                             if self.buf.endswith(marker[:n])), 0)
                emit, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            else:
                emit, self.buf = self.buf[:i], self.buf[i + len(marker):]
            if self.state == "content":
                c += emit
            else:
                r += emit
            if i < 0:
                break
            self.state = "reasoning" if self.state == "content" else "content"
        return r, c

    def flush(self):
        out, self.buf = self.buf, ""
        return ("", out) if self.state == "content" else (out, "")


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
