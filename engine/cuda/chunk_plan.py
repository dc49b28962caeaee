"""How big a prompt chunk the streamed prompt pass takes, decided before anything is allocated.

`buffers(cfg, T, ...)` lists every device buffer a chunk of T tokens needs (name, element count, bytes per element);
engine/cuda/prefill.py allocates exactly this list, so summing it here *is* replaying the allocation: a
chunk either fits or is refused with the numbers, never an out-of-memory halfway through a prompt. Pure Python (no
CuPy), so the sizing is unit-tested on the CPU with real model shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
AUTO_MAX = 8192          # auto never goes past this: the expert bytes per token are already 1/8 of a 1K chunk's
AUTO_MIN = 1024          # docs/design.md "The prompt pass": 1,024 tokens and up when it fits
STEP = 256               # auto chunk sizes are multiples of this (below AUTO_MIN: of 16)
RING_MIN = 2             # two slots: one being copied while the other is read
RING_MAX = 384           # the original engine measured 384 slots best with pinned sources
RING_AUTO_FLOOR = 16     # auto keeps at least this many ring slots before it grows the chunk past AUTO_MIN
RING_LEND_FLOOR = 64     # a lent ring is at least this deep (see ring_target)
DEQUANT_SCRATCH_ELEMS = 1 << 25   # dense weights are dequantized to fp32 scratch at most this many values at a time
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


def no_buffers(T: int) -> list[Buffer]:
    return []


def buffers(cfg, T: int, extra=no_buffers) -> list[Buffer]:
    """Every buffer of a chunk of T tokens (the expert ring's slots excepted: ring_bytes); extra(T): the family's
    own (engine/cuda/families/: its prompt_buffers)."""
    c = cfg
    E, qw, kw = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    k = max(c.n_expert_used, 1)
    out = [Buffer("x", T * E, 4), Buffer("xn", T * E, 4), Buffer("q", T * qw, 4), Buffer("k", T * kw, 4),
           Buffer("v", T * kw, 4), Buffer("att", T * qw, 4),
           # fp16 GEMM operands: the normed activations (or the attention output) once per token, and a dense
           # weight matrix dequantized once per chunk
           Buffer("xh", T * max(E, qw, getattr(c, "ssm_inner", 0)), 2),
           Buffer("wh", min(max(qw * E, kw * E), WH_ELEMS), 2)]
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
    out += extra(T)             # the family's (the hybrids' attention gate and GDN buffers)
    # What is dequantized to fp32 (prefill.py linear_into, linear, ffn): the routers and the shared
    # expert of an MoE model, the FFN of a dense one. Attention goes through the fp16 "wh"; the output head's logits
    # of the last row come from the decode mat-vec on the quantized rows, so no fp32 copy of the head (n_vocab x
    # n_embd: the cap, 128 MiB, for Qwen3) is held back from the expert cache; logits for every row (all_logits:
    # teacher forcing, tests) dequantize it in blocks of the cap beyond this plan, as their (T, n_vocab) output is.
    fp32 = max(c.n_expert * E, (c.n_ff_shexp or 0) * E) if c.n_expert else (c.n_ff or 0) * E
    out += [Buffer("dequant_scratch", max(1, min(fp32, DEQUANT_SCRATCH_ELEMS)), 4, False),
            Buffer("logits", c.n_vocab, 4, False),             # the last row's logits (the mat-vec norms x itself)
            Buffer("cublas", CUBLAS_WORKSPACE, 1, False), Buffer("margin", MARGIN, 1, False)]
    return out


def chunk_bytes(cfg, T: int, extra=no_buffers) -> int:
    return sum(b.nbytes for b in buffers(cfg, T, extra))


def ring_bytes(depth: int, stride: int) -> int:
    return depth * stride


def ring_target(n_stream: int, n_layer: int) -> int:
    """How deep the ring should be when expert-cache slots can be lent to it: two layers' worth of streamed experts
    (at least RING_LEND_FLOOR, at most RING_MAX, never more than there are to stream).

    Why two layers: the copy stream only refills a slot once the compute stream has released it, and during a
    layer's attention and dense projections the compute stream releases nothing. With one layer's worth the copy
    engine has at most the next layer's experts to copy while the current layer computes, then idles through the
    next attention half (docs/experiments.md, "The lent ring's depth"). Two layers' worth let the copies run a whole layer ahead, so the attention halves are covered
    by the next layer's copies, and ring batches (half the ring, at most ring.BATCH_MAX) stay full size. The floor
    covers an attention half (~27 experts at 52 GB/s on Qwen3-30B-A3B) with room for a batch being read; the cap is
    the original engine's measured best."""
    if not n_stream or not n_layer:
        return 0
    per_layer = -(-int(n_stream) // int(n_layer))
    return min(RING_MAX, int(n_stream), max(2 * per_layer, RING_LEND_FLOOR))


@dataclass(frozen=True)
class Plan:
    chunk: int
    ring: int                 # ring slots allocated (the ring's own VRAM)
    chunk_bytes: int
    ring_bytes: int
    lend: int = 0             # expert-cache slots the ring borrows per streamed prompt, on top of its own
    lend_occupied: bool = False   # may it evict the coldest experts for them (auto), or only take free slots (ring=N)

    @property
    def total(self) -> int:
        return self.chunk_bytes + self.ring_bytes


class ChunkRefused(MemoryError):
    """A chunk (or ring) that does not fit; the message names the numbers and the flag that helps."""


def _refuse(what: str, need: int, free: int, hint: str) -> ChunkRefused:
    return ChunkRefused(f"{what} needs {need / MiB:.0f} MiB of VRAM but {free / MiB:.0f} MiB are left after the "
                        f"weights, KV cache and expert cache; {hint}")


def _auto_sizes(cap: int) -> list[int]:
    """Chunk sizes auto tries, largest first: the cap, multiples of STEP down to AUTO_MIN, then multiples of 16."""
    s = {cap} | {n for n in range(AUTO_MIN, cap + 1, STEP)} | {n for n in range(16, min(cap, AUTO_MIN), 16)}
    return sorted(s, reverse=True)


def plan_chunk(cfg, free: int, chunk="auto", ring=None, stride: int = 0, n_stream: int = 0,
               max_tokens: int | None = None, lendable: int = 0, extra=no_buffers) -> Plan:
    """The chunk and ring for `free` bytes of VRAM.

    chunk: an int or "auto"; ring: an int (ring=N: the ring's own slots, exactly) or None (auto); stride: bytes per
    expert blob (0: no experts); n_stream: how many experts stream (the non-resident ones; 0 when everything is
    resident); max_tokens: the context (no chunk is longer); lendable: expert-cache slots the ring may borrow (the
    cache's slot count); extra: the family's buffers (buffers()).

    Auto: the ring's own slots are whatever VRAM the chunk leaves (the backend reserves none for it, so the expert
    cache gets those bytes for decode), and per streamed prompt the ring borrows cache slots up to ring_target(),
    evicting the coldest experts for them. ring=N: N own slots, plus only free (empty) cache slots lent on top.
    Raises ChunkRefused with the numbers when nothing fits.
    """
    cap = AUTO_MAX if max_tokens is None else max(1, min(AUTO_MAX, int(max_tokens)))
    streams = bool(stride and n_stream)
    if ring is not None and int(ring) < RING_MIN:
        raise ValueError(f"--tune ring={ring} is too small; use at least {RING_MIN}")
    lendable = max(0, int(lendable)) if streams else 0
    if ring is not None:
        own_floor = int(ring) if streams else 0
    else:       # the auto ring needs RING_MIN slots in all; borrowed ones count
        own_floor = max(0, RING_MIN - lendable) if streams else 0
    if chunk != "auto":
        T = int(chunk)
        if T < 1:
            raise ValueError(f"--prefill-chunk must be at least 1 (or auto), got {chunk}")
        if max_tokens is not None:
            T = min(T, int(max_tokens))
        need = chunk_bytes(cfg, T, extra) + ring_bytes(own_floor, stride)
        if need > free:
            raise _refuse(f"a prompt chunk of {T} tokens (with {own_floor} ring slots)", need, free,
                          ("lower --tune ring, " if ring is not None else "") + "lower --prefill-chunk (or use auto), "
                          "lower --ctx or --expert-slots, or raise --vram-budget-mib")
    else:
        # Largest multiple of STEP up to the cap that leaves room for the ring's own floor (the auto floor's
        # RING_AUTO_FLOOR slots may be borrowed); below AUTO_MIN, smaller steps.
        floor = own_floor
        if ring is None and streams:
            floor = max(own_floor, min(RING_AUTO_FLOOR, n_stream) - lendable)
        floor_bytes = ring_bytes(floor, stride)
        T = next((T for T in _auto_sizes(cap) if chunk_bytes(cfg, T, extra) + floor_bytes <= free), None)
        if T is None:
            T = _auto_sizes(cap)[-1]
            raise _refuse(f"the smallest prompt chunk ({T} tokens, {floor} ring slots)", chunk_bytes(cfg, T, extra)
                          + floor_bytes, free, ("lower --tune ring, " if ring is not None else "")
                          + "lower --ctx or --expert-slots, or raise --vram-budget-mib")
    cb = chunk_bytes(cfg, T, extra)
    left = free - cb
    if not streams:
        return Plan(T, 0, cb, 0)
    if ring is not None:
        own = int(ring)
        if own * stride > left:
            raise _refuse(f"--tune ring={ring} beside a chunk of {T} tokens", cb + own * stride, free,
                          "lower --tune ring, or --prefill-chunk")
        return Plan(T, own, cb, ring_bytes(own, stride), max(0, min(lendable, RING_MAX - own)), False)
    # VRAM the chunk leaves would sit idle: the ring's own slots take it first (up to RING_MAX), so fewer experts
    # are evicted for lent slots
    # (at least RING_MIN slots in all, even when fewer experts stream)
    own = max(0, min(RING_MAX, max(n_stream, RING_MIN), left // stride))
    lend = max(0, min(lendable, max(ring_target(n_stream, cfg.n_layer), RING_MIN) - own))
    if own + lend < RING_MIN:
        raise _refuse(f"a chunk of {T} tokens and {RING_MIN} ring slots", cb + (RING_MIN - lend) * stride, free,
                      "lower --prefill-chunk, --ctx or --expert-slots")
    return Plan(T, own, cb, ring_bytes(own, stride), lend, True)
