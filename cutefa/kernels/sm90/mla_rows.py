"""The row softmax of the MLA decode kernel (templates/decode_mla_sm90.py.j2), whose query rows are
shared by several warps.

The tile's mma.sync warps form a (row slabs x columns) grid: a 16-row slab of packed query rows
is owned by :data:`cutefa.model.policy_mla.WARP_COLS` warps side by side, each computing its
columns of S = Q K^T (a quarter of the keys) and of O = P V (a quarter of the 512 V columns). A
row's maximum over a key block is therefore reduced in two steps: over the quad of threads that
hold the row in a warp (shuffles), then over the warps of the slab through shared memory (a
(tile_m, WARP_COLS) float32 exchange). Every warp of a slab then uses the same running maximum, so
each keeps its own partial row sums and rescales its own O columns; the sums are added across the
slab once, at the end.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import warp

from cutefa.kernels.common.softmax import LN_2, quad_allreduce_max, quad_allreduce_sum

MMA_ROWS = 16
ATOM_COLS = 8  # columns of one m16n8k16 atom


def tiled_mma(dtype, row_slabs: int, warp_cols: int):
    """mma.sync m16n8k16 warps in a (row_slabs, warp_cols) grid; the tile is (16 * row_slabs,
    16 * warp_cols, 16), so that ldmatrix.x4 feeds two n8 atoms of B per warp (warp ``c`` owns
    columns [8c, 8c + 8) and [8 (warp_cols + c), 8 (warp_cols + c) + 8) of every 16 * warp_cols)."""
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)),
        (row_slabs, warp_cols, 1),
        permutation_mnk=(row_slabs * MMA_ROWS, 2 * ATOM_COLS * warp_cols, 16),
    )


def warp_col(c_mn: cute.Tensor):
    """The slab column of this thread's warp, from the tile coordinates ``c_mn`` of its S fragment
    ((rows, cols) view): its first column lies in [8c, 8c + 8)."""
    return c_mn[0, 0][1] // ATOM_COLS


@cute.jit
def _publish(values: cute.Tensor, exchange: cute.Tensor, c_mn: cute.Tensor, col, lane):
    """Write each of the thread's row values (one per fragment row; the same on the 4 threads of a
    quad) into ``exchange[row, col]`` from the quad's first thread."""
    if lane % 4 == 0:
        for r in cutlass.range_constexpr(cute.size(values)):
            exchange[c_mn[r, 0][0], col] = values[r]


@cute.jit
def softmax_step(
    s_mn: cute.Tensor,
    o_mn: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    scale_log2: Float32,
    exchange: cute.Tensor,
    c_mn: cute.Tensor,
    col,
    lane,
    warp_cols: cutlass.Constexpr,
):
    """One key block's online softmax over a row shared by ``warp_cols`` warps: the block's row
    maxima through ``exchange`` ((tile_m, warp_cols) float32 in shared memory; one CTA barrier),
    then the scores ``s_mn`` become unnormalised probabilities in place, this thread's partial
    ``row_sum`` and its O columns ``o_mn`` are rescaled by exp2 of the max change. The caller
    puts a CTA barrier between this call's reads of ``exchange`` and the next block's writes."""
    rows = cute.size(row_max)
    part = cute.make_rmem_tensor((rows,), Float32)
    for r in cutlass.range_constexpr(rows):
        part[r] = quad_allreduce_max(s_mn[r, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
    _publish(part, exchange, c_mn, col, lane)
    cute.arch.barrier()
    for r in cutlass.range_constexpr(rows):
        blk_max = exchange[c_mn[r, 0][0], 0]
        for c in cutlass.range_constexpr(1, warp_cols):
            blk_max = cute.arch.fmax(blk_max, exchange[c_mn[r, 0][0], c])
        prev_max = row_max[r]
        new_max = cute.arch.fmax(prev_max, blk_max)
        # a row that has seen only masked scores keeps max = -inf: offset 0 gives exp2(-inf) = 0
        offset = (0.0 if new_max == -Float32.inf else new_max) * scale_log2
        p = cute.math.exp2(s_mn[r, None].load() * scale_log2 - offset, fastmath=True)
        corr = cute.math.exp2(prev_max * scale_log2 - offset, fastmath=True)
        row_sum[r] = row_sum[r] * corr + p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
        row_max[r] = new_max
        s_mn[r, None].store(p)
        o_mn[r, None].store(o_mn[r, None].load() * corr)


@cute.jit
def finalize(
    o_mn: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    scale_log2: Float32,
    lse: cute.Tensor,
    exchange: cute.Tensor,
    c_mn: cute.Tensor,
    col,
    lane,
    warp_cols: cutlass.Constexpr,
):
    """Add the row sums over the quad and the slab's warps (through ``exchange``; CTA barriers
    before and after its use), normalise this thread's O columns and write each row's natural-log
    LSE to ``lse``. Rows with no unmasked key get O = 0 and LSE = -inf."""
    rows = cute.size(row_max)
    part = cute.make_rmem_tensor((rows,), Float32)
    for r in cutlass.range_constexpr(rows):
        part[r] = quad_allreduce_sum(row_sum[r])
    cute.arch.barrier()
    _publish(part, exchange, c_mn, col, lane)
    cute.arch.barrier()
    for r in cutlass.range_constexpr(rows):
        total = exchange[c_mn[r, 0][0], 0]
        for c in cutlass.range_constexpr(1, warp_cols):
            total = total + exchange[c_mn[r, 0][0], c]
        empty = total == 0.0 or total != total  # noqa: PLR0124 -- the NaN test
        inv = 0.0 if empty else cute.arch.rcp_approx(total)
        o_mn[r, None].store(o_mn[r, None].load() * inv)
        lse[r] = (
            -Float32.inf if empty else (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
        )
