"""dq_bulk, FlashAttention-3's dQ path of the sm90 backward (templates/bwd_sm90*.py.j2): a consumer's
dQ piece staged in shared memory in its fragment's order and added into the fp32 workspace with one
bulk reduce-add; the workspace's order (:func:`bulk_dq_coords`, what the postprocess reads back).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import warpgroup

from cutefa.kernels.common.reduce import bulk_reduce_add_f32, st_shared_f32x4
from cutefa.kernels.sm90.parts import WG_ROWS

# --- dq_bulk: FlashAttention-3's dQ path ----------------------------------------------------------
# Each consumer writes its dQ piece (64 rows x cols fp32, the WGMMA accumulator) to shared memory in
# the fragment's own order: value 4j + e of thread t at word 4 (128 j + t) + e (16-byte stores,
# contiguous over the warpgroup, no bank conflict); after a fence and a barrier of its 128 threads
# one thread adds the whole piece into global memory with one bulk reduce-add. The global workspace
# therefore holds, per query block, one contiguous chunk: consumer 0's piece, then consumer 1's,
# each in that order (space.bwd_dq_accum_shape); :func:`bulk_dq_coords` maps it back.

BULK_VEC = 4  # fp32 values per 16-byte store / load


def bulk_piece_offsets(pieces) -> tuple[int, ...]:
    """Word offset of each consumer's dQ piece inside a query block's chunk (pieces as
    ``space.sm90_bwd_dq_pieces``: (64-row block, first column, columns))."""
    offsets, at = [], 0
    for _, _, cols in pieces:
        offsets.append(at)
        at += WG_ROWS * cols
    return tuple(offsets)


def bulk_dq_coords(mma, thread, cols: int) -> cute.Tensor:
    """Tile-local (row, col) of each accumulator value of ``thread`` in a 64 x ``cols`` dQ piece:
    value i of the thread sits at word 4 (128 (i // 4) + thread) + i % 4 of the piece's chunk."""
    return mma.get_slice(thread).partition_C(cute.make_identity_tensor((WG_ROWS, cols)))


def bulk_dq_transposed_coords(mma, thread, cols: int, tile_m: int) -> cute.Tensor:
    """Tile-local (head-dim column, query row) of each accumulator value of ``thread`` in a
    transposed ``cols`` x ``tile_m`` dQ piece, in the fragment order :func:`stage_and_reduce` writes."""
    return mma.get_slice(thread).partition_C(cute.make_identity_tensor((cols, tile_m)))


@cute.jit
def stage_values(
    acc: cute.Tensor, first: cutlass.Constexpr, count: cutlass.Constexpr, s_base: Int32, wtid: Int32
):
    """Values [first, first + count) of this thread's fragment ``acc`` (``first`` and ``count``
    multiples of 4) -> shared memory at ``s_base`` in fragment order: value first + 4j + e of
    thread ``wtid`` at word 4 (128 j + wtid) + e, one 16-byte store per 4 values."""
    s_thread = s_base + wtid * (BULK_VEC * 4)
    for j in cutlass.range_constexpr(count // BULK_VEC):
        v = first + BULK_VEC * j
        st_shared_f32x4(
            s_thread + j * (WG_ROWS * 2 * BULK_VEC * 4), acc[v], acc[v + 1], acc[v + 2], acc[v + 3]
        )


@cute.jit
def stage_and_reduce(acc: cute.Tensor, s_base: Int32, g_addr, wtid: Int32, barrier_id: Int32):
    """``acc`` (this thread's fragment of a dQ piece) -> shared memory at ``s_base`` in fragment
    order, then one thread of the warpgroup adds the whole piece into global memory at ``g_addr``
    (Int64) with a bulk reduce-add and commits it, after the warpgroup met at its named barrier
    ``barrier_id`` (a constant or a value). The caller has made sure the buffer's previous bulk read
    is done (:func:`bulk_wait`, before a barrier all of the warpgroup passes)."""
    _stage_values_and_reduce(acc, 0, cute.size(acc), s_base, g_addr, wtid, barrier_id)


@cute.jit
def _stage_values_and_reduce(
    acc: cute.Tensor, first: cutlass.Constexpr, count: cutlass.Constexpr, s_base: Int32, g_addr, wtid: Int32,
    barrier_id: Int32,
):  # fmt: skip
    """Values [first, first + count) of this thread's fragment (``first`` and ``count`` multiples of
    4): words [128 first, 128 (first + count)) of the piece, staged at ``s_base`` and added into
    global memory at ``g_addr`` (the piece's start) plus their offset by one bulk reduce-add."""
    stage_values(acc, first, count, s_base, wtid)
    cute.arch.fence_proxy("async.shared", space="cta")  # generic-proxy writes -> visible to the bulk copy
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=WG_ROWS * 2)
    if wtid == 0:
        bulk_reduce_add_f32(g_addr + first * (WG_ROWS * 2 * 4), s_base, count * WG_ROWS * 2 * 4)
        cute.arch.cp_async_bulk_commit_group()


@cute.jit
def stage_aliased_and_reduce(
    acc: cute.Tensor, s_first: Int32, s_second: Int32, g_addr, wtid: Int32, barrier_id: cutlass.Constexpr,
    deterministic: Int32,
):  # fmt: skip
    """dq_bulk of the head-dim split where no staging buffer of its own fits (head dim 256): the
    piece is staged in the warpgroup's own head-dim columns of the current Q/dO stage, which only its
    dV and dK WGMMAs read after the consumers' barrier. Called once dQ and dV are done (dK, the last
    commit group, may still run): the first half of ``acc`` goes to ``s_first`` (this warpgroup's
    columns of dO) and out by one bulk reduce-add; after the WGMMAs are done, the second half to
    ``s_second`` (its columns of Q), a second bulk reduce-add. Thread 0 then waits until both copies
    have read their source (deterministic: until they are complete) and the warpgroup meets at the
    barrier: after it the Q/dO stage may go back to the producer."""
    half = cute.size(acc) // 2
    _stage_values_and_reduce(acc, 0, half, s_first, g_addr, wtid, barrier_id)
    warpgroup.wait_group(0)
    _stage_values_and_reduce(acc, half, half, s_second, g_addr, wtid, barrier_id)
    if wtid == 0:
        bulk_wait(deterministic)
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=WG_ROWS * 2)


@cute.jit
def bulk_wait(deterministic: Int32):
    """The calling thread's bulk reduce-adds: until their shared-memory source is read, or (with
    ``deterministic``) until they are complete, so that the next one into the same chunk lands
    after them (the fixed order of a deterministic run)."""
    if deterministic != 0:
        cute.arch.cp_async_bulk_wait_group(0)
    else:
        cute.arch.cp_async_bulk_wait_group(0, read=True)
