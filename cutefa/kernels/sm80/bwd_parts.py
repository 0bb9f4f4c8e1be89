"""Building blocks of the sm80-family (FlashAttention-2 design) backward kernels.

The backward runs three kernels: a preprocess over query rows (D = rowsum(dO * O) - dLSE, the LSE
in log2 units, the fp32 dQ accumulator cleared), the main kernel over key blocks (P recomputed from
Q, K and the LSE; dK and dV accumulated in registers; dQ added into the fp32 accumulator), and a
postprocess over query rows (dQ = softmax_scale * sum of the accumulator's splits, in the input
dtype). The row kernels use one warp per query row, each lane owning the columns lane + 32 * j.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp
from cutlass.cutlass_dsl import BaseDSL

from cutefa.kernels.common.reduce import red_add_pairs
from cutefa.kernels.common.softmax import LOG2_E


def tiled_mma(dtype, warps_m: int, warps_n: int):
    """mma.sync m16n8k16 with a (warps_m, warps_n) warp grid; every warp owns 16-row slabs and
    16-column pairs of n8 atoms, so that one ldmatrix.x4 feeds two n8 atoms of B."""
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)),
        (warps_m, warps_n, 1),
        permutation_mnk=(warps_m * 16, warps_n * 16, 16),
    )


def warp_grid(rows: int, cols: int, warps: int) -> tuple[int, int]:
    """Warp grid of a (rows, cols) GEMM output: (warps/2, 2), or (2, warps/2) where that is valid
    (16-row and 16-column slabs per warp) and each warp then reads fewer operand rows and columns
    from shared memory (rows / 2 + cols / (warps/2) < rows / (warps/2) + cols / 2): per k-step a
    warp loads its A rows and its B columns, so squarer warp tiles read less."""
    tall, wide = (warps // 2, 2), (2, warps // 2)
    if rows % (16 * wide[0]) or cols % (16 * wide[1]):
        return tall
    if rows // wide[0] + cols // wide[1] < rows // tall[0] + cols // tall[1]:
        return wide
    return tall


def ldmatrix_copies(dtype, mma):
    """ldmatrix tiled copies (A, A transposed, B, B transposed) for ``mma``.

    The transposed ones read operands whose M (or N) mode is the contiguous one in shared memory:
    P^T, dS^T as A of dV/dK; dO^T, Q^T, K^T as B of dV/dK/dQ."""
    ld = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    ld_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), dtype)
    return (
        cute.make_tiled_copy_A(ld, mma),
        cute.make_tiled_copy_A(ld_t, mma),
        cute.make_tiled_copy_B(ld, mma),
        cute.make_tiled_copy_B(ld_t, mma),
    )


def transposed(s: cute.Tensor, rows: int, cols: int) -> cute.Tensor:
    """A (cols, rows) view of a (rows, cols) shared-memory tensor."""
    return cute.composition(s, cute.make_layout((cols, rows), stride=(rows, 1)))


@cute.jit
def warp_allreduce_sum(val: Float32) -> Float32:
    for i in cutlass.range_constexpr(5):
        val = val + cute.arch.shuffle_sync_bfly(val, offset=16 >> i)
    return val


@cute.jit
def preprocess_row(
    mO: cute.Tensor,
    mdO: cute.Tensor,
    mLSE: cute.Tensor,
    mdLSE: cute.Tensor,
    mLSE2: cute.Tensor,
    mDpsum: cute.Tensor,
    mdQaccum: cute.Tensor,
    batch: Int32,
    head: Int32,
    row: Int32,
    lane: Int32,
    head_dim: cutlass.Constexpr,
    zero_accum: cutlass.Constexpr = True,
):
    """One query row, one warp: D = rowsum(dO * O) - dLSE, LSE * log2(e) (+inf for a row that
    attends no key, so that its probabilities recompute to 0), and the row of every dQ split zeroed
    (``zero_accum``; a workspace of another layout, zeroed by the caller, passes False)."""
    acc = Float32(0.0)
    for j in cutlass.range_constexpr(head_dim // 32):
        col = lane + 32 * j
        acc = acc + Float32(mdO[batch, row, head, col]) * Float32(mO[batch, row, head, col])
    acc = warp_allreduce_sum(acc)
    if lane == 0:
        lse = mLSE[batch, head, row]
        mDpsum[batch, head, row] = acc - mdLSE[batch, head, row]
        mLSE2[batch, head, row] = Float32.inf if lse == -Float32.inf else lse * LOG2_E
    if cutlass.const_expr(zero_accum):
        zero_accum_row(mdQaccum, batch, head, row, lane, head_dim)


@cute.jit
def zero_accum_row(
    mdQaccum: cute.Tensor, batch: Int32, head: Int32, row: Int32, lane: Int32, head_dim: cutlass.Constexpr
):
    """One query row, one warp: the row of every split of the (splits, batch, seqlen_q, heads,
    head_dim) dQ accumulator zeroed."""
    for s in cutlass.range(cute.size(mdQaccum, mode=[0]), unroll=1):
        for j in cutlass.range_constexpr(head_dim // 32):
            mdQaccum[s, batch, row, head, lane + 32 * j] = Float32(0.0)


@cute.jit
def postprocess_row(
    mdQaccum: cute.Tensor,
    mdQ: cute.Tensor,
    scale: Float32,
    batch: Int32,
    head: Int32,
    row: Int32,
    lane: Int32,
    head_dim: cutlass.Constexpr,
    dtype: cutlass.Constexpr,
):
    """One query row, one warp: dQ = scale * (sum of the splits, in split order), in ``dtype``."""
    for j in cutlass.range_constexpr(head_dim // 32):
        col = lane + 32 * j
        acc = Float32(0.0)
        for s in cutlass.range(cute.size(mdQaccum, mode=[0]), unroll=1):
            acc = acc + mdQaccum[s, batch, row, head, col]
        mdQ[batch, row, head, col] = dtype(acc * scale)


@cute.jit
def load_row_values(
    dst: cute.Tensor, src: cute.Tensor, c_mn: cute.Tensor, row0: Int32, seqlen_q: Int32, fill: Float32
):
    """dst[r] = src[row0 + row of r] for each accumulator row r of this thread (``c_mn`` holds the
    tile-local coordinates), ``fill`` for rows past ``seqlen_q``. ``src`` is one (batch, head)'s
    per-row vector."""
    for r in cutlass.range_constexpr(cute.size(dst)):
        row = row0 + c_mn[r, 0][0]
        dst[r] = fill
        if row < seqlen_q:
            dst[r] = src[row]


@cute.jit
def recompute_p(s_mn: cute.Tensor, lse2: cute.Tensor, scale_log2: Float32):
    """Scores -> probabilities in place: P = exp2(S * scale * log2(e) - LSE * log2(e))."""
    for r in cutlass.range_constexpr(cute.size(lse2)):
        row = s_mn[r, None].load()
        s_mn[r, None].store(cute.math.exp2(row * scale_log2 - lse2[r], fastmath=True))


@cute.jit
def compute_ds(p_mn: cute.Tensor, dp_mn: cute.Tensor, dpsum: cute.Tensor):
    """dP -> dS in place: dS = P * (dP - D), D per row (the softmax scale is applied later)."""
    for r in cutlass.range_constexpr(cute.size(dpsum)):
        dp_mn[r, None].store(p_mn[r, None].load().to(Float32) * (dp_mn[r, None].load() - dpsum[r]))


@cute.jit
def atomic_add_rows(acc: cute.Tensor, coords: cute.Tensor, gdst: cute.Tensor, row_limit: Int32):
    """gdst += acc with fp32 reductions (RED.ADD.F32), element by element, rows < ``row_limit``.

    ``gdst`` is the thread's partition of the destination tile (the same shape as ``acc``) and
    ``coords`` the tile-local (row, col) of each element."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        if coords[i][0] < row_limit:
            cute.arch.red(
                (gdst.iterator + cute.crd2idx(i, gdst.layout)),
                acc[i],
                op="add",
                dtype=Float32,
                sem="relaxed",
                scope="gpu",
            )


def vector_red_supported() -> bool:
    """Whether the target being compiled for has red.global.add.v2.f32 (sm_90 and newer; the sm80
    family also compiles for sm_80, sm_86 and sm_89, which have element-wise fp32 reductions only)."""
    return BaseDSL._get_dsl().get_arch_enum().major >= 9


def add_rows(acc: cute.Tensor, coords: cute.Tensor, gdst: cute.Tensor, row_limit: Int32, tile_rows: int = 0):
    """gdst += acc (rows below ``row_limit``) with the widest fp32 reductions the target has:
    :func:`red_add_pairs` on sm_90 and newer (unpredicated when all ``tile_rows`` rows of the tile
    are in range), :func:`atomic_add_rows` before. Chosen while tracing."""
    if vector_red_supported():
        red_add_pairs(acc, coords, gdst, row_limit, tile_rows)
    else:
        atomic_add_rows(acc, coords, gdst, row_limit)
