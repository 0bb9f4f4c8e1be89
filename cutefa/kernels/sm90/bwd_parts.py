"""Building blocks of the sm90-family (FlashAttention-3 design) backward kernels.

The main kernel (templates/bwd_sm90.py.j2) owns TILE_N keys of one (batch, query head); each of
its two consumer warpgroups owns 64 of those keys and computes, per query block of TILE_M rows,

    S^T  = K Q^T, dP^T = V dO^T          WGMMA, both operands K-major in shared memory
    P^T  = exp2(S^T * scale_log2 - LSE2), dS^T = P^T (dP^T - D)      in registers, per key row
    dV  += P^T dO, dK += dS^T Q         WGMMA, A (P^T, dS^T) from registers, B MN-major in smem
    dQ   = dS K                         WGMMA, dS (written by both warpgroups) and K from smem; each
                                        warpgroup one piece (bwd_dq.py)

The shared-memory buffers are allocated once and read through two layouts where two WGMMAs use
them in different roles (Q and dO: K-major B of S^T/dP^T and MN-major B of dK/dV; K: K-major A of
S^T and MN-major B of dQ). Both layouts come from the same swizzle atom (128-byte; 64-byte for
head_dim 96) tiled over the major mode first, so they address the same bytes (:func:`smem_layouts`;
tests/test_compile_sm90_bwd.py checks every element).

This module: the layouts and tiled MMAs, the staging of the per-row values (LSE2, D), P^T and dS^T
in registers, the dK/dV store. The dQ step per dQ path: bwd_dq.py; the dq_bulk staging and bulk
reduce-add: bwd_dq_bulk.py; the dQ-writer warp: bwd_dq_writer.py; the preprocess and postprocess
kernels' parts: bwd_pre_post.py (and the sm80 family's row helpers, cutefa/kernels/sm80/bwd_parts.py).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from cutefa.kernels.sm80.bwd_parts import (  # noqa: F401 (the templates')
    causal_launch_coords,
    pin_words,
)
from cutefa.kernels.sm90.parts import WG_ROWS, tma_tiles


def smem_layouts(dtype, tile_m: int, tile_n: int, head_dim: int, stages: int):
    """Swizzled layouts of the backward's shared-memory operands.

    Returns (sK, sKt, sQ, sQt, sdS):
      sK   (tile_n, head_dim, 1)       K and V: K-major A of S^T = K Q^T and dP^T = V dO^T
      sKt  (head_dim, tile_n, 1)       the same bytes as K: MN-major B of dQ = dS K
      sQ   (tile_m, head_dim, stages)  Q and dO: K-major B of S^T and dP^T
      sQt  (head_dim, tile_m, stages)  the same bytes: MN-major B of dK = dS^T Q and dV = P^T dO
      sdS  (tile_m, tile_n, 2)         dS, queries contiguous: MN-major A of dQ (two buffers)
    """
    row, col = utils.LayoutEnum.ROW_MAJOR, utils.LayoutEnum.COL_MAJOR
    sk = sm90_utils.make_smem_layout_a(row, (tile_n, WG_ROWS, head_dim), dtype, 1)
    skt = sm90_utils.make_smem_layout_b(col, (WG_ROWS, head_dim, tile_n), dtype, 1)
    sq = sm90_utils.make_smem_layout_b(row, (WG_ROWS, tile_m, head_dim), dtype, stages)
    sqt = sm90_utils.make_smem_layout_b(col, (WG_ROWS, head_dim, tile_m), dtype, stages)
    sds = sm90_utils.make_smem_layout_a(col, (tile_m, WG_ROWS, tile_n), dtype, 2)
    return sk, skt, sq, sqt, sds


def sdp_tiled_mma(dtype, tile_m: int):
    """S^T = K Q^T and dP^T = V dO^T for one warpgroup: 64 keys x tile_m queries, K-major operands."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
        Float32, (1, 1, 1), (WG_ROWS, tile_m),
    )  # fmt: skip


def dkv_tiled_mma(dtype, head_dim: int):
    """dV += P^T dO and dK += dS^T Q for one warpgroup: 64 keys x head_dim, A from registers,
    B (dO^T, Q^T) MN-major in shared memory."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
        Float32, (1, 1, 1), (WG_ROWS, head_dim), warpgroup.OperandSource.RMEM,
    )  # fmt: skip


def dq_tiled_mma(dtype, dq_n: int):
    """dQ = dS K for one warpgroup: 64 queries x dq_n head-dim columns, both operands MN-major."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.MN,
        Float32, (1, 1, 1), (WG_ROWS, dq_n),
    )  # fmt: skip


def same_bytes(s: cute.Tensor, layout) -> cute.Tensor:
    """``s``'s shared memory read through another swizzled (composed) layout."""
    return cute.make_tensor(cute.recast_ptr(s.iterator, layout.inner), layout.outer)


def element_swizzled(layout, dtype):
    """``layout`` (a composed layout from ``smem_layouts``, whose swizzle acts on byte addresses: it
    goes into the pointer) with its swizzle restated on element offsets, for a tensor over an
    aligned pointer to the same bytes (the swizzle's base bits drop by log2 of the element size)."""
    sw = layout.inner
    base = sw.num_base - (dtype.width // 8).bit_length() + 1
    return cute.make_composed_layout(cute.make_swizzle(sw.num_bits, base, sw.num_shift), 0, layout.outer)


def transposed(s: cute.Tensor, rows: int, cols: int) -> cute.Tensor:
    """A (cols, rows) view of a (rows, cols) shared-memory tensor."""
    return cute.composition(s, cute.make_layout((cols, rows), stride=(rows, 1)))


@cute.jit
def load_row_value(
    lse2_row: cute.Tensor,
    dpsum_row: cute.Tensor,
    row0: Int32,
    seqlen_q: Int32,
    thread: Int32,
    tile_m: cutlass.Constexpr,
) -> Float32:
    """The value consumer thread ``thread`` (of 256) stages for the query block at ``row0``:
    threads [0, tile_m) the log2 LSE of row row0 + thread (+inf past seqlen_q, so that P is 0
    there), threads [128, 128 + tile_m) D of row row0 + thread - 128 (0 past seqlen_q)."""
    val = Float32(0.0)
    if thread < tile_m:
        val = Float32.inf
        if row0 + thread < seqlen_q:
            val = lse2_row[row0 + thread]
    elif thread >= 128 and thread < 128 + tile_m and row0 + thread - 128 < seqlen_q:
        val = dpsum_row[row0 + thread - 128]
    return val


@cute.jit
def store_row_value(
    sLSE: cute.Tensor, sD: cute.Tensor, val: Float32, thread: Int32, tile_m: cutlass.Constexpr
):
    """Shared-memory half of :func:`load_row_value`: ``val`` into sLSE or sD (one buffer each)."""
    if thread < tile_m:
        sLSE[thread] = val
    elif thread >= 128 and thread < 128 + tile_m:
        sD[thread - 128] = val


@cute.jit
def row_slot(
    lse2_row: cute.Tensor, dpsum_row: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor, thread: Int32,
    tile_m: cutlass.Constexpr,
):  # fmt: skip
    """Set-up of :func:`load_row_slot` / :func:`store_row_slot`, once per kernel (the same rows as
    :func:`load_row_value` / :func:`store_row_value` without their per-block thread tests and
    tensor indexing): consumer thread ``thread`` (of 256) stages row ``thread`` of the log2 LSE
    (threads [0, tile_m)) or row ``thread - 128`` of D (threads [128, 128 + tile_m)).

    Returns (global address of the thread's row array, its shared-memory address in buffer 0
    (``sLSE`` / ``sD`` as (tile_m, 2) with the buffers tile_m words apart), the row offset, the value
    of rows past seqlen_q, whether the thread stages a row at all)."""
    g_addr = lse2_row.iterator.toint()
    s_addr = sLSE.iterator.toint()
    offset = thread
    fill = Float32.inf
    if thread >= 128:
        g_addr = dpsum_row.iterator.toint()
        s_addr = sD.iterator.toint()
        offset = thread - 128
        fill = Float32(0.0)
    return g_addr, s_addr + offset * 4, offset, fill, offset < tile_m


@cute.jit
def load_row_slot(g_addr, offset: Int32, fill: Float32, active, row0: Int32, seqlen_q: Int32) -> Float32:
    """:func:`load_row_value` from :func:`row_slot`'s set-up: the thread's value for the query block
    at ``row0`` (``fill`` past seqlen_q, and for threads that stage nothing)."""
    val = fill
    row = row0 + offset
    if active and row < seqlen_q:
        src = cute.make_ptr(Float32, g_addr + cutlass.Int64(row) * 4, cute.AddressSpace.gmem, assumed_align=4)
        val = cute.make_tensor(src, cute.make_layout(1))[0]
    return val


@cute.jit
def store_row_slot(s_addr: Int32, active, val: Float32, buf, tile_m: cutlass.Constexpr):
    """:func:`store_row_value` from :func:`row_slot`'s set-up: ``val`` into buffer ``buf``."""
    if active:
        dst = cute.make_ptr(Float32, s_addr + buf * (tile_m * 4), cute.AddressSpace.smem, assumed_align=4)
        cute.make_tensor(dst, cute.make_layout(1))[0] = val


# A causal row bound that no tile-local query offset exceeds (the key is past key_limit).
MASK_NONE = 1 << 30


@cute.jit
def load_columns(s_rows: cute.Tensor, c_mn: cute.Tensor, dst: cute.Tensor):
    """dst[j] = s_rows[query of column j] for each of this thread's query columns (``c_mn``: the
    tile-local (key, query) of each accumulator element): a query block's LSE2 or D values, read
    from shared memory into registers ahead of the WGMMA wait they would otherwise follow."""
    for j in cutlass.range_constexpr(cute.size(c_mn, mode=[1])):
        dst[j] = s_rows[c_mn[0, j][1]]


@cute.jit
def recompute_pt(
    st_mn: cute.Tensor,
    c_mn: cute.Tensor,
    sLSE: cute.Tensor,
    scale_log2: Float32,
    key_limit: Int32,
    diag: Int32,
    masked: cutlass.Constexpr,
    causal: cutlass.Constexpr,
    by_column: cutlass.Constexpr = False,
):
    """S^T -> P^T in place (rows are keys, columns queries): P = exp2(S * scale_log2 - LSE2[query]).

    ``c_mn`` holds each element's tile-local (key, query). With ``masked``: keys at or past
    ``key_limit`` (tile-local) get P = 0, and with ``causal`` also keys past query + ``diag``
    (tile-local key index minus tile-local query index allowed by the bottom-right diagonal).

    The mask is set up once per row (key): whether the key is below ``key_limit``, and (causal)
    the bound that a query must exceed, relative to the thread's first query q0: key - diag - q0
    for keys below ``key_limit``, else one no query offset reaches. Each element then costs one
    compare against its constant column offset and one select (key < min(key_limit, query + diag)
    <=> key < key_limit and key - diag - q0 < query - q0: the same elements as an element-wise
    limit). ``by_column``: ``sLSE`` holds the values per column (:func:`load_columns`), not per
    tile-local query."""
    rows = cute.size(st_mn, mode=[0])
    q0 = c_mn[0, 0][1]
    row_ok = []
    row_bound = []
    if cutlass.const_expr(masked):
        for r in cutlass.range_constexpr(rows):
            key = c_mn[r, 0][0]
            if cutlass.const_expr(causal):
                row_bound.append(cutlass.select_(key < key_limit, key - diag - q0, Int32(MASK_NONE)))
            else:
                row_ok.append(key < key_limit)
    for j in cutlass.range_constexpr(cute.size(st_mn, mode=[1])):
        query = c_mn[0, j][1]
        lse2 = sLSE[j] if cutlass.const_expr(by_column) else sLSE[query]
        for r in cutlass.range_constexpr(rows):
            p = cute.math.exp2(st_mn[r, j] * scale_log2 - lse2, fastmath=True)
            if cutlass.const_expr(masked):
                if cutlass.const_expr(causal):
                    p = cutlass.select_(row_bound[r] < query - q0, p, Float32(0.0))
                else:
                    p = cutlass.select_(row_ok[r], p, Float32(0.0))
            st_mn[r, j] = p


@cute.jit
def compute_dst(
    pt_mn: cute.Tensor, dpt_mn: cute.Tensor, c_mn: cute.Tensor, sD: cute.Tensor, by_column: cutlass.Constexpr = False
):
    """dP^T -> dS^T in place: dS = P (dP - D[query]) (the softmax scale is applied later).
    ``by_column``: ``sD`` holds the values per column (:func:`load_columns`)."""
    for j in cutlass.range_constexpr(cute.size(dpt_mn, mode=[1])):
        d = sD[j] if cutlass.const_expr(by_column) else sD[c_mn[0, j][1]]
        for r in cutlass.range_constexpr(cute.size(dpt_mn, mode=[0])):
            dpt_mn[r, j] = pt_mn[r, j] * (dpt_mn[r, j] - d)


@cute.jit
def store_kv_tiles(
    dk_tma, gdK_tma: cute.Tensor, sK: cute.Tensor, dv_tma, gdV_tma: cute.Tensor, sV: cute.Tensor,
    head: Int32, batch: Int32, n_block: Int32, tile_n: cutlass.Constexpr, head_dim: cutlass.Constexpr,
):
    """The producer warp: key block ``n_block``'s dK and dV tiles (staged in the K and V buffers)
    to global memory by two TMA stores (rows past seqlen_k clipped by the TMA unit), waiting until
    both have read shared memory, so that the buffers may be loaded again."""
    tdKs, tdKg = tma_tiles(dk_tma, sK, cute.local_tile(gdK_tma[None, None, head, batch], (tile_n, head_dim), (None, 0)))
    tdVs, tdVg = tma_tiles(dv_tma, sV, cute.local_tile(gdV_tma[None, None, head, batch], (tile_n, head_dim), (None, 0)))
    cute.copy(dk_tma, tdKs[None, 0], tdKg[None, n_block])
    cute.copy(dv_tma, tdVs[None, 0], tdVg[None, n_block])
    cute.arch.cp_async_bulk_commit_group()
    cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def store_rows(src: cute.Tensor, coords: cute.Tensor, gdst: cute.Tensor, row_limit: Int32):
    """gdst[i] = src[i] for every element whose tile-local row (``coords``) is below ``row_limit``."""
    for i in cutlass.range_constexpr(cute.size(src)):
        if coords[i][0] < row_limit:
            gdst[i] = src[i]


# --- Head-dim split (templates/bwd_sm90_hsplit.py.j2, head dims 192 and 256) -----------------------
# The two consumer warpgroups share the CTA's 64 keys. Per query block of 64 rows, warpgroup c
# computes S^T and dP^T for its 32 queries (64 keys x 32), writes P^T and dS^T to shared memory, and
# after a barrier accumulates dV and dK for columns [c d/2, (c+1) d/2) over all 64 queries (A from
# shared memory) and forms the same columns of dQ = dS K.


def _tiled_smem(layout_enum, shape, dtype, atom_major: int, stages: int, k_major: bool):
    """``shape`` + (stages,) tiled by the swizzle atom the WGMMA helpers would pick for a major
    mode of ``atom_major`` elements (a warpgroup's half of the head dim), in the helpers' order."""
    atom = sm90_utils.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(layout_enum, dtype, atom_major), dtype)
    return cute.tile_to_shape(atom, (*shape, stages), order=(0, 1, 2) if k_major else (1, 0, 2))


def split_smem_layouts(dtype, tile_m: int, tile_n: int, head_dim: int, stages: int):
    """Swizzled layouts of the head-dim split's shared-memory operands.

    Returns (sK, sKt, sQ, sQt, sdS, sdSt):
      sK   (tile_n, head_dim, 1)       K and V: K-major A of S^T = K Q^T and dP^T = V dO^T
      sKt  (head_dim, tile_n, 1)       the same bytes as K: MN-major B of dQ = dS K
      sQ   (tile_m, head_dim, stages)  Q and dO: K-major B of S^T and dP^T
      sQt  (head_dim, tile_m, stages)  the same bytes: MN-major B of dK = dS^T Q and dV = P^T dO
      sdS  (tile_m, tile_n, 2)         dS, queries contiguous: MN-major A of dQ (two buffers)
      sdSt (tile_n, tile_m, 2)         the same bytes as dS: K-major A of dK (P^T's buffers too)

    The head-dim swizzle atom is chosen for d/2 columns (128-byte at 256, 64-byte at 192), so that
    each warpgroup's half of the head dim starts on an atom boundary of K^T, Q^T and dO^T."""
    half = head_dim // 2
    row, col = utils.LayoutEnum.ROW_MAJOR, utils.LayoutEnum.COL_MAJOR
    sk = _tiled_smem(row, (tile_n, head_dim), dtype, half, 1, True)
    skt = _tiled_smem(col, (head_dim, tile_n), dtype, half, 1, False)
    sq = _tiled_smem(row, (tile_m, head_dim), dtype, half, stages, True)
    sqt = _tiled_smem(col, (head_dim, tile_m), dtype, half, stages, False)
    sds = sm90_utils.make_smem_layout_a(col, (tile_m, WG_ROWS, tile_n), dtype, 2)
    sdst = sm90_utils.make_smem_layout_a(row, (tile_n, WG_ROWS, tile_m), dtype, 2)
    return sk, skt, sq, sqt, sds, sdst


def split_dkv_tiled_mma(dtype, half: int):
    """dV += P^T dO and dK += dS^T Q for one warpgroup of the head-dim split: 64 keys x d/2
    columns, A (P^T, dS^T) K-major and B (dO^T, Q^T) MN-major, both in shared memory."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
        Float32, (1, 1, 1), (WG_ROWS, half),
    )  # fmt: skip
