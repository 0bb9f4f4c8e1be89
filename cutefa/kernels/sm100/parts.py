"""Building blocks of the sm100-family (FlashAttention-4 design) kernels.

tcgen05 UMMA with accumulators in tensor memory (TMEM), TMA loads, TMEM <-> register copies for
the softmax and correction warpgroups, and an exp2 that runs on the FMA units. Compiled and
SASS-checked on the CPU for sm_100a; not run on hardware.

TMEM map of one CTA (columns; 128 lanes = 128 query rows of a Q tile)::

    S_q  at q * tile_n            fp32 scores of Q tile q (tile_n columns)
      P_q  inside S_q at + tile_n/2   16-bit probabilities (tile_n/2 columns, 2 per column;
                                      e4m3 variants: tile_n/4 columns, 4 per column)
      stats_q inside S_q at + 0       (previous max, current max) for the correction warpgroup
    O_q  at q_tiles * tile_n + q * head_dim_v   fp32 output accumulator of Q tile q

CTA pair (``cta_pair``, tcgen05 cta_group::2): the two CTAs of a (2, 1, 1) cluster share each UMMA
(M = 256, issued by the leader, cluster rank 0). Each CTA keeps its own 128 rows of every Q tile in
shared memory and its own S, P and O in its TMEM (the map above, at the same addresses in both
CTAs), and loads half of every K tile (tile_n / 2 keys) and half of every V tile (head_dim_v / 2
columns); the MMA reads both halves across the pair.
"""

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.cutlass_dsl import dsl_user_op

from cutefa.kernels.common.exp2 import exp2_fma
from cutefa.kernels.common.ptx import effect_asm

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


def cta_group(ctas: int):
    """tcgen05 CTA group of a UMMA spread over ``ctas`` (1 or 2) CTAs."""
    return tcgen05.CtaGroup.TWO if ctas == 2 else tcgen05.CtaGroup.ONE


def tiled_mmas(dtype, tile_n: int, head_dim_v: int, ctas: int = 1):
    """(QK^T MMA: S = Q K^T, both operands K-major in smem; PV MMA: O += P V, P from TMEM, V MN-major).
    ``ctas`` = 2: 2-SM UMMAs (cta_group::2) of M = 256, 128 rows in each CTA of the pair. An e4m3
    ``dtype`` gives kind::f8f6f4 UMMAs (k = 32), which take an 8-bit MN-major V as well."""
    k_major = tcgen05.OperandMajorMode.K
    group = cta_group(ctas)
    qk = sm100_utils.make_trivial_tiled_mma(
        dtype, dtype, k_major, k_major, Float32, group, (ROWS_PER_Q_TILE * ctas, tile_n)
    )
    pv = sm100_utils.make_trivial_tiled_mma(
        dtype, dtype, k_major, tcgen05.OperandMajorMode.MN, Float32, group,
        (ROWS_PER_Q_TILE * ctas, head_dim_v), tcgen05.OperandSource.TMEM,
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


def tma_load_atoms(qk_mma, pv_mma, qk_tiler, pv_tiler, q, k, v, sQ_layout, sK_layout, sV_layout, ctas: int = 1):
    """TMA atoms and coordinate tensors for Q (A of QK), K (B of QK) and V (B of PV). Rows past a
    sequence end are zero-filled by the TMA unit (out-of-bounds boxes). ``ctas`` = 2: 2-SM loads
    (each CTA fills its own half of the operand and signals the leader CTA's barrier)."""
    op = cpasync.CopyBulkTensorTileG2SOp(cta_group(ctas))
    cluster = (ctas, 1, 1, 1)
    tq = cute.nvgpu.make_tiled_tma_atom_A(op, q, cute.select(sQ_layout, mode=[0, 1, 2]), qk_tiler, qk_mma, cluster)
    tk = cute.nvgpu.make_tiled_tma_atom_B(op, k, cute.select(sK_layout, mode=[0, 1, 2]), qk_tiler, qk_mma, cluster)
    tv = cute.nvgpu.make_tiled_tma_atom_B(op, v, cute.select(sV_layout, mode=[0, 1, 2]), pv_tiler, pv_mma, cluster)
    return tq, tk, tv


def tma_store_atom(o, sO_layout, epi_tile):
    """TMA store of one (128, head_dim_v) output tile; rows past seqlen_q are clipped by the TMA unit."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), o, sO_layout, epi_tile)


# ---------------------------------------------------------------------------------------------
# Device-side helpers

PAIR_BOTH_CTAS = 0b11  # multicast mask of the (2, 1, 1) cluster: both CTAs of the pair
PAIR_LEADER = 0  # cluster rank of the CTA that issues the pair's UMMAs


@dataclasses.dataclass(frozen=True)
class PairUmmaAsync(pipeline.PipelineUmmaAsync):
    """An UMMA -> threads pipeline of a CTA pair whose consumers (softmax or correction threads of
    either CTA) release a TMEM buffer by arriving on the leader CTA's barrier with a cluster-scope
    release: what they did to their CTA's TMEM (S read, P written, O rescaled) is handed to the
    leader's next UMMA, a cross-CTA handoff (the DSL's remote arrive defaults to CTA scope). The
    tcgen05 fences around that thread synchronisation order the TMEM loads/stores before it and
    the leader's UMMAs after it, as the PTX memory model asks of tcgen05 work handed across one."""

    @dsl_user_op
    def consumer_release(self, state, *, loc=None, ip=None) -> None:
        tcgen05_fence("before", loc=loc, ip=ip)
        arrive_cluster(self.sync_object_empty.get_barrier(state.index, loc=loc, ip=ip), PAIR_LEADER, loc=loc, ip=ip)

    @dsl_user_op
    def producer_acquire(self, state, try_acquire_token=None, *, loc=None, ip=None) -> None:
        super().producer_acquire(state, try_acquire_token, loc=loc, ip=ip)
        tcgen05_fence("after", loc=loc, ip=ip)


@dsl_user_op
def arrive_cluster(mbar, cta_rank, *, loc=None, ip=None) -> None:
    """Arrive on the mbarrier at ``mbar``'s offset in CTA ``cta_rank`` of the cluster, with a
    cluster-scope release (orders this thread's earlier work before the other CTA's waiter)."""
    cute.arch.mbarrier_arrive(mbar, cta_rank, scope=nvvm.MemScopeKind.CLUSTER, loc=loc, ip=ip)


def pair_targets(pipe):
    """``pipe`` (created with the pair's cluster layout) with its arrival targets as constants:
    UMMA commits multicast to both CTAs, thread arrivals go to the leader (cluster-scoped, see
    :class:`PairUmmaAsync`). The DSL derives the targets from the cluster rank at creation, before
    the warp-role split, where they would stay live in a register through every role (and spill in
    the 80-register correction warps); for a (2, 1, 1) cluster they are the constants above."""
    if isinstance(pipe, pipeline.PipelineTmaUmma):
        return dataclasses.replace(pipe, consumer_mask=PAIR_BOTH_CTAS)
    if isinstance(pipe, pipeline.PipelineUmmaAsync):
        fields = {f.name: getattr(pipe, f.name) for f in dataclasses.fields(pipe)}
        return PairUmmaAsync(**{**fields, "producer_mask": PAIR_BOTH_CTAS, "consumer_mask": PAIR_LEADER})
    raise TypeError(f"pair_targets: no pair arrival targets for {type(pipe).__name__}")


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
    effect_asm(None, [], f"tcgen05.fence::{kind}_thread_sync;", "~{memory}", loc=loc, ip=ip)
