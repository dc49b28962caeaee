"""Whole-row dots in LLVM IR for the CPU expert kernels: a row's blocks in one IR loop, the sums kept in vectors
across blocks and reduced once at the row's end.

engine/cpu_simd.py's block dots reduce every block to a scalar (a halving tree per block) and multiply each product
by its sub-block's scale; here each 16-value chunk is one fused multiply-add into its sub-block's vector sum, the
sub-block's scale one more into the row's vectors, and the tree comes once a row: from cache on one thread Q4_K
8.5 -> 13.0 GB/s, Q6_K 10.9 -> 14.5, Q8_0 12.4 -> 24.3 (docs/experiments.md). 4-bit table types (MXFP4, IQ4_NL,
Q4_0, IQ4_XS, NVFP4) take their values through AVX-512's vpermps, where the CPU has it: MXFP4 7.6 -> 15.1, IQ4_NL
4.8 -> 14.3. The order of every operation is fixed in the IR and each one IEEE (llvm.fma is correctly rounded on every
CPU: FMA hardware, or libm's fmaf without it), so a row's bits do not depend on the thread count, on inlining or on
numba's cache; the result differs from dequantize-then-dot by float32 rounding alone (tests/test_cpu_experts.py).

row_X(a, nb, xa, sa) -> float32: the row of nb blocks of type X at address a dotted with the float32 at xa; sa
holds x's sums over every 32 values (Q4_K's offsets' term).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from engine.cpu_simd import F, I8, I32, _cat, _const, _load, _take, _tree_sum, _vec

I16, I64 = ir.IntType(16), ir.IntType(64)


def _fma(builder, a, b, c):
    """a * b + c rounded once (llvm.fma: the same bits with or without FMA hardware)."""
    t = a.type
    name = f"llvm.fma.v{t.count}f32" if isinstance(t, ir.VectorType) else "llvm.fma.f32"
    fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(t, [t, t, t]))
    return builder.call(fn, [a, b, c])


def _splat_lane(builder, v, lane, n):
    """Lane `lane` of v in all n lanes of a new vector."""
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), _const(I32, [lane] * n))


def _zero(t):
    if not isinstance(t, ir.VectorType):
        return ir.Constant(t, 0.0)
    return ir.Constant(t, [ir.Constant(t.element, 0.0)] * t.count)


def _half_at(builder, addr, off):
    p = builder.inttoptr(builder.add(addr, ir.Constant(addr.type, off)), I16.as_pointer())
    return builder.fpext(builder.bitcast(builder.load(p, align=1), ir.HalfType()), F)


def _block_loop(builder, nb, acc_types, body):
    """for ib in 0..nb: accs = body(builder, ib, accs), the accumulators starting at zero; returns the last ones
    (zeros when nb is 0)."""
    pre = builder.block
    loop = builder.append_basic_block("rows.loop")
    done = builder.append_basic_block("rows.done")
    zeros = [_zero(t) for t in acc_types]
    builder.cbranch(builder.icmp_signed(">", nb, ir.Constant(nb.type, 0)), loop, done)
    builder.position_at_end(loop)
    ib = builder.phi(nb.type)
    accs = [builder.phi(t) for t in acc_types]
    new = body(builder, ib, accs)
    end = builder.block
    ib1 = builder.add(ib, ir.Constant(nb.type, 1))
    ib.add_incoming(ir.Constant(nb.type, 0), pre)
    ib.add_incoming(ib1, end)
    for p, z, v in zip(accs, zeros, new):
        p.add_incoming(z, pre)
        p.add_incoming(v, end)
    builder.cbranch(builder.icmp_signed("<", ib1, nb), loop, done)
    builder.position_at_end(done)
    out = []
    for z, v in zip(zeros, new):
        r = builder.phi(z.type)
        r.add_incoming(z, pre)
        r.add_incoming(v, end)
        out.append(r)
    return out


def _at(builder, base, ib, stride, off=0):
    """base + ib * stride + off (addresses as i64)."""
    a = builder.add(base, builder.mul(ib, ir.Constant(ib.type, stride)))
    return builder.add(a, ir.Constant(a.type, off)) if off else a


def _row_intrinsic(block_codegen, acc_types, finish, unroll=1):
    """An intrinsic (a, nb, xa, sa) -> float32 from a block body and a finisher of the accumulators.

    unroll > 1: `unroll` blocks an iteration, each into its own accumulators (a chain of one add a block would wait
    on the last one's latency), a leftover block into the first's; finish gets the accumulator sets summed in
    order."""
    @intrinsic
    def f(typingctx, a, nb, xa, sa):
        if not all(isinstance(t, types.Integer) for t in (a, nb, xa, sa)):
            return None

        def codegen(context, builder, sig, args):
            ea, enb, exa, esa = (builder.sext(v, I64) if v.type.width < 64 else v for v in args)
            ts = [t() for t in acc_types]
            n = len(ts)
            if unroll == 1:
                return finish(builder, _block_loop(builder, enb, ts,
                                                   lambda b, ib, accs: block_codegen(b, ea, ib, exa, esa, accs)))
            u = ir.Constant(I64, unroll)

            def body(b, it, accs):
                out = []
                for k in range(unroll):
                    ib = b.add(b.mul(it, u), ir.Constant(I64, k))
                    out += block_codegen(b, ea, ib, exa, esa, accs[k * n:(k + 1) * n])
                return out
            accs = _block_loop(builder, builder.sdiv(enb, u), ts * unroll, body)
            sets = [accs[k * n:(k + 1) * n] for k in range(unroll)]
            first = sets[0]
            for k in range(1, unroll):
                first = [builder.fadd(x, y) for x, y in zip(first, sets[k])]
            done = builder.mul(builder.sdiv(enb, u), u)

            def tail(b, it, accs):
                return block_codegen(b, ea, b.add(done, it), exa, esa, accs)
            rest = _block_loop(builder, builder.sub(enb, done), ts, tail)
            return finish(builder, [builder.fadd(x, y) for x, y in zip(first, rest)])
        return types.float32(a, nb, xa, sa), codegen
    return f


# --- Q4_K ---------------------------------------------------------------------------------------------------------
# 144-byte blocks of 256: fp16 d, dmin; 12 bytes of 6-bit scales and mins; 128 bytes of codes, byte 32j + l holding
# value 64j + l (low nibble) and 64j + 32 + l (high). w = d * sc_s * q - dmin * m_s on sub-block s (32 values).

def _q4k_scales(builder, blk):
    """(sc, mn) as v8 float: the block's eight 6-bit scales and mins (get_scale_min_k4)."""
    v4b, v8b, v8f = _vec(I8, 4), _vec(I8, 8), _vec(F, 8)
    sm = _load(builder, blk, v8b, 4)
    hi = _load(builder, blk, v4b, 12)
    c63, c15, c4, c6 = (_const(I8, [v] * 4) for v in (63, 15, 4, 6))
    s_lo, m_lo = _take(builder, sm, range(4)), _take(builder, sm, range(4, 8))
    sc = _cat(builder, builder.and_(s_lo, c63), builder.or_(builder.and_(hi, c15),
                                                            builder.shl(builder.lshr(s_lo, c6), c4)))
    mn = _cat(builder, builder.and_(m_lo, c63), builder.or_(builder.lshr(hi, c4),
                                                            builder.shl(builder.lshr(m_lo, c6), c4)))
    return builder.uitofp(sc, v8f), builder.uitofp(mn, v8f)


def _nibble_chunks(builder, qaddr):
    """16 bytes at qaddr as two v16 float: their low nibbles and their high ones."""
    v16b, v16i, v16f = _vec(I8, 16), _vec(I32, 16), _vec(F, 16)
    q = builder.zext(_load(builder, qaddr, v16b), v16i)
    lo = builder.sitofp(builder.and_(q, _const(I32, [15] * 16)), v16f)
    hi = builder.sitofp(builder.lshr(q, _const(I32, [4] * 16)), v16f)
    return lo, hi


def _q4k_body(builder, a, ib, xa, sa, accs):
    v16f, v8f = _vec(F, 16), _vec(F, 8)
    blk = _at(builder, a, ib, 144)
    xb = _at(builder, xa, ib, 1024)
    d, dmin = _half_at(builder, blk, 0), _half_at(builder, blk, 2)
    sc, mn = _q4k_scales(builder, blk)
    dsc = builder.fmul(sc, _splat_lane(builder, builder.insert_element(ir.Constant(v8f, ir.Undefined), d,
                                                                       ir.Constant(I32, 0)), 0, 8))
    nib = _nibble_chunks
    r = list(accs[:4])
    for j in range(4):
        lo0, hi0 = nib(builder, builder.add(blk, ir.Constant(I64, 16 + 32 * j)))
        lo1, hi1 = nib(builder, builder.add(blk, ir.Constant(I64, 16 + 32 * j + 16)))
        for part, (c0, c1) in enumerate(((lo0, lo1), (hi0, hi1))):
            s = 2 * j + part
            xo = 256 * j + 128 * part
            acc = builder.fmul(c0, _load(builder, xb, v16f, xo))
            acc = _fma(builder, c1, _load(builder, xb, v16f, xo + 64), acc)
            r[s % 4] = _fma(builder, _splat_lane(builder, dsc, s, 16), acc, r[s % 4])
    dm = _splat_lane(builder, builder.insert_element(ir.Constant(v8f, ir.Undefined), dmin, ir.Constant(I32, 0)), 0, 8)
    mv = builder.fmul(builder.fmul(dm, mn), _load(builder, _at(builder, sa, ib, 32), v8f))
    return r + [builder.fadd(mv, accs[4])]


def _q4k_finish(builder, accs):
    r = builder.fadd(builder.fadd(accs[0], accs[1]), builder.fadd(accs[2], accs[3]))
    return builder.fsub(_tree_sum(builder, r), _tree_sum(builder, accs[4]))


row_q4_k = _row_intrinsic(_q4k_body, [lambda: _vec(F, 16)] * 4 + [lambda: _vec(F, 8)], _q4k_finish)


# --- 4-bit codes through a 16-value table (MXFP4, IQ4_NL, Q4_0, IQ4_XS, NVFP4) ----------------------------------
# AVX-512's vpermps picks 16 float32 by the low 4 bits of each 32-bit lane: a byte widened to a lane is its low
# nibble's value already, shifted right by 4 its high one's; no int8 table, widening and conversion between.

HAS_AVX512 = bool(__import__("llvmlite.binding", fromlist=["x"]).get_host_cpu_features().get("avx512f", False))


def _table16(builder, values):
    return ir.Constant(_vec(F, 16), [ir.Constant(F, float(v)) for v in values])


def _lut_chunks(builder, qaddr, table, n_bytes=16):
    """n_bytes (16) bytes at qaddr through the table: (values of the low nibbles, of the high ones), v16 float."""
    v16i, v16f = _vec(I32, 16), _vec(F, 16)
    perm = builder.module.declare_intrinsic("llvm.x86.avx512.permvar.sf.512",
                                            fnty=ir.FunctionType(v16f, [v16f, v16i]))
    q = builder.zext(_load(builder, qaddr, _vec(I8, 16)), v16i)
    return (builder.call(perm, [table, q]),
            builder.call(perm, [table, builder.lshr(q, _const(I32, [4] * 16))]))


def _f32_splat(builder, v, n):
    return _splat_lane(builder, builder.insert_element(ir.Constant(_vec(F, n), ir.Undefined), v,
                                                       ir.Constant(I32, 0)), 0, n)


def _e8m0_half_ir(builder, e):
    """ggml_e8m0_to_fp32_half of an i8 exponent byte."""
    e = builder.zext(e, I32)
    small = builder.shl(ir.Constant(I32, 0x00200000), e)
    big = builder.shl(builder.sub(e, ir.Constant(I32, 1)), ir.Constant(I32, 23))
    return builder.bitcast(builder.select(builder.icmp_unsigned("<", e, ir.Constant(I32, 2)), small, big), F)


def _lut32_row(table, nbytes, codes, scale):
    """Rows of 32-value blocks of nbytes: the scale (scale(builder, block address) -> float) and 16 bytes of codes at
    `codes` (low nibbles values 0..15, high 16..31) through the table."""
    def body(builder, a, ib, xa, sa, accs):
        v16f = _vec(F, 16)
        blk = _at(builder, a, ib, nbytes)
        xb = _at(builder, xa, ib, 128)
        lo, hi = _lut_chunks(builder, builder.add(blk, ir.Constant(I64, codes)), _table16(builder, table))
        acc = _fma(builder, hi, _load(builder, xb, v16f, 64), builder.fmul(lo, _load(builder, xb, v16f)))
        return [_fma(builder, _f32_splat(builder, scale(builder, blk), 16), acc, accs[0])]
    return _row_intrinsic(body, [lambda: _vec(F, 16)], lambda b, accs: _tree_sum(b, accs[0]), unroll=4)


def _f16_scale(builder, blk):
    return _half_at(builder, blk, 0)


def _e8m0_scale(builder, blk):
    return _e8m0_half_ir(builder, builder.load(builder.inttoptr(blk, I8.as_pointer())))


FP4 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
IQ4 = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
row_mxfp4 = _lut32_row(FP4, 17, 1, _e8m0_scale)
row_iq4_nl = _lut32_row(IQ4, 18, 2, _f16_scale)
row_q4_0 = _lut32_row([c - 8 for c in range(16)], 18, 2, _f16_scale)


def _iq4_xs_body(builder, a, ib, xa, sa, accs):
    """136-byte blocks of 256: fp16 d, u16 scales_h, 4 bytes scales_l, 128 bytes of codes (sub-block k's 16 at
    8 + 16 k); sub-block k's scale d * (6-bit ls - 32)."""
    v16f, v8i, v8f = _vec(F, 16), _vec(I32, 8), _vec(F, 8)
    blk = _at(builder, a, ib, 136)
    xb = _at(builder, xa, ib, 1024)
    d = _half_at(builder, blk, 0)
    sh = builder.zext(builder.load(builder.inttoptr(builder.add(blk, ir.Constant(I64, 2)), I16.as_pointer()),
                                   align=1), I32)
    sl = builder.zext(_load(builder, blk, _vec(I8, 4), 4), _vec(I32, 4))
    sl8 = _take(builder, sl, [k // 2 for k in range(8)])
    lo4 = builder.and_(builder.lshr(sl8, _const(I32, [4 * (k % 2) for k in range(8)])), _const(I32, [15] * 8))
    hi2 = builder.and_(builder.lshr(_splat_lane(builder, builder.insert_element(ir.Constant(v8i, ir.Undefined), sh,
                                                                                 ir.Constant(I32, 0)), 0, 8),
                                    _const(I32, [2 * k for k in range(8)])), _const(I32, [3] * 8))
    ls = builder.sub(builder.or_(lo4, builder.shl(hi2, _const(I32, [4] * 8))), _const(I32, [32] * 8))
    dl = builder.fmul(builder.sitofp(ls, v8f), _f32_splat(builder, d, 8))
    tab = _table16(builder, IQ4)
    r = list(accs)
    for k in range(8):
        lo, hi = _lut_chunks(builder, builder.add(blk, ir.Constant(I64, 8 + 16 * k)), tab)
        acc = _fma(builder, hi, _load(builder, xb, v16f, 128 * k + 64), builder.fmul(lo, _load(builder, xb, v16f,
                                                                                                  128 * k)))
        r[k % 4] = _fma(builder, _splat_lane(builder, dl, k, 16), acc, r[k % 4])
    return r


def _sum4_finish(builder, accs):
    return _tree_sum(builder, builder.fadd(builder.fadd(accs[0], accs[1]), builder.fadd(accs[2], accs[3])))


row_iq4_xs = _row_intrinsic(_iq4_xs_body, [lambda: _vec(F, 16)] * 4, _sum4_finish)


def _ue4m3_table(builder):
    """NVFP4's 256 half-scales (engine.cpu_decode.UE4M3_HALF) as a constant global of the module."""
    from engine.cpu_decode import UE4M3_HALF
    name = "strata_ue4m3_half"
    mod = builder.module
    if name in mod.globals:
        return mod.globals[name]
    t = ir.ArrayType(F, 256)
    g = ir.GlobalVariable(mod, t, name)
    g.initializer = ir.Constant(t, [ir.Constant(F, float(v)) for v in UE4M3_HALF])
    g.global_constant = True
    g.linkage = "internal"
    return g


def _nvfp4_body(builder, a, ib, xa, sa, accs):
    """36-byte blocks of 64: four UE4M3 scale bytes, then 32 bytes, sub-block s's 8 at 4 + 8 s (low nibbles its
    values 0..7, high 8..15)."""
    v16f = _vec(F, 16)
    blk = _at(builder, a, ib, 36)
    xb = _at(builder, xa, ib, 256)
    g = _ue4m3_table(builder)
    sc = [builder.load(builder.gep(g, [ir.Constant(I32, 0), builder.zext(
        builder.load(builder.inttoptr(builder.add(blk, ir.Constant(I64, s)), I8.as_pointer())), I32)]))
        for s in range(4)]
    tab = _table16(builder, FP4)
    acc = accs[0]
    for h in range(2):                          # sub-blocks 2h, 2h + 1: lanes 0..7 and 8..15
        lo, hi = _lut_chunks(builder, builder.add(blk, ir.Constant(I64, 4 + 16 * h)), tab)
        x0, x1 = _load(builder, xb, v16f, 128 * h), _load(builder, xb, v16f, 128 * h + 64)
        xlo = builder.shuffle_vector(x0, x1, _const(I32, [*range(8), *range(16, 24)]))
        xhi = builder.shuffle_vector(x0, x1, _const(I32, [*range(8, 16), *range(24, 32)]))
        sv = _cat(builder, _f32_splat(builder, sc[2 * h], 8), _f32_splat(builder, sc[2 * h + 1], 8))
        p = _fma(builder, hi, xhi, builder.fmul(lo, xlo))
        acc = _fma(builder, sv, p, acc)
    return [acc]


row_nvfp4 = _row_intrinsic(_nvfp4_body, [lambda: _vec(F, 16)], lambda b, accs: _tree_sum(b, accs[0]), unroll=4)


# --- Q8_0 and Q6_K ------------------------------------------------------------------------------------------------

def _q8_0_body(builder, a, ib, xa, sa, accs):
    """34-byte blocks of 32: fp16 d, 32 int8 codes."""
    v16f = _vec(F, 16)
    blk = _at(builder, a, ib, 34)
    xb = _at(builder, xa, ib, 128)
    c = [builder.sitofp(builder.sext(_load(builder, blk, _vec(I8, 16), 2 + 16 * h), _vec(I32, 16)), v16f)
         for h in range(2)]
    acc = _fma(builder, c[1], _load(builder, xb, v16f, 64), builder.fmul(c[0], _load(builder, xb, v16f)))
    return [_fma(builder, _f32_splat(builder, _half_at(builder, blk, 0), 16), acc, accs[0])]


row_q8_0 = _row_intrinsic(_q8_0_body, [lambda: _vec(F, 16)], lambda b, accs: _tree_sum(b, accs[0]), unroll=4)


def _q6k_body(builder, a, ib, xa, sa, accs):
    """210-byte blocks of 256: ql[128], qh[64], int8 scales[16], fp16 d. Half h (128 values), l in 0..31: value
    32 g + l of the half is (ql[64 h + l + 32 (g % 2)] nibble g // 2 | qh[32 h + l] bits 2g..2g+1 << 4) - 32, scale
    sc[8 h + l // 16 + 2 g]. The codes times their 16-value scale are integers below 2^12 (exact in float32), d
    once a block."""
    v16b, v16i, v16f = _vec(I8, 16), _vec(I32, 16), _vec(F, 16)
    blk = _at(builder, a, ib, 210)
    xb = _at(builder, xa, ib, 1024)
    scf = builder.sitofp(_load(builder, blk, v16b, 192), v16f)
    c15, c3, c32 = _const(I32, [15] * 16), _const(I32, [3] * 16), _const(I32, [32] * 16)
    bacc = [None, None]
    for h in range(2):
        for half in range(2):                       # l in 16 half .. 16 half + 15
            qh = builder.zext(_load(builder, blk, v16b, 128 + 32 * h + 16 * half), v16i)
            ql = [builder.zext(_load(builder, blk, v16b, 64 * h + 32 * m + 16 * half), v16i) for m in range(2)]
            for g in range(4):
                low = ql[g % 2]
                low = builder.and_(low, c15) if g < 2 else builder.lshr(low, _const(I32, [4] * 16))
                high = builder.shl(builder.and_(builder.lshr(qh, _const(I32, [2 * g] * 16)), c3),
                                   _const(I32, [4] * 16))
                q = builder.sitofp(builder.sub(builder.or_(low, high), c32), v16f)
                w = builder.fmul(q, _splat_lane(builder, scf, 8 * h + half + 2 * g, 16))      # exact
                x = _load(builder, xb, v16f, 4 * (128 * h + 32 * g + 16 * half))
                k = g % 2
                bacc[k] = builder.fmul(w, x) if bacc[k] is None else _fma(builder, w, x, bacc[k])
    d = _f32_splat(builder, _half_at(builder, blk, 208), 16)
    return [_fma(builder, d, builder.fadd(bacc[0], bacc[1]), accs[0])]


row_q6_k = _row_intrinsic(_q6k_body, [lambda: _vec(F, 16)], lambda b, accs: _tree_sum(b, accs[0]), unroll=2)


# --- the types without a fused dot before: each chunk's weights formed in registers as the decoder forms them
# (engine/cpu_decode.py), or factored as Q4_K's are, then one fused multiply-add with x: no float32 row in L1.

def _u16x(builder, addr, off=0):
    """16 bytes at addr + off widened to v16 i32."""
    return builder.zext(_load(builder, addr, _vec(I8, 16), off), _vec(I32, 16))


def _ci(v):
    return _const(I32, [v] * 16)


def _bits16(builder, word, first):
    """Bits first .. first + 15 of an i32 as v16 i32 of 0 / 1."""
    return builder.and_(builder.lshr(_splat_lane(builder, builder.insert_element(
        ir.Constant(_vec(I32, 16), ir.Undefined), word, ir.Constant(I32, 0)), 0, 16),
        _const(I32, range(first, first + 16))), _ci(1))


def _u32_at(builder, addr, off):
    return builder.load(builder.inttoptr(builder.add(addr, ir.Constant(I64, off)), I32.as_pointer()), align=1)


def _legacy_body(nbytes, has_min, has_qh):
    """Q4_1 (20 bytes: d, m, 16 of codes), Q5_0 (22: d, qh, codes), Q5_1 (24: d, m, qh, codes): 32-value blocks,
    value j (j < 16) the low nibble of byte j, j + 16 its high one, Q5's fifth bits qh bits j and j + 16;
    w = d * q + m (Q4_1, Q5_1), d * (q - 16) (Q5_0), summed as d * (q . x) + (m or -16 d) * sum x."""
    def body(builder, a, ib, xa, sa, accs):
        v16f = _vec(F, 16)
        blk = _at(builder, a, ib, nbytes)
        xb = _at(builder, xa, ib, 128)
        d = _half_at(builder, blk, 0)
        codes = 4 + 4 * has_qh if has_min else 2 + 4 * has_qh
        q = _u16x(builder, blk, codes)
        lo, hi = builder.and_(q, _ci(15)), builder.lshr(q, _ci(4))
        if has_qh:
            qh = _u32_at(builder, blk, 4 if has_min else 2)
            lo = builder.or_(lo, builder.shl(_bits16(builder, qh, 0), _ci(4)))
            hi = builder.or_(hi, builder.shl(_bits16(builder, qh, 16), _ci(4)))
        acc = _fma(builder, builder.sitofp(hi, v16f), _load(builder, xb, v16f, 64),
                   builder.fmul(builder.sitofp(lo, v16f), _load(builder, xb, v16f)))
        off = _half_at(builder, blk, 2) if has_min else builder.fmul(d, ir.Constant(F, -16.0))
        xs = builder.load(builder.inttoptr(_at(builder, sa, ib, 4), F.as_pointer()))
        return [_fma(builder, _f32_splat(builder, d, 16), acc, accs[0]), builder.fadd(accs[1],
                                                                                    builder.fmul(off, xs))]
    return body


def _vec_scalar_finish(builder, accs):
    return builder.fadd(_tree_sum(builder, accs[0]), accs[1])


_VS = [lambda: _vec(F, 16), lambda: F]
row_q4_1 = _row_intrinsic(_legacy_body(20, True, False), _VS, _vec_scalar_finish, unroll=4)
row_q5_0 = _row_intrinsic(_legacy_body(22, False, True), _VS, _vec_scalar_finish, unroll=4)
row_q5_1 = _row_intrinsic(_legacy_body(24, True, True), _VS, _vec_scalar_finish, unroll=4)


def _q5k_body(builder, a, ib, xa, sa, accs):
    """176-byte blocks of 256: Q4_K's d, dmin, scales, then qh[32] (value 64 j + l's fifth bit: bit 2 j of qh[l],
    64 j + 32 + l's: bit 2 j + 1) and 128 bytes of codes as Q4_K's."""
    v16f, v8f = _vec(F, 16), _vec(F, 8)
    blk = _at(builder, a, ib, 176)
    xb = _at(builder, xa, ib, 1024)
    d, dmin = _half_at(builder, blk, 0), _half_at(builder, blk, 2)
    sc, mn = _q4k_scales(builder, blk)
    dsc = builder.fmul(sc, _f32_splat(builder, d, 8))
    qh = [_u16x(builder, blk, 16 + 16 * h) for h in range(2)]
    r = list(accs[:4])
    for j in range(4):
        parts = []
        for h in range(2):                          # l in 16 h .. 16 h + 15
            q = _u16x(builder, blk, 48 + 32 * j + 16 * h)
            b0 = builder.and_(builder.lshr(qh[h], _ci(2 * j)), _ci(1))
            b1 = builder.and_(builder.lshr(qh[h], _ci(2 * j + 1)), _ci(1))
            parts.append((builder.or_(builder.and_(q, _ci(15)), builder.shl(b0, _ci(4))),
                          builder.or_(builder.lshr(q, _ci(4)), builder.shl(b1, _ci(4)))))
        for part in range(2):
            s = 2 * j + part
            xo = 256 * j + 128 * part
            acc = builder.fmul(builder.sitofp(parts[0][part], v16f), _load(builder, xb, v16f, xo))
            acc = _fma(builder, builder.sitofp(parts[1][part], v16f), _load(builder, xb, v16f, xo + 64), acc)
            r[s % 4] = _fma(builder, _splat_lane(builder, dsc, s, 16), acc, r[s % 4])
    mv = builder.fmul(builder.fmul(_f32_splat(builder, dmin, 8), mn), _load(builder, _at(builder, sa, ib, 32), v8f))
    return r + [builder.fadd(mv, accs[4])]


row_q5_k = _row_intrinsic(_q5k_body, [lambda: _vec(F, 16)] * 4 + [lambda: _vec(F, 8)], _q4k_finish)


def _q2k_body(builder, a, ib, xa, sa, accs):
    """84-byte blocks of 256: scales[16] (low nibble a scale, high a min), qs[64], fp16 d and dmin at 80, 82. Value
    128 h + 32 j + l: bits 2 j of qs[32 h + l], its 16-value group's scale and min sc[8 h + 2 j + l // 16];
    w = d * sc * q - dmin * m, as the decoder forms it."""
    v16f = _vec(F, 16)
    blk = _at(builder, a, ib, 84)
    xb = _at(builder, xa, ib, 1024)
    d, dmin = _half_at(builder, blk, 80), _half_at(builder, blk, 82)
    sc = _u16x(builder, blk, 0)
    dl = builder.fmul(builder.uitofp(builder.and_(sc, _ci(15)), v16f), _f32_splat(builder, d, 16))
    ml = builder.fmul(builder.uitofp(builder.lshr(sc, _ci(4)), v16f), _f32_splat(builder, dmin, 16))
    r = list(accs)
    for h in range(2):
        for part in range(2):
            q = _u16x(builder, blk, 16 + 32 * h + 16 * part)
            for j in range(4):
                g = 8 * h + 2 * j + part
                c = builder.uitofp(builder.and_(builder.lshr(q, _ci(2 * j)), _ci(3)), v16f)
                w = builder.fsub(builder.fmul(_splat_lane(builder, dl, g, 16), c), _splat_lane(builder, ml, g, 16))
                x = _load(builder, xb, v16f, 4 * (128 * h + 32 * j + 16 * part))
                r[j] = _fma(builder, w, x, r[j])
    return r


row_q2_k = _row_intrinsic(_q2k_body, [lambda: _vec(F, 16)] * 4, _sum4_finish)


def _q3k_body(builder, a, ib, xa, sa, accs):
    """110-byte blocks of 256: hmask[32], qs[64], 12 bytes of 6-bit scales, fp16 d at 108. Value 128 h + 32 j + l:
    bits 2 j of qs[32 h + l], minus 4 where bit 4 h + j of hmask[l] is clear; its 16-value group's scale
    d * (s_k - 32), k = 8 h + 2 j + l // 16, s_k's low 4 bits from byte 96 + k % 8 (nibble k // 8), high 2 from
    byte 104 + k % 4 (pair k // 4)."""
    v16f = _vec(F, 16)
    blk = _at(builder, a, ib, 110)
    xb = _at(builder, xa, ib, 1024)
    d = _half_at(builder, blk, 108)
    b8 = builder.zext(_load(builder, blk, _vec(I8, 8), 96), _vec(I32, 8))
    b4 = builder.zext(_load(builder, blk, _vec(I8, 4), 104), _vec(I32, 4))
    lo = builder.and_(builder.lshr(_take(builder, b8, [k % 8 for k in range(16)]),
                                   _const(I32, [4 * (k // 8) for k in range(16)])), _ci(15))
    hi = builder.and_(builder.lshr(_take(builder, b4, [k % 4 for k in range(16)]),
                                   _const(I32, [2 * (k // 4) for k in range(16)])), _ci(3))
    s = builder.sub(builder.or_(lo, builder.shl(hi, _ci(4))), _ci(32))
    dl = builder.fmul(builder.sitofp(s, v16f), _f32_splat(builder, d, 16))
    r = list(accs)
    for part in range(2):
        hm = _u16x(builder, blk, 16 * part)
        for h in range(2):
            q = _u16x(builder, blk, 32 + 32 * h + 16 * part)
            for j in range(4):
                k = 8 * h + 2 * j + part
                c = builder.and_(builder.lshr(q, _ci(2 * j)), _ci(3))
                off = builder.shl(builder.xor(builder.and_(builder.lshr(hm, _ci(4 * h + j)), _ci(1)), _ci(1)),
                                  _ci(2))
                w = builder.fmul(_splat_lane(builder, dl, k, 16), builder.sitofp(builder.sub(c, off), v16f))
                x = _load(builder, xb, v16f, 4 * (128 * h + 32 * j + 16 * part))
                r[j] = _fma(builder, w, x, r[j])
    return r


row_q3_k = _row_intrinsic(_q3k_body, [lambda: _vec(F, 16)] * 4, _sum4_finish)


# --- IQ3_XXS, IQ3_S: 4-value grid rows, one 16-byte load each, signs from bits ------------------------------------

def _table_global(builder, name, values, t=F):
    """A constant table (numpy values) as an internal global of the module, made once per module."""
    mod = builder.module
    if name in mod.globals:
        return mod.globals[name]
    at = ir.ArrayType(t, len(values))
    g = ir.GlobalVariable(mod, at, name)
    conv = float if t is F else int
    g.initializer = ir.Constant(at, [ir.Constant(t, conv(v)) for v in values])
    g.global_constant = True
    g.linkage = "internal"
    return g


def _spread(builder, vals, each):
    """The i32 values vals[0], vals[1], .. each repeated `each` times in order: one vector of 16 lanes."""
    v = ir.Constant(_vec(I32, len(vals)), ir.Undefined)
    for i, x in enumerate(vals):
        v = builder.insert_element(v, x, ir.Constant(I32, i))
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                  _const(I32, [i for i in range(len(vals)) for _ in range(each)]))


def _grid_rows16(builder, grid, idx, signs, shifts):
    """16 float32: the four 4-value grid rows idx[0..3] (i32) of the global `grid`, lane j of row r negated where
    bit shifts[r] + j of the i32 signs[r] is set."""
    v4f, v16i = _vec(F, 4), _vec(I32, 16)
    base = builder.bitcast(grid, F.as_pointer())
    rows = [builder.load(builder.bitcast(builder.gep(base, [builder.shl(i, ir.Constant(I32, 2))]),
                                         v4f.as_pointer()), align=4) for i in idx]
    w = _cat(builder, _cat(builder, rows[0], rows[1]), _cat(builder, rows[2], rows[3]))
    sv = _spread(builder, signs, 4)
    bit = builder.shl(builder.and_(builder.lshr(sv, _const(I32, [shifts[r] + j for r in range(4) for j in range(4)])),
                                   _ci(1)), _ci(31))
    return builder.bitcast(builder.xor(builder.bitcast(w, v16i), bit), _vec(F, 16))


def _byte(builder, addr, off):
    return builder.zext(builder.load(builder.inttoptr(builder.add(addr, ir.Constant(I64, off)), I8.as_pointer())),
                        I32)


def _iq3_xxs_body(builder, a, ib, xa, sa, accs):
    """98-byte blocks of 256: fp16 d, 64 grid indices, 8 u32 of scale (top 4 bits) and 4 x 7-bit sign indices into
    KSIGNS. Group g's 32 values: 8 rows, row 2l + h the grid entry of byte 2 + 8 g + 2 l + h, signs
    KSIGNS[(aux_g >> 7 l) & 127] bits 4 h ..; scale d * (0.5 + (aux_g >> 28)) * 0.5."""
    from engine.cpu_decode import GRID_IQ3_XXS, KSIGNS
    v16f = _vec(F, 16)
    blk = _at(builder, a, ib, 98)
    xb = _at(builder, xa, ib, 1024)
    grid = _table_global(builder, "strata_grid_iq3_xxs", GRID_IQ3_XXS)
    ks = builder.bitcast(_table_global(builder, "strata_ksigns", KSIGNS, I8), I8.as_pointer())
    d = _half_at(builder, blk, 0)
    r = list(accs)
    for g in range(8):
        aux = _u32_at(builder, blk, 66 + 4 * g)
        db = builder.fmul(builder.fmul(d, builder.fadd(ir.Constant(F, 0.5), builder.uitofp(
            builder.lshr(aux, ir.Constant(I32, 28)), F))), ir.Constant(F, 0.5))
        acc = None
        for half in range(2):               # l in 2 half, 2 half + 1: 16 values
            idx, signs, shifts = [], [], []
            for l in (2 * half, 2 * half + 1):
                sg = builder.zext(builder.load(builder.gep(ks, [builder.and_(builder.lshr(
                    aux, ir.Constant(I32, 7 * l)), ir.Constant(I32, 127))])), I32)
                for h in range(2):
                    idx.append(_byte(builder, blk, 2 + 8 * g + 2 * l + h))
                    signs.append(sg)
                    shifts.append(4 * h)
            w = _grid_rows16(builder, grid, idx, signs, shifts)
            x = _load(builder, xb, v16f, 4 * (32 * g + 16 * half))
            acc = builder.fmul(w, x) if acc is None else _fma(builder, w, x, acc)
        r[g % 4] = _fma(builder, _f32_splat(builder, db, 16), acc, r[g % 4])
    return r


row_iq3_xxs = _row_intrinsic(_iq3_xxs_body, [lambda: _vec(F, 16)] * 4, _sum4_finish)


def _iq3_s_body(builder, a, ib, xa, sa, accs):
    """110-byte blocks of 256: fp16 d, qs[64] at 2, qh[8] at 66, signs[32] at 74, scales[4] at 106. Row g (4
    values): grid entry qs[g] | bit g % 8 of qh[g // 8] << 8, signs byte 74 + g // 2 bits 4 (g % 2) ..; group s
    (32 values, rows 8 s ..) scaled by d * (1 + 2 * nibble s % 2 of scales[s // 2])."""
    from engine.cpu_decode import GRID_IQ3_S
    v16f = _vec(F, 16)
    blk = _at(builder, a, ib, 110)
    xb = _at(builder, xa, ib, 1024)
    grid = _table_global(builder, "strata_grid_iq3_s", GRID_IQ3_S)
    d = _half_at(builder, blk, 0)
    r = list(accs)
    for s in range(8):
        sc = builder.and_(builder.lshr(_byte(builder, blk, 106 + s // 2), ir.Constant(I32, 4 * (s % 2))),
                          ir.Constant(I32, 15))
        db = builder.fmul(d, builder.uitofp(builder.or_(builder.shl(sc, ir.Constant(I32, 1)), ir.Constant(I32, 1)),
                                            F))
        qh = _byte(builder, blk, 66 + s)
        acc = None
        for half in range(2):
            idx, signs, shifts = [], [], []
            for t in range(4):
                g = 8 * s + 4 * half + t
                hb = builder.and_(builder.lshr(qh, ir.Constant(I32, g % 8)), ir.Constant(I32, 1))
                idx.append(builder.or_(_byte(builder, blk, 2 + g), builder.shl(hb, ir.Constant(I32, 8))))
                signs.append(_byte(builder, blk, 74 + g // 2))
                shifts.append(4 * (g % 2))
            w = _grid_rows16(builder, grid, idx, signs, shifts)
            x = _load(builder, xb, v16f, 4 * (32 * s + 16 * half))
            acc = builder.fmul(w, x) if acc is None else _fma(builder, w, x, acc)
        r[s % 4] = _fma(builder, _f32_splat(builder, db, 16), acc, r[s % 4])
    return r


row_iq3_s = _row_intrinsic(_iq3_s_body, [lambda: _vec(F, 16)] * 4, _sum4_finish)


# --- IQ2_XXS, IQ2_XS, IQ2_S: 8-value grid rows (engine/cpu_expert_kernels.py's _iq2_* block dots, as rows) --------

def _grid8_rows16(builder, grid, idx, signs):
    """16 float32: grid rows idx[0], idx[1] (8 values each) of the global `grid`, value j of row r negated where
    bit j of the i32 signs[r] is set."""
    v8f, v16i = _vec(F, 8), _vec(I32, 16)
    base = builder.bitcast(grid, F.as_pointer())
    rows = [builder.load(builder.bitcast(builder.gep(base, [builder.shl(i, ir.Constant(I32, 3))]),
                                         v8f.as_pointer()), align=4) for i in idx]
    w = _cat(builder, rows[0], rows[1])
    sv = _spread(builder, signs, 8)
    bit = builder.shl(builder.and_(builder.lshr(sv, _const(I32, [j for _ in range(2) for j in range(8)])), _ci(1)),
                      _ci(31))
    return builder.bitcast(builder.xor(builder.bitcast(w, v16i), bit), _vec(F, 16))


def _ksign(builder, ks, v):
    return builder.zext(builder.load(builder.gep(ks, [v])), I32)


def _u16_at(builder, addr, off):
    return builder.zext(builder.load(builder.inttoptr(builder.add(addr, ir.Constant(I64, off)), I16.as_pointer()),
                                     align=1), I32)


def _iq2_row(nbytes, table, rows16):
    """A row of 256-value i-quant blocks: rows16(builder, blk, grid, ks) -> 16 (scale (float), [(idx0, idx1,
    sign0, sign1)]) pairs, one per 16 values in order; the block's sum times d * 0.25."""
    def body(builder, a, ib, xa, sa, accs):
        v16f = _vec(F, 16)
        blk = _at(builder, a, ib, nbytes)
        xb = _at(builder, xa, ib, 1024)
        grid = _table_global(builder, f"strata_grid_{table[0]}", table[1])
        from engine.cpu_decode import KSIGNS
        ks = builder.bitcast(_table_global(builder, "strata_ksigns", KSIGNS, I8), I8.as_pointer())
        r = list(accs)
        for k, (scale, (i0, i1, s0, s1)) in enumerate(rows16(builder, blk, ks)):
            w = _grid8_rows16(builder, grid, (i0, i1), (s0, s1))
            p = builder.fmul(w, _load(builder, xb, v16f, 64 * k))
            r[k % 4] = _fma(builder, _f32_splat(builder, scale, 16), p, r[k % 4])
        d = builder.fmul(_half_at(builder, blk, 0), ir.Constant(F, 0.25))
        return [builder.fmul(_f32_splat(builder, d, 16), v) for v in r]

    def block_sum(builder, a, ib, xa, sa, accs):
        part = body(builder, a, ib, xa, sa, [_zero(_vec(F, 16))] * 4)
        return [builder.fadd(x, y) for x, y in zip(accs, part)]
    return _row_intrinsic(block_sum, [lambda: _vec(F, 16)] * 4, _sum4_finish)


def _half_scale(builder, v):
    return builder.fadd(ir.Constant(F, 0.5), builder.uitofp(v, F))


def _iq2_xxs_rows(builder, blk, ks):
    """66 bytes: group g (32 values) rows bytes 2 + 8 g + l (l < 4), aux = u32 at 6 + 8 g: row l's signs
    KSIGNS[(aux >> 7 l) & 127], scale 0.5 + aux >> 28."""
    out = []
    for g in range(8):
        aux = _u32_at(builder, blk, 6 + 8 * g)
        sc = _half_scale(builder, builder.lshr(aux, ir.Constant(I32, 28)))
        sg = [_ksign(builder, ks, builder.and_(builder.lshr(aux, ir.Constant(I32, 7 * l)), ir.Constant(I32, 127)))
              for l in range(4)]
        for h in range(2):
            out.append((sc, (_byte(builder, blk, 2 + 8 * g + 2 * h), _byte(builder, blk, 3 + 8 * g + 2 * h),
                             sg[2 * h], sg[2 * h + 1])))
    return out


def _iq2_xs_rows(builder, blk, ks):
    """74 bytes: 16-value group g2's rows the u16s at 2 + 4 g2 and 4 + 4 g2 (grid index the low 9 bits, signs
    KSIGNS[the top 7]), scale 0.5 + nibble g2 % 2 of byte 66 + g2 // 2."""
    out = []
    for g2 in range(16):
        q0, q1 = _u16_at(builder, blk, 2 + 4 * g2), _u16_at(builder, blk, 4 + 4 * g2)
        sc = _half_scale(builder, builder.and_(builder.lshr(_byte(builder, blk, 66 + g2 // 2),
                                                            ir.Constant(I32, 4 * (g2 % 2))), ir.Constant(I32, 15)))
        m, n9 = ir.Constant(I32, 511), ir.Constant(I32, 9)
        out.append((sc, (builder.and_(q0, m), builder.and_(q1, m), _ksign(builder, ks, builder.lshr(q0, n9)),
                         _ksign(builder, ks, builder.lshr(q1, n9)))))
    return out


def _iq2_s_rows(builder, blk, ks):
    """82 bytes: rows g = 2 g2, 2 g2 + 1: index byte 2 + g | 2 bits (2 (g % 4)) of byte 66 + g // 4 << 8, signs the
    bytes 34 + g; scale 0.5 + nibble g2 % 2 of byte 74 + g2 // 2."""
    out = []
    for g2 in range(16):
        g = 2 * g2
        hb = _byte(builder, blk, 66 + g // 4)
        i0 = builder.or_(_byte(builder, blk, 2 + g), builder.shl(builder.and_(builder.lshr(
            hb, ir.Constant(I32, 2 * (g % 4))), ir.Constant(I32, 3)), ir.Constant(I32, 8)))
        i1 = builder.or_(_byte(builder, blk, 3 + g), builder.shl(builder.and_(builder.lshr(
            hb, ir.Constant(I32, 2 * (g % 4) + 2)), ir.Constant(I32, 3)), ir.Constant(I32, 8)))
        sc = _half_scale(builder, builder.and_(builder.lshr(_byte(builder, blk, 74 + g2 // 2),
                                                            ir.Constant(I32, 4 * (g2 % 2))), ir.Constant(I32, 15)))
        out.append((sc, (i0, i1, _byte(builder, blk, 34 + g), _byte(builder, blk, 35 + g))))
    return out


def _grids():
    from engine.cpu_decode import GRID_IQ2_S, GRID_IQ2_XS, GRID_IQ2_XXS
    return GRID_IQ2_XXS, GRID_IQ2_XS, GRID_IQ2_S


_G2 = _grids()
row_iq2_xxs = _iq2_row(66, ("iq2_xxs", _G2[0]), _iq2_xxs_rows)
row_iq2_xs = _iq2_row(74, ("iq2_xs", _G2[1]), _iq2_xs_rows)
row_iq2_s = _iq2_row(82, ("iq2_s", _G2[2]), _iq2_s_rows)
