"""The packed rows of no sequence in a variable-length forward's outputs: out 0, lse ``-inf``; and
in a variable-length backward's gradients: dQ, dK, dV 0 (:func:`launch_zero`).

Sequence ``b`` of a packed batch owns q's rows ``[cu_seqlens_q[b], cu_seqlens_q[b] + seqused_q[b])``;
the attention kernel writes those rows of out and lse and no other. The others belong to no
sequence: a span's rows past its seqused, ``[cu_seqlens_q[b] + seqused_q[b], cu_seqlens_q[b + 1])``
(gap ``b``), and the rows past the last span, ``[cu_seqlens_q[batch], total)`` (the tail). The call's
contract gives them out 0 and lse ``-inf`` (sinks or not); :func:`launch` writes exactly those on
the device, reading the lengths there (no host read: a CUDA graph replays it with new lengths).

Plain CuTe DSL (no arch-specific instruction): every family's forward launches it from its
``__call__``, on the same stream, before the attention kernel (the rows they write are disjoint).

Grid: one dimension, ``batch * seq_slices`` CTAs for the sequences' gaps (CTA ``x`` takes slice
``x % seq_slices`` of gap ``x // seq_slices``) and ``tail_slices`` CTAs for the tail. A slice is a
stride of the gap's (row, head) pairs, so the work is proportional to the rows of no sequence, and
a CTA whose gap is empty reads its lengths and leaves (the common case: no seqused, the last
span ending at ``total``). The slice counts come from the packed size (:func:`slice_counts`): one
CTA a ``SLICE_BYTES`` of out rows were every row a gap's, at most ``MAX_SLICES`` a gap and about
``SEQUENCE_CTAS`` over the sequences together (one a sequence past that).

A (row, head) pair of out is ``d_v`` contiguous elements written ``VEC_BYTES`` at a time by
neighbouring threads (``STG.E.128``); lse's pairs are one float32 each, a gap's rows of one head
contiguous.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

FILL_THREADS = 128
VEC_BYTES = 16  # one store: 16 bytes of a row (out's rows are 16-byte aligned, as the compiles assume)
SLICE_BYTES = 32 * 1024  # out bytes one CTA takes where every row is a gap's
MAX_SLICES = 128  # CTAs on one gap at most (the tail's: a CTA an SM on an H100)
SEQUENCE_CTAS = 512  # CTAs on the sequences' gaps together, unless there are more sequences


def vector_shape(head_dim_v: int, elem_bytes: int) -> tuple[int, int]:
    """(elements a store, stores a (row, head) pair) for rows of ``head_dim_v`` elements of
    ``elem_bytes`` bytes: 16-byte stores where the row is a whole number of them, else smaller."""
    vec = VEC_BYTES // elem_bytes
    while head_dim_v % vec:
        vec //= 2
    return vec, head_dim_v // vec


def pairs_per_slice(head_dim_v: int, elem_bytes: int) -> int:
    """(row, head) pairs of out in ``SLICE_BYTES``."""
    return max(1, SLICE_BYTES // (head_dim_v * elem_bytes))


def slice_counts(batch, total, heads, pairs: int):
    """(seq_slices, tail_slices): CTAs a sequence's gap and the tail take, from the batch and the
    packed size only (``pairs``: :func:`pairs_per_slice`). A gap is at most its span, on average
    ``total / batch`` rows; the tail at most ``total``. Plain arithmetic: Int32 while tracing, int
    in a host-side check."""
    seqs = cutlass.max(batch, 1)
    tail = cutlass.min(cutlass.max((total * heads + pairs - 1) // pairs, 1), MAX_SLICES)
    span_pairs = (total + seqs - 1) // seqs * heads
    most = cutlass.min(cutlass.max(SEQUENCE_CTAS // seqs, 1), MAX_SLICES)
    return cutlass.min(cutlass.max((span_pairs + pairs - 1) // pairs, 1), most), tail


@cute.jit
def launch(
    mCuSeqlensQ: cute.Tensor,
    mSeqUsedQ: cute.Tensor,
    mO: cute.Tensor,
    mLSE: cute.Tensor,
    stream: cuda.CUstream,
):
    """Write out 0 and lse ``-inf`` on the packed rows of no sequence (module docstring):
    ``mCuSeqlensQ`` int32 (batch + 1,), ``mSeqUsedQ`` int32 (batch,), ``mO`` (total, heads, d_v)
    whose rows are 16-byte aligned, ``mLSE`` float32 (heads, total). Launched on ``stream``."""
    _launch_fill(mCuSeqlensQ, mSeqUsedQ, mO, mLSE, True, stream)


@cute.jit
def launch_zero(mCuSeqlens: cute.Tensor, mSeqUsed: cute.Tensor, mX: cute.Tensor, stream: cuda.CUstream):
    """Zero the packed rows of no sequence of ``mX`` (total, heads, d), 16-byte aligned rows: a
    variable-length backward's dQ (with q's lengths) and dK, dV (with k's), whose kernels write the
    rows of the sequences only. The same grid and stores as :func:`launch`, no lse."""
    _launch_fill(mCuSeqlens, mSeqUsed, mX, mX, False, stream)


@cute.jit
def _launch_fill(
    mCuSeqlens: cute.Tensor, mSeqUsed: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
    with_lse: cutlass.Constexpr, stream: cuda.CUstream,
):  # fmt: skip
    """The fill's grid (module docstring) over ``mO``'s rows, lse written only ``with_lse``."""
    batch = cute.size(mCuSeqlens.shape[0]) - 1
    pairs = pairs_per_slice(cute.size(mO.shape[2]), mO.element_type.width // 8)
    seq_slices, tail_slices = slice_counts(batch, cute.size(mO.shape[0]), cute.size(mO.shape[1]), pairs)
    fill_rows(mCuSeqlens, mSeqUsed, mO, mLSE, seq_slices, tail_slices, with_lse).launch(
        grid=(batch * seq_slices + tail_slices, 1, 1), block=[FILL_THREADS, 1, 1], stream=stream
    )


@cute.kernel
def fill_rows(
    mCuSeqlensQ: cute.Tensor, mSeqUsedQ: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, seq_slices: Int32,
    tail_slices: Int32, with_lse: cutlass.Constexpr,
):  # fmt: skip
    tidx, _, _ = cute.arch.thread_idx()
    bx, _, _ = cute.arch.block_idx()
    batch = mCuSeqlensQ.shape[0] - 1
    heads = mO.shape[1]
    vec, stores = vector_shape(cute.size(mO.shape[2]), mO.element_type.width // 8)
    # this CTA's gap [start, end) and its slice s of `slices`
    gap = bx // seq_slices
    s = bx - gap * seq_slices
    slices = seq_slices
    start = Int32(0)
    end = Int32(0)
    if gap < batch:
        start = mCuSeqlensQ[gap] + mSeqUsedQ[gap]
        end = mCuSeqlensQ[gap + 1]
    else:
        s = bx - batch * seq_slices
        slices = tail_slices
        start = mCuSeqlensQ[batch]
        end = mO.shape[0]
    rows = end - start
    pairs = rows * heads  # <= 0: nothing (an empty gap; inconsistent lengths are caught elsewhere)

    # out: `per_step` (row, head) pairs a step, `stores` neighbouring threads a pair; pair p is
    # (start + p // heads, p % heads), so consecutive pairs are consecutive in a contiguous out.
    per_step = FILL_THREADS // stores
    sub = tidx // stores
    column = tidx - sub * stores
    zeros = cute.make_rmem_tensor((vec,), mO.element_type)
    zeros.fill(0.0)
    store = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), mO.element_type, num_bits_per_copy=vec * mO.element_type.width
    )
    if sub < per_step:
        for p in cutlass.range(s * per_step + sub, pairs, slices * per_step, unroll=1):
            step = p // heads
            dst = cute.local_tile(mO[start + step, p - step * heads, None], (vec,), (column,))
            cute.copy(store, zeros, dst)
    # lse (heads, total): pair i is (i // rows, start + i % rows), a head's rows contiguous
    if cutlass.const_expr(with_lse):
        for i in cutlass.range(s * FILL_THREADS + tidx, pairs, slices * FILL_THREADS, unroll=1):
            head = i // rows
            mLSE[head, start + i - head * rows] = -Float32.inf
