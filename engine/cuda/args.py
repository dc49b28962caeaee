"""The CUDA backend's command-line flags (added to strata_worker.py's parser; importing this needs no CuPy)."""
from __future__ import annotations

import argparse


def _chunk(v: str):
    if v == "auto":
        return v
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--prefill-chunk takes a number of tokens (>= 1) or auto, got {v!r}")
    return n


def _at_least(lo: int):
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            n = lo - 1
        if n < lo:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {lo}, got {v!r}")
        return n
    return parse


def _gib(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        x = -1.0
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"--resident-budget-gib takes a size in GiB (>= 0), got {v!r}")
    return x


def check_cuda_args(args) -> str | None:
    """A one-line message for a flag combination the CUDA backend cannot run, else None."""
    if getattr(args, "fetch_misses", None) == "on" and getattr(args, "prefetch", None) == "off":
        return "--fetch-misses on is part of the decode prefetch: drop --prefetch off (or --fetch-misses on)"
    return None


def add_cuda_args(parser) -> None:
    g = parser
    g.add_argument("--vram-reserve-mib", type=int, default=700, metavar="MIB",
                   help="VRAM left free for the driver and other programs (default 700)")
    g.add_argument("--vram-budget-mib", type=int, default=None, metavar="MIB",
                   help="the most VRAM this worker takes in all (emulates a smaller card; default: all free VRAM)")
    g.add_argument("--expert-slots", type=int, default=None, metavar="N",
                   help="at most N experts cached in VRAM (default: as many as the VRAM budget holds)")
    mem = g.add_mutually_exclusive_group()
    mem.add_argument("--mmap-experts", action="store_true",
                     help="pin no experts: read them from the memory-mapped GGUF (the OS file cache) through a small "
                          "pinned staging ring, for PCs whose RAM cannot hold them (slowest)")
    mem.add_argument("--resident-budget-gib", type=_gib, default=None, metavar="GIB",
                     help="pin only the hottest GIB of experts (by --expert-profile, else by router-row norm); the "
                          "rest are read from the GGUF through a pinned staging ring")
    g.add_argument("--expert-profile", default=None, metavar="P",
                   help="fill the VRAM expert cache in this profile's order (.bin, DESIGN §6)")
    g.add_argument("--expert-profile-save", default=None, metavar="P",
                   help="write the learned expert profile here at QUIT and every --expert-profile-save-every minutes")
    g.add_argument("--expert-profile-save-every", type=float, default=10.0, metavar="MIN",
                   help="minutes between profile saves (default 10; 0 = at QUIT only)")
    g.add_argument("--adapt-every", type=int, default=32, metavar="N",
                   help="decode tokens between rounds of the adaptive expert tier (default 32; 0 = off)")
    g.add_argument("--prefetch", choices=("on", "off"), default=None,
                   help="decode: predict each next layer's experts from the current layer's FFN input and copy the "
                        "ones not in VRAM ahead of use, overlapping PCIe with compute (default: on while fewer than 95%% "
                        "of the experts fit in VRAM; above that the few others are faster read in place)")
    g.add_argument("--prefetch-depth", type=int, choices=(1, 2), default=None, metavar="1|2",
                   help="decode prefetch: predict the next layer's experts (1) or the one after it (2, default: each "
                        "copy has two layers of compute to hide in, the guess is less accurate; 3 staging banks)")
    g.add_argument("--fetch-misses", choices=("on", "off"), default=None,
                   help="decode prefetch: copy each layer's routed experts that are neither cached nor prefetched "
                        "into VRAM with one fast copy before its expert kernels, instead of letting them read those in "
                        "place over PCIe (default on; off: A/B)")
    g.add_argument("--embed-host", choices=("auto", "on", "off"), default=None,
                   help="keep the token embedding in pinned host memory, read in place over PCIe (one row a token), "
                        "so its VRAM holds expert-cache slots: auto (default) when not every expert fits in VRAM and "
                        "that buys slots; on / off (A/B). Never when it is tied to the output head")
    g.add_argument("--no-graph", action="store_true",
                   help="launch the decode step kernel by kernel instead of replaying a CUDA graph (debugging)")
    g.add_argument("--calibrate", action="store_true",
                   help="measure PCIe and HBM bandwidth at start and report them in INFO (pcie_gbps, hbm_gbps)")
    g.add_argument("--kv", choices=("f16", "int8"), default=None,
                   help="KV cache format: f16 (default) or int8 (one scale per 32 values; 56%% of the VRAM, so about "
                        "1.8x the context fits)")
    g.add_argument("--prefill-chunk", type=_chunk, default=None, metavar="N|auto",
                   help="prompt pass: tokens per chunk (default auto: the largest that fits, 1024 and up)")
    g.add_argument("--ring", type=_at_least(2), default=None, metavar="N",
                   help="prompt pass: N expert ring slots of its own (default: whatever VRAM the chunk "
                        "leaves, plus up to two layers' worth of streamed experts (64..384) borrowed from the coldest "
                        "expert-cache slots for the prompt and refilled at the first decode step)")
    g.add_argument("--stream-min", type=_at_least(1), default=None, metavar="N",
                   help="prompt pass: chunks of at least N tokens stream experts through the ring; shorter "
                        "ones read them in place (default 1024)")
