"""A head dim padded to the sm80 kernels' tile head dim.

A problem's head dim d (a multiple of 8) is served by a tile of ``tile_d`` >= d columns (the next
multiple of the 32-column shared-memory atom, :func:`cutefa.model.budgets_sm80.sm80_tile_head_dim`).
The global tensors are viewed ``tile_d`` wide with their own strides (:func:`padded_view`); the
columns at and past d are never read or written there: every copy of a padded tile is predicated
per 16-byte vector on its column as well as its row (:func:`copy_tile`), and a load zero-fills the
vectors it skips, so that the pad columns of Q and K add nothing to Q K^T and those of V make
zero columns of O, which the store skips. The inputs are never copied to pad them.
"""

import cutlass
import cutlass.cute as cute


def padded_view(t: cute.Tensor, tile_d: int) -> cute.Tensor:
    """``t`` (..., d) viewed as (..., tile_d) with the same strides: the columns past d alias the
    next rows' memory (or none), so only predicated copies may touch them."""
    shape = tuple(t.shape[i] for i in range(cute.rank(t) - 1)) + (tile_d,)
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=t.stride))


@cute.jit
def copy_tile(
    tiled_copy,
    src: cute.Tensor,
    dst: cute.Tensor,
    coords: cute.Tensor,
    row_limit,
    col_limit: cutlass.Constexpr,
    zero_fill: cutlass.Constexpr,
):
    """Copy a thread's (CPY, ROWS, COLS) partition vector by vector: only the vectors whose row
    coordinate is < ``row_limit`` and whose first column is < ``col_limit`` (the head dim, a
    multiple of the 8-element vector); with ``zero_fill`` the other vectors of ``dst`` are
    cleared."""
    for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
        for k in cutlass.range_constexpr(cute.size(dst, mode=[2])):
            if coords[0, m, k][0] < row_limit and coords[0, m, k][1] < col_limit:
                cute.copy(tiled_copy, src[None, m, k], dst[None, m, k])
            else:
                if cutlass.const_expr(zero_fill):
                    dst[None, m, k].fill(0)
