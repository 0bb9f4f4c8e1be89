"""Variable-length batches on the sm90 family: TMA over packed (total, heads, head_dim) tensors.

A packed tensor holds the sequences of a batch one after the other: sequence ``b`` owns rows
``[offset_b, offset_b + length_b)`` (``offset_b = cu_seqlens[b]``, ``length_b = seqused[b]``). A
TMA box of one sequence's tile must neither read nor write the next sequence's rows, yet one
descriptor serves every sequence. The *ragged* view does it with the TMA unit's own bounds check:

    view (rows R, head_dim, heads, X): strides (row, 1, head, row), base pointer moved back R rows

where R is the packed tensor's row count (at least any sequence's length) and X = R + 1. Element
(r, d, h, x) lies at row ``r + x - R`` of the packed tensor. A sequence's tiles address it with
``x = offset + length`` and row coordinates shifted by ``R - length``: local row ``i`` is view row
``R - length + i``, packed row ``offset + i``, and the TMA unit treats view rows ``>= R`` (local
rows ``>= length``) as out of bounds: zero-filled when loaded, skipped when stored. So the tiles of
a sequence behave as the tiles of a dense tensor of that sequence's length (the residue of the
last tile is zero-filled, an O store is clipped at the sequence's end), and the shifted base
address is never accessed itself: every box the kernel issues lies inside the packed rows of one
sequence after the clip.

The shift is the packed tensor's own size (R rows), so the descriptor's base address is that many
bytes below the tensor (64-bit address arithmetic; the TMA unit adds the coordinates back).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

# The view's modes: rows first and head_dim contiguous (Q, K, O: (rows, d, heads, x)), or head_dim
# first (V as the N-major B operand of O += P V: (d, rows, heads, x)).
ROWS_FIRST = 0
DIM_FIRST = 1


def _ragged(t: cute.Tensor, dim_first: bool) -> cute.Tensor:
    rows, heads, dim = t.shape
    row_stride, head_stride, dim_stride = t.stride
    if dim_first:
        shape = (dim, rows, heads, rows + 1)
        stride = (dim_stride, row_stride, head_stride, row_stride)
    else:
        shape = (rows, dim, heads, rows + 1)
        stride = (row_stride, dim_stride, head_stride, row_stride)
    base = cute.domain_offset((-rows, 0, 0), t).iterator  # R rows before the tensor
    return cute.make_tensor(base, cute.make_layout(shape, stride=stride))


def packed_as_sdhx(t: cute.Tensor) -> cute.Tensor:
    """The ragged view (rows, head_dim, heads, rows + 1) of a packed (rows, heads, head_dim)
    tensor: the K-major operand layout of Q and K and the O store's (module docs)."""
    return _ragged(t, dim_first=False)


def packed_as_dshx(t: cute.Tensor) -> cute.Tensor:
    """The ragged view (head_dim, rows, heads, rows + 1) of a packed V: the N-major B operand of
    O += P V (module docs)."""
    return _ragged(t, dim_first=True)


def sequence(g_tma: cute.Tensor, head: Int32, offset: Int32, length: Int32, rows_mode: int) -> cute.Tensor:
    """The 2-mode TMA coordinate tensor of one sequence's rows of ``head`` in a ragged view's TMA
    tensor ``g_tma`` (from :func:`packed_as_sdhx` / :func:`packed_as_dshx`): row ``i`` of it is row
    ``offset + i`` of the packed tensor, and rows from ``length`` on are out of the TMA bounds.
    ``rows_mode``: :data:`ROWS_FIRST` or :data:`DIM_FIRST`, the view's layout."""
    rows = g_tma.shape[rows_mode]
    seq = g_tma[None, None, head, offset + length]
    shift = (rows - length, 0) if rows_mode == ROWS_FIRST else (0, rows - length)
    return cute.domain_offset(shift, seq)


def grid_m_block(bx: Int32, seqlen_q: Int32, tile_m: cutlass.Constexpr) -> Int32:
    """Query tile of grid column ``bx`` in a sequence of ``seqlen_q`` rows: its last tile first (the
    most key blocks when causal), so the first columns of the grid carry each sequence's longest
    tiles; negative for the columns past the sequence's tiles (the CTA has nothing to do)."""
    return cute.ceil_div(seqlen_q, tile_m) - 1 - bx


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
