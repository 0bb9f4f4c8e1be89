"""Hoisted addresses of the sm90 e4m3 forward's V transposes (fp8_transpose.TransposeV and
fp8_wide_transpose.WideTransposeV): the swizzle on byte offsets, and the split of every access's
swizzled offset into a per-thread base, a compile-time XOR mask and a compile-time offset
(:func:`xor_hoisted_plan`). Plain Python on ints at trace time (the CPU tests run the same code).
"""

from cutefa.kernels.sm90.parts import WG_THREADS


def swizzle_bytes(offset, bits: int, base: int, shift: int):
    """CuTe's Swizzle<bits, base, shift> on a byte offset: bits [base + shift, base + shift + bits)
    XOR into bits [base, base + bits). Plain integer arithmetic (kernel and CPU tests)."""
    return offset ^ ((offset >> shift) & (((1 << bits) - 1) << base))


def _side_plans(words, steps: int, accesses: int, offsets, spans):
    """(V reps, V plan, Vt reps, Vt plan): :func:`xor_hoisted_plan` of both sides of a transpose
    whose thread ``t`` accesses ``words(t, i)`` = (V coordinates, Vt coordinates) in step ``i``."""
    plans = []
    for side in (0, 1):
        plans.extend(xor_hoisted_plan(
            lambda i, e, side=side: [offsets[side](words(t, i)[side][e]) for t in range(WG_THREADS)],
            steps, accesses, spans[side],
        ))  # fmt: skip
    return tuple(plans)


def composed_offset(layout, coord_bytes):
    """Byte offset of a byte coordinate (row, col) of stage 0 of a staged swizzled byte layout
    (``smem_layouts``): the swizzle applied to the outer layout's offset. Python ints at trace
    time (static layout, int coordinates), DSL integers at run time."""
    sw = layout.inner
    return swizzle_bytes(
        layout.outer((coord_bytes[0], coord_bytes[1], 0)), sw.num_bits, sw.num_base, sw.num_shift
    )


def _swizzle_span(layout) -> int:
    sw = layout.inner
    return 1 << (sw.num_bits + sw.num_base + sw.num_shift)


def xor_hoisted_plan(column, steps: int, accesses: int, span: int):
    """Split the transpose's shared-memory byte offsets into per-thread bases, XOR masks and
    offsets: ``column(i, e)`` lists the byte offsets (one per thread) of access ``e`` of step
    ``i``. Returns ``(reps, plan)``: ``reps`` lists the (step, access) pairs whose offset each
    thread computes at run time (one register each), and ``plan[i][e] = (c, x, d)`` says that for
    EVERY thread, access e of step i is at ``(offset(reps[c]) ^ x) + d``, with compile-time
    ``x < span`` (a mask of the swizzle's bits, 0 for a plain offset) and ``d``.

    A swizzle XORs row bits into the slot bits of a row; the lanes of a conflict-free access cover
    every slot, so a row move changes each lane's offset by a lane-dependent amount,
    but by the same XOR: an access related to a base by an XOR and an offset costs one LOP3 per
    (base, mask) per CTA (ptxas may recompute it per key block under the producer's 40 registers),
    and only an access related to no base that way becomes a base. When the ring's stage start
    ``s`` is a multiple of ``span``, (s + o) ^ x = s + (o ^ x) for x < span. Re-checked over all
    threads before it is returned (ValueError otherwise)."""
    cols: dict[tuple[int, int], list[int]] = {}

    def col(i, e):
        if (i, e) not in cols:
            cols[(i, e)] = column(i, e)
        return cols[(i, e)]

    def relate(target, base):
        x = (target[0] ^ base[0]) % span
        d = target[0] - (base[0] ^ x)
        if all(t == (b ^ x) + d for t, b in zip(target, base)):
            return x, d
        return None

    reps: list[tuple[int, int]] = []
    plan = []
    for i in range(steps):
        row = []
        for e in range(accesses):
            for c, (ri, re_) in enumerate(reps):
                found = relate(col(i, e), col(ri, re_))
                if found is not None:
                    row.append((c, *found))
                    break
            else:
                reps.append((i, e))
                row.append((len(reps) - 1, 0, 0))
        plan.append(row)
    for i in range(steps):  # the proof, independent of the search above
        for e in range(accesses):
            c, x, d = plan[i][e]
            if not 0 <= x < span or col(i, e) != [(b ^ x) + d for b in col(*reps[c])]:
                raise ValueError(f"transpose access ({i}, {e}) is not (base {c} ^ {x}) + {d}")
    return reps, plan


__all__ = [
    "composed_offset",
    "swizzle_bytes",
    "xor_hoisted_plan",
]
