"""Kernel launch helpers shared by the decode step, the prompt pass, the prefetch and the tests: numpy scalar types
for kernel arguments, `ptr` for device arrays, `MappedInts` (a few int32 both host and kernels read and write), the
decode kernels' shared-memory rule, and `Launcher` (the mat-vec family, norms, FFN pieces)."""
from __future__ import annotations

import ctypes

import cupy as cp
import numpy as np

from engine.cuda.arena import HOST_ALLOC_MAPPED, HOST_ALLOC_PORTABLE, device_address

SMEM_DEFAULT = 48 * 1024     # dynamic shared memory a kernel gets without opting in
SMEM_MAX = 227 * 1024        # the most a block may opt in to (sm_80 / sm_90)


def staged_bytes(n: int) -> int:
    """Shared memory for n floats staged by common.cuh stage_x (Q4_K's padded layout: 4 floats per 64)."""
    return 4 * (n + 4 * (n // 64))


MOE_DOWN_TILE_ROWS = 8       # moe.cu moe_down_q6k: rows of every expert one block computes


def moe_down_tiled_bytes(k: int, n_ff: int, row_bytes: int) -> int:
    """moe.cu moe_down_q6k's dynamic shared memory: the k experts' tiles of MOE_DOWN_TILE_ROWS rows (rounded up to
    16 bytes), then h (k * n_ff floats)."""
    return (k * MOE_DOWN_TILE_ROWS * row_bytes + 15) // 16 * 16 + 4 * k * n_ff


def moe_down_tiled_fits(qt_name: str, n_embd: int, n_ff: int, k: int) -> bool:
    """Whether a layer's ffn_down takes moe_down_q6k: Q6_K, n_embd a multiple of the tile's rows (a tile never
    reads past its expert), k <= 32 (a lane per expert) and the tiles within the opt-in shared memory."""
    from engine.cuda.quant_types import qtype
    return (qt_name == "Q6_K" and n_embd % MOE_DOWN_TILE_ROWS == 0 and n_ff % 256 == 0 and 0 < k <= 32
            and moe_down_tiled_bytes(k, n_ff, qtype("Q6_K").row_bytes(n_ff)) <= SMEM_MAX)


U64, I64, I32, F32 = np.uint64, np.int64, np.int32, np.float32
NULL = U64(0)
MV_WARPS = 4           # rows per block in the mat-vec kernels (one warp each)
BIG_ROWS = 16384             # a mat-vec with more rows gives each warp several (one staging of x serves them)


def skipped(*args, **kwargs) -> None:
    """A launch a tracer filtered out (decode.py KindFilter)."""


def ptr(a) -> U64:
    return NULL if a is None else U64(a.data.ptr)


MV4_MAX = 4            # matrices one dense.cu mv4 launch computes


def shared_input_launches(Ws) -> list[list[int]]:
    """The launches of mv_many for matrices Ws that read one input: indices grouped by (quant type, width, row bytes)
    in order of first appearance, at most MV4_MAX a launch (mv4 has one quant type; llama-quantize's recipes give
    e.g. attn_qkv Q6_K and attn_gate Q4_K in some layers, which then take two launches)."""
    groups: dict[tuple[int, int, int], list[list[int]]] = {}
    for i, W in enumerate(Ws):
        if W is None:
            continue
        runs = groups.setdefault((int(W.qt), int(W.cols), int(W.row_bytes)), [[]])
        if len(runs[-1]) == MV4_MAX:
            runs.append([])
        runs[-1].append(i)
    return [g for runs in groups.values() for g in runs]


def plan_shared_input(Ws, mixed: bool = False) -> list[tuple[list[int], bool]]:
    """mv_many's launches: (matrix indices in launch order, two types?). shared_input_launches' groups; with mixed,
    two groups of one width whose one holds a single matrix and which hold at most MV4_MAX together become one
    mv4_mixed launch, that single matrix first (a Q4_K_M layer's attn_qkv or attn_v in Q6_K beside Q4_K)."""
    groups = shared_input_launches(Ws)
    if mixed and len(groups) == 2 and sum(map(len, groups)) <= MV4_MAX:
        a, b = sorted(groups, key=len)
        if len(a) == 1 and Ws[a[0]].cols == Ws[b[0]].cols:
            return [(a + b, True)]
    return [(g, False) for g in groups]


def mixed_pairs(projections, mixed: bool = True) -> set[tuple[int, int]]:
    """The (first matrix's, the others') quant type ids of the mv4_mixed launches that plan_shared_input makes for
    these lists of matrices (one list per layer)."""
    out = set()
    for Ws in projections:
        for order, two in plan_shared_input(Ws, mixed):
            if two:
                out.add((int(Ws[order[0]].qt), int(Ws[order[1]].qt)))
    return out


def load_mixed(table, pairs) -> None:
    """cuda_src/mv_mixed.cu's mv4_mixed for these type pairs, compiled now and added to the kernel table (so
    table("mv4_mixed", (qg, qu)) finds them, as the decode step's launches ask)."""
    if not pairs:
        return
    from engine.cuda import kernels as loader
    pairs = sorted(pairs)
    mod = loader.load("mv_mixed", qtypes=(), pairs=pairs)
    for qg, qu in pairs:
        table.register("mv4_mixed", (qg, qu), mod.get_function(f"mv4_mixed<{qg}, {qu}>"))


class MappedInts:
    """A few int32 in pinned host memory that kernels read and write through their device address."""

    def __init__(self, n: int):
        self.hptr = cp.cuda.runtime.hostAlloc(4 * n, HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED)
        self.dptr = U64(device_address(self.hptr))
        self.view = np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(self.hptr))
        self.view[:] = 0

    def close(self):
        if self.hptr:
            self.view = None
            cp.cuda.runtime.freeHost(self.hptr)
            self.hptr = 0


class Launcher:
    """Kernel launches shared by the decode step and the prompt pass (the mat-vec family, norms, FFN pieces)."""

    def __init__(self, kernels, cfg):
        self.kernels = kernels
        self.cfg = cfg

    # The decode mat-vecs read x from shared memory, staged once per block (common.cuh stage_x); given a norm
    # weight, the block stages rmsnorm(x) * norm itself, so no norm has a launch of its own.
    @staticmethod
    def smem(f, n: int, need: bool, optional_max: int = SMEM_DEFAULT) -> int:
        """Dynamic shared memory for staging n floats in kernel f (opted in above 48 KiB). Staging that is optional
        (x may also be read from global memory) is skipped, 0, above optional_max bytes."""
        nb = staged_bytes(n)
        if not need and nb > optional_max:
            return 0
        if nb > SMEM_MAX:
            raise ValueError(f"a {n}-float vector does not fit in shared memory ({nb} > {SMEM_MAX} bytes); "
                             f"this model's width is beyond the decode kernels")
        if nb > SMEM_DEFAULT and getattr(f, "max_dynamic_shared_size_bytes", 0) < nb:
            f.max_dynamic_shared_size_bytes = nb
        return nb

    def mv(self, W, x, y, bias=None, gate_logit=None, accumulate=False, tag="mv", norm=None):
        """y (+)= W @ xn; xn = rmsnorm(x) * norm when norm (a weight vector) is given, else x."""
        f = self.kernels("mv", W.qt, tag)
        sm = self.smem(f, W.cols, norm is not None)
        rpw = min(8, max(1, W.rows // BIG_ROWS))
        f(((W.rows + MV_WARPS * rpw - 1) // (MV_WARPS * rpw),), (32 * MV_WARPS,),
          (U64(W.ptr), I64(W.row_bytes), ptr(x), ptr(y), ptr(bias), ptr(gate_logit), I32(W.rows), I32(W.cols),
           I32(1 if accumulate else 0), ptr(norm), F32(self.cfg.rms_eps), I32(1 if sm else 0), I32(rpw)),
          shared_mem=sm)

    def mv3(self, Ws, x, ys, biases, norm=None):
        """Q, K and V (of rmsnorm(x) * norm) in one launch when they share a quant type and width, else three."""
        if len({(W.qt, W.cols, W.row_bytes) for W in Ws}) != 1:
            for W, y, b in zip(Ws, ys, biases):
                self.mv(W, x, y, bias=b, tag="qkv", norm=norm)
            return
        n = sum(W.rows for W in Ws)
        f = self.kernels("mv3", Ws[0].qt, "qkv")
        f(((n + MV_WARPS - 1) // MV_WARPS,), (32 * MV_WARPS,),
          (*(U64(W.ptr) for W in Ws), I64(Ws[0].row_bytes), ptr(x), ptr(norm), F32(self.cfg.rms_eps),
           *(ptr(y) for y in ys), *(ptr(b) for b in biases), *(I32(W.rows) for W in Ws), I32(Ws[0].cols)),
          shared_mem=self.smem(f, Ws[0].cols, True))

    def mv_many(self, Ws, x, ys, norm=None, conv=None, tag="mv4", mixed: bool = False):
        """ys[i] = Ws[i] @ xn for every i, xn = rmsnorm(x) * norm when given, in the launches of
        plan_shared_input(Ws, mixed): dense.cu mv4 for one quant type, mv_mixed.cu mv4_mixed for a matrix of another
        type beside them (mixed: the caller has loaded those kernels, load_mixed). conv = (conv_state, conv_w,
        d_conv): Ws[0] is a GDN layer's attn_qkv and ys[0] gets the conv of its outputs (the kernels' epilogue;
        conv_state shifts in place)."""
        if conv is not None and (conv[0].shape != (conv[2] - 1, Ws[0].rows) or conv[1].shape != (Ws[0].rows, conv[2])
                                 or not 2 <= conv[2] <= 32):
            raise ValueError(f"mv_many's conv: a state of shape {conv[0].shape} and taps {conv[1].shape} for "
                             f"{Ws[0].rows} channels of width {conv[2]}; want ({conv[2] - 1}, channels) and "
                             f"(channels, {conv[2]}), a width of 2 to 32")
        for order, two_types in plan_shared_input(Ws, mixed):
            mats, outs = [Ws[i] for i in order], [ys[i] for i in order]
            pad = MV4_MAX - len(order)
            conv_m = order.index(0) if conv is not None and 0 in order else -1
            state, taps, d_conv = conv if conv_m >= 0 else (None, None, 0)
            W0 = mats[0]
            if two_types:
                f = self.kernels("mv4_mixed", (W0.qt, mats[1].qt), tag)
                rest = sum(W.rows for W in mats[1:])
                grid = (W0.rows + MV_WARPS - 1) // MV_WARPS + (rest + MV_WARPS - 1) // MV_WARPS
                strides = (I64(W0.row_bytes), I64(mats[1].row_bytes))
            else:
                f = self.kernels("mv4", W0.qt, tag)
                grid = (sum(W.rows for W in mats) + MV_WARPS - 1) // MV_WARPS
                strides = (I64(W0.row_bytes),)
            f((grid,), (32 * MV_WARPS,),
              (*(U64(W.ptr) for W in mats), *(NULL,) * pad, *strides, ptr(x), ptr(norm), F32(self.cfg.rms_eps),
               *(ptr(y) for y in outs), *(NULL,) * pad, *(I32(W.rows) for W in mats), *(I32(0),) * pad,
               I32(W0.cols), ptr(state), ptr(taps), I32(d_conv), I32(conv_m)),
              shared_mem=self.smem(f, W0.cols, True))

    def mv_gated(self, W, x, gate, y, tag="wo"):
        """y += W @ (x * sigmoid(gate)): a gated attention's output projection with its query gate (dense.cu)."""
        f = self.kernels("mv_gated", W.qt, tag)
        f(((W.rows + MV_WARPS - 1) // MV_WARPS,), (32 * MV_WARPS,),
          (U64(W.ptr), I64(W.row_bytes), ptr(x), ptr(gate), ptr(y), I32(W.rows), I32(W.cols)),
          shared_mem=self.smem(f, W.cols, True))

    def swiglu(self, Wg, Wu, x, h, norm=None, tag="swiglu_mv"):
        """h = silu(Wg @ xn) * (Wu @ xn), xn = rmsnorm(x) * norm when given."""
        f = self.kernels("swiglu_mv", Wg.qt, tag)
        f(((Wg.rows + MV_WARPS - 1) // MV_WARPS,), (32 * MV_WARPS,),
          (U64(Wg.ptr), U64(Wu.ptr), I64(Wg.row_bytes), ptr(x), ptr(norm), F32(self.cfg.rms_eps), ptr(h),
           I32(Wg.rows), I32(Wg.cols)),
          shared_mem=self.smem(f, Wg.cols, True))

    def output_logits(self, w, x, y):
        """y = the output head on rmsnorm(x) * output_norm: a token's logits from its final residual x (one row)."""
        self.mv(w.output, x, y, tag="output", norm=w.output_norm)

    def rmsnorm(self, x, w, out, rows=1):
        self.kernels("rmsnorm")((rows,), (256,), (ptr(x), ptr(w), ptr(out), I32(w.size), F32(self.cfg.rms_eps)))
