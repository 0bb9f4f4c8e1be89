"""Building blocks of the sm90-family (FlashAttention-3 design) backward kernels.

The main kernel (templates/bwd_sm90.py.j2) owns TILE_N keys of one (batch, query head); each of
its two consumer warpgroups owns 64 of those keys and computes, per query block of TILE_M rows,

    S^T  = K Q^T, dP^T = V dO^T          WGMMA, both operands K-major in shared memory
    P^T  = exp2(S^T * scale_log2 - LSE2), dS^T = P^T (dP^T - D)      in registers, per key row
    dV  += P^T dO, dK += dS^T Q         WGMMA, A (P^T, dS^T) from registers, B MN-major in smem
    dQ   = dS K                         WGMMA, dS (written by both warpgroups) and K from smem; each
                                        warpgroup one piece (:func:`dq_operands`, :func:`dq_step`)

The shared-memory buffers are allocated once and read through two layouts where two WGMMAs use
them in different roles (Q and dO: K-major B of S^T/dP^T and MN-major B of dK/dV; K: K-major A of
S^T and MN-major B of dQ). Both layouts come from the same swizzle atom (128-byte; 64-byte for
head_dim 96) tiled over the major mode first, so they address the same bytes (:func:`smem_layouts`;
tests/test_compile_sm90_bwd.py checks every element).

The row pre/postprocessing kernels (LSE in log2 units, D = rowsum(dO * O) - dLSE, the dQ fp32
accumulator) are the sm80 family's (cutefa/kernels/sm80/bwd_parts.py).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from cutefa.kernels.common.reduce import bulk_reduce_add_f32, red_add_pairs, st_shared_f32x4
from cutefa.kernels.common.softmax import LOG2_E
from cutefa.kernels.sm80.bwd_parts import (  # noqa: F401 (causal_launch_coords, pin_words: the templates')
    causal_launch_coords,
    pin_words,
    warp_allreduce_sum,
)
from cutefa.kernels.sm90.descriptors import hoisted
from cutefa.kernels.sm90.parts import WG_ROWS, WG_THREADS, tma_tiles


def smem_layouts(dtype, tile_m: int, tile_n: int, head_dim: int, stages: int):
    """Swizzled layouts of the backward's shared-memory operands.

    Returns (sK, sKt, sQ, sQt, sdS):
      sK   (tile_n, head_dim, 1)       K and V: K-major A of S^T = K Q^T and dP^T = V dO^T
      sKt  (head_dim, tile_n, 1)       the same bytes as K: MN-major B of dQ = dS K
      sQ   (tile_m, head_dim, stages)  Q and dO: K-major B of S^T and dP^T
      sQt  (head_dim, tile_m, stages)  the same bytes: MN-major B of dK = dS^T Q and dV = P^T dO
      sdS  (tile_m, tile_n, 2)         dS, queries contiguous: MN-major A of dQ (two buffers)
    """
    row, col = utils.LayoutEnum.ROW_MAJOR, utils.LayoutEnum.COL_MAJOR
    sk = sm90_utils.make_smem_layout_a(row, (tile_n, WG_ROWS, head_dim), dtype, 1)
    skt = sm90_utils.make_smem_layout_b(col, (WG_ROWS, head_dim, tile_n), dtype, 1)
    sq = sm90_utils.make_smem_layout_b(row, (WG_ROWS, tile_m, head_dim), dtype, stages)
    sqt = sm90_utils.make_smem_layout_b(col, (WG_ROWS, head_dim, tile_m), dtype, stages)
    sds = sm90_utils.make_smem_layout_a(col, (tile_m, WG_ROWS, tile_n), dtype, 2)
    return sk, skt, sq, sqt, sds


def sdp_tiled_mma(dtype, tile_m: int):
    """S^T = K Q^T and dP^T = V dO^T for one warpgroup: 64 keys x tile_m queries, K-major operands."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
        Float32, (1, 1, 1), (WG_ROWS, tile_m),
    )  # fmt: skip


def dkv_tiled_mma(dtype, head_dim: int):
    """dV += P^T dO and dK += dS^T Q for one warpgroup: 64 keys x head_dim, A from registers,
    B (dO^T, Q^T) MN-major in shared memory."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
        Float32, (1, 1, 1), (WG_ROWS, head_dim), warpgroup.OperandSource.RMEM,
    )  # fmt: skip


def dq_tiled_mma(dtype, dq_n: int):
    """dQ = dS K for one warpgroup: 64 queries x dq_n head-dim columns, both operands MN-major."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.MN,
        Float32, (1, 1, 1), (WG_ROWS, dq_n),
    )  # fmt: skip


def same_bytes(s: cute.Tensor, layout) -> cute.Tensor:
    """``s``'s shared memory read through another swizzled (composed) layout."""
    return cute.make_tensor(cute.recast_ptr(s.iterator, layout.inner), layout.outer)


def element_swizzled(layout, dtype):
    """``layout`` (a composed layout from ``smem_layouts``, whose swizzle acts on byte addresses: it
    goes into the pointer) with its swizzle restated on element offsets, for a tensor over an
    aligned pointer to the same bytes (the swizzle's base bits drop by log2 of the element size)."""
    sw = layout.inner
    base = sw.num_base - (dtype.width // 8).bit_length() + 1
    return cute.make_composed_layout(cute.make_swizzle(sw.num_bits, base, sw.num_shift), 0, layout.outer)


def transposed(s: cute.Tensor, rows: int, cols: int) -> cute.Tensor:
    """A (cols, rows) view of a (rows, cols) shared-memory tensor."""
    return cute.composition(s, cute.make_layout((cols, rows), stride=(rows, 1)))


@cute.jit
def load_row_value(
    lse2_row: cute.Tensor,
    dpsum_row: cute.Tensor,
    row0: Int32,
    seqlen_q: Int32,
    thread: Int32,
    tile_m: cutlass.Constexpr,
) -> Float32:
    """The value consumer thread ``thread`` (of 256) stages for the query block at ``row0``:
    threads [0, tile_m) the log2 LSE of row row0 + thread (+inf past seqlen_q, so that P is 0
    there), threads [128, 128 + tile_m) D of row row0 + thread - 128 (0 past seqlen_q)."""
    val = Float32(0.0)
    if thread < tile_m:
        val = Float32.inf
        if row0 + thread < seqlen_q:
            val = lse2_row[row0 + thread]
    elif thread >= 128 and thread < 128 + tile_m and row0 + thread - 128 < seqlen_q:
        val = dpsum_row[row0 + thread - 128]
    return val


@cute.jit
def store_row_value(
    sLSE: cute.Tensor, sD: cute.Tensor, val: Float32, thread: Int32, tile_m: cutlass.Constexpr
):
    """Shared-memory half of :func:`load_row_value`: ``val`` into sLSE or sD (one buffer each)."""
    if thread < tile_m:
        sLSE[thread] = val
    elif thread >= 128 and thread < 128 + tile_m:
        sD[thread - 128] = val


@cute.jit
def row_slot(
    lse2_row: cute.Tensor, dpsum_row: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor, thread: Int32,
    tile_m: cutlass.Constexpr,
):  # fmt: skip
    """Set-up of :func:`load_row_slot` / :func:`store_row_slot`, once per kernel (the same rows as
    :func:`load_row_value` / :func:`store_row_value` without their per-block thread tests and
    tensor indexing): consumer thread ``thread`` (of 256) stages row ``thread`` of the log2 LSE
    (threads [0, tile_m)) or row ``thread - 128`` of D (threads [128, 128 + tile_m)).

    Returns (global address of the thread's row array, its shared-memory address in buffer 0
    (``sLSE`` / ``sD`` as (tile_m, 2) with the buffers tile_m words apart), the row offset, the value
    of rows past seqlen_q, whether the thread stages a row at all)."""
    g_addr = lse2_row.iterator.toint()
    s_addr = sLSE.iterator.toint()
    offset = thread
    fill = Float32.inf
    if thread >= 128:
        g_addr = dpsum_row.iterator.toint()
        s_addr = sD.iterator.toint()
        offset = thread - 128
        fill = Float32(0.0)
    return g_addr, s_addr + offset * 4, offset, fill, offset < tile_m


@cute.jit
def load_row_slot(g_addr, offset: Int32, fill: Float32, active, row0: Int32, seqlen_q: Int32) -> Float32:
    """:func:`load_row_value` from :func:`row_slot`'s set-up: the thread's value for the query block
    at ``row0`` (``fill`` past seqlen_q, and for threads that stage nothing)."""
    val = fill
    row = row0 + offset
    if active and row < seqlen_q:
        src = cute.make_ptr(Float32, g_addr + cutlass.Int64(row) * 4, cute.AddressSpace.gmem, assumed_align=4)
        val = cute.make_tensor(src, cute.make_layout(1))[0]
    return val


@cute.jit
def store_row_slot(s_addr: Int32, active, val: Float32, buf, tile_m: cutlass.Constexpr):
    """:func:`store_row_value` from :func:`row_slot`'s set-up: ``val`` into buffer ``buf``."""
    if active:
        dst = cute.make_ptr(Float32, s_addr + buf * (tile_m * 4), cute.AddressSpace.smem, assumed_align=4)
        cute.make_tensor(dst, cute.make_layout(1))[0] = val


# A causal row bound that no tile-local query offset exceeds (the key is past key_limit).
MASK_NONE = 1 << 30


@cute.jit
def load_columns(s_rows: cute.Tensor, c_mn: cute.Tensor, dst: cute.Tensor):
    """dst[j] = s_rows[query of column j] for each of this thread's query columns (``c_mn``: the
    tile-local (key, query) of each accumulator element): a query block's LSE2 or D values, read
    from shared memory into registers ahead of the WGMMA wait they would otherwise follow."""
    for j in cutlass.range_constexpr(cute.size(c_mn, mode=[1])):
        dst[j] = s_rows[c_mn[0, j][1]]


@cute.jit
def recompute_pt(
    st_mn: cute.Tensor,
    c_mn: cute.Tensor,
    sLSE: cute.Tensor,
    scale_log2: Float32,
    key_limit: Int32,
    diag: Int32,
    masked: cutlass.Constexpr,
    causal: cutlass.Constexpr,
    by_column: cutlass.Constexpr = False,
):
    """S^T -> P^T in place (rows are keys, columns queries): P = exp2(S * scale_log2 - LSE2[query]).

    ``c_mn`` holds each element's tile-local (key, query). With ``masked``: keys at or past
    ``key_limit`` (tile-local) get P = 0, and with ``causal`` also keys past query + ``diag``
    (tile-local key index minus tile-local query index allowed by the bottom-right diagonal).

    The mask is set up once per row (key): whether the key is below ``key_limit``, and (causal)
    the bound that a query must exceed, relative to the thread's first query q0: key - diag - q0
    for keys below ``key_limit``, else one no query offset reaches. Each element then costs one
    compare against its constant column offset and one select (key < min(key_limit, query + diag)
    <=> key < key_limit and key - diag - q0 < query - q0: the same elements as an element-wise
    limit). ``by_column``: ``sLSE`` holds the values per column (:func:`load_columns`), not per
    tile-local query."""
    rows = cute.size(st_mn, mode=[0])
    q0 = c_mn[0, 0][1]
    row_ok = []
    row_bound = []
    if cutlass.const_expr(masked):
        for r in cutlass.range_constexpr(rows):
            key = c_mn[r, 0][0]
            if cutlass.const_expr(causal):
                row_bound.append(cutlass.select_(key < key_limit, key - diag - q0, Int32(MASK_NONE)))
            else:
                row_ok.append(key < key_limit)
    for j in cutlass.range_constexpr(cute.size(st_mn, mode=[1])):
        query = c_mn[0, j][1]
        lse2 = sLSE[j] if cutlass.const_expr(by_column) else sLSE[query]
        for r in cutlass.range_constexpr(rows):
            p = cute.math.exp2(st_mn[r, j] * scale_log2 - lse2, fastmath=True)
            if cutlass.const_expr(masked):
                if cutlass.const_expr(causal):
                    p = cutlass.select_(row_bound[r] < query - q0, p, Float32(0.0))
                else:
                    p = cutlass.select_(row_ok[r], p, Float32(0.0))
            st_mn[r, j] = p


@cute.jit
def compute_dst(
    pt_mn: cute.Tensor, dpt_mn: cute.Tensor, c_mn: cute.Tensor, sD: cute.Tensor, by_column: cutlass.Constexpr = False
):
    """dP^T -> dS^T in place: dS = P (dP - D[query]) (the softmax scale is applied later).
    ``by_column``: ``sD`` holds the values per column (:func:`load_columns`)."""
    for j in cutlass.range_constexpr(cute.size(dpt_mn, mode=[1])):
        d = sD[j] if cutlass.const_expr(by_column) else sD[c_mn[0, j][1]]
        for r in cutlass.range_constexpr(cute.size(dpt_mn, mode=[0])):
            dpt_mn[r, j] = pt_mn[r, j] * (dpt_mn[r, j] - d)


@cute.jit
def store_kv_tiles(
    dk_tma, gdK_tma: cute.Tensor, sK: cute.Tensor, dv_tma, gdV_tma: cute.Tensor, sV: cute.Tensor,
    head: Int32, batch: Int32, n_block: Int32, tile_n: cutlass.Constexpr, head_dim: cutlass.Constexpr,
):
    """The producer warp: key block ``n_block``'s dK and dV tiles (staged in the K and V buffers)
    to global memory by two TMA stores (rows past seqlen_k clipped by the TMA unit), waiting until
    both have read shared memory, so that the buffers may be loaded again."""
    tdKs, tdKg = tma_tiles(dk_tma, sK, cute.local_tile(gdK_tma[None, None, head, batch], (tile_n, head_dim), (None, 0)))
    tdVs, tdVg = tma_tiles(dv_tma, sV, cute.local_tile(gdV_tma[None, None, head, batch], (tile_n, head_dim), (None, 0)))
    cute.copy(dk_tma, tdKs[None, 0], tdKg[None, n_block])
    cute.copy(dv_tma, tdVs[None, 0], tdVg[None, n_block])
    cute.arch.cp_async_bulk_commit_group()
    cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def store_rows(src: cute.Tensor, coords: cute.Tensor, gdst: cute.Tensor, row_limit: Int32):
    """gdst[i] = src[i] for every element whose tile-local row (``coords``) is below ``row_limit``."""
    for i in cutlass.range_constexpr(cute.size(src)):
        if coords[i][0] < row_limit:
            gdst[i] = src[i]


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


def dq_bulk_operands(mma, wtid, sdS: cute.Tensor, sKt: cute.Tensor, row_block: int, col0: int, cols: int):
    """WGMMA operands of one dQ piece (as :func:`dq_operands`, without a global destination):
    (A fragments by dS buffer, B fragment, accumulator shape) for :func:`dq_bulk_step`."""
    tile_n = cute.size(sdS, mode=[1])
    thr = mma.get_slice(wtid)
    t_a = hoisted(thr.make_fragment_A(thr.partition_A(cute.local_tile(sdS, (WG_ROWS, tile_n, 2), (row_block, 0, 0)))))
    t_b = hoisted(thr.make_fragment_B(thr.partition_B(cute.local_tile(sKt, (cols, tile_n), (col0 // cols, 0)))))
    return t_a, t_b, thr.partition_shape_C((WG_ROWS, cols))


def bulk_dq_coords(mma, thread, cols: int) -> cute.Tensor:
    """Tile-local (row, col) of each accumulator value of ``thread`` in a 64 x ``cols`` dQ piece:
    value i of the thread sits at word 4 (128 (i // 4) + thread) + i % 4 of the piece's chunk."""
    return mma.get_slice(thread).partition_C(cute.make_identity_tensor((WG_ROWS, cols)))


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


@cute.jit
def _bulk_postprocess(
    coords: cute.Tensor, transposed: cutlass.Constexpr, mdQaccum: cute.Tensor, sdQ: cute.Tensor,
    scale: Float32, batch: Int32, head: Int32, m_block: Int32, thread: Int32, row0: cutlass.Constexpr,
    col0: cutlass.Constexpr, offset: cutlass.Constexpr, dtype: cutlass.Constexpr,
):  # fmt: skip
    """The body of :func:`bulk_postprocess_piece` and :func:`bulk_postprocess_transposed_piece`:
    thread ``thread``'s values of the piece at word ``offset`` of query block ``m_block``'s chunk,
    read 16 bytes at a time, the splits summed in order, scaled, converted and each written to
    ``sdQ[row0 + row, col0 + col]``, where ``coords`` holds the tile-local (row, col) of each value
    in fragment order, or with ``transposed`` its (col, row)."""
    vecs = cute.size(coords) // BULK_VEC  # BULK_VEC values per 16-byte load
    acc = cute.make_rmem_tensor((BULK_VEC, vecs), Float32)
    part = cute.make_rmem_tensor((BULK_VEC,), Float32)
    splits = cute.size(mdQaccum, mode=[0])
    for s in cutlass.range(splits, unroll=1):
        # The chunk as 16-byte vectors: vector (offset / BULK_VEC + j * 256 + thread) is word
        # offset + (j * 256 + thread) * BULK_VEC; all of a split's loads go out before any add.
        vectors = cute.logical_divide(mdQaccum[s, batch, head, m_block, None], cute.make_layout(BULK_VEC))
        for j in cutlass.range_constexpr(vecs):
            src = vectors[None, offset // BULK_VEC + j * WG_ROWS * 2 + thread]
            if s == 0:
                cute.autovec_copy(src, acc[None, j])
            else:
                cute.autovec_copy(src, part)
                for e in cutlass.range_constexpr(BULK_VEC):
                    acc[e, j] = acc[e, j] + part[e]
    for j in cutlass.range_constexpr(vecs):
        for e in cutlass.range_constexpr(BULK_VEC):
            row, col = coords[BULK_VEC * j + e]
            if cutlass.const_expr(transposed):
                row, col = col, row
            sdQ[row0 + row, col0 + col] = dtype(acc[e, j] * scale)


@cute.jit
def bulk_postprocess_piece(
    mma: cute.TiledMma, mdQaccum: cute.Tensor, sdQ: cute.Tensor, scale: Float32, batch: Int32, head: Int32,
    m_block: Int32, thread: Int32, row_block: cutlass.Constexpr, col0: cutlass.Constexpr,
    cols: cutlass.Constexpr, offset: cutlass.Constexpr, dtype: cutlass.Constexpr,
):  # fmt: skip
    """dQ of one consumer's piece of query block ``m_block`` from the dq_bulk workspace (splits,
    batch, heads, blocks, tile_m * head_dim) into ``sdQ`` (the block's tile_m x head_dim tile in
    shared memory, rows padded by :data:`POST_ROW_PAD`): thread ``thread`` (of 128) reads its
    fragment's values 16 bytes at a time (coalesced over the threads; every load of a split issued
    before its adds), sums the splits in order, scales and converts. All rows, padded ones too
    (:func:`store_dq_tile` guards the rows when it writes dQ)."""
    _bulk_postprocess(
        bulk_dq_coords(mma, thread, cols), False, mdQaccum, sdQ, scale, batch, head, m_block, thread,
        row_block * WG_ROWS, col0, offset, dtype,
    )  # fmt: skip


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


def bulk_dq_transposed_coords(mma, thread, cols: int, tile_m: int) -> cute.Tensor:
    """Tile-local (head-dim column, query row) of each accumulator value of ``thread`` in a
    transposed ``cols`` x ``tile_m`` dQ piece, in the fragment order :func:`stage_and_reduce` writes."""
    return mma.get_slice(thread).partition_C(cute.make_identity_tensor((cols, tile_m)))


@cute.jit
def bulk_postprocess_transposed_piece(
    mma: cute.TiledMma, mdQaccum: cute.Tensor, sdQ: cute.Tensor, scale: Float32, batch: Int32,
    head: Int32, m_block: Int32, thread: Int32, col0: cutlass.Constexpr, cols: cutlass.Constexpr,
    tile_m: cutlass.Constexpr, offset: cutlass.Constexpr, dtype: cutlass.Constexpr,
):  # fmt: skip
    """:func:`bulk_postprocess_piece` for a transposed piece (:func:`bulk_dq_transposed_coords`):
    the same coalesced 16-byte reads and split sums in order, each value to ``sdQ[query, col0 + column]``."""
    _bulk_postprocess(
        bulk_dq_transposed_coords(mma, thread, cols, tile_m), True, mdQaccum, sdQ, scale, batch, head,
        m_block, thread, 0, col0, offset, dtype,
    )  # fmt: skip


POST_ROW_PAD = 8  # 16-bit elements after each row of the postprocess's dQ tile: 16 bytes, so that
# the fragment-order stores of a warp (8 rows x 4 column pairs) fall in 32 different banks


def post_tile_layout(tile_m: int, head_dim: int):
    """Layout of the postprocess's tile_m x head_dim dQ tile in shared memory (rows padded)."""
    return cute.make_layout((tile_m, head_dim), stride=(head_dim + POST_ROW_PAD, 1))


@cute.jit
def store_dq_tile(
    sdQ: cute.Tensor, mdQ: cute.Tensor, batch: Int32, head: Int32, m_block: Int32, thread: Int32,
    tile_m: cutlass.Constexpr, head_dim: cutlass.Constexpr, threads: cutlass.Constexpr,
):  # fmt: skip
    """dQ rows of query block ``m_block`` below seqlen_q from the tile in shared memory to global
    memory, 16 bytes (8 elements) per copy: copy j * ``threads`` + ``thread`` is row (it / (d / 8)),
    column 8 (it % (d / 8)), so that consecutive threads write consecutive bytes of a row. The caller
    has met the CTA at a barrier after the tile was written."""
    per_row = head_dim // 8
    seqlen_q = mdQ.shape[1]
    s_vec = cute.zipped_divide(sdQ, (1, 8))
    g_vec = cute.zipped_divide(mdQ[batch, None, head, None], (1, 8))
    frag = cute.make_rmem_tensor((1, 8), sdQ.element_type)
    for j in cutlass.range_constexpr(tile_m * per_row // threads):
        it = j * threads + thread
        row = it // per_row
        col = it % per_row
        if m_block * tile_m + row < seqlen_q:
            cute.autovec_copy(s_vec[None, (row, col)], frag)
            cute.autovec_copy(frag, g_vec[None, (m_block * tile_m + row, col)])


@cute.jit
def preprocess_rows(
    mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor, mLSE2: cute.Tensor,
    mDpsum: cute.Tensor, batch: Int32, head: Int32, first: Int32, lane: Int32, rows: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
):  # fmt: skip
    """Query rows [first, first + ``rows``) of (``batch``, ``head``), one warp (``rows`` <= 32),
    those below seqlen_q written: D = rowsum(dO * O) - dLSE and LSE * log2(e) (+inf for a row that
    attends no key, so that its probabilities recompute to 0). Lane l reads 16-byte vectors l,
    l + 32, ... of each row (8 elements each; lanes past head_dim / 8 read none) and lane i < rows
    the LSE and dLSE of row first + i, all loads issued before any product (rows past seqlen_q read
    the last row and are not written); each lane sums its products in column order, then the warp
    (butterfly); lane i writes row first + i."""
    seqlen_q = mO.shape[1]
    vecs = head_dim // 8
    per_lane = (vecs + 31) // 32
    o_vec = cute.zipped_divide(mO[batch, None, head, None], (1, 8))
    do_vec = cute.zipped_divide(mdO[batch, None, head, None], (1, 8))
    o_frag = cute.make_rmem_tensor((8, per_lane, rows), mO.element_type)
    do_frag = cute.make_rmem_tensor((8, per_lane, rows), mdO.element_type)
    o_frag.fill(0.0)
    do_frag.fill(0.0)
    my_row = first + lane
    lse = Float32(0.0)
    dlse = Float32(0.0)
    if lane < rows:
        if my_row < seqlen_q:
            lse = mLSE[batch, head, my_row]
            dlse = mdLSE[batch, head, my_row]
    for i in cutlass.range_constexpr(rows):
        row = cutlass.min(first + i, seqlen_q - 1)
        for k in cutlass.range_constexpr(per_lane):
            if lane + 32 * k < vecs:
                cute.autovec_copy(o_vec[None, (row, lane + 32 * k)], o_frag[None, k, i])
                cute.autovec_copy(do_vec[None, (row, lane + 32 * k)], do_frag[None, k, i])
    dot = Float32(0.0)
    for i in cutlass.range_constexpr(rows):
        acc = Float32(0.0)
        for k in cutlass.range_constexpr(per_lane):
            for e in cutlass.range_constexpr(8):
                acc = acc + Float32(do_frag[e, k, i]) * Float32(o_frag[e, k, i])
        acc = warp_allreduce_sum(acc)
        if lane == i:
            dot = acc
    if lane < rows:
        if my_row < seqlen_q:
            mDpsum[batch, head, my_row] = dot - dlse
            mLSE2[batch, head, my_row] = Float32.inf if lse == -Float32.inf else lse * LOG2_E


@cute.jit
def zero_bulk_part(
    mdQaccum: cute.Tensor, batch: Int32, head: Int32, bx: Int32, thread: Int32, rows: cutlass.Constexpr,
    tile_m: cutlass.Constexpr, head_dim: cutlass.Constexpr, threads: cutlass.Constexpr,
):  # fmt: skip
    """Zero part ``bx`` of the dq_bulk workspace of (``batch``, ``head``), in every split, with
    16-byte stores: a query block's chunk (tile_m * head_dim words) is cut into tile_m / ``rows``
    parts of ``rows`` * head_dim words, and part bx is words [(bx % p) rows d, (bx % p + 1) rows d)
    of chunk bx / p (p = tile_m / rows). Parts 0, 1, ... of a grid of whole chunks zero every word
    once, the padding rows of the last chunk too (the main kernel adds whole chunks)."""
    per_chunk = tile_m // rows
    m_block = bx // per_chunk
    first = (bx % per_chunk) * (rows * head_dim // BULK_VEC)
    zero = cute.make_rmem_tensor((BULK_VEC,), Float32)
    zero.fill(0.0)
    for s in cutlass.range(cute.size(mdQaccum, mode=[0]), unroll=1):
        vectors = cute.logical_divide(mdQaccum[s, batch, head, m_block, None], cute.make_layout(BULK_VEC))
        for j in cutlass.range_constexpr(rows * head_dim // BULK_VEC // threads):
            cute.autovec_copy(zero, vectors[None, first + j * threads + thread])


# --- Head-dim split (templates/bwd_sm90_hsplit.py.j2, head dims 192 and 256) -----------------------
# The two consumer warpgroups share the CTA's 64 keys. Per query block of 64 rows, warpgroup c
# computes S^T and dP^T for its 32 queries (64 keys x 32), writes P^T and dS^T to shared memory, and
# after a barrier accumulates dV and dK for columns [c d/2, (c+1) d/2) over all 64 queries (A from
# shared memory) and forms the same columns of dQ = dS K.


def _tiled_smem(layout_enum, shape, dtype, atom_major: int, stages: int, k_major: bool):
    """``shape`` + (stages,) tiled by the swizzle atom the WGMMA helpers would pick for a major
    mode of ``atom_major`` elements (a warpgroup's half of the head dim), in the helpers' order."""
    atom = sm90_utils.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(layout_enum, dtype, atom_major), dtype)
    return cute.tile_to_shape(atom, (*shape, stages), order=(0, 1, 2) if k_major else (1, 0, 2))


def split_smem_layouts(dtype, tile_m: int, tile_n: int, head_dim: int, stages: int):
    """Swizzled layouts of the head-dim split's shared-memory operands.

    Returns (sK, sKt, sQ, sQt, sdS, sdSt):
      sK   (tile_n, head_dim, 1)       K and V: K-major A of S^T = K Q^T and dP^T = V dO^T
      sKt  (head_dim, tile_n, 1)       the same bytes as K: MN-major B of dQ = dS K
      sQ   (tile_m, head_dim, stages)  Q and dO: K-major B of S^T and dP^T
      sQt  (head_dim, tile_m, stages)  the same bytes: MN-major B of dK = dS^T Q and dV = P^T dO
      sdS  (tile_m, tile_n, 2)         dS, queries contiguous: MN-major A of dQ (two buffers)
      sdSt (tile_n, tile_m, 2)         the same bytes as dS: K-major A of dK (P^T's buffers too)

    The head-dim swizzle atom is chosen for d/2 columns (128-byte at 256, 64-byte at 192), so that
    each warpgroup's half of the head dim starts on an atom boundary of K^T, Q^T and dO^T."""
    half = head_dim // 2
    row, col = utils.LayoutEnum.ROW_MAJOR, utils.LayoutEnum.COL_MAJOR
    sk = _tiled_smem(row, (tile_n, head_dim), dtype, half, 1, True)
    skt = _tiled_smem(col, (head_dim, tile_n), dtype, half, 1, False)
    sq = _tiled_smem(row, (tile_m, head_dim), dtype, half, stages, True)
    sqt = _tiled_smem(col, (head_dim, tile_m), dtype, half, stages, False)
    sds = sm90_utils.make_smem_layout_a(col, (tile_m, WG_ROWS, tile_n), dtype, 2)
    sdst = sm90_utils.make_smem_layout_a(row, (tile_n, WG_ROWS, tile_m), dtype, 2)
    return sk, skt, sq, sqt, sds, sdst


def split_dkv_tiled_mma(dtype, half: int):
    """dV += P^T dO and dK += dS^T Q for one warpgroup of the head-dim split: 64 keys x d/2
    columns, A (P^T, dS^T) K-major and B (dO^T, Q^T) MN-major, both in shared memory."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
        Float32, (1, 1, 1), (WG_ROWS, half),
    )  # fmt: skip
