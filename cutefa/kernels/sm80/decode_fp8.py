"""The e4m3 KV cache of the sm80-family decode kernel (templates/decode_sm80.py.j2, ``kv_e4m3``).

K and V tiles are cp.async'd as e4m3 bytes into their own shared-memory stages (16 bytes a copy,
the same thread layout as the 16-bit copies), and each thread widens the chunks it copied itself
(visible to it once its cp.async group has completed, before any barrier) to q's dtype, into one
16-bit K and one 16-bit V tile that the unchanged mma.sync/ldmatrix path reads. The widening is
exact: every e4m3 value is a float16 and a bfloat16 (``cvt.rn.f16x2.e4m3x2``, sm_89 and newer;
bfloat16 through float32). The descales stay out of the tile: ``k_descale`` multiplies the exp2
scale of the scores and ``v_descale`` the normalised output rows.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from cutefa.kernels.common.ptx import pure_asm

FP8 = cutlass.Float8E4M3FN
COPY_BITS = 128
CHUNK = COPY_BITS // 8  # e4m3 elements in one 16-byte copy


def fp8_smem_layout(rows: int, head_dim: int, stages: int):
    """Row-major (rows, head_dim, stages) bytes: only cp.async writes and each thread's own 16-byte
    reads touch it, so it needs no swizzle for ldmatrix."""
    return cute.make_layout((rows, head_dim, stages), stride=(head_dim, 1, rows * head_dim))


def g2s_tiled_copy(threads: int, threads_per_row: int):
    """cp.async (bypassing L1) of 16 e4m3 bytes per thread and step, ``threads_per_row`` threads side
    by side on a row."""
    atom = cute.make_copy_atom(
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), FP8, num_bits_per_copy=COPY_BITS
    )
    thr = cute.make_layout((threads // threads_per_row, threads_per_row), stride=(threads_per_row, 1))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, CHUNK)))


def widen_tiled_copy(dtype, threads: int, threads_per_row: int):
    """The 16-bit stores of the widened chunks: the thread and value layouts of
    :func:`g2s_tiled_copy` (so a thread's partitions of the e4m3 and the 16-bit tiles hold the same
    coordinates), two 16-byte vectors a chunk."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=COPY_BITS)
    thr = cute.make_layout((threads // threads_per_row, threads_per_row), stride=(threads_per_row, 1))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, CHUNK)))


@dsl_user_op
def _e4m3x2_to_f16x2(word: Int32, high: bool, *, loc=None, ip=None) -> Int32:
    """Two e4m3 bytes of ``word`` (its low half, or its high half) as two float16 (lower byte in the
    lower half)."""
    half = "hi" if high else "lo"
    return Int32(
        pure_asm(
            T.i32(),
            [Int32(word).ir_value(loc=loc, ip=ip)],
            f"{{\n.reg .b16 lo, hi;\nmov.b32 {{lo, hi}}, $1;\ncvt.rn.f16x2.e4m3x2 $0, {half};\n}}",
            "=r,r",
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def _e4m3x2_to_bf16x2(word: Int32, high: bool, *, loc=None, ip=None) -> Int32:
    """As :func:`_e4m3x2_to_f16x2`, as two bfloat16 (through float32: exact)."""
    half = "hi" if high else "lo"
    return Int32(
        pure_asm(
            T.i32(),
            [Int32(word).ir_value(loc=loc, ip=ip)],
            "{\n.reg .b16 lo, hi, a, b;\n.reg .b32 h;\n.reg .f32 fa, fb;\nmov.b32 {lo, hi}, $1;\n"
            f"cvt.rn.f16x2.e4m3x2 h, {half};\nmov.b32 {{a, b}}, h;\ncvt.f32.f16 fa, a;\ncvt.f32.f16 fb, b;\n"
            "cvt.rn.bf16x2.f32 $0, fb, fa;\n}",
            "=r,r",
            loc=loc,
            ip=ip,
        )
    )


@cute.jit
def widen(src: cute.Tensor, dst: cute.Tensor, bf16: cutlass.Constexpr):
    """This thread's (CPY, ROWS, COLS) partition ``src`` of an e4m3 tile (16 bytes a CPY) into its
    partition ``dst`` of the 16-bit tile (:func:`widen_tiled_copy`: the same coordinates), converted
    to bfloat16 (``bf16``) or float16."""
    # a row at a time (not unrolled): the chunks of one row live in registers, not the whole tile's
    for m in cutlass.range(cute.size(src, mode=[1]), unroll=1):
        for k in cutlass.range_constexpr(cute.size(src, mode=[2])):
            r8 = cute.make_fragment_like(src[None, m, k])
            cute.autovec_copy(src[None, m, k], r8)
            r16 = cute.make_fragment_like(dst[None, m, k])
            w8 = cute.make_tensor(cute.recast_ptr(r8.iterator, dtype=Int32), cute.make_layout(CHUNK // 4))
            w16 = cute.make_tensor(cute.recast_ptr(r16.iterator, dtype=Int32), cute.make_layout(CHUNK // 2))
            for i in cutlass.range_constexpr(CHUNK // 4):
                if cutlass.const_expr(bf16):
                    w16[2 * i] = _e4m3x2_to_bf16x2(w8[i], False)
                    w16[2 * i + 1] = _e4m3x2_to_bf16x2(w8[i], True)
                else:
                    w16[2 * i] = _e4m3x2_to_f16x2(w8[i], False)
                    w16[2 * i + 1] = _e4m3x2_to_f16x2(w8[i], True)
            cute.autovec_copy(r16, dst[None, m, k])
