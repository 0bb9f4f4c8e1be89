"""The preprocess and postprocess kernels of the sm90 backward (templates/bwd_sm90*.py.j2): per query
row D = rowsum(dO * O) - dLSE and the LSE in log2 units, the dq_bulk workspace zeroed; after the main
kernel, the workspace's pieces read back in their fragment order (bwd_dq_bulk.py), summed over the
splits, scaled, converted and written to dQ.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cutefa.kernels.common.softmax import LOG2_E
from cutefa.kernels.sm80.bwd_parts import warp_allreduce_sum
from cutefa.kernels.sm90.bwd_dq_bulk import BULK_VEC, bulk_dq_coords, bulk_dq_transposed_coords
from cutefa.kernels.sm90.parts import WG_ROWS


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
    part = rows * head_dim // BULK_VEC  # 16-byte vectors of a part
    for s in cutlass.range(cute.size(mdQaccum, mode=[0]), unroll=1):
        vectors = cute.logical_divide(mdQaccum[s, batch, head, m_block, None], cute.make_layout(BULK_VEC))
        for j in cutlass.range_constexpr(part // threads):
            cute.autovec_copy(zero, vectors[None, first + j * threads + thread])
        if cutlass.const_expr(part % threads):
            # a part that the threads do not cover evenly (head dims 80, 112: 320, 448 vectors)
            if thread < part % threads:
                cute.autovec_copy(zero, vectors[None, first + part // threads * threads + thread])


POST_ROW_PAD = 8  # 16-bit elements after each row of the postprocess's dQ tile: 16 bytes, so that
# the fragment-order stores of a warp (8 rows x 4 column pairs) fall in 32 different banks


def post_tile_layout(tile_m: int, head_dim: int):
    """Layout of the postprocess's tile_m x head_dim dQ tile in shared memory (rows padded)."""
    return cute.make_layout((tile_m, head_dim), stride=(head_dim + POST_ROW_PAD, 1))


@cute.jit
def bulk_postprocess_values(
    coords: cute.Tensor, transposed: cutlass.Constexpr, mdQaccum: cute.Tensor, sdQ: cute.Tensor,
    scale: Float32, batch: Int32, head: Int32, m_block: Int32, thread: Int32, row0: cutlass.Constexpr,
    col0: cutlass.Constexpr, offset: cutlass.Constexpr, dtype: cutlass.Constexpr,
):  # fmt: skip
    """The body of :func:`bulk_postprocess_piece` and :func:`bulk_postprocess_transposed_piece` (and
    of the grouped-query dK/dV conversion, bwd_dkv.py, into an fp32 tile):
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
    bulk_postprocess_values(
        bulk_dq_coords(mma, thread, cols), False, mdQaccum, sdQ, scale, batch, head, m_block, thread,
        row_block * WG_ROWS, col0, offset, dtype,
    )  # fmt: skip


@cute.jit
def bulk_postprocess_transposed_piece(
    mma: cute.TiledMma, mdQaccum: cute.Tensor, sdQ: cute.Tensor, scale: Float32, batch: Int32,
    head: Int32, m_block: Int32, thread: Int32, col0: cutlass.Constexpr, cols: cutlass.Constexpr,
    tile_m: cutlass.Constexpr, offset: cutlass.Constexpr, dtype: cutlass.Constexpr,
):  # fmt: skip
    """:func:`bulk_postprocess_piece` for a transposed piece (:func:`bulk_dq_transposed_coords`):
    the same coalesced 16-byte reads and split sums in order, each value to ``sdQ[query, col0 + column]``."""
    bulk_postprocess_values(
        bulk_dq_transposed_coords(mma, thread, cols, tile_m), True, mdQaccum, sdQ, scale, batch, head,
        m_block, thread, 0, col0, offset, dtype,
    )  # fmt: skip


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
