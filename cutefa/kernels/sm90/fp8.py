"""Building blocks of the sm90-family FP8 (e4m3) forward (templates/fwd_sm90_fp8.py.j2): the
tiled MMAs, the shared-memory layouts and the P operand.

FP8 WGMMA reads both shared-memory operands K-major. S = Q K^T is K-major as loaded (head_dim
contiguous in Q and K). For O += P V the contraction runs over keys, so V (keys x head_dim, head_dim
contiguous in memory) is transposed on chip: the producer warpgroup's threads turn each V tile that
TMA landed into Vt (head_dim x keys, keys contiguous) in a second shared-memory ring, with 32-bit
shared loads, byte permutes (PRMT) and 32-bit shared stores.

P is the register A operand of the P V WGMMA. The fp32 accumulator of S gives a thread, per 8-key
block, keys 2t and 2t+1 (t = lane % 4); the e4m3 A operand (k = 32 per instruction) wants keys
4t..4t+3 and 16+4t..16+4t+3. Instead of exchanging values between threads, P is converted in place
and the keys of every 32-key block of Vt are permuted to match (:func:`key_of_a_column`): the sum
over keys of P V does not depend on the order of the keys, and the permutation costs nothing since
the transpose writes Vt anyway.

The other parts, one idea each: the V transposes (fp8_transpose.py: 32-bit accesses;
fp8_wide_transpose.py: 64-bit; fp8_transpose_plan.py: their hoisted swizzled addresses), the online
softmax (fp8_softmax.py), the row sums by MMA (fp8_row_sums.py, sum_mma variants) and the two-level
O accumulation (fp8_two_level.py, two_level variants).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from cutefa.kernels.common.ptx import pure_asm
from cutefa.kernels.sm90.parts import WG_ROWS

FP8 = cutlass.Float8E4M3FN
MMA_K = 32  # k of one fp8 WGMMA

# Register layouts of one warpgroup (threads x values -> (row, col) of the tile, column-major
# index row + 64 * col), as the DSL's fp8 WGMMA atom reports them (a compile test checks).
TV_LAYOUT_A_FP8 = "((4,8,4),(4,2,2)):((256,1,16),(64,8,1024))"  # 64 x 32 A operand from registers
TV_LAYOUT_C_N128 = "((4,8,4),(2,2,16)):((128,1,16),(64,8,512))"  # 64 x 128 fp32 accumulator

# Shared-memory layouts of :func:`smem_layouts` (V as TMA lands it, Vt), byte elements, as the DSL
# prints them, per (tile_n, head_dim, stages) of the committed e4m3 tiles: the CPU tests evaluate
# the hoisted transpose's addresses (:class:`TransposeV`, hoist_vt variants) with them on every
# tile (a compile test checks them against the DSL).
SMEM_LAYOUTS_V_VT = {
    (128, 64, 2): ("S<2,4,3> o 0 o ((8,16),(64,1),(1,2)):((64,512),(1,0),(0,8192))", "S<3,4,3> o 0 o ((8,8),(128,1),(1,2)):((128,1024),(1,0),(0,8192))"),
    (128, 96, 2): ("S<1,4,3> o 0 o ((8,16),(32,3),(1,2)):((32,256),(1,4096),(0,12288))", "S<3,4,3> o 0 o ((8,12),(128,1),(1,2)):((128,1024),(1,0),(0,12288))"),
    (128, 128, 2): ("S<3,4,3> o 0 o ((8,16),(128,1),(1,2)):((128,1024),(1,0),(0,16384))", "S<3,4,3> o 0 o ((8,16),(128,1),(1,2)):((128,1024),(1,0),(0,16384))"),
    (96, 128, 2): ("S<3,4,3> o 0 o ((8,12),(128,1),(1,2)):((128,1024),(1,0),(0,12288))", "S<1,4,3> o 0 o ((8,16),(32,3),(1,2)):((32,256),(1,4096),(0,12288))"),
    (96, 192, 2): ("S<2,4,3> o 0 o ((8,12),(64,3),(1,2)):((64,512),(1,6144),(0,18432))", "S<1,4,3> o 0 o ((8,24),(32,3),(1,2)):((32,256),(1,6144),(0,18432))"),
    (64, 256, 2): ("S<3,4,3> o 0 o ((8,8),(128,2),(1,2)):((128,1024),(1,8192),(0,16384))", "S<2,4,3> o 0 o ((8,32),(64,1),(1,2)):((64,512),(1,0),(0,16384))"),
    (128, 128, 3): ("S<3,4,3> o 0 o ((8,16),(128,1),(1,3)):((128,1024),(1,0),(0,16384))", "S<3,4,3> o 0 o ((8,16),(128,1),(1,3)):((128,1024),(1,0),(0,16384))"),
    (160, 128, 3): ("S<3,4,3> o 0 o ((8,20),(128,1),(1,3)):((128,1024),(1,0),(0,20480))", "S<1,4,3> o 0 o ((8,16),(32,5),(1,3)):((32,256),(1,4096),(0,20480))"),
    (64, 256, 3): ("S<3,4,3> o 0 o ((8,8),(128,2),(1,3)):((128,1024),(1,8192),(0,16384))", "S<2,4,3> o 0 o ((8,32),(64,1),(1,3)):((64,512),(1,0),(0,16384))"),
    (64, 256, 4): ("S<3,4,3> o 0 o ((8,8),(128,2),(1,4)):((128,1024),(1,8192),(0,16384))", "S<2,4,3> o 0 o ((8,32),(64,1),(1,4)):((64,512),(1,0),(0,16384))"),
    (96, 256, 2): ("S<3,4,3> o 0 o ((8,12),(128,2),(1,2)):((128,1024),(1,12288),(0,24576))", "S<1,4,3> o 0 o ((8,32),(32,3),(1,2)):((32,256),(1,8192),(0,24576))"),
    (160, 128, 2): ("S<3,4,3> o 0 o ((8,20),(128,1),(1,2)):((128,1024),(1,0),(0,20480))", "S<1,4,3> o 0 o ((8,16),(32,5),(1,2)):((32,256),(1,4096),(0,20480))"),
    (128, 256, 2): ("S<3,4,3> o 0 o ((8,16),(128,2),(1,2)):((128,1024),(1,16384),(0,32768))", "S<3,4,3> o 0 o ((8,32),(128,1),(1,2)):((128,1024),(1,0),(0,32768))"),
}  # fmt: skip


def key_of_a_column(k: int) -> int:
    """The key (within a 32-key block) whose probability sits at column ``k`` of the P operand.

    A thread's accumulator holds keys 2t, 2t+1 of each 8-key block (rows g, g+8); its A-operand
    registers take columns 4t..4t+3 and 16+4t..16+4t+3. Converting the accumulator in place puts
    keys (2t, 2t+1, 8+2t, 9+2t) of each 16-key half at columns 4t..4t+3 of that half."""
    half, r = divmod(k, 16)
    t, i = divmod(r, 4)
    return 16 * half + 2 * t + (i & 1) + 8 * (i >> 1)


def qk_tiled_mma(tile_n: int):
    """S = Q K^T for one warpgroup: 64 query rows x tile_n keys, e4m3 operands K-major in smem."""
    return sm90_utils.make_trivial_tiled_mma(
        FP8, FP8, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
        Float32, (1, 1, 1), (WG_ROWS, tile_n),
    )  # fmt: skip


def pv_tiled_mma(head_dim: int):
    """O += P V for one warpgroup: P (64 x keys, e4m3) from registers, Vt (head_dim x keys) K-major."""
    return sm90_utils.make_trivial_tiled_mma(
        FP8, FP8, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
        Float32, (1, 1, 1), (WG_ROWS, head_dim), warpgroup.OperandSource.RMEM,
    )  # fmt: skip


def smem_layouts(tile_n: int, head_dim: int, q_slabs: int, stages: int):
    """Swizzled staged layouts: Q (64, d, q_slabs); K and V as TMA lands them (tile_n, d, stages);
    Vt (d, tile_n, stages), the K-major B operand of P V."""
    row = utils.LayoutEnum.ROW_MAJOR
    sq = sm90_utils.make_smem_layout_a(row, (WG_ROWS, tile_n, head_dim), FP8, q_slabs)
    sk = sm90_utils.make_smem_layout_b(row, (WG_ROWS, tile_n, head_dim), FP8, stages)
    svt = sm90_utils.make_smem_layout_b(row, (WG_ROWS, head_dim, tile_n), FP8, stages)
    return sq, sk, sk, svt


def p_fragment(acc_S: cute.Tensor):
    """The e4m3 A-operand fragment ((4,2,2), 1, tile_n/32) of P for the S accumulator ``acc_S``,
    which :func:`convert_p` fills from it in place (see :func:`key_of_a_column`): accumulator value
    (j, r, b) (column pair j, row half r, 8-key block b = 4 kb + 2 h + b1) lands at A register
    j + 2 b1 + 4 r + 8 h of k-block kb (:data:`P_STRIDES`)."""
    kblocks = cute.size(acc_S.layout.shape[0][2]) // 4
    return cute.make_rmem_tensor(cute.make_layout(((4, 2, 2), 1, kblocks), stride=((1, 4, 8), 0, 16)), FP8)


# Offsets in the A-operand fragment of accumulator value (j, r, b1, h, kb): column pair j, row half
# r, and 8-key block b = 4 kb + 2 h + b1 (the fragment is ((4, 2, 2), 1, kblocks) : ((1, 4, 8), 0, 16)).
P_STRIDES = (1, 4, 2, 8, 16)

# Offsets of accumulator value (j, r, b1, h, kb) in the fp32 S fragment (its register order).
ACC_STRIDES = (1, 2, 4, 8, 16)


def p_register_sources(kblocks: int) -> list[tuple[int, int, int, int]]:
    """Per 32-bit register w of the e4m3 P fragment (:func:`p_fragment`, 4 x ``kblocks`` registers),
    the S accumulator offsets (ACC_STRIDES) of its bytes 0..3: value (j, r, b1, h, kb) at rP offset
    P_STRIDES . (j, r, b1, h, kb). Plain integers (the CPU tests check the placement)."""
    sources = [[-1] * 4 for _ in range(4 * kblocks)]
    for kb in range(kblocks):
        for h in range(2):
            for b1 in range(2):
                for r in range(2):
                    for j in range(2):
                        index = (j, r, b1, h, kb)
                        offset = sum(i * s for i, s in zip(index, P_STRIDES))
                        sources[offset // 4][offset % 4] = sum(i * s for i, s in zip(index, ACC_STRIDES))
    return [tuple(w) for w in sources]


@dsl_user_op
def cvt_e4m3_quad(b0: Float32, b1: Float32, b2: Float32, b3: Float32, *, loc=None, ip=None) -> Int32:
    """``b0``..``b3`` rounded to nearest even e4m3 (saturating to +-448, NaN kept), packed into one
    32-bit word, ``b0`` in the lowest byte: two ``cvt.rn.satfinite.e4m3x2.f32`` and a ``mov.b32``
    of the halves (two F2FP and a PRMT in SASS). Every byte of the word is written here, so the
    compiler sees no dependence on the register's previous value."""
    operands = [Float32(x).ir_value(loc=loc, ip=ip) for x in (b1, b0, b3, b2)]
    return Int32(
        pure_asm(
            T.i32(),
            operands,
            # In each cvt the first source goes to the upper byte of the 16-bit result.
            "{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, $1, $2;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $3, $4;\nmov.b32 $0, {lo, hi};\n}",
            "=r,f,f,f,f",
            loc=loc,
            ip=ip,
        )
    )


@cute.jit
def convert_p(acc_S: cute.Tensor, rP: cute.Tensor):
    """P (the fp32 S fragment after the softmax) to e4m3 into ``rP`` (:func:`p_fragment`), one 32-bit
    A register at a time from its four scores (:func:`cvt_e4m3_quad`), so that no register is built
    from byte inserts into its previous contents (the DSL's lowering of a tensor store through a
    view with P_STRIDES left ~19 PRMT per key block, and a dependence of each key block's first P
    register on the last one)."""
    kblocks = cute.size(acc_S.layout.shape[0][2]) // 4
    sources = p_register_sources(kblocks)
    acc = cute.make_tensor(acc_S.iterator, cute.make_layout(cute.size(acc_S)))
    words = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=Int32), cute.make_layout(4 * kblocks))
    for w in cutlass.range_constexpr(4 * kblocks):
        b0, b1, b2, b3 = sources[w]
        words[w] = cvt_e4m3_quad(acc[b0], acc[b1], acc[b2], acc[b3])


__all__ = [
    "ACC_STRIDES",
    "FP8",
    "MMA_K",
    "P_STRIDES",
    "SMEM_LAYOUTS_V_VT",
    "TV_LAYOUT_A_FP8",
    "TV_LAYOUT_C_N128",
    "convert_p",
    "cvt_e4m3_quad",
    "key_of_a_column",
    "p_fragment",
    "p_register_sources",
    "pv_tiled_mma",
    "qk_tiled_mma",
    "smem_layouts",
]
