"""The calling convention of the FP8 (e4m3) forwards that share it (the sm100 family's; the sm90
fp8 template defines the same one inline): ``kernel(q, k, v, o, lse, q_descale, k_descale,
v_descale, softmax_scale, stream)`` with e4m3 q/k/v (batch, seqlen, heads, head_dim), bf16 o of
q's shape, fp32 lse (batch, heads_q, seqlen_q) and fp32 descales of shape (batch, heads_kv).
"""

import cutlass

IN_DTYPE = cutlass.Float8E4M3FN
OUT_DTYPE = cutlass.BFloat16


def fake_arguments(spec, cutlass, cute):
    """Fake (q, k, v, o, lse, q_descale, k_descale, v_descale, softmax_scale, stream) for one
    shape-polymorphic compile of the e4m3 forward ``spec``."""
    batch, seqlen_q, seqlen_k = cute.sym_int(symbol="b"), cute.sym_int(symbol="sq"), cute.sym_int(symbol="sk")
    heads_q, heads_kv = cute.sym_int(symbol="hq"), cute.sym_int(symbol="hkv")

    def bshd(dtype, seqlen, heads):
        align = 16 // (dtype.width // 8)  # rows start on 16-byte boundaries (TMA)
        strides = tuple(cute.sym_int64(divisibility=align) for _ in range(3)) + (1,)
        return cute.runtime.make_fake_tensor(
            dtype, (batch, seqlen, heads, spec.head_dim), strides, assumed_align=16
        )

    def descale():
        return cute.runtime.make_fake_tensor(
            cutlass.Float32, (batch, heads_kv), (cute.sym_int64(), cute.sym_int64())
        )

    lse = cute.runtime.make_fake_tensor(
        cutlass.Float32, (batch, heads_q, seqlen_q), (cute.sym_int64(), cute.sym_int64(), 1)
    )
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    q, o = bshd(IN_DTYPE, seqlen_q, heads_q), bshd(OUT_DTYPE, seqlen_q, heads_q)
    k, v = bshd(IN_DTYPE, seqlen_k, heads_kv), bshd(IN_DTYPE, seqlen_k, heads_kv)
    return q, k, v, o, lse, descale(), descale(), descale(), cutlass.Float32(1.0), stream


__all__ = ["IN_DTYPE", "OUT_DTYPE", "fake_arguments"]
