"""HTTP: the OpenAI-compatible API (+ Anthropic's /v1/messages), /health, /metrics, /load, /unload, the web app.

Stdlib http.server, one thread per connection. Handlers tokenize, submit a job to the service and turn its events
into JSON or server-sent events. Safety first: Host/Origin checks against DNS rebinding, the API key, CORS only for
the configured origins, a body size limit, and every JSON field checked for its type.
"""
from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import json
import logging
import mimetypes
import queue
import select
import socket
import sys
import time
import uuid
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from server import metrics
from server.schema import (ApiError, chat_messages, field, max_new_tokens, sampling_params, stop_list,
                           text_content)
from server.effort import effort_kwargs
from server.service import Job, Result, Service, ServiceError
from server import logprobs
from server.grammar import GrammarRequestError, response_format_grammar, tool_call_grammar
from server.text import PromptError
from engine.grammar import encode as encode_grammar
from engine.protocol import MAX_TOP_LOGPROBS

log = logging.getLogger("strata.http")
STATIC_DIR = Path(__file__).resolve().parent / "static"
MAX_BODY = 32 * 1024 * 1024
POLL_S = 0.2
KEEPALIVE_S = 10.0   # an SSE comment this often while nothing else is sent (a long prompt): proxies stay open
MAX_N = 16           # choices per request (n): each is a full generation, one after another
OPEN_PATHS = {"/health"}     # no API key needed (the web app's files are public too: they hold no data)


class ClientGone(Exception):
    pass


# --- the server ----------------------------------------------------------------------------------------------------
class StrataServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # listen()'s backlog: Python's default of 5 reset 17 of 128 connections in bursts of 32 (the accept loop is one
    # thread); the kernel caps it at net.core.somaxconn.
    request_queue_size = 1024

    def __init__(self, cfg, service: Service, codec):
        self.cfg, self.service, self.codec = cfg, service, codec
        super().__init__((cfg.host, cfg.port), Handler)
        self.started = time.time()
        names = {"localhost"}
        try:
            names |= {socket.gethostname().lower(), socket.gethostname().lower() + ".local"}
        except OSError:
            pass
        if cfg.host not in ("0.0.0.0", "::", ""):
            names.add(cfg.host.lower())
        for origin in cfg.cors_origins:
            names.add((urlsplit(origin).hostname or "").lower())
        self.host_names = names

    def handle_error(self, request, client_address):
        # A client that leaves mid-answer is ordinary: no traceback on stderr for it.
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, socket.timeout)):
            return
        super().handle_error(request, client_address)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "strata"
    timeout = 120        # a client that stops reading cannot hold a thread (or a socket write) forever
    server: StrataServer

    def log_message(self, fmt, *args):  # quiet: the Monitor and /metrics are the record
        pass

    def handle_one_request(self):
        """http.server's request loop, after a look at the connection's first byte: a TLS ClientHello (a client set
        up for https) has no line end to wait for, so it would hold the connection until the timeout."""
        try:
            first = self.rfile.peek(1)[:1]
        except (OSError, ValueError):
            self.close_connection = True
            return
        if first and (first[0] == 0x16 or first[0] >= 0x80):    # a TLS handshake record, or any binary protocol
            self.command, self.requestline, self.request_version = "", "", "HTTP/1.1"
            self.send_error(400, "this port speaks plain HTTP, not TLS: use http:// in the client's base URL")
        else:
            super().handle_one_request()
        if getattr(self, "_refused", False):
            self._lingering_close()

    def parse_request(self) -> bool:
        # A request line without a version (HTTP/0.9): http.server would read headers that never come, then
        # answer with no status line.
        if len(self.raw_requestline.split()) == 2:
            self.command, self.requestline, self.request_version = None, "", "HTTP/1.1"
            self.send_error(400, "send an HTTP/1.1 request line: METHOD /path HTTP/1.1")
            return False
        return super().parse_request()

    def _lingering_close(self) -> None:
        """After a refusal, send our end (FIN) and read what the client still sends for a moment before the close:
        closing a socket with unread bytes resets it, and a reset can destroy the answer before the client reads."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.5)
            end = time.monotonic() + 1.0
            while time.monotonic() < end and self.connection.recv(65536):
                pass
        except OSError:
            pass

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (a request line or headers too long, bad syntax, HTTP/2) as JSON, like ours,
        always behind an HTTP/1.1 status line."""
        self.close_connection = True
        self._refused = True
        if self.request_version == "HTTP/0.9":
            # parse_request refuses a request line before it records its version; http.server would then answer
            # as HTTP/0.9 does: the body alone, with no status line.
            self.request_version = "HTTP/1.1"
        try:
            text = {414: "the request line is too long (at most 65,536 bytes)",
                    431: "the request headers are too long or too many (at most 100 headers of 65,536 bytes)",
                    501: f"the method {self.command!r} is not supported: use GET, HEAD or POST",
                    505: "this server speaks HTTP/1.1 (an HTTP/2 request arrived): use HTTP/1.1 (curl: --http1.1)",
                    }.get(code, message)
            body = json.dumps({"error": {"message": text or f"HTTP {code}", "type": "invalid_request_error",
                                         "param": None, "code": code}}).encode()
            self.send_response(code, message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD" and code >= 200 and code not in (204, 304):
                self.wfile.write(body)
        except OSError:
            pass

    # --- plumbing -------------------------------------------------------------------------------------------------
    def _cors_headers(self) -> None:
        origin = self.headers.get("Origin")
        if origin and origin in self.server.cfg.cors_origins:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")

    def send_json(self, status: int, obj, headers: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self._cors_headers()
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.write_body(data)

    def write_body(self, data: bytes) -> None:
        """The body, except for HEAD: the same status and headers as GET, no body."""
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_error_json(self, e: ApiError) -> None:
        if self.command == "POST" and not getattr(self, "_body_read", False):
            self.close_connection = True     # the unread body would be taken for the next request
        if self.path.startswith("/v1/messages"):
            kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 413: "request_too_large", 503: "overloaded_error"}
            body = {"type": "error", "error": {"type": kinds.get(e.status, "api_error"), "message": e.message}}
        else:
            body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code or e.status}}
        self.send_json(e.status, body)

    def client_gone(self) -> bool:
        """True when the client has closed its side (a readable socket with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def read_json(self) -> dict:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise ApiError(411, "send the body with a Content-Length (chunked uploads are not accepted)")
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self.close_connection = True
            raise ApiError(400, "Content-Length is not a number") from None
        if n > MAX_BODY:
            self.close_connection = True
            raise ApiError(413, f"the request body is {n} bytes; the limit is {MAX_BODY}", code="body_too_large")
        raw = self.rfile.read(n) if n > 0 else b""
        self._body_read = True
        try:
            body = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "the JSON body is nested too deeply: flatten it") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    # --- safety ---------------------------------------------------------------------------------------------------
    def check_host_origin(self) -> None:
        host = self.headers.get("Host")
        if not host:
            raise ApiError(400, "the request has no Host header")
        try:
            name = urlsplit("//" + host).hostname or ""
        except ValueError:
            raise ApiError(400, f"the Host header {host!r} is malformed") from None
        if not self._name_allowed(name):
            raise ApiError(403, f"Host {host!r} is not this server's: open it as http://127.0.0.1:{self.server.server_port}"
                           " or http://localhost (requests through foreign host names are refused: DNS rebinding)",
                           kind="permission_error")
        origin = self.headers.get("Origin")
        if origin is None or origin in self.server.cfg.cors_origins:
            return
        parts = urlsplit(origin)
        if parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower():
            return          # our own web app
        raise ApiError(403, f"Origin {origin!r} is not allowed: add it to cors_origins in the config to let that "
                       "site call this server", kind="permission_error")

    def _name_allowed(self, name: str) -> bool:
        name = name.lower().rstrip(".")
        try:
            ipaddress.ip_address(name)
            return True       # an address cannot be re-pointed by DNS
        except ValueError:
            pass
        return name in self.server.host_names or name.endswith(".localhost")

    def check_key(self, path: str) -> None:
        key = self.server.cfg.api_key
        if not key or path in OPEN_PATHS or self.is_static(path):
            return
        given = self.headers.get("x-api-key") or ""
        auth = self.headers.get("Authorization") or ""
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
                           " (the key is api_key in the server's config)", kind="authentication_error",
                           code="invalid_api_key")

    # --- routing --------------------------------------------------------------------------------------------------
    def do_OPTIONS(self):
        origin = self.headers.get("Origin")
        try:
            self.check_host_origin()
        except ApiError as e:
            return self.send_error_json(e)
        if not origin or origin not in self.server.cfg.cors_origins:
            return self.send_error_json(ApiError(403, "CORS is not enabled for this origin (see cors_origins)",
                                                 kind="permission_error"))
        self.send_response(204)
        self._cors_headers()
        self.send_header("Access-Control-Allow-Methods", "GET, HEAD, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type, x-api-key, anthropic-version")
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def _method_not_allowed(self):
        self._body_read = False
        self.close_connection = True         # any body is left unread
        self.send_json(405, {"error": {"message": f"the method {self.command} is not allowed here: the API takes GET, "
                                                  "HEAD and POST", "type": "invalid_request_error", "param": None,
                                       "code": 405}}, headers={"Allow": "GET, HEAD, POST, OPTIONS"})

    do_PUT = do_DELETE = do_PATCH = do_TRACE = do_CONNECT = _method_not_allowed

    def send_response(self, code, message=None):
        self._responded = True
        super().send_response(code, message)

    def _dispatch(self, method: str) -> None:
        self._body_read = False
        self._responded = False
        url = urlsplit(self.path)
        path = url.path.rstrip("/") or "/"
        try:
            self.check_host_origin()
            self.check_key(path)
            self._path = path
            reads = method in ("GET", "HEAD")       # HEAD: GET's answer without its body (write_body)
            route = ROUTES.get(("GET" if reads else method, path))
            if route is None and reads and path.startswith("/v1/models/"):
                route = Handler.get_model
            if route is None:
                if reads and self.is_static(path):
                    return self.send_static(path)
                if method == "POST":
                    self.read_json()   # drain the body so the connection stays in step
                raise ApiError(404, f"no such endpoint: {method} {path}", code="not_found")
            route(self, parse_qs(url.query))
        except ApiError as e:
            self.send_error_json(e)
        except ServiceError as e:
            self.send_error_json(ApiError(e.status, e.message, e.kind))
        except RecursionError:
            self.send_error_json(ApiError(400, "the JSON body is nested too deeply: flatten it"))
        except ClientGone:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        except Exception as e:     # a bug: the traceback to the server's log, a JSON 500 to the client
            log.exception("internal error answering %s %s", method, path)
            self.close_connection = True
            if not self._responded:
                try:
                    self.send_error_json(ApiError(500, f"internal error in the server ({type(e).__name__}); the "
                                                       "server's log has the details", kind="server_error"))
                except OSError:
                    pass

    # --- the web app ----------------------------------------------------------------------------------------------
    @staticmethod
    def static_name(path: str) -> str:
        # The page declares favicon.svg; /favicon.ico is what browsers ask for on pages that declare none (a JSON
        # endpoint opened in a tab).
        return {"/": "index.html", "/favicon.ico": "favicon.svg"}.get(path, path.lstrip("/"))

    @classmethod
    def is_static(cls, path: str) -> bool:
        name = cls.static_name(path)
        return "/" not in name and (STATIC_DIR / name).is_file()

    def send_static(self, path: str) -> None:
        name = self.static_name(path)
        data = (STATIC_DIR / name).read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", (mimetypes.guess_type(name)[0] or "application/octet-stream") + "; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.write_body(data)

    # --- simple endpoints -----------------------------------------------------------------------------------------
    def get_health(self, q):
        status, body = self.server.service.health()
        self.send_json(status, body, headers={"Retry-After": "1"} if body["status"] == "loading" else None)

    def get_models(self, q):
        self.send_json(200, {"object": "list", "data": [self._model_entry()]})

    def _model_entry(self) -> dict:
        cfg = self.server.cfg
        w = self.server.service.worker
        return {"id": cfg.model_name, "object": "model", "created": int(self.server.started), "owned_by": "strata",
                "meta": {"path": cfg.model, "n_ctx": w.max_context if w else None}}

    def get_metrics(self, q):
        snap = self.server.service.snapshot()
        if q.get("format", [""])[0] == "prometheus":
            data = metrics.prometheus(snap).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self._cors_headers()
            self.end_headers()
            self.write_body(data)
        else:
            self.send_json(200, snap)

    def post_load(self, q):
        self.read_json()
        job = self.server.service.submit(Job("load", endpoint="/load"))
        for ev in self.events(job):
            if ev[0] == "error":
                raise ApiError(ev[1], ev[2], kind="server_error")
        self.send_json(200, {"status": "loaded", "phase": self.server.service.phase})

    def post_unload(self, q):
        self.read_json()
        job = self.server.service.submit(Job("unload", endpoint="/unload"))
        for _ in self.events(job):
            pass
        self.send_json(200, {"status": "unloaded"})

    # --- generation -----------------------------------------------------------------------------------------------
    def events(self, job: Job, keepalive_s: float | None = None):
        """The job's events, up to done/error; watches the client meanwhile and cancels the job if it leaves.
        With keepalive_s, ("tick",) comes after that long without an event."""
        last_check = last_event = time.monotonic()
        while True:
            try:
                ev = job.events.get(timeout=POLL_S)
            except queue.Empty:
                ev = None
            now = time.monotonic()
            if now - last_check >= POLL_S:   # also while events flow: a non-stream client may leave
                last_check = now
                if self.client_gone():
                    job.cancel.set()
                    raise ClientGone()
            if ev is None:
                if keepalive_s is not None and now - last_event >= keepalive_s:
                    last_event = now
                    yield ("tick",)
                continue
            last_event = now
            yield ev
            if ev[0] in ("done", "error"):
                return

    def _common(self, body: dict, api: str = "messages") -> dict:
        """What every generation endpoint reads; api: chat | completions | messages (their logprobs differ)."""
        field(body, "model", "str")
        n = field(body, "n", "int", default=1, lo=1, hi=MAX_N)
        stream = field(body, "stream", "bool", default=False)
        if api == "messages" and n != 1:
            raise ApiError(400, "'n' is not part of the Messages API: send one request per answer", param="n")
        logprobs = None
        if api == "chat" and field(body, "logprobs", "bool", default=False):
            logprobs = field(body, "top_logprobs", "int", default=0, lo=0, hi=MAX_TOP_LOGPROBS)
        elif api == "chat" and field(body, "top_logprobs", "int") is not None:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        elif api == "completions":
            logprobs = field(body, "logprobs", "int", lo=0, hi=5)
        grammar = None
        if api != "messages":
            try:
                grammar = response_format_grammar(field(body, "response_format", "dict"))
            except GrammarRequestError as e:
                raise ApiError(400, str(e), param="response_format") from None
        budget = field(body, "reasoning_budget_tokens", "int", lo=-1)
        if budget is None:
            budget = self.server.cfg.reasoning_budget_tokens
        return dict(params=sampling_params(body, self.server.cfg.sampling), stream=stream, n=n, logprobs=logprobs,
                    grammar=grammar, budget=None if budget is None or budget < 0 else budget)

    def _submit(self, endpoint: str, prompt: list[int], max_new, common: dict, stops: list[str],
                prompt_text: str | None, choice: int = 0) -> Job:
        if not prompt:
            raise ApiError(400, "the prompt is empty: send some text")
        params = dict(common["params"])
        if choice and params.get("seed") is not None:
            params["seed"] += choice        # n > 1 with a seed: reproducible, yet not n copies of one answer
        grammar = common["grammar"]
        return self.server.service.submit(Job(
            "gen", endpoint=endpoint, prompt=prompt, max_new=max_new, params=params, stops=stops,
            reasoning_budget=common["budget"], prompt_text=prompt_text, logprobs=common["logprobs"],
            grammar=encode_grammar(grammar) if grammar else None))

    def _force_tool_call(self, common: dict, tools, choice) -> None:
        """tool_choice "required" or a named function: a grammar holds the answer to one call (server/grammar.py),
        for templates whose calls take the tags form (the generic prompt's too); others get the choice in words."""
        try:
            forced = tool_call_grammar(tools, choice) if self.server.codec.tool_format.name == "tags" else None
        except GrammarRequestError as e:
            raise ApiError(400, str(e), param="tool_choice") from None
        if forced is not None:
            if common["grammar"] is not None:
                raise ApiError(400, "'response_format' and a forced 'tool_choice' cannot both shape one answer",
                               param="tool_choice")
            common["grammar"] = forced

    def _choices(self, endpoint, prompt, max_new, common, stops, prompt_text):
        """n answers, one after another: [(reasoning, content, Result, logprob events)]. Jobs are submitted one at
        a time, so a client that leaves stops the rest."""
        out = []
        for i in range(common["n"]):
            job = self._submit(endpoint, prompt, max_new, common, stops, prompt_text, choice=i)
            lps: list = []
            out.append(self.collect(job, lps) + (lps,))
        return out

    def post_chat(self, q):
        body = self.read_json()
        common = self._common(body, "chat")
        msgs = chat_messages(body)
        stops = stop_list(body)
        max_new = max_new_tokens(body, "max_completion_tokens", "max_tokens")
        tools = field(body, "tools", "list")
        kwargs = {**effort_kwargs(body), **field(body, "chat_template_kwargs", "dict", default={})}
        so = field(body, "stream_options", "dict", default={})
        include_usage = bool(so.get("include_usage"))
        choice = body.get("tool_choice")
        parser = self.server.codec.tool_parser(tools, tool_choice(body))
        self._force_tool_call(common, tools, choice)
        with prompt_errors_are_400("messages"):
            prompt, text = self.server.codec.chat_prompt(msgs, tools=tools, template_kwargs=kwargs,
                                                         tool_choice=choice)
        rid, created, model = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time()), self.server.cfg.model_name
        tok = self.server.codec.tok
        if not common["stream"]:
            choices, total = [], None
            for i, (reasoning, content, res, lps) in enumerate(
                    self._choices("/v1/chat/completions", prompt, max_new, common, stops, text)):
                if parser is not None:
                    parser = self.server.codec.tool_parser(tools, tool_choice(body))    # a fresh one per choice
                content, calls = split_calls(parser, content)
                msg = {"role": "assistant", "content": content}
                if reasoning:
                    msg["reasoning_content"] = reasoning
                if calls:
                    msg["tool_calls"] = [openai_call(k) for k in calls]
                    msg["content"] = content or None
                choices.append({"index": i, "message": msg, "finish_reason": finish_reason(res, calls),
                                "logprobs": {"content": logprobs.chat_content(tok, lps)}
                                if common["logprobs"] is not None else None})
                total = res if total is None else add_usage(total, res)
            return self.send_json(200, {
                "id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage(total), "timings": timings(total)})
        results: list = []

        def streamed(i):
            """Choice i's job and its chunk builders (n > 1: the choices stream one after another)."""
            job = self._submit("/v1/chat/completions", prompt, max_new, common, stops, text, choice=i)
            lp_pending: list = []
            p = self.server.codec.tool_parser(tools, tool_choice(body)) if i else parser

            def chunk(delta, finish=None, **extra):
                lp = None
                if common["logprobs"] is not None:
                    lp = {"content": logprobs.chat_content(tok, lp_pending)}
                    lp_pending.clear()
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}], **extra}

            def on_delta(r, c):
                c, calls = feed_calls(p, c)
                d = {}
                if r:
                    d["reasoning_content"] = r
                if c:
                    d["content"] = c
                out = [chunk(d)] if d or p is None else []
                return out + call_chunks(calls)

            def call_chunks(calls):
                first = len(p.calls) - len(calls) if calls else 0
                return [chunk({"tool_calls": [dict(index=first + j, **openai_call(k))]}) for j, k in enumerate(calls)]

            def on_done(res):
                results.append(res)
                c, calls = flush_calls(p)
                out = ([chunk({"content": c})] if c else []) + call_chunks(calls)
                out.append(chunk({}, finish_reason(res, p.calls if p else ()), timings=timings(res)))
                if include_usage and len(results) == common["n"]:
                    total = results[0]
                    for more in results[1:]:
                        total = add_usage(total, more)
                    out.append({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "choices": [], "usage": usage(total)})
                return out

            return SseChoice(job, [chunk({"role": "assistant", "content": ""})], on_delta, on_done, lp_pending)

        self.stream_sse(streamed(0), more=[lambda i=i: streamed(i) for i in range(1, common["n"])])

    def post_completions(self, q):
        body = self.read_json()
        common = self._common(body, "completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        ok = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and
                                        all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
        if not ok:
            raise ApiError(400, "'prompt' must be a string or an array of token ids (one prompt per request)",
                           param="prompt")
        if field(body, "echo", "bool"):
            raise ApiError(400, "'echo' is not supported", param="echo")
        stops = stop_list(body)
        max_new = max_new_tokens(body, "max_tokens")
        with prompt_errors_are_400("prompt"):
            ids = self.server.codec.completion_prompt(prompt)
        rid, created, model = "cmpl-" + uuid.uuid4().hex[:24], int(time.time()), self.server.cfg.model_name
        tok = self.server.codec.tok
        if not common["stream"]:
            choices, total = [], None
            for i, (reasoning, content, res, lps) in enumerate(
                    self._choices("/v1/completions", ids, max_new, common, stops, None)):
                choices.append({"index": i, "text": reasoning + content, "finish_reason": finish_reason(res),
                                "logprobs": logprobs.completion_logprobs(tok, lps)
                                if common["logprobs"] is not None else None})
                total = res if total is None else add_usage(total, res)
            return self.send_json(200, {
                "id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage(total), "timings": timings(total)})
        def streamed(i):
            job = self._submit("/v1/completions", ids, max_new, common, stops, None, choice=i)
            lp_pending: list = []
            sent = [0]

            def chunk(text, finish=None, **extra):
                lp = None
                if common["logprobs"] is not None:
                    lp = logprobs.completion_logprobs(tok, lp_pending, sent[0])
                    lp_pending.clear()
                sent[0] += len(text)
                return {"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": i, "text": text, "finish_reason": finish, "logprobs": lp}], **extra}

            return SseChoice(job, [], lambda r, c: [chunk(r + c)],
                             lambda res: [chunk("", finish_reason(res), usage=usage(res), timings=timings(res))],
                             lp_pending)

        self.stream_sse(streamed(0), more=[lambda i=i: streamed(i) for i in range(1, common["n"])])

    def post_messages(self, q):
        body = self.read_json()
        common = self._common(body)
        max_new = field(body, "max_tokens", "int", lo=1)
        if max_new is None:
            raise ApiError(400, "'max_tokens' is required (a positive integer)", param="max_tokens")
        tools = anthropic_tools(field(body, "tools", "list"))
        msgs = self._anthropic_messages(body)
        parser = self.server.codec.tool_parser(tools, tool_choice(body))
        self._force_tool_call(common, tools, anthropic_choice(body))
        thinking = field(body, "thinking", "dict")
        if thinking and thinking.get("type") == "enabled":
            budget = thinking.get("budget_tokens")
            if budget is not None:
                if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                    raise ApiError(400, "'thinking.budget_tokens' must be an integer >= 0", param="thinking")
                common["budget"] = budget
        stops = stop_list(body, "stop_sequences")
        with prompt_errors_are_400("messages"):
            prompt, text = self.server.codec.chat_prompt(msgs, tools=tools, tool_choice=anthropic_choice(body),
                                                         template_kwargs=effort_kwargs(body, anthropic=True))
        job = self._submit("/v1/messages", prompt, max_new, common, stops, text)
        rid, model = "msg_" + uuid.uuid4().hex[:24], self.server.cfg.model_name

        def stop_reason(res: Result, calls=()):
            if calls:
                return "tool_use"
            return "max_tokens" if res.finish == "length" else ("stop_sequence" if res.stop_string else "end_turn")

        if not common["stream"]:
            reasoning, content, res = self.collect(job)
            content, calls = split_calls(parser, content)
            blocks = ([{"type": "thinking", "thinking": reasoning}] if reasoning else []) + \
                     ([{"type": "text", "text": content}] if content or not calls else []) + \
                     [anthropic_call(k) for k in calls]
            return self.send_json(200, {
                "id": rid, "type": "message", "role": "assistant", "model": model, "content": blocks,
                "stop_reason": stop_reason(res, calls), "stop_sequence": res.stop_string,
                "usage": {"input_tokens": res.prompt_tokens, "output_tokens": res.generated,
                          "cache_read_input_tokens": res.cached_tokens}})

        state = {"index": -1, "type": None}

        def block(kind):
            out = []
            if state["type"] != kind:
                if state["type"] is not None:
                    out.append(("content_block_stop", {"type": "content_block_stop", "index": state["index"]}))
                state["index"] += 1
                state["type"] = kind
                cb = {"type": "thinking", "thinking": ""} if kind == "thinking" else {"type": "text", "text": ""}
                out.append(("content_block_start", {"type": "content_block_start", "index": state["index"],
                                                    "content_block": cb}))
            return out

        def call_blocks(calls):
            out = []
            for k in calls:       # each call is a block of its own: the input whole, in one delta
                if state["type"] is not None:
                    out.append(("content_block_stop", {"type": "content_block_stop", "index": state["index"]}))
                state["index"] += 1
                state["type"] = None
                out.append(("content_block_start", {"type": "content_block_start", "index": state["index"],
                                                    "content_block": dict(anthropic_call(k), input={})}))
                out.append(("content_block_delta", {"type": "content_block_delta", "index": state["index"],
                                                    "delta": {"type": "input_json_delta", "partial_json": k.arguments}}))
                out.append(("content_block_stop", {"type": "content_block_stop", "index": state["index"]}))
            return out

        def on_delta(r, c):
            c, calls = feed_calls(parser, c)
            return text_events(r, c) + call_blocks(calls)

        def text_events(r, c):
            out = []
            if r:
                out += block("thinking")
                out.append(("content_block_delta", {"type": "content_block_delta", "index": state["index"],
                                                    "delta": {"type": "thinking_delta", "thinking": r}}))
            if c:
                out += block("text")
                out.append(("content_block_delta", {"type": "content_block_delta", "index": state["index"],
                                                    "delta": {"type": "text_delta", "text": c}}))
            return out

        def on_done(res):
            c, last = flush_calls(parser)
            out = text_events("", c) + call_blocks(last)
            calls = parser.calls if parser is not None else []
            if state["type"] is not None or not calls:
                out += block("text") if state["type"] is None else []
                out.append(("content_block_stop", {"type": "content_block_stop", "index": state["index"]}))
            out.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason(res, calls),
                                                                             "stop_sequence": res.stop_string},
                                          "usage": {"output_tokens": res.generated}}))
            out.append(("message_stop", {"type": "message_stop"}))
            return out

        start = ("message_start", {"type": "message_start", "message": {
            "id": rid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": len(prompt), "output_tokens": 0}}})
        self.stream_sse(SseChoice(job, [start], on_delta, on_done), named=True)

    def _anthropic_messages(self, body: dict) -> list[dict]:
        msgs = []
        system = body.get("system")
        if system is not None:
            msgs.append({"role": "system", "content": text_content(system, "system")})
        raw = field(body, "messages", "list")
        if not raw:
            raise ApiError(400, "'messages' must be a non-empty array", param="messages")
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
                raise ApiError(400, f"messages[{i}] must be an object with role 'user' or 'assistant'", param="messages")
            msgs += anthropic_message(m, f"messages[{i}]")
        return msgs

    def post_count_tokens(self, q):
        """Anthropic's /v1/messages/count_tokens: the prompt's length as this model's template and vocabulary make
        it (the tools included), without running the model."""
        body = self.read_json()
        field(body, "model", "str")
        tools = anthropic_tools(field(body, "tools", "list"))
        msgs = self._anthropic_messages(body)
        with prompt_errors_are_400("messages"):
            prompt, _ = self.server.codec.chat_prompt(msgs, tools=tools, tool_choice=anthropic_choice(body))
        self.send_json(200, {"input_tokens": len(prompt)})

    def get_model(self, q):
        """GET /v1/models/{id}: this server's one model, or a 404 naming it."""
        cfg = self.server.cfg
        wanted = unquote(self._path[len("/v1/models/"):])
        if wanted != cfg.model_name:
            raise ApiError(404, f"no model {wanted!r}: this server serves {cfg.model_name!r}", code="model_not_found")
        self.send_json(200, self._model_entry())

    def collect(self, job: Job, logprob_sink: list | None = None) -> tuple[str, str, Result]:
        reasoning, content = [], []
        for ev in self.events(job):
            if ev[0] == "logprobs" and logprob_sink is not None:
                logprob_sink.append(ev)
            elif ev[0] == "delta":
                reasoning.append(ev[1])
                content.append(ev[2])
            elif ev[0] == "error":
                raise ApiError(ev[1], ev[2], kind="invalid_request_error" if ev[1] == 400 else "server_error")
            elif ev[0] == "done":
                return "".join(reasoning), "".join(content), ev[1]
        raise ApiError(500, "the request ended without a result")

    def stream_sse(self, c: "SseChoice", named: bool = False, more=()) -> None:
        """Server-sent events. Headers wait until the worker has taken the request, so a request refused at once
        (a prompt that does not fit, a failed start) gets its HTTP status. more: callables that submit and return
        the next choices (n > 1), streamed after this one; [DONE] follows the last."""
        more = list(more)
        events = self.events(c.job, KEEPALIVE_S)
        ev = next(events)
        while ev[0] == "tick":
            ev = next(events)
        if ev[0] == "error":
            raise ApiError(ev[1], ev[2], kind="invalid_request_error" if ev[1] == 400 else "server_error")
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Accel-Buffering", "no")
        self.send_header("Connection", "close")
        self._cors_headers()
        self.end_headers()

        def send(items):
            for item in items:
                if named:
                    name, obj = item
                    data = f"event: {name}\ndata: {json.dumps(obj)}\n\n"
                else:
                    data = f"data: {json.dumps(item)}\n\n"
                self.wfile.write(data.encode())
            self.wfile.flush()

        def send_error(status, message):
            err = {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                   "code": status}
            send([("error", {"type": "error", "error": err})] if named else [{"error": err}])

        try:
            send(c.first)
            while True:
                if ev[0] == "tick":
                    self.wfile.write(b": keep-alive\n\n")   # a comment: clients ignore it
                    self.wfile.flush()
                elif ev[0] == "logprobs":
                    if c.logprob_sink is not None:
                        c.logprob_sink.append(ev)      # sent with the next chunk
                elif ev[0] == "delta":
                    send(c.on_delta(ev[1], ev[2]))
                elif ev[0] == "done":
                    send(c.on_done(ev[1]))
                    if more:
                        try:
                            c = more.pop(0)()
                        except ServiceError as e:     # the server is shutting down
                            return send_error(e.status, e.message)
                        events = self.events(c.job, KEEPALIVE_S)
                        send(c.first)
                        ev = next(events)
                        continue
                    if not named:
                        self.wfile.write(b"data: [DONE]\n\n")
                        self.wfile.flush()
                    return
                elif ev[0] == "error":
                    return send_error(ev[1], ev[2])
                ev = next(events)
        except (BrokenPipeError, ConnectionResetError, socket.timeout, OSError):
            c.job.cancel.set()
            raise ClientGone() from None


@dataclasses.dataclass
class SseChoice:
    """One streamed answer: its job, the events sent first, and the builders of its later events."""
    job: Job
    first: list
    on_delta: object
    on_done: object
    logprob_sink: list | None = None


@contextmanager
def prompt_errors_are_400(param: str):
    """A prompt the codec cannot build (a template error, an unknown token id) is the request's fault."""
    try:
        yield
    except PromptError as e:
        raise ApiError(400, str(e), param=param) from None


def finish_reason(res: Result, calls=()) -> str:
    if calls:
        return "tool_calls"
    return "length" if res.finish == "length" else "stop"


def tool_choice(body: dict) -> str | None:
    """OpenAI's tool_choice ("none", "auto", "required" or a named function) or Anthropic's ({"type": ...}), as
    "none" or not: a model cannot be forced to call, so the rest only matter to the template."""
    v = body.get("tool_choice")
    if v is None or v in ("none", "auto", "required"):
        return v
    if isinstance(v, dict) and isinstance(v.get("type"), str):
        return "none" if v["type"] == "none" else "auto"
    raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or an object with a 'type'",
                   param="tool_choice")


def anthropic_choice(body: dict):
    """Anthropic's tool_choice ({"type": "auto" | "any" | "tool" | "none", "name"}) in OpenAI's terms."""
    v = body.get("tool_choice")
    if not isinstance(v, dict):
        return v
    kind = v.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": v.get("name")}}
    return {"any": "required"}.get(kind, kind)


def feed_calls(parser, content: str) -> tuple[str, list]:
    """A piece of the answer's content through the tool-call parser (None: the request offers no tools): (the content
    without calls, the calls it completed). Streamed answers feed each piece; split_calls feeds the whole answer."""
    if parser is None or not content:
        return content, []
    return parser.feed(content)


def flush_calls(parser) -> tuple[str, list]:
    """At the end of the answer: (the content the parser held back, the calls that the end completes)."""
    return ("", []) if parser is None else parser.flush()


def split_calls(parser, content: str) -> tuple[str, list]:
    """The whole answer's content through the tool-call parser: (content without the calls, the calls)."""
    c1, k1 = feed_calls(parser, content)
    c2, k2 = flush_calls(parser)
    return c1 + c2, k1 + k2


def anthropic_tools(tools) -> list | None:
    """Anthropic's tools ({name, description, input_schema}) in the OpenAI shape chat templates read."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise ApiError(400, f"tools[{i}] must be an object with a string 'name'", param="tools")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                     "parameters": t.get("input_schema") or {}}})
    return out


def anthropic_message(m: dict, where: str) -> list[dict]:
    """One Anthropic message as chat-template messages: tool_use blocks become the assistant's tool_calls, its
    thinking blocks its reasoning_content (which gpt-oss's template writes back before a call), tool_result blocks
    become role "tool" messages (before the user's own text)."""
    content = m.get("content")
    if not isinstance(content, list):
        return [{"role": m["role"], "content": text_content(content, where)}]
    calls, results, rest, thinking = [], [], [], []
    for i, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
            if kind == "thinking":     # redacted thinking is opaque to any other model: dropped
                if not isinstance(b.get("thinking"), str):
                    raise ApiError(400, f"{where}.content[{i}]: a thinking block needs a string 'thinking'",
                                   param="messages")
                thinking.append(b["thinking"])
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise ApiError(400, f"{where}.content[{i}]: a tool_use needs a string 'name' and an object 'input'",
                               param="messages")
            calls.append({"id": _call_id(b.get("id")), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        elif kind == "tool_result" and m["role"] == "user":
            results.append({"role": "tool", "tool_call_id": _call_id(b.get("tool_use_id")),
                            "content": text_content(b.get("content"), f"{where}.content[{i}]")})
        else:
            rest.append(b)
    msg = {"role": m["role"], "content": text_content(rest, where)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    return results + ([msg] if rest or calls or thinking or not results else [])


def _call_id(tool_use_id) -> str:
    # Our tool_use ids are "toolu_" + the call's id: the template sees the id it would have seen through the
    # OpenAI API (Mistral's insists on its 9-character form).
    return str(tool_use_id or "").removeprefix("toolu_")


def anthropic_call(call) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}


def openai_call(call) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def add_usage(a: Result, b: Result) -> Result:
    """The sums of two choices' counts (n > 1: the usage covers every answer; the prompt counts once)."""
    out = dataclasses.replace(a)
    for k in ("generated", "prompt_read", "prompt_ms", "decode_ms"):
        setattr(out, k, getattr(a, k) + getattr(b, k))
    return out


def usage(res: Result) -> dict:
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.generated,
            "total_tokens": res.prompt_tokens + res.generated,
            "prompt_tokens_details": {"cached_tokens": res.cached_tokens}}


def timings(res: Result) -> dict:
    return {"cache_n": res.cached_tokens, "prompt_n": res.prompt_read, "prompt_ms": round(res.prompt_ms, 3),
            "prompt_per_second": round(res.prompt_read / res.prompt_ms * 1000, 2) if res.prompt_ms else 0.0,
            "predicted_n": res.generated, "predicted_ms": round(res.decode_ms, 3),
            "predicted_per_second": round(res.generated / res.decode_ms * 1000, 2) if res.decode_ms else 0.0}


ROUTES = {
    ("GET", "/health"): Handler.get_health,
    ("GET", "/v1/models"): Handler.get_models,
    ("GET", "/metrics"): Handler.get_metrics,
    ("POST", "/load"): Handler.post_load,
    ("POST", "/unload"): Handler.post_unload,
    ("POST", "/v1/chat/completions"): Handler.post_chat,
    ("POST", "/v1/completions"): Handler.post_completions,
    ("POST", "/v1/messages"): Handler.post_messages,
    ("POST", "/v1/messages/count_tokens"): Handler.post_count_tokens,
}
