"""exp2 on the FMA units: the software exp2 the softmax splits off MUFU.EX2 (16 per clock per SM)
where the special-function unit, not the tensor cores, bounds the schedule (FlashAttention-4's
trick; plain PTX, so every family can use it)."""

from cutlass import Float32
from cutlass.cutlass_dsl import T, dsl_user_op

from cutefa.kernels.common.ptx import pure_asm


@dsl_user_op
def exp2_fma(x: Float32, *, loc=None, ip=None) -> Float32:
    """2**x for x <= 0 on the FMA pipe (no MUFU): Cody-Waite split x = j + f with j = round(x) via
    the 1.5 * 2**23 shifter, f in [-0.5, 0.5]; 2**f by a degree-3 minimax polynomial (relative
    error 7.5e-5, below bf16/fp16 rounding of P); 2**j added into the exponent bits. Below -126
    (masked scores are -inf) the result is exactly 0, as MUFU.EX2 gives: a row that sees no key
    must sum to 0."""
    return Float32(
        pure_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            "{\n"
            ".reg .f32 xc, t, j, f, p;\n"
            ".reg .b32 tb, pb;\n"
            ".reg .pred lo;\n"
            "setp.lt.f32 lo, $1, 0fC2FC0000;\n"  # x < -126: the result underflows to 0
            "max.ftz.f32 xc, $1, 0fC2FE0000;\n"  # -127
            "add.rn.ftz.f32 t, xc, 0f4B400000;\n"  # + 1.5 * 2**23: round to integer
            "sub.rn.ftz.f32 j, t, 0f4B400000;\n"
            "sub.rn.ftz.f32 f, xc, j;\n"
            "fma.rn.ftz.f32 p, f, 0f3D61FBA0, 0f3E786F0C;\n"  # 0.05517 f + 0.24261
            "fma.rn.ftz.f32 p, p, f, 0f3F31798D;\n"  # + 0.69326
            "fma.rn.ftz.f32 p, p, f, 0f3F7FFB49;\n"  # + 0.99993
            "mov.b32 tb, t;\n"
            "mov.b32 pb, p;\n"
            "shl.b32 tb, tb, 23;\n"
            "add.s32 pb, pb, tb;\n"
            "selp.b32 pb, 0, pb, lo;\n"
            "mov.b32 $0, pb;\n"
            "}",
            "=f,f",
            loc=loc,
            ip=ip,
        )
    )
