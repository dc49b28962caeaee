"""Which of a layer's VRAM misses the CPU computes instead of the link carrying them: the cost model and the rule.

A decode layer's routed experts that have no VRAM slot are read over PCIe in place by the expert kernels, one
after the other with the layer's GPU work (docs/experiments.md: "a step is its compute plus its misses read in
place at ~50 GB/s"); those the prefetch already staged cost nothing more. Each unstaged miss the CPU computes
instead (engine/cpu_expert_pool.py) leaves the link, and the CPU works beside the GPU from the router on, its
result joining before the layer's combine. With n unstaged misses of b bytes each, c of them on the CPU:

    gpu(c) = gpu_us + link_busy_us + (n - c) * b / link          the GPU's expert phase, link reads included
                                                                  (with the prefetch, max(gpu_us, link part))
    cpu(c) = overhead_us + c * b / cpu          (c > 0)          the pool's hand-over and join, then its bytes
    layer(c) = max(gpu(c), cpu(c))

split_layer takes the c in 0..n with the smallest layer(c) (ties: the fewer on the CPU). Without fixed costs the
optimum balances the two rates: a share link / (link + cpu) over the link. The original Strata's rule,
original_link_share: link share = 0.55 * min(1, link GB/s / 20), whatever the CPU: it is that balance for a CPU of
~41 GB/s beside a 50 GB/s link (its machine) and nothing else, so a slow CPU still gets 45% of the misses and makes
the layer slower than the link alone. The rule here uses the measured rates and the fixed cost instead, so it sends
nothing to a slow CPU and nearly everything away from a slow link (tests/test_cpu_share.py, the hand-made cases).

`--tune cpu_share=auto|off|F` (parse_cpu_share): auto is split_layer's choice, off none, F the share F of each
layer's unstaged misses (rounded) whatever the rates. ShareRule.from_options makes the rule of a worker's options
(engine/cuda/args.py CudaOptions: cpu_share and the measured cpu_gbps / link_gbps, which --calibrate writes:
engine/cpu_calibrate.py); typical_split is what calibration shows for a typical layer.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

# The pool's hand-over and join a layer: one queue put, the worker's wake-up and numba's parallel launch, the
# result's flag. Not measured on the GPU host yet (bench.cpu_experts times calls, not the hand-over); 30 us is
# the order a thread wake-up plus an OpenMP fork-join takes, about half a Qwen3-30B layer's 65 us of GPU compute.
CPU_OVERHEAD_US = 30.0
ORIGINAL_BASE = 0.55       # the original Strata's pcie_frac base, and the link rate it was scaled against
ORIGINAL_FULL_GBPS = 20.0


@dataclass(frozen=True)
class Rates:
    link_gbps: float                    # missed experts read in place over PCIe (H200: ~50; PCIe 4 x16: ~25)
    cpu_gbps: float                     # CPU experts' GB/s of expert bytes at the pool's threads (0: no CPU)
    cpu_overhead_us: float = CPU_OVERHEAD_US

    def __post_init__(self):
        if not self.link_gbps > 0:
            raise ValueError(f"the link rate must be above 0 GB/s, not {self.link_gbps}")
        if not self.cpu_gbps >= 0 or not self.cpu_overhead_us >= 0:
            raise ValueError(f"the CPU rate and overhead must be at least 0, not {self.cpu_gbps}, "
                             f"{self.cpu_overhead_us}")


@dataclass(frozen=True)
class LayerSplit:
    cpu: tuple[int, ...]        # experts the CPU computes
    link: tuple[int, ...]       # unstaged misses the link carries
    gpu_us: float               # the GPU's expert phase with this split
    cpu_us: float               # the CPU's (0 when it computes none)

    @property
    def us(self) -> float:
        """The layer's expert phase: the later of the two."""
        return max(self.gpu_us, self.cpu_us)


def layer_times(n: int, c: int, expert_bytes: float, rates: Rates, gpu_us: float = 0.0, link_busy_us: float = 0.0,
                overlapped: bool = False, cpu_bytes: float | None = None) -> tuple[float, float]:
    """(gpu(c), cpu(c)) in microseconds for n unstaged misses of expert_bytes each, c of them on the CPU.

    overlapped: the link's reads run beside the GPU's work (the prefetch's copies) instead of after it, so the GPU
    side is the longer of the two; cpu_bytes: what the CPU reads an expert, when the link carries more (a
    prefetch's wrong guesses counted into expert_bytes)."""
    link = link_busy_us + (n - c) * expert_bytes / (rates.link_gbps * 1e3)      # bytes / (GB/s) in us
    gpu = max(gpu_us, link) if overlapped else gpu_us + link
    if c == 0:
        return gpu, 0.0
    if rates.cpu_gbps <= 0:
        return gpu, float("inf")
    b = expert_bytes if cpu_bytes is None else cpu_bytes
    return gpu, rates.cpu_overhead_us + c * b / (rates.cpu_gbps * 1e3)


def best_count(n: int, expert_bytes: float, rates: Rates, gpu_us: float = 0.0, link_busy_us: float = 0.0,
               overlapped: bool = False, cpu_bytes: float | None = None) -> int:
    """The number of unstaged misses to compute on the CPU: the smallest c with the least max(gpu(c), cpu(c))."""
    cost = [max(layer_times(n, c, expert_bytes, rates, gpu_us, link_busy_us, overlapped, cpu_bytes))
            for c in range(n + 1)]
    return min(range(n + 1), key=lambda c: (cost[c], c))


def split_layer(missing, staged, expert_bytes: float, rates: Rates, gpu_us: float = 0.0, link_busy_us: float = 0.0,
                share: float | None = None, overlapped: bool = False, cpu_bytes: float | None = None) -> LayerSplit:
    """Split a layer's misses (routed experts without a VRAM slot, in the caller's order) between the CPU and the
    link. staged: those the prefetch already copied (neither moves). share: None for the cost model's choice, else
    the fixed share of the unstaged misses the CPU takes (0 = off). The CPU takes the last ones of the order.
    gpu_us, link_busy_us, overlapped, cpu_bytes: as layer_times."""
    staged = set(int(e) for e in staged)
    todo = [int(e) for e in missing if int(e) not in staged]
    n = len(todo)
    if share is None:
        c = best_count(n, expert_bytes, rates, gpu_us, link_busy_us, overlapped, cpu_bytes)
    else:
        c = min(n, max(0, int(share * n + 0.5)))
    gpu, cpu = layer_times(n, c, expert_bytes, rates, gpu_us, link_busy_us, overlapped, cpu_bytes)
    return LayerSplit(tuple(todo[n - c:]), tuple(todo[:n - c]), gpu, cpu)


def original_link_share(link_gbps: float, base: float = ORIGINAL_BASE) -> float:
    """The original Strata's pcie_frac: the share of misses sent over PCIe (the rest to the CPU)."""
    return base * min(1.0, link_gbps / ORIGINAL_FULL_GBPS)


# --- --tune cpu_share=auto|off|F ----------------------------------------------------------------------------------

CPU_SHARE_HELP = ("auto|off|F: the share of each decode layer's unstaged VRAM misses computed on the CPU instead of "
                  "read over PCIe (auto: the cost model's choice from the link's and the CPU's measured rates; off: "
                  "none; F in 0..1: that share, rounded)")


def parse_cpu_share(v: str) -> float | None:
    """None for auto, 0.0 for off, else the share F in [0, 1]; argparse.ArgumentTypeError says what is wrong."""
    v = v.strip().lower()
    if v == "auto":
        return None
    if v == "off":
        return 0.0
    try:
        f = float(v)
    except ValueError:
        f = -1.0
    if not 0.0 <= f <= 1.0:
        raise argparse.ArgumentTypeError(f"cpu_share takes auto, off or a share from 0 to 1 (e.g. 0.3), got {v!r}")
    return f


CPU_SHARE_TUNE = (parse_cpu_share, CPU_SHARE_HELP)      # engine/cuda/args.py TUNING's entry for cpu_share


# --- the rule the decode step asks, from CudaOptions ------------------------------------------------------------

@dataclass(frozen=True)
class ShareRule:
    """What `--tune cpu_share` and the measured rates make of a layer's misses: share None (auto) is split_layer's
    cost model on `rates`, a number that fixed share; rates None (no measured CPU rate) leaves every miss to the
    link, whatever the share, since the CPU's cost is unknown."""
    share: float | None
    rates: Rates | None
    why: str

    @classmethod
    def from_options(cls, opts, pcie_gbps: float | None = None) -> "ShareRule":
        """opts: engine.cuda.args.CudaOptions (cpu_share, cpu_gbps, link_gbps); pcie_gbps: the link rate measured
        at start, used when opts.link_gbps is None."""
        share = opts.cpu_share
        link = opts.link_gbps if opts.link_gbps is not None else pcie_gbps
        if share == 0.0:
            return cls(0.0, None, "cpu_share=off")
        if not opts.cpu_gbps:
            return cls(0.0, None, "no CPU expert rate measured (--calibrate, or --tune cpu_gbps=): the link takes "
                                  "every miss")
        if share is None and not link:
            return cls(0.0, None, "cpu_share=auto needs the link's rate (--calibrate, or --tune link_gbps=): the "
                                  "link takes every miss")
        rates = Rates(link if link else 1.0, opts.cpu_gbps)     # a fixed share never reads the link rate
        said = "auto" if share is None else f"{share:g}"
        return cls(share, rates, f"cpu_share={said}: CPU {opts.cpu_gbps:g} GB/s" +
                   (f", link {link:g} GB/s" if link else ""))

    def split(self, missing, staged, expert_bytes: float, **kw) -> LayerSplit:
        """split_layer with this rule's share and rates (kw: gpu_us, link_busy_us, overlapped, cpu_bytes)."""
        if self.rates is None:
            return split_layer(missing, staged, expert_bytes, Rates(1.0, 0.0), share=0.0, **kw)
        return split_layer(missing, staged, expert_bytes, self.rates, share=self.share, **kw)


def typical_split(rates: Rates, expert_bytes: float, k: int, hit_rate: float) -> tuple[int, int]:
    """(experts on the CPU, unstaged misses) split_layer chooses for a layer of k routed experts of which a share
    hit_rate is in VRAM (no prefetch, no GPU time counted: the link alone beside the CPU): what calibration shows as
    its chosen split."""
    if not 0 <= hit_rate <= 1 or k < 1:
        raise ValueError(f"a hit rate in 0..1 and k >= 1, not {hit_rate}, {k}")
    n = max(1, int(round(k * (1 - hit_rate)))) if hit_rate < 1 else 0
    return best_count(n, expert_bytes, rates), n
