"""The dQ step of the sm90 backward's consumers (templates/bwd_sm90*.py.j2): dQ = dS K for one piece
of a query block (a consumer's 64 rows x some head-dim columns, or the transposed piece of tile_m =
80), issued behind the dV/dK WGMMAs (or, in the overlap schedule, between dV and dK), the Q/dO stage
released once those have read it, and the piece reduced into the fp32 dQ accumulator by the dQ
path: element-wise reduce-adds (:func:`dq_step`), staged and bulk-added by the consumer
(:func:`dq_bulk_step`, bwd_dq_bulk.py) or by the dQ-writer warp (:func:`dq_warp_step`,
bwd_dq_writer.py).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from cutefa.kernels.common.reduce import red_add_pairs
from cutefa.kernels.sm90.bwd_dq_bulk import stage_and_reduce
from cutefa.kernels.sm90.bwd_dq_writer import stage_for_writer
from cutefa.kernels.sm90.descriptors import hoisted
from cutefa.kernels.sm90.parts import WG_ROWS


def dq_operands(
    mma, wtid, sdS: cute.Tensor, sKt: cute.Tensor, gdq: cute.Tensor, row_block: int, col0: int, cols: int
):
    """WGMMA operands and destination of one dQ piece: rows [64 row_block, + 64) of a query block
    and columns [col0, col0 + cols). ``sdS`` (tile_m, tile_n, 2 buffers), ``sKt`` (head_dim,
    tile_n), ``gdq`` one (batch, head) of the fp32 accumulator (seqlen_q, head_dim).

    Returns (A fragments by dS buffer, B fragment, destination by 64-row block, coordinates,
    accumulator shape) for :func:`dq_step`."""
    tile_n = cute.size(sdS, mode=[1])
    thr = mma.get_slice(wtid)
    t_a = hoisted(thr.make_fragment_A(thr.partition_A(cute.local_tile(sdS, (WG_ROWS, tile_n, 2), (row_block, 0, 0)))))
    t_b = hoisted(thr.make_fragment_B(thr.partition_B(cute.local_tile(sKt, (cols, tile_n), (col0 // cols, 0)))))
    dst = thr.partition_C(cute.local_tile(gdq, (WG_ROWS, cols), (None, col0 // cols)))
    coords = thr.partition_C(cute.make_identity_tensor((WG_ROWS, cols)))
    return t_a, t_b, dst, coords, thr.partition_shape_C((WG_ROWS, cols))


@cute.jit
def dq_step(
    mma: cute.TiledMma,
    t_a: cute.Tensor,
    t_b: cute.Tensor,
    dst: cute.Tensor,
    coords: cute.Tensor,
    acc_shape: cutlass.Constexpr,
    buf: Int32,
    handle,
    row_block: Int32,
    seqlen_q: Int32,
):
    """One dQ piece of a query block: acc = dS K (dS buffer ``buf``) issued behind the dV/dK WGMMAs
    still in flight; once those are done the Q/dO stage is released (``handle``); then acc is added
    into the fp32 accumulator's 64-row block ``row_block`` (rows below seqlen_q)."""
    _dq_behind_dkv(
        mma, t_a, t_b, acc_shape, buf, handle,
        lambda acc: red_add_pairs(
            acc, coords, dst[None, None, None, row_block], seqlen_q - row_block * WG_ROWS, WG_ROWS
        ),
    )  # fmt: skip


@cute.jit
def _dq_behind_dkv(
    mma: cute.TiledMma, t_a: cute.Tensor, t_b: cute.Tensor, acc_shape: cutlass.Constexpr, buf: Int32, handle,
    reduce_dq: cutlass.Constexpr,
):  # fmt: skip
    """The dQ step behind the dV/dK WGMMAs, whatever its reduction: acc = dS K (dS buffer ``buf``)
    committed behind them; once they are done the Q/dO stage is released (``handle``: S^T, dP^T,
    dV and dK have read it); once dQ is done ``reduce_dq(acc)`` (traced inline)."""
    acc = issue_dq(mma, t_a, t_b, acc_shape, buf)
    warpgroup.wait_group(1)
    handle.release()  # Q and dO of this stage are read (S^T, dP^T, dV, dK done)
    warpgroup.wait_group(0)
    reduce_dq(acc)


@cute.jit
def dq_step_under_dk(
    mma: cute.TiledMma,
    t_a: cute.Tensor,
    t_b: cute.Tensor,
    dst: cute.Tensor,
    coords: cute.Tensor,
    acc_shape: cutlass.Constexpr,
    dkv_mma: cute.TiledMma,
    acc_dK: cute.Tensor,
    rdS: cute.Tensor,
    t_qt: cute.Tensor,
    buf: Int32,
    handle,
    row_block: Int32,
    seqlen_q: Int32,
):
    """:func:`dq_step` of the overlap schedule: acc = dS K (dS buffer ``buf``) committed behind the
    dV WGMMA, then dK += dS^T Q (``rdS`` the register A operand, ``t_qt`` Q^T of this stage) as its
    own group; once dQ is done (dK may still run) acc goes into the fp32 accumulator's 64-row block
    ``row_block``, and the Q/dO stage is released after dK."""
    _dq_then_dk(
        mma, t_a, t_b, acc_shape, dkv_mma, acc_dK, rdS, t_qt, buf, handle,
        lambda acc: red_add_pairs(acc, coords, dst[None, None, None, row_block], seqlen_q - row_block * WG_ROWS, WG_ROWS),
    )


@cute.jit
def issue_dq(
    mma: cute.TiledMma, t_a: cute.Tensor, t_b: cute.Tensor, acc_shape: cutlass.Constexpr, buf: Int32
):
    """acc = dS K (dS buffer ``buf``: A ``t_a``, B ``t_b``) issued and committed as one WGMMA group
    behind the ones in flight; returns acc (valid once that group is done)."""
    # Zero-filled and accumulated into: the caller keeps ``mma``'s ACCUMULATE field True (a field
    # set here, inside the caller's per-consumer branch, would escape the branch).
    acc = cute.make_rmem_tensor(acc_shape, Float32)
    acc.fill(0.0)
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(t_a, mode=[2])):
        cute.gemm(mma, acc, t_a[None, None, k, buf], t_b[None, None, k], acc)
    warpgroup.commit_group()
    return acc


@cute.jit
def _dq_then_dk(
    mma: cute.TiledMma,
    t_a: cute.Tensor,
    t_b: cute.Tensor,
    acc_shape: cutlass.Constexpr,
    dkv_mma: cute.TiledMma,
    acc_dK: cute.Tensor,
    rdS: cute.Tensor,
    t_qt: cute.Tensor,
    buf: Int32,
    handle,
    reduce_dq: cutlass.Constexpr,
):
    """The overlap schedule's dQ step, whatever its reduction: acc = dS K committed behind the dV
    WGMMA, then dK += dS^T Q as its own group; ``reduce_dq(acc)`` (traced inline) once dQ is done
    while dK may still run; the Q/dO stage released after dK."""
    acc = issue_dq(mma, t_a, t_b, acc_shape, buf)
    for k in cutlass.range_constexpr(cute.size(rdS, mode=[2])):
        cute.gemm(dkv_mma, acc_dK, rdS[None, None, k], t_qt[None, None, k], acc_dK)
    warpgroup.commit_group()
    warpgroup.wait_group(1)  # dV and dQ done; dK may still run
    reduce_dq(acc)
    warpgroup.wait_group(0)
    handle.release()  # Q and dO of this stage are read (S^T, dP^T, dV, dK done)


def dq_bulk_operands(mma, wtid, sdS: cute.Tensor, sKt: cute.Tensor, row_block: int, col0: int, cols: int):
    """WGMMA operands of one dQ piece (as :func:`dq_operands`, without a global destination):
    (A fragments by dS buffer, B fragment, accumulator shape) for :func:`dq_bulk_step`."""
    tile_n = cute.size(sdS, mode=[1])
    thr = mma.get_slice(wtid)
    t_a = hoisted(thr.make_fragment_A(thr.partition_A(cute.local_tile(sdS, (WG_ROWS, tile_n, 2), (row_block, 0, 0)))))
    t_b = hoisted(thr.make_fragment_B(thr.partition_B(cute.local_tile(sKt, (cols, tile_n), (col0 // cols, 0)))))
    return t_a, t_b, thr.partition_shape_C((WG_ROWS, cols))


@cute.jit
def dq_bulk_step(
    mma: cute.TiledMma,
    t_a: cute.Tensor,
    t_b: cute.Tensor,
    acc_shape: cutlass.Constexpr,
    buf: Int32,
    handle,
    s_base: Int32,
    g_addr,
    wtid: Int32,
    barrier_id: cutlass.Constexpr,
):
    """:func:`dq_step` of the dq_bulk path: acc = dS K (dS buffer ``buf``) behind the dV/dK WGMMAs,
    the Q/dO stage released once those are done, then acc staged and bulk-added (:func:`stage_and_reduce`)."""
    _dq_behind_dkv(
        mma, t_a, t_b, acc_shape, buf, handle,
        lambda acc: stage_and_reduce(acc, s_base, g_addr, wtid, barrier_id),
    )  # fmt: skip


@cute.jit
def dq_bulk_step_under_dk(
    mma: cute.TiledMma,
    t_a: cute.Tensor,
    t_b: cute.Tensor,
    acc_shape: cutlass.Constexpr,
    dkv_mma: cute.TiledMma,
    acc_dK: cute.Tensor,
    rdS: cute.Tensor,
    t_qt: cute.Tensor,
    buf: Int32,
    handle,
    s_base: Int32,
    g_addr,
    wtid: Int32,
    barrier_id: cutlass.Constexpr,
):
    """:func:`dq_step_under_dk` of the dq_bulk path: dQ, then dK as its own group; acc staged and
    bulk-added while dK runs; the Q/dO stage released after dK."""
    _dq_then_dk(
        mma, t_a, t_b, acc_shape, dkv_mma, acc_dK, rdS, t_qt, buf, handle,
        lambda acc: stage_and_reduce(acc, s_base, g_addr, wtid, barrier_id),
    )


@cute.jit
def dq_warp_step(
    mma: cute.TiledMma,
    t_a: cute.Tensor,
    t_b: cute.Tensor,
    acc_shape: cutlass.Constexpr,
    buf: Int32,
    handle,
    s_base: Int32,
    wtid: Int32,
    empty_id: cutlass.Constexpr,
    full_id: cutlass.Constexpr,
):
    """:func:`dq_bulk_step` with the dQ-writer warp: acc = dS K (dS buffer ``buf``) behind the dV/dK
    WGMMAs, the Q/dO stage released once those are done, then acc staged for the writer
    (:func:`stage_for_writer`)."""
    _dq_behind_dkv(
        mma, t_a, t_b, acc_shape, buf, handle,
        lambda acc: stage_for_writer(acc, s_base, wtid, empty_id, full_id),
    )  # fmt: skip


@cute.jit
def dq_warp_step_under_dk(
    mma: cute.TiledMma,
    t_a: cute.Tensor,
    t_b: cute.Tensor,
    acc_shape: cutlass.Constexpr,
    dkv_mma: cute.TiledMma,
    acc_dK: cute.Tensor,
    rdS: cute.Tensor,
    t_qt: cute.Tensor,
    buf: Int32,
    handle,
    s_base: Int32,
    wtid: Int32,
    empty_id: cutlass.Constexpr,
    full_id: cutlass.Constexpr,
):
    """:func:`dq_bulk_step_under_dk` with the dQ-writer warp: dQ, then dK as its own group; acc
    staged for the writer while dK runs; the Q/dO stage released after dK."""
    _dq_then_dk(
        mma, t_a, t_b, acc_shape, dkv_mma, acc_dK, rdS, t_qt, buf, handle,
        lambda acc: stage_for_writer(acc, s_base, wtid, empty_id, full_id),
    )


# --- Transposed dQ (tile_m = 80, FlashAttention-4's non-causal hd128 tile; space.sm90_bwd_dq_swapped) ---
# tile_m is not a multiple of WGMMA's 64-row M, so each consumer computes dQ^T = K^T dS^T for 64
# head-dim columns of all tile_m queries (M = 64 columns, N = tile_m, K = the CTA's keys). A = K^T
# is sKt (the bytes of K, MN-major), B = dS^T is sdS (queries contiguous: MN-major for N = queries);
# :func:`dq_tiled_mma` (tile_m) is the MMA. The piece is staged and bulk-added as the others
# (:func:`stage_and_reduce`), in its own (transposed) fragment order.


def dq_transposed_operands(mma, wtid, sKt: cute.Tensor, sdS: cute.Tensor, col0: int, cols: int):
    """WGMMA operands of one transposed dQ piece (head-dim columns [col0, col0 + cols) x all of
    sdS's tile_m queries): (A fragment of K^T, B fragments by dS buffer, accumulator shape), for
    :func:`dq_transposed_bulk_step`."""
    tile_n = cute.size(sKt, mode=[1])
    tile_m = cute.size(sdS, mode=[0])
    thr = mma.get_slice(wtid)
    t_a = hoisted(thr.make_fragment_A(thr.partition_A(cute.local_tile(sKt, (cols, tile_n), (col0 // cols, 0)))))
    t_b = hoisted(thr.make_fragment_B(thr.partition_B(sdS)))
    return t_a, t_b, thr.partition_shape_C((cols, tile_m))


@cute.jit
def dq_transposed_bulk_step(
    mma: cute.TiledMma,
    t_a: cute.Tensor,
    t_b: cute.Tensor,
    acc_shape: cutlass.Constexpr,
    buf: Int32,
    handle,
    s_base: Int32,
    g_addr,
    wtid: Int32,
    barrier_id: cutlass.Constexpr,
):
    """:func:`dq_bulk_step` with the transposed piece: acc = K^T dS^T (dS buffer ``buf``) behind
    the dV/dK WGMMAs, the Q/dO stage released once those are done, then acc staged and bulk-added."""
    acc = cute.make_rmem_tensor(acc_shape, Float32)
    acc.fill(0.0)  # accumulated into: the caller keeps ``mma``'s ACCUMULATE field True
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(t_a, mode=[2])):
        cute.gemm(mma, acc, t_a[None, None, k], t_b[None, None, k, buf], acc)
    warpgroup.commit_group()
    warpgroup.wait_group(1)
    handle.release()  # Q and dO of this stage are read (S^T, dP^T, dV, dK done)
    warpgroup.wait_group(0)
    stage_and_reduce(acc, s_base, g_addr, wtid, barrier_id)
