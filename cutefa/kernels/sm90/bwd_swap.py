"""Building blocks of the sm90 backward at head dim 192 with dK/dV on WGMMA's M axis
(templates/bwd_sm90_swapkv.py.j2, FlashAttention-3's hd192 partition).

A CTA owns tile_n = 96 keys; consumer warpgroup c owns keys [48 c, 48 c + 48) of them. Per query
block of 64 rows it computes

    S  = Q K_c^T, dP = dO V_c^T        WGMMA 64 queries x 48 keys (M = queries), K-major operands
    P  = exp2(S * scale_log2 - LSE2), dS = P (dP - D)     in registers, per query row
                                       P and dS (16-bit, keys contiguous) -> shared memory
    dV_c^T += dO^T P_c, dK_c^T += Q^T dS_c   WGMMA head_dim x 48 keys (M = head_dim, three 64-row
                                       atoms at 192), both operands MN-major in shared memory
    dQ_c = dS K_c                      WGMMA 64 queries x d/2 columns over all 96 keys

so that 48 keys per warpgroup need no M = 64 key slab: fp32 dK^T + dV^T take 2 x 192 x 48 / 128 =
144 registers per thread. The rest (row staging of LSE2/D, the dQ step, pre/postprocessing) is
the main backward's (bwd_parts.py, bwd_dq.py, bwd_dq_bulk.py, bwd_pre_post.py).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from cutefa.kernels.sm90.bwd_dq import issue_dq
from cutefa.kernels.sm90.bwd_dq_bulk import bulk_wait, stage_and_reduce
from cutefa.kernels.sm90.parts import WG_ROWS


def _tiled(layout_enum, shape, dtype, atom_major: int, stages: int, k_major: bool):
    """``shape`` + (stages,) tiled by the swizzle atom the WGMMA helpers would pick for a major mode
    of ``atom_major`` elements (a warpgroup's part of that mode), major mode first."""
    atom = sm90_utils.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(layout_enum, dtype, atom_major), dtype)
    return cute.tile_to_shape(atom, (*shape, stages), order=(0, 1, 2) if k_major else (1, 0, 2))


def swap_smem_layouts(dtype, tile_m: int, tile_n: int, head_dim: int, stages: int):
    """Swizzled layouts of the swapped-dK/dV backward's shared-memory operands.

    Returns (sK, sKt, sQ, sQt, sP, sPt):
      sK   (tile_n, head_dim, 1)       K and V: K-major B of S = Q K^T and dP = dO V^T
      sKt  (head_dim, tile_n, 1)       the same bytes as K: MN-major B of dQ = dS K
      sQ   (tile_m, head_dim, stages)  Q and dO: K-major A of S and dP
      sQt  (head_dim, tile_m, stages)  the same bytes: MN-major A of dK^T = Q^T dS and dV^T = dO^T P
      sP   (tile_m, tile_n, 2)         P or dS, keys contiguous: K-major A of dQ (two buffers)
      sPt  (tile_n, tile_m, 2)         the same bytes: MN-major B of dK^T and dV^T

    The head-dim atom is chosen for d/2 columns (64-byte at 192) so that each consumer's dQ columns
    of K^T start on an atom panel; the key atom for tile_n/2 keys (32-byte at 96 keys) so that each
    consumer's keys of P^T and dS^T do."""
    half, keys = head_dim // 2, tile_n // 2
    row, col = utils.LayoutEnum.ROW_MAJOR, utils.LayoutEnum.COL_MAJOR
    sk = _tiled(row, (tile_n, head_dim), dtype, half, 1, True)
    skt = _tiled(col, (head_dim, tile_n), dtype, half, 1, False)
    sq = _tiled(row, (tile_m, head_dim), dtype, half, stages, True)
    sqt = _tiled(col, (head_dim, tile_m), dtype, half, stages, False)
    sp = _tiled(row, (tile_m, tile_n), dtype, keys, 2, True)
    spt = _tiled(col, (tile_n, tile_m), dtype, keys, 2, False)
    return sk, skt, sq, sqt, sp, spt


def swap_dkv_tiled_mma(dtype, keys: int):
    """dV^T += dO^T P and dK^T += Q^T dS for one warpgroup: head_dim (M, 64 per atom) x ``keys``,
    K = the query block; A (dO^T, Q^T) and B (P, dS of this warpgroup's keys) MN-major in smem."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.MN,
        Float32, (1, 1, 1), (WG_ROWS, keys),
    )  # fmt: skip


def swap_dq_tiled_mma(dtype, dq_n: int):
    """dQ = dS K for one warpgroup of the swapped backward: 64 queries x dq_n head-dim columns, A
    (dS, keys contiguous) K-major, B (K^T) MN-major, both in shared memory."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
        Float32, (1, 1, 1), (WG_ROWS, dq_n),
    )  # fmt: skip


@cute.jit
def recompute_p(
    s_mn: cute.Tensor,
    c_mn: cute.Tensor,
    sLSE: cute.Tensor,
    scale_log2: Float32,
    key_limit: Int32,
    diag: Int32,
    masked: cutlass.Constexpr,
    causal: cutlass.Constexpr,
):
    """S -> P in place (rows are queries, columns keys): P = exp2(S * scale_log2 - LSE2[query]).

    ``c_mn`` holds each element's tile-local (query, key). With ``masked``: keys at or past
    ``key_limit`` (tile-local) get P = 0, and with ``causal`` also keys at or past query + ``diag``
    (the bottom-right diagonal, as bwd_parts.recompute_pt). The limit is set once per row."""
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        query = c_mn[r, 0][0]
        lse2 = sLSE[query]
        limit = key_limit
        if cutlass.const_expr(causal):
            limit = cutlass.min(key_limit, query + diag)
        for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            p = cute.math.exp2(s_mn[r, j] * scale_log2 - lse2, fastmath=True)
            if cutlass.const_expr(masked):
                p = cutlass.select_(c_mn[r, j][1] < limit, p, Float32(0.0))
            s_mn[r, j] = p


@cute.jit
def compute_ds(p_mn: cute.Tensor, dp_mn: cute.Tensor, c_mn: cute.Tensor, sD: cute.Tensor):
    """dP -> dS in place (rows are queries): dS = P (dP - D[query]) (the softmax scale comes later)."""
    for r in cutlass.range_constexpr(cute.size(dp_mn, mode=[0])):
        d = sD[c_mn[r, 0][0]]
        for j in cutlass.range_constexpr(cute.size(dp_mn, mode=[1])):
            dp_mn[r, j] = p_mn[r, j] * (dp_mn[r, j] - d)


def dkv_store_atom(dtype):
    """Register -> shared memory copy of 16-bit dK^T/dV^T fragments (head_dim x keys, M = head_dim)
    into K's/V's bytes, keys x head_dim with the head dim contiguous: ``stmatrix`` with transpose
    (four 8x8 matrices per instruction; each stored 16-byte row is 8 head-dim columns of one key)."""
    return cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(True, 4), dtype)


def transposed_rows(t: cute.Tensor) -> cute.Tensor:
    """A (cols, rows) view of a 2-mode (rows, cols) tensor (any memory, dynamic strides)."""
    return cute.make_tensor(
        t.iterator, cute.make_layout((t.shape[1], t.shape[0]), stride=(t.stride[1], t.stride[0]))
    )


@cute.jit
def store_cols(src: cute.Tensor, coords: cute.Tensor, gdst: cute.Tensor, col_limit: Int32):
    """gdst[i] = src[i] for every element whose tile-local column (``coords``) is below ``col_limit``."""
    for i in cutlass.range_constexpr(cute.size(src)):
        if coords[i][1] < col_limit:
            gdst[i] = src[i]


@cute.jit
def dq_bulk_step_in_stage(
    mma: cute.TiledMma,
    t_a: cute.Tensor,
    t_b: cute.Tensor,
    acc_shape: cutlass.Constexpr,
    buf: Int32,
    s_base: Int32,
    g_addr,
    wtid: Int32,
    wg_barrier: Int32,
    consumer_barrier: cutlass.Constexpr,
    consumer_threads: cutlass.Constexpr,
):
    """dQ of the dq_bulk path staged in the current Q/dO stage (no buffer of its own fits): acc =
    dS K (dS buffer ``buf``) behind the warpgroup's dV^T/dK^T WGMMAs; once those are done, a barrier
    of both consumers (each warpgroup's dV^T and dK^T read all of that stage's Q and dO); once dQ is
    done, :func:`stage_and_reduce` stages acc in fragment order (value 4j + e of thread t at word
    4 (128 j + t) + e) at ``s_base`` (this warpgroup's 16-bit tile of the stage: consumer 0 dO's,
    consumer 1 Q's, each exactly the bytes of its fp32 64 x d/2 piece), meets the warpgroup at
    ``wg_barrier``, and one thread (``wtid`` 0) adds the piece into global memory at ``g_addr`` with
    a bulk reduce-add and commits it. It does not wait: the stage goes back to the producer later,
    through :func:`release_stage_after_bulk` (in the next query block, once its S and dP are issued)."""
    acc = issue_dq(mma, t_a, t_b, acc_shape, buf)
    warpgroup.wait_group(1)  # this warpgroup's dV^T, dK^T done
    cute.arch.barrier(barrier_id=consumer_barrier, number_of_threads=consumer_threads)
    warpgroup.wait_group(0)
    stage_and_reduce(acc, s_base, g_addr, wtid, wg_barrier)


@cute.jit
def release_stage_after_bulk(
    pipe, stages: cutlass.Constexpr, index: Int32, wtid: Int32, deterministic: Int32
):
    """Give Q/dO stage ``index`` back to the producer (``pipe``: the ring's PipelineTmaAsync) once
    this warpgroup's bulk reduce-add from it (:func:`dq_bulk_step_in_stage`) has read it
    (deterministic: is complete, so that the next add into the same chunk lands after it). Thread
    ``wtid`` 0 issued the copy and waits; its warp arrives after it, the other warps at once. Called
    one query block later, after that block's S and dP WGMMAs are issued, so the wait runs beside
    them instead of ahead of them."""
    if wtid == 0:
        bulk_wait(deterministic)
    pipe.consumer_release(pipeline.PipelineState(stages, Int32(0), index, Int32(0)))
