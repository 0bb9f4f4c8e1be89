"""The stream-K tail of the sm80 non-causal backward: the last wave of key blocks spread evenly.

A non-causal backward grid has ``units`` = key blocks x heads x batches CTAs of equal work (each
walks all ``m_blocks`` query blocks). With ``slots`` CTAs resident at once (SMs x CTAs per SM), the
last wave holds ``units % slots`` of them and the rest of the GPU idles while they run: at the
benchmark shapes (2048 heads x head_dim, 16384 tokens) 2048 or 4096 units on 132 SMs, a wave in
16 or 32 run as a fraction.

With the tail on, the last ``rem + slots`` units (``rem = units % slots``: the partial wave and
the full one before it) form the stream region: its ``(rem + slots) * m_blocks`` query-block
steps are cut into ``slots`` equal contiguous ranges, one per stream CTA, so that the region takes
``1 + rem / slots`` waves of time instead of two. A range covers whole units in its middle (written
as usual) and at most one part of a unit at each end. A part's dK and dV (fp32, dK already scaled)
go to the CTA's slot 0 (its first unit) or slot 1 (its last one) of the partials workspace
``(slots, 2, 2, tile_n * head_dim)`` in fragment order (value ``4 j + e`` of thread ``t`` at word
``4 (threads j + t) + e``: 16-byte stores, a warp's covering 512 contiguous bytes); then the CTA
counts itself in the unit's counter (zeroed by the preprocess). The CTA that completes the count
sums the unit's parts in the order of the CTAs that made them (a fixed order, whatever order
they finished in) and writes dK and dV. The CTAs of the grid whose units lie in the region's
partial wave exit at once: the grid keeps its shape.

Every quantity here is CTA-uniform integer arithmetic on the grid's shape; the host passes
``slots`` (0: tail off, as in deterministic mode) and keeps ``(rem + slots) * m_blocks * slots``
within 32 bits (:func:`cutefa.api.backward.tail_slots`).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector
from cutlass.cutlass_dsl import T, dsl_user_op

from cutefa.kernels.common.ptx import effect_asm


@cute.jit
def cta_of(step: Int32, steps: Int32, slots: Int32) -> Int32:
    """The stream CTA whose range holds region step ``step``: CTA c covers steps
    [c steps // slots, (c + 1) steps // slots)."""
    return ((step + 1) * slots - 1) // steps


@cute.jit
def store_fragment(acc: cute.Tensor, part: cute.Tensor, thread: Int32, threads: cutlass.Constexpr):
    """part[4 (threads j + thread) + e] = acc[4 j + e]: one 16-byte store per four values.
    ``part`` is one (tile_n * head_dim,) fp32 slot, 16-byte aligned."""
    quad_type = ir.VectorType.get([4], Float32.mlir_type)
    base = part.iterator + 4 * thread
    for j in cutlass.range_constexpr(cute.size(acc) // 4):
        quad = vector.from_elements(quad_type, [acc[4 * j + e].ir_value() for e in range(4)])
        cute.arch.store(base + 4 * threads * j, quad)


@cute.jit
def add_fragment(acc: cute.Tensor, part: cute.Tensor, thread: Int32, threads: cutlass.Constexpr):
    """acc += the values :func:`store_fragment` wrote to ``part``, read through L2 (ld.global.cg:
    other CTAs wrote them during this launch)."""
    quad_type = ir.VectorType.get([4], Float32.mlir_type)
    base = part.iterator + 4 * thread
    for j in cutlass.range_constexpr(cute.size(acc) // 4):
        quad = cute.arch.load(base + 4 * threads * j, quad_type, cop="cg")
        for e in cutlass.range_constexpr(4):
            acc[4 * j + e] = acc[4 * j + e] + Float32(vector.extract(quad, [], [e]))


@cute.jit
def rebuild(address: cutlass.Int64, like: cute.Tensor, align: cutlass.Constexpr) -> cute.Tensor:
    """A global tensor with ``like``'s element type and layout at byte ``address`` (a segment's
    base address, read back from shared memory), ``align``-byte aligned."""
    ptr = cute.make_ptr(like.element_type, address, cute.AddressSpace.gmem, assumed_align=align)
    return cute.make_tensor(ptr, like.layout)


@dsl_user_op
def thread_index(*, loc=None, ip=None) -> Int32:
    """threadIdx.x read where this is called (a ``mov`` with side effects): partitions built from it
    in a segment are computed in that segment, not hoisted out of the segment loop to stay live in
    registers (or spill) across its query-block loop."""
    return Int32(effect_asm(T.i32(), [], "mov.u32 $0, %tid.x;", "=r", loc=loc, ip=ip))


def plan(units: int, m_blocks: int, slots: int) -> list[list[tuple[int, int, int, int]]]:
    """The kernel's plan in Python, with its integer formulas: per stream CTA, its segments as
    (unit, m_begin, m_end, slot) with the unit counted from the region's first and the slot its part
    goes to (-1 for a whole unit, written directly). For tests and for reading; [] where the tail
    does not apply (``units % slots == 0`` or fewer than ``units % slots + slots`` units)."""
    rem = units % slots if slots > 0 else 0
    if rem == 0 or units < rem + slots:
        return []
    steps = (rem + slots) * m_blocks
    ctas = []
    for c in range(slots):
        begin, end = c * steps // slots, (c + 1) * steps // slots
        segs = []
        for it in range((end - 1) // m_blocks - begin // m_blocks + 1):
            unit = begin // m_blocks + it
            m_begin, m_end = max(begin - unit * m_blocks, 0), min(end - unit * m_blocks, m_blocks)
            cut = m_begin > 0 or m_end < m_blocks
            segs.append((unit, m_begin, m_end, min(it, 1) if cut else -1))
        ctas.append(segs)
    return ctas


def part_slots(unit: int, m_blocks: int, steps: int, slots: int) -> list[tuple[int, int]]:
    """(CTA, slot) of each part of region unit ``unit``, in the order the finishing CTA sums them:
    the kernel's reading side (:func:`cta_of` and the slot rule), for tests against :func:`plan`."""
    first = ((unit * m_blocks + 1) * slots - 1) // steps
    last = ((unit * m_blocks + m_blocks) * slots - 1) // steps
    return [(c, 0 if c * steps // slots >= unit * m_blocks else 1) for c in range(first, last + 1)]


@cute.jit
def dq_rows(
    address: cutlass.Int64, like: cute.Tensor, row0: Int32, mma_dq: cute.TiledMma, tile_m: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
) -> cute.Tensor:  # fmt: skip
    """This thread's partition of a segment's (seqlen_q, head_dim) fp32 dQ rows from row ``row0``
    on, by query blocks: the natural and dq_quad layouts' reduction targets, rebuilt where used."""
    rows = cute.local_tile(cute.domain_offset((row0, 0), rebuild(address, like, 8)), (tile_m, head_dim), (None, 0))
    return mma_dq.get_slice(thread_index()).partition_C(rows)
