"""numba intrinsics for the CPU expert kernels: 32-bit integer ops, raw pointers, and the SIMD dot products.

numba widens integer arithmetic to 64 bits (half the SIMD lanes) and has no vector types, and a float sum it may
vectorize only under fast-math, whose order then depends on what LLVM inlines: a kernel compiled in a fresh
process (callees inlined) and one loaded from numba's cache (callees called) summed in different orders, so their
results differed in the last bits. So every sum here is written out in LLVM IR: products in vectors, lanes
accumulated in a loop, and one fixed halving tree at the end, with strict IEEE operations that no optimization may
reorder. The result is the same bits whatever is inlined, cached or threaded (tests/test_cpu_experts.py).

vdot is the plain float32 dot; the others dot x with a block's codes without a float32 copy of the weights:
_lut16_blocks and _nvfp4_block (4-bit codes through a 16-entry table, SSSE3 pshufb: MXFP4, NVFP4, IQ4_NL, IQ4_XS,
Q4_0; without AVX-512, where engine/cpu_rows.py's vpermps rows cannot run), crumbs_dot (Q2_0's 2-bit codes) and
bits_dot (Q1_0's signs). Accumulating a whole block in one vector before its one tree is what made them fast (Q6_K
2.2 -> 7.5 GB/s a thread against decoding the row first); engine/cpu_rows.py goes further (a row's sums in vectors,
one tree a row). The callers (engine/cpu_expert_kernels.py) apply the blocks' own scales.
"""
from __future__ import annotations

from llvmlite import binding as llvm_binding, ir
from numba import carray, njit, types
from numba.extending import intrinsic

HAS_PSHUFB = bool(llvm_binding.get_host_cpu_features().get("ssse3", False))   # x86 CPUs since 2006

I8, I32, F = ir.IntType(8), ir.IntType(32), ir.FloatType()


def _as_i32(builder, val, ty):
    if ty.bitwidth == 32:
        return val
    if ty.bitwidth < 32:
        return builder.sext(val, I32) if ty.signed else builder.zext(val, I32)
    return builder.trunc(val, I32)


def _i32_op(op):
    @intrinsic
    def f(typingctx, a, b):
        if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, op)(_as_i32(builder, args[0], a), _as_i32(builder, args[1], b))
        return types.int32(a, b), codegen
    return f


band, bor, shr, shl, isub = (_i32_op(op) for op in ("and_", "or_", "lshr", "shl", "sub"))


@intrinsic
def i32(typingctx, a):
    """An integer as int32 (sign- or zero-extended, or truncated)."""
    if not isinstance(a, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _as_i32(builder, args[0], a)
    return types.int32(a), codegen


@intrinsic
def f32_bits(typingctx, bits):
    """The float32 whose bits are the low 32 of an integer."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(_as_i32(builder, args[0], bits), F)
    return types.float32(bits), codegen


@intrinsic
def f16_to_f32(typingctx, bits):
    """IEEE half (the low 16 bits) to float32, exactly (fpext: F16C's vcvtph2ps)."""
    def codegen(context, builder, sig, args):
        h = builder.bitcast(builder.trunc(_as_i32(builder, args[0], bits), ir.IntType(16)), ir.HalfType())
        return builder.fpext(h, F)
    return types.float32(bits), codegen


def _ptr(numba_type):
    @intrinsic
    def f(typingctx, addr):
        if not isinstance(addr, types.Integer):
            return None
        ptr_type = types.CPointer(numba_type)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr_type))
        return ptr_type(addr), codegen
    return f


ptr_u8, ptr_i8, ptr_u16, ptr_f32, ptr_u64 = (_ptr(t) for t in (types.uint8, types.int8, types.uint16,
                                                                types.float32, types.uint64))


@intrinsic
def prefetch(typingctx, addr):
    """Ask for the cache line at an address (llvm.prefetch: read, keep in all levels)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i8p = I8.as_pointer()
        fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [i8p] + [I32] * 3))
        builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(I32, 0), ir.Constant(I32, 3),
                          ir.Constant(I32, 1)])
        return context.get_dummy_value()
    return types.none(addr), codegen


@njit(inline="always")
def prefetch_rows(a, nbytes):
    for o in range(0, nbytes, 64):
        prefetch(a + o)


# --- IR helpers ---------------------------------------------------------------------------------------------------

def _vec(t, n):
    return ir.VectorType(t, n)


def _const(t, values):
    return ir.Constant(_vec(t, len(values)), [ir.Constant(t, int(v) if isinstance(t, ir.IntType) else v)
                                              for v in values])


def _load(builder, addr, vtype, offset=0):
    a = builder.add(addr, ir.Constant(addr.type, offset)) if offset else addr
    return builder.load(builder.inttoptr(a, vtype.as_pointer()), align=1)


def _splat(builder, v, n):
    one = builder.insert_element(ir.Constant(_vec(v.type, n), ir.Undefined), v, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(_vec(v.type, n), ir.Undefined), _const(I32, [0] * n))


def _take(builder, v, idx):
    """The lanes idx of v (a shufflevector of one vector)."""
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), _const(I32, idx))


def _cat(builder, a, b):
    n = a.type.count
    return builder.shuffle_vector(a, b, _const(I32, range(2 * n)))


def _tree_sum(builder, v):
    """The lanes of a float vector summed by halving: lanes i and i + n/2 first. A fixed order."""
    n = v.type.count
    while n > 1:
        n //= 2
        v = builder.fadd(_take(builder, v, range(n)), _take(builder, v, range(n, 2 * n)))
    return builder.extract_element(v, ir.Constant(I32, 0))


def _fmuladd(builder, acc, a, b):
    """acc + a * b, rounded twice (no fusing: the same bits on every CPU)."""
    return builder.fadd(acc, builder.fmul(a, b))


# --- the dots -----------------------------------------------------------------------------------------------------

LANES = 16


@intrinsic
def vdot_blocks(typingctx, a, b, n16):
    """The dot of n16 * 16 float32 at addresses a and b: 16 lane accumulators over the chunks, then _tree_sum."""
    def codegen(context, builder, sig, args):
        vf = _vec(F, LANES)
        a0, b0, n = args
        pre = builder.block
        loop = builder.append_basic_block("vdot.loop")
        done = builder.append_basic_block("vdot.done")
        zero = ir.Constant(vf, [ir.Constant(F, 0.0)] * LANES)
        builder.cbranch(builder.icmp_signed(">", n, ir.Constant(n.type, 0)), loop, done)
        builder.position_at_end(loop)
        i = builder.phi(n.type)
        acc = builder.phi(vf)
        off = builder.mul(i, ir.Constant(n.type, 4 * LANES))
        nxt = _fmuladd(builder, acc, _load(builder, builder.add(a0, off), vf), _load(builder, builder.add(b0, off), vf))
        i1 = builder.add(i, ir.Constant(n.type, 1))
        i.add_incoming(ir.Constant(n.type, 0), pre)
        i.add_incoming(i1, loop)
        acc.add_incoming(zero, pre)
        acc.add_incoming(nxt, loop)
        builder.cbranch(builder.icmp_signed("<", i1, n), loop, done)
        builder.position_at_end(done)
        res = builder.phi(vf)
        res.add_incoming(zero, pre)
        res.add_incoming(nxt, loop)
        return _tree_sum(builder, res)
    return types.float32(a, b, n16), codegen


@njit(inline="always")
def vdot(a, b, n):
    """float32 dot of n values at addresses a and b: 16-lane chunks (vdot_blocks), then the tail in order."""
    m = n // LANES
    s = vdot_blocks(a, b, m)
    u, v = carray(ptr_f32(a), n), carray(ptr_f32(b), n)
    for i in range(m * LANES, n):
        s += u[i] * v[i]
    return s


def _lut16_blocks(table, n_sub: int, stride: int):
    """f(qa, xa, s_0 .. s_{n_sub-1}) -> float32 for n_sub in 1, 2, 8: n_sub groups of 16 bytes of 4-bit codes, group
    i at qa + i * stride (low nibbles its values 0..15, high ones 16..31), through the 16-entry table, dotted with
    32 * n_sub float32 at xa, group i scaled by s_i; one tree for all (MXFP4 and IQ4_NL two blocks a call, IQ4_XS a
    block's 8 groups)."""
    codes = [int(v) & 0xFF for v in table]

    def codegen(context, builder, sig, args):
        v16b, v32f = _vec(I8, 16), _vec(F, 32)
        pshufb = builder.module.declare_intrinsic("llvm.x86.ssse3.pshuf.b.128",
                                                  fnty=ir.FunctionType(v16b, [v16b, v16b]))
        nib, tab = _const(I8, [15] * 16), _const(I8, codes)
        acc = None
        for i in range(n_sub):
            q = _load(builder, args[0], v16b, i * stride)
            lo = builder.call(pshufb, [tab, builder.and_(q, nib)])
            hi = builder.call(pshufb, [tab, builder.and_(builder.lshr(q, _const(I8, [4] * 16)), nib)])
            w = builder.sitofp(_cat(builder, lo, hi), v32f)
            p = builder.fmul(builder.fmul(w, _load(builder, args[1], v32f, 128 * i)), _splat(builder, args[2 + i], 32))
            acc = p if acc is None else builder.fadd(acc, p)
        return _tree_sum(builder, acc)

    f32 = types.float32
    if n_sub == 1:
        @intrinsic
        def f(typingctx, qa, xa, s0):
            return f32(qa, xa, f32), codegen
    elif n_sub == 2:
        @intrinsic
        def f(typingctx, qa, xa, s0, s1):
            return f32(qa, xa, f32, f32), codegen
    elif n_sub == 8:
        @intrinsic
        def f(typingctx, qa, xa, s0, s1, s2, s3, s4, s5, s6, s7):
            return f32(qa, xa, *(f32,) * 8), codegen
    else:
        raise ValueError(f"groups a call: 1, 2 or 8, not {n_sub}")
    return f


def _nvfp4_block(table):
    """f(qa, xa, d0, d1, d2, d3) -> float32: an NVFP4 block's 32 bytes of E2M1 codes at qa (16-value sub-block s in
    bytes 8s..8s+7: low nibbles its values 0..7, high ones 8..15) dotted with 64 float32 at xa, sub-block s scaled
    by d_s; one tree for the block."""
    codes = [int(v) & 0xFF for v in table]

    @intrinsic
    def f(typingctx, qa, xa, d0, d1, d2, d3):
        def codegen(context, builder, sig, args):
            v16b, v64f = _vec(I8, 16), _vec(F, 64)
            pshufb = builder.module.declare_intrinsic("llvm.x86.ssse3.pshuf.b.128",
                                                      fnty=ir.FunctionType(v16b, [v16b, v16b]))
            nib, tab = _const(I8, [15] * 16), _const(I8, codes)
            parts = []
            for h in range(2):                  # bytes 16h..16h+15: sub-blocks 2h and 2h+1
                q = _load(builder, args[0], v16b, 16 * h)
                lo = builder.call(pshufb, [tab, builder.and_(q, nib)])
                hi = builder.call(pshufb, [tab, builder.and_(builder.lshr(q, _const(I8, [4] * 16)), nib)])
                parts.append(_take(builder, _cat(builder, lo, hi), (*range(8), *range(16, 24), *range(8, 16),
                                                                    *range(24, 32))))
            w = builder.sitofp(_cat(builder, parts[0], parts[1]), v64f)
            sv = _cat(builder, _cat(builder, _splat(builder, args[2], 16), _splat(builder, args[3], 16)),
                      _cat(builder, _splat(builder, args[4], 16), _splat(builder, args[5], 16)))
            return _tree_sum(builder, builder.fmul(builder.fmul(w, _load(builder, args[1], v64f)), sv))
        return types.float32(qa, xa, *(types.float32,) * 4), codegen
    return f


@intrinsic
def crumbs_dot(typingctx, qa, xa):
    """16 bytes of 2-bit codes at qa (value 4i + k: bits 2k of byte i), each minus 1, dotted with 64 float32 at xa
    (a Q2_0 block)."""
    def codegen(context, builder, sig, args):
        v64f = _vec(F, 64)
        q = _load(builder, args[0], _vec(I8, 16))
        spread = _take(builder, q, [j // 4 for j in range(64)])           # lane j holds byte j // 4
        c = builder.and_(builder.lshr(spread, _const(I8, [2 * (j % 4) for j in range(64)])), _const(I8, [3] * 64))
        w = builder.sitofp(builder.sub(c, _const(I8, [1] * 64)), v64f)
        return _tree_sum(builder, builder.fmul(w, _load(builder, args[1], v64f)))
    return types.float32(qa, xa), codegen


@intrinsic
def bits_dot(typingctx, qa, xa):
    """16 bytes of sign bits at qa (value j: bit j % 8 of byte j // 8; set: +x, clear: -x) summed with 128 float32
    at xa (a Q1_0 block, before its scale)."""
    def codegen(context, builder, sig, args):
        n = 128
        v128i, v128f = _vec(I32, n), _vec(F, n)
        q = _load(builder, args[0], _vec(I8, 16))
        spread = _take(builder, q, [j // 8 for j in range(n)])
        bit = builder.and_(builder.lshr(spread, _const(I8, [j % 8 for j in range(n)])), _const(I8, [1] * n))
        sign = builder.shl(builder.zext(builder.xor(bit, _const(I8, [1] * n)), v128i), _const(I32, [31] * n))
        x = builder.bitcast(_load(builder, args[1], v128f), v128i)
        return _tree_sum(builder, builder.bitcast(builder.xor(x, sign), v128f))
    return types.float32(qa, xa), codegen
