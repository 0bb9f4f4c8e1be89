"""WGMMA building blocks of the MLA decode kernel for sm_90a
(templates/decode_mla_wgmma_sm90.py.j2; policy: :mod:`cutefa.model.policy_mla_wgmma`).

One shared-memory stage of latent rows serves both products. It is laid out as the K-major B
operand of S = Q K^T ((keys, 576), 128-byte swizzle); the MN-major B operand of O += P V
((512, keys): V^T) over the same bytes is the canonical MN-major layout of that shape with the
stage stride of the latent stages: both tile 8-key x 64-column swizzle atoms, keys first, then
columns, so each (key, column) maps to the same byte. The first warpgroup computes S and the
softmax and hands P and per-row numbers (rescale factors, then 1 / row sum and lse) to the second
through shared memory (:func:`publish_rows`, :func:`read_rows`).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import warpgroup

from cutefa.kernels.common.softmax import LN_2, quad_allreduce_sum
from cutefa.kernels.sm90 import parts

WG_ROWS = parts.WG_ROWS
WG_THREADS = parts.WG_THREADS


def pv_tiled_mma_ss(dtype, cols: int):
    """O += P V for one warpgroup with P from shared memory (K-major) and V^T MN-major."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
        cutlass.Float32, (1, 1, 1), (WG_ROWS, cols),
    )  # fmt: skip


def smem_layouts(dtype, tile_n: int, head_dim: int, head_dim_v: int, stages: int):
    """(Q (64, head_dim, 1), the latent stages (tile_n, head_dim, stages) K-major, their V^T view
    (head_dim_v, tile_n, stages) MN-major with the latent stage stride, P (64, tile_n, 1))."""
    sq = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (WG_ROWS, tile_n, head_dim), dtype, 1)
    skv = sm90_utils.make_smem_layout_b(
        utils.LayoutEnum.ROW_MAJOR, (WG_ROWS, tile_n, head_dim), dtype, stages
    )
    vt = sm90_utils.make_smem_layout_b(
        utils.LayoutEnum.COL_MAJOR, (WG_ROWS, head_dim_v, tile_n), dtype, stages
    )
    outer = vt.outer
    # the stage mode is (1, stages):(0, stride): give it the latent stages' stride
    restaged = cute.make_layout(
        outer.shape, stride=(outer.stride[0], outer.stride[1], (0, tile_n * head_dim))
    )
    svt = cute.make_composed_layout(vt.inner, vt.offset, restaged)
    sp = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (WG_ROWS, head_dim_v, tile_n), dtype, 1)
    return sq, skv, svt, sp


@cute.jit
def publish_rows(values: cute.Tensor, exchange: cute.Tensor, c_mn: cute.Tensor, col: cutlass.Constexpr, lane):
    """``exchange[row, col] = values[r]`` for each of the thread's fragment rows (the same on the
    4 threads of a quad: written by the quad's first)."""
    if lane % 4 == 0:
        for r in cutlass.range_constexpr(cute.size(values)):
            exchange[c_mn[r, 0][0], col] = values[r]


@cute.jit
def read_rows(values: cute.Tensor, exchange: cute.Tensor, c_mn: cute.Tensor, col: cutlass.Constexpr):
    """``values[r] = exchange[row, col]`` for each of the thread's fragment rows."""
    for r in cutlass.range_constexpr(cute.size(values)):
        values[r] = exchange[c_mn[r, 0][0], col]


@cute.jit
def finalize_rows(
    row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32, inv: cute.Tensor, lse: cute.Tensor
):
    """Each row's 1 / (sum over the quad) into ``inv`` and its natural-log LSE into ``lse``; rows
    with no unmasked key get inv = 0 (O = 0) and lse = -inf."""
    for r in cutlass.range_constexpr(cute.size(row_max)):
        total = quad_allreduce_sum(row_sum[r])
        empty = total == 0.0 or total != total  # noqa: PLR0124 -- the NaN test
        inv[r] = 0.0 if empty else cute.arch.rcp_approx(total)
        lse[r] = (
            -Float32.inf if empty else (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
        )


@cute.jit
def scale_rows(o_mn: cute.Tensor, factors: cute.Tensor):
    """Multiply each of the thread's rows of ``o_mn`` by its factor."""
    for r in cutlass.range_constexpr(cute.size(factors)):
        o_mn[r, None].store(o_mn[r, None].load() * factors[r])
