"""Variable-length batches in the sm100-family forward (FlashAttention-4 design).

Sequences are packed: q and out are (total_q, heads_q, head_dim), k and v (total_k, heads_kv,
head_dim), lse (heads_q, total_q). Sequence b's rows start at ``cu_seqlens[b]`` and it uses
``seqused[b]`` of them. The TMA descriptors cover the whole packed tensors; a CTA shifts its TMA
coordinates by its sequence's first row (:func:`shift_rows`), so a tile's boxes start there. Rows a
box takes past the sequence's end are the next sequence's (or zeros past the tensor's end): query
rows there are computed but never stored, keys there are masked like the key-length residue and
weighted by P = 0. The output cannot go out by a TMA store (its box would overwrite the next
sequence's rows), so the correction warps store each row they own to global memory, rows past the
sequence's length not at all.

Compiled and SASS-checked for sm_100a; not run on hardware.
"""

import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import dsl_user_op

from cutefa.kernels.common.ptx import effect_asm


def packed_seq_major_view(t: cute.Tensor) -> cute.Tensor:
    """(total, heads, dim) -> (total, dim, heads): the (M|N, K, L) form of TMA/UMMA."""
    lay = t.layout
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            (lay.shape[0], lay.shape[2], lay.shape[1]),
            stride=(lay.stride[0], lay.stride[2], lay.stride[1]),
        ),
    )


def packed_dim_major_view(t: cute.Tensor) -> cute.Tensor:
    """(total, heads, dim) -> (dim, total, heads): V as the MN-major B operand of O += P V."""
    lay = t.layout
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            (lay.shape[2], lay.shape[0], lay.shape[1]),
            stride=(lay.stride[2], lay.stride[0], lay.stride[1]),
        ),
    )


def shift_rows(coords: cute.Tensor, first_row, mode: int) -> cute.Tensor:
    """A TMA coordinate tensor of a packed operand whose sequence mode ``mode`` starts at
    ``first_row``: tile i of it begins at packed row first_row + i * tile."""
    offset = tuple(first_row if m == mode else 0 for m in range(cute.rank(coords)))
    return cute.domain_offset(offset, coords)


@cute.jit
def sequence(
    cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor, seqused_q: cute.Tensor, seqused_k: cute.Tensor
):
    """(first packed query row, first packed key row, query length, key length) of this CTA's
    sequence (the grid's z index)."""
    _, _, batch = cute.arch.block_idx()
    return cu_seqlens_q[batch], cu_seqlens_k[batch], seqused_q[batch], seqused_k[batch]


@dsl_user_op
def exit_thread(*, loc=None, ip=None) -> None:
    """PTX ``exit``: this thread stops here. Used by every thread of a CTA with no work, before
    any barrier is initialised or waited on, so that nothing waits for an arrival it would make."""
    effect_asm(None, [], "exit;", "~{memory}", loc=loc, ip=ip)


@cute.jit
def exit_if_past(tile_row0: Int32, seqused_q: cute.Tensor):
    """Every thread leaves when the CTA's first query row ``tile_row0`` is at or past its sequence's
    length: a CTA of the grid's padding (the grid covers the longest sequence) does no work."""
    _, _, batch = cute.arch.block_idx()
    if tile_row0 >= seqused_q[batch]:
        exit_thread()


@cute.jit
def store_row(values: cute.Tensor, out: cute.Tensor, row: Int32, seqlen_q: Int32):
    """This thread's piece of one output row (``values``, registers, already converted) to
    ``out`` (the same piece of global memory), unless the row is past the sequence's length."""
    if row < seqlen_q:
        cute.autovec_copy(values, out)


def out_rows(o: cute.Tensor, first_row, head) -> cute.Tensor:
    """(rows, dim) view of one head of the packed output, row 0 at packed row ``first_row``."""
    return cute.domain_offset((first_row, 0), o[None, head, None])


def lse_rows(lse: cute.Tensor, first_row, head) -> cute.Tensor:
    """(rows,) view of one head of the packed (heads, total_q) lse, row 0 at ``first_row``."""
    return cute.domain_offset((first_row,), lse[head, None])
