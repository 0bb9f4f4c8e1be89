"""Score masks applied to accumulator fragments: key-length residue, causal and the local
(sliding-window) band, all aligned bottom-right; and the key-block ranges a tile visits.

Causal is aligned bottom-right, as in FlashAttention 2.1+: query row i may attend key j when
j <= i + (seqlen_k - seqlen_q). The local band: row i attends key j when
i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right (an unbounded
side is a bound of 1 << 30, cutefa.api.features.UNBOUNDED; causal with a window is window_right =
0). Masked scores become -inf before the softmax.

Every function takes a sequence's lengths (``seqlen_q``, ``seqlen_k``: for a variable-length batch
those of the tile's sequence) and coordinates within that sequence.
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


# ---------------------------------------------------------------------------------------------
# The local (sliding-window) band


def local_key_bounds(row, seqlen_q, seqlen_k, window_left, window_right):
    """(lo, hi): query ``row`` attends the keys ``lo <= j < hi`` of the band, before clipping to
    [0, seqlen_k) (``lo`` may be negative, ``hi`` past ``seqlen_k``). Int32 arithmetic: no overflow
    for lengths below 2**29 and window bounds up to 1 << 30."""
    shift = row + seqlen_k - seqlen_q
    return shift - window_left, shift + window_right + 1


def local_key_blocks(row_first, row_last, tile_n: int, seqlen_q, seqlen_k, window_left, window_right):
    """Key blocks of ``tile_n`` keys that the query rows [row_first, row_last] (inclusive; the
    caller clips ``row_last`` to seqlen_q - 1, rows past it being never stored) visit under the
    local band: (n_first, n_last, u_first, u_last), where blocks [n_first, n_last) hold at least one
    key of some row's band below seqlen_k (the others are never loaded or computed) and
    [u_first, u_last) (inside it) are the blocks whose every key lies in every row's band and
    below seqlen_k, which need no per-element mask. The masked blocks are [u_last, n_last) (the
    right edge and the key-length residue) and [n_first, u_first) (the left edge); every range is
    empty or ordered (n_first <= u_first <= u_last <= n_last)."""
    lo_first, hi_first = local_key_bounds(row_first, seqlen_q, seqlen_k, window_left, window_right)
    lo_last, hi_last = local_key_bounds(row_last, seqlen_q, seqlen_k, window_left, window_right)
    n_last = cutlass.min((seqlen_k + tile_n - 1) // tile_n, (cutlass.max(hi_last, 0) + tile_n - 1) // tile_n)
    n_first = cutlass.min(cutlass.max(lo_first, 0) // tile_n, n_last)
    u_first = (cutlass.max(lo_last, 0) + tile_n - 1) // tile_n
    u_last = cutlass.max(cutlass.min(seqlen_k, hi_first), 0) // tile_n
    u_last = cutlass.max(cutlass.min(u_last, n_last), n_first)
    u_first = cutlass.min(cutlass.max(u_first, n_first), u_last)
    return n_first, n_last, u_first, u_last


def local_query_blocks(col_first, col_last, tile_m: int, seqlen_q, seqlen_k, window_left, window_right):
    """Query blocks of ``tile_m`` rows that see any of the keys [col_first, col_last] (inclusive;
    the caller clips ``col_last`` to seqlen_k - 1) under the local band: (m_first, m_last), the
    blocks [m_first, m_last) (empty when m_first == m_last). Row i sees key j when
    j - (seqlen_k - seqlen_q) - window_right <= i <= j - (seqlen_k - seqlen_q) + window_left."""
    shift = seqlen_k - seqlen_q
    m_last = cutlass.min(
        (seqlen_q + tile_m - 1) // tile_m, (cutlass.max(col_last - shift + window_left + 1, 0) + tile_m - 1) // tile_m
    )
    m_first = cutlass.min(cutlass.max(col_first - shift - window_right, 0) // tile_m, m_last)
    return m_first, m_last


def local_block_is_full(row_first, row_last, col_first, col_last, seqlen_q, seqlen_k, window_left, window_right):
    """Whether every key of [col_first, col_last] is below seqlen_k and in the band of every query
    row of [row_first, row_last] (all inclusive): such a block needs no per-element mask. A DSL
    boolean (use it in a dynamic ``if``)."""
    lo_last, _ = local_key_bounds(row_last, seqlen_q, seqlen_k, window_left, window_right)
    _, hi_first = local_key_bounds(row_first, seqlen_q, seqlen_k, window_left, window_right)
    return (col_last < seqlen_k) & (col_first >= lo_last) & (col_last < hi_first)


@cute.jit
def apply_local_mask(
    s_mn: cute.Tensor,
    c_mn: cute.Tensor,
    row_base: Int32,
    col_base: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    c0_mn: cute.Tensor = None,
):
    """Set to -inf every score of ``s_mn`` whose key is outside its row's local band or at or past
    ``seqlen_k`` (both edges of the band and the key-length residue: one call for any block).

    ``s_mn``: a (rows, cols) view of an fp32 accumulator fragment (mma.sync or WGMMA), ``c_mn``
    the same view of its tile-local (row, col) coordinates (a partitioned identity tensor): a row
    coordinate depends on the row index only and a column coordinate on the column index only.
    ``row_base``/``col_base``: the coordinates, within the sequence, of the tile origin. ``c0_mn``
    (optional): the same view for thread 0 of the MMA (compile-time constants), as in
    :func:`apply_mask`: each row's two limits are moved by the thread's column offset once and every
    score is one select against a constant column (a bit mask per 32 scores in the pair layout).
    """
    rows = cute.size(s_mn, mode=[0])
    cols = cute.size(s_mn, mode=[1])
    if cutlass.const_expr(c0_mn is None):
        for r in cutlass.range_constexpr(rows):
            lo, hi = local_key_bounds(row_base + c_mn[r, 0][0], seqlen_q, seqlen_k, window_left, window_right)
            lo = lo - col_base
            hi = cutlass.min(hi, seqlen_k) - col_base
            for c in cutlass.range_constexpr(cols):
                col = c_mn[0, c][1]
                s_mn[r, c] = Float32(cutlass.select_((col >= lo) & (col < hi), s_mn[r, c], -Float32.inf))
    else:
        lo, hi, end = local_mask_limits(c_mn, c0_mn, row_base, seqlen_q, seqlen_k, window_left, window_right)
        apply_local_mask_limits(s_mn, c0_mn, lo - col_base, hi - col_base, end - col_base)


def local_mask_limits(c_mn, c0_mn, row_base, seqlen_q, seqlen_k, window_left, window_right):
    """The limits :func:`apply_local_mask_limits` takes for the tile of query rows at ``row_base``
    and keys from column 0 (subtract a block's first key from each for that block): (lo, hi, end),
    in thread 0's columns, of this thread's first row (``c_mn``/``c0_mn`` as in
    :func:`apply_local_mask`): its band is [lo, hi), the keys below seqlen_k are those below
    ``end``. Loop-invariant over the key blocks: compute them once per tile."""
    col_shift = c_mn[0, 0][1] - c0_mn[0, 0][1]
    lo0, hi0 = local_key_bounds(row_base + c_mn[0, 0][0], seqlen_q, seqlen_k, window_left, window_right)
    return lo0 - col_shift, hi0 - col_shift, seqlen_k - col_shift


@cute.jit
def apply_local_mask_limits(s_mn: cute.Tensor, c0_mn: cute.Tensor, lo: Int32, hi: Int32, end: Int32):
    """:func:`apply_local_mask` from precomputed limits (:func:`local_mask_limits`, less the
    block's first key): row r of this thread keeps the (thread 0) columns in
    [lo + dr, min(hi + dr, end)), dr its row's offset from the thread's first row."""
    rows = cute.size(s_mn, mode=[0])
    cols = cute.size(s_mn, mode=[1])
    pairs = _pair_columns(c0_mn)
    for r in cutlass.range_constexpr(rows):
        dr = c0_mn[r, 0][0] - c0_mn[0, 0][0]  # row r is the thread's first row plus this
        row_lo = lo + dr
        row_hi = cutlass.min(hi + dr, end)
        if cutlass.const_expr(pairs):
            _mask_row_range_bits(s_mn, r, cols, row_lo, row_hi)
        else:
            for c in cutlass.range_constexpr(cols):
                col = c0_mn[0, c][1]
                s_mn[r, c] = Float32(cutlass.select_((col >= row_lo) & (col < row_hi), s_mn[r, c], -Float32.inf))


@cute.jit
def _pair_keep_count(limit: Int32) -> Int32:
    """In the pair layout of :func:`_pair_columns`, how many elements have a column below ``limit``."""
    lim = cutlass.max(limit, 0)
    return (lim >> 3) * 2 + cutlass.min(lim & 7, 2)


@cute.jit
def _mask_row_range_bits(s_mn: cute.Tensor, r: cutlass.Constexpr, cols: cutlass.Constexpr, lo: Int32, hi: Int32):
    """Row ``r`` of ``s_mn`` keeps its elements whose (thread 0) column is in [lo, hi), for the
    pair layout of :func:`_pair_columns`: the elements [keep(lo), keep(hi)) with keep as in
    :func:`_mask_row_bits`, one bit mask per 32 elements (two shifts and an and-not) feeding the
    selects' predicates."""
    first = _pair_keep_count(lo)
    end = _pair_keep_count(hi)
    for chunk in cutlass.range_constexpr((cols + 31) // 32):
        below_end = shr_b32(Uint32(0xFFFFFFFF), cutlass.max(32 * (chunk + 1) - end, 0))
        below_first = shr_b32(Uint32(0xFFFFFFFF), cutlass.max(32 * (chunk + 1) - first, 0))
        bits = below_end ^ (below_end & below_first)  # below_end and not below_first
        for i in cutlass.range_constexpr(min(32, cols - 32 * chunk)):
            c = 32 * chunk + i
            keep_c = (bits & Uint32(1 << i)) != Uint32(0)
            s_mn[r, c] = Float32(cutlass.select_(keep_c, s_mn[r, c], -Float32.inf))


def local_block_needs_mask(row_first, row_last, col_first, col_last, seqlen_q, seqlen_k, window_left, window_right):
    """The negation of :func:`local_block_is_full`: whether some key of [col_first, col_last] is at
    or past seqlen_k or outside the band of some query row of [row_first, row_last] (all inclusive),
    so that the block needs :func:`apply_local_mask`. A DSL boolean (use it in a dynamic ``if``)."""
    lo_last, _ = local_key_bounds(row_last, seqlen_q, seqlen_k, window_left, window_right)
    _, hi_first = local_key_bounds(row_first, seqlen_q, seqlen_k, window_left, window_right)
    return (col_last >= seqlen_k) | (col_first < lo_last) | (col_last >= hi_first)
