"""The V transpose of the sm90 e4m3 forward (templates/fwd_sm90_fp8.py.j2) with 32-bit shared-memory
accesses: the producer warpgroup turns each V tile (keys x head_dim) that TMA landed into Vt
(head_dim x keys, the keys of every 32-key block permuted by fp8.key_of_a_column), 4 keys x 4 head
dims per thread and step: 4 word loads, a 4x4 byte transpose (8 PRMT), 4 word stores.
:func:`transpose_v` indexes the swizzled tensors; :class:`TransposeV` (hoist_vt variants) hoists
the address arithmetic (fp8_transpose_plan.py) and permutes each lane's access order so that every
access takes one wavefront. The 64-bit transpose: fp8_wide_transpose.py.
"""

import cutlass
import cutlass.cute as cute

from cutefa.kernels.sm90.fp8_transpose_plan import _side_plans, _swizzle_span, composed_offset


def transpose_unit(tid, i, head_dim: int):
    """The unit of thread ``tid`` (of 128) in step ``i`` of :func:`transpose_v`: (first source key
    row, head-dim word dq, Vt key word kq). The thread reads V rows key0 + (0, 1, 8, 9) at word dq
    and writes Vt rows 4 dq + (0..3) at word kq. Plain integer arithmetic: the same function runs
    in the kernel and in the CPU tests.

    A warp covers 4 head-dim words x 8 key words (one 32-key block), so each side sees at most
    2-way bank conflicts under the 128-byte swizzle."""
    warp = tid // 32
    lane = tid % 32
    d_tiles = head_dim // 16
    wt = warp + 4 * i
    kq_lane = lane // 4  # half h = kq_lane // 4 and t = kq_lane % 4 of key_of_a_column
    kb = wt // d_tiles
    dq = (wt % d_tiles) * 4 + lane % 4
    key0 = kb * 32 + 16 * (kq_lane // 4) + 2 * (kq_lane % 4)
    return key0, dq, kb * 8 + kq_lane


def transpose_steps(tile_n: int, head_dim: int) -> int:
    """Steps of :func:`transpose_v`: (head_dim / 16) x (tile_n / 32) warp tiles over 4 warps."""
    return (head_dim // 16) * (tile_n // 32) // 4


# Byte selectors of the 4x4 byte transpose: PRMT(a, b, sel) picks bytes of (b:a) by nibble.
PRMT_LO_PAIRS, PRMT_HI_PAIRS = 0x5140, 0x7362  # interleave bytes 0,1 / 2,3 of a and b
PRMT_LO_HALVES, PRMT_HI_HALVES = 0x5410, 0x7632  # low / high 16 bits of a and b


@cute.jit
def transpose_v(
    sV: cute.Tensor,
    sVt: cute.Tensor,
    tid: cutlass.Int32,
    tile_n: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
):
    """Vt[d, 32 kb + k] = V[32 kb + key_of_a_column(k), d] for one stage, by the 128 threads of a
    warpgroup. ``sV`` (tile_n, d / 4) and ``sVt`` (d, tile_n / 4) are 32-bit views (4 e4m3 a word).

    A thread's unit (:func:`transpose_unit`) is 4 keys x 4 head dims: 4 word loads from 4 key rows,
    a 4x4 byte transpose (8 PRMT), 4 word stores into 4 head-dim rows."""
    for i in cutlass.range(transpose_steps(tile_n, head_dim), unroll=2):
        key0, dq, kq = transpose_unit(tid, i, head_dim)
        w0 = cutlass.Int32(sV[key0, dq])
        w1 = cutlass.Int32(sV[key0 + 1, dq])
        w2 = cutlass.Int32(sV[key0 + 8, dq])
        w3 = cutlass.Int32(sV[key0 + 9, dq])
        t0 = cutlass.Int32(cute.arch.prmt(w0, w1, PRMT_LO_PAIRS))
        t1 = cutlass.Int32(cute.arch.prmt(w0, w1, PRMT_HI_PAIRS))
        t2 = cutlass.Int32(cute.arch.prmt(w2, w3, PRMT_LO_PAIRS))
        t3 = cutlass.Int32(cute.arch.prmt(w2, w3, PRMT_HI_PAIRS))
        sVt[dq * 4 + 0, kq] = cutlass.Uint32(cute.arch.prmt(t0, t2, PRMT_LO_HALVES))
        sVt[dq * 4 + 1, kq] = cutlass.Uint32(cute.arch.prmt(t0, t2, PRMT_HI_HALVES))
        sVt[dq * 4 + 2, kq] = cutlass.Uint32(cute.arch.prmt(t1, t3, PRMT_LO_HALVES))
        sVt[dq * 4 + 3, kq] = cutlass.Uint32(cute.arch.prmt(t1, t3, PRMT_HI_HALVES))


# The key rows of a 32-bit unit, relative to its first key, in canonical word order.
UNIT_ROWS = (0, 1, 8, 9)


def unit_row(j):
    """UNIT_ROWS[j] by arithmetic (j may be a DSL Int32)."""
    return (j & 1) + 8 * (j >> 1)


# Lane masks of the hoisted 32-bit transpose (:class:`TransposeV`), per tile_n: ((load bit 0, load
# bit 1), (store bit 0, store bit 1)), each the lane bit (0-4) that sets that bit of the thread's
# load / store order mask, or None. Load e of a unit reads its word UNIT_ROWS[e ^ mL], store e
# writes Vt row 4 dq + (e ^ mS). Without them a warp's 32-bit accesses fall on 4 distinct swizzle
# chunk XORs per 8 rows (all its units start at even key rows, and its Vt rows 4 dq + e repeat mod
# 8): 2 wavefronts per load, 2-4 per store. With them every load and store of every committed
# tile takes one wavefront (tests/test_fp8_layout.py checks each one). Found by searching the
# lane bits against the layouts.
TRANSPOSE_LANE_MASKS = {
    64: ((4, None), (1, None)),
    96: ((4, None), (0, 1)),
    128: ((4, None), (None, 1)),
    160: ((4, None), (0, 1)),
}
NO_LANE_MASKS = ((None, None), (None, None))


def lane_masks(lane, masks):
    """(mL, mS) of a lane under ``masks`` (an entry of TRANSPOSE_LANE_MASKS): plain integer
    arithmetic on an int or a DSL Int32."""

    def bits(pair):
        value = 0
        for position, lane_bit in enumerate(pair):
            if lane_bit is not None:
                value = value | (((lane >> lane_bit) & 1) << position)
        return value

    return bits(masks[0]), bits(masks[1])


def transpose_words(tid, i, head_dim: int, masks=NO_LANE_MASKS):
    """The 4 V word coordinates (key, dq) that unit ``i`` of thread ``tid`` loads and the 4 Vt
    word coordinates (head-dim row, kq) it stores, in the order of :class:`TransposeV`'s loads
    and stores (the unit of :func:`transpose_unit`; ``masks`` permute the order per lane, see
    TRANSPOSE_LANE_MASKS)."""
    key0, dq, kq = transpose_unit(tid, i, head_dim)
    m_load, m_store = lane_masks(tid % 32, masks)
    return (
        [(key0 + unit_row(e ^ m_load), dq) for e in range(4)],
        [(dq * 4 + (e ^ m_store), kq) for e in range(4)],
    )


def transpose_selectors(m_load, m_store):
    """PRMT selectors (SA, SB, HA, HB) of the 4x4 byte transpose of a thread whose loads come in
    the order UNIT_ROWS[e ^ m_load] and whose stores go to rows e ^ m_store (plain integer
    arithmetic on ints or DSL Int32s). With words w0..w3 as loaded, a0 = PRMT(w0, w1, SA), a1 =
    PRMT(w0, w1, SB), a2 = PRMT(w2, w3, SA), a3 = PRMT(w2, w3, SB) interleave one byte pair of two
    key rows; store e writes PRMT(a0, a2, HA), PRMT(a0, a2, HB), PRMT(a1, a3, HA), PRMT(a1, a3, HB)
    (e = 0..3). Masks 0 give the canonical PRMT_LO/HI_PAIRS and PRMT_LO/HI_HALVES: bit 1 of m_store
    picks the byte pair (nibbles + 2), bit 0 of m_load swaps the pairs' operands and bit 1 the
    halves' operands (nibbles ^ 4), bit 0 of m_store picks the half (nibbles + 2)."""
    sa = (PRMT_LO_PAIRS + 0x2222 * ((m_store >> 1) & 1)) ^ (0x4444 * (m_load & 1))
    ha = (PRMT_LO_HALVES + 0x2222 * (m_store & 1)) ^ (0x4444 * ((m_load >> 1) & 1))
    return sa, sa ^ 0x2222, ha, ha ^ 0x2222


def transpose_plan(v_offset, vt_offset, tile_n: int, head_dim: int, v_span: int, vt_span: int):
    """(V reps, V plan, Vt reps, Vt plan) of :func:`xor_hoisted_plan` for the hoisted 32-bit
    transpose of one tile (its lane masks from TRANSPOSE_LANE_MASKS): ``v_offset`` / ``vt_offset``
    map a word coordinate (key, dq) / (head-dim row, kq) to its swizzled byte offset in stage 0;
    ``v_span`` / ``vt_span`` are the layouts' swizzle spans."""
    masks = TRANSPOSE_LANE_MASKS[tile_n]
    return _side_plans(
        lambda t, i: transpose_words(t, i, head_dim, masks),
        transpose_steps(tile_n, head_dim), 4, (v_offset, vt_offset), (v_span, vt_span),
    )  # fmt: skip


class TransposeV:
    """The V transpose of one tile shape, its address arithmetic hoisted (:func:`transpose_plan`).

    ``TransposeV(tid, sV_layout, sVt_layout, tile_n, head_dim, pipelined)`` (once per thread,
    before the key loop) computes the per-thread swizzled byte offsets of the plan's base accesses
    and the thread's PRMT selectors (:func:`transpose_selectors`, from its lane masks); ``pipelined``
    issues each step's loads one step early (for a producer with 32 registers or more);
    ``__call__(v_base, vt_base, v_stage, vt_stage)`` transposes one stage. Plain Python, traced
    inline from the kernel: every loop here is unrolled at trace time."""

    def __init__(self, tid, sV_layout, sVt_layout, tile_n: int, head_dim: int, pipelined: bool = True):
        self.steps = transpose_steps(tile_n, head_dim)
        self.pipelined = pipelined
        masks = TRANSPOSE_LANE_MASKS[tile_n]
        v_reps, self.v_plan, vt_reps, self.vt_plan = transpose_plan(
            lambda c: composed_offset(sV_layout, (c[0], c[1] * 4)),
            lambda c: composed_offset(sVt_layout, (c[0], c[1] * 4)),
            tile_n,
            head_dim,
            _swizzle_span(sV_layout),
            _swizzle_span(sVt_layout),
        )
        assert all(d % 4 == 0 and x % 4 == 0 for row in (*self.v_plan, *self.vt_plan) for _, x, d in row)
        # Whole swizzle spans per stage (and a span-aligned ring, see __call__): swizzling the
        # offset within stage 0 and adding the stage's start equals swizzling the absolute
        # address, and (start + offset) ^ x = start + (offset ^ x) for x below the span.
        self.v_stage_bytes = cute.cosize(sV_layout.outer) // cute.size(sV_layout.outer, mode=[2])
        self.vt_stage_bytes = cute.cosize(sVt_layout.outer) // cute.size(sVt_layout.outer, mode=[2])
        assert self.v_stage_bytes % _swizzle_span(sV_layout) == 0
        assert self.vt_stage_bytes % _swizzle_span(sVt_layout) == 0
        self.v_offsets = []
        for i_rep, e_rep in v_reps:
            key, dq = transpose_words(tid, i_rep, head_dim, masks)[0][e_rep]
            self.v_offsets.append(cutlass.Int32(composed_offset(sV_layout, (key, dq * 4))))
        self.vt_offsets = []
        for i_rep, e_rep in vt_reps:
            row, kq = transpose_words(tid, i_rep, head_dim, masks)[1][e_rep]
            self.vt_offsets.append(cutlass.Int32(composed_offset(sVt_layout, (row, kq * 4))))
        m_load, m_store = lane_masks(tid % 32, masks)
        self.selectors = tuple(cutlass.Int32(x) for x in transpose_selectors(m_load, m_store))

    @staticmethod
    def _word(bases, c, x, d):
        """A one-word tensor at (bases[c] ^ x) + d (bytes)."""
        addr = bases[c] if x == 0 else bases[c] ^ x
        ptr = cute.make_ptr(cutlass.Uint32, addr, cute.AddressSpace.smem, assumed_align=4) + d // 4
        return cute.make_tensor(ptr, cute.make_layout(1))

    def __call__(self, v_base, vt_base, v_stage, vt_stage):
        """Vt[d, 32 kb + k] = V[32 kb + key_of_a_column(k), d] for stage ``v_stage`` of the V ring
        into stage ``vt_stage`` of the Vt ring, by the 128 threads of a warpgroup. ``v_base`` /
        ``vt_base``: shared-memory byte addresses of the rings (1024-byte aligned, a multiple of
        every swizzle span).

        A thread's unit (:func:`transpose_unit`) is 4 keys x 4 head dims: 4 word loads from 4 key
        rows, a 4x4 byte transpose (8 PRMT with the thread's selectors), 4 word stores into 4
        head-dim rows; every address is a per-thread base, XOR a compile-time mask, plus a
        compile-time byte offset."""
        v0 = v_base + v_stage * self.v_stage_bytes
        vt0 = vt_base + vt_stage * self.vt_stage_bytes
        v_bases = [v0 + off for off in self.v_offsets]
        vt_bases = [vt0 + off for off in self.vt_offsets]

        def load(i):
            return [cutlass.Int32(self._word(v_bases, c, x, d)[0]) for c, x, d in self.v_plan[i]]

        # Pipelined: the next step's loads are issued before this step's stores (ptxas does not
        # move a shared load above a shared store it cannot prove disjoint, so otherwise each step
        # waits out its loads' latency alone). It takes 4 more registers: a producer held to 24
        # registers spills with it, so that one runs the steps one after another.
        ahead = load(0) if self.pipelined else None
        for i in range(self.steps):
            if self.pipelined:
                w = ahead
                if i + 1 < self.steps:
                    ahead = load(i + 1)
            else:
                w = load(i)
            outs = transpose_4x4(*w, selectors=self.selectors)
            for e in range(4):
                c, x, d = self.vt_plan[i][e]
                self._word(vt_bases, c, x, d)[0] = outs[e]


CANONICAL_SELECTORS = (PRMT_LO_PAIRS, PRMT_HI_PAIRS, PRMT_LO_HALVES, PRMT_HI_HALVES)


def transpose_4x4(w0, w1, w2, w3, selectors=CANONICAL_SELECTORS):
    """The 4x4 byte transpose of the V transposes (8 PRMT): words of key rows (0, 1, 8, 9) (4 head
    dims each) to words of head dims 0..3 (keys 0, 1, 8, 9 each). ``selectors`` (pairs low, pairs
    high, halves low, halves high): the canonical ones, or a thread's own from
    :func:`transpose_selectors` (:class:`TransposeV`, whose lanes load and store in permuted orders)."""
    lo_pairs, hi_pairs, lo_halves, hi_halves = selectors
    t0 = cutlass.Int32(cute.arch.prmt(w0, w1, lo_pairs))
    t1 = cutlass.Int32(cute.arch.prmt(w0, w1, hi_pairs))
    t2 = cutlass.Int32(cute.arch.prmt(w2, w3, lo_pairs))
    t3 = cutlass.Int32(cute.arch.prmt(w2, w3, hi_pairs))
    return (
        cutlass.Uint32(cute.arch.prmt(t0, t2, lo_halves)),
        cutlass.Uint32(cute.arch.prmt(t0, t2, hi_halves)),
        cutlass.Uint32(cute.arch.prmt(t1, t3, lo_halves)),
        cutlass.Uint32(cute.arch.prmt(t1, t3, hi_halves)),
    )


__all__ = [
    "CANONICAL_SELECTORS",
    "NO_LANE_MASKS",
    "PRMT_HI_HALVES",
    "PRMT_HI_PAIRS",
    "PRMT_LO_HALVES",
    "PRMT_LO_PAIRS",
    "TRANSPOSE_LANE_MASKS",
    "UNIT_ROWS",
    "TransposeV",
    "lane_masks",
    "transpose_4x4",
    "transpose_plan",
    "transpose_selectors",
    "transpose_steps",
    "transpose_unit",
    "transpose_v",
    "transpose_words",
    "unit_row",
]
