"""fp32 reductions into global memory shared by the backward kernels' dQ accumulation."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector


@cute.jit
def red_add_pairs(
    acc: cute.Tensor, coords: cute.Tensor, gdst: cute.Tensor, row_limit: Int32, tile_rows: cutlass.Constexpr = 0
):
    """gdst += acc for rows below ``row_limit``, two adjacent columns per 8-byte vector reduction
    (red.global.add.v2.f32, sm_90 and newer: half the reductions of element-wise ones, each a full
    8-byte word).

    ``acc`` is an MMA accumulator fragment (mma.sync or WGMMA) whose elements 2i and 2i + 1 are
    adjacent columns (even, odd) of one row; ``gdst`` is the thread's partition of an fp32
    destination with contiguous rows, an 8-byte aligned base and even strides, so that every pair
    is 8-byte aligned; ``coords`` the tile-local (row, col) of each element.

    ``tile_rows`` (the rows of the tile ``coords`` spans; 0: unknown): when every row of the tile
    is below ``row_limit`` (all query blocks but the last) the reductions go out unpredicated, so
    their addresses are the base plus constants instead of one guarded branch each."""
    if cutlass.const_expr(tile_rows > 0):
        if row_limit >= tile_rows:
            _red_add_all(acc, gdst)
        else:
            _red_add_guarded(acc, coords, gdst, row_limit)
    else:
        _red_add_guarded(acc, coords, gdst, row_limit)


@cute.jit
def _red_add_all(acc: cute.Tensor, gdst: cute.Tensor):
    pair_type = ir.VectorType.get([2], Float32.mlir_type)
    for i in cutlass.range_constexpr(cute.size(acc) // 2):
        pair = vector.from_elements(pair_type, [acc[2 * i].ir_value(), acc[2 * i + 1].ir_value()])
        cute.arch.red(
            gdst.iterator + cute.crd2idx(2 * i, gdst.layout), pair, op="add", dtype=Float32, sem="relaxed", scope="gpu"
        )


@cute.jit
def _red_add_guarded(acc: cute.Tensor, coords: cute.Tensor, gdst: cute.Tensor, row_limit: Int32):
    pair_type = ir.VectorType.get([2], Float32.mlir_type)
    for i in cutlass.range_constexpr(cute.size(acc) // 2):
        if coords[2 * i][0] < row_limit:
            pair = vector.from_elements(pair_type, [acc[2 * i].ir_value(), acc[2 * i + 1].ir_value()])
            cute.arch.red(
                gdst.iterator + cute.crd2idx(2 * i, gdst.layout), pair, op="add", dtype=Float32, sem="relaxed",
                scope="gpu",
            )  # fmt: skip
