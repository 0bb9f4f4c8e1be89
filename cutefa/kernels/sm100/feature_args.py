"""Fake arguments of a 16-bit sm100 forward with feature axes, for one shape-polymorphic compile.

The calling convention (:mod:`cutefa.api.features`): ``q, k, v, out, lse, softmax_scale``, then,
those the spec has, ``cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q`` (varlen),
``window_left, window_right`` (local mask), ``softcap``, ``alibi_slopes`` (float32 (batch,
heads_q)), ``sinks`` (float32 (heads_q,)), and the stream. Varlen packs q and out as (total_q,
heads_q, head_dim), k and v as (total_k, heads_kv, head_dim) and lse as (heads_q, total_q);
otherwise they are (batch, seqlen, heads, head_dim) and lse (batch, heads_q, seqlen_q).
"""

from __future__ import annotations

from typing import Any

from cutefa.model.options import Mask
from cutefa.model.spec import VariantSpec

_ROW_ALIGN_BYTES = 16


def fake_arguments(spec: VariantSpec, cutlass: Any, cute: Any) -> tuple[Any, ...]:
    """Fake tensors and scalars of ``spec``'s calling convention (every dynamic dim symbolic)."""
    dtype = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[spec.dtype]
    row_align = _ROW_ALIGN_BYTES // spec.elem_bytes
    f = spec.features
    heads_q, heads_kv = cute.sym_int(symbol="hq"), cute.sym_int(symbol="hkv")

    def rows(dims: tuple[Any, ...]) -> Any:
        """A 16-bit tensor of shape ``dims`` + (head_dim,), head_dim contiguous, 16-byte rows."""
        strides = tuple(cute.sym_int64(divisibility=row_align) for _ in dims) + (1,)
        return cute.runtime.make_fake_tensor(
            dtype, (*dims, spec.head_dim), strides, assumed_align=_ROW_ALIGN_BYTES
        )

    def f32(shape: tuple[Any, ...], strides: tuple[Any, ...]) -> Any:
        return cute.runtime.make_fake_tensor(cutlass.Float32, shape, strides, assumed_align=4)

    def i32(length: Any) -> Any:
        return cute.runtime.make_fake_tensor(cutlass.Int32, (length,), (1,), assumed_align=4)

    args: list[Any] = []
    if f.varlen:
        total_q, total_k = cute.sym_int(symbol="tq"), cute.sym_int(symbol="tk")
        batch, bounds = cute.sym_int(symbol="b"), cute.sym_int(symbol="b1")
        q, o = rows((total_q, heads_q)), rows((total_q, heads_q))
        k, v = rows((total_k, heads_kv)), rows((total_k, heads_kv))
        lse = f32((heads_q, total_q), (cute.sym_int64(), 1))
        args += [q, k, v, o, lse, cutlass.Float32(1.0)]
        args += [i32(bounds), i32(bounds), i32(batch), i32(batch), cutlass.Int32(1)]
    else:
        batch, seqlen_q, seqlen_k = (
            cute.sym_int(symbol="b"),
            cute.sym_int(symbol="sq"),
            cute.sym_int(symbol="sk"),
        )
        q, o = rows((batch, seqlen_q, heads_q)), rows((batch, seqlen_q, heads_q))
        k, v = rows((batch, seqlen_k, heads_kv)), rows((batch, seqlen_k, heads_kv))
        lse = f32((batch, heads_q, seqlen_q), (cute.sym_int64(), cute.sym_int64(), 1))
        args += [q, k, v, o, lse, cutlass.Float32(1.0)]
    if spec.mask is Mask.LOCAL:
        args += [cutlass.Int32(0), cutlass.Int32(0)]
    if f.softcap:
        args.append(cutlass.Float32(1.0))
    if f.alibi:
        args.append(f32((batch, heads_q), (cute.sym_int64(), cute.sym_int64())))
    if f.sinks:
        args.append(f32((heads_q,), (1,)))
    args.append(cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
    return tuple(args)
