"""The online softmax of the sm90 e4m3 forward (templates/fwd_sm90_fp8.py.j2): per key block the
scores of a consumer thread's rows to probabilities shifted up for e4m3 (per-head descales, or
block-quantized inputs), the rescale factors of O, the row sums; at the end O's normalization and
the LSE.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cutefa.kernels.common.exp2 import exp2_fma
from cutefa.kernels.common.lazy_rescale import block_row_maxes, warp_moves_max
from cutefa.kernels.common.softmax import LN_2, quad_allreduce_max, quad_allreduce_sum

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


__all__ = [
    "LAZY_P_OFFSET_LOG2",
    "LAZY_RESCALE_LOG2",
    "P_OFFSET_LOG2",
    "online_softmax_step",
    "online_softmax_step_block",
    "p_offset_log2",
    "softmax_finalize",
]
