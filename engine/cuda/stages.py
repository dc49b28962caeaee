"""The pipeline stages of a layer split (issue 32): which device each stage runs on, which consecutive layers it
owns, its share of the expert profile and of its device's VRAM, and the hand-off of the hidden state from one stage
to the next.

A stage list comes from `--gpus` and the split's counts (engine/cuda/layer_split.py plans them). A device may be
listed more than once (`--gpus 0,0 --layer-split 12,12`): the test mode that runs several stages on one GPU, so the
stage bookkeeping and the hand-off run where only one GPU is lent. Stages on one device share its VRAM: each gets a
share in proportion to its layers' bytes (`device_shares`), the share its own expert cache is sized within.

The hand-off (`Handoff`) copies the hidden state from the sending stage's buffer into the receiving stage's, ordered
by CUDA events: the receiver's stream waits on the sender's event, then copies (a peer copy when the devices differ,
a plain device copy on one device) and records its own event. Two alternating receive buffers let the sender write
chunk c + 1 while the receiver still reads chunk c (the prompt pass pipelined by chunk across devices); on one device
the stages share one GPU and run one after another, so the alternation only keeps the same code path.

Pure Python at import: CuPy is imported inside Handoff (the worker imports this module before CUDA starts).
"""
from __future__ import annotations

from dataclasses import dataclass


class StageError(ValueError):
    """A stage list that cannot run; one line saying what to change."""


@dataclass(frozen=True)
class StageSpec:
    index: int          # its place in the chain (0: the first)
    device: int         # the CUDA device index it runs on
    first: int          # the first layer it owns
    end: int            # one past its last layer
    n_stages: int

    @property
    def layers(self) -> range:
        return range(self.first, self.end)

    @property
    def embeds(self) -> bool:
        """The first stage embeds the token(s)."""
        return self.index == 0

    @property
    def heads(self) -> bool:
        """The last stage runs the output norm, the head and the pick."""
        return self.index == self.n_stages - 1

    def owns(self, layer: int) -> bool:
        return self.first <= layer < self.end


def stage_specs(devices: list[int], counts: list[int], n_layer: int) -> list[StageSpec]:
    """One stage a device listed, holding counts[i] consecutive layers; the counts cover the model's layers."""
    if len(devices) != len(counts):
        raise StageError(f"{len(counts)} layer counts for {len(devices)} GPU(s) "
                         f"({','.join(map(str, devices))}): give one count a GPU")
    if not counts:
        raise StageError("a layer split needs at least one stage")
    bad = [c for c in counts if c < 1]
    if bad:
        raise StageError(f"--layer-split {','.join(map(str, counts))}: every stage needs at least one layer")
    if sum(counts) != n_layer:
        raise StageError(f"--layer-split {','.join(map(str, counts))} covers {sum(counts)} layers; this model has "
                         f"{n_layer}")
    out, a = [], 0
    for i, (d, c) in enumerate(zip(devices, counts)):
        out.append(StageSpec(i, int(d), a, a + c, len(counts)))
        a += c
    return out


def shared_devices(specs: list[StageSpec]) -> bool:
    """Whether some device runs more than one stage (the one-GPU test mode)."""
    devs = [s.device for s in specs]
    return len(set(devs)) < len(devs)


def device_shares(specs: list[StageSpec], layer_bytes: list[int], free_bytes: dict[int, int]) -> list[int]:
    """The VRAM each stage may take: a device's free bytes (`free_bytes[device]`, within reserve and budget) split
    among its stages in proportion to the bytes of their layers (weights, KV, experts), so two stages of equal
    layers on one device each get half. The shares of one device sum to its free bytes (integer division's rest to
    its last stage)."""
    if len(layer_bytes) != max(s.end for s in specs):
        raise StageError(f"{len(layer_bytes)} layer sizes for {max(s.end for s in specs)} layers")
    out = [0] * len(specs)
    for dev in sorted({s.device for s in specs}):
        if dev not in free_bytes:
            raise StageError(f"no free VRAM figure for GPU {dev}")
        mine = [s for s in specs if s.device == dev]
        weights = [sum(layer_bytes[s.first:s.end]) for s in mine]
        total, free, given = sum(weights), int(free_bytes[dev]), 0
        for k, (s, w) in enumerate(zip(mine, weights)):
            share = free - given if k == len(mine) - 1 else (free * w // total if total else free // len(mine))
            out[s.index] = share
            given += share
    return out


def profile_shares(profile, specs: list[StageSpec]) -> list:
    """Each stage's own expert profile: the profile's order restricted to its layers (global layer ids, hottest
    first), as engine/cuda/layer_split.py share_profile does for a plan."""
    from engine.profile import ExpertProfile
    out = []
    for s in specs:
        keep = (profile.order[:, 0] >= s.first) & (profile.order[:, 0] < s.end)
        out.append(ExpertProfile(profile.n_layers, profile.n_expert, profile.order[keep].copy()))
    return out


def copy_after(dst, dst_device: int, dst_stream, src, src_device: int, src_stream, event, nbytes: int | None = None):
    """Copy src (on src_device) into dst (on dst_device) after everything enqueued on src_stream so far: `event` is
    recorded there and dst_stream waits on it, then copies (a peer copy across devices, a plain device copy on one).
    Later work on dst_stream runs after the copy."""
    import cupy as cp
    rt = cp.cuda.runtime
    nbytes = src.nbytes if nbytes is None else nbytes
    with cp.cuda.Device(src_device):
        event.record(src_stream)
    with cp.cuda.Device(dst_device):
        dst_stream.wait_event(event)
        if src_device != dst_device:
            rt.memcpyPeerAsync(dst.data.ptr, dst_device, src.data.ptr, src_device, nbytes, dst_stream.ptr)
        else:
            rt.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToDevice, dst_stream.ptr)


class Handoff:
    """The hidden state (or a chunk's rows of it) from one stage to the next: `send(src, rows)` orders the copy
    after everything enqueued on the sender's stream, into the next of two receive buffers on the receiver's device,
    and returns that buffer; the receiver's stream then runs after the copy. `src_stream` / `dst_stream`: the stages'
    streams (on their own devices)."""

    def __init__(self, src_device: int, dst_device: int, src_stream, dst_stream, shape, dtype):
        import cupy as cp
        self.cp = cp
        self.src_device, self.dst_device = int(src_device), int(dst_device)
        self.src_stream, self.dst_stream = src_stream, dst_stream
        self.peer = self.src_device != self.dst_device
        if self.peer:
            with cp.cuda.Device(self.dst_device):
                if cp.cuda.runtime.deviceCanAccessPeer(self.dst_device, self.src_device):
                    try:
                        cp.cuda.runtime.deviceEnablePeerAccess(self.src_device)
                    except cp.cuda.runtime.CUDARuntimeError as e:     # already enabled by another hand-off
                        if "PeerAccessAlreadyEnabled" not in str(e):
                            raise
        with cp.cuda.Device(self.src_device):
            self.sent = cp.cuda.Event(disable_timing=True)
        with cp.cuda.Device(self.dst_device):
            with dst_stream:
                self.bufs = [cp.empty(shape, dtype=dtype) for _ in range(2)]
            self.landed = [cp.cuda.Event(disable_timing=True) for _ in range(2)]
            for e in self.landed:
                e.record(dst_stream)
        self.turn = 0

    def send(self, src, rows: int | None = None):
        """Copy src (on the sender's device; its first `rows` rows, all when None) into the next receive buffer
        after the sender's stream's work; the receiver's stream waits for it. Returns the buffer (its first rows
        written)."""
        cp = self.cp
        dst = self.bufs[self.turn]
        n = src.shape[0] if rows is None else rows
        if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:] or n > dst.shape[0]:
            raise ValueError(f"hand-off of {n} rows of {src.shape[1:]} {src.dtype} into "
                             f"{dst.shape} {dst.dtype}")
        nbytes = n * (src.nbytes // max(src.shape[0], 1)) if src.ndim else src.nbytes
        # the buffer's previous contents have been read: the receiver's reads of it are on dst_stream, in order
        copy_after(dst, self.dst_device, self.dst_stream, src, self.src_device, self.src_stream, self.sent, nbytes)
        with cp.cuda.Device(self.dst_device):
            self.landed[self.turn].record(self.dst_stream)
        self.turn ^= 1
        return dst

    def wait_landed(self, src_stream=None) -> None:
        """Make the sender's stream wait until the receiver copied the last buffer sent, so the sender may
        overwrite its source (the next chunk) without racing the copy."""
        s = src_stream or self.src_stream
        with self.cp.cuda.Device(self.src_device):
            s.wait_event(self.landed[self.turn ^ 1])
