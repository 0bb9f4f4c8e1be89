"""Row sums of P by MMA (sum_mma variants of the sm90 e4m3 forward, templates/fwd_sm90_fp8.py.j2):
P times a block of e4m3 ones in shared memory, one more WGMMA per key block, instead of the
per-score adds of the softmax.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils

from cutefa.kernels.sm90.fp8 import FP8, pv_tiled_mma
from cutefa.kernels.sm90.parts import WG_ROWS

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


__all__ = [
    "E4M3_ONE_WORD",
    "SUM_COLS",
    "add_block_sums",
    "add_last_sums",
    "fill_ones",
    "ones_layout",
    "sum_tiled_mma",
]
