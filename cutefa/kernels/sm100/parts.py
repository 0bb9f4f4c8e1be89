"""Building blocks of the sm100-family (FlashAttention-4 design) kernels.

tcgen05 UMMA with accumulators in tensor memory (TMEM), TMA loads, TMEM <-> register copies for
the softmax and correction warpgroups, and an exp2 that runs on the FMA units. Compiled and
SASS-checked on the CPU for sm_100a; not run on hardware.

TMEM map of one CTA (columns; 128 lanes = 128 query rows of a Q tile)::

    S_q  at q * tile_n            fp32 scores of Q tile q (tile_n columns)
      P_q  inside S_q at + tile_n/2   16-bit probabilities (tile_n/2 columns, packed)
      stats_q inside S_q at + 0       (previous max, current max) for the correction warpgroup
    O_q  at q_tiles * tile_n + q * head_dim_v   fp32 output accumulator of Q tile q
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from cutefa.kernels.common.exp2 import exp2_fma

TMEM_COLUMNS = 512  # per SM, 128 lanes x 512 columns x 32 bit
ROWS_PER_Q_TILE = 128  # the M of one UMMA (cta_group::1), one TMEM lane per query row


def tmem_alloc_columns(used: int) -> int:
    """Columns to allocate: a power of two >= 32 covering ``used``."""
    cols = 32
    while cols < used:
        cols *= 2
    return cols


# ---------------------------------------------------------------------------------------------
# Host-side set-up (called inside the @cute.jit launcher)


def tiled_mmas(dtype, tile_n: int, head_dim_v: int):
    """(QK^T MMA: S = Q K^T, both operands K-major in smem; PV MMA: O += P V, P from TMEM, V MN-major)."""
    k_major = tcgen05.OperandMajorMode.K
    qk = sm100_utils.make_trivial_tiled_mma(
        dtype, dtype, k_major, k_major, Float32, tcgen05.CtaGroup.ONE, (ROWS_PER_Q_TILE, tile_n)
    )
    pv = sm100_utils.make_trivial_tiled_mma(
        dtype, dtype, k_major, tcgen05.OperandMajorMode.MN, Float32, tcgen05.CtaGroup.ONE,
        (ROWS_PER_Q_TILE, head_dim_v), tcgen05.OperandSource.TMEM,
    )  # fmt: skip
    return qk, pv


def seq_major_view(t: cute.Tensor) -> cute.Tensor:
    """(batch, seqlen, heads, dim) -> (seqlen, dim, (heads, batch)): the (M|N, K, L) form of TMA/UMMA."""
    lay = t.layout
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            (lay.shape[1], lay.shape[3], (lay.shape[2], lay.shape[0])),
            stride=(lay.stride[1], lay.stride[3], (lay.stride[2], lay.stride[0])),
        ),
    )


def dim_major_view(t: cute.Tensor) -> cute.Tensor:
    """(batch, seqlen, heads, dim) -> (dim, seqlen, (heads, batch)): V as the MN-major B of O += P V."""
    lay = t.layout
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            (lay.shape[3], lay.shape[1], (lay.shape[2], lay.shape[0])),
            stride=(lay.stride[3], lay.stride[1], (lay.stride[2], lay.stride[0])),
        ),
    )


def tma_load_atoms(qk_mma, pv_mma, qk_tiler, pv_tiler, q, k, v, sQ_layout, sK_layout, sV_layout):
    """TMA atoms and coordinate tensors for Q (A of QK), K (B of QK) and V (B of PV). Rows past a
    sequence end are zero-filled by the TMA unit (out-of-bounds boxes)."""
    op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
    one = (1, 1, 1, 1)
    tq = cute.nvgpu.make_tiled_tma_atom_A(op, q, cute.select(sQ_layout, mode=[0, 1, 2]), qk_tiler, qk_mma, one)
    tk = cute.nvgpu.make_tiled_tma_atom_B(op, k, cute.select(sK_layout, mode=[0, 1, 2]), qk_tiler, qk_mma, one)
    tv = cute.nvgpu.make_tiled_tma_atom_B(op, v, cute.select(sV_layout, mode=[0, 1, 2]), pv_tiler, pv_mma, one)
    return tq, tk, tv


def tma_store_atom(o, sO_layout, epi_tile):
    """TMA store of one (128, head_dim_v) output tile; rows past seqlen_q are clipped by the TMA unit."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), o, sO_layout, epi_tile)


# ---------------------------------------------------------------------------------------------
# Device-side helpers


def tma_tiles(atom, mma_slice, s_tensor, g_tensor, tiler_modes, tiler):
    """(smem, gmem) TMA partitions of one operand: gmem tiled by ``tiler`` over ``tiler_modes``."""
    g = cute.flat_divide(g_tensor, cute.select(tiler, mode=tiler_modes))
    if tiler_modes[0] == 0 and tiler_modes[1] == 2:
        part = mma_slice.partition_A(g)
    else:
        part = mma_slice.partition_B(g)
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_tensor, 0, 3), cute.group_modes(part, 0, 3))


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, accumulate):
    """acc (+)= a @ b over every k-block; the first block overwrites unless ``accumulate``.

    The k-blocks after the first run in a rolled loop: unrolled, ptxas hoists one 64-bit shared-
    memory descriptor per k-block and operand out of the caller's mainloop (they are loop-invariant
    for Q), which at the MMA warp's register budget spills them to local memory. Rolled, each
    descriptor is the previous one plus a constant, and one MMA issue per k-block costs a few
    uniform-datapath instructions beside the tensor core's work.

    Returns ``tiled_mma``: its ACCUMULATE field changes here, so a caller inside staged control
    flow rebinds it (``mma = gemm(mma, ...)``) for the tracer to carry it."""
    tiled_mma.set(tcgen05.Field.ACCUMULATE, accumulate)
    cute.gemm(tiled_mma, acc, a[None, None, 0], b[None, None, 0], acc)
    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
    for kb in cutlass.range(1, cute.size(a, mode=[2]), unroll=1):
        cute.gemm(tiled_mma, acc, a[None, None, kb], b[None, None, kb], acc)
    return tiled_mma


def tmem_copy(op, dtype, tmem: cute.Tensor, thread: int):
    """A 32x32b TMEM load or store (``op`` an Ld32x32bOp/St32x32bOp) over a (128, cols) TMEM view,
    sliced for ``thread`` (0..127 of the warpgroup: thread t owns lane/row t)."""
    tiled = tcgen05.make_tmem_copy(cute.make_copy_atom(op, dtype), tmem)
    return tiled, tiled.get_slice(thread)


def tmem_cols(tmem: cute.Tensor, offset: int, cols: int) -> cute.Tensor:
    """Columns [offset, offset + cols) of an accumulator TMEM tensor as a (128, cols) view."""
    t = cute.make_tensor(tmem.iterator + offset, tmem.layout)
    return cute.make_tensor(t.iterator, cute.composition(t.layout, cute.make_layout((ROWS_PER_Q_TILE, cols))))


@cute.jit
def exp2_sum(x: cute.Tensor, scale_log2: Float32, offset: Float32, emu_per_16: cutlass.Constexpr, acc):
    """x[i] = 2**(x[i] * scale_log2 - offset) in place; returns ``acc`` (two packed f32x2 partial
    sums) plus the new values. Of every 16 consecutive elements the last ``emu_per_16`` go to
    :func:`exp2_fma` (FMA pipe), the rest to MUFU.EX2: the two units work in parallel, so the share
    moved off MUFU (16 ex2/clk/SM) shortens the softmax's critical path."""
    acc0, acc1 = acc
    n = cute.size(x)
    for i in cutlass.range_constexpr(0, n, 2):
        x[i], x[i + 1] = cute.arch.fma_packed_f32x2((x[i], x[i + 1]), (scale_log2, scale_log2), (-offset, -offset))
        for j in cutlass.range_constexpr(i, i + 2):
            if cutlass.const_expr(j % 16 >= 16 - emu_per_16):
                x[j] = exp2_fma(x[j])
            else:
                x[j] = cute.math.exp2(x[j], fastmath=True)
        if cutlass.const_expr(i % 4 == 0):
            acc0 = cute.arch.add_packed_f32x2(acc0, (x[i], x[i + 1]))
        else:
            acc1 = cute.arch.add_packed_f32x2(acc1, (x[i], x[i + 1]))
    return acc0, acc1


@cute.jit
def mask_row(s: cute.Tensor, key_limit):
    """-inf for every column >= ``key_limit`` (tile-local key index) of this thread's row."""
    for c in cutlass.range_constexpr(cute.size(s)):
        s[c] = Float32(cutlass.select_(key_limit > c, s[c], -Float32.inf))


@cute.jit
def scale_tmem_rows(tO: cute.Tensor, factor: Float32, cols: cutlass.Constexpr, chunk: cutlass.Constexpr, thread):
    """Multiply this thread's row of the (128, cols) TMEM accumulator ``tO`` by ``factor``,
    ``chunk`` columns at a time (TMEM -> registers -> TMEM)."""
    ld, ld_thr = tmem_copy(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(chunk)), Float32, tmem_cols(tO, 0, chunk), thread)
    st, st_thr = tmem_copy(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(chunk)), Float32, tmem_cols(tO, 0, chunk), thread)
    for i in cutlass.range_constexpr(cols // chunk):
        src = ld_thr.partition_S(tmem_cols(tO, i * chunk, chunk))
        dst = st_thr.partition_D(tmem_cols(tO, i * chunk, chunk))
        r = cute.make_rmem_tensor(ld_thr.partition_D(cute.make_identity_tensor((ROWS_PER_Q_TILE, chunk))).shape, Float32)
        cute.copy(ld, src, r)
        for j in cutlass.range_constexpr(0, cute.size(r), 2):
            r[j], r[j + 1] = cute.arch.mul_packed_f32x2((r[j], r[j + 1]), (factor, factor))
        cute.copy(st, r, dst)


@dsl_user_op
def tcgen05_fence(kind: str, *, loc=None, ip=None) -> None:
    """``tcgen05.fence::before_thread_sync`` (kind "before") or ``::after_thread_sync`` ("after"):
    orders this thread's tcgen05 operations (UMMA issue, TMEM loads) against a thread
    synchronisation (bar.sync), as the PTX memory model asks of tcgen05 work handed across it."""
    llvm.inline_asm(
        res=None,
        operands_=[],
        asm_string=f"tcgen05.fence::{kind}_thread_sync;",
        constraints="~{memory}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
