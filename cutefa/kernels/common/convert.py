"""fp32 -> 16-bit conversion of register fragments two elements per instruction."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cutlass_dsl import T, dsl_user_op

from cutefa.kernels.common.ptx import pure_asm


@dsl_user_op
def cvt_pair(lo: Float32, hi: Float32, bf16: cutlass.Constexpr, *, loc=None, ip=None) -> Int32:
    """``lo`` and ``hi`` rounded to nearest even bf16 (``bf16``) or fp16, packed into one 32-bit
    word (``lo`` in the low half): one ``cvt.rn.{bf16x2,f16x2}.f32``, one F2FP in SASS."""
    kind = "bf16x2" if bf16 else "f16x2"
    return Int32(
        pure_asm(
            T.i32(),
            [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{kind}.f32 $0, $1, $2;",  # $1 goes to the upper half, $2 to the lower
            "=r,f,f",
            loc=loc,
            ip=ip,
        )
    )


@cute.jit
def convert_pairs(src: cute.Tensor, dst: cute.Tensor):
    """``dst`` = ``src`` converted to ``dst``'s 16-bit type, element ``i`` of ``src`` to register
    offset ``i`` of ``dst``, two elements per instruction.

    ``src`` is an fp32 register fragment in a compact layout (an MMA accumulator: flat index =
    register offset) with an even number of elements; ``dst`` a 16-bit register tensor of as many
    elements over its own registers (any layout: it is written by offset). ``tensor.to(dtype)``
    does the same, but for fragments whose shape is not the 128x128 tile's (e.g. a 64x80 or 64x64
    WGMMA accumulator) the DSL lowers it to one F2FP per element plus a PRMT per pair."""
    words = cute.make_tensor(
        cute.recast_ptr(dst.iterator, dtype=Int32), cute.make_layout(cute.size(src) // 2)
    )
    for i in cutlass.range_constexpr(cute.size(src) // 2):
        words[i] = cvt_pair(src[2 * i], src[2 * i + 1], dst.element_type is cutlass.BFloat16)
