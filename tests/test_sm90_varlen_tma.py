"""The sm90 forward's TMA boxes over packed (variable-length) batches, checked on the CPU.

The kernel (templates/fwd_sm90.py.j2) reads Q, K and V and stores O through the ragged views of
cutefa/kernels/sm90/varlen.py. Here every box a tile issues is replayed on plain integers, with
the views' own layout (``varlen.ragged_layout``), coordinates (``varlen.ragged_coords``), query
tiles (``varlen.grid_m_block``) and key blocks (``mask.local_key_blocks``), through a model of the
TMA unit: an element is read or written when each of its coordinates is inside its mode's extent,
at the base address plus the sum of coordinates times strides, modulo 2^64. Asserted, over random
batches (sequences of 0 and 1 rows, spans with unused rows, no rows after the last span) and
windows (unbounded, narrow, empty for whole tiles):

- every element a box touches lies in its own sequence's rows of the packed tensor (so in the
  tensor), and the box takes every row of the sequence it covers (none is dropped);
- the descriptor's base address is the packed tensor's own (an H100 faults on a TMA load whose
  descriptor base is not mapped, whatever the box reads);
- no key block is loaded that holds no key of any of the tile's rows' bands below seqlen_k (an
  empty band loads nothing), and every key of those bands is in a loaded block;
- the tile lists of the persistent and longest-first schedulers fit the grids the host sizes
  (``varlen.tiles_bound``).
"""

from __future__ import annotations

import random

import pytest

from cutefa.api.features import UNBOUNDED
from cutefa.kernels.common.mask import local_key_blocks
from cutefa.kernels.sm90 import varlen

WG_ROWS = 64  # rows of one consumer warpgroup's Q slab and O box (parts.WG_ROWS)
ADDRESS_BITS = 64


def _view(total, heads, dim, dim_first):
    """(shape, stride) in elements of the ragged view of a contiguous packed (total, heads, dim)."""
    return varlen.ragged_layout(total, heads, dim, heads * dim, dim, 1, dim_first)


def _touched_rows(
    total, heads, dim, offset, length, first_local_row, box_rows, head, dim_first, elem_bytes=2
):
    """The packed rows of ``head`` that the TMA unit touches for a box of ``box_rows`` rows (all of
    head_dim) at local row ``first_local_row`` of the sequence (``offset``, ``length``): the
    model of the module docs, element addresses reduced modulo 2^64 and converted back to rows."""
    shape, stride = _view(total, heads, dim, dim_first)
    rows_mode, dim_mode = (1, 0) if dim_first else (0, 1)
    shift, x, w = varlen.ragged_coords(offset, length)
    row_stride = heads * dim
    touched = []
    for r in range(shift + first_local_row, shift + first_local_row + box_rows):
        coords = [0] * 5
        coords[rows_mode], coords[2], coords[3], coords[4] = r, head, x, w
        coords[dim_mode] = dim - 1  # the box's last column: the whole row is in or out together
        if not all(0 <= c < e for c, e in zip(coords, shape, strict=True)):
            continue  # out of bounds: zero-filled on a load, skipped on a store
        address = (sum(c * s for c, s in zip(coords, stride, strict=True)) * elem_bytes) % (1 << ADDRESS_BITS)
        element = address // elem_bytes
        assert element % row_stride == head * dim + dim - 1, (address, head)
        touched.append(element // row_stride)
    return touched


def _check_box(total, heads, dim, offset, length, first_local_row, box_rows, head, dim_first, what):
    touched = _touched_rows(total, heads, dim, offset, length, first_local_row, box_rows, head, dim_first)
    expected = [offset + i for i in range(max(first_local_row, 0), min(first_local_row + box_rows, length))]
    assert touched == expected, (
        f"{what}: rows {touched[:4]}... of sequence {offset}+{length}, box at {first_local_row}"
    )
    assert all(0 <= row < total for row in touched), what


def test_view_base_is_the_tensor_and_the_wrap_cancels():
    """The view's element at the origin of every mode but the wrap-around one is the tensor's first
    (the descriptor's base address is the tensor's own), and the wrap-around mode at the
    coordinate the kernel gives moves the address back by exactly RAGGED_ROWS rows."""
    for dim_first in (False, True):
        shape, stride = _view(1000, 3, 128, dim_first)
        assert shape[4] > varlen.RAGGED_ROWS and stride[4] > 0 and (stride[4] * 2) % 16 == 0
        modulus = 1 << ADDRESS_BITS
        assert (varlen.RAGGED_ROWS * stride[4]) % modulus == (-varlen.RAGGED_ROWS * 3 * 128) % modulus
        assert all(s < (1 << 40) // 2 for s in stride)  # TMA byte strides stay below 2^40
        assert all(e <= 1 << 32 for e in shape)  # TMA extents
    # the first sequence's first row is the tensor's first row, whichever row stride
    for heads, dim in ((1, 64), (6, 128), (32, 256)):
        assert _touched_rows(5, heads, dim, 0, 5, 0, 1, 0, False) == [0]
        assert _touched_rows(5, heads, dim, 0, 5, 0, 1, heads - 1, True) == [0]


@pytest.mark.parametrize("dim_first", [False, True])
def test_boxes_stay_in_their_sequence(dim_first):
    rng = random.Random(7 + dim_first)
    for _ in range(60):
        lengths = [
            rng.choice([0, 1, 2, 63, 64, 65, 127, 128, 129, rng.randint(0, 700)])
            for _ in range(rng.randint(1, 6))
        ]
        slack = [rng.choice([0, 0, 1, 5]) for _ in lengths]
        offsets = [
            sum(n + s for n, s in zip(lengths[:b], slack[:b], strict=True)) for b in range(len(lengths))
        ]
        total = offsets[-1] + lengths[-1] + slack[-1]  # nothing after the last span but its slack
        heads, dim = rng.choice([(1, 64), (2, 128), (3, 256)])
        box = rng.choice([64, 80, 128, 176])
        for offset, length in zip(offsets, lengths, strict=True):
            for first in range(0, length + box, box):  # every box a tile list can issue, one past
                head = rng.randrange(heads)
                _check_box(total, heads, dim, offset, length, first, box, head, dim_first, "box")


def _band_keys(i, sq, sk, left, right):
    lo, hi = i + sk - sq - left, i + sk - sq + right
    return range(max(lo, 0), min(hi + 1, sk))


SCHEDULES = [(128, 128), (128, 64), (128, 80), (128, 176), (192, 128), (128, 96)]  # (tile_m, tile_n)
WINDOWS = [
    (UNBOUNDED, UNBOUNDED),
    (UNBOUNDED, 0),
    (0, 0),
    (100, 50),
    (300, 0),
    (17, UNBOUNDED),
    (5, 0),
    (4096, 4096),
]


@pytest.mark.parametrize(("tile_m", "tile_n"), SCHEDULES)
def test_tiles_load_only_their_band(tile_m, tile_n):
    """Every tile the grid scheduler runs (grid column bx, varlen.grid_m_block; the columns past a
    sequence's tiles do nothing) and every tile of the batch's list (the persistent and longest-first
    schedulers: each sequence's tiles [0, ceil(seqlen_q / tile_m))): its Q boxes, its key blocks
    [n_first, n_blocks) (K and V boxes) and its O boxes stay in its sequence, and the key blocks
    are exactly those holding a key of its rows' bands."""
    rng = random.Random(tile_m * 1000 + tile_n)
    consumers = tile_m // WG_ROWS
    for _ in range(12):
        count = rng.randint(1, 5)
        pairs = [
            (rng.choice([0, 1, 5, 17, 129, 300, 1000]), rng.choice([0, 1, 5, 17, 129, 300, 1000]))
            for _ in range(count)
        ]
        slack = [rng.choice([0, 3]) for _ in pairs]
        offs_q = [sum(p[0] + s for p, s in zip(pairs[:b], slack[:b], strict=True)) for b in range(count)]
        offs_k = [sum(p[1] + s for p, s in zip(pairs[:b], slack[:b], strict=True)) for b in range(count)]
        total_q, total_k = offs_q[-1] + pairs[-1][0] + slack[-1], offs_k[-1] + pairs[-1][1] + slack[-1]
        num_m = -(-max(sq for sq, _ in pairs) // tile_m)
        left, right = rng.choice(WINDOWS)
        for b, (sq, sk) in enumerate(pairs):
            tiles = -(-sq // tile_m)
            grid_tiles = [varlen.grid_m_block(bx, sq, tile_m) for bx in range(max(num_m, 1) + 1)]
            assert sorted(m for m in grid_tiles if m >= 0) == list(range(tiles))  # each tile once
            for m_block in range(tiles):
                row0 = m_block * tile_m
                last = min(row0 + tile_m, sq) - 1
                n_first, n_blocks, _, _ = local_key_blocks(row0, last, tile_n, sq, sk, left, right)
                where = f"sequence {b} {(sq, sk)} tile {m_block} window {(left, right)}"
                for c in range(consumers):  # Q loads and O stores of the slabs
                    first = (m_block * consumers + c) * WG_ROWS
                    _check_box(total_q, 2, 64, offs_q[b], sq, first, WG_ROWS, 1, False, f"Q/O {where}")
                keys = {j for i in range(row0, last + 1) for j in _band_keys(i, sq, sk, left, right)}
                loaded = range(n_first, n_blocks)  # the producer's walk: n_blocks - 1 down to n_first
                assert {j // tile_n for j in keys} == set(loaded), where
                for n in loaded:
                    assert 0 <= n and n * tile_n < sk, where
                    _check_box(total_k, 2, 64, offs_k[b], sk, n * tile_n, tile_n, 0, False, f"K {where}")
                    _check_box(total_k, 2, 64, offs_k[b], sk, n * tile_n, tile_n, 0, True, f"V {where}")
        assert varlen.tiles_bound(total_q, count, num_m, tile_m) >= sum(-(-sq // tile_m) for sq, _ in pairs)


def test_a_window_empty_for_a_whole_tile_loads_nothing():
    """Rows with no key in their band (more queries than keys under a narrow window) make tiles
    whose key range is empty: no K or V box is issued for them."""
    sq, sk, tile_m, tile_n = 300, 20, 128, 128
    for left, right in ((0, 0), (5, 0), (UNBOUNDED, 0)):
        for m_block in range(2):  # rows 0..255: i + sk - sq + right < 0 for every one of them
            row0 = m_block * tile_m
            n_first, n_blocks, _, _ = local_key_blocks(row0, row0 + tile_m - 1, tile_n, sq, sk, left, right)
            assert n_blocks == n_first, (left, right, m_block)
        n_first, n_blocks, _, _ = local_key_blocks(256, 299, tile_n, sq, sk, left, right)
        assert (n_first, n_blocks) == (0, 1)
