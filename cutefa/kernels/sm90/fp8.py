"""Building blocks of the sm90-family FP8 (e4m3) forward (templates/fwd_sm90_fp8.py.j2).

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
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from cutefa.kernels.common.exp2 import exp2_fma
from cutefa.kernels.common.lazy_rescale import block_row_maxes, warp_moves_max
from cutefa.kernels.common.ptx import pure_asm
from cutefa.kernels.common.softmax import LN_2, quad_allreduce_max, quad_allreduce_sum
from cutefa.kernels.sm90.parts import WG_ROWS, WG_THREADS

FP8 = cutlass.Float8E4M3FN
MMA_K = 32  # k of one fp8 WGMMA
# P = exp2(score - max + P_OFFSET_LOG2) lies in [0, 2^8]: e4m3 keeps 3 mantissa bits down to 2^-6,
# so shifting P up by 2^8 keeps probabilities down to 2^-14 normal instead of flushing them to
# e4m3 subnormals (max e4m3 is 448 > 256). Row sums carry the same factor, so it cancels in O; the
# LSE subtracts it.
P_OFFSET_LOG2 = 8.0
# lazy_rescale variants: a warp keeps its rows' running maxes until a key block raises some row's
# max by more than LAZY_RESCALE_LOG2 (log2 units); only then are its maxes, row sums and O rescaled
# (one warp-uniform branch; after the first key blocks almost never). P = exp2(score - kept max +
# LAZY_P_OFFSET_LOG2) then stays below 2^(4 + 4) = 256 as the default's does (probabilities down to
# 2^-10 of a fresh row max stay normal). Exact: the max only offsets the exponents that the row sums
# and the LSE are taken against.
LAZY_RESCALE_LOG2 = 4.0
LAZY_P_OFFSET_LOG2 = 4.0


def p_offset_log2(lazy: bool) -> float:
    """The shift of P (log2) of a variant with or without lazy_rescale."""
    return LAZY_P_OFFSET_LOG2 if lazy else P_OFFSET_LOG2

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


# sum_mma variants: the row sums of P come from one more WGMMA per key block, P (64 x tile_n, e4m3,
# the same register A operand as for P V) times a constant tile_n x SUM_COLS block of e4m3 ones in
# shared memory (the smallest WGMMA N), into a fresh fp32 accumulator; every column of a row holds
# the row's sum, which the caller adds to its fp32 running sum (so the tensor core's accumulation
# precision applies within one key block only).
SUM_COLS = 8
E4M3_ONE_WORD = 0x38383838  # four e4m3 1.0 bytes


def sum_tiled_mma():
    """Row sums of P for one warpgroup: P (64 x keys, e4m3) from registers times a SUM_COLS x keys
    block of ones (K-major in shared memory); see :data:`SUM_COLS`."""
    return pv_tiled_mma(SUM_COLS)


def ones_layout(tile_n: int):
    """The shared-memory layout of the ones operand of :func:`sum_tiled_mma` (SUM_COLS x tile_n,
    K-major, one stage). Every byte is e4m3 1.0, so its swizzle does not matter to its contents."""
    row = utils.LayoutEnum.ROW_MAJOR
    return sm90_utils.make_smem_layout_b(row, (WG_ROWS, SUM_COLS, tile_n), FP8, 1)


@cute.jit
def fill_ones(words: cute.Tensor, tid, threads: cutlass.Constexpr):
    """Every 32-bit word of ``words`` (a flat view of the ones operand) set to four e4m3 1.0 bytes
    by ``threads`` threads (thread ``tid`` takes words tid, tid + threads, ...)."""
    count = cute.size(words)
    for i in cutlass.range_constexpr((count + threads - 1) // threads):
        w = tid + i * threads
        if w < count:
            words[w] = cutlass.Uint32(E4M3_ONE_WORD)


@cute.jit
def add_block_sums(row_sum: cute.Tensor, acc_L: cute.Tensor, corr: cute.Tensor):
    """row_sum = (row_sum + the block's sums) * corr, per row (sum_mma, overlap schedule: the block
    summed is the one whose P V just finished, taken at the running max before this step's
    softmax, which ``corr`` moves to the new one). ``acc_L`` is the 64 x SUM_COLS accumulator of
    :func:`sum_tiled_mma`: a thread's values (column pair, row half), row half r first at 2 r."""
    for r in cutlass.range_constexpr(cute.size(row_sum)):
        row_sum[r] = (row_sum[r] + acc_L[2 * r]) * corr[r]


@cute.jit
def add_last_sums(row_sum: cute.Tensor, acc_L: cute.Tensor):
    """row_sum += the last key block's sums (sum_mma, after the loop; see :func:`add_block_sums`)."""
    for r in cutlass.range_constexpr(cute.size(row_sum)):
        row_sum[r] = row_sum[r] + acc_L[2 * r]


# two_level variants: the e4m3 tensor cores accumulate with fewer mantissa bits than fp32 (each
# product aligned to the accumulator and cut short), so O accumulated over n keys in one WGMMA
# accumulator loses about n * 2^-16 of itself where V's columns carry a mean (25% at 16k keys;
# docs/perf-notes.md). Every PROMOTE_BLOCKS key blocks each consumer thread adds its O accumulator
# into an fp32 copy in shared memory (its own slots) and restarts it from zero, so that the tensor
# cores sum at most PROMOTE_BLOCKS blocks.
PROMOTE_BLOCKS = 4
O32_CHUNK = 4  # fp32 values of one 16-byte access


def o32_layout(head_dim: int, consumers: int):
    """The fp32 shared-memory copy of O (two_level): a consumer thread's head_dim / 2 accumulator
    values in 16-byte chunks, chunk j of the warpgroup's 128 threads side by side (a warp's access is
    512 contiguous bytes): (O32_CHUNK, threads, chunks, consumers)."""
    chunks = head_dim // 2 // O32_CHUNK
    return cute.make_layout(
        (O32_CHUNK, WG_THREADS, chunks, consumers),
        stride=(1, O32_CHUNK, O32_CHUNK * WG_THREADS, O32_CHUNK * WG_THREADS * chunks),
    )


@cute.jit
def zero_o32(o32: cute.Tensor):
    """A thread's fp32 O slots (``o32``: (O32_CHUNK, chunks)) set to zero."""
    zeros = cute.make_rmem_tensor((O32_CHUNK,), Float32)
    zeros.fill(0.0)
    for j in cutlass.range_constexpr(cute.size(o32, mode=[1])):
        cute.autovec_copy(zeros, o32[None, j])


@cute.jit
def promote_o(acc_O: cute.Tensor, o32: cute.Tensor, o32_scale: cute.Tensor, merge: cutlass.Constexpr = False):
    """o32 = o32 * o32_scale[row] + acc_O per value, and o32_scale = 1 (two_level; the caller's
    next P V then overwrites acc_O: its first k-block's scale-d is 0). With ``merge`` (the
    epilogue) the sum goes to acc_O instead. Accumulator value v (flat index of the ((2, 2, n), 1,
    1) fragment: column pair, row half, 8-column block) sits in chunk v // 4 at v % 4, so row half
    (v % 4) // 2."""
    for j in cutlass.range_constexpr(cute.size(o32, mode=[1])):
        part = cute.make_rmem_tensor((O32_CHUNK,), Float32)
        cute.autovec_copy(o32[None, j], part)
        for e in cutlass.range_constexpr(O32_CHUNK):
            v = j * O32_CHUNK + e
            part[e] = part[e] * o32_scale[e // 2] + acc_O[v]
            if cutlass.const_expr(merge):
                acc_O[v] = part[e]
        if cutlass.const_expr(not merge):
            cute.autovec_copy(part, o32[None, j])
    if cutlass.const_expr(not merge):
        for r in cutlass.range_constexpr(cute.size(o32_scale)):
            o32_scale[r] = Float32(1.0)


@cute.jit
def scale_rows(o32_scale: cute.Tensor, corr: cute.Tensor):
    """o32_scale[r] *= corr[r]: the shared-memory copy of O follows the rescales of the registers'."""
    for r in cutlass.range_constexpr(cute.size(corr)):
        o32_scale[r] = o32_scale[r] * corr[r]


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


def transpose_unit(tid, i, head_dim: int):
    """The unit of thread ``tid`` (of 128) in step ``i`` of :func:`transpose_v`: (first source key
    row, head-dim word dq, Vt key word kq). The thread reads V rows key0 + (0, 1, 8, 9) at word dq
    and writes Vt rows 4 dq + (0..3) at word kq. Plain integer arithmetic: the same function runs
    in the kernel and in the CPU tests.

    A warp covers 4 head-dim words x 8 key words (one 32-key block), so each side sees at most
    2-way bank conflicts under the 128-byte swizzle."""
    warp = tid // 32
    lane = tid % 32
    d_tiles = head_dim // 16
    wt = warp + 4 * i
    kq_lane = lane // 4  # half h = kq_lane // 4 and t = kq_lane % 4 of key_of_a_column
    kb = wt // d_tiles
    dq = (wt % d_tiles) * 4 + lane % 4
    key0 = kb * 32 + 16 * (kq_lane // 4) + 2 * (kq_lane % 4)
    return key0, dq, kb * 8 + kq_lane


def transpose_steps(tile_n: int, head_dim: int) -> int:
    """Steps of :func:`transpose_v`: (head_dim / 16) x (tile_n / 32) warp tiles over 4 warps."""
    return (head_dim // 16) * (tile_n // 32) // 4


# Byte selectors of the 4x4 byte transpose: PRMT(a, b, sel) picks bytes of (b:a) by nibble.
PRMT_LO_PAIRS, PRMT_HI_PAIRS = 0x5140, 0x7362  # interleave bytes 0,1 / 2,3 of a and b
PRMT_LO_HALVES, PRMT_HI_HALVES = 0x5410, 0x7632  # low / high 16 bits of a and b


@cute.jit
def transpose_v(
    sV: cute.Tensor,
    sVt: cute.Tensor,
    tid: cutlass.Int32,
    tile_n: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
):
    """Vt[d, 32 kb + k] = V[32 kb + key_of_a_column(k), d] for one stage, by the 128 threads of a
    warpgroup. ``sV`` (tile_n, d / 4) and ``sVt`` (d, tile_n / 4) are 32-bit views (4 e4m3 a word).

    A thread's unit (:func:`transpose_unit`) is 4 keys x 4 head dims: 4 word loads from 4 key rows,
    a 4x4 byte transpose (8 PRMT), 4 word stores into 4 head-dim rows."""
    for i in cutlass.range(transpose_steps(tile_n, head_dim), unroll=2):
        key0, dq, kq = transpose_unit(tid, i, head_dim)
        w0 = cutlass.Int32(sV[key0, dq])
        w1 = cutlass.Int32(sV[key0 + 1, dq])
        w2 = cutlass.Int32(sV[key0 + 8, dq])
        w3 = cutlass.Int32(sV[key0 + 9, dq])
        t0 = cutlass.Int32(cute.arch.prmt(w0, w1, PRMT_LO_PAIRS))
        t1 = cutlass.Int32(cute.arch.prmt(w0, w1, PRMT_HI_PAIRS))
        t2 = cutlass.Int32(cute.arch.prmt(w2, w3, PRMT_LO_PAIRS))
        t3 = cutlass.Int32(cute.arch.prmt(w2, w3, PRMT_HI_PAIRS))
        sVt[dq * 4 + 0, kq] = cutlass.Uint32(cute.arch.prmt(t0, t2, PRMT_LO_HALVES))
        sVt[dq * 4 + 1, kq] = cutlass.Uint32(cute.arch.prmt(t0, t2, PRMT_HI_HALVES))
        sVt[dq * 4 + 2, kq] = cutlass.Uint32(cute.arch.prmt(t1, t3, PRMT_LO_HALVES))
        sVt[dq * 4 + 3, kq] = cutlass.Uint32(cute.arch.prmt(t1, t3, PRMT_HI_HALVES))


# The key rows of a 32-bit unit, relative to its first key, in canonical word order.
UNIT_ROWS = (0, 1, 8, 9)


def unit_row(j):
    """UNIT_ROWS[j] by arithmetic (j may be a DSL Int32)."""
    return (j & 1) + 8 * (j >> 1)


# Lane masks of the hoisted 32-bit transpose (:class:`TransposeV`), per tile_n: ((load bit 0, load
# bit 1), (store bit 0, store bit 1)), each the lane bit (0-4) that sets that bit of the thread's
# load / store order mask, or None. Load e of a unit reads its word UNIT_ROWS[e ^ mL], store e
# writes Vt row 4 dq + (e ^ mS). Without them a warp's 32-bit accesses fall on 4 distinct swizzle
# chunk XORs per 8 rows (all its units start at even key rows, and its Vt rows 4 dq + e repeat mod
# 8): 2 wavefronts per load, 2-4 per store. With them every load and store of every committed
# tile takes one wavefront (tests/test_fp8_layout.py checks each one). Found by searching the
# lane bits against the layouts.
TRANSPOSE_LANE_MASKS = {
    64: ((4, None), (1, None)),
    96: ((4, None), (0, 1)),
    128: ((4, None), (None, 1)),
    160: ((4, None), (0, 1)),
}
NO_LANE_MASKS = ((None, None), (None, None))


def lane_masks(lane, masks):
    """(mL, mS) of a lane under ``masks`` (an entry of TRANSPOSE_LANE_MASKS): plain integer
    arithmetic on an int or a DSL Int32."""

    def bits(pair):
        value = 0
        for position, lane_bit in enumerate(pair):
            if lane_bit is not None:
                value = value | (((lane >> lane_bit) & 1) << position)
        return value

    return bits(masks[0]), bits(masks[1])


def transpose_words(tid, i, head_dim: int, masks=NO_LANE_MASKS):
    """The 4 V word coordinates (key, dq) that unit ``i`` of thread ``tid`` loads and the 4 Vt
    word coordinates (head-dim row, kq) it stores, in the order of :class:`TransposeV`'s loads
    and stores (the unit of :func:`transpose_unit`; ``masks`` permute the order per lane, see
    TRANSPOSE_LANE_MASKS)."""
    key0, dq, kq = transpose_unit(tid, i, head_dim)
    m_load, m_store = lane_masks(tid % 32, masks)
    return (
        [(key0 + unit_row(e ^ m_load), dq) for e in range(4)],
        [(dq * 4 + (e ^ m_store), kq) for e in range(4)],
    )


def transpose_selectors(m_load, m_store):
    """PRMT selectors (SA, SB, HA, HB) of the 4x4 byte transpose of a thread whose loads come in
    the order UNIT_ROWS[e ^ m_load] and whose stores go to rows e ^ m_store (plain integer
    arithmetic on ints or DSL Int32s). With words w0..w3 as loaded, a0 = PRMT(w0, w1, SA), a1 =
    PRMT(w0, w1, SB), a2 = PRMT(w2, w3, SA), a3 = PRMT(w2, w3, SB) interleave one byte pair of two
    key rows; store e writes PRMT(a0, a2, HA), PRMT(a0, a2, HB), PRMT(a1, a3, HA), PRMT(a1, a3, HB)
    (e = 0..3). Masks 0 give the canonical PRMT_LO/HI_PAIRS and PRMT_LO/HI_HALVES: bit 1 of m_store
    picks the byte pair (nibbles + 2), bit 0 of m_load swaps the pairs' operands and bit 1 the
    halves' operands (nibbles ^ 4), bit 0 of m_store picks the half (nibbles + 2)."""
    sa = (PRMT_LO_PAIRS + 0x2222 * ((m_store >> 1) & 1)) ^ (0x4444 * (m_load & 1))
    ha = (PRMT_LO_HALVES + 0x2222 * (m_store & 1)) ^ (0x4444 * ((m_load >> 1) & 1))
    return sa, sa ^ 0x2222, ha, ha ^ 0x2222


def swizzle_bytes(offset, bits: int, base: int, shift: int):
    """CuTe's Swizzle<bits, base, shift> on a byte offset: bits [base + shift, base + shift + bits)
    XOR into bits [base, base + bits). Plain integer arithmetic (kernel and CPU tests)."""
    return offset ^ ((offset >> shift) & (((1 << bits) - 1) << base))


def transpose_plan(v_offset, vt_offset, tile_n: int, head_dim: int, v_span: int, vt_span: int):
    """(V reps, V plan, Vt reps, Vt plan) of :func:`xor_hoisted_plan` for the hoisted 32-bit
    transpose of one tile (its lane masks from TRANSPOSE_LANE_MASKS): ``v_offset`` / ``vt_offset``
    map a word coordinate (key, dq) / (head-dim row, kq) to its swizzled byte offset in stage 0;
    ``v_span`` / ``vt_span`` are the layouts' swizzle spans."""
    masks = TRANSPOSE_LANE_MASKS[tile_n]
    return _side_plans(
        lambda t, i: transpose_words(t, i, head_dim, masks),
        transpose_steps(tile_n, head_dim), 4, (v_offset, vt_offset), (v_span, vt_span),
    )  # fmt: skip


def _side_plans(words, steps: int, accesses: int, offsets, spans):
    """(V reps, V plan, Vt reps, Vt plan): :func:`xor_hoisted_plan` of both sides of a transpose
    whose thread ``t`` accesses ``words(t, i)`` = (V coordinates, Vt coordinates) in step ``i``."""
    plans = []
    for side in (0, 1):
        plans.extend(xor_hoisted_plan(
            lambda i, e, side=side: [offsets[side](words(t, i)[side][e]) for t in range(WG_THREADS)],
            steps, accesses, spans[side],
        ))  # fmt: skip
    return tuple(plans)


def composed_offset(layout, coord_bytes):
    """Byte offset of a byte coordinate (row, col) of stage 0 of a staged swizzled byte layout
    (``smem_layouts``): the swizzle applied to the outer layout's offset. Python ints at trace
    time (static layout, int coordinates), DSL integers at run time."""
    sw = layout.inner
    return swizzle_bytes(
        layout.outer((coord_bytes[0], coord_bytes[1], 0)), sw.num_bits, sw.num_base, sw.num_shift
    )


def _swizzle_span(layout) -> int:
    sw = layout.inner
    return 1 << (sw.num_bits + sw.num_base + sw.num_shift)


class TransposeV:
    """The V transpose of one tile shape, its address arithmetic hoisted (:func:`transpose_plan`).

    ``TransposeV(tid, sV_layout, sVt_layout, tile_n, head_dim, pipelined)`` (once per thread,
    before the key loop) computes the per-thread swizzled byte offsets of the plan's base accesses
    and the thread's PRMT selectors (:func:`transpose_selectors`, from its lane masks); ``pipelined``
    issues each step's loads one step early (for a producer with 32 registers or more);
    ``__call__(v_base, vt_base, v_stage, vt_stage)`` transposes one stage. Plain Python, traced
    inline from the kernel: every loop here is unrolled at trace time."""

    def __init__(self, tid, sV_layout, sVt_layout, tile_n: int, head_dim: int, pipelined: bool = True):
        self.steps = transpose_steps(tile_n, head_dim)
        self.pipelined = pipelined
        masks = TRANSPOSE_LANE_MASKS[tile_n]
        v_reps, self.v_plan, vt_reps, self.vt_plan = transpose_plan(
            lambda c: composed_offset(sV_layout, (c[0], c[1] * 4)),
            lambda c: composed_offset(sVt_layout, (c[0], c[1] * 4)),
            tile_n,
            head_dim,
            _swizzle_span(sV_layout),
            _swizzle_span(sVt_layout),
        )
        assert all(d % 4 == 0 and x % 4 == 0 for row in (*self.v_plan, *self.vt_plan) for _, x, d in row)
        # Whole swizzle spans per stage (and a span-aligned ring, see __call__): swizzling the
        # offset within stage 0 and adding the stage's start equals swizzling the absolute
        # address, and (start + offset) ^ x = start + (offset ^ x) for x below the span.
        self.v_stage_bytes = cute.cosize(sV_layout.outer) // cute.size(sV_layout.outer, mode=[2])
        self.vt_stage_bytes = cute.cosize(sVt_layout.outer) // cute.size(sVt_layout.outer, mode=[2])
        assert self.v_stage_bytes % _swizzle_span(sV_layout) == 0
        assert self.vt_stage_bytes % _swizzle_span(sVt_layout) == 0
        self.v_offsets = []
        for i_rep, e_rep in v_reps:
            key, dq = transpose_words(tid, i_rep, head_dim, masks)[0][e_rep]
            self.v_offsets.append(cutlass.Int32(composed_offset(sV_layout, (key, dq * 4))))
        self.vt_offsets = []
        for i_rep, e_rep in vt_reps:
            row, kq = transpose_words(tid, i_rep, head_dim, masks)[1][e_rep]
            self.vt_offsets.append(cutlass.Int32(composed_offset(sVt_layout, (row, kq * 4))))
        m_load, m_store = lane_masks(tid % 32, masks)
        self.selectors = tuple(cutlass.Int32(x) for x in transpose_selectors(m_load, m_store))

    @staticmethod
    def _word(bases, c, x, d):
        """A one-word tensor at (bases[c] ^ x) + d (bytes)."""
        addr = bases[c] if x == 0 else bases[c] ^ x
        ptr = cute.make_ptr(cutlass.Uint32, addr, cute.AddressSpace.smem, assumed_align=4) + d // 4
        return cute.make_tensor(ptr, cute.make_layout(1))

    def __call__(self, v_base, vt_base, v_stage, vt_stage):
        """Vt[d, 32 kb + k] = V[32 kb + key_of_a_column(k), d] for stage ``v_stage`` of the V ring
        into stage ``vt_stage`` of the Vt ring, by the 128 threads of a warpgroup. ``v_base`` /
        ``vt_base``: shared-memory byte addresses of the rings (1024-byte aligned, a multiple of
        every swizzle span).

        A thread's unit (:func:`transpose_unit`) is 4 keys x 4 head dims: 4 word loads from 4 key
        rows, a 4x4 byte transpose (8 PRMT with the thread's selectors), 4 word stores into 4
        head-dim rows; every address is a per-thread base, XOR a compile-time mask, plus a
        compile-time byte offset."""
        v0 = v_base + v_stage * self.v_stage_bytes
        vt0 = vt_base + vt_stage * self.vt_stage_bytes
        v_bases = [v0 + off for off in self.v_offsets]
        vt_bases = [vt0 + off for off in self.vt_offsets]

        def load(i):
            return [cutlass.Int32(self._word(v_bases, c, x, d)[0]) for c, x, d in self.v_plan[i]]

        # Pipelined: the next step's loads are issued before this step's stores (ptxas does not
        # move a shared load above a shared store it cannot prove disjoint, so otherwise each step
        # waits out its loads' latency alone). It takes 4 more registers: a producer held to 24
        # registers spills with it, so that one runs the steps one after another.
        ahead = load(0) if self.pipelined else None
        for i in range(self.steps):
            if self.pipelined:
                w = ahead
                if i + 1 < self.steps:
                    ahead = load(i + 1)
            else:
                w = load(i)
            outs = transpose_4x4(*w, selectors=self.selectors)
            for e in range(4):
                c, x, d = self.vt_plan[i][e]
                self._word(vt_bases, c, x, d)[0] = outs[e]


# --- The wide transpose (wide_vt variants): 64-bit shared-memory accesses, 8 keys x 8 head dims ---

# The key rows of a wide unit, relative to its first key, in the order of the unit's 8 Vt bytes:
# Vt key word 2 kp holds keys (0, 1, 8, 9), word 2 kp + 1 keys (2, 3, 10, 11) (key_of_a_column).
WIDE_ROWS = (0, 1, 8, 9, 2, 3, 10, 11)
WIDE_UNIT_BYTES = 8  # a unit's bytes per key row (head dims) and per head-dim row (keys)


def swizzle_atom_bytes(extent: int) -> int:
    """Row bytes of the 128/64/32-byte swizzle atom that ``smem_layouts`` picks for an e4m3 K-major
    tile whose contiguous extent is ``extent`` (head_dim for V, tile_n for Vt)."""
    return 128 if extent % 128 == 0 else 64 if extent % 64 == 0 else 32


def wide_steps(tile_n: int, head_dim: int) -> int:
    """Steps of :class:`WideTransposeV`: (head_dim / 8) x (tile_n / 8) units over 128 threads
    (space.why_invalid requires a whole number)."""
    return (head_dim // 8) * (tile_n // 8) // WG_THREADS


def wide_transpose_unit(tid, i, tile_n: int, head_dim: int):
    """The unit of thread ``tid`` (of 128) in step ``i`` of :class:`WideTransposeV`: (first key
    row key0, 8-byte head-dim word dp, 8-byte Vt key word kp). The thread loads V rows key0 +
    WIDE_ROWS at bytes 8 dp..8 dp + 7 and stores Vt rows 8 dp + (0..7) at bytes 8 kp..8 kp + 7
    (Vt key words 2 kp, 2 kp + 1 of :func:`transpose_unit`). Plain integer arithmetic.

    The mapping keeps every warp-wide 64-bit access at the fewest wavefronts the swizzle allows
    (a half-warp's 16 lanes, 128 bytes, per wavefront). With SV = V atom row bytes / 8 and SVT = Vt
    atom row bytes / 8 (16, 8 or 4 8-byte slots per swizzled row): a half-warp takes SVT adjacent
    key words kp (every Vt slot of a row: all lanes of a store write rows 8 dp + e with the same e,
    whose swizzle XOR is the same) and 16 / SVT head-dim words per key word, twisted by XOR so that
    (dp mod SV) ^ (SV / 2)(kp & 1), the V slot up to the instruction's constant XOR (key0 mod 8 =
    4 (kp & 1)), takes min(16, SV) distinct values. Half-warps fill blocks of SV head-dim words x
    SVT key words (SV x SVT / 16 half-warps each), blocks in key-word-major order."""
    sv = swizzle_atom_bytes(head_dim) // WIDE_UNIT_BYTES
    svt = swizzle_atom_bytes(tile_n) // WIDE_UNIT_BYTES
    per_block = sv * svt // 16
    warp = tid // 32
    lane = tid % 32
    half_warp = 8 * i + 2 * warp + lane // 16
    block = half_warp // per_block
    q = half_warp % per_block
    dpb = block % (head_dim // 8 // sv)
    kpb = block // (head_dim // 8 // sv)
    b = lane % 16 % svt
    x = q * (16 // svt) + lane % 16 // svt
    twist = ((sv // 2) * (b % 2)) ^ ((b * (16 // svt)) % sv)
    dp = dpb * sv + (x ^ twist)
    kp = kpb * svt + b
    key0 = 16 * (kp // 2) + 4 * (kp % 2)
    return key0, dp, kp


def wide_transpose_words(tid, i, tile_n: int, head_dim: int):
    """The 8 V coordinates (key, dp) that unit ``i`` of thread ``tid`` loads and the 8 Vt
    coordinates (head-dim row, kp) it stores (8-byte words), in :class:`WideTransposeV`'s order."""
    key0, dp, kp = wide_transpose_unit(tid, i, tile_n, head_dim)
    return [(key0 + r, dp) for r in WIDE_ROWS], [(8 * dp + e, kp) for e in range(8)]


def xor_hoisted_plan(column, steps: int, accesses: int, span: int):
    """Split the transpose's shared-memory byte offsets into per-thread bases, XOR masks and
    offsets: ``column(i, e)`` lists the byte offsets (one per thread) of access ``e`` of step
    ``i``. Returns ``(reps, plan)``: ``reps`` lists the (step, access) pairs whose offset each
    thread computes at run time (one register each), and ``plan[i][e] = (c, x, d)`` says that for
    EVERY thread, access e of step i is at ``(offset(reps[c]) ^ x) + d``, with compile-time
    ``x < span`` (a mask of the swizzle's bits, 0 for a plain offset) and ``d``.

    A swizzle XORs row bits into the slot bits of a row; the lanes of a conflict-free access cover
    every slot, so a row move changes each lane's offset by a lane-dependent amount,
    but by the same XOR: an access related to a base by an XOR and an offset costs one LOP3 per
    (base, mask) per CTA (ptxas may recompute it per key block under the producer's 40 registers),
    and only an access related to no base that way becomes a base. When the ring's stage start
    ``s`` is a multiple of ``span``, (s + o) ^ x = s + (o ^ x) for x < span. Re-checked over all
    threads before it is returned (ValueError otherwise)."""
    cols: dict[tuple[int, int], list[int]] = {}

    def col(i, e):
        if (i, e) not in cols:
            cols[(i, e)] = column(i, e)
        return cols[(i, e)]

    def relate(target, base):
        x = (target[0] ^ base[0]) % span
        d = target[0] - (base[0] ^ x)
        if all(t == (b ^ x) + d for t, b in zip(target, base)):
            return x, d
        return None

    reps: list[tuple[int, int]] = []
    plan = []
    for i in range(steps):
        row = []
        for e in range(accesses):
            for c, (ri, re_) in enumerate(reps):
                found = relate(col(i, e), col(ri, re_))
                if found is not None:
                    row.append((c, *found))
                    break
            else:
                reps.append((i, e))
                row.append((len(reps) - 1, 0, 0))
        plan.append(row)
    for i in range(steps):  # the proof, independent of the search above
        for e in range(accesses):
            c, x, d = plan[i][e]
            if not 0 <= x < span or col(i, e) != [(b ^ x) + d for b in col(*reps[c])]:
                raise ValueError(f"transpose access ({i}, {e}) is not (base {c} ^ {x}) + {d}")
    return reps, plan


def wide_transpose_plan(v_offset, vt_offset, tile_n: int, head_dim: int, v_span: int, vt_span: int):
    """(V reps, V plan, Vt reps, Vt plan) of :func:`xor_hoisted_plan` for one tile: ``v_offset`` /
    ``vt_offset`` map an 8-byte word coordinate (key, dp) / (head-dim row, kp) to its swizzled
    byte offset in stage 0; ``v_span`` / ``vt_span`` are the layouts' swizzle spans."""
    return _side_plans(
        lambda t, i: wide_transpose_words(t, i, tile_n, head_dim),
        wide_steps(tile_n, head_dim), 8, (v_offset, vt_offset), (v_span, vt_span),
    )  # fmt: skip


CANONICAL_SELECTORS = (PRMT_LO_PAIRS, PRMT_HI_PAIRS, PRMT_LO_HALVES, PRMT_HI_HALVES)


def transpose_4x4(w0, w1, w2, w3, selectors=CANONICAL_SELECTORS):
    """The 4x4 byte transpose of the V transposes (8 PRMT): words of key rows (0, 1, 8, 9) (4 head
    dims each) to words of head dims 0..3 (keys 0, 1, 8, 9 each). ``selectors`` (pairs low, pairs
    high, halves low, halves high): the canonical ones, or a thread's own from
    :func:`transpose_selectors` (:class:`TransposeV`, whose lanes load and store in permuted orders)."""
    lo_pairs, hi_pairs, lo_halves, hi_halves = selectors
    t0 = cutlass.Int32(cute.arch.prmt(w0, w1, lo_pairs))
    t1 = cutlass.Int32(cute.arch.prmt(w0, w1, hi_pairs))
    t2 = cutlass.Int32(cute.arch.prmt(w2, w3, lo_pairs))
    t3 = cutlass.Int32(cute.arch.prmt(w2, w3, hi_pairs))
    return (
        cutlass.Uint32(cute.arch.prmt(t0, t2, lo_halves)),
        cutlass.Uint32(cute.arch.prmt(t0, t2, hi_halves)),
        cutlass.Uint32(cute.arch.prmt(t1, t3, lo_halves)),
        cutlass.Uint32(cute.arch.prmt(t1, t3, hi_halves)),
    )


class WideTransposeV:
    """The V transpose with 64-bit shared-memory accesses (wide_vt variants), addresses hoisted
    (:func:`xor_hoisted_plan`). Same interface as :class:`TransposeV`, same Vt bytes.

    A thread's unit (:func:`wide_transpose_unit`) is 8 keys x 8 head dims: 8 LDS.64 from the key
    rows key0 + WIDE_ROWS (head dims 8 dp..8 dp + 7: low word dims 0-3, high word 4-7), four 4x4
    byte transposes (32 PRMT: keys (0, 1, 8, 9) / (2, 3, 10, 11) x dims 0-3 / 4-7), 8 STS.64 into
    head-dim rows 8 dp + e (low word: Vt key word 2 kp, high word: 2 kp + 1)."""

    def __init__(self, tid, sV_layout, sVt_layout, tile_n: int, head_dim: int):
        self.steps = wide_steps(tile_n, head_dim)
        v_span, vt_span = _swizzle_span(sV_layout), _swizzle_span(sVt_layout)
        v_reps, self.v_plan, vt_reps, self.vt_plan = wide_transpose_plan(
            lambda c: composed_offset(sV_layout, (c[0], c[1] * WIDE_UNIT_BYTES)),
            lambda c: composed_offset(sVt_layout, (c[0], c[1] * WIDE_UNIT_BYTES)),
            tile_n,
            head_dim,
            v_span,
            vt_span,
        )
        assert all(d % 8 == 0 and x % 8 == 0 for row in (*self.v_plan, *self.vt_plan) for _, x, d in row)
        self.v_stage_bytes = cute.cosize(sV_layout.outer) // cute.size(sV_layout.outer, mode=[2])
        self.vt_stage_bytes = cute.cosize(sVt_layout.outer) // cute.size(sVt_layout.outer, mode=[2])
        assert self.v_stage_bytes % v_span == 0 and self.vt_stage_bytes % vt_span == 0
        self.v_offsets = []
        for i_rep, e_rep in v_reps:
            key, dp = wide_transpose_words(tid, i_rep, tile_n, head_dim)[0][e_rep]
            self.v_offsets.append(cutlass.Int32(composed_offset(sV_layout, (key, dp * WIDE_UNIT_BYTES))))
        self.vt_offsets = []
        for i_rep, e_rep in vt_reps:
            row, kp = wide_transpose_words(tid, i_rep, tile_n, head_dim)[1][e_rep]
            self.vt_offsets.append(cutlass.Int32(composed_offset(sVt_layout, (row, kp * WIDE_UNIT_BYTES))))
        # The XOR-derived offsets, per CTA like the bases: the stage start is a multiple of the
        # swizzle span and x < span, so (start + off) ^ x = start + (off ^ x).
        self.v_xor_offsets = {
            (c, x): self.v_offsets[c] ^ x for row in self.v_plan for c, x, _ in row if x
        }
        self.vt_xor_offsets = {
            (c, x): self.vt_offsets[c] ^ x for row in self.vt_plan for c, x, _ in row if x
        }

    @staticmethod
    def _ptr(bases, derived, c, x, d):
        """Pointer (64-bit elements) to stage start + (offset[c] ^ x) + d."""
        addr = bases[c] if x == 0 else derived[(c, x)]
        return cute.make_ptr(cutlass.Uint64, addr, cute.AddressSpace.smem, assumed_align=8) + d // 8

    def __call__(self, v_base, vt_base, v_stage, vt_stage):
        """Vt[d, 32 kb + k] = V[32 kb + key_of_a_column(k), d] for stage ``v_stage`` of the V ring
        into stage ``vt_stage`` of the Vt ring (see :meth:`TransposeV.__call__`)."""
        v0 = v_base + v_stage * self.v_stage_bytes
        vt0 = vt_base + vt_stage * self.vt_stage_bytes
        v_bases = [v0 + off for off in self.v_offsets]
        vt_bases = [vt0 + off for off in self.vt_offsets]
        v_derived = {k: v0 + off for k, off in self.v_xor_offsets.items()}
        vt_derived = {k: vt0 + off for k, off in self.vt_xor_offsets.items()}
        one = cute.make_layout(1)
        for i in range(self.steps):
            lo, hi = [], []
            for c, x, d in self.v_plan[i]:
                word = cute.make_tensor(self._ptr(v_bases, v_derived, c, x, d), one)[0]
                lo.append(cutlass.Int32(cutlass.Uint32(word)))
                hi.append(cutlass.Int32(cutlass.Uint32(word >> 32)))
            # lo/hi[j]: head dims 0-3 / 4-7 of key row key0 + WIDE_ROWS[j]
            outs_lo = transpose_4x4(lo[0], lo[1], lo[2], lo[3]) + transpose_4x4(hi[0], hi[1], hi[2], hi[3])
            outs_hi = transpose_4x4(lo[4], lo[5], lo[6], lo[7]) + transpose_4x4(hi[4], hi[5], hi[6], hi[7])
            for e in range(8):
                c, x, d = self.vt_plan[i][e]
                pair = cutlass.Uint64(outs_lo[e]) | (cutlass.Uint64(outs_hi[e]) << 32)
                cute.make_tensor(self._ptr(vt_bases, vt_derived, c, x, d), one)[0] = pair


@cute.jit
def online_softmax_step(
    s_mn: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    scale_log2: Float32,
    corr: cute.Tensor,
    emu_per_16: cutlass.Constexpr = 0,
    lazy: cutlass.Constexpr = False,
    sums: cutlass.Constexpr = True,
):
    """Scores ``s_mn`` (rows x cols, fp32) to probabilities scaled by 2^P_OFFSET_LOG2, in place;
    the per-row rescale factors of O go to ``corr`` (applied by the caller once no MMA reads O).

    Of every 16 scores of a thread's row the last ``emu_per_16`` take :func:`exp2_fma` on the FMA
    units instead of MUFU.EX2 (0: all on MUFU, the code of the default variants). Its arguments
    reach +P_OFFSET_LOG2 = 8 here, not only <= 0: the Cody-Waite split adds round(x) into the
    exponent bits, exact for any x up to 127.

    ``lazy`` (lazy_rescale variants): the warp's maxes move only when ``warp_moves_max``
    (cutefa/kernels/common/lazy_rescale.py) says so, P is shifted by LAZY_P_OFFSET_LOG2; returns that warp-uniform flag (the caller rescales O
    only where it is set; ``corr`` is 1 elsewhere). Without ``lazy`` returns True.

    ``sums=False`` (sum_mma variants) leaves ``row_sum`` alone: the caller takes the row sums from
    the P x ones WGMMA (:func:`add_block_sums`)."""
    moved = True
    if cutlass.const_expr(lazy):
        blk = block_row_maxes(s_mn, Float32(1.0))
        moved = warp_moves_max(blk, row_max, scale_log2, LAZY_RESCALE_LOG2)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        row = s_mn[r, None].load()
        prev_max = row_max[r]
        if cutlass.const_expr(lazy):
            new_max = cutlass.select_(moved, cute.arch.fmax(prev_max, blk[r]), prev_max)
        else:
            blk_max = quad_allreduce_max(row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
            new_max = cute.arch.fmax(prev_max, blk_max)
        # A row that has seen only masked scores keeps max = -inf: offset by 0 so that
        # exp2(-inf - offset) = 0 instead of NaN.
        offset = (0.0 if new_max == -Float32.inf else new_max) * scale_log2
        if cutlass.const_expr(emu_per_16 == 0):
            p = cute.math.exp2(row * scale_log2 - (offset - p_offset_log2(lazy)), fastmath=True)
        else:
            s_mn[r, None].store(row * scale_log2 - (offset - p_offset_log2(lazy)))
            for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                if cutlass.const_expr(j % 16 >= 16 - emu_per_16):
                    s_mn[r, j] = exp2_fma(s_mn[r, j])
                else:
                    s_mn[r, j] = cute.math.exp2(s_mn[r, j], fastmath=True)
            p = s_mn[r, None].load()
        corr[r] = cute.math.exp2(prev_max * scale_log2 - offset, fastmath=True)
        if cutlass.const_expr(sums):
            row_sum[r] = row_sum[r] * corr[r] + p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
        row_max[r] = new_max
        s_mn[r, None].store(p)
    return moved


@cute.jit
def online_softmax_step_block(
    s_mn: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    tile_scale_log2: Float32,
    v_ratio_log2: Float32,
    v_ratio_inv: Float32,
    corr: cute.Tensor,
    emu_per_16: cutlass.Constexpr = 0,
    lazy: cutlass.Constexpr = False,
):
    """:func:`online_softmax_step` for block-quantized inputs (``block_quant`` variants).

    Each key tile n has its own score scale ``tile_scale_log2`` = softmax_scale * log2(e) * sq * sk[n]
    (sq: this CTA's query-tile descale, sk[n]: the key tile's), so ``row_max`` is kept in scaled
    log2 units: since the scale is positive, the tile's largest scaled score is the largest raw
    score times the scale, one multiply per row. V's tile descale enters as the ratio r[n] =
    sv[n] / max(sv) in (0, 1]: its log2 ``v_ratio_log2`` joins the exp2 bias, so the probabilities
    left in ``s_mn`` (and converted to e4m3 for P V) are P * r[n], while ``row_sum`` accumulates the
    unscaled P (the tile's sum times ``v_ratio_inv`` = 1 / r[n]). The epilogue multiplies O by
    max(sv). Per score this is the FFMA and MUFU.EX2 of the per-head path; per row two more FMULs.
    ``lazy`` and the return value as in :func:`online_softmax_step` (row_max is in scaled log2
    units here, so the block maxes are compared scaled)."""
    moved = True
    if cutlass.const_expr(lazy):
        blk = block_row_maxes(s_mn, tile_scale_log2)
        moved = warp_moves_max(blk, row_max, Float32(1.0), LAZY_RESCALE_LOG2)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        row = s_mn[r, None].load()
        prev_max = row_max[r]
        if cutlass.const_expr(lazy):
            new_max = cutlass.select_(moved, cute.arch.fmax(prev_max, blk[r]), prev_max)
        else:
            blk_max = quad_allreduce_max(row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
            new_max = cute.arch.fmax(prev_max, blk_max * tile_scale_log2)
        # A row that has seen only masked scores keeps max = -inf: offset by 0 (see online_softmax_step).
        offset = 0.0 if new_max == -Float32.inf else new_max
        bias = offset - (p_offset_log2(lazy) + v_ratio_log2)
        if cutlass.const_expr(emu_per_16 == 0):
            p = cute.math.exp2(row * tile_scale_log2 - bias, fastmath=True)
        else:
            s_mn[r, None].store(row * tile_scale_log2 - bias)
            for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                if cutlass.const_expr(j % 16 >= 16 - emu_per_16):
                    s_mn[r, j] = exp2_fma(s_mn[r, j])
                else:
                    s_mn[r, j] = cute.math.exp2(s_mn[r, j], fastmath=True)
            p = s_mn[r, None].load()
        corr[r] = cute.math.exp2(prev_max - offset, fastmath=True)
        row_sum[r] = row_sum[r] * corr[r] + p.reduce(cute.ReductionOp.ADD, Float32.zero, 0) * v_ratio_inv
        row_max[r] = new_max
        s_mn[r, None].store(p)
    return moved


@cute.jit
def softmax_finalize(
    o_mn: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    scale_log2: Float32,
    v_descale: Float32,
    lse: cute.Tensor,
    lazy: cutlass.Constexpr = False,
    full_sums: cutlass.Constexpr = False,
):
    """O = O * v_descale / row_sum and the natural-log LSE of the dequantized scores per row.
    Rows with no unmasked key get O = 0 and LSE = -inf. ``row_max`` times ``scale_log2`` is the
    row max in log2 units (block_quant variants keep it scaled already and pass 1); ``lazy``: P
    was shifted by LAZY_P_OFFSET_LOG2 (lazy_rescale). ``row_sum`` holds a thread's share of each
    row (summed over the row's four threads here), or with ``full_sums`` (sum_mma) the whole row."""
    for r in cutlass.range_constexpr(cute.size(row_max)):
        total = row_sum[r] if cutlass.const_expr(full_sums) else quad_allreduce_sum(row_sum[r])
        empty = total == 0.0 or total != total  # noqa: PLR0124 -- the NaN test
        inv = 0.0 if empty else cute.arch.rcp_approx(total) * v_descale
        o_mn[r, None].store(o_mn[r, None].load() * inv)
        lse[r] = (
            -Float32.inf
            if empty
            else (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True) - p_offset_log2(lazy)) * LN_2
        )


@cute.jit
def rescale_rows(o_mn: cute.Tensor, corr: cute.Tensor):
    for r in cutlass.range_constexpr(cute.size(corr)):
        o_mn[r, None].store(o_mn[r, None].load() * corr[r])


__all__ = [
    "FP8",
    "LAZY_P_OFFSET_LOG2",
    "LAZY_RESCALE_LOG2",
    "MMA_K",
    "NO_LANE_MASKS",
    "O32_CHUNK",
    "PROMOTE_BLOCKS",
    "P_OFFSET_LOG2",
    "P_STRIDES",
    "SMEM_LAYOUTS_V_VT",
    "SUM_COLS",
    "TRANSPOSE_LANE_MASKS",
    "TV_LAYOUT_A_FP8",
    "TV_LAYOUT_C_N128",
    "UNIT_ROWS",
    "WG_THREADS",
    "WIDE_ROWS",
    "WIDE_UNIT_BYTES",
    "TransposeV",
    "WideTransposeV",
    "add_block_sums",
    "add_last_sums",
    "composed_offset",
    "fill_ones",
    "key_of_a_column",
    "lane_masks",
    "o32_layout",
    "ones_layout",
    "online_softmax_step",
    "online_softmax_step_block",
    "p_fragment",
    "p_offset_log2",
    "promote_o",
    "pv_tiled_mma",
    "qk_tiled_mma",
    "rescale_rows",
    "scale_rows",
    "smem_layouts",
    "softmax_finalize",
    "sum_tiled_mma",
    "swizzle_atom_bytes",
    "swizzle_bytes",
    "transpose_4x4",
    "transpose_plan",
    "transpose_selectors",
    "transpose_steps",
    "transpose_unit",
    "transpose_v",
    "transpose_words",
    "unit_row",
    "wide_steps",
    "wide_transpose_plan",
    "wide_transpose_unit",
    "wide_transpose_words",
    "xor_hoisted_plan",
    "zero_o32",
]
