"""Score masks applied to accumulator fragments: key-length residue and causal (bottom-right).

Causal is aligned bottom-right, as in FlashAttention 2.1+: query row i may attend key j when
j <= i + (seqlen_k - seqlen_q). Masked scores become -inf before the softmax.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from cutefa.kernels.common.ptx import pure_asm


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
    c0_mn: cute.Tensor = None,
):
    """Set to -inf every score of ``s_mn`` whose key is out of range or (if causal) in the future.

    ``c_mn`` holds the tile-local (row, col) coordinate of each element of ``s_mn`` (same view);
    ``row_base``/``col_base`` are the global coordinates of the tile origin.

    ``c0_mn`` (optional): the same view for thread 0 of the MMA, whose coordinates are compile-time
    constants. A thread's rows and columns are thread 0's shifted by one offset each, so with
    ``c0_mn`` each row's key limit is moved by the column offset once and every score is one select
    (``arith.select``) against a constant column: in the accumulator's pair layout a bit mask per 32
    scores feeds the selects' predicates (:func:`_mask_row_bits`), otherwise a compare per score.
    Without it (the older path) each score is a dynamic ``if``, which the DSL lowers to a region
    yielding the whole fragment: ~30 selects per score once compiled.
    """
    rows = cute.size(s_mn, mode=[0])
    cols = cute.size(s_mn, mode=[1])
    if cutlass.const_expr(c0_mn is None):
        for r in cutlass.range_constexpr(rows):
            limit = seqlen_k - col_base
            if cutlass.const_expr(causal):
                limit = cutlass.min(limit, causal_key_limit(row_base + c_mn[r, 0][0], seqlen_q, seqlen_k) - col_base)
            for c in cutlass.range_constexpr(cols):
                if c_mn[0, c][1] >= limit:
                    s_mn[r, c] = -Float32.inf
    else:
        col_limit = seqlen_k - col_base - (c_mn[0, 0][1] - c0_mn[0, 0][1])  # in thread 0's columns
        pairs = _pair_columns(c0_mn)
        if cutlass.const_expr(causal):
            # Row r of this thread is thread 0's row r shifted by the thread's row offset, so one
            # value (the limit of the thread's first row) gives every row's limit plus a constant.
            # For a row below seqlen_q the causal limit is within seqlen_k; rows past seqlen_q are
            # never stored, so the key-length bound is not needed with it.
            diag = causal_key_limit(row_base + c_mn[0, 0][0], seqlen_q, seqlen_k) - seqlen_k + col_limit
        for r in cutlass.range_constexpr(rows):
            limit = col_limit
            if cutlass.const_expr(causal):
                limit = diag + (c0_mn[r, 0][0] - c0_mn[0, 0][0])
            if cutlass.const_expr(pairs):
                _mask_row_bits(s_mn, r, cols, limit)
            else:
                for c in cutlass.range_constexpr(cols):
                    # arith.select, not a branch (a divergent branch makes ptxas serialize WGMMAs)
                    s_mn[r, c] = Float32(cutlass.select_(c0_mn[0, c][1] < limit, s_mn[r, c], -Float32.inf))


def _pair_columns(c0_mn: cute.Tensor) -> bool:
    """Whether the columns of ``c0_mn`` are 0, 1, 8, 9, 16, 17, ...: two adjacent columns per
    8-column block (the mma.sync / WGMMA accumulator of thread 0), known at trace time."""
    return all(c0_mn[0, c][1] == 8 * (c // 2) + c % 2 for c in range(cute.size(c0_mn, mode=[1])))


@dsl_user_op
def shr_b32(x: Uint32, n: Int32, *, loc=None, ip=None) -> Uint32:
    """``shr.b32``: x >> n with shifts of 32 or more giving 0 (PTX clamps the amount; LLVM's
    shift would be undefined there)."""
    return Uint32(
        pure_asm(
            Uint32.mlir_type,
            [Uint32(x).ir_value(loc=loc, ip=ip), Int32(n).ir_value(loc=loc, ip=ip)],
            "shr.b32 $0, $1, $2;",
            "=r,r,r",
            loc=loc,
            ip=ip,
        )
    )


@cute.jit
def _mask_row_bits(s_mn: cute.Tensor, r: cutlass.Constexpr, cols: cutlass.Constexpr, limit: Int32):
    """Row ``r`` of ``s_mn`` keeps its elements whose (thread 0) column is below ``limit``, for the
    pair layout of :func:`_pair_columns`: element e has column 8 (e // 2) + e % 2, so the kept
    elements are the first ``keep`` = 2 (limit // 8) + min(limit % 8, 2). Per 32 elements one
    shift makes a bit mask whose bits go to predicates (R2P) for the selects: about one
    instruction per element instead of a compare and a select."""
    lim = cutlass.max(limit, 0)
    keep = (lim >> 3) * 2 + cutlass.min(lim & 7, 2)
    for chunk in cutlass.range_constexpr((cols + 31) // 32):
        # bit i set: element 32 chunk + i is kept
        bits = shr_b32(Uint32(0xFFFFFFFF), cutlass.max(32 * (chunk + 1) - keep, 0))
        for i in cutlass.range_constexpr(min(32, cols - 32 * chunk)):
            c = 32 * chunk + i
            keep_c = (bits & Uint32(1 << i)) != Uint32(0)
            s_mn[r, c] = Float32(cutlass.select_(keep_c, s_mn[r, c], -Float32.inf))
