"""Variable-length batches on the sm90 family: TMA over packed (total, heads, head_dim) tensors.

A packed tensor holds the sequences of a batch one after the other: sequence ``b`` owns rows
``[offset_b, offset_b + length_b)`` (``offset_b = cu_seqlens[b]``, ``length_b = seqused[b]``). A
TMA box of one sequence's tile must neither read nor write the next sequence's rows, yet one
descriptor serves every sequence. The *ragged* view does it with the TMA unit's own bounds check:

    view (S, head_dim, heads, R + 1, S + 1): strides (row, 1, head, row, W - row)

with R the packed tensor's row count, S = :data:`RAGGED_ROWS` (more rows than any sequence has)
and W = :data:`WRAP_STRIDE`. Its base address is the packed tensor's own. Element (r, d, h, x, w)
lies ``(r + x) row + w (W - row)`` elements past it; the kernel always gives ``w = S``, and
``S (W - row) = 2^64 - S row`` (``S W = 2^64``), so modulo 2^64, the width of the TMA unit's address
arithmetic, that is row ``r + x - S`` of the packed tensor. A sequence's tiles address it with
``x = offset + length`` and row coordinates shifted by ``S - length`` (:func:`ragged_coords`):
local row ``i`` is view row ``S - length + i``, packed row ``offset + i``, and the TMA unit treats
view rows ``>= S`` (local rows ``>= length``) as out of bounds: zero-filled when loaded, skipped
when stored. So the tiles of a sequence behave as the tiles of a dense tensor of that sequence's
length (the residue of the last tile is zero-filled, an O store is clipped at the sequence's end).
The kernel only addresses local rows ``>= 0`` (query tiles and key blocks of the sequence), so
every element a box takes lies in the packed rows of one sequence.

Why the wrap-around mode rather than a base address moved back by S rows (the same element
addresses with one mode fewer): with a descriptor base below the allocation, TMA loads on an H100
raised "illegal address" at the load instruction whenever the memory below the tensor was not
mapped, although every element the boxes read was in the tensor (whether it is mapped depends on
what the allocator put there). With the packed tensor's own base the descriptor is valid wherever
the tensor is.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import dsl_user_op

from cutefa.kernels.common.ptx import effect_asm

# The view's modes: rows first and head_dim contiguous (Q, K, O: (rows, d, heads, x, w)), or
# head_dim first (V as the N-major B operand of O += P V: (d, rows, heads, x, w)).
ROWS_FIRST = 0
DIM_FIRST = 1
# S: the ragged view's row extent (local rows from a sequence's length on are past it); any
# sequence is shorter. A power of two that makes WRAP_STRIDE a whole number: S * WRAP_STRIDE = 2^64.
RAGGED_ROWS = 1 << 30
WRAP_STRIDE = 1 << 34  # elements; (WRAP_STRIDE - row stride) is the wrap-around mode's stride


def ragged_coords(offset, length):
    """(row shift, x, w) of a sequence of ``length`` rows from packed row ``offset`` in a ragged view:
    its local row ``i`` is view row ``row shift + i`` at mode coordinates ``x`` and ``w`` (module
    docs). Plain integer arithmetic (Python ints or the kernel's Int32 values)."""
    return RAGGED_ROWS - length, offset + length, RAGGED_ROWS


def ragged_layout(rows, heads, dim, row_stride, head_stride, dim_stride, dim_first: bool):
    """(shape, stride) of the ragged view of a packed (rows, heads, dim) tensor with those strides
    (elements), its base address the tensor's own (module docs): modes (S, dim, heads, rows + 1,
    S + 1), or (dim, S, heads, rows + 1, S + 1) with ``dim_first``. Works on Python ints and on the
    DSL's values alike."""
    wrap = cute.assume(WRAP_STRIDE - row_stride, divby=8)  # 16-byte TMA strides, like the row's
    if dim_first:
        shape = (dim, RAGGED_ROWS, heads, rows + 1, RAGGED_ROWS + 1)
        stride = (dim_stride, row_stride, head_stride, row_stride, wrap)
    else:
        shape = (RAGGED_ROWS, dim, heads, rows + 1, RAGGED_ROWS + 1)
        stride = (row_stride, dim_stride, head_stride, row_stride, wrap)
    return shape, stride


def _ragged(t: cute.Tensor, dim_first: bool) -> cute.Tensor:
    shape, stride = ragged_layout(*t.shape, *t.stride, dim_first)
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def packed_as_sdhx(t: cute.Tensor) -> cute.Tensor:
    """The ragged view (S, head_dim, heads, rows + 1, S + 1) of a packed (rows, heads, head_dim)
    tensor: the K-major operand layout of Q and K and the O store's (module docs)."""
    return _ragged(t, dim_first=False)


def packed_as_dshx(t: cute.Tensor) -> cute.Tensor:
    """The ragged view (head_dim, S, heads, rows + 1, S + 1) of a packed V: the N-major B operand
    of O += P V (module docs)."""
    return _ragged(t, dim_first=True)


def sequence(g_tma: cute.Tensor, head: Int32, offset: Int32, length: Int32, rows_mode: int) -> cute.Tensor:
    """The 2-mode TMA coordinate tensor of one sequence's rows of ``head`` in a ragged view's TMA
    tensor ``g_tma`` (from :func:`packed_as_sdhx` / :func:`packed_as_dshx`): row ``i`` of it is row
    ``offset + i`` of the packed tensor, and rows from ``length`` on are out of the TMA bounds.
    ``rows_mode``: :data:`ROWS_FIRST` or :data:`DIM_FIRST`, the view's layout."""
    shift, x, w = ragged_coords(offset, length)
    seq = g_tma[None, None, head, x, w]
    return cute.domain_offset((shift, 0) if rows_mode == ROWS_FIRST else (0, shift), seq)


def grid_m_block(bx: Int32, seqlen_q: Int32, tile_m: cutlass.Constexpr) -> Int32:
    """Query tile of grid column ``bx`` in a sequence of ``seqlen_q`` rows: its last tile first (the
    most key blocks when causal), so the first columns of the grid carry each sequence's longest
    tiles; negative for the columns past the sequence's tiles (the CTA has nothing to do)."""
    return cute.ceil_div(seqlen_q, tile_m) - 1 - bx


@dsl_user_op
def exit_past(row0: Int32, length: Int32, *, loc=None, ip=None) -> None:
    """Ends the calling thread (PTX ``exit``) where ``row0 >= length``: a CTA whose query tile starts
    past its sequence's rows leaves before it sets up shared memory, barriers or registers. Every
    thread of the CTA must call it with the same values, before any barrier (none is left waiting)."""
    effect_asm(
        None,
        [Int32(row0).ir_value(loc=loc, ip=ip), Int32(length).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred past;\nsetp.ge.s32 past, $0, $1;\n@past exit;\n}",
        "r,r,~{memory}",
        loc=loc,
        ip=ip,
    )


# ---------------------------------------------------------------------------------------------
# The tiles of a packed batch as one list (the persistent and longest-first schedulers)
#
# Tile ``i`` of the list lies in the first sequence whose running tile count passes ``i``; the
# sequences come in batch order, each from its last query tile to its first (the most key blocks
# first when causal). A warp finds it with one pass over the lengths, 32 sequences per step: no
# table is built on the host, and the host never reads the lengths (CUDA-graph safe).


def tiles_bound(total_q: Int32, batch: Int32, num_m: Int32, tile_m: cutlass.Constexpr) -> Int32:
    """At most how many query tiles a packed batch of ``batch`` sequences has, from what the host
    knows without reading the lengths: the sequences' rows fit in the ``total_q`` packed rows (each
    rounding up by at most ``tile_m - 1``) and none has more than ``num_m`` tiles (max_seqlen_q)."""
    return cutlass.min((total_q + batch * (tile_m - 1)) // tile_m, batch * num_m)


@cute.jit
def _sequence_tiles(seqused_q: cute.Tensor, b: Int32, batch: Int32, tile_m: cutlass.Constexpr) -> Int32:
    """Query tiles of sequence ``b``; 0 past the batch."""
    n = Int32(0)
    if b < batch:
        n = cute.ceil_div(seqused_q[b], tile_m)
    return n


@cute.jit
def _warp_inclusive_sum(x: Int32) -> Int32:
    lane = cute.arch.lane_idx()
    for step in cutlass.range_constexpr(5):
        y = cute.arch.shuffle_sync_up(x, offset=1 << step)
        x = x + cutlass.select_(lane >= (1 << step), y, Int32(0))
    return x


@cute.jit
def count_tiles(seqused_q: cute.Tensor, batch: Int32, tile_m: cutlass.Constexpr) -> Int32:
    """The query tiles of the whole batch (every lane gets the sum). A full warp calls it."""
    lane = cute.arch.lane_idx()
    total = Int32(0)
    for chunk in cutlass.range(cute.ceil_div(batch, 32), unroll=1):
        n = _sequence_tiles(seqused_q, chunk * 32 + lane, batch, tile_m)
        total = total + cute.arch.shuffle_sync(_warp_inclusive_sum(n), 31)
    return total


@cute.jit
def locate_tile(i: Int32, seqused_q: cute.Tensor, batch: Int32, tile_m: cutlass.Constexpr):
    """(m_block, sequence) of tile ``i`` of the batch's tile list (section docs); m_block is -1
    where ``i`` is past the last tile. A full warp calls it (the same answer in every lane)."""
    lane = cute.arch.lane_idx()
    before = Int32(0)  # tiles of the sequences of the earlier chunks
    m_block = Int32(-1)
    seq = Int32(0)
    for chunk in cutlass.range(cute.ceil_div(batch, 32), unroll=1):
        n = _sequence_tiles(seqused_q, chunk * 32 + lane, batch, tile_m)
        ends = _warp_inclusive_sum(n)  # one past the last tile of each lane's sequence, in the chunk
        local = i - before
        # The lanes whose sequences end at or before tile i: the first other lane holds it.
        passed = cute.arch.popc(cute.arch.vote_ballot_sync(ends <= local))
        holder = cutlass.min(passed, 31)
        first = cute.arch.shuffle_sync(ends - n, holder)  # its first tile, in the chunk
        tiles = cute.arch.shuffle_sync(n, holder)
        if m_block < 0 and local >= 0 and passed < 32:
            seq = chunk * 32 + passed
            m_block = tiles - 1 - (local - first)  # its last tile first
        before = before + cute.arch.shuffle_sync(ends, 31)
    return m_block, seq
