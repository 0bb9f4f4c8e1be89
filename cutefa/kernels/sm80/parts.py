"""Building blocks of the sm80-family (FlashAttention-2 design) kernels.

mma.sync m16n8k16 with fp32 accumulation, ldmatrix from swizzled shared memory, cp.async 128-bit
global->shared copies. The generated kernels (templates/*_sm80.py.j2) compose these.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

COPY_BITS = 128


def smem_layout(dtype, rows: int, head_dim: int, stages: int = 0):
    """Swizzled (rows, head_dim[, stages]) shared-memory layout, conflict-free for cp.async
    writes and ldmatrix reads: 8-row atoms of 64 (or 32) columns with a 3-bit (2-bit) XOR swizzle."""
    atom_cols = 64 if head_dim % 64 == 0 else 32
    swz = 3 if atom_cols == 64 else 2
    atom = cute.make_composed_layout(
        cute.make_swizzle(swz, 3, 3), 0, cute.make_layout((8, atom_cols), stride=(atom_cols, 1))
    )
    if stages:
        return cute.tile_to_shape(atom, (rows, head_dim, stages), (0, 1, 2))
    return cute.tile_to_shape(atom, (rows, head_dim), (0, 1))


def _row_copy_threads(dtype, threads: int, head_dim: int):
    per_copy = COPY_BITS // dtype.width
    atom_cols = 64 if head_dim % 64 == 0 else 32
    cols = atom_cols // per_copy
    return cute.make_layout((threads // cols, cols), stride=(cols, 1)), cute.make_layout((1, per_copy))


def g2s_tiled_copy(dtype, threads: int, head_dim: int):
    """cp.async (bypassing L1) tiled copy, 16 bytes per thread per step, rows of head_dim."""
    atom = cute.make_copy_atom(
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype, num_bits_per_copy=COPY_BITS
    )
    thr, val = _row_copy_threads(dtype, threads, head_dim)
    return cute.make_tiled_copy_tv(atom, thr, val)


def vec_tiled_copy(dtype, threads: int, head_dim: int):
    """Plain 16-byte vector copy with the same thread arrangement (smem->regs->gmem epilogue)."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=COPY_BITS)
    thr, val = _row_copy_threads(dtype, threads, head_dim)
    return cute.make_tiled_copy_tv(atom, thr, val)


def tiled_mma(dtype, warps: int):
    """Warps stacked along M; each warp owns 16-row slabs; N and K tiled by 16 so that ldmatrix.x4
    feeds two n8 atoms of B at once."""
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)),
        (warps, 1, 1),
        permutation_mnk=(warps * 16, 16, 16),
    )


def ldmatrix_copies(dtype, mma):
    """ldmatrix tiled copies for the A operand, the B operand, and B transposed (V in P @ V)."""
    ld = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    ld_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), dtype)
    return (
        cute.make_tiled_copy_A(ld, mma),
        cute.make_tiled_copy_B(ld, mma),
        cute.make_tiled_copy_B(ld_t, mma),
    )


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View an mma.sync accumulator fragment ((2, 2), MMA_M, MMA_N) as (rows, cols).

    In the m16n8 C layout a thread holds, per atom, 2 adjacent columns of 2 rows 8 apart: mode
    (0,0) walks columns and (0,1) walks rows.
    """
    lay = cute.make_layout(acc.layout.shape)  # compact, to address the fragment by coordinates
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def acc_as_a_operand(frag: cute.Tensor) -> cute.Tensor:
    """Reinterpret a converted accumulator fragment ((2, 2), MMA_M, MMA_N) as an A-operand
    fragment ((2, 2, 2), MMA_M, MMA_N / 2) of m16n8k16: two n8 accumulator atoms make one k16."""
    div = cute.logical_divide(frag.layout, (None, None, 2))
    a = cute.make_layout(
        ((div.shape[0], div.shape[2][0]), div.shape[1], div.shape[2][1]),
        stride=((div.stride[0], div.stride[2][0]), div.stride[1], div.stride[2][1]),
    )
    return cute.make_tensor(frag.iterator, a)


@cute.jit
def gemm_rs(mma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor, tCsB, tCrB_view, copy_B):
    """acc += A (already in registers) @ B (from shared memory, ldmatrix one k-block ahead)."""
    k_blocks = cute.size(tCrA, mode=[2])
    cute.copy(copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in cutlass.range_constexpr(k_blocks):
        if cutlass.const_expr(k + 1 < k_blocks):
            cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def gemm_ss(mma, acc, tCrA, tCsA, tCrA_view, copy_A, tCrB, tCsB, tCrB_view, copy_B):
    """acc += A @ B with both operands streamed from shared memory one k-block ahead."""
    k_blocks = cute.size(tCrA, mode=[2])
    cute.copy(copy_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
    cute.copy(copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in cutlass.range_constexpr(k_blocks):
        if cutlass.const_expr(k + 1 < k_blocks):
            cute.copy(copy_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
            cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def copy_rows(tiled_copy, src: cute.Tensor, dst: cute.Tensor, coords: cute.Tensor, row_limit, zero_fill):
    """Copy a thread's (CPY, ROWS, COLS) partition row by row, only rows with coordinate
    < ``row_limit``; with ``zero_fill`` the other rows of ``dst`` are cleared (so that masked
    keys/values hold zeros, never stale data or NaN)."""
    for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
        if coords[0, m, 0][0] < row_limit:
            cute.copy(tiled_copy, src[None, m, None], dst[None, m, None])
        else:
            if cutlass.const_expr(zero_fill):
                dst[None, m, None].fill(0)
