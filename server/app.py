"""Wiring: config -> text codec -> service -> HTTP server."""
from __future__ import annotations

from server.openai_api import StrataServer
from server.service import Service
from server.text import TextCodec


def build(cfg, codec: TextCodec | None = None) -> StrataServer:
    codec = codec or TextCodec.from_gguf(cfg.model)
    service = Service(cfg, codec)
    try:
        return StrataServer(cfg, service, codec)
    except Exception:
        service.close()
        raise
