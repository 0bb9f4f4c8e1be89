"""CPU proof of the sm90 fp8 forward's register and shared-memory permutations (no GPU, no DSL).

The kernel converts the fp32 accumulator of S = Q K^T in place into the e4m3 register A operand of
O += P Vt, which puts the probability of key ``key_of_a_column(k)`` at operand column k, and its
producer warpgroup writes Vt with the same key permutation. Here both are modelled with the WGMMA
register layouts (thread, value) -> (row, col) that the DSL's atom reports (checked against the DSL
in tests/test_compile_sm90_fp8.py), the in-place conversion layout of ``fp8.p_views`` and the
transpose's own index function ``fp8.transpose_unit``, and the product is compared with P V.
"""

from __future__ import annotations

import numpy as np
import pytest

from cutefa.kernels.sm90 import fp8

ROWS = 64  # rows of one warpgroup MMA
THREADS = 128


def _layout(text: str):
    """A flat (thread, value) -> column-major index function of a rank-2 CuTe layout string."""
    shape_text, stride_text = text.split(":")

    def parse(part: str) -> list[list[int]]:
        modes = part.strip()[1:-1].split("),(")
        return [[int(x) for x in m.strip("()").split(",")] for m in modes]

    shapes, strides = parse(shape_text), parse(stride_text)

    def index(mode: int, i: int) -> int:
        total = 0
        for extent, stride in zip(shapes[mode], strides[mode]):
            total += (i % extent) * stride
            i //= extent
        return total

    return lambda t, v: index(0, t) + index(1, v)


TV_A = _layout(fp8.TV_LAYOUT_A_FP8)
TV_C = _layout(fp8.TV_LAYOUT_C_N128)


def _p_offset(j: int, r: int, b: int) -> int:
    """Where ``fp8.p_views`` stores accumulator value (j, r, b) in the A-operand fragment
    (strides ((1, 4, (2, 8, 16)))): column pair j, row half r, 8-key block b = 4 kb + 2 h + b1."""
    b1, h, kb = b % 2, (b // 2) % 2, b // 4
    strides = fp8.P_STRIDES
    return sum(x * s for x, s in zip((j, r, b1, h, kb), strides))


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def test_key_permutation_is_a_bijection_per_block():
    assert sorted(fp8.key_of_a_column(k) for k in range(32)) == list(range(32))


def test_layout_strings_parse_to_the_documented_fragments():
    # Thread 5 (lane 5: group 1, thread-in-group 1), value 0: row 1, col 2 of the accumulator and
    # row 1, col 4 of the A operand.
    assert divmod(TV_C(5, 0), ROWS)[::-1] == (1, 2)
    assert divmod(TV_A(5, 0), ROWS)[::-1] == (1, 4)


@pytest.mark.parametrize("tile_n", [64, 96, 128])
def test_in_place_conversion_puts_key_of_a_column_at_each_operand_column(tile_n):
    seen = set()
    for t in range(THREADS):
        for b in range(tile_n // 8):
            for r in range(2):
                for j in range(2):
                    v_c = j + 2 * r + 4 * b
                    m_c, n_c = TV_C(t, v_c) % ROWS, TV_C(t, v_c) // ROWS
                    off = _p_offset(j, r, b)
                    kb, v_a = divmod(off, 16)
                    idx = TV_A(t, v_a)
                    m_a, k_a = idx % ROWS, idx // ROWS + 32 * kb
                    assert m_a == m_c
                    assert n_c == 32 * kb + fp8.key_of_a_column(k_a % 32), (t, v_c)
                    seen.add((m_a, k_a))
    assert len(seen) == ROWS * tile_n  # every operand element written exactly once


def _transpose(v_tile: np.ndarray) -> np.ndarray:
    """The producer warpgroup's transpose, modelled word by word with fp8.transpose_unit."""
    tile_n, head_dim = v_tile.shape
    words = v_tile.view(np.uint32)  # (tile_n, head_dim / 4)
    out = np.zeros((head_dim, tile_n // 4), dtype=np.uint32)
    written = np.zeros(out.shape, dtype=int)
    for tid in range(THREADS):
        for i in range(fp8.transpose_steps(tile_n, head_dim)):
            key0, dq, kq = fp8.transpose_unit(tid, i, head_dim)
            w = [int(words[key0 + d, dq]) for d in (0, 1, 8, 9)]
            t0 = _prmt(w[0], w[1], fp8.PRMT_LO_PAIRS)
            t1 = _prmt(w[0], w[1], fp8.PRMT_HI_PAIRS)
            t2 = _prmt(w[2], w[3], fp8.PRMT_LO_PAIRS)
            t3 = _prmt(w[2], w[3], fp8.PRMT_HI_PAIRS)
            outs = (
                _prmt(t0, t2, fp8.PRMT_LO_HALVES),
                _prmt(t0, t2, fp8.PRMT_HI_HALVES),
                _prmt(t1, t3, fp8.PRMT_LO_HALVES),
                _prmt(t1, t3, fp8.PRMT_HI_HALVES),
            )
            for e, word in enumerate(outs):
                out[4 * dq + e, kq] = word
                written[4 * dq + e, kq] += 1
    assert (written == 1).all(), "every Vt word is written exactly once"
    return out.view(np.uint8)  # (head_dim, tile_n)


@pytest.mark.parametrize(("tile_n", "head_dim"), [(128, 64), (128, 96), (128, 128), (96, 192), (64, 256)])
def test_transpose_writes_permuted_vt(tile_n, head_dim):
    rng = np.random.default_rng(0)
    v_tile = rng.integers(0, 256, size=(tile_n, head_dim), dtype=np.uint8)
    vt = _transpose(v_tile)
    perm = np.array([32 * (k // 32) + fp8.key_of_a_column(k % 32) for k in range(tile_n)])
    np.testing.assert_array_equal(vt, v_tile[perm].T)


@pytest.mark.parametrize(("tile_n", "head_dim"), [(128, 128), (64, 256)])
def test_operand_product_equals_p_v(tile_n, head_dim):
    """A_operand @ Vt^T, with A built from P through the register mapping and Vt through the
    transpose, equals P @ V: the two permutations cancel."""
    rng = np.random.default_rng(1)
    p = rng.random((ROWS, tile_n))
    v_bytes = rng.integers(0, 256, size=(tile_n, head_dim), dtype=np.uint8)
    a_op = np.full((ROWS, tile_n), np.nan)
    for t in range(THREADS):
        for v_c in range(tile_n // 2):
            j, r, b = v_c % 2, (v_c // 2) % 2, v_c // 4
            m, n = TV_C(t, v_c) % ROWS, TV_C(t, v_c) // ROWS
            kb, v_a = divmod(_p_offset(j, r, b), 16)
            idx = TV_A(t, v_a)
            a_op[idx % ROWS, idx // ROWS + 32 * kb] = p[m, n]
    vt = _transpose(v_bytes).astype(np.float64)
    np.testing.assert_allclose(a_op @ vt.T, p @ v_bytes.astype(np.float64))
