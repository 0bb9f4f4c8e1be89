"""The warps of a decode CTA that split the keys (templates/decode_sm80.py.j2, the KEYS schedule of
cutefa.model.policy_decode): their partial rows merge through shared memory.

Each warp walks its own slice of every key block with its own online softmax, so at the end warp
``w`` holds its rows normalised over its keys, ``O_w``, and their natural-log sums of exponentials
``lse_w`` (``-inf`` and ``O_w = 0`` for a warp that saw no key of a row). All warps hold the same
fragment layout (one-warp MMA tiles), so a thread's element ``i`` is the same (row, column) in every
warp: warps ``1..`` write theirs by (lane, element), conflict-free, and warp 0 merges
``lse = log(sum_w exp(lse_w))``, ``O = sum_w exp(lse_w - lse) O_w`` (a row no warp saw: O = 0,
lse = -inf) into its own fragment, which the kernel then stores.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cutefa.kernels.common.softmax import LN_2, LOG2_E

WARP = 32


@cute.jit
def merge_rows(
    o_mn: cute.Tensor,
    lse: cute.Tensor,
    o_space: cute.Pointer,
    lse_space: cute.Pointer,
    warp: Int32,
    lane: Int32,
    key_warps: cutlass.Constexpr,
):
    """Merge the ``key_warps`` warps' ``o_mn`` ((rows, cols) view of the normalised O fragment) and
    ``lse`` (per row) into warp 0's. ``o_space``/``lse_space``: shared memory no warp reads any more
    (the K and V stages), for ``(key_warps - 1) * 32`` fragments and their LSEs. Every thread of the
    CTA calls it (it holds a CTA barrier)."""
    rows = cute.size(o_mn, mode=[0])
    cols = cute.size(o_mn, mode=[1])
    x_o = cute.make_tensor(
        cute.recast_ptr(o_space, dtype=Float32), cute.make_layout((WARP, rows, cols, key_warps - 1))
    )
    x_lse = cute.make_tensor(
        cute.recast_ptr(lse_space, dtype=Float32), cute.make_layout((WARP, rows, key_warps - 1))
    )
    if warp > 0:
        for r in cutlass.range_constexpr(rows):
            x_lse[lane, r, warp - 1] = lse[r]
            for c in cutlass.range_constexpr(cols):
                x_o[lane, r, c, warp - 1] = o_mn[r, c]
    cute.arch.barrier()
    if warp == 0:
        for r in cutlass.range_constexpr(rows):
            top = lse[r]
            for w in cutlass.range_constexpr(key_warps - 1):
                top = cute.arch.fmax(top, x_lse[lane, r, w])
            offset = Float32(0.0) if top == -Float32.inf else top
            # exp(-inf) = 0: a warp that saw none of the row's keys adds nothing
            own = cute.math.exp2((lse[r] - offset) * LOG2_E, fastmath=True)
            total = own
            for c in cutlass.range_constexpr(cols):
                o_mn[r, c] = o_mn[r, c] * own
            for w in cutlass.range_constexpr(key_warps - 1):
                weight = cute.math.exp2((x_lse[lane, r, w] - offset) * LOG2_E, fastmath=True)
                total += weight
                for c in cutlass.range_constexpr(cols):
                    o_mn[r, c] = o_mn[r, c] + x_o[lane, r, c, w] * weight
            inv = Float32(0.0)
            merged = -Float32.inf
            if total > 0.0:
                inv = cute.arch.rcp_approx(total)
                merged = offset + cute.math.log2(total, fastmath=True) * LN_2
            for c in cutlass.range_constexpr(cols):
                o_mn[r, c] = o_mn[r, c] * inv
            lse[r] = merged
