"""Two-level O accumulation (two_level variants of the sm90 e4m3 forward,
templates/fwd_sm90_fp8.py.j2): every few key blocks each consumer thread promotes its WGMMA
accumulator of O into an fp32 copy in shared memory.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cutefa.kernels.sm90.parts import WG_THREADS

# two_level variants: the e4m3 tensor cores accumulate with fewer mantissa bits than fp32 (each
# product aligned to the accumulator and cut short), so O accumulated over n keys in one WGMMA
# accumulator loses about n * 2^-16 of itself where V's columns carry a mean (25% at 16k keys;
# docs/log/perf-notes.md). Every PROMOTE_BLOCKS key blocks each consumer thread adds its O accumulator
# into an fp32 copy in shared memory (its own slots) and restarts it from zero, so that the tensor
# cores sum at most PROMOTE_BLOCKS blocks.
PROMOTE_BLOCKS = 4
O32_CHUNK = 4  # fp32 values of one 16-byte access


def o32_layout(head_dim: int, consumers: int):
    """The fp32 shared-memory copy of O (two_level): a consumer thread's head_dim / 2 accumulator
    values in 16-byte chunks, chunk j of the warpgroup's 128 threads side by side (a warp's access is
    512 contiguous bytes): (O32_CHUNK, threads, chunks, consumers)."""
    chunks = head_dim // 2 // O32_CHUNK
    return cute.make_layout(
        (O32_CHUNK, WG_THREADS, chunks, consumers),
        stride=(1, O32_CHUNK, O32_CHUNK * WG_THREADS, O32_CHUNK * WG_THREADS * chunks),
    )


@cute.jit
def zero_o32(o32: cute.Tensor):
    """A thread's fp32 O slots (``o32``: (O32_CHUNK, chunks)) set to zero."""
    zeros = cute.make_rmem_tensor((O32_CHUNK,), Float32)
    zeros.fill(0.0)
    for j in cutlass.range_constexpr(cute.size(o32, mode=[1])):
        cute.autovec_copy(zeros, o32[None, j])


@cute.jit
def promote_o(acc_O: cute.Tensor, o32: cute.Tensor, o32_scale: cute.Tensor, merge: cutlass.Constexpr = False):
    """o32 = o32 * o32_scale[row] + acc_O per value, and o32_scale = 1 (two_level; the caller's
    next P V then overwrites acc_O: its first k-block's scale-d is 0). With ``merge`` (the
    epilogue) the sum goes to acc_O instead. Accumulator value v (flat index of the ((2, 2, n), 1,
    1) fragment: column pair, row half, 8-column block) sits in chunk v // 4 at v % 4, so row half
    (v % 4) // 2."""
    for j in cutlass.range_constexpr(cute.size(o32, mode=[1])):
        part = cute.make_rmem_tensor((O32_CHUNK,), Float32)
        cute.autovec_copy(o32[None, j], part)
        for e in cutlass.range_constexpr(O32_CHUNK):
            v = j * O32_CHUNK + e
            part[e] = part[e] * o32_scale[e // 2] + acc_O[v]
            if cutlass.const_expr(merge):
                acc_O[v] = part[e]
        if cutlass.const_expr(not merge):
            cute.autovec_copy(part, o32[None, j])
    if cutlass.const_expr(not merge):
        for r in cutlass.range_constexpr(cute.size(o32_scale)):
            o32_scale[r] = Float32(1.0)


@cute.jit
def scale_rows(o32_scale: cute.Tensor, corr: cute.Tensor):
    """o32_scale[r] *= corr[r]: the shared-memory copy of O follows the rescales of the registers'."""
    for r in cutlass.range_constexpr(cute.size(corr)):
        o32_scale[r] = o32_scale[r] * corr[r]


__all__ = [
    "O32_CHUNK",
    "PROMOTE_BLOCKS",
    "o32_layout",
    "promote_o",
    "scale_rows",
    "zero_o32",
]
