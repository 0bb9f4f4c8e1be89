"""Online softmax over MMA accumulator fragments (exp2 domain, scale folded in).

Rows of an accumulator fragment are spread over the 4 threads of a quad (mma.sync C layout), so
row reductions finish with two butterfly shuffles. The running sum is kept per thread and reduced
across the quad once, at the end.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cutefa.kernels.common.exp2 import exp2_fma

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


@cute.jit
def quad_allreduce_max(val: Float32) -> Float32:
    val = cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=2))
    return cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=1))


@cute.jit
def quad_allreduce_sum(val: Float32) -> Float32:
    val = val + cute.arch.shuffle_sync_bfly(val, offset=2)
    return val + cute.arch.shuffle_sync_bfly(val, offset=1)


def softmax_state(num_rows: int):
    """Running (row_max, row_sum) register fragments for ``num_rows`` rows: -inf and 0."""
    row_max = cute.make_rmem_tensor((num_rows,), Float32)
    row_sum = cute.make_rmem_tensor((num_rows,), Float32)
    row_max.fill(-Float32.inf)
    row_sum.fill(0.0)
    return row_max, row_sum


@cute.jit
def online_softmax_step(
    s_mn: cute.Tensor,
    o_mn: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    scale_log2: Float32,
    emu_per_16: cutlass.Constexpr = 0,
):
    """Turn scores ``s_mn`` (rows x cols view, fp32) into unnormalised probabilities in place and
    rescale the output accumulator ``o_mn`` (rows x head_dim view) by exp2 of the max change.

    ``scale_log2`` is softmax_scale * log2(e): one FFMA and one MUFU.EX2 per score. ``row_sum``
    holds this thread's partial sums; the quad reduction happens once, in :func:`softmax_finalize`.
    Of every 16 scores of a thread's row the last ``emu_per_16`` take :func:`exp2_fma` on the FMA
    units instead of MUFU.EX2 (0: all on MUFU).
    """
    corr = cute.make_rmem_tensor((cute.size(row_max),), Float32)
    online_softmax_step_deferred(s_mn, row_max, row_sum, scale_log2, corr, emu_per_16)
    rescale_rows(o_mn, corr)


@cute.jit
def online_softmax_step_deferred(
    s_mn: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    scale_log2: Float32,
    corr: cute.Tensor,
    emu_per_16: cutlass.Constexpr = 0,
):
    """:func:`online_softmax_step` without touching O: the per-row rescale factors go to ``corr``
    for :func:`rescale_rows` once the MMA still reading the previous P into O has finished."""
    for r in cutlass.range_constexpr(cute.size(row_max)):
        row = s_mn[r, None].load()
        blk_max = quad_allreduce_max(row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
        prev_max = row_max[r]
        new_max = cute.arch.fmax(prev_max, blk_max)
        # A row that has seen only masked scores keeps max = -inf; offset by 0 so that
        # exp2(-inf - offset) = 0 instead of NaN.
        offset = (0.0 if new_max == -Float32.inf else new_max) * scale_log2
        if cutlass.const_expr(emu_per_16 == 0):
            p = cute.math.exp2(row * scale_log2 - offset, fastmath=True)
        else:
            s_mn[r, None].store(row * scale_log2 - offset)
            for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                if cutlass.const_expr(j % 16 >= 16 - emu_per_16):
                    s_mn[r, j] = exp2_fma(s_mn[r, j])
                else:
                    s_mn[r, j] = cute.math.exp2(s_mn[r, j], fastmath=True)
            p = s_mn[r, None].load()
        corr[r] = cute.math.exp2(prev_max * scale_log2 - offset, fastmath=True)
        row_sum[r] = row_sum[r] * corr[r] + p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
        row_max[r] = new_max
        s_mn[r, None].store(p)


@cute.jit
def rescale_rows(o_mn: cute.Tensor, corr: cute.Tensor):
    for r in cutlass.range_constexpr(cute.size(corr)):
        o_mn[r, None].store(o_mn[r, None].load() * corr[r])


@cute.jit
def softmax_finalize(
    o_mn: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32, lse: cute.Tensor
):
    """Normalise ``o_mn`` by the row sums and write each row's natural-log LSE to ``lse``.
    Rows with no unmasked key get O = 0 and LSE = -inf."""
    for r in cutlass.range_constexpr(cute.size(row_max)):
        total = quad_allreduce_sum(row_sum[r])
        empty = total == 0.0 or total != total  # noqa: PLR0124 -- the NaN test
        inv = 0.0 if empty else cute.arch.rcp_approx(total)
        o_mn[r, None].store(o_mn[r, None].load() * inv)
        lse[r] = -Float32.inf if empty else (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
