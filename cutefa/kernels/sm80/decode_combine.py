"""The split-KV combine of the sm80 decode kernel (templates/decode_sm80.py.j2): one warp merges
one output row from the partial results of the splits, reading several splits' rows at once
(:func:`loads_in_flight`) so that their memory latencies overlap.

Split ``s`` wrote its row normalised over its own keys, ``O_s``, and its natural-log sum of
exponentials ``lse_s`` (``-inf`` and ``O_s = 0`` for a split that saw no key). Then
``lse = log(sum_s exp(lse_s))`` and ``out = sum_s exp(lse_s - lse) O_s``; a row no split saw gets
``out = 0`` and ``lse = -inf``. Partial layouts: ``o_partial`` (splits, batch, seqlen_q, heads_q,
head_dim) and ``lse_partial`` (splits, batch, heads_q, seqlen_q), float32.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cutefa.kernels.common.softmax import LN_2, LOG2_E

WARP = 32


@cute.jit
def warp_allreduce(val: Float32, is_max: cutlass.Constexpr) -> Float32:
    for i in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_bfly(val, offset=1 << (4 - i))
        val = cute.arch.fmax(val, other) if cutlass.const_expr(is_max) else val + other
    return val


def loads_in_flight(head_dim: int) -> int:
    """Partial rows a lane reads before it uses any (the combine's memory-level parallelism): 64
    float32 registers of them, at most 16 rows; a power of two, so that groups tile the 32 splits of
    a pass."""
    most = max(1, min(16, 64 // (head_dim // WARP)))
    return 1 << (most.bit_length() - 1)


@cute.jit
def combine_row(
    mOpart: cute.Tensor,
    mLSEpart: cute.Tensor,
    mO: cute.Tensor,
    mLSE: cute.Tensor,
    batch: Int32,
    t: Int32,
    head: Int32,
    lane: Int32,
    head_dim: cutlass.Constexpr,
):
    """Merge row (batch, token t, head) of the splits into ``mO`` (batch, seqlen_q, heads_q,
    head_dim; its dtype) and ``mLSE`` (batch, heads_q, seqlen_q): ``lane`` of the warp owns
    ``head_dim / 32`` contiguous columns."""
    num_splits = mLSEpart.shape[0]
    # the largest lse over the splits, then the sum of exponentials: each lane takes every 32nd split
    top = -Float32.inf
    for s0 in cutlass.range(0, num_splits, WARP, unroll=1):
        if s0 + lane < num_splits:
            top = cute.arch.fmax(top, mLSEpart[s0 + lane, batch, head, t])
    top = warp_allreduce(top, True)
    offset = Float32(0.0) if top == -Float32.inf else top
    total = Float32(0.0)
    for s0 in cutlass.range(0, num_splits, WARP, unroll=1):
        if s0 + lane < num_splits:
            total += cute.math.exp2((mLSEpart[s0 + lane, batch, head, t] - offset) * LOG2_E, fastmath=True)
    total = warp_allreduce(total, False)
    lse = -Float32.inf
    if total > 0.0:
        lse = offset + cute.math.log2(total, fastmath=True) * LN_2
    lse_weight = Float32(0.0) if lse == -Float32.inf else lse
    vec = head_dim // WARP
    group = loads_in_flight(head_dim)
    acc = cute.make_rmem_tensor((vec,), Float32)
    acc.fill(0.0)
    parts = cute.make_rmem_tensor((vec, group), Float32)  # a row's columns contiguous
    weights = cute.make_rmem_tensor((group,), Float32)
    # 32 splits at a time: lane j holds the weight of split s0 + j (exp(-inf) = 0: a split that saw
    # no key, or none at all past the splits, adds nothing); the partial rows are then read `group`
    # at a time, every read of a group issued before any is used (the rows are independent loads,
    # so the group's latencies overlap instead of adding up split after split).
    for s0 in cutlass.range(0, num_splits, WARP, unroll=1):
        weight = Float32(0.0)
        if s0 + lane < num_splits:
            weight = cute.math.exp2(
                (mLSEpart[s0 + lane, batch, head, t] - lse_weight) * LOG2_E, fastmath=True
            )
        for g0 in cutlass.range(0, cutlass.min(WARP, num_splits - s0), group, unroll=1):
            for u in cutlass.range_constexpr(group):  # the shuffles first: loads are not moved across them
                weights[u] = cute.arch.shuffle_sync(weight, g0 + u)  # 0 past the splits (lanes with none)
            for u in cutlass.range_constexpr(group):  # past the splits: the last split's row again, weight 0
                split = cutlass.min(s0 + g0 + u, num_splits - 1)
                src = cute.local_tile(mOpart[split, batch, t, head, None], (vec,), (lane,))
                cute.autovec_copy(src, parts[None, u])
            for u in cutlass.range_constexpr(group):
                acc.store(acc.load() + parts[None, u].load() * weights[u])
    out = cute.make_rmem_tensor((vec,), mO.element_type)
    out.store(acc.load().to(mO.element_type))
    cute.autovec_copy(out, cute.local_tile(mO[batch, t, head, None], (vec,), (lane,)))
    if lane == 0:
        mLSE[batch, head, t] = lse
