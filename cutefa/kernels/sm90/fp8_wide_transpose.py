"""The V transpose of the sm90 e4m3 forward with 64-bit shared-memory accesses (wide_vt variants,
templates/fwd_sm90_fp8.py.j2): 8 keys x 8 head dims per thread and step, the same Vt bytes as
fp8_transpose.TransposeV, its addresses hoisted the same way (fp8_transpose_plan.py).
"""

import cutlass
import cutlass.cute as cute

from cutefa.kernels.sm90.fp8_transpose import transpose_4x4
from cutefa.kernels.sm90.fp8_transpose_plan import _side_plans, _swizzle_span, composed_offset
from cutefa.kernels.sm90.parts import WG_THREADS

# The key rows of a wide unit, relative to its first key, in the order of the unit's 8 Vt bytes:
# Vt key word 2 kp holds keys (0, 1, 8, 9), word 2 kp + 1 keys (2, 3, 10, 11) (key_of_a_column).
WIDE_ROWS = (0, 1, 8, 9, 2, 3, 10, 11)
WIDE_UNIT_BYTES = 8  # a unit's bytes per key row (head dims) and per head-dim row (keys)


def swizzle_atom_bytes(extent: int) -> int:
    """Row bytes of the 128/64/32-byte swizzle atom that ``smem_layouts`` picks for an e4m3 K-major
    tile whose contiguous extent is ``extent`` (head_dim for V, tile_n for Vt)."""
    return 128 if extent % 128 == 0 else 64 if extent % 64 == 0 else 32


def wide_steps(tile_n: int, head_dim: int) -> int:
    """Steps of :class:`WideTransposeV`: (head_dim / 8) x (tile_n / 8) units over 128 threads
    (space.why_invalid requires a whole number)."""
    return (head_dim // 8) * (tile_n // 8) // WG_THREADS


def wide_transpose_unit(tid, i, tile_n: int, head_dim: int):
    """The unit of thread ``tid`` (of 128) in step ``i`` of :class:`WideTransposeV`: (first key
    row key0, 8-byte head-dim word dp, 8-byte Vt key word kp). The thread loads V rows key0 +
    WIDE_ROWS at bytes 8 dp..8 dp + 7 and stores Vt rows 8 dp + (0..7) at bytes 8 kp..8 kp + 7
    (Vt key words 2 kp, 2 kp + 1 of :func:`transpose_unit`). Plain integer arithmetic.

    The mapping keeps every warp-wide 64-bit access at the fewest wavefronts the swizzle allows
    (a half-warp's 16 lanes, 128 bytes, per wavefront). With SV = V atom row bytes / 8 and SVT = Vt
    atom row bytes / 8 (16, 8 or 4 8-byte slots per swizzled row): a half-warp takes SVT adjacent
    key words kp (every Vt slot of a row: all lanes of a store write rows 8 dp + e with the same e,
    whose swizzle XOR is the same) and 16 / SVT head-dim words per key word, twisted by XOR so that
    (dp mod SV) ^ (SV / 2)(kp & 1), the V slot up to the instruction's constant XOR (key0 mod 8 =
    4 (kp & 1)), takes min(16, SV) distinct values. Half-warps fill blocks of SV head-dim words x
    SVT key words (SV x SVT / 16 half-warps each), blocks in key-word-major order."""
    sv = swizzle_atom_bytes(head_dim) // WIDE_UNIT_BYTES
    svt = swizzle_atom_bytes(tile_n) // WIDE_UNIT_BYTES
    per_block = sv * svt // 16
    warp = tid // 32
    lane = tid % 32
    half_warp = 8 * i + 2 * warp + lane // 16
    block = half_warp // per_block
    q = half_warp % per_block
    dpb = block % (head_dim // 8 // sv)
    kpb = block // (head_dim // 8 // sv)
    b = lane % 16 % svt
    x = q * (16 // svt) + lane % 16 // svt
    twist = ((sv // 2) * (b % 2)) ^ ((b * (16 // svt)) % sv)
    dp = dpb * sv + (x ^ twist)
    kp = kpb * svt + b
    key0 = 16 * (kp // 2) + 4 * (kp % 2)
    return key0, dp, kp


def wide_transpose_words(tid, i, tile_n: int, head_dim: int):
    """The 8 V coordinates (key, dp) that unit ``i`` of thread ``tid`` loads and the 8 Vt
    coordinates (head-dim row, kp) it stores (8-byte words), in :class:`WideTransposeV`'s order."""
    key0, dp, kp = wide_transpose_unit(tid, i, tile_n, head_dim)
    return [(key0 + r, dp) for r in WIDE_ROWS], [(8 * dp + e, kp) for e in range(8)]


def wide_transpose_plan(v_offset, vt_offset, tile_n: int, head_dim: int, v_span: int, vt_span: int):
    """(V reps, V plan, Vt reps, Vt plan) of :func:`xor_hoisted_plan` for one tile: ``v_offset`` /
    ``vt_offset`` map an 8-byte word coordinate (key, dp) / (head-dim row, kp) to its swizzled
    byte offset in stage 0; ``v_span`` / ``vt_span`` are the layouts' swizzle spans."""
    return _side_plans(
        lambda t, i: wide_transpose_words(t, i, tile_n, head_dim),
        wide_steps(tile_n, head_dim), 8, (v_offset, vt_offset), (v_span, vt_span),
    )  # fmt: skip


class WideTransposeV:
    """The V transpose with 64-bit shared-memory accesses (wide_vt variants), addresses hoisted
    (:func:`xor_hoisted_plan`). Same interface as :class:`TransposeV`, same Vt bytes.

    A thread's unit (:func:`wide_transpose_unit`) is 8 keys x 8 head dims: 8 LDS.64 from the key
    rows key0 + WIDE_ROWS (head dims 8 dp..8 dp + 7: low word dims 0-3, high word 4-7), four 4x4
    byte transposes (32 PRMT: keys (0, 1, 8, 9) / (2, 3, 10, 11) x dims 0-3 / 4-7), 8 STS.64 into
    head-dim rows 8 dp + e (low word: Vt key word 2 kp, high word: 2 kp + 1)."""

    def __init__(self, tid, sV_layout, sVt_layout, tile_n: int, head_dim: int):
        self.steps = wide_steps(tile_n, head_dim)
        v_span, vt_span = _swizzle_span(sV_layout), _swizzle_span(sVt_layout)
        v_reps, self.v_plan, vt_reps, self.vt_plan = wide_transpose_plan(
            lambda c: composed_offset(sV_layout, (c[0], c[1] * WIDE_UNIT_BYTES)),
            lambda c: composed_offset(sVt_layout, (c[0], c[1] * WIDE_UNIT_BYTES)),
            tile_n,
            head_dim,
            v_span,
            vt_span,
        )
        assert all(d % 8 == 0 and x % 8 == 0 for row in (*self.v_plan, *self.vt_plan) for _, x, d in row)
        self.v_stage_bytes = cute.cosize(sV_layout.outer) // cute.size(sV_layout.outer, mode=[2])
        self.vt_stage_bytes = cute.cosize(sVt_layout.outer) // cute.size(sVt_layout.outer, mode=[2])
        assert self.v_stage_bytes % v_span == 0 and self.vt_stage_bytes % vt_span == 0
        self.v_offsets = []
        for i_rep, e_rep in v_reps:
            key, dp = wide_transpose_words(tid, i_rep, tile_n, head_dim)[0][e_rep]
            self.v_offsets.append(cutlass.Int32(composed_offset(sV_layout, (key, dp * WIDE_UNIT_BYTES))))
        self.vt_offsets = []
        for i_rep, e_rep in vt_reps:
            row, kp = wide_transpose_words(tid, i_rep, tile_n, head_dim)[1][e_rep]
            self.vt_offsets.append(cutlass.Int32(composed_offset(sVt_layout, (row, kp * WIDE_UNIT_BYTES))))
        # The XOR-derived offsets, per CTA like the bases: the stage start is a multiple of the
        # swizzle span and x < span, so (start + off) ^ x = start + (off ^ x).
        self.v_xor_offsets = {
            (c, x): self.v_offsets[c] ^ x for row in self.v_plan for c, x, _ in row if x
        }
        self.vt_xor_offsets = {
            (c, x): self.vt_offsets[c] ^ x for row in self.vt_plan for c, x, _ in row if x
        }

    @staticmethod
    def _ptr(bases, derived, c, x, d):
        """Pointer (64-bit elements) to stage start + (offset[c] ^ x) + d."""
        addr = bases[c] if x == 0 else derived[(c, x)]
        return cute.make_ptr(cutlass.Uint64, addr, cute.AddressSpace.smem, assumed_align=8) + d // 8

    def __call__(self, v_base, vt_base, v_stage, vt_stage):
        """Vt[d, 32 kb + k] = V[32 kb + key_of_a_column(k), d] for stage ``v_stage`` of the V ring
        into stage ``vt_stage`` of the Vt ring (see :meth:`TransposeV.__call__`)."""
        v0 = v_base + v_stage * self.v_stage_bytes
        vt0 = vt_base + vt_stage * self.vt_stage_bytes
        v_bases = [v0 + off for off in self.v_offsets]
        vt_bases = [vt0 + off for off in self.vt_offsets]
        v_derived = {k: v0 + off for k, off in self.v_xor_offsets.items()}
        vt_derived = {k: vt0 + off for k, off in self.vt_xor_offsets.items()}
        one = cute.make_layout(1)
        for i in range(self.steps):
            lo, hi = [], []
            for c, x, d in self.v_plan[i]:
                word = cute.make_tensor(self._ptr(v_bases, v_derived, c, x, d), one)[0]
                lo.append(cutlass.Int32(cutlass.Uint32(word)))
                hi.append(cutlass.Int32(cutlass.Uint32(word >> 32)))
            # lo/hi[j]: head dims 0-3 / 4-7 of key row key0 + WIDE_ROWS[j]
            outs_lo = transpose_4x4(lo[0], lo[1], lo[2], lo[3]) + transpose_4x4(hi[0], hi[1], hi[2], hi[3])
            outs_hi = transpose_4x4(lo[4], lo[5], lo[6], lo[7]) + transpose_4x4(hi[4], hi[5], hi[6], hi[7])
            for e in range(8):
                c, x, d = self.vt_plan[i][e]
                pair = cutlass.Uint64(outs_lo[e]) | (cutlass.Uint64(outs_hi[e]) << 32)
                cute.make_tensor(self._ptr(vt_bases, vt_derived, c, x, d), one)[0] = pair


__all__ = [
    "WIDE_ROWS",
    "WIDE_UNIT_BYTES",
    "WideTransposeV",
    "swizzle_atom_bytes",
    "wide_steps",
    "wide_transpose_plan",
    "wide_transpose_unit",
    "wide_transpose_words",
]
