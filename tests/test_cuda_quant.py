"""cuda_src/quant.cuh against engine.quant_types.dequantize (gguf.quants, engine.quant_blocks), for every quant type.

Host tests (no GPU): quant.cuh compiled for the CPU (STRATA_HOST) with g++/nvcc runs dequant8 and dot_row on fresh
random blocks. GPU tests (marked gpu): dequant.cu (fp32 and fp16 outputs) and matvec.cu (1..8 vectors) on the device,
outputs poisoned with NaN first, against engine.quant_types' dequantize and NumPy's matrix product; Q2_0, Q1_0 and
NVFP4 also against llama.cpp's own floats of its blocks (tests/fixtures/quants), bit for bit.
"""
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from engine.cuda.kernels import CUDA_SRC
from engine.cuda.quant_types import NAMES, qtype, random_rows
from engine.quant_types import dequantize

HOST_MAIN = r"""
#define STRATA_HOST
#include "quant.cuh"
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <vector>
template <int Q> static void run(const uint8_t* in, size_t n, int ncols, const std::vector<float>& x,
                                 std::vector<float>& out, std::vector<float>& dots) {
    constexpr int QK = QTraits<Q>::QK, B = QTraits<Q>::BYTES;
    const size_t nb = n / B, rb = (size_t)ncols / QK * B, nrows = n / rb;
    out.assign(nb * QK, 0.f);
    for (size_t b = 0; b < nb; b++)
        for (int j = 0; j < QK / 8; j++) {
            float v[8];
            dequant8<Q>(in + b * B, j, v);
            for (int k = 0; k < 8; k++) out[b * QK + j * 8 + k] = v[k];
        }
    dots.assign(2 * nrows, 0.f);
    for (size_t r = 0; r < nrows; r++)
        for (int lane = 0; lane < 32; lane++) dots[r] += dot_row<Q>(in + r * rb, x.data(), ncols, lane);
    for (size_t r = 0; r < nrows; r += 2) {  // dot_rows, two rows at a time (the last pair may repeat a row)
        const uint8_t* rows[2] = {in + r * rb, in + (r + 1 < nrows ? r + 1 : r) * rb};
        float acc[2][1] = {{0.f}, {0.f}};
        for (int lane = 0; lane < 32; lane++) dot_rows<Q, 2, 1>(rows, x.data(), ncols, ncols, lane, acc);
        dots[nrows + r] = acc[0][0];
        if (r + 1 < nrows) dots[nrows + r + 1] = acc[1][0];
    }
}
int main(int argc, char** argv) {
    if (argc != 6) { fprintf(stderr, "usage: qt ncols blocks.bin x.bin out.bin\n"); return 2; }
    const int qt = atoi(argv[1]), ncols = atoi(argv[2]);
    std::vector<uint8_t> in; std::vector<float> x(ncols), out, dots;
    FILE* f = fopen(argv[3], "rb"); int c; while ((c = fgetc(f)) != EOF) in.push_back((uint8_t)c); fclose(f);
    f = fopen(argv[4], "rb"); if (fread(x.data(), 4, ncols, f) != (size_t)ncols) return 3; fclose(f);
    // the data in an allocation of whole words, as a GPU's are (the sanitizer build sees any read past that)
    std::vector<uint8_t> buf((in.size() + 3) & ~(size_t)3);
    std::copy(in.begin(), in.end(), buf.begin());
#if defined(STRATA_ONLY)  // one type (the sanitizer build)
    if (qt != STRATA_ONLY) { fprintf(stderr, "this build runs type %d only\n", STRATA_ONLY); return 2; }
    run<STRATA_ONLY>(buf.data(), in.size(), ncols, x, out, dots);
#else
    switch (qt) {
#define CASE(T) case STRATA_Q_##T: run<STRATA_Q_##T>(buf.data(), in.size(), ncols, x, out, dots); break;
        STRATA_FOR_EACH_QTYPE(CASE)
        default: fprintf(stderr, "unknown type %d\n", qt); return 2;
    }
#endif
    f = fopen(argv[5], "wb"); fwrite(out.data(), 4, out.size(), f); fwrite(dots.data(), 4, dots.size(), f); fclose(f);
    return 0;
}
"""


def _host_compiler() -> list[str] | None:
    for cxx in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cxx and shutil.which(cxx):
            return [cxx]
    return None


def _build_host(tmp_path_factory, *flags: str) -> Path:
    cxx = _host_compiler()
    if cxx is None:
        pytest.skip("no C++ compiler (g++/c++/clang++ or $CXX) to build quant.cuh for the host")
    d = tmp_path_factory.mktemp("quant_host")
    (d / "main.cpp").write_text(HOST_MAIN)
    exe = d / "quant_host"
    p = subprocess.run([*cxx, "-O1", "-std=c++17", *flags, f"-I{CUDA_SRC}", str(d / "main.cpp"), "-o", str(exe)],
                       capture_output=True, text=True)
    assert p.returncode == 0, f"quant.cuh does not compile for the host ({' '.join(flags)}):\n{p.stderr[-3000:]}"
    return exe


@pytest.fixture(scope="module")
def host_bin(tmp_path_factory):
    return _build_host(tmp_path_factory)


NEW = ("Q2_0", "Q1_0", "NVFP4")       # issue 35's types


def _sizes(name: str) -> list[tuple[int, int]]:
    qk = qtype(name).qk
    return [(1, qk), (3, 4 * qk), (5, 1024 if qk < 256 else 2048)]


def _ref(rows: np.ndarray, name: str) -> np.ndarray:
    return dequantize(rows, qtype(name).ggml).astype(np.float32).reshape(rows.shape[0], -1)


def _run_host(exe, tmp_path, name, rows, x):
    """The host build on rows (n_rows, row bytes) and x: every block's dequant8 as (n_rows, ncols), then each row's
    dot_row and dot_rows with x."""
    n_rows, ncols = rows.shape[0], x.size
    rows.tofile(tmp_path / "in.bin")
    x.tofile(tmp_path / "x.bin")
    (tmp_path / "out.bin").write_bytes(b"\xff" * 8)  # stale bytes must be overwritten
    subprocess.run([str(exe), str(qtype(name).id), str(ncols), str(tmp_path / "in.bin"), str(tmp_path / "x.bin"),
                    str(tmp_path / "out.bin")], check=True)
    out = np.fromfile(tmp_path / "out.bin", dtype=np.float32)
    assert out.size == n_rows * ncols + 2 * n_rows
    n = n_rows * ncols
    return out[:n].reshape(n_rows, ncols), out[n:n + n_rows], out[n + n_rows:]


def _check_host(exe, tmp_path, name, sizes, rng):
    for n_rows, ncols in sizes:
        rows = random_rows(name, n_rows, ncols, rng)
        x = rng.standard_normal(ncols, dtype=np.float32)
        got, dots, dots2 = _run_host(exe, tmp_path, name, rows, x)
        ref = _ref(rows, name)
        if name in NEW:     # no sum in their decoding: the reference's float32 bits
            np.testing.assert_array_equal(got, ref, err_msg=f"{name} dequant8 {n_rows}x{ncols}")
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0, err_msg=f"{name} dequant8 {n_rows}x{ncols}")
        want = ref.astype(np.float64) @ x
        scale = np.abs(ref).astype(np.float64) @ np.abs(x)
        assert np.all(np.abs(dots - want) <= 1e-5 * scale), f"{name} dot_row {n_rows}x{ncols}"
        assert np.all(np.abs(dots2 - want) <= 1e-5 * scale), f"{name} dot_rows {n_rows}x{ncols}"


def _llama_blocks(name):
    """llama.cpp's floats of blocks (tests/fixtures/quants, python -m tools.quant_fixtures): its random-block set
    (fp16 scales of zero, subnormal, inf and NaN; every UE4M3 byte) and its blocks of float rows, one block a row."""
    q = qtype(name)
    f = np.load(Path(__file__).parent / "fixtures" / "quants" / "llama_blocks.npz")
    blocks = np.concatenate([f[f"{name}_dequant_blocks"].reshape(-1), f[f"{name}_blocks"]]).reshape(-1, q.block_bytes)
    y = np.concatenate([f[f"{name}_dequant_y"].reshape(-1), f[f"{name}_y"]]).reshape(-1, q.qk)
    return blocks, y


def _assert_llama_bits(got, want, what):
    """NaN where llama.cpp has NaN (its payload may differ: fp16 conversions quiet a signalling NaN or not), the same
    float32 bits everywhere else."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{what}: NaN elsewhere than llama.cpp's")
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32), err_msg=what)


@pytest.mark.parametrize("name", ["Q2_0", "Q1_0", "NVFP4"])
def test_host_new_types_give_llamas_floats_bit_for_bit(host_bin, tmp_path, name):
    blocks, want = _llama_blocks(name)
    got, _, _ = _run_host(host_bin, tmp_path, name, blocks, np.ones(qtype(name).qk, np.float32))
    _assert_llama_bits(got, want, f"{name} dequant8 of llama.cpp's blocks")


@pytest.mark.parametrize("name", NAMES)
def test_host_dequant8_and_dot_row_match_gguf(host_bin, tmp_path, name):
    _check_host(host_bin, tmp_path, name, _sizes(name), np.random.default_rng(1000 + qtype(name).id))


def test_host_mxfp4_word_loads_stay_inside_the_data(tmp_path_factory, tmp_path):
    # MXFP4's 17-byte blocks sit at every byte offset mod 4; quant.cuh reads them as aligned words (ld8_a1). Built
    # with AddressSanitizer over a buffer of the rows rounded up to whole words (a GPU allocation is rounded further),
    # any word read past the last block's word aborts. Total block counts 1..8 and 160 put the last block at each
    # offset mod 4 (the buffer starts 16-byte aligned: block k at 17k).
    cxx = _host_compiler()
    if cxx and subprocess.run([*cxx, "-fsanitize=address", "-x", "c++", "-", "-o", str(tmp_path / "probe")],
                              input="int main() { return 0; }", text=True, capture_output=True).returncode:
        pytest.skip(f"{cxx[0]} cannot build with -fsanitize=address (no libasan)")
    exe = _build_host(tmp_path_factory, "-fsanitize=address", "-fno-omit-frame-pointer",
                      f"-DSTRATA_ONLY={qtype('MXFP4').id}")
    sizes = [(n_rows, 32 * nb) for n_rows in (1, 3) for nb in (1, 2, 3, 4, 5, 7, 8)] + [(5, 1024)]
    _check_host(exe, tmp_path, "MXFP4", sizes, np.random.default_rng(1039))


def test_random_rows_refuses_a_ragged_row():
    with pytest.raises(ValueError, match="multiple of 256"):
        random_rows("Q4_K", 1, 100, np.random.default_rng(0))


def test_unknown_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="supported: F32"):
        qtype("TQ1_0")


def test_matvec_plan_names_kernels_that_exist_and_covers_every_row():
    import re
    from bench.matvec import MATVEC_ROWS, matvec_plan
    src = (CUDA_SRC / "matvec.cu").read_text()
    made = {(int(r), int(n)) for r, n in re.findall(r"^STRATA_MATVEC\((\d+), (\d+)\)", src, re.M)}
    assert made == {(r, nv) for nv, rs in MATVEC_ROWS.items() for r in rs}
    for nrows in (1, 45, 4096, 8192, 151936):
        for nv in MATVEC_ROWS:
            for name, ncols in (("Q4_K", 2048), ("Q8_0", 576), ("F16", 8192)):
                kernel, grid, block, r = matvec_plan(nrows, nv, qtype_=name, ncols=ncols)
                assert kernel == f"matvec_r{r}_nv{nv}" and (r, nv) in made
                assert grid[0] * (block[0] // 32) * r >= nrows > (grid[0] - 1) * (block[0] // 32) * r
    with pytest.raises(ValueError, match="1 to 8 vectors"):
        matvec_plan(10, 9)


# ---- GPU ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


def _launch_dequant(cp, name, rows, out_dtype):
    from engine.cuda.kernels import quant_function
    q = qtype(name)
    src = cp.asarray(rows.reshape(-1))
    n_blocks = rows.size // q.block_bytes
    dst = cp.full(n_blocks * q.qk + 64, np.nan, dtype=out_dtype)  # poisoned, with a tail that must stay untouched
    fn = quant_function("dequant", "dequant_f32" if out_dtype == np.float32 else "dequant_f16", name)
    threads = 256
    blocks = min(4096, max(1, (n_blocks * q.qk // 8 + threads - 1) // threads))
    fn((blocks,), (threads,), (src, dst, np.int64(n_blocks)))
    out = cp.asnumpy(dst)
    return out[:-64], out[-64:]


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_dequant_matches_gguf(cp, name):
    rng = np.random.default_rng(2000 + qtype(name).id)
    for n_rows, ncols in _sizes(name) + [(37, 4096)]:
        rows = random_rows(name, n_rows, ncols, rng)
        ref = _ref(rows, name).reshape(-1)
        # nvcc fuses d*q + m into one fma (numpy rounds twice): allow an ulp of the block's scale
        atol = 1e-6 * float(np.abs(ref).max())
        got32, tail32 = _launch_dequant(cp, name, rows, np.float32)
        np.testing.assert_allclose(got32, ref, rtol=1e-6, atol=atol, err_msg=f"{name} f32 {n_rows}x{ncols}")
        assert np.isnan(tail32).all(), f"{name} dequant_f32 wrote past its output"
        got16, tail16 = _launch_dequant(cp, name, rows, np.float16)
        np.testing.assert_allclose(got16.astype(np.float32), ref, rtol=2.0 ** -11, atol=atol + 2.0 ** -24,
                                   err_msg=f"{name} f16 {n_rows}x{ncols}")
        assert np.isnan(tail16).all(), f"{name} dequant_f16 wrote past its output"


def matvec(cp, name, w_rows, x, row_stride=None, pad_rows_out=3, rows_per_warp=1):
    """y (nv, nrows) = x (nv, ncols) @ W.T through matvec.cu; y poisoned with NaN first, with a tail checked."""
    from bench.matvec import matvec_plan
    from engine.cuda.kernels import quant_function
    nv, ncols = x.shape
    nrows = w_rows.shape[0]
    row_stride = row_stride or w_rows.shape[1]
    wd = cp.asarray(w_rows)
    xd = cp.asarray(x, dtype=cp.float32)
    ldy = nrows + pad_rows_out
    yd = cp.full((nv, ldy), np.nan, dtype=cp.float32)
    kernel, grid, block, r = matvec_plan(nrows, nv, rows_per_warp)
    assert r == rows_per_warp
    quant_function("matvec", kernel, name)(grid, block, (wd, np.int64(row_stride), xd, np.int32(ncols), yd,
                                                         np.int32(ldy), np.int32(nrows), np.int32(ncols)))
    y = cp.asnumpy(yd)
    return y[:, :nrows], y[:, nrows:]


def _check_matvec(name, rows, x, y, tail, what):
    w = _ref(rows, name).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert np.all(np.abs(y - want) <= 1e-3 * np.abs(want) + 1e-5 * scale), f"{name} {what}"
    assert np.isnan(tail).all(), f"{name} matvec wrote past nrows ({what})"


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_matvec_matches_numpy(cp, name):
    from bench.matvec import MATVEC_ROWS
    q = qtype(name)
    rng = np.random.default_rng(3000 + q.id)
    for (n_rows, ncols), nv in zip(_sizes(name) + [(301, 2048 + 2 * 256)], (1, 3, 8, 2)):
        rows = random_rows(name, n_rows, ncols, rng)
        x = rng.standard_normal((nv, ncols), dtype=np.float32)
        for r in MATVEC_ROWS[nv]:
            y, tail = matvec(cp, name, rows, x, rows_per_warp=r)
            _check_matvec(name, rows, x, y, tail, f"{n_rows}x{ncols} nv={nv} rows/warp={r}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "F16", *NEW])
def test_gpu_matvec_every_kernel_variant(cp, name):
    # every (rows per warp, vectors) kernel, with row counts that leave a partial block and a partial warp
    from bench.matvec import MATVEC_ROWS
    rng = np.random.default_rng(5000 + qtype(name).id)
    ncols = 512
    rows = random_rows(name, 45, ncols, rng)
    for nv, rs in MATVEC_ROWS.items():
        x = rng.standard_normal((nv, ncols), dtype=np.float32)
        for r in rs:
            y, tail = matvec(cp, name, rows, x, rows_per_warp=r)
            _check_matvec(name, rows, x, y, tail, f"45x{ncols} nv={nv} rows/warp={r}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "F16", "IQ2_XS", *NEW])
def test_gpu_matvec_row_stride_skips_padding(cp, name):
    # rows inside a wider buffer (a slab with padding): bytes past each row are garbage the kernel must not read
    q = qtype(name)
    rng = np.random.default_rng(4000 + q.id)
    ncols = 512
    rows = random_rows(name, 9, ncols, rng)
    stride = rows.shape[1] + 64
    padded = np.full((9, stride), 0xFF, dtype=np.uint8)
    padded[:, :rows.shape[1]] = rows
    x = rng.standard_normal((1, ncols), dtype=np.float32)
    y, _ = matvec(cp, name, padded, x, row_stride=stride, rows_per_warp=2)
    want = x.astype(np.float64) @ _ref(rows, name).astype(np.float64).T
    np.testing.assert_allclose(y, want, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("n_rows,ncols", [(1, 32), (33, 32 * 45), (7, 2880)])
def test_gpu_mxfp4_at_every_byte_offset(cp, n_rows, ncols):
    # MXFP4 blocks are 17 bytes, read as aligned words (quant.cuh ld8_a1): the matrix starts 0..3 bytes into a buffer
    # of 0xFF guard bytes, with rows of 1, 45 (odd) and 90 (gpt-oss's 2880 columns) blocks, so blocks and rows sit at
    # every offset mod 4; mat-vecs (1 and 2 vectors, every rows-per-warp kernel) and dequant against gguf.
    from bench.matvec import MATVEC_ROWS, matvec_plan
    from engine.cuda.kernels import quant_function
    rng = np.random.default_rng()
    rows = random_rows("MXFP4", n_rows, ncols, rng)
    ref = _ref(rows, "MXFP4")
    for off in range(4):
        buf = np.full(rows.size + 8, 0xFF, np.uint8)
        buf[off:off + rows.size] = rows.reshape(-1)
        src = cp.asarray(buf)[off:]
        for nv in (1, 2):
            x = rng.standard_normal((nv, ncols), dtype=np.float32)
            for r in MATVEC_ROWS[nv]:
                kernel, grid, block, _ = matvec_plan(n_rows, nv, r)
                yd = cp.full((nv, n_rows + 3), np.nan, dtype=cp.float32)
                quant_function("matvec", kernel, "MXFP4")(
                    grid, block, (src, np.int64(rows.shape[1]), cp.asarray(x), np.int32(ncols), yd,
                                  np.int32(n_rows + 3), np.int32(n_rows), np.int32(ncols)))
                y = cp.asnumpy(yd)
                _check_matvec("MXFP4", rows, x, y[:, :n_rows], y[:, n_rows:], f"offset {off} {n_rows}x{ncols} "
                              f"nv={nv} rows/warp={r}")
        n_blocks = rows.size // 17
        dst = cp.full(n_blocks * 32 + 64, np.nan, dtype=cp.float32)
        quant_function("dequant", "dequant_f32", "MXFP4")((max(1, n_blocks * 4 // 256 + 1),), (256,),
                                                          (src, dst, np.int64(n_blocks)))
        got = cp.asnumpy(dst)
        np.testing.assert_allclose(got[:-64], ref.reshape(-1), rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()),
                                   err_msg=f"MXFP4 dequant at offset {off}, {n_rows}x{ncols}")
        assert np.isnan(got[-64:]).all(), "dequant_f32 wrote past its output"


@pytest.mark.gpu
@pytest.mark.parametrize("name", NEW)
def test_gpu_new_types_give_llamas_floats_at_even_offsets(cp, name):
    # Q2_0's and Q1_0's 18-byte blocks and NVFP4's 36-byte ones start at any even address (a blob's up after an
    # 18-byte type's gate rows: quant.cuh's contract): the blocks at buffer offsets 0 and 2 (NVFP4's 8-byte loads
    # take ld8_blk's unaligned branch at 2). dequant_f32 of llama.cpp's own blocks (zero, subnormal, inf and NaN fp16
    # scales; every UE4M3 byte) bit for bit; then mat-vecs of random rows, every rows-per-warp kernel.
    from bench.matvec import MATVEC_ROWS, matvec_plan
    from engine.cuda.kernels import quant_function
    q = qtype(name)
    blocks, want = _llama_blocks(name)
    rng = np.random.default_rng()
    n_rows, ncols = 45, 9 * q.qk          # rows of 9 blocks: every other row starts 2 bytes off a word for 18
    rows = random_rows(name, n_rows, ncols, rng)
    for off in (0, 2):
        buf = np.full(blocks.size + 8, 0xFF, np.uint8)
        buf[off:off + blocks.size] = blocks.reshape(-1)
        src = cp.asarray(buf)[off:]
        dst = cp.full(want.size + 64, np.nan, dtype=cp.float32)
        quant_function("dequant", "dequant_f32", name)((max(1, want.size // 8 // 256 + 1),), (256,),
                                                       (src, dst, np.int64(len(blocks))))
        got = cp.asnumpy(dst)
        _assert_llama_bits(got[:-64].reshape(want.shape), want, f"{name} dequant_f32 at offset {off}")
        assert np.isnan(got[-64:]).all(), "dequant_f32 wrote past its output"
        buf = np.full(rows.size + 8, 0xFF, np.uint8)
        buf[off:off + rows.size] = rows.reshape(-1)
        src = cp.asarray(buf)[off:]
        for nv in (1, 2):
            x = rng.standard_normal((nv, ncols), dtype=np.float32)
            for r in MATVEC_ROWS[nv]:
                kernel, grid, block, _ = matvec_plan(n_rows, nv, r)
                yd = cp.full((nv, n_rows + 3), np.nan, dtype=cp.float32)
                quant_function("matvec", kernel, name)(
                    grid, block, (src, np.int64(rows.shape[1]), cp.asarray(x), np.int32(ncols), yd,
                                  np.int32(n_rows + 3), np.int32(n_rows), np.int32(ncols)))
                y = cp.asnumpy(yd)
                _check_matvec(name, rows, x, y[:, :n_rows], y[:, n_rows:], f"offset {off} nv={nv} rows/warp={r}")
