"""The sm90 e4m3 forward's v_mean epilogue (spec flag ``v_mean``): v's column means, taken out
before quantization (``cutefa.center_v``), added back to O in registers before it is stored.

A module of its own so that only the kernels with the flag import it (a kernel's fingerprint
covers the building blocks it imports: cutefa.compile)."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32


@cute.jit
def add_column_means(o_mn: cute.Tensor, c_mn: cute.Tensor, means: cute.Tensor, lse: cute.Tensor):
    """O[r, j] += means[column of j] on the rows whose ``lse`` is finite (that attend a key; the
    others stay 0): ``c_mn`` holds the (row, column) of each of the thread's O values, ``means``
    the (head_dim,) float32 means of v's columns for this (batch, kv head), read once per tile."""
    mine = cute.make_rmem_tensor_like(o_mn[0, None], Float32)
    for j in cutlass.range_constexpr(cute.size(mine)):
        mine[j] = means[c_mn[0, j][1]]
    for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
        attends = Float32(0.0) if lse[r] == -Float32.inf else Float32(1.0)
        o_mn[r, None].store(o_mn[r, None].load() + mine.load() * attends)


__all__ = ["add_column_means"]
