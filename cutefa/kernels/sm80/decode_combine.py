"""The split-KV combine of the sm80 decode kernel (templates/decode_sm80.py.j2): one warp merges
one output row from the partial results of the splits.

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
    acc = cute.make_rmem_tensor((vec,), Float32)
    acc.fill(0.0)
    part = cute.make_rmem_tensor((vec,), Float32)
    for s in cutlass.range(num_splits, unroll=4):
        # exp(-inf) = 0: a split that saw no key (its O is 0) adds nothing
        w = cute.math.exp2((mLSEpart[s, batch, head, t] - lse_weight) * LOG2_E, fastmath=True)
        src = cute.local_tile(mOpart[s, batch, t, head, None], (vec,), (lane,))
        cute.autovec_copy(src, part)
        acc.store(acc.load() + part.load() * w)
    out = cute.make_rmem_tensor((vec,), mO.element_type)
    out.store(acc.load().to(mO.element_type))
    cute.autovec_copy(out, cute.local_tile(mO[batch, t, head, None], (vec,), (lane,)))
    if lane == 0:
        mLSE[batch, head, t] = lse
