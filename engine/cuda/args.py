"""The CUDA backend's options: `CudaOptions` (every setting, typed, its default here and nowhere else) and the worker
flags that fill it (added to strata_worker.py's parser; importing this needs no CuPy).

A user sets the flags of add_cuda_args. The switches that exist for A/B runs and tuning go through one flag,
`--tune KEY=VALUE` (repeatable), whose keys are TUNING's: CudaOptions fields like the others, so tests and benches
set them by name."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from engine.cpu_share import CPU_SHARE_TUNE


@dataclass
class CudaOptions:
    # --- what a user sets ---------------------------------------------------------------------------------------
    vram_reserve_mib: int = 700             # VRAM left free for the driver and other programs
    vram_budget_mib: int | None = None      # the most VRAM the worker takes in all (None: all free VRAM)
    expert_slots: int | None = None         # at most this many experts cached in VRAM (None: what the budget holds)
    mmap_experts: bool = False              # memory modes (engine/cuda/memory_mode.py)
    resident_budget_gib: float | None = None
    expert_profile: str | None = None
    expert_profile_save: str | None = None
    expert_profile_save_every: float = 10.0     # minutes; 0: at QUIT only
    kv: str = "f16"                         # "int8": engine/cuda/kv.py's int8 layout (one scale per 32 values)
    prefill_chunk: int | None = None        # prompt tokens per chunk (None: the largest that fits, 1024 and up)
    no_graph: bool = False                  # decode kernel by kernel instead of replaying the graph (debugging)
    calibrate: bool = False                 # measure the PCIe copy rate at start (INFO pcie_gbps)
    gpus: tuple | str | None = None         # --gpus: device indices or "auto" (every one CUDA shows); None: device 0
    layer_split: tuple | str | None = None  # --layer-split: layers per GPU, or "auto" (engine/cuda/layer_split.py)
    show_split: bool = False                # print the split's plan and exit (a dry run)
    # --- tuning (--tune KEY=VALUE): measured defaults, docs/design.md "Decode" and "The prompt pass" ---------------
    prefetch: bool | None = None            # next-layer expert prefetch; None: on below 95% of the experts in VRAM
    prefetch_depth: int = 2                 # predict the layer after next (2) or the next one (1)
    fetch_misses: bool = True               # the prefetch also copies each layer's late misses into VRAM
    embed_host: bool | None = None          # token embedding in pinned host memory; None: when that buys slots
    adapt_every: int = 32                   # decode tokens between rounds of the adaptive expert tier (0: off)
    ring: int | None = None                 # the prompt pass's own ring slots (None: borrow expert-cache slots)
    stream_min: int = 1024                  # chunks of at least this many tokens stream experts through the ring
    pipeline: bool = True                   # launch the next decode step before reading this one's pick
    # the CPU's share of a decode layer's VRAM misses (engine/cpu_share.py ShareRule): None = auto (the cost model,
    # from the two rates below; without a measured CPU rate, none), 0 = off, else that share; the rates are what
    # --calibrate measured (setup writes them into the config's args)
    cpu_share: float | None = None
    cpu_gbps: float | None = None           # CPU experts' GB/s of expert bytes at cpu_threads
    link_gbps: float | None = None          # the host-to-device link's GB/s (None: the start's own pcie_gbps)
    cpu_threads: int | None = None          # CPU expert threads (None: every core but the decode loop's)
    windows: bool = True                    # a verify window as one step of window kernels (off: a step a token)
    # --- tests only ---------------------------------------------------------------------------------------------
    staging_slots: int | None = None        # memory modes: staging LRU slots (None: sized from the model)

    @classmethod
    def from_args(cls, args) -> "CudaOptions":
        """The flags the worker parsed (add_cuda_args), --tune's pairs among them."""
        kw = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        kw.update(getattr(args, "tune", None) or {})
        return cls(**kw)


def _at_least(lo: int, what: str = "a whole number"):
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            n = lo - 1
        if n < lo:
            raise argparse.ArgumentTypeError(f"expected {what} >= {lo}, got {v!r}")
        return n
    return parse


def _switch(v: str) -> bool:
    if v not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {v!r}")
    return v == "on"


def _auto_switch(v: str) -> bool | None:
    return None if v == "auto" else _switch(v)


def _depth(v: str) -> int:
    if v not in ("1", "2"):
        raise argparse.ArgumentTypeError(f"expected 1 or 2, got {v!r}")
    return int(v)


def _chunk(v: str) -> int | None:
    if v == "auto":
        return None
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--prefill-chunk takes a number of tokens (>= 1) or auto, got {v!r}")
    return n


def _rate(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        x = -1.0
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a rate in GB/s (> 0), got {v!r}")
    return x


def _gib(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        x = -1.0
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"--resident-budget-gib takes a size in GiB (>= 0), got {v!r}")
    return x


def _gpus(v: str) -> tuple | str:
    """--gpus auto | I[,J...]: device indices >= 0; one listed more than once runs several stages on that GPU (the
    test mode, --gpus 0,0), never beside another GPU."""
    if v == "auto":
        return v
    try:
        ids = tuple(int(x) for x in v.split(","))
    except ValueError:
        ids = ()
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"--gpus takes auto or GPU indices such as 0,1; got {v!r}")
    if len(set(ids)) != len(ids) and len(set(ids)) > 1:
        raise argparse.ArgumentTypeError(f"--gpus {v} names a GPU twice beside another: several stages on one GPU "
                                         f"(the test mode) name only that GPU, e.g. --gpus {ids[0]},{ids[0]}")
    return ids


def _layer_split(v: str) -> tuple | str:
    """--layer-split auto | N[,M...]: layers per GPU, each >= 1."""
    if v == "auto":
        return v
    try:
        counts = tuple(int(x) for x in v.split(","))
    except ValueError:
        counts = ()
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"--layer-split takes auto or layer counts >= 1 a GPU such as 24,24; "
                                         f"got {v!r}")
    return counts


# --tune's keys: (parser of the value, what it does)
TUNING = {
    "prefetch": (_auto_switch, "auto|on|off: decode predicts each next layer's experts and copies the ones not in "
                               "VRAM ahead of use (auto: while fewer than 95% of the experts fit in VRAM, for "
                               "experts of at most 8 MiB)"),
    "prefetch_depth": (_depth, "1|2: the prefetch predicts the next layer (1) or the one after it (2, default)"),
    "fetch_misses": (_switch, "on|off: the prefetch also copies each layer's routed experts it did not predict into "
                              "VRAM before the layer's expert kernels (default on)"),
    "embed_host": (_auto_switch, "auto|on|off: the token embedding in pinned host memory, read over PCIe, so its "
                                 "VRAM holds expert slots (auto: when that buys slots; never when tied to the head)"),
    "adapt_every": (_at_least(0), "N: decode tokens between rounds of the adaptive expert tier (default 32; 0 = off)"),
    "ring": (_at_least(2), "N: the prompt pass's own expert ring slots (default: borrow the coldest cache slots)"),
    "stream_min": (_at_least(1), "N: prompt chunks of at least N tokens stream experts through the ring; shorter "
                                 "ones read them in place (default 1024)"),
    "pipeline": (_switch, "on|off: decode launches the next step, fed on the GPU by this step's pick, before the "
                          "host reads and prints the pick; not with a grammar, logprobs, drafts or the memory modes, "
                          "nor at a request's last token (default on)"),
    "cpu_share": CPU_SHARE_TUNE,
    "cpu_gbps": (_rate, "GB/s: the CPU experts' measured rate (--calibrate's cpu_gbps), cpu_share=auto's input"),
    "link_gbps": (_rate, "GB/s: the link's measured rate for cpu_share=auto (default: the start's own pcie_gbps)"),
    "cpu_threads": (_at_least(1), "N: threads computing CPU experts (default: every core but one)"),
    "windows": (_switch, "on|off: a speculative verify window runs as one step of window kernels, each weight and "
                         "expert read once for its tokens (engine/cuda/decode_window.py; default on), or one step a "
                         "token"),
}


class _Tune(argparse.Action):
    """--tune KEY=VALUE, repeatable, into a dict {field: typed value}."""

    def __call__(self, parser, namespace, value, option_string=None):
        key, eq, raw = value.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in TUNING:
            parser.error(f"--tune takes KEY=VALUE with KEY one of {', '.join(TUNING)}; got {value!r}")
        try:
            typed = TUNING[key][0](raw.strip())
        except argparse.ArgumentTypeError as e:
            parser.error(f"--tune {key}: {e}")
        tune = dict(getattr(namespace, self.dest, None) or {})
        tune[key] = typed
        setattr(namespace, self.dest, tune)


def check_cuda_args(args) -> str | None:
    """A one-line message for a flag combination the CUDA backend cannot run, else None."""
    tune = getattr(args, "tune", None) or {}
    if tune.get("fetch_misses") is True and tune.get("prefetch") is False:
        return ("--tune fetch_misses=on is part of the decode prefetch: drop --tune prefetch=off "
                "(or --tune fetch_misses=on)")
    return check_split_args(getattr(args, "gpus", None), getattr(args, "layer_split", None))


def check_split_args(gpus, split) -> str | None:
    """--gpus and --layer-split together: a one-line message for a combination that names no split, else None.
    (Counts against the model's layers and indices against the PC's GPUs are checked once those are known.)"""
    if not isinstance(split, tuple):
        return None
    shown = ",".join(str(n) for n in split)
    if len(split) == 1:
        return (f"--layer-split {shown} gives every layer to one GPU: a split takes one count a GPU, two or more "
                f"(with --gpus naming as many), or auto")
    if gpus is None:
        return f"--layer-split {shown} needs --gpus naming its {len(split)} GPUs (e.g. --gpus " \
               f"{','.join(str(i) for i in range(len(split)))})"
    if isinstance(gpus, tuple) and len(gpus) != len(split):
        return (f"--layer-split {shown} gives {len(split)} stages and --gpus {','.join(map(str, gpus))} names "
                f"{len(gpus)} GPU(s): give one count a GPU")
    return None


def add_cuda_args(parser) -> None:
    g = parser
    g.add_argument("--vram-reserve-mib", type=int, default=None, metavar="MIB",
                   help="VRAM left free for the driver and other programs (default 700)")
    g.add_argument("--vram-budget-mib", type=int, default=None, metavar="MIB",
                   help="the most VRAM this worker takes in all (emulates a smaller card; default: all free VRAM)")
    g.add_argument("--expert-slots", type=int, default=None, metavar="N",
                   help="at most N experts cached in VRAM (default: as many as the VRAM budget holds)")
    mem = g.add_mutually_exclusive_group()
    mem.add_argument("--mmap-experts", action="store_true", default=None,
                     help="pin no experts: read them from the memory-mapped GGUF (the OS file cache) through a small "
                          "pinned staging ring, for PCs whose RAM cannot hold them (slowest)")
    mem.add_argument("--resident-budget-gib", type=_gib, default=None, metavar="GIB",
                     help="pin only the hottest GIB of experts (by --expert-profile, else by router-row norm); the "
                          "rest are read from the GGUF through a pinned staging ring")
    g.add_argument("--expert-profile", default=None, metavar="P",
                   help="fill the VRAM expert cache in this profile's order (.bin, docs/design.md \"Files\")")
    g.add_argument("--expert-profile-save", default=None, metavar="P",
                   help="write the learned expert profile here at QUIT and every --expert-profile-save-every minutes")
    g.add_argument("--expert-profile-save-every", type=float, default=None, metavar="MIN",
                   help="minutes between profile saves (default 10; 0 = at QUIT only)")
    g.add_argument("--kv", choices=("f16", "int8"), default=None,
                   help="KV cache format: f16 (default) or int8 (one scale per 32 values; 56%% of the VRAM, so about "
                        "1.8x the context fits)")
    g.add_argument("--prefill-chunk", type=_chunk, default=None, metavar="N|auto",
                   help="prompt pass: tokens per chunk (default auto: the largest that fits, 1024 and up)")
    g.add_argument("--no-graph", action="store_true", default=None,
                   help="launch the decode step kernel by kernel instead of replaying a CUDA graph (debugging)")
    g.add_argument("--calibrate", action="store_true", default=None,
                   help="measure the PCIe copy rate at start and report it in INFO (pcie_gbps)")
    g.add_argument("--calibrate-chats", default=None, metavar="FILE",
                   help="with --calibrate: a JSON list of prompts (lists of token ids, typical chats) decoded after "
                        "the timing, so the adaptive tier learns the routing; --expert-profile-save keeps it")
    g.add_argument("--gpus", type=_gpus, default=None, metavar="auto|I,J",
                   help="the GPUs this worker uses, by CUDA index (auto: every GPU CUDA shows; default: GPU 0); "
                        "several split the layers (--layer-split), which runs only as stages on one GPU (a test "
                        "mode: --gpus 0,0) for now")
    g.add_argument("--layer-split", type=_layer_split, default=None, metavar="auto|N,M",
                   help="layers per GPU of --gpus, in order (auto: from each GPU's free VRAM and measured link "
                        "rate, balancing the step time; engine/cuda/layer_split.py)")
    g.add_argument("--show-split", action="store_true", default=None,
                   help="print the layer split's plan for --gpus (stages, caches, predicted step time) and exit")
    g.add_argument("--tune", action=_Tune, default=None, metavar="KEY=VALUE",
                   help="tuning and A/B switches, repeatable: " + "; ".join(f"{k}={d}" for k, (_, d) in TUNING.items())
                   .replace("%", "%%"))
