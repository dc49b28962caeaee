"""How big a prompt chunk the streamed prompt pass takes, decided before anything is allocated.

`buffers(cfg, T, ...)` lists every device buffer a chunk of T tokens needs (name, element count, bytes per element);
engine/cuda/prefill_streamed.py allocates exactly this list, so summing it here *is* replaying the allocation: a
chunk either fits or is refused with the numbers, never an out-of-memory halfway through a prompt. Pure Python (no
CuPy), so the sizing is unit-tested on the CPU with real model shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
AUTO_MAX = 8192          # auto never goes past this: the expert bytes per token are already 1/8 of a 1K chunk's
AUTO_MIN = 1024          # DESIGN §5: 1,024 tokens and up when it fits
STEP = 256               # auto chunk sizes are multiples of this (below AUTO_MIN: of 16)
RING_MIN = 2             # two slots: one being copied while the other is read
RING_MAX = 384           # the original engine measured 384 slots best with pinned sources
RING_AUTO_FLOOR = 16     # auto keeps at least this many ring slots before it grows the chunk past AUTO_MIN
DEQUANT_SCRATCH_ELEMS = 1 << 25   # dense weights are dequantized to fp32 scratch this many values at a time
WH_ELEMS = 1 << 24       # attention weights dequantized to fp16 for cuBLAS this many values at a time (32 MiB)
CUBLAS_WORKSPACE = 32 * MiB
MARGIN = 64 * MiB        # the CuPy pool's rounding and small arrays (schedule tables, events)


@dataclass(frozen=True)
class Buffer:
    name: str
    elems: int
    itemsize: int
    keep: bool = True        # allocated once for the chunk size; False: a transient (CuPy temporaries, cuBLAS)

    @property
    def nbytes(self) -> int:
        return self.elems * self.itemsize


def buffers(cfg, T: int) -> list[Buffer]:
    """Every buffer of a chunk of T tokens (the expert ring's slots excepted: ring_bytes)."""
    c = cfg
    E, qw, kw = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    k = max(c.n_expert_used, 1)
    out = [Buffer("x", T * E, 4), Buffer("xn", T * E, 4), Buffer("q", T * qw, 4), Buffer("k", T * kw, 4),
           Buffer("v", T * kw, 4), Buffer("att", T * qw, 4),
           # fp16 GEMM operands: the normed activations (or the attention output) once per token, and a dense
           # weight matrix dequantized once per chunk
           Buffer("xh", T * max(E, qw), 2), Buffer("wh", min(max(qw * E, kw * E), WH_ELEMS), 2)]
    if c.n_expert:
        out += [Buffer("router_logits", T * c.n_expert, 4),
                Buffer("ids", T * k, 4), Buffer("wts", T * k, 4),
                Buffer("rows", T * k, 4), Buffer("row_w", T * k, 4),   # pairs sorted by expert
                Buffer("offsets", 2 * (c.n_expert + 1), 4),
                Buffer("h", T * k * c.n_ff_exp, 2)]            # SwiGLU output per (token, expert) pair, fp16
        if c.n_ff_shexp:
            out += [Buffer("sh_tmp", 3 * T * c.n_ff_shexp, 4, False), Buffer("sh_gate", T, 4, False)]
    else:
        out += [Buffer("ffn_tmp", 3 * T * c.n_ff, 4, False)]   # gate, up and their product
    largest = max(c.n_vocab * E, qw * E, E * qw, kw * E, (c.n_ff or 0) * E, (c.n_ff_shexp or 0) * E)
    out += [Buffer("dequant_scratch", min(largest, DEQUANT_SCRATCH_ELEMS), 4, False),
            Buffer("logits", 2 * c.n_vocab, 4, False),         # the last row's logits and the final norm's output
            Buffer("cublas", CUBLAS_WORKSPACE, 1, False), Buffer("margin", MARGIN, 1, False)]
    return out


def chunk_bytes(cfg, T: int) -> int:
    return sum(b.nbytes for b in buffers(cfg, T))


def ring_bytes(depth: int, stride: int) -> int:
    return depth * stride


@dataclass(frozen=True)
class Plan:
    chunk: int
    ring: int                 # ring slots allocated (lent cache slots come on top, per prompt)
    chunk_bytes: int
    ring_bytes: int

    @property
    def total(self) -> int:
        return self.chunk_bytes + self.ring_bytes


class ChunkRefused(MemoryError):
    """A chunk (or ring) that does not fit; the message names the numbers and the flag that helps."""


def _refuse(what: str, need: int, free: int, hint: str) -> ChunkRefused:
    return ChunkRefused(f"{what} needs {need / MiB:.0f} MiB of VRAM but {free / MiB:.0f} MiB are left after the "
                        f"weights, KV cache and expert cache; {hint}")


def _ring_depth(ring, left: int, stride: int, n_stream: int) -> int:
    """Slots for the ring: --ring N, else as many as the VRAM left holds up to RING_MAX (and no more than the
    experts there are to stream)."""
    if not stride or not n_stream:
        return 0
    if ring is not None:
        return int(ring)
    return max(0, min(RING_MAX, n_stream, left // stride))


def _auto_sizes(cap: int) -> list[int]:
    """Chunk sizes auto tries, largest first: the cap, multiples of STEP down to AUTO_MIN, then multiples of 16."""
    s = {cap} | {n for n in range(AUTO_MIN, cap + 1, STEP)} | {n for n in range(16, min(cap, AUTO_MIN), 16)}
    return sorted(s, reverse=True)


def plan_chunk(cfg, free: int, chunk="auto", ring=None, stride: int = 0, n_stream: int = 0,
               max_tokens: int | None = None, lendable: int = 0) -> Plan:
    """The chunk and ring for `free` bytes of VRAM.

    chunk: an int or "auto"; ring: an int or None (auto); stride: bytes per expert blob (0: no experts);
    n_stream: how many experts may stream (the non-resident ones; 0 when everything is resident);
    max_tokens: the context (no chunk is longer); lendable: expert-cache slots the ring may borrow, which lower
    the slots it must allocate. Raises ChunkRefused with the numbers when nothing fits.
    """
    cap = AUTO_MAX if max_tokens is None else max(1, min(AUTO_MAX, int(max_tokens)))
    want_ring = 0 if not (stride and n_stream) else max(RING_MIN, 0 if ring is None else int(ring))
    if ring is not None and int(ring) < RING_MIN:
        raise ValueError(f"--ring {ring} is too small; use at least {RING_MIN}")
    if chunk != "auto":
        T = int(chunk)
        if T < 1:
            raise ValueError(f"--prefill-chunk must be at least 1 (or auto), got {chunk}")
        if max_tokens is not None:
            T = min(T, int(max_tokens))
        need_ring = max(0, want_ring - lendable)
        need = chunk_bytes(cfg, T) + ring_bytes(need_ring, stride)
        if need > free:
            raise _refuse(f"a prompt chunk of {T} tokens (with {want_ring} ring slots)", need, free,
                          ("lower --ring, " if ring is not None else "") + "lower --prefill-chunk (or use auto), "
                          "lower --ctx or --expert-slots, or raise --vram-budget-mib")
        T_fixed = T
    else:
        T_fixed = None
    if T_fixed is None:
        # Largest multiple of STEP up to the cap that leaves room for the ring's floor; below AUTO_MIN, smaller steps.
        floor = 0 if not want_ring else max(want_ring, min(RING_AUTO_FLOOR, n_stream))
        floor_bytes = ring_bytes(max(0, floor - lendable), stride)
        T_fixed = next((T for T in _auto_sizes(cap) if chunk_bytes(cfg, T) + floor_bytes <= free), None)
        if T_fixed is None:
            T = _auto_sizes(cap)[-1]
            need = chunk_bytes(cfg, T) + floor_bytes
            raise _refuse(f"the smallest prompt chunk ({T} tokens, {floor} ring slots)", need, free,
                          ("lower --ring, " if ring is not None else "") + "lower --ctx or --expert-slots, or raise --vram-budget-mib")
    cb = chunk_bytes(cfg, T_fixed)
    left = free - cb
    if ring is not None:
        depth = int(ring) if (stride and n_stream) else 0
        own = max(0, depth - lendable)
        if own * stride > left:
            raise _refuse(f"--ring {ring} beside a chunk of {T_fixed} tokens", cb + own * stride, free,
                          "lower --ring, or --prefill-chunk")
    else:
        depth = _ring_depth(None, left + lendable * stride, stride, n_stream)
        if stride and n_stream and depth < RING_MIN:
            raise _refuse(f"a chunk of {T_fixed} tokens and {RING_MIN} ring slots",
                          cb + RING_MIN * stride, free, "lower --prefill-chunk, --ctx or --expert-slots")
        own = max(0, depth - lendable)
    return Plan(T_fixed, own, cb, ring_bytes(own, stride))
