"""The feature axes of the sm90 16-bit backward (templates/bwd_sm90.py.j2): packed sequences, the
local (sliding-window) band, and the views its side kernels need for a packed batch.

Packed sequences. The main kernel reads Q, dO, K and V and writes dK and dV (one query head per kv
head) through the ragged TMA views of :mod:`cutefa.kernels.sm90.varlen` (a sequence's tiles end at
its end: residue rows zero-filled, stores clipped). The workspaces are indexed by chunks like the
sm80 family's tiled dQ accumulator: sequence b's query block m is chunk
``cu_seqlens_q[b] // tile_m + b + m`` of dq_accum (splits, heads_q, total_q // tile_m + batch,
tile_m * head_dim), its key block n chunk ``cu_seqlens_k[b] // tile_n + b + n`` of dkv_accum
(slots, heads_kv, total_k // tile_n + batch, 2 * tile_n * head_dim)
(:func:`cutefa.kernels.sm80.varlen.first_chunk`: no two sequences share a chunk). The dense side
kernels' parts serve a packed batch through views with a batch mode of one
(:func:`~cutefa.kernels.sm80.varlen.unit_mode`) and through :func:`sequence_rows`.

The local band on the transposed score tile (rows are keys, columns queries):
:func:`recompute_pt_local`.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cutefa.kernels.sm90.parts import tma_tiles


def sequence_rows(t: cute.Tensor, offset: Int32, length: Int32) -> cute.Tensor:
    """The rows [offset, offset + length) of a packed (total, heads, head_dim) tensor as a dense
    (1, length, heads, head_dim) tensor (batch 0): the dense side kernels' row loops then stop at
    the sequence's end."""
    shape, stride = t.layout.shape, t.layout.stride
    base = cute.domain_offset((offset, 0, 0), t)
    layout = cute.make_layout((1, length, shape[1], shape[2]), stride=(0, stride[0], stride[1], stride[2]))
    return cute.make_tensor(base.iterator, layout)


@cute.jit
def store_kv_blocks(
    dk_tma, gdK: cute.Tensor, sK: cute.Tensor, dv_tma, gdV: cute.Tensor, sV: cute.Tensor, n_block: Int32,
    tile_n: cutlass.Constexpr, head_dim: cutlass.Constexpr,
):  # fmt: skip
    """:func:`cutefa.kernels.sm90.bwd_parts.store_kv_tiles` on one sequence's (rows, head_dim) TMA
    coordinate tensors of dK and dV (:func:`cutefa.kernels.sm90.varlen.sequence`): the stores are
    clipped at the sequence's end."""
    tdKs, tdKg = tma_tiles(dk_tma, sK, cute.local_tile(gdK, (tile_n, head_dim), (None, 0)))
    tdVs, tdVg = tma_tiles(dv_tma, sV, cute.local_tile(gdV, (tile_n, head_dim), (None, 0)))
    cute.copy(dk_tma, tdKs[None, 0], tdKg[None, n_block])
    cute.copy(dv_tma, tdVs[None, 0], tdVg[None, n_block])
    cute.arch.cp_async_bulk_commit_group()
    cute.arch.cp_async_bulk_wait_group(0, read=True)


def band_limits(m0, key0, seqlen_q, seqlen_k, window_left, window_right):
    """(lo, hi): tile-local key index minus tile-local query index of the band's edges for the
    query block at row ``m0`` and the keys from ``key0``: key ``key0 + r`` is in the band of query
    ``m0 + q`` when ``lo <= r - q <= hi`` (cutefa/api/features.py's rule, bottom-right aligned).
    Int32: no overflow for lengths below 2**29 and bounds up to 1 << 30."""
    shift = m0 + seqlen_k - seqlen_q - key0
    return shift - window_left, shift + window_right


@cute.jit
def recompute_pt_local(
    st_mn: cute.Tensor,
    c_mn: cute.Tensor,
    sLSE: cute.Tensor,
    scale_log2: Float32,
    key_limit: Int32,
    lo: Int32,
    hi: Int32,
    by_column: cutlass.Constexpr = False,
):
    """:func:`cutefa.kernels.sm90.bwd_parts.recompute_pt` with the local band as its mask: S^T ->
    P^T = exp2(S^T * scale_log2 - LSE2[query]) in place, 0 for keys at or past ``key_limit`` and
    outside the band (``lo``/``hi`` from :func:`band_limits`; ``c_mn``: each element's tile-local
    (key, query)). Per key row two bounds on the query offset from the thread's first query q0 are
    set up once (key - lo - q0 and key - hi - q0; none reachable for a key past ``key_limit``), so
    an element costs two compares against its constant column offset and one select."""
    rows = cute.size(st_mn, mode=[0])
    q0 = c_mn[0, 0][1]
    upper = []  # query - q0 <= upper: key - query >= lo
    lower = []  # query - q0 >= lower: key - query <= hi
    for r in cutlass.range_constexpr(rows):
        key = c_mn[r, 0][0]
        upper.append(cutlass.select_(key < key_limit, key - lo - q0, Int32(-(1 << 30))))
        lower.append(key - hi - q0)
    for j in cutlass.range_constexpr(cute.size(st_mn, mode=[1])):
        query = c_mn[0, j][1]
        lse2 = sLSE[j] if cutlass.const_expr(by_column) else sLSE[query]
        for r in cutlass.range_constexpr(rows):
            p = cute.math.exp2(st_mn[r, j] * scale_log2 - lse2, fastmath=True)
            keep = (query - q0 <= upper[r]) & (query - q0 >= lower[r])
            st_mn[r, j] = cutlass.select_(keep, p, Float32(0.0))


@cute.jit
def compute_dst_softcap(
    pt_mn: cute.Tensor,
    dpt_mn: cute.Tensor,
    c_mn: cute.Tensor,
    sD: cute.Tensor,
    sLSE: cute.Tensor,
    scale_log2: Float32,
    by_column: cutlass.Constexpr = False,
    alibi_slope: Float32 = None,
    alibi_diag: Int32 = None,
    c0_mn: cute.Tensor = None,
):
    """:func:`cutefa.kernels.sm90.bwd_parts.compute_dst` with softcap's derivative: dS^T = P^T
    (1 - t^2) (dP^T - D[query]), t = tanh(S * softmax_scale / c) recovered from P itself, so that no
    register holds t or 1 - t^2 across the GEMMs: P = exp2((t + bias) * scale_log2 - LSE2) gives
    t = (log2 P + LSE2) / ``scale_log2`` - bias (``sLSE``: the query block's LSE2 by tile-local
    query, in shared memory; ``scale_log2`` = c log2 e, inverted here: no register holds its
    inverse across the loop). A P of 0 (masked, or below the
    exponent's range) gives dS 0 (1 - t^2 is taken as 0 there and clamped at 0 elsewhere: the log of
    0 and an LSE2 of +inf make no NaN). ALiBi
    (``alibi_slope`` in the fragment's unit c): bias = -slope * |key - query + ``alibi_diag``|
    (tile-local key and query; alibi_diag = key0 - m0 + seqlen_q - seqlen_k; ``c0_mn``: the same view
    for thread 0 of the MMA, compile-time constants: one distance per thread, constants per element).
    ``by_column``: ``sD`` holds the values per column (:func:`cutefa.kernels.sm90.bwd_parts.load_columns`)."""
    inv_scale_log2 = cute.arch.rcp_approx(scale_log2)
    d0 = Float32(0.0)
    if cutlass.const_expr(alibi_slope is not None):
        d0 = Float32(c_mn[0, 0][0] - c_mn[0, 0][1] + alibi_diag)  # this thread's first key and query
    for j in cutlass.range_constexpr(cute.size(dpt_mn, mode=[1])):
        query = c_mn[0, j][1]
        d = sD[j] if cutlass.const_expr(by_column) else sD[query]
        lse2 = sLSE[query]
        for r in cutlass.range_constexpr(cute.size(dpt_mn, mode=[0])):
            p = pt_mn[r, j]
            t = (cute.math.log2(p, fastmath=True) + lse2) * inv_scale_log2
            if cutlass.const_expr(alibi_slope is not None):
                dist = d0 + Float32((c0_mn[r, 0][0] - c0_mn[0, 0][0]) - (c0_mn[0, j][1] - c0_mn[0, 0][1]))
                t = t + alibi_slope * cute.math.absf(dist)
            # P = 0 (masked, a row past seqlen_q or with no key: LSE2 = +inf) gives t = NaN: dS 0
            dtanh = cutlass.select_(p > Float32(0.0), cute.arch.fmax(1.0 - t * t, Float32(0.0)), Float32(0.0))
            dpt_mn[r, j] = p * dtanh * (dpt_mn[r, j] - d)
