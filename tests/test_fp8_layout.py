"""CPU proof of the sm90 fp8 forward's register and shared-memory permutations (no GPU, no DSL).

The kernel converts the fp32 accumulator of S = Q K^T in place into the e4m3 register A operand of
O += P Vt, which puts the probability of key ``key_of_a_column(k)`` at operand column k, and its
producer warpgroup writes Vt with the same key permutation. Here both are modelled with the WGMMA
register layouts (thread, value) -> (row, col) that the DSL's atom reports (checked against the DSL
in tests/test_compile_sm90_fp8.py), the in-place conversion layout of ``fp8.convert_p`` and the
transpose's own index function ``fp8_transpose.transpose_unit``, and the product is compared with P V.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from cpu_support import all_variants

from cutefa.kernels.sm90 import fp8, fp8_transpose, fp8_transpose_plan, fp8_wide_transpose
from cutefa.model.options import Schedule, VTranspose

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
    """Where ``fp8.convert_p`` stores accumulator value (j, r, b) in the A-operand fragment
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


@pytest.mark.parametrize("tile_n", [64, 96, 128, 160])
def test_register_conversion_places_each_score_as_the_in_place_store(tile_n):
    """``fp8.convert_p`` builds each 32-bit A register from four scores (p_register_sources):
    score v_c = j + 2 r + 4 b of the accumulator must land at _p_offset(j, r, b), each once."""
    kblocks = tile_n // 32
    placed = {}
    for w, sources in enumerate(fp8.p_register_sources(kblocks)):
        for byte, v_c in enumerate(sources):
            assert v_c not in placed, v_c
            placed[v_c] = 4 * w + byte
    blocks = range(tile_n // 8)
    assert placed == {j + 2 * r + 4 * b: _p_offset(j, r, b) for b in blocks for r in range(2) for j in range(2)}
    assert sorted(placed.values()) == list(range(tile_n // 2))  # every byte of every register written


def _transpose(v_tile: np.ndarray) -> np.ndarray:
    """The producer warpgroup's transpose, modelled word by word with fp8_transpose.transpose_unit."""
    tile_n, head_dim = v_tile.shape
    words = v_tile.view(np.uint32)  # (tile_n, head_dim / 4)
    out = np.zeros((head_dim, tile_n // 4), dtype=np.uint32)
    written = np.zeros(out.shape, dtype=int)
    for tid in range(THREADS):
        for i in range(fp8_transpose.transpose_steps(tile_n, head_dim)):
            key0, dq, kq = fp8_transpose.transpose_unit(tid, i, head_dim)
            w = [int(words[key0 + d, dq]) for d in (0, 1, 8, 9)]
            t0 = _prmt(w[0], w[1], fp8_transpose.PRMT_LO_PAIRS)
            t1 = _prmt(w[0], w[1], fp8_transpose.PRMT_HI_PAIRS)
            t2 = _prmt(w[2], w[3], fp8_transpose.PRMT_LO_PAIRS)
            t3 = _prmt(w[2], w[3], fp8_transpose.PRMT_HI_PAIRS)
            outs = (
                _prmt(t0, t2, fp8_transpose.PRMT_LO_HALVES),
                _prmt(t0, t2, fp8_transpose.PRMT_HI_HALVES),
                _prmt(t1, t3, fp8_transpose.PRMT_LO_HALVES),
                _prmt(t1, t3, fp8_transpose.PRMT_HI_HALVES),
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


# --- The hoisted transpose addressing (fp8_transpose.TransposeV) against the plain swizzled indexing -------


@functools.cache
def _composed(text: str):
    """A byte-offset function (row, col, stage) of a staged swizzled layout string as the DSL prints
    it, e.g. ``S<3,4,3> o 0 o ((8,16),(128,1),(1,2)):((128,1024),(1,0),(0,16384))``: the outer
    layout's offset (each mode's coordinate split colexicographically over its sub-shape), then
    the swizzle."""
    swz, offset, outer = (part.strip() for part in text.split(" o "))
    assert offset == "0"
    bits, base, shift = (int(x) for x in swz[2:-1].split(","))
    shape_text, stride_text = outer.split(":")

    def parse(part: str) -> list[list[int]]:
        return [[int(x) for x in m.strip("()").split(",")] for m in part.strip()[1:-1].split("),(")]

    shapes, strides = parse(shape_text), parse(stride_text)

    def offset_of(*coord: int) -> int:
        total = 0
        for c, shape, stride in zip(coord, shapes, strides):
            assert 0 <= c < int(np.prod(shape)), (coord, shapes)
            for extent, st in zip(shape, stride):
                total += (c % extent) * st
                c //= extent
        return fp8_transpose_plan.swizzle_bytes(total, bits, base, shift)

    stages = int(np.prod(shapes[2]))
    stage_bytes = (
        max(
            offset_of(r, c, 0) for r in range(int(np.prod(shapes[0]))) for c in range(int(np.prod(shapes[1])))
        )
        + 1
    )
    return offset_of, stages, stage_bytes, (bits, base, shift)


TILES = sorted(fp8.SMEM_LAYOUTS_V_VT)


def _plans_of(plan_fn, word_bytes, tile_n, head_dim, stages):
    """``plan_fn`` (fp8_transpose.transpose_plan or fp8_wide_transpose.wide_transpose_plan) on a
    tile's layout strings, words of ``word_bytes`` bytes."""
    v_text, vt_text = fp8.SMEM_LAYOUTS_V_VT[(tile_n, head_dim, stages)]
    v_off, _, _, v_swz = _composed(v_text)
    vt_off, _, _, vt_swz = _composed(vt_text)
    return plan_fn(
        lambda c: v_off(c[0], word_bytes * c[1], 0),
        lambda c: vt_off(c[0], word_bytes * c[1], 0),
        tile_n,
        head_dim,
        1 << sum(v_swz),
        1 << sum(vt_swz),
    )


def _plan(tile_n, head_dim, stages):
    return _plans_of(fp8_transpose.transpose_plan, 4, tile_n, head_dim, stages)


def _masked_words(tid, i, tile_n, head_dim):
    return fp8_transpose.transpose_words(tid, i, head_dim, fp8_transpose.TRANSPOSE_LANE_MASKS[tile_n])


def test_every_committed_e4m3_tile_has_its_smem_layouts():
    e4m3 = [s for s in all_variants("sm90", "fwd") if s.dtype == "e4m3"]
    tiles = {(s.tile_n, s.head_dim, s.stages) for s in e4m3}
    assert tiles <= set(fp8.SMEM_LAYOUTS_V_VT)
    assert any(s.options.v_transpose is VTranspose.HOISTED for s in e4m3)


@pytest.mark.parametrize(("tile_n", "head_dim", "stages"), TILES)
def test_hoisted_addresses_equal_the_swizzled_indexing(tile_n, head_dim, stages):
    """Every load and store of the hoisted transpose, for every thread, step and stage of the ring:
    the runtime base (the swizzled stage-0 offset of the plan's representative access, plus the
    stage's start), XOR the compile-time mask, plus the compile-time offset is the byte address
    that indexing the swizzled layout at the unit's coordinates (fp8_transpose.transpose_unit, each lane's
    load and store order permuted by its masks) gives."""
    v_text, vt_text = fp8.SMEM_LAYOUTS_V_VT[(tile_n, head_dim, stages)]
    v_reps, v_plan, vt_reps, vt_plan = _plan(tile_n, head_dim, stages)
    rows = fp8_transpose.UNIT_ROWS
    for side, text, reps, plan in ((0, v_text, v_reps, v_plan), (1, vt_text, vt_reps, vt_plan)):
        offset_of, n_stages, stage_bytes, swz = _composed(text)
        assert n_stages == stages
        assert stage_bytes % (1 << sum(swz)) == 0  # whole swizzle spans per stage
        for tid in range(THREADS):
            m_load, m_store = fp8_transpose.lane_masks(tid % 32, fp8_transpose.TRANSPOSE_LANE_MASKS[tile_n])
            bases = []
            for i_rep, e_rep in reps:
                coord = _masked_words(tid, i_rep, tile_n, head_dim)[side][e_rep]
                bases.append(offset_of(coord[0], 4 * coord[1], 0))
            for i in range(fp8_transpose.transpose_steps(tile_n, head_dim)):
                key0, dq, kq = fp8_transpose.transpose_unit(tid, i, head_dim)
                if side == 0:
                    coords = [(key0 + rows[e ^ m_load], 4 * dq) for e in range(4)]
                else:
                    coords = [(4 * dq + (e ^ m_store), 4 * kq) for e in range(4)]
                for e, (row, col) in enumerate(coords):
                    c, x, d = plan[i][e]
                    for stage in range(stages):
                        assert stage * stage_bytes + (bases[c] ^ x) + d == offset_of(row, col, stage), (
                            side, tid, i, e, stage,
                        )  # fmt: skip


def _hoisted_vt_ring(tile_n, head_dim, stages, v_ring, v_stage, vt_stage):
    """The hoisted 32-bit transpose (fp8_transpose.TransposeV) run on a byte image of the V ring, each thread
    with its own load/store order and PRMT selectors: the Vt ring image it writes and how often it
    writes each Vt word."""
    v_text, vt_text = fp8.SMEM_LAYOUTS_V_VT[(tile_n, head_dim, stages)]
    v_off, _, v_stage_bytes, _ = _composed(v_text)
    vt_off, _, vt_stage_bytes, _ = _composed(vt_text)
    v_reps, v_plan, vt_reps, vt_plan = _plan(tile_n, head_dim, stages)
    vt_ring = np.zeros(stages * vt_stage_bytes, dtype=np.uint8)
    writes = np.zeros(stages * vt_stage_bytes // 4, dtype=int)
    v_words, vt_words = v_ring.view(np.uint32), vt_ring.view(np.uint32)
    for tid in range(THREADS):
        v_coords = [_masked_words(tid, i, tile_n, head_dim)[0][e] for i, e in v_reps]
        vt_coords = [_masked_words(tid, i, tile_n, head_dim)[1][e] for i, e in vt_reps]
        v_bases = [v_stage * v_stage_bytes + v_off(row, 4 * w, 0) for row, w in v_coords]
        vt_bases = [vt_stage * vt_stage_bytes + vt_off(row, 4 * w, 0) for row, w in vt_coords]
        selectors = fp8_transpose.transpose_selectors(
            *fp8_transpose.lane_masks(tid % 32, fp8_transpose.TRANSPOSE_LANE_MASKS[tile_n])
        )
        for i in range(fp8_transpose.transpose_steps(tile_n, head_dim)):
            w = [int(v_words[((v_bases[c] ^ x) + d) // 4]) for c, x, d in v_plan[i]]
            outs = _transpose_4x4(*w, selectors=selectors)
            for e, (c, x, d) in enumerate(vt_plan[i]):
                addr = (vt_bases[c] ^ x) + d
                assert addr % 4 == 0
                vt_words[addr // 4] = outs[e]
                writes[addr // 4] += 1
    return vt_ring, writes


def _transpose_4x4(w0, w1, w2, w3, selectors=None):
    """fp8_transpose.transpose_4x4 (the 8 PRMT of a 4x4 unit) on Python ints; with ``selectors``
    (SA, SB, HA, HB of fp8_transpose.transpose_selectors) the hoisted transpose's per-thread form."""
    sa, sb, ha, hb = selectors or (
        fp8_transpose.PRMT_LO_PAIRS, fp8_transpose.PRMT_HI_PAIRS, fp8_transpose.PRMT_LO_HALVES, fp8_transpose.PRMT_HI_HALVES
    )  # fmt: skip
    t0 = _prmt(w0, w1, sa)
    t1 = _prmt(w0, w1, sb)
    t2 = _prmt(w2, w3, sa)
    t3 = _prmt(w2, w3, sb)
    return (_prmt(t0, t2, ha), _prmt(t0, t2, hb), _prmt(t1, t3, ha), _prmt(t1, t3, hb))


def test_canonical_selectors():
    """Masks 0 give the plain transpose's PRMT selectors (fp8_transpose.transpose_4x4)."""
    assert fp8_transpose.transpose_selectors(0, 0) == (
        fp8_transpose.PRMT_LO_PAIRS, fp8_transpose.PRMT_HI_PAIRS,
        fp8_transpose.PRMT_LO_HALVES, fp8_transpose.PRMT_HI_HALVES,
    )  # fmt: skip


@pytest.mark.parametrize("m_load", range(4))
@pytest.mark.parametrize("m_store", range(4))
def test_selectors_undo_the_lane_order(m_load, m_store):
    """Words loaded in the order UNIT_ROWS[e ^ m_load], transposed with the selectors of (m_load,
    m_store), give in store e the Vt word of head dim e ^ m_store: byte j = key row UNIT_ROWS[j]'s
    byte e ^ m_store."""
    rng = np.random.default_rng(m_load * 4 + m_store)
    canonical = [int(x) for x in rng.integers(0, 2**32, size=4, dtype=np.uint64)]
    loaded = [canonical[e ^ m_load] for e in range(4)]
    outs = _transpose_4x4(*loaded, selectors=fp8_transpose.transpose_selectors(m_load, m_store))
    for e in range(4):
        dim = e ^ m_store
        assert outs[e] == sum(((canonical[j] >> (8 * dim)) & 0xFF) << (8 * j) for j in range(4)), e


@pytest.mark.parametrize(("tile_n", "head_dim", "stages"), TILES)
def test_hoisted_transpose_moves_the_same_bytes(tile_n, head_dim, stages):
    """The hoisted transpose run on a byte image of the V and Vt rings (every stage) writes each Vt
    word of the target stage exactly once, touches no other stage, and gives Vt[d, 32 kb + k] =
    V[32 kb + key_of_a_column(k), d] read through the layouts."""
    v_text, vt_text = fp8.SMEM_LAYOUTS_V_VT[(tile_n, head_dim, stages)]
    v_off, _, v_stage_bytes, _ = _composed(v_text)
    vt_off, _, vt_stage_bytes, _ = _composed(vt_text)
    rng = np.random.default_rng(2)
    v_ring = rng.integers(0, 256, size=stages * v_stage_bytes, dtype=np.uint8)
    perm = np.array([32 * (k // 32) + fp8.key_of_a_column(k % 32) for k in range(tile_n)])
    for v_stage, vt_stage in ((0, stages - 1), (stages - 1, 0)):
        vt_ring, writes = _hoisted_vt_ring(tile_n, head_dim, stages, v_ring, v_stage, vt_stage)
        stage_words = slice(vt_stage * vt_stage_bytes // 4, (vt_stage + 1) * vt_stage_bytes // 4)
        assert (writes[stage_words] == 1).all() and writes.sum() == vt_stage_bytes // 4
        v = np.array([[v_ring[v_off(k, d, v_stage)] for d in range(head_dim)] for k in range(tile_n)])
        vt = np.array([[vt_ring[vt_off(d, k, vt_stage)] for k in range(tile_n)] for d in range(head_dim)])
        np.testing.assert_array_equal(vt, v[perm].T)


# --- The wide transpose (fp8_wide_transpose.WideTransposeV, VTranspose.WIDE): 64-bit accesses, 8x8-byte units

# The committed e4m3 tiles the wide transpose can run on: (head_dim / 8) x (tile_n / 8) units split
# evenly over the 128 producer threads (rules.why_invalid).
WIDE_TILES = [t for t in TILES if (t[1] // 8) * (t[0] // 8) % THREADS == 0]
STAGE_START = 3 * 1024  # a ring's shared-memory start: 1024-byte aligned, not 0


def test_wide_tiles_are_the_valid_ones():
    from cutefa.model import rules
    from cutefa.model.spec import VariantSpec

    def valid(tile_n, head_dim, stages):
        # the wide transpose's own rule (a tile may still fail the register budget, e.g. hd256 x 96
        # at the 232 registers the wide transpose leaves the consumers)
        spec = VariantSpec(
            "sm90", "fwd", "e4m3", head_dim, 128, tile_n, stages, 12,
            schedule=Schedule.PINGPONG, v_transpose=VTranspose.WIDE,
        )  # fmt: skip
        return rules._sm90_fp8_wide_transpose(spec) is None

    assert WIDE_TILES == [t for t in TILES if valid(*t)]
    assert {(128, 128, 2), (64, 256, 3), (128, 64, 2)} <= set(WIDE_TILES)  # hd128 / hd256 / hd64 defaults
    e4m3 = [s for s in all_variants("sm90", "fwd") if s.dtype == "e4m3"]
    wide = [s for s in e4m3 if s.options.v_transpose is VTranspose.WIDE]
    assert wide and all((s.tile_n, s.head_dim, s.stages) in WIDE_TILES for s in wide)


@pytest.mark.parametrize(("tile_n", "head_dim", "stages"), TILES)
def test_swizzle_atom_bytes_match_the_layouts(tile_n, head_dim, stages):
    """fp8_wide_transpose.swizzle_atom_bytes (the row bytes the wide mapping assumes) is the layouts'
    swizzle span / 8."""
    v_text, vt_text = fp8.SMEM_LAYOUTS_V_VT[(tile_n, head_dim, stages)]
    assert 1 << sum(_composed(v_text)[3]) == 8 * fp8_wide_transpose.swizzle_atom_bytes(head_dim)
    assert 1 << sum(_composed(vt_text)[3]) == 8 * fp8_wide_transpose.swizzle_atom_bytes(tile_n)


@pytest.mark.parametrize(("tile_n", "head_dim"), sorted({t[:2] for t in WIDE_TILES}))
def test_wide_units_partition_the_tile_with_the_key_permutation(tile_n, head_dim):
    """Every (dp, kp) 8x8-byte unit is taken once over the 128 threads and the steps, and the 8 key
    rows a unit loads are, in order, the keys of Vt columns 8 kp .. 8 kp + 7 (key_of_a_column): the
    low word of each store is key word 2 kp of the 4x4 transpose, the high word 2 kp + 1."""
    seen = set()
    for tid in range(THREADS):
        for i in range(fp8_wide_transpose.wide_steps(tile_n, head_dim)):
            key0, dp, kp = fp8_wide_transpose.wide_transpose_unit(tid, i, tile_n, head_dim)
            assert 0 <= dp < head_dim // 8 and 0 <= kp < tile_n // 8
            seen.add((dp, kp))
            for k, r in enumerate(fp8_wide_transpose.WIDE_ROWS):
                col = 8 * kp + k
                assert key0 + r == 32 * (col // 32) + fp8.key_of_a_column(col % 32), (tid, i, k)
    assert len(seen) == (head_dim // 8) * (tile_n // 8) == THREADS * fp8_wide_transpose.wide_steps(tile_n, head_dim)


@functools.cache
def _wide_plan(tile_n, head_dim, stages):
    return _plans_of(fp8_wide_transpose.wide_transpose_plan, 8, tile_n, head_dim, stages)


@functools.cache
def _wide_addresses(tile_n, head_dim, stages, tid, side, stage):
    """Per step, the 8 byte addresses (relative to the ring's start) of thread ``tid``'s loads
    (side 0) or stores (side 1) as fp8_wide_transpose.WideTransposeV computes them: ring start + stage start +
    (the base's swizzled stage-0 offset ^ mask) + offset."""
    v_text, vt_text = fp8.SMEM_LAYOUTS_V_VT[(tile_n, head_dim, stages)]
    offset_of, _, stage_bytes, _ = _composed((v_text, vt_text)[side])
    plans = _wide_plan(tile_n, head_dim, stages)
    reps, plan = plans[2 * side], plans[2 * side + 1]
    bases = []
    for i_rep, e_rep in reps:
        row, w = fp8_wide_transpose.wide_transpose_words(tid, i_rep, tile_n, head_dim)[side][e_rep]
        bases.append(offset_of(row, 8 * w, 0))
    start = STAGE_START + stage * stage_bytes
    return tuple(tuple(start + (bases[c] ^ x) + d - STAGE_START for c, x, d in row) for row in plan)


@pytest.mark.parametrize(("tile_n", "head_dim", "stages"), WIDE_TILES)
def test_wide_addresses_equal_the_swizzled_indexing(tile_n, head_dim, stages):
    """Every 64-bit load and store of the wide transpose, for every thread, step and ring stage, is
    8-byte aligned and covers exactly the 8 bytes that indexing the swizzled byte layout at the
    unit's coordinates gives: V row key, head dims 8 dp .. 8 dp + 7 / Vt row 8 dp + e, keys
    8 kp .. 8 kp + 7 (the swizzle moves 16-byte chunks, so 8 aligned bytes stay contiguous)."""
    v_text, vt_text = fp8.SMEM_LAYOUTS_V_VT[(tile_n, head_dim, stages)]
    for side, text in ((0, v_text), (1, vt_text)):
        offset_of, n_stages, _, _ = _composed(text)
        assert n_stages == stages
        for tid in range(THREADS):
            for stage in range(stages):
                addrs = _wide_addresses(tile_n, head_dim, stages, tid, side, stage)
                for i, row_addrs in enumerate(addrs):
                    coords = fp8_wide_transpose.wide_transpose_words(tid, i, tile_n, head_dim)[side]
                    for e, ((row, w), addr) in enumerate(zip(coords, row_addrs)):
                        assert addr % 8 == 0, (side, tid, i, e, stage)
                        for j in range(8):
                            assert offset_of(row, 8 * w + j, stage) == addr + j, (side, tid, i, e, stage, j)


@pytest.mark.parametrize(("tile_n", "head_dim", "stages"), WIDE_TILES)
def test_wide_transpose_writes_the_vt_of_the_hoisted_transpose(tile_n, head_dim, stages):
    """The wide transpose (8 LDS.64, four 4x4 byte transposes, 8 STS.64 per unit) run on a byte
    image of the rings writes each 8-byte Vt word of the target stage exactly once, nothing else,
    and leaves the Vt ring byte for byte as the hoisted 32-bit transpose (fp8_transpose.TransposeV)
    leaves it."""
    v_text, vt_text = fp8.SMEM_LAYOUTS_V_VT[(tile_n, head_dim, stages)]
    _, _, v_stage_bytes, _ = _composed(v_text)
    _, _, vt_stage_bytes, _ = _composed(vt_text)
    rng = np.random.default_rng(3)
    v_ring = rng.integers(0, 256, size=stages * v_stage_bytes, dtype=np.uint8)
    for v_stage, vt_stage in {(0, stages - 1), (stages - 1, 0), (stages // 2, stages // 2)}:
        vt_ring = np.zeros(stages * vt_stage_bytes, dtype=np.uint8)
        writes = np.zeros(stages * vt_stage_bytes // 8, dtype=int)
        v_dwords, vt_dwords = v_ring.view(np.uint64), vt_ring.view(np.uint64)
        for tid in range(THREADS):
            loads = _wide_addresses(tile_n, head_dim, stages, tid, 0, v_stage)
            stores = _wide_addresses(tile_n, head_dim, stages, tid, 1, vt_stage)
            for i in range(fp8_wide_transpose.wide_steps(tile_n, head_dim)):
                words = [int(v_dwords[a // 8]) for a in loads[i]]
                lo = [w & 0xFFFFFFFF for w in words]  # head dims 0-3 of key row key0 + WIDE_ROWS[j]
                hi = [w >> 32 for w in words]  # head dims 4-7
                outs_lo = _transpose_4x4(*lo[:4]) + _transpose_4x4(*hi[:4])  # keys (0, 1, 8, 9), dims 0-7
                outs_hi = _transpose_4x4(*lo[4:]) + _transpose_4x4(*hi[4:])  # keys (2, 3, 10, 11)
                for e, a in enumerate(stores[i]):
                    vt_dwords[a // 8] = outs_lo[e] | (outs_hi[e] << 32)
                    writes[a // 8] += 1
        stage_dwords = slice(vt_stage * vt_stage_bytes // 8, (vt_stage + 1) * vt_stage_bytes // 8)
        assert (writes[stage_dwords] == 1).all() and writes.sum() == vt_stage_bytes // 8
        hoisted, _ = _hoisted_vt_ring(tile_n, head_dim, stages, v_ring, v_stage, vt_stage)
        np.testing.assert_array_equal(vt_ring, hoisted)


def _wavefronts(addrs: list[int], width: int) -> int:
    """Shared-memory wavefronts of one warp-wide access of ``width`` bytes per lane (32 banks of 4
    bytes): a 32-bit access is served for the whole warp, a 64-bit one per half-warp (16 lanes, 128
    bytes at most per wavefront); a group takes as many wavefronts as the most distinct 4-byte
    words that fall into one bank."""
    group = 128 // width
    total = 0
    for g in range(0, 32, group):
        banks: dict[int, set[int]] = {}
        for a in addrs[g : g + group]:
            for word in range(a // 4, (a + width) // 4):
                banks.setdefault(word % 32, set()).add(word)
        total += max(len(words) for words in banks.values())
    return total


@pytest.mark.parametrize(("tile_n", "head_dim", "stages"), WIDE_TILES)
def test_wide_bank_conflicts(tile_n, head_dim, stages):
    """Every warp-wide LDS.64 / STS.64 of the wide transpose takes 2 wavefronts (the minimum for 256
    bytes) where that side's swizzle atom rows are 128 bytes, and 2 x 128 / row bytes where they
    are narrower (V at hd64: 64-byte rows; Vt at tile_n 64: 64-byte rows): all lanes of one
    instruction access rows with the same index mod 8 (the unit's 8 head dims / 8-key word are
    8-aligned), and such rows of a narrow atom share 64 (32) bytes of banks. Per byte moved that is
    never more than the plain 32-bit mapping's wavefronts (fp8_transpose.transpose_unit without lane masks,
    as fp8_transpose.transpose_v runs it), and half of them on 128-byte sides."""
    v_text, vt_text = fp8.SMEM_LAYOUTS_V_VT[(tile_n, head_dim, stages)]
    v_off, vt_off = _composed(v_text)[0], _composed(vt_text)[0]
    for side, extent in ((0, head_dim), (1, tile_n)):
        expected = 2 * 128 // fp8_wide_transpose.swizzle_atom_bytes(extent)
        wide_total = 0
        for w in range(4):
            addrs = [_wide_addresses(tile_n, head_dim, stages, t, side, 0) for t in range(32 * w, 32 * w + 32)]
            for i in range(fp8_wide_transpose.wide_steps(tile_n, head_dim)):
                for e in range(8):
                    fronts = _wavefronts([a[i][e] for a in addrs], 8)
                    assert fronts == expected, (side, w, i, e, fronts)
                    wide_total += fronts
        narrow_total = 0  # the plain 32-bit mapping, the same bytes
        for w in range(4):
            for i in range(fp8_transpose.transpose_steps(tile_n, head_dim)):
                words = [fp8_transpose.transpose_words(t, i, head_dim)[side] for t in range(32 * w, 32 * w + 32)]
                offset_of = (v_off, vt_off)[side]
                for e in range(4):
                    narrow_total += _wavefronts([offset_of(ws[e][0], 4 * ws[e][1], 0) for ws in words], 4)
        assert wide_total <= narrow_total, (side, wide_total, narrow_total)
        if fp8_wide_transpose.swizzle_atom_bytes(extent) == 128:
            assert 2 * wide_total == narrow_total, (side, wide_total, narrow_total)


@pytest.mark.parametrize(("tile_n", "head_dim", "stages"), TILES)
def test_hoisted_transpose_is_free_of_bank_conflicts(tile_n, head_dim, stages):
    """With its lane masks (fp8_transpose.TRANSPOSE_LANE_MASKS) every warp-wide 32-bit load and store of the
    hoisted transpose takes one wavefront; the plain mapping took 2 per load and 2-4 per store."""
    v_text, vt_text = fp8.SMEM_LAYOUTS_V_VT[(tile_n, head_dim, stages)]
    for side, text in ((0, v_text), (1, vt_text)):
        offset_of = _composed(text)[0]
        plain = 0
        for w in range(4):
            for i in range(fp8_transpose.transpose_steps(tile_n, head_dim)):
                masked = [_masked_words(t, i, tile_n, head_dim)[side] for t in range(32 * w, 32 * w + 32)]
                words = [fp8_transpose.transpose_words(t, i, head_dim)[side] for t in range(32 * w, 32 * w + 32)]
                for e in range(4):
                    fronts = _wavefronts([offset_of(ws[e][0], 4 * ws[e][1], 0) for ws in masked], 4)
                    assert fronts == 1, (side, w, i, e, fronts)
                    plain += _wavefronts([offset_of(ws[e][0], 4 * ws[e][1], 0) for ws in words], 4)
        assert plain >= 2 * 4 * 4 * fp8_transpose.transpose_steps(tile_n, head_dim), (side, plain)
