"""K/V rows through a page table for the sm80 decode kernel (templates/decode_sm80.py.j2).

A paged cache is (num_pages, page_size, heads_kv, head_dim); ``page_table[b, i]`` is the page that
holds keys ``[i * page_size, (i + 1) * page_size)`` of sequence ``b``. Key ``j`` of a sequence is row
``j % page_size`` of page ``page_table[b, j // page_size]``. Page sizes are powers of two (the API
checks), so the split is a shift and a mask; a key block of ``tile_n`` rows may lie inside one page
or span several: each row's address is computed on its own, so any page size works with any tile
(or, with pages of at least ``PAGE_CHUNK_KEYS`` keys, once per aligned chunk of that many keys).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cutefa.kernels.sm80.decode_rows import copy_row
from cutefa.model.policy_decode import PAGE_CHUNK_KEYS


def page_shift(page_size: Int32) -> Int32:
    """log2 of a power-of-two ``page_size``."""
    return Int32(31) - Int32(cute.arch.clz(page_size))


@cute.jit
def load_page_rows(
    g2s: cute.TiledCopy,
    mX: cute.Tensor,
    page_row: cute.Tensor,
    dst: cute.Tensor,
    coords: cute.Tensor,
    key0: Int32,
    seqlen_k: Int32,
    shift: Int32,
    row_step: cutlass.Constexpr = 0,
):
    """cp.async the keys ``key0 + i`` (the tile's rows) of one kv head's paged cache ``mX``
    ((num_pages, page_size, head_dim)) into this thread's (CPY, ROWS, COLS) partition ``dst``
    (``coords``: its tile coordinates), through ``page_row`` (the sequence's page table row). Rows
    at or past ``seqlen_k`` are zero-filled and their page entries never read.

    ``row_step`` 0: each row's page read and address built on its own (any page size). Otherwise
    the thread's rows are ``row_step`` apart (``coords[0, m, 0][0] = coords[0, 0, 0][0] + m *
    row_step``, the first below ``row_step``), ``row_step`` divides ``PAGE_CHUNK_KEYS``
    (:mod:`cutefa.model.policy_decode`), ``key0`` is a multiple of it and the pages hold at least
    that many keys: the rows of an aligned chunk of ``PAGE_CHUNK_KEYS`` keys share one page-table
    read and lie at constant offsets from the chunk's first in its page (one 64-bit address a chunk,
    not a row)."""
    offset_mask = (Int32(1) << shift) - 1
    rows = cute.size(dst, mode=[1])
    if cutlass.const_expr(row_step == 0):
        # the page of each of the thread's rows first, so that the table reads go out together
        pages = cute.make_rmem_tensor((rows,), Int32)
        for m in cutlass.range_constexpr(rows):
            j = key0 + coords[0, m, 0][0]
            pages[m] = 0
            if j < seqlen_k:
                pages[m] = page_row[j >> shift]
        for m in cutlass.range_constexpr(rows):
            j = key0 + coords[0, m, 0][0]
            if j < seqlen_k:
                copy_row(g2s, mX[pages[m], j & offset_mask, None], dst, coords, m)
            else:
                dst[None, m, None].fill(0)
    else:
        _load_page_chunks(g2s, mX, page_row, dst, coords, key0, seqlen_k, offset_mask, shift, row_step)


@cute.jit
def _load_page_chunks(
    g2s: cute.TiledCopy, mX: cute.Tensor, page_row: cute.Tensor, dst: cute.Tensor, coords: cute.Tensor,
    key0: Int32, seqlen_k: Int32, offset_mask: Int32, shift: Int32, row_step: cutlass.Constexpr,
):  # fmt: skip
    """:func:`load_page_rows` with a page-table read per chunk of ``PAGE_CHUNK_KEYS`` keys."""
    per_chunk = PAGE_CHUNK_KEYS // row_step
    chunks = cute.size(dst, mode=[1]) // per_chunk
    pages = cute.make_rmem_tensor((chunks,), Int32)
    for c in cutlass.range_constexpr(chunks):
        j = key0 + coords[0, c * per_chunk, 0][0]
        pages[c] = 0
        if j < seqlen_k:
            pages[c] = page_row[j >> shift]
    for c in cutlass.range_constexpr(chunks):
        first = key0 + coords[0, c * per_chunk, 0][0]
        # the page's rows from this chunk's first row of this thread on
        chunk = cute.domain_offset((first & offset_mask, 0), mX[pages[c], None, None])
        for i in cutlass.range_constexpr(per_chunk):
            m = c * per_chunk + i
            if first + i * row_step < seqlen_k:
                copy_row(g2s, chunk[i * row_step, None], dst, coords, m)
            else:
                dst[None, m, None].fill(0)

