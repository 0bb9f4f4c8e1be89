"""Grouped-query dK and dV of the sm90 backward (templates/bwd_sm90*.py.j2): where g > 1 query heads
share a kv head, the CTAs of those heads add their fp32 dK and dV into one fp32 workspace of the kv
head, which a conversion kernel scales, converts and writes as dK and dV (batch, seqlen_k,
heads_kv, head_dim) once.

The workspace, ``dkv_accum`` (slots, batch, heads_kv, key blocks, 2 * tile_n * head_dim) float32
(:func:`cutefa.model.budgets_sm90.sm90_bwd_dkv_accum_shape`): per key block one chunk of dK, then
one of dV, each the consumers' pieces one after the other (the WGMMA accumulator of a consumer
warpgroup: 64 keys x head_dim, 64 keys x head_dim / 2 in the head-dim split, head_dim x 48 keys
transposed in the swapped partition), each in its fragment's order: value 4j + e of consumer
thread t at word 4 (128 j + t) + e (the dq_bulk order, cutefa/kernels/sm90/bwd_dq_bulk.py). So a
consumer adds its piece straight from its registers with 16-byte vector reductions
(``red.global.add.v4.f32``, SASS ``REDG.E.ADD.F32x4``) that a warp issues over 512 contiguous
bytes; no shared memory, no barrier. slots = 1: every head of the group adds into the same chunk
(in any order). Deterministic mode: slots = g, the head of index h in its group adds into slot h
alone, so every word takes exactly one add on zero, and the conversion sums the slots in order.

Three pieces here: :func:`red_add_piece` (the main kernel's end of a key block),
:func:`zero_chunk` (the zeroing kernel before the main kernel) and :func:`gather_piece` +
:func:`store_tile` (the conversion kernel after it: a key block's dK or dV gathered by each
value's coordinates into an fp32 tile in shared memory, 8-byte stores of column pairs where the
piece's fragment holds them, then written row by row with 16-byte shared-memory loads and 8-byte
coalesced global stores).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector
from cutlass.cutlass_dsl import T, dsl_user_op

from cutefa.kernels.common.ptx import effect_asm
from cutefa.kernels.sm80.bwd_parts import WAVE_CTAS, heavy_first
from cutefa.kernels.sm90.bwd_pre_post import bulk_postprocess_values
from cutefa.kernels.sm90.parts import WG_THREADS

VEC = 4  # fp32 words per 16-byte vector reduction, store or load
TILE_PAD = 4  # fp32 words after each row of the conversion tile (16 bytes: rows stay 16-byte aligned)


@dsl_user_op
def _sreg(name: str, *, loc=None, ip=None) -> Int32:
    """The special register ``%name`` (``ctaid.x``, ``nctaid.y``...) read here: a ``mov.u32`` with
    side effects, so that no earlier read of it is kept in a register until this point."""
    return Int32(effect_asm(T.i32(), [], f"mov.u32 $0, %{name};", "=r", loc=loc, ip=ip))


@cute.jit
def chunk_base(
    mdKVaccum: cute.Tensor, group: Int32, n_block: Int32, deterministic: Int32, causal: cutlass.Constexpr,
    cu_seqlens_k: cute.Tensor = None, tile_n: cutlass.Constexpr = 0,
) -> cute.Pointer:
    """The fp32 pointer of key block ``n_block``'s chunks in ``dkv_accum`` for this CTA's query head
    h (a group of ``group`` query heads per kv head): kv head h / group, slot h % group when
    ``deterministic``, else 0. The CTA's query head and batch are read again here from the special
    registers (``causal``: mapped as :func:`~cutefa.kernels.sm80.bwd_parts.causal_launch_coords`
    maps them), at the end of a key block: values of the kernel's prologue used here would live
    through the query loop, and across the producer warpgroup's register cut, in registers (seen:
    one spilled in the producer's 24). A packed batch (``cu_seqlens_k``, keys per block ``tile_n``):
    ``mdKVaccum`` is the (slots, 1, heads_kv, chunks, words) view of its chunked workspace, and the
    sequence's key block ``n_block`` is chunk cu_seqlens_k[batch] // tile_n + batch + n_block
    (cutefa/kernels/sm90/bwd_features.py)."""
    head = _sreg("ctaid.y")
    batch = _sreg("ctaid.z")
    if cutlass.const_expr(causal):
        if deterministic == 0:
            _, head, batch = heavy_first(
                _sreg("ctaid.x"), head, batch, _sreg("nctaid.x"), _sreg("nctaid.y"), _sreg("nctaid.z"), WAVE_CTAS
            )
    kv = head // group
    if cutlass.const_expr(cu_seqlens_k is not None):
        n_block = n_block + cu_seqlens_k[batch] // tile_n + batch
    return mdKVaccum[(head - kv * group) * deterministic, batch, kv, n_block, None].iterator


@cute.jit
def red_add_piece(acc: cute.Tensor, g_piece: cute.Pointer, wtid: Int32):
    """This consumer thread's fragment ``acc`` of a dK or dV piece (fp32) added into the piece at
    ``g_piece`` (fp32, 16-byte aligned) of ``dkv_accum``: values 4j..4j + 3 of thread ``wtid`` at
    words 4 (128 j + wtid), one 16-byte vector reduction each."""
    vec_type = ir.VectorType.get([VEC], Float32.mlir_type)
    base = g_piece + wtid * VEC
    for j in cutlass.range_constexpr(cute.size(acc) // VEC):
        values = vector.from_elements(vec_type, [acc[VEC * j + e].ir_value() for e in range(VEC)])
        cute.arch.red(
            base + j * (WG_THREADS * VEC), values, op="add", dtype=Float32, sem="relaxed", scope="gpu"
        )


@cute.jit
def zero_chunk(
    mdKVaccum: cute.Tensor, batch: Int32, kv: Int32, n_block: Int32, thread: Int32, words: cutlass.Constexpr,
    threads: cutlass.Constexpr,
):  # fmt: skip
    """Zero key block ``n_block``'s ``words`` fp32 words (its dK and dV chunks) of (``batch``,
    ``kv``) in every slot: 16-byte store j * ``threads`` + ``thread`` of each slot."""
    zero = cute.make_rmem_tensor((VEC,), Float32)
    zero.fill(0.0)
    for s in cutlass.range(cute.size(mdKVaccum, mode=[0]), unroll=1):
        vectors = cute.logical_divide(mdKVaccum[s, batch, kv, n_block, None], cute.make_layout(VEC))
        for j in cutlass.range_constexpr(words // VEC // threads):
            cute.autovec_copy(zero, vectors[None, j * threads + thread])


def tile_layout(rows: int, head_dim: int):
    """The conversion kernel's fp32 tile of one key block's dK or dV in shared memory (rows padded
    by :data:`TILE_PAD` words)."""
    return cute.make_layout((rows, head_dim), stride=(head_dim + TILE_PAD, 1))


@cute.jit
def gather_piece(
    mma: cute.TiledMma, shape: cutlass.Constexpr, transposed: cutlass.Constexpr, mdKVaccum: cute.Tensor,
    sTile: cute.Tensor, scale: Float32, batch: Int32, kv: Int32, n_block: Int32, thread: Int32,
    row0: cutlass.Constexpr, col0: cutlass.Constexpr, offset: cutlass.Constexpr,
):  # fmt: skip
    """One consumer's piece of key block ``n_block`` (at word ``offset`` of its chunk), summed over
    the slots in order and scaled, into ``sTile[row0 + key, col0 + column]``: thread ``thread`` (of
    128) reads the values of consumer thread ``thread`` 16 bytes at a time (coalesced). ``mma`` and
    ``shape`` name the piece's accumulator (its partition gives each value's coordinates: (key,
    column), or with ``transposed`` (column, key))."""
    coords = mma.get_slice(thread).partition_C(cute.make_identity_tensor(shape))
    bulk_postprocess_values(
        coords, transposed, mdKVaccum, sTile, scale, batch, kv, n_block, thread, row0, col0, offset, Float32
    )


@cute.jit
def store_tile(
    sTile: cute.Tensor, mdst: cute.Tensor, batch: Int32, kv: Int32, n_block: Int32, thread: Int32,
    rows: cutlass.Constexpr, head_dim: cutlass.Constexpr, threads: cutlass.Constexpr,
):  # fmt: skip
    """The tile's rows below seqlen_k (key block ``n_block`` of ``mdst``, (batch, seqlen_k,
    heads_kv, head_dim), kv head ``kv``) converted to ``mdst``'s dtype and written, 4 columns per
    copy: copy j * ``threads`` + ``thread`` is row it / (d / 4), columns 4 (it % (d / 4)), so that
    consecutive threads read consecutive 16 bytes of the tile and write consecutive 8 bytes of a
    row. The caller has met the CTA at a barrier after the tile was written."""
    per_row = head_dim // VEC
    seqlen_k = mdst.shape[1]
    s_vec = cute.zipped_divide(sTile, (1, VEC))
    g_vec = cute.zipped_divide(mdst[batch, None, kv, None], (1, VEC))
    frag = cute.make_rmem_tensor((1, VEC), Float32)
    out = cute.make_rmem_tensor((1, VEC), mdst.element_type)
    for j in cutlass.range_constexpr(rows * per_row // threads):
        it = j * threads + thread
        row = it // per_row
        col = it % per_row
        if n_block * rows + row < seqlen_k:
            cute.autovec_copy(s_vec[None, (row, col)], frag)
            out.store(frag.load().to(mdst.element_type))
            cute.autovec_copy(out, g_vec[None, (n_block * rows + row, col)])
