"""The worker line protocol, shared by the worker and the server: every line's format and its parser.

docs/design.md, "The worker protocol", is the reference: each line, the GEN keys (sampling, req, logprobs,
grammar) and the start narration (INFO phase=...). A worker on a model with recurrent layers resumes from
checkpoints: see the note above `Done`.
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

# Keys of GEN that are not sampling settings (see the module docstring).
REQUEST_KEYS: dict[str, type] = {"req": int, "logprobs": int, "grammar": str}
MAX_TOP_LOGPROBS = 20

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
    req: int | None = None           # the server's request number, echoed in RESUME, DONE and ERR
    logprobs: int | None = None      # top alternatives per T line (None: no log-probabilities)
    grammar: str | None = None       # base64url of an llguidance grammar (engine/grammar.py)

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
    for key in REQUEST_KEYS:
        value = getattr(req, key)
        if value is not None:
            parts.append(f"{key}={value}")
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
    extra: dict = {}
    for kv in parts[2:-1]:
        key, sep, value = kv.partition("=")
        if not sep:
            raise ProtocolError(f"GEN: expected key=value, got {kv!r}")
        if key in REQUEST_KEYS:
            typ = REQUEST_KEYS[key]
            extra[key] = value if typ is str else _parse_number(key, value, typ)
            continue
        if key not in GEN_KEYS:
            raise ProtocolError(f"GEN: unknown key {key!r} (known: {', '.join([*GEN_KEYS, *REQUEST_KEYS])})")
        params[key] = _parse_number(key, value, GEN_KEYS[key][0])
    _check_params(params)
    if not 0 <= extra.get("logprobs", 0) <= MAX_TOP_LOGPROBS:
        raise ProtocolError(f"GEN: logprobs must be in 0..{MAX_TOP_LOGPROBS}")
    ids_text = parts[-1]
    try:
        prompt = [int(t) for t in ids_text.split(",")]
    except ValueError:
        raise ProtocolError(f"GEN: the prompt must be comma-separated token ids, got {ids_text[:60]!r}") from None
    if not prompt:
        raise ProtocolError("GEN needs at least one prompt token")
    return GenRequest(max_new=max_new, prompt=prompt, params=params, **extra)


def gen_req_number(line: str) -> int | None:
    """The req=<n> of a GEN line that may not parse, so its ERR can still name the request."""
    for kv in line.split()[2:-1]:
        if kv.startswith("req=") and kv[4:].isdigit():
            return int(kv[4:])
    return None


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


# Models with recurrent layers (qwen3next, qwen35moe, qwen4exp; engine/checkpoints.py): their state cannot be cut
# back to a shorter prefix, so the worker resumes from its latest checkpoint at or before the common prefix. RESUME
# <n> and DONE's `reused` say where that checkpoint is (n <= the common prefix; 0 when none fits), and `prompt_read`
# counts everything read again after it. Just before each DONE such a worker sends
#     INFO checkpoints=<count> checkpoint_mib=<MiB held>[ <backend's request facts>]
# (the facts: Backend.request_info(), e.g. qwen4exp's ple_row_lookups=<n> ple_row_hits=<n>, its n-gram table's
# rows read in that request and how many came from the row cache).
# The drafts fields count speculative decoding (engine/speculate.py, the worker's --draft): drafts_offered, the draft
# tokens the request's verify windows checked, drafts_accepted, those the target confirmed and the request emitted;
# both 0 without a drafter. Every other emitted token is a window's own pick, one a window (the prompt's first
# pick counting as one): so generated / (generated - drafts_accepted) is the tokens per window, within the last
# window of a request that ended on an end-of-generation token. The original Strata put checkpoint counts in these
# fields; this protocol keeps those on the INFO line above.
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
    return parse_done_req(line)[0]


def parse_done_req(line: str) -> tuple[Done, int | None]:
    """DONE's fields and the req number it echoes (None when it has none)."""
    parts = line.split()
    if parts[:1] != ["DONE"] or len(parts) not in (15, 16):
        raise ProtocolError(f"DONE needs 14 fields (and the req number), got {len(parts) - 1}: {line[:80]!r}")
    req = None
    if len(parts) == 16:
        if not parts[15].isdigit():
            raise ProtocolError(f"DONE: the req number {parts[15][:20]!r} is not a number")
        req = int(parts[15])
    vals = []
    try:
        for f, text in zip(fields(Done), parts[1:]):
            vals.append(text if f.type == "str" else (float(text) if f.type == "float" else int(text)))
    except ValueError:
        raise ProtocolError(f"DONE: a field is not a number: {line[:80]!r}") from None
    d = Done(*vals)
    if d.finish not in FINISH_REASONS:
        raise ProtocolError(f"DONE: unknown finish {d.finish!r}")
    if min(d.generated, d.prompt, d.reused, d.prompt_read) < 0:
        raise ProtocolError(f"DONE: a count is negative: {line[:80]!r}")
    return d, req


def format_info(**kv) -> str:
    items = []
    for k, v in kv.items():
        text = f"{v:.1f}" if isinstance(v, float) else str(v)
        if " " in text or "=" in k:
            raise ProtocolError(f"INFO values may not hold spaces: {k}={text!r}")
        items.append(f"{k}={text}")
    return "INFO " + " ".join(items)


PHASES = ("loading", "arena", "cache", "ready")


def format_phase(phase: str, done: float | None = None, gib: float | None = None, gib_s: float | None = None) -> str:
    if phase not in PHASES:
        raise ProtocolError(f"unknown start phase {phase!r}: expected one of {', '.join(PHASES)}")
    kv = {"phase": phase}
    for key, v, digits in (("phase_done", done, 3), ("phase_gib", gib, 2), ("phase_gib_s", gib_s, 1)):
        if v is not None:
            kv[key] = f"{v:.{digits}f}"
    return format_info(**kv)


def describe_phase(info: dict[str, str]) -> str | None:
    """The start's phase in words from the INFO keys gathered so far ("pinning experts: 45% of 16.0 GiB at 12.3
    GiB/s"), or None before the first phase line."""
    phase = info.get("phase")
    if phase not in PHASES:
        return None
    done, gib, rate = info.get("phase_done"), info.get("phase_gib"), info.get("phase_gib_s")
    if phase == "arena":
        text = "pinning experts in RAM"
        if done is not None:
            text += f": {float(done):.0%}" + (f" of {float(gib):.1f} GiB" if gib else "")
        return text + (f" at {float(rate):.1f} GiB/s" if rate else "")
    if phase == "cache":
        what = f" ({float(gib):.1f} GiB)" if gib else ""
        return f"VRAM expert cache filled{what}" if done == "1.000" else f"filling the VRAM expert cache{what}"
    return {"loading": "loading the model", "ready": "ready"}[phase]


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
    try:
        return int(p[1]), int(p[2]), float(p[3]), float(p[4])
    except ValueError:
        raise ProtocolError(f"PP: a field is not a number: {line[:80]!r}") from None


def format_err(message: str, req: int | None = None) -> str:
    # One line: the server reads line by line, so a newline in a message would split it.
    return "ERR " + (f"req={req} " if req is not None else "") + " ".join(str(message).split())


def parse_err(line: str) -> tuple[str, int | None]:
    """(message, req number or None) of an ERR line."""
    rest = line[3:].strip()
    head, _, tail = rest.partition(" ")
    if head.startswith("req=") and head[4:].isdigit():
        return tail, int(head[4:])
    return rest, None


def parse_resume(line: str) -> tuple[int, int | None]:
    """(tokens reused, req number or None) of a RESUME line."""
    p = line.split()
    if len(p) not in (2, 3) or not all(x.isdigit() for x in p[1:]):
        raise ProtocolError(f"RESUME needs a count (and the req number): {line[:80]!r}")
    return int(p[1]), (int(p[2]) if len(p) == 3 else None)


def with_req(line: str, req: int | None) -> str:
    """A request-scoped line as the worker sends it for GEN req=<req>: RESUME and DONE end with the number, ERR
    starts with req=<n>; other lines unchanged."""
    if req is None:
        return line
    head = line.split(" ", 1)[0]
    if head in ("RESUME", "DONE"):
        return f"{line} {req}"
    if head == "ERR":
        return f"ERR req={req} {line[4:]}"
    return line


def format_token(token: int, logprob: float | None = None, top: "list[tuple[int, float]] | None" = None) -> str:
    if logprob is None:
        return f"T {token}"
    alts = ",".join(f"{i}:{lp:.4f}" for i, lp in (top or [])) or "-"
    return f"T {token} {logprob:.4f} {alts}"


def parse_token(line: str, n_vocab: int | None = None) -> tuple[int, float | None, list[tuple[int, float]]]:
    """(id, logprob or None, [(id, logprob), ...]) of a T line; ids checked against n_vocab when given."""
    p = line.split()
    if len(p) not in (2, 4):
        raise ProtocolError(f"T needs an id (and a logprob and the alternatives): {line[:80]!r}")
    try:
        tok = int(p[1])
        lp = float(p[2]) if len(p) == 4 else None
        top = [] if len(p) == 2 or p[3] == "-" else \
            [(int(i), float(v)) for i, _, v in (a.partition(":") for a in p[3].split(","))]
    except ValueError:
        raise ProtocolError(f"T: not a token id / log-probability: {line[:80]!r}") from None
    if n_vocab is not None and not all(0 <= t < n_vocab for t in [tok] + [i for i, _ in top]):
        raise ProtocolError(f"T: token id outside the vocabulary (0..{n_vocab - 1}): {line[:80]!r}")
    if lp is not None and not (math.isfinite(lp) or lp == -math.inf):
        raise ProtocolError(f"T: the log-probability is not a number: {line[:80]!r}")
    return tok, lp, top


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
    try:
        n_layer, n_expert = int(p[1]), int(p[2])
        bits, heat = bytes.fromhex(p[3]), np.frombuffer(bytes.fromhex(p[4]), np.uint8)
    except ValueError:
        raise ProtocolError(f"CACHE: the sizes must be numbers and the maps hex: {line[:80]!r}") from None
    n = n_layer * n_expert
    if n_layer < 0 or n_expert < 0 or len(bits) != (n + 7) // 8 or heat.size != n:
        raise ProtocolError(f"CACHE: {n_layer} x {n_expert} experts need {(n + 7) // 8} bitmap bytes and {n} heat "
                            f"bytes, got {len(bits)} and {heat.size}")
    resident = np.unpackbits(np.frombuffer(bits, np.uint8), bitorder="little")[:n].astype(bool)
    return n_layer, n_expert, resident.reshape(n_layer, n_expert), heat.reshape(n_layer, n_expert)


def kind(line: str) -> str:
    """The message type of a worker line: INFO, READY, RESUME, PP, REUSED, T, DONE, ERR, CACHE or '' (unknown)."""
    head = line.split(" ", 1)[0].strip()
    return head if head in {"INFO", "READY", "RESUME", "PP", "REUSED", "T", "DONE", "ERR", "CACHE"} else ""
