"""Score masks applied to accumulator fragments: key-length residue and causal (bottom-right).

Causal is aligned bottom-right, as in FlashAttention 2.1+: query row i may attend key j when
j <= i + (seqlen_k - seqlen_q). Masked scores become -inf before the softmax.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


def causal_key_limit(row: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
    """One past the last key index that query ``row`` may attend under the causal rule."""
    return row + 1 + seqlen_k - seqlen_q


@cute.jit
def apply_mask(
    s_mn: cute.Tensor,
    c_mn: cute.Tensor,
    row_base: Int32,
    col_base: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr,
):
    """Set to -inf every score of ``s_mn`` whose key is out of range or (if causal) in the future.

    ``c_mn`` holds the tile-local (row, col) coordinate of each element of ``s_mn`` (same view);
    ``row_base``/``col_base`` are the global coordinates of the tile origin.
    """
    rows = cute.size(s_mn, mode=[0])
    cols = cute.size(s_mn, mode=[1])
    for r in cutlass.range_constexpr(rows):
        limit = seqlen_k - col_base
        if cutlass.const_expr(causal):
            limit = cutlass.min(limit, causal_key_limit(row_base + c_mn[r, 0][0], seqlen_q, seqlen_k) - col_base)
        for c in cutlass.range_constexpr(cols):
            if c_mn[0, c][1] >= limit:
                s_mn[r, c] = -Float32.inf
