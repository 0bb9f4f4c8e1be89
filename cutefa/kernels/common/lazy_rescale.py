"""The lazy O rescale of the sm90 forwards (spec flag ``lazy_rescale``, name token ``_lres``).

A warp keeps its rows' running maxes (the exp2 offsets of P) until a key block raises one of them
by more than a threshold (log2 units): :func:`warp_moves_max` votes over the warp's rows after the
block maxes, and only a warp whose vote is set takes the new maxes and rescales its row sums and
its rows of O (one warp-uniform branch around the head_dim / 2 multiplies per thread; everywhere
else the factor would be exactly 1). Exact: the kept max only offsets the exponents that the row
sums and the LSE are taken against. P = exp2(score - kept max) then reaches 2^threshold at most:
the 16-bit forward takes FlashAttention-4's 2^8 (P stays far inside fp16's and bf16's range), the
e4m3 forward 2^4 with P shifted by 2^4 (cutefa/kernels/sm90/fp8_softmax.py).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cutefa.kernels.common.softmax import quad_allreduce_max

# The 16-bit forward's threshold: a kept max at most 8 below the true one, P <= 2^8.
THRESHOLD_LOG2 = 8.0


@cute.jit
def block_row_maxes(s_mn: cute.Tensor, scale: Float32) -> cute.Tensor:
    """Per row of ``s_mn``: its largest score over the quad that holds the row, times ``scale``."""
    blk = cute.make_rmem_tensor((cute.size(s_mn, mode=[0]),), Float32)
    for r in cutlass.range_constexpr(cute.size(blk)):
        blk[r] = quad_allreduce_max(s_mn[r, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)) * scale
    return blk


@cute.jit
def warp_moves_max(
    blk_max: cute.Tensor, row_max: cute.Tensor, scale_log2: Float32, threshold_log2: cutlass.Constexpr
) -> cutlass.Boolean:
    """Whether some row of this warp has a block max above its running max by more than
    ``threshold_log2`` ((blk - prev) * scale_log2 in log2 units: a row's first finite block gives
    +inf, a row that has seen only masked scores NaN, i.e. no). The same for every lane."""
    need = cutlass.Boolean(False)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        need = need | ((blk_max[r] - row_max[r]) * scale_log2 > threshold_log2)
    return cute.arch.vote_any_sync(need)


@cute.jit
def lazy_softmax_step_deferred(
    s_mn: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    scale_log2: Float32,
    corr: cute.Tensor,
    moved: cute.Tensor,
):
    """``online_softmax_step_deferred`` (cutefa/kernels/common/softmax.py) of the 16-bit forward
    with the lazy rule: the warp's maxes move only where :func:`warp_moves_max` (threshold 2^8)
    says so; ``moved[0]`` (an Int32 register) becomes 1 there and 0 elsewhere, where ``corr`` is 1
    and the caller skips the O rescale. All exp2 on MUFU (the rule refuses exp_emu with the flag)."""
    blk = block_row_maxes(s_mn, Float32(1.0))
    flag = warp_moves_max(blk, row_max, scale_log2, THRESHOLD_LOG2)
    moved[0] = cutlass.select_(flag, Int32(1), Int32(0))
    for r in cutlass.range_constexpr(cute.size(row_max)):
        prev_max = row_max[r]
        new_max = cutlass.select_(flag, cute.arch.fmax(prev_max, blk[r]), prev_max)
        # A row that has seen only masked scores keeps max = -inf: offset by 0 so that
        # exp2(-inf - offset) = 0 instead of NaN.
        offset = (0.0 if new_max == -Float32.inf else new_max) * scale_log2
        p = cute.math.exp2(s_mn[r, None].load() * scale_log2 - offset, fastmath=True)
        corr[r] = cute.math.exp2(prev_max * scale_log2 - offset, fastmath=True)
        row_sum[r] = row_sum[r] * corr[r] + p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
        row_max[r] = new_max
        s_mn[r, None].store(p)

__all__ = ["THRESHOLD_LOG2", "block_row_maxes", "lazy_softmax_step_deferred", "warp_moves_max"]
