"""dq_warp: the dQ-writer warp of the sm90 backward (templates/bwd_sm90.py.j2): the consumers stage
their dQ pieces (bwd_dq_bulk.py), a warp of the producer warpgroup bulk-adds them into the fp32
workspace, the two sides handing each buffer over through named barriers.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cutefa.kernels.common.reduce import bulk_reduce_add_f32
from cutefa.kernels.sm90.bwd_dq_bulk import stage_values
from cutefa.kernels.sm90.parts import WG_THREADS

# --- dq_warp: a dQ-writer warp (FlashAttention-3/4's dQ path) --------------------------------------
# The consumers stage their piece as in dq_bulk, then arrive on their "dQ full" named barrier; warp
# 1 of the producer warpgroup (WRITER_THREADS threads) waits on it, issues the bulk reduce-add,
# waits until the copy has read the buffer (deterministic: until it is complete) and arrives on the
# consumer's "dQ empty" barrier, which the consumer syncs on before it writes the buffer again. The
# writer arrives on "dQ empty" once before the loop and each consumer syncs once after it, so every
# barrier generation is completed.

WRITER_THREADS = 32


def writer_barrier_threads() -> int:
    """Threads of a dQ full / dQ empty named barrier: one consumer warpgroup and the writer warp."""
    return WG_THREADS + WRITER_THREADS


@cute.jit
def stage_for_writer(
    acc: cute.Tensor, s_base: Int32, wtid: Int32, empty_id: cutlass.Constexpr, full_id: cutlass.Constexpr
):
    """``acc`` (this thread's fragment of a dQ piece) -> shared memory at ``s_base`` in fragment
    order (as :func:`stage_and_reduce`), once the writer warp's previous bulk copy has read the
    buffer (``empty_id``); then fenced to the async proxy and handed to the writer (``full_id``)."""
    cute.arch.barrier(barrier_id=empty_id, number_of_threads=writer_barrier_threads())
    stage_values(acc, 0, cute.size(acc), s_base, wtid)
    cute.arch.fence_proxy("async.shared", space="cta")  # generic-proxy writes -> visible to the bulk copy
    cute.arch.barrier_arrive(barrier_id=full_id, number_of_threads=writer_barrier_threads())


@cute.jit
def _writer_wait(pending: cutlass.Constexpr, deterministic: Int32):
    """The writer's bulk groups until at most ``pending`` are outstanding: read (or, with
    ``deterministic``, complete: the next add into the same chunk lands after it)."""
    if deterministic != 0:
        cute.arch.cp_async_bulk_wait_group(pending)
    else:
        cute.arch.cp_async_bulk_wait_group(pending, read=True)


@cute.jit
def dq_writer_block(
    g_chunk,
    s_base0: Int32,
    s_base1: Int32,
    offsets: cutlass.Constexpr,
    piece_bytes: cutlass.Constexpr,
    lane: Int32,
    deterministic: Int32,
    full_id: cutlass.Constexpr,
    empty_id: cutlass.Constexpr,
):
    """The writer warp's work for one query block: for consumer 0, then 1, wait until its piece is
    staged (``full_id + c``) and add it into the block's chunk (``g_chunk``, the fp32 pointer of
    dq_accum; piece c at word ``offsets[c]``) with one bulk reduce-add (lane 0), each its own group;
    then each consumer's buffer is handed back (``empty_id + c``) as soon as its copy has read it
    (deterministic: completed)."""
    threads = writer_barrier_threads()
    cute.arch.barrier(barrier_id=full_id, number_of_threads=threads)
    if lane == 0:
        bulk_reduce_add_f32((g_chunk + offsets[0]).toint(), s_base0, piece_bytes[0])
        cute.arch.cp_async_bulk_commit_group()
    cute.arch.barrier(barrier_id=full_id + 1, number_of_threads=threads)
    if lane == 0:
        bulk_reduce_add_f32((g_chunk + offsets[1]).toint(), s_base1, piece_bytes[1])
        cute.arch.cp_async_bulk_commit_group()
        _writer_wait(1, deterministic)  # consumer 0's copy
    cute.arch.barrier_arrive(barrier_id=empty_id, number_of_threads=threads)
    if lane == 0:
        _writer_wait(0, deterministic)  # consumer 1's copy
    cute.arch.barrier_arrive(barrier_id=empty_id + 1, number_of_threads=threads)
