"""Variable-length (packed) batches in the sm80-family backward: views that let the row kernels
walk the packed rows as one batch, and the tiled dQ postprocess of one sequence's query block.

Packed layouts: q, dq (total_q, heads_q, head_dim); lse and the per-row workspaces (heads_q,
total_q); the natural dQ accumulator (splits, total_q, heads_q, head_dim); the tiled one (splits,
heads_q, chunks, tile_m * head_dim), sequence b's query block m at chunk
cu_seqlens_q[b] // tile_m + b + m (each sequence starts a fresh chunk: the spans of chunks never
overlap, and total_q // tile_m + batch chunks hold them all).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cutefa.kernels.sm80 import dq_tile, head_pad, parts


def first_chunk(offset_q, batch, tile_m: int):
    """The tiled dQ accumulator's chunk of query block 0 of sequence ``batch`` (rows from
    ``offset_q`` = cu_seqlens_q[batch]); its block m is chunk ``first_chunk(...) + m``. The main
    kernel adds into and the postprocess reads from these chunks, and with seqused <= the spans of
    cu_seqlens_q no two sequences' blocks share one: sequence b's ceil(seqused[b] / tile_m) chunks
    end at or before cu_seqlens_q[b + 1] // tile_m + b + 1, where sequence b + 1's begin. Plain
    arithmetic: Int32 while tracing a kernel, int in a host-side check."""
    return offset_q // tile_m + batch


def unit_mode(t: cute.Tensor, pos: int) -> cute.Tensor:
    """``t`` with a mode of size 1 (stride 0) inserted before its mode ``pos``: a packed tensor seen
    as a batch of one, (total, heads, d) -> (1, total, heads, d), so that the dense layout's row
    kernels index it with batch 0."""
    shape, stride = t.layout.shape, t.layout.stride
    layout = cute.make_layout((*shape[:pos], 1, *shape[pos:]), stride=(*stride[:pos], 0, *stride[pos:]))
    return cute.make_tensor(t.iterator, layout)


@cute.jit
def postprocess_tile(
    mdQaccum: cute.Tensor, chunk: Int32, head: Int32, gdQ: cute.Tensor, row_limit: Int32, scale: Float32,
    sdQ: cute.Tensor, mma_dq: cute.TiledMma, r2g: cute.TiledCopy, tidx: Int32, tile_m: cutlass.Constexpr,
    head_dim: cutlass.Constexpr, threads: cutlass.Constexpr, dtype: cutlass.Constexpr,
    col_limit: cutlass.Constexpr = None,
):  # fmt: skip
    """One query block of the tiled dQ accumulator to dQ: the fragment of ``chunk`` of ``head``
    (``mdQaccum`` a (splits, 1, heads_q, chunks, tile_m * head_dim) view, :func:`unit_mode`) summed
    over the splits in order, scaled, converted to ``dtype`` and written through shared memory
    (``sdQ``, tile_m x head_dim) to the rows of ``gdQ`` (the block's tile of dQ) below ``row_limit``,
    16 bytes per thread and copy. With ``col_limit`` (a padded head dim: ``head_dim`` is the tile's,
    ``gdQ`` a padded view, :mod:`cutefa.kernels.sm80.head_pad`) only the columns below it."""
    thr_dq = mma_dq.get_slice(tidx)
    acc = cute.make_rmem_tensor(thr_dq.partition_shape_C((tile_m, head_dim)), Float32)
    dq_tile.load_fragment(acc, mdQaccum, 0, head, chunk, tidx, threads)
    rdQ = cute.make_fragment_like(acc, dtype)
    rdQ.store((acc.load() * scale).to(dtype))
    r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype), mma_dq)
    r2s_thr = r2s.get_slice(tidx)
    cute.copy(r2s, r2s_thr.retile(rdQ), r2s_thr.partition_D(sdQ))
    cute.arch.barrier()
    r2g_thr = r2g.get_slice(tidx)
    tsdQ = r2g_thr.partition_S(sdQ)
    trdQ = cute.make_fragment_like(tsdQ, dtype)
    cute.copy(r2g, tsdQ, trdQ)
    tdQc = r2g_thr.partition_D(cute.make_identity_tensor((tile_m, head_dim)))
    if cutlass.const_expr(col_limit is None):
        parts.copy_rows(r2g, trdQ, r2g_thr.partition_D(gdQ), tdQc, row_limit, False)
    else:
        head_pad.copy_tile(r2g, trdQ, r2g_thr.partition_D(gdQ), tdQc, row_limit, col_limit, False)
