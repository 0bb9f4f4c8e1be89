"""The split-KV combine of the decode kernels (templates/decode_sm80.py.j2 and the MLA ones): a few
warps merge one output row from the partial results of the splits, a lane a split, so that the
splits' reads are independent and their memory latencies overlap (:func:`combine_row`).

Split ``s`` wrote its row normalised over its own keys, ``O_s``, and its natural-log sum of
exponentials ``lse_s`` (``-inf`` and ``O_s = 0`` for a split that saw no key). Then
``lse = log(sum_s exp(lse_s))`` and ``out = sum_s exp(lse_s - lse) O_s``; a row no split saw gets
``out = 0`` and ``lse = -inf``. Partial layouts: ``o_partial`` (splits, batch, seqlen_q, heads_q,
head_dim) and ``lse_partial`` (splits, batch, heads_q, seqlen_q), float32.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cutefa.kernels.common import pdl
from cutefa.kernels.common.softmax import LN_2, LOG2_E

WARP = 32


@cute.jit
def warp_allreduce(val: Float32, is_max: cutlass.Constexpr) -> Float32:
    for i in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_bfly(val, offset=1 << (4 - i))
        val = cute.arch.fmax(val, other) if cutlass.const_expr(is_max) else val + other
    return val


def warps_per_row(head_dim: int) -> int:
    """Warps that merge one output row, each owning a contiguous slice of its columns: a warp per
    32 columns, at most 8 (head dim 64: 2 warps; 128: 4; 256: 8; the 512-wide latent rows: 8 warps
    of 64 columns)."""
    return max(1, min(8, head_dim // WARP))


def columns_per_lane(head_dim: int) -> int:
    """Columns of its warp's slice a lane holds after the reduction (and stores). The row's warps
    cover it whole: a multiple of 32 columns (the decode head dims 64, 96, 128, 192, 256 and the
    512-wide latent rows)."""
    if head_dim % WARP or head_dim % (WARP * warps_per_row(head_dim)):
        raise ValueError(
            f"the combine takes rows of a multiple of {WARP} columns its warps split evenly; got {head_dim}"
        )
    return head_dim // (WARP * warps_per_row(head_dim))


def rows_per_cta(head_dim: int, warps: int) -> int:
    """Output rows a CTA merges (the launch grid divides the rows by this)."""
    return max(1, warps // warps_per_row(head_dim))


def threads_per_cta(head_dim: int, warps: int) -> int:
    """The combine CTA: ``warps`` warps, or one row's warps where a row takes more."""
    return WARP * rows_per_cta(head_dim, warps) * warps_per_row(head_dim)


@cute.jit
def combine_cta(
    mOpart: cute.Tensor,
    mLSEpart: cute.Tensor,
    mO: cute.Tensor,
    mLSE: cute.Tensor,
    tidx: Int32,
    bx: Int32,
    batch: Int32,
    head_dim: cutlass.Constexpr,
    warps: cutlass.Constexpr,
):
    """The combine kernel's body: CTA ``bx`` of a (ceil(rows / rows_per_cta), batch) grid of
    ``threads_per_cta`` threads merges rows ``bx * rows_per_cta ...`` (row = token * heads_q +
    head) of sequence ``batch``, :func:`warps_per_row` warps a row. The combine is launched as the
    split kernel's programmatic dependent (sm_90+, :mod:`cutefa.kernels.common.pdl`): its CTAs may
    start while the splits still run, and wait here for them before reading a partial."""
    pdl.wait_primary()
    row_threads = WARP * warps_per_row(head_dim)
    row = bx * rows_per_cta(head_dim, warps) + tidx // row_threads
    heads_q = mO.shape[2]
    if row < mO.shape[1] * heads_q:
        t = row // heads_q
        thread = tidx % row_threads
        combine_row(
            mOpart, mLSEpart, mO, mLSE, batch, t, row - t * heads_q, thread // WARP, thread % WARP, head_dim
        )


@cute.jit
def combine_row(
    mOpart: cute.Tensor,
    mLSEpart: cute.Tensor,
    mO: cute.Tensor,
    mLSE: cute.Tensor,
    batch: Int32,
    t: Int32,
    head: Int32,
    warp: Int32,
    lane: Int32,
    head_dim: cutlass.Constexpr,
):
    """Merge row (batch, token t, head) of the splits into ``mO`` (batch, seqlen_q, heads_q,
    head_dim; its dtype) and ``mLSE`` (batch, heads_q, seqlen_q): warp ``warp`` of the row's
    :func:`warps_per_row` owns a contiguous slice of ``32 * columns_per_lane`` columns.

    Split-major: lane ``j`` reads split ``j``'s whole slice (every 32nd split after the first
    pass) and scales it by its own split's weight, so the reads are independent vector loads with
    no shuffle between them and land in one memory latency; the 32 lanes' rows are then summed
    by a butterfly reduce-scatter (31 shuffles) that leaves lane ``l`` the sum of chunk ``l``:
    the lane-major layout the output store wants. Every warp of the row computes the same lse
    from the same reads."""
    num_splits = mLSEpart.shape[0]
    vec = columns_per_lane(head_dim)
    width = WARP * vec  # the warp's columns
    # lane j reads the lse of split j once and, in the same memory latency (it does not wait for
    # the lse), split j's slice of the row; more splits than a pass are read 32 at a time on top
    acc = cute.make_rmem_tensor((width,), Float32)
    acc.fill(0.0)
    first = -Float32.inf
    if lane < num_splits:
        first = mLSEpart[lane, batch, head, t]
        cute.autovec_copy(cute.local_tile(mOpart[lane, batch, t, head, None], (width,), (warp,)), acc)
    top = first
    for s0 in cutlass.range(WARP, num_splits, WARP, unroll=1):
        if s0 + lane < num_splits:
            top = cute.arch.fmax(top, mLSEpart[s0 + lane, batch, head, t])
    top = warp_allreduce(top, True)
    offset = Float32(0.0) if top == -Float32.inf else top
    total = cute.math.exp2((first - offset) * LOG2_E, fastmath=True)
    for s0 in cutlass.range(WARP, num_splits, WARP, unroll=1):
        if s0 + lane < num_splits:
            total += cute.math.exp2((mLSEpart[s0 + lane, batch, head, t] - offset) * LOG2_E, fastmath=True)
    total = warp_allreduce(total, False)
    lse = -Float32.inf
    if total > 0.0:
        lse = offset + cute.math.log2(total, fastmath=True) * LN_2
    lse_weight = Float32(0.0) if lse == -Float32.inf else lse
    # pass 0 (the common case is one pass) scaled by its split's weight exp(lse_s - lse) (0 for a
    # split that saw no key; a lane past the splits holds zeros)
    acc.store(acc.load() * cute.math.exp2((first - lse_weight) * LOG2_E, fastmath=True))
    part = cute.make_rmem_tensor((width,), Float32)
    for s0 in cutlass.range(WARP, num_splits, WARP, unroll=1):
        split = s0 + lane
        if split < num_splits:
            cute.autovec_copy(cute.local_tile(mOpart[split, batch, t, head, None], (width,), (warp,)), part)
            weight = cute.math.exp2((mLSEpart[split, batch, head, t] - lse_weight) * LOG2_E, fastmath=True)
            acc.store(acc.load() + part.load() * weight)
    # reduce-scatter over the lanes: at distance d, the chunks pair up (c, c + d); a lane keeps
    # the half whose bit d matches its own and sends its partner the other half
    for stage in cutlass.range_constexpr(5):
        d = (WARP // 2) >> stage
        for c in cutlass.range_constexpr(d):
            for e in cutlass.range_constexpr(vec):
                lo = acc[c * vec + e]
                hi = acc[(c + d) * vec + e]
                upper = (lane & d) != 0
                send = Float32(cutlass.select_(upper, lo, hi))
                keep = Float32(cutlass.select_(upper, hi, lo))
                acc[c * vec + e] = keep + cute.arch.shuffle_sync_bfly(send, offset=d)
    mine = cute.make_rmem_tensor((vec,), Float32)  # chunk `lane` of the warp's columns
    for e in cutlass.range_constexpr(vec):
        mine[e] = acc[e]
    out = cute.make_rmem_tensor((vec,), mO.element_type)
    out.store(mine.load().to(mO.element_type))
    cute.autovec_copy(out, cute.local_tile(mO[batch, t, head, None], (vec,), (warp * WARP + lane,)))
    if warp == 0 and lane == 0:
        mLSE[batch, head, t] = lse
