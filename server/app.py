"""Wiring: config -> text codec -> service -> HTTP server, then the model's load (unless the config says lazy)."""
from __future__ import annotations

from server.openai_api import StrataServer
from server.service import Service
from server.text import TextCodec


def build(cfg, codec: TextCodec | None = None) -> StrataServer:
    codec = codec or TextCodec.from_gguf(cfg.model)
    service = Service(cfg, codec)
    try:
        httpd = StrataServer(cfg, service, codec)
    except Exception:
        service.close()
        raise
    if cfg.load_at_start:   # after the port is bound: a port in use fails the start before a model loads
        service.preload()
    return httpd
