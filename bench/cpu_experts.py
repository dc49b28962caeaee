"""CPU experts: GB/s of expert bytes per thread count, beside this machine's plain-read ceiling measured the same way.

    python -m bench.cpu_experts [--preset qwen3-30b-a3b] [--types Q4_K,Q4_K,Q6_K] [--threads 1,2,4,8,16]
    python -m bench.cpu_experts --preset gpt-oss-120b --ggml      # + llama.cpp's own CPU expert arithmetic
    python -m bench.cpu_experts --row-dots Q4_K,Q6_K,MXFP4 [--ggml] # one thread's row dots from cache, per type

One call is one token's routed experts of one layer (--experts, default the preset's top k), a fresh random choice
from a pool of blobs in the pinned arena's layout (--pool-gib, larger than the caches) every call, as a decode
step's misses are. The ceiling is a numba loop summing every 8-byte word of another random choice of as many blobs
with the same threads, run between the kernel's calls so both see the same machine (it is shared: the table prints
medians and bests). --ggml times llama.cpp's CPU path on the same blobs (the anchor wheel's libggml-cpu: each row's
vec_dot against x rounded to 8 bits, as llama.cpp's CPU experts run) and prints how far both are from exact
arithmetic (float64 over the dequantized weights).
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np

from engine import cpu_experts as ce

GB = 1e9


def _qtype(name: str) -> int:
    from gguf import GGMLQuantizationType as Q
    extra = {"Q1_0": 41, "Q2_0": 42}
    if name.upper() in extra:
        return extra[name.upper()]
    try:
        return int(Q[name.upper()])
    except KeyError:
        raise SystemExit(f"bench.cpu_experts: unknown quant type {name!r}") from None


def preset_shape(name: str) -> tuple[int, int, int, tuple[int, int, int], str]:
    """(n_embd, n_ff, k, (gate, up, down) types, activation) of a make_moe preset's experts."""
    from tools import make_moe as mm
    if name not in mm.PRESETS:
        raise SystemExit(f"bench.cpu_experts: no preset {name!r}; one of {', '.join(sorted(mm.PRESETS))}")
    args = mm.parse_args(["--preset", name])
    s = mm.resolve_shape(args)
    qt = int(args.experts)
    return s.n_embd, s.n_ff_exp, s.n_expert_used, (qt, qt, qt), "swiglu_oai" if s.arch == "gpt-oss" else "swiglu"


def random_expert(rng, types, n_ff: int, n_embd: int, gate_only: bool = False) -> list[np.ndarray]:
    """gate, up, down rows of one expert with valid blocks (tools.make_moe's, unit-RMS outputs); gate_only: gate's."""
    from tools import make_moe as mm
    out = []
    shapes = list(zip(types, (n_ff, n_ff, n_embd), (n_embd, n_embd, n_ff)))
    for qt, rows, cols in shapes[:1] if gate_only else shapes:
        made = [t for t in mm.SUPPORTED_TYPES if int(t) == qt]      # make_moe's enum member (gguf's or engine's)
        if made:
            out.append(mm.random_rows(rng, made[0], rows, cols, 1.0 / np.sqrt(cols)))
        else:                               # a type make_moe cannot make here: random bytes, sane fp16 scales
            raw = rng.integers(0, 256, (rows, ce.row_bytes(qt, cols)), dtype=np.uint8)
            blocks = raw.reshape(-1, ce.QUANT_BLOCKS[qt][1])
            blocks[:, :2] = np.float16(0.01 / np.sqrt(cols)).reshape(1).view(np.uint8)
            out.append(raw)
    return out


class Pool:
    """n blobs (gate | up | down, 256-byte stride) filled from a few distinct random experts."""

    def __init__(self, types, n_ff: int, n_embd: int, gib: float, seed: int = 0, distinct: int = 8):
        rng = np.random.default_rng(seed)
        self.types = ce.LayerTypes.of(*types, n_ff, n_embd)
        self.n_ff, self.n_embd = n_ff, n_embd
        self.nbytes = self.types.expert_bytes(n_ff, n_embd)
        self.stride = (self.nbytes + ce.BLOB_ALIGN - 1) // ce.BLOB_ALIGN * ce.BLOB_ALIGN
        self.n = max(distinct, int(gib * 2**30 // self.stride))
        self.buf = np.empty(self.n * self.stride + ce.BLOB_ALIGN, np.uint8)
        self.base = self.buf.ctypes.data + (-self.buf.ctypes.data) % ce.BLOB_ALIGN
        view = np.ctypeslib.as_array((ctypes.c_uint8 * (self.n * self.stride)).from_address(self.base))
        self.blobs = view.reshape(self.n, self.stride)
        for e in range(distinct):
            g, u, d = random_expert(rng, types, n_ff, n_embd)
            self.blobs[e, :self.nbytes] = np.concatenate([g.reshape(-1), u.reshape(-1), d.reshape(-1)])
        for e in range(distinct, self.n):
            self.blobs[e] = self.blobs[e % distinct]
        self.layout = ce.PackedLayout(self.types.gate, self.types.up, self.types.down, n_ff * self.types.rb_gate,
                                      n_ff * (self.types.rb_gate + self.types.rb_up), n_ff, n_embd, self.stride)

    def table(self, activation: str, biases=None) -> ce.ExpertTable:
        ptr = self.base + np.arange(self.n, dtype=np.uint64) * np.uint64(self.stride)
        return ce.ExpertTable.from_blobs(ptr, [self.layout], self.n, activation, biases, (self.buf,))


def plain_read_kernel():
    """numba: the XOR of every 8-byte word of each blob at addrs (nbytes each), over prange'd 64 KiB pieces."""
    from numba import carray, njit, prange

    from engine.cpu_simd import ptr_u64

    @njit(parallel=True, nogil=True)
    def read(addrs, nbytes):
        words, piece = nbytes // 8, 8192
        per = (words + piece - 1) // piece
        acc = np.zeros(len(addrs) * per, np.uint64)
        for t in prange(len(addrs) * per):
            e, w0 = t // per, (t % per) * piece
            n = min(piece, words - w0)
            v = carray(ptr_u64(addrs[e] + w0 * 8), n)
            s = np.uint64(0)
            for i in range(n):
                s ^= v[i]
            acc[t] = s
        return acc.sum()
    return read


# --- llama.cpp's CPU path (the anchor wheel's libggml) ------------------------------------------------------------

def ggml_path(lib_dir: Path, types: ce.LayerTypes, n_ff: int, n_embd: int, activation: str):
    """A function f(gate, up, down addresses, w, x, out) computing the experts as llama.cpp's CPU backend does:
    x and h rounded to the row type's vec_dot_type (q8_K / q8_0), each row's ggml vec_dot, in numba's prange."""
    from numba import njit, prange
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_cpu_init()

    class TraitsCPU(ctypes.Structure):     # ggml-cpu.h, struct ggml_type_traits_cpu
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                    ("nrows", ctypes.c_int64)]
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TraitsCPU)
    base.ggml_row_size.restype, base.ggml_row_size.argtypes = ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]
    U, I = ctypes.c_uint64, ctypes.c_int
    vec_dot_t = ctypes.CFUNCTYPE(None, I, U, ctypes.c_size_t, U, ctypes.c_size_t, U, ctypes.c_size_t, I)
    from_float_t = ctypes.CFUNCTYPE(None, U, U, ctypes.c_int64)

    def traits(qt):
        t = cpu.ggml_get_type_traits_cpu(qt).contents
        q = cpu.ggml_get_type_traits_cpu(t.vec_dot_type).contents
        return vec_dot_t(t.vec_dot), from_float_t(q.from_float), t.vec_dot_type

    (dg, fg, tg), (du, _, tu), (dd, fd, td) = traits(types.gate), traits(types.up), traits(types.down)
    if tg != tu:
        raise SystemExit("bench.cpu_experts --ggml: gate and up round x to different types; use one type for both")
    xq_bytes, hq_bytes = base.ggml_row_size(tg, n_embd), base.ggml_row_size(td, n_ff)
    oai = activation == "swiglu_oai"
    rbg, rbu, rbd = types.rb_gate, types.rb_up, types.rb_down
    alpha, limit = np.float32(1.702), np.float32(7.0)

    @njit(parallel=True, nogil=True)
    def run(gate, up, down, w, x, out):
        k = len(gate)
        xq = np.empty(xq_bytes, np.uint8)
        fg(x.ctypes.data, xq.ctypes.data, n_embd)
        h = np.empty((k, n_ff), np.float32)
        for t in prange(k * n_ff):
            e, r = t // n_ff, t % n_ff
            s = np.zeros(2, np.float32)
            dg(n_embd, s.ctypes.data, 0, gate[e] + r * rbg, 0, xq.ctypes.data, 0, 1)
            du(n_embd, s.ctypes.data + 4, 0, up[e] + r * rbu, 0, xq.ctypes.data, 0, 1)
            g, u = s[0], s[1]
            if oai:
                g = min(g, limit)
                u = max(-limit, min(u, limit))
                h[e, r] = g / (np.float32(1) + np.exp(-alpha * g)) * (u + np.float32(1))
            else:
                h[e, r] = g / (np.float32(1) + np.exp(-g)) * u
        hq = np.empty((k, hq_bytes), np.uint8)
        for e in range(k):
            fd(h[e].ctypes.data, hq[e].ctypes.data, n_ff)
        for r in prange(n_embd):
            s = np.zeros(1, np.float32)
            acc = np.float32(0)
            for e in range(k):
                dd(n_ff, s.ctypes.data, 0, down[e] + r * rbd, 0, hq[e].ctypes.data, 0, 1)
                acc += w[e] * s[0]
            out[r] = acc
    return run


def default_ggml_lib() -> Path:
    from tools.llama_ref import llama_python
    py = llama_python()
    site = next((py.parent.parent / "lib").glob("python3*/site-packages"))
    return site / "llama_cpp" / "lib"


def exact(table: ce.ExpertTable, ids, w, x) -> np.ndarray:
    """float64 over the dequantized weights (no bias: the bench's tables have none)."""
    from engine.cpu_experts import _rows
    from engine.gguf_model import dequantize
    t, F, D = table.types[0], table.n_ff, table.n_embd
    out = np.zeros(D)
    x64 = x.astype(np.float64)
    for e, we in zip(ids, w):
        g = dequantize(_rows(table.gate[0, e], F, t.rb_gate), t.gate) @ x64
        u = dequantize(_rows(table.up[0, e], F, t.rb_up), t.up) @ x64
        if table.activation == "swiglu_oai":
            g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
            h = g / (1 + np.exp(-1.702 * g)) * (u + 1)
        else:
            h = g / (1 + np.exp(-g)) * u
        out += float(we) * (dequantize(_rows(table.down[0, e], D, t.rb_down), t.down) @ h)
    return out


def ggml_row_dot(lib_dir: Path, qt: int, n: int, row_bytes: int):
    """f(address, n_rows, x, out): llama.cpp's vec_dot of each row against x rounded to the type's vec_dot_type
    (x rounded once a call, as a layer rounds it once), from numba as ggml_path calls it."""
    from numba import njit
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_cpu_init()

    class TraitsCPU(ctypes.Structure):     # ggml-cpu.h, struct ggml_type_traits_cpu
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                    ("nrows", ctypes.c_int64)]
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TraitsCPU)
    base.ggml_row_size.restype, base.ggml_row_size.argtypes = ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]
    U, I = ctypes.c_uint64, ctypes.c_int
    t = cpu.ggml_get_type_traits_cpu(qt).contents
    q = cpu.ggml_get_type_traits_cpu(t.vec_dot_type).contents
    vd = ctypes.CFUNCTYPE(None, I, U, ctypes.c_size_t, U, ctypes.c_size_t, U, ctypes.c_size_t, I)(t.vec_dot)
    ff = ctypes.CFUNCTYPE(None, U, U, ctypes.c_int64)(q.from_float)
    xq_bytes = base.ggml_row_size(t.vec_dot_type, n)

    @njit
    def rows(a, n_rows, x, out):
        xq = np.empty(xq_bytes, np.uint8)
        ff(x.ctypes.data, xq.ctypes.data, n)
        s = np.zeros(1, np.float32)
        for r in range(n_rows):
            vd(n, s.ctypes.data, 0, a + r * row_bytes, 0, xq.ctypes.data, 0, 1)
            out[r] = s[0]
    return rows


def row_dots(names: str, ggml_lib: Path | None = None, n: int = 2048, rows: int = 128, reps: int = 20) -> int:
    """GB/s of one thread's row dots from cache (engine/cpu_expert_kernels.py dot_rows over `rows` rows of n values,
    or 2880 where n is no whole number of the type's blocks), best of `reps` rounds of 20 calls: the kernels' own
    rate, without DRAM; with ggml_lib, llama.cpp's vec_dot on the same rows beside it."""
    import numba

    from engine import cpu_expert_kernels as kern
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    cols_ = ["type", "values a row", "GB/s from cache (best)"] + (["llama.cpp's vec_dot", "ours / llama.cpp"]
                                                               if ggml_lib else [])
    print("| " + " | ".join(cols_) + " |")
    print("| --- |" + " ---: |" * (len(cols_) - 1))

    def best_of(f):
        f()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(20):
                f()
            best = min(best, (time.perf_counter() - t0) / 20)
        return best
    for name in names.split(","):
        qt = _qtype(name)
        cols = n if n % ce.QUANT_BLOCKS[qt][0] == 0 else 2880
        data = random_expert(rng, (qt, qt, qt), rows, cols, gate_only=True)[0]
        x = rng.standard_normal(cols).astype(np.float32)
        out = np.zeros(rows, np.float32)
        ours = data.nbytes / best_of(lambda: kern.dot_rows(qt, data.ctypes.data, data.shape[1], rows, cols, x, out))
        row = [name.upper(), str(cols), f"{ours / GB:.2f}"]
        if ggml_lib:
            g = ggml_row_dot(ggml_lib, qt, cols, data.shape[1])
            theirs = data.nbytes / best_of(lambda: g(data.ctypes.data, rows, x, out))
            row += [f"{theirs / GB:.2f}", f"{ours / theirs:.2f}"]
        print("| " + " | ".join(row) + " |", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_experts", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="make_moe preset whose expert shape to use")
    ap.add_argument("--types", help="gate,up,down quant types (default: the preset's expert type)")
    ap.add_argument("--experts", type=int, help="experts a call (default: the preset's top k)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    ap.add_argument("--pool-gib", type=float, default=1.5, help="GiB of blobs to pick from (default 1.5)")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per thread count (default 30)")
    ap.add_argument("--backend", default="auto", choices=("auto",) + ce.BACKENDS)
    ap.add_argument("--ahead", help="software prefetch distances in rows to time, comma-separated (0: none; "
                                    "default: the kernels' own, engine/cpu_expert_kernels.py AHEAD)")
    ap.add_argument("--ggml", action="store_true", help="also time llama.cpp's CPU path (the anchor wheel)")
    ap.add_argument("--ggml-lib", type=Path, help="directory of libggml-base.so and libggml-cpu.so "
                                                   "(default: tools.llama_ref's venv of the anchor wheel)")
    ap.add_argument("--row-dots", metavar="TYPES", help="only time one thread's row dots from cache for these types "
                                                         "(comma-separated), then exit")
    a = ap.parse_args(argv)
    if a.row_dots:
        return row_dots(a.row_dots, (a.ggml_lib or default_ggml_lib()) if a.ggml else None)
    n_embd, n_ff, k, types, act = preset_shape(a.preset)
    if a.types:
        names = a.types.split(",")
        if len(names) != 3:
            raise SystemExit("bench.cpu_experts: --types takes gate,up,down")
        types = tuple(_qtype(n) for n in names)
    k = a.experts or k
    try:
        threads = [int(t) for t in a.threads.split(",")]
    except ValueError:
        raise SystemExit(f"bench.cpu_experts: --threads {a.threads!r} is not a list of counts") from None
    backend = ce.check_backend(a.backend)
    try:
        aheads = [None] if not a.ahead else [int(v) for v in a.ahead.split(",")]
    except ValueError:
        raise SystemExit(f"bench.cpu_experts: --ahead {a.ahead!r} is not a list of row counts") from None
    if any(v is not None and v < 0 for v in aheads):
        raise SystemExit("bench.cpu_experts: --ahead takes counts >= 0")
    pool = Pool(types, n_ff, n_embd, a.pool_gib)
    if pool.n < 2 * k:
        raise SystemExit(f"bench.cpu_experts: --pool-gib {a.pool_gib} holds {pool.n} experts; give at least {2 * k}")
    table = pool.table(act)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n_embd).astype(np.float32)
    w = rng.uniform(0.05, 0.3, k).astype(np.float32)
    out = np.zeros(n_embd, np.float32)
    call_bytes = k * pool.nbytes
    import numba
    top = int(numba.config.NUMBA_NUM_THREADS)
    read = plain_read_kernel()
    ptrs = pool.base + np.arange(pool.n, dtype=np.int64) * pool.stride
    ggml = None
    if a.ggml:
        ggml = ggml_path(a.ggml_lib or default_ggml_lib(), pool.types, n_ff, n_embd, act)
    from gguf import GGMLQuantizationType as Q
    tnames = "/".join(Q(t).name if t in {int(v) for v in Q} else str(t) for t in types)
    print(f"bench.cpu_experts: {a.preset} experts ({n_embd} x {n_ff}, {tnames}, {act}), {k} a call = "
          f"{call_bytes / 1e6:.2f} MB; pool {pool.n} blobs ({pool.n * pool.stride / 2**30:.2f} GiB); backend "
          f"{backend}; {a.reps} calls per row; numba allows {top} threads here")
    # first calls compile (numba caches to disk)
    ids0 = rng.choice(pool.n, k, replace=False)
    ce.experts_ffn(table, 0, ids0, w, x, out, backend)
    read(ptrs[ids0], pool.nbytes)
    if ggml is not None:
        g_out = np.zeros(n_embd, np.float32)
        ggml(table.gate[0, ids0], table.up[0, ids0], table.down[0, ids0], w, x, g_out)
        ref = exact(table, ids0, w, x)
        scale = np.sqrt(np.mean(ref ** 2))
        print(f"error against exact arithmetic (float64), one call: ours max {np.max(np.abs(out - ref)) / scale:.2e} "
              f"rms {np.sqrt(np.mean((out - ref) ** 2)) / scale:.2e}; llama.cpp's max "
              f"{np.max(np.abs(g_out - ref)) / scale:.2e} rms {np.sqrt(np.mean((g_out - ref) ** 2)) / scale:.2e} "
              f"(of the output's rms)")
    cols = ["threads"] + (["ahead"] if a.ahead else []) + ["ms a call", "GB/s (best)", "plain read GB/s (best)", "of read"]
    if ggml is not None:
        cols += ["llama.cpp GB/s (best)", "ours / llama.cpp"]
    print("| " + " | ".join(cols) + " |")
    print("| " + " | ".join("---:" for _ in cols) + " |")
    for nt, ahead in ((nt, ahead) for nt in threads for ahead in aheads):
        if nt > top or nt < 1:
            print(f"| {nt} | skipped: numba allows 1..{top} threads here (NUMBA_NUM_THREADS) |")
            continue
        numba.set_num_threads(nt)
        times = {"ours": [], "read": [], "ggml": []}
        for _ in range(a.reps):
            for name in times:
                if name == "ggml" and ggml is None:
                    continue
                ids = rng.choice(pool.n, k, replace=False)
                t0 = time.perf_counter()
                if name == "ours":
                    ce.experts_ffn(table, 0, ids, w, x, out, backend, ahead)
                elif name == "read":
                    read(ptrs[ids], pool.nbytes)
                else:
                    ggml(table.gate[0, ids], table.up[0, ids], table.down[0, ids], w, x, out)
                times[name].append(time.perf_counter() - t0)
        rate = {n: (call_bytes / np.median(v) / GB, call_bytes / min(v) / GB) for n, v in times.items() if v}
        row = [str(nt)] + ([str(ahead)] if a.ahead else []) + [f"{np.median(times['ours']) * 1e3:.3f}", "%.2f (%.2f)" % rate["ours"],
               "%.2f (%.2f)" % rate["read"], f"{rate['ours'][0] / rate['read'][0]:.2f}"]
        if ggml is not None:
            row += ["%.2f (%.2f)" % rate["ggml"], f"{rate['ours'][0] / rate['ggml'][0]:.2f}"]
        print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
