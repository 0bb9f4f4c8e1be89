"""fp32 reductions into global memory shared by the backward kernels' dQ accumulation."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector
from cutlass.cutlass_dsl import dsl_user_op

from cutefa.kernels.common.ptx import effect_asm


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


# --- Bulk reduce-add (sm_90+): a whole shared-memory buffer added into global memory by one thread --


@dsl_user_op
def st_shared_f32x4(addr: Int32, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> None:
    """``st.shared.v4.f32 [addr], {a, b, c, d}``: one 16-byte store at the 32-bit shared-memory
    address ``addr`` (16-byte aligned)."""
    effect_asm(
        None,
        [Int32(addr).ir_value(loc=loc, ip=ip), *(Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d))],
        "st.shared.v4.f32 [$0], {$1, $2, $3, $4};",
        "r,f,f,f,f,~{memory}",
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def bulk_reduce_add_f32(gaddr: Int64, saddr: Int32, nbytes: int, *, loc=None, ip=None) -> None:
    """``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32``: ``nbytes`` (a multiple of
    16) of fp32 at the shared-memory address ``saddr`` added element by element (each add atomic)
    into global memory at ``gaddr`` (both 16-byte aligned), asynchronously, in this thread's current
    bulk group (SASS ``UBLKRED``). The caller commits the group (``cute.arch.cp_async_bulk_commit_group``)
    and waits on it (``cute.arch.cp_async_bulk_wait_group(0, read=True)``) before the shared memory is
    written again."""
    if nbytes % 16:
        raise ValueError(f"nbytes={nbytes}: a bulk copy moves a multiple of 16 bytes")
    effect_asm(
        None,
        [Int64(gaddr).ir_value(loc=loc, ip=ip), Int32(saddr).ir_value(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r,~{memory}",
        loc=loc,
        ip=ip,
    )
