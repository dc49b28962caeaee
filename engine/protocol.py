"""The worker line protocol (DESIGN §3), shared by the worker and the server.

One message per line, ASCII, fields separated by single spaces. Token ids, never text, cross the boundary.

Worker -> server:
    INFO key=value ...            any number, before READY and after
    READY <max_context> stop      once, when loaded
    RESUME <n>                    per request: prompt tokens reused from the cached prefix
    PP <pos> <prompt> <ms> <tps>  after every prompt chunk
    REUSED <n>                    once the prompt is read
    T <id>                        every generated token, as soon as it is final; the end-of-generation token
                                  that ends a request with `stop` is not sent (and not counted in DONE)
    DONE <14 fields>              or ERR <message>: exactly one per request. A STOP during the prompt pass gives
                                  RESUME, PP..., DONE ... cancel (no REUSED: the prompt was not read to its end)
    CACHE <n_layer> <n_expert> <resident_hex> <heat_hex>
                                  expert-cache picture (backends with an expert cache), may appear anywhere
                                  like INFO; resident_hex is a bitmap, bit (layer*n_expert+expert), LSB first
                                  within each byte; heat_hex one byte per (layer, expert), 0..255, use shaded.

A worker on a model with recurrent layers resumes from checkpoints: see the note above `Done`.

Server -> worker:
    GEN <max_new>[ key=value ...] <id>,<id>,...
    STOP
    QUIT
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

# Sampling keys GEN may carry, with their type and the default that is never sent.
GEN_KEYS: dict[str, tuple[type, object]] = {
    "temperature": (float, 0.0),
    "top_k": (int, 0),
    "top_p": (float, 1.0),
    "min_p": (float, 0.0),
    "seed": (int, None),
    "penalty_repeat": (float, 1.0),
    "penalty_freq": (float, 0.0),
    "penalty_present": (float, 0.0),
    "penalty_last_n": (int, 64),
}

# Room kept free beyond prompt + max_new: a GEN whose prompt + max_new + CONTEXT_MARGIN exceeds the context is an ERR,
# never a silent truncation. The server checks the same rule before it sends.
CONTEXT_MARGIN = 8
FINISH_REASONS = ("stop", "length", "cancel")


class ProtocolError(ValueError):
    """A line that does not follow the protocol; the message says what is wrong and what was expected."""


@dataclass
class GenRequest:
    max_new: int
    prompt: list[int]
    params: dict = field(default_factory=dict)  # only keys from GEN_KEYS, only non-default values

    def param(self, key: str):
        return self.params.get(key, GEN_KEYS[key][1])


def format_gen(req: GenRequest) -> str:
    if not req.prompt:
        raise ProtocolError("GEN needs at least one prompt token")
    parts = ["GEN", str(int(req.max_new))]
    for key, (typ, default) in GEN_KEYS.items():
        if key in req.params and req.params[key] is not None and req.params[key] != default:
            value = typ(req.params[key])
            parts.append(f"{key}={value!r}" if typ is float else f"{key}={value}")
    parts.append(",".join(str(int(t)) for t in req.prompt))
    return " ".join(parts)


def _parse_number(key: str, text: str, typ: type):
    try:
        value = typ(text)
    except ValueError:
        raise ProtocolError(f"GEN: {key}={text!r} is not a valid {typ.__name__}") from None
    if typ is float and not math.isfinite(value):
        raise ProtocolError(f"GEN: {key}={text!r} must be a finite number")
    return value


def parse_gen(line: str) -> GenRequest:
    """Parse a GEN line. Ranges of the sampling values are checked here so the worker can answer ERR at once."""
    parts = line.split()  # any run of spaces separates fields; a stray double space is not an error
    if not parts or parts[0] != "GEN":
        raise ProtocolError("expected a line starting with GEN")
    if len(parts) < 3:
        raise ProtocolError("GEN needs: GEN <max_new> [key=value ...] <id>,<id>,...")
    try:
        max_new = int(parts[1])
    except ValueError:
        raise ProtocolError(f"GEN: max_new {parts[1]!r} is not an integer") from None
    if max_new < 0:
        raise ProtocolError(f"GEN: max_new must be >= 0, got {max_new}")
    params: dict = {}
    for kv in parts[2:-1]:
        key, sep, value = kv.partition("=")
        if not sep:
            raise ProtocolError(f"GEN: expected key=value, got {kv!r}")
        if key not in GEN_KEYS:
            raise ProtocolError(f"GEN: unknown key {key!r} (known: {', '.join(GEN_KEYS)})")
        params[key] = _parse_number(key, value, GEN_KEYS[key][0])
    _check_params(params)
    ids_text = parts[-1]
    try:
        prompt = [int(t) for t in ids_text.split(",")]
    except ValueError:
        raise ProtocolError(f"GEN: the prompt must be comma-separated token ids, got {ids_text[:60]!r}") from None
    if not prompt:
        raise ProtocolError("GEN needs at least one prompt token")
    return GenRequest(max_new=max_new, prompt=prompt, params=params)


def _check_params(p: dict) -> None:
    def bad(msg):
        raise ProtocolError(f"GEN: {msg}")
    if p.get("temperature", 0.0) < 0:
        bad("temperature must be >= 0")
    if p.get("top_k", 0) < 0:
        bad("top_k must be >= 0 (0 = off)")
    if not 0.0 < p.get("top_p", 1.0) <= 1.0:
        bad("top_p must be in (0, 1]")
    if not 0.0 <= p.get("min_p", 0.0) <= 1.0:
        bad("min_p must be in [0, 1]")
    if p.get("penalty_repeat", 1.0) <= 0:
        bad("penalty_repeat must be > 0 (1 = off)")
    if p.get("seed", 0) < 0:
        bad("seed must be >= 0 (leave it out for a fresh random seed)")
    if p.get("penalty_last_n", 64) < -1:
        bad("penalty_last_n must be >= -1 (-1 = the whole context)")


# Models with recurrent layers (qwen3next, qwen35moe; engine/checkpoints.py): their state cannot be cut back to a
# shorter prefix, so the worker resumes from its latest checkpoint at or before the common prefix. RESUME <n> and
# DONE's `reused` say where that checkpoint is (n <= the common prefix; 0 when none fits), and `prompt_read` counts
# everything read again after it. Just before each DONE such a worker sends
#     INFO checkpoints=<count> checkpoint_mib=<MiB held>
# The drafts fields stay speculative-decoding counters (0 until a draft/MTP path exists): the original Strata put
# checkpoint counts there; this protocol keeps them on that INFO line instead.
@dataclass
class Done:
    generated: int
    prompt: int
    prompt_ms: float
    decode_ms: float
    finish: str
    drafts_accepted: int = 0
    drafts_offered: int = 0
    reused: int = 0
    hits: int = 0
    lookups: int = 0
    ram_blobs: int = 0
    file_blobs: int = 0
    file_mb: float = 0.0
    prompt_read: int = 0


DONE_FIELDS = [f.name for f in fields(Done)]
assert len(DONE_FIELDS) == 14


def format_done(d: Done) -> str:
    if d.finish not in FINISH_REASONS:
        raise ProtocolError(f"DONE: finish must be one of {FINISH_REASONS}")
    out = ["DONE"]
    for f in fields(Done):
        v = getattr(d, f.name)
        out.append(f"{v:.1f}" if isinstance(v, float) else str(v))
    return " ".join(out)


def parse_done(line: str) -> Done:
    parts = line.split()
    if parts[:1] != ["DONE"] or len(parts) != 15:
        raise ProtocolError(f"DONE needs 14 fields, got {len(parts) - 1}: {line[:80]!r}")
    vals = []
    try:
        for f, text in zip(fields(Done), parts[1:]):
            vals.append(text if f.type == "str" else (float(text) if f.type == "float" else int(text)))
    except ValueError:
        raise ProtocolError(f"DONE: a field is not a number: {line[:80]!r}") from None
    d = Done(*vals)
    if d.finish not in FINISH_REASONS:
        raise ProtocolError(f"DONE: unknown finish {d.finish!r}")
    return d


def format_info(**kv) -> str:
    items = []
    for k, v in kv.items():
        text = f"{v:.1f}" if isinstance(v, float) else str(v)
        if " " in text or "=" in k:
            raise ProtocolError(f"INFO values may not hold spaces: {k}={text!r}")
        items.append(f"{k}={text}")
    return "INFO " + " ".join(items)


def parse_info(line: str) -> dict[str, str]:
    out = {}
    for item in line.split()[1:]:
        k, _, v = item.partition("=")
        out[k] = v
    return out


def format_pp(position: int, prompt_tokens: int, ms: float, tps: float) -> str:
    return f"PP {position} {prompt_tokens} {ms:.1f} {tps:.1f}"


def parse_pp(line: str) -> tuple[int, int, float, float]:
    p = line.split()
    if len(p) != 5:
        raise ProtocolError(f"PP needs 4 fields: {line[:80]!r}")
    return int(p[1]), int(p[2]), float(p[3]), float(p[4])


def format_err(message: str) -> str:
    # One line: the server reads line by line, so a newline in a message would split it.
    return "ERR " + " ".join(str(message).split())


def format_cache(n_layer: int, n_expert: int, resident: "list[bool] | bytes", heat: bytes) -> str:
    """Expert-cache picture; resident is n_layer*n_expert booleans, heat one byte each."""
    import numpy as np
    bits = np.packbits(np.asarray(resident, dtype=bool), bitorder="little").tobytes()
    if len(heat) != n_layer * n_expert:
        raise ProtocolError("CACHE: heat must hold one byte per (layer, expert)")
    return f"CACHE {n_layer} {n_expert} {bits.hex()} {bytes(heat).hex()}"


def parse_cache(line: str):
    import numpy as np
    p = line.split()
    if len(p) != 5:
        raise ProtocolError(f"CACHE needs 4 fields: {line[:80]!r}")
    n_layer, n_expert = int(p[1]), int(p[2])
    n = n_layer * n_expert
    resident = np.unpackbits(np.frombuffer(bytes.fromhex(p[3]), np.uint8), bitorder="little")[:n].astype(bool)
    heat = np.frombuffer(bytes.fromhex(p[4]), np.uint8)
    return n_layer, n_expert, resident.reshape(n_layer, n_expert), heat.reshape(n_layer, n_expert)


def kind(line: str) -> str:
    """The message type of a worker line: INFO, READY, RESUME, PP, REUSED, T, DONE, ERR, CACHE or '' (unknown)."""
    head = line.split(" ", 1)[0].strip()
    return head if head in {"INFO", "READY", "RESUME", "PP", "REUSED", "T", "DONE", "ERR", "CACHE"} else ""
