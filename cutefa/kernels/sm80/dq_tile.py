"""dq_tile: the sm80 backward's fp32 dQ accumulator tiled by query blocks, in fragment order.

The workspace is (splits, batch, heads_q, query blocks, tile_m * head_dim) (``space.bwd_dq_accum_shape``):
one contiguous chunk per query block, seqlen_q rounded up to whole blocks. Value ``v * j + e`` of
thread ``t`` of the dQ MMA's accumulator fragment lives at word ``v * (threads * j + t) + e`` of
its block's chunk, where ``v`` (:func:`vec_width`) is 4 on targets with 16-byte fp32 reductions
(sm_90 and newer) and 1 before: consecutive threads own consecutive 16-byte (or 4-byte) words, so
that one warp's reduction covers 512 (or 128) contiguous bytes, FlashAttention-2's workspace
layout. The main kernel adds whole fragments unpredicated (the padding rows of the last block add
zeros: their Q and dO rows load as zeros and their LSE as +inf); the postprocess reads each
thread's values back in the same order, through the same MMA's fragment, into a shared-memory tile
that it writes to dQ by rows.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector

from cutefa.kernels.sm80.bwd_parts import vector_red_supported


def vec_width() -> int:
    """Words per reduction and per thread-contiguous group in the chunk: 4 where the target being
    compiled for has red.global.add.v4.f32 (sm_90 and newer), 1 on sm_80/86/89. Chosen while
    tracing, the same for the main kernel and the postprocess of one compile."""
    return 4 if vector_red_supported() else 1


@cute.jit
def red_add_fragment(
    acc: cute.Tensor, chunk: cute.Tensor, thread: Int32, threads: cutlass.Constexpr,
    part: cutlass.Constexpr = 0, parts: cutlass.Constexpr = 1, value0=0,
):  # fmt: skip
    """chunk += acc in fragment order: value v j + e of ``thread`` at word v (threads j + thread) + e
    (v = :func:`vec_width`), one 16-byte red.global.add.v4.f32 per four values (sm_90+) or one
    red.global.add.f32 per value. ``chunk`` is one query block's (tile_m * head_dim,) fp32 chunk,
    16-byte aligned. With ``parts`` > 1 only the ``part``-th of ``parts`` equal shares of the
    reductions (in order), so that a caller can spread them between other work. ``value0``: ``acc``
    is the part of a larger fragment that starts at its value ``value0`` (a multiple of vec; a
    column chunk of the dQ GEMM, ``VariantSpec.dq_pipe``), possibly known only at run time."""
    vec = vec_width()
    base = chunk.iterator + vec * thread + threads * value0
    groups = cute.size(acc) // vec
    if cutlass.const_expr(groups % parts):
        raise ValueError(f"{groups} reductions per thread do not split into {parts} equal parts")
    share = groups // parts
    if cutlass.const_expr(vec == 4):
        quad_type = ir.VectorType.get([4], Float32.mlir_type)
        for j in cutlass.range_constexpr(part * share, (part + 1) * share):
            quad = vector.from_elements(quad_type, [acc[4 * j + e].ir_value() for e in range(4)])
            cute.arch.red(base + 4 * threads * j, quad, op="add", dtype=Float32, sem="relaxed", scope="gpu")
    else:
        for i in cutlass.range_constexpr(part * share, (part + 1) * share):
            cute.arch.red(base + threads * i, acc[i], op="add", dtype=Float32, sem="relaxed", scope="gpu")


@cute.jit
def load_fragment(acc: cute.Tensor, mdQaccum: cute.Tensor, batch: Int32, head: Int32, m_block: Int32,
                  thread: Int32, threads: cutlass.Constexpr):  # fmt: skip
    """acc = the sum over the splits (in split order) of ``thread``'s values of query block
    ``m_block``'s chunk, in fragment order (:func:`red_add_fragment`'s); every load of a split is
    issued before its adds."""
    vec = vec_width()
    groups = cute.size(acc) // vec
    part = cute.make_rmem_tensor((vec,), Float32)
    for s in cutlass.range(cute.size(mdQaccum, mode=[0]), unroll=1):
        words = cute.logical_divide(mdQaccum[s, batch, head, m_block, None], cute.make_layout(vec))
        for j in cutlass.range_constexpr(groups):
            cute.autovec_copy(words[None, threads * j + thread], part)
            for e in cutlass.range_constexpr(vec):
                if s == 0:
                    acc[vec * j + e] = part[e]
                else:
                    acc[vec * j + e] = acc[vec * j + e] + part[e]


@cute.jit
def zero_part(
    mdQaccum: cute.Tensor, batch: Int32, head: Int32, bx: Int32, thread: Int32, rows: cutlass.Constexpr,
    tile_m: cutlass.Constexpr, head_dim: cutlass.Constexpr, threads: cutlass.Constexpr,
):  # fmt: skip
    """Zero part ``bx`` of the workspace of (``batch``, ``head``), in every split, 16 bytes per
    store: a chunk (tile_m * head_dim words) is cut into tile_m / ``rows`` parts of ``rows`` *
    head_dim words, and part bx is part bx % p of chunk bx / p (p = tile_m / rows), so that a grid
    of whole chunks' parts zeroes every word once, the padding rows of the last chunk too."""
    per_chunk = tile_m // rows
    m_block = bx // per_chunk
    first = (bx % per_chunk) * (rows * head_dim // 4)
    zero = cute.make_rmem_tensor((4,), Float32)
    zero.fill(0.0)
    for s in cutlass.range(cute.size(mdQaccum, mode=[0]), unroll=1):
        quads = cute.logical_divide(mdQaccum[s, batch, head, m_block, None], cute.make_layout(4))
        for j in cutlass.range_constexpr(rows * head_dim // 4 // threads):
            cute.autovec_copy(zero, quads[None, first + j * threads + thread])
