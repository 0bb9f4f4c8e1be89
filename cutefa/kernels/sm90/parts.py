"""Building blocks of the sm90-family (FlashAttention-3 design) kernels.

TMA bulk-tensor copies into swizzled shared memory, warpgroup MMA (WGMMA) with S = Q K^T from
shared memory and O += P V with P from registers, mbarrier pipelines between one producer warp
and the consumer warpgroups. The generated kernels (templates/fwd_sm90.py.j2) compose these.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

WG_ROWS = 64  # rows of one warpgroup MMA (wgmma M)
WG_THREADS = 128


def bshd_as_sdhb(t: cute.Tensor) -> cute.Tensor:
    """View a (batch, seqlen, heads, head_dim) tensor as (seqlen, head_dim, heads, batch): the
    row-major (K-major) operand layout TMA and WGMMA address, with head_dim contiguous."""
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            (t.shape[1], t.shape[3], t.shape[2], t.shape[0]),
            stride=(t.stride[1], t.stride[3], t.stride[2], t.stride[0]),
        ),
    )


def bshd_as_dshb(t: cute.Tensor) -> cute.Tensor:
    """View V (batch, seqlen, heads, head_dim) as (head_dim, seqlen, heads, batch): the B operand
    of O += P V (N = head_dim, K = keys), N-major since head_dim is contiguous."""
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            (t.shape[3], t.shape[1], t.shape[2], t.shape[0]),
            stride=(t.stride[3], t.stride[1], t.stride[2], t.stride[0]),
        ),
    )


def qk_tiled_mma(dtype, tile_n: int):
    """S = Q K^T for one warpgroup: 64 query rows x tile_n keys, both operands K-major in smem."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
        cutlass.Float32, (1, 1, 1), (WG_ROWS, tile_n),
    )  # fmt: skip


def pv_tiled_mma(dtype, head_dim: int):
    """O += P V for one warpgroup: P (64 x keys) from registers, V from smem, N-major."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
        cutlass.Float32, (1, 1, 1), (WG_ROWS, head_dim), warpgroup.OperandSource.RMEM,
    )  # fmt: skip


def smem_layouts(dtype, tile_n: int, head_dim: int, q_slabs: int, stages: int):
    """Swizzled staged layouts: Q (64, d, q_slabs), K (tile_n, d, stages), V (d, tile_n, stages)."""
    sq = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (WG_ROWS, tile_n, head_dim), dtype, q_slabs)
    sk = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, (WG_ROWS, tile_n, head_dim), dtype, stages)
    sv = sm90_utils.make_smem_layout_b(utils.LayoutEnum.COL_MAJOR, (WG_ROWS, head_dim, tile_n), dtype, stages)
    return sq, sk, sv


def tma_load_atom(gmem: cute.Tensor, smem_staged, tile):
    """TMA load atom + coordinate tensor for boxes of ``tile`` into one stage of ``smem_staged``."""
    one = cute.slice_(smem_staged, (None, None, 0))
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), gmem, one, tile)


def tma_store_atom(gmem: cute.Tensor, smem_staged, tile):
    one = cute.slice_(smem_staged, (None, None, 0))
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), gmem, one, tile)


def tma_tiles(atom, smem: cute.Tensor, gmem_tiles: cute.Tensor):
    """Partition staged smem (r, c, stage) and tiled gmem (r, c, tile) for a TMA atom:
    returns (TMA, stage) and (TMA, tile) views."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2), cute.group_modes(gmem_tiles, 0, 2))


def o_store_atom(dtype):
    """Register -> shared memory copy of the 16-bit O tile: ``stmatrix`` (four 8x8 matrices per
    instruction, 16 bytes per row, which the 128-byte swizzle keeps free of bank conflicts)."""
    return cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), dtype)


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View a wgmma accumulator fragment ((2, 2, N/8), MMA_M, MMA_N) as (rows, cols).

    Per 8-column block a thread holds 2 adjacent columns of 2 rows 8 apart (as in mma.sync):
    mode (0,0) and (0,2) walk columns, (0,1) walks rows."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), ((lay.shape[0][0], lay.shape[0][2]), lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), ((lay.stride[0][0], lay.stride[0][2]), lay.stride[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def acc_to_a_layout(acc_layout):
    """Layout of a register A operand (64 x K) built from a (64 x N) accumulator in place:
    two adjacent 8-column blocks of the accumulator make one k16 block of the operand."""
    s, d = acc_layout.shape, acc_layout.stride
    return cute.make_layout(
        ((s[0][0], s[0][1], 2), s[1], (s[2], s[0][2] // 2)),
        stride=((d[0][0], d[0][1], d[0][2]), d[1], (d[2], 2 * d[0][2])),
    )


@cute.jit
def gemm_ss_zero(mma, acc, tCrA, tCrB):
    """acc = A @ B over all k-blocks, the first one overwriting acc (no fill needed)."""
    for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        mma.set(warpgroup.Field.ACCUMULATE, k != 0)
        cute.gemm(mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def gemm_acc_from(mma, acc, tCrA, tCrB, accumulate):
    """acc = A @ B + (acc if ``accumulate`` else 0), over all k-blocks: ``accumulate`` (a run-time
    Boolean) is the first k-block's scale-d, the rest accumulate."""
    for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        mma.set(warpgroup.Field.ACCUMULATE, accumulate if k == 0 else True)
        cute.gemm(mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def gemm_acc(mma, acc, tCrA, tCrB):
    """acc += A @ B over all k-blocks."""
    mma.set(warpgroup.Field.ACCUMULATE, True)
    for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


# K/V bytes of the (head, batch) pairs a persistent grid works on at once are kept within this
# share of the 50 MiB L2, so that the CTAs on the same pairs read each K/V block from HBM once.
L2_KV_BUDGET = 24 * 1024 * 1024


def lpt_tile(t, num_m, heads, pairs, group):
    """(m_block, head, batch) of tile ``t`` of a persistent grid's longest-first order.

    The (head, batch) pairs are cut into sections of ``group`` pairs; a section's tiles come
    before the next section's, and inside a section the last query blocks (the most key blocks
    when causal) come first, the pairs of one query block side by side. Plain index arithmetic on
    the kernel's Int32 values (traced inline)."""
    per_section = group * num_m
    section = t // per_section
    first_pair = section * group
    width = cutlass.min(group, pairs - first_pair)  # the last section may hold fewer pairs
    r = t - section * per_section
    pair = first_pair + r % width
    return num_m - 1 - r // width, pair % heads, pair // heads


def lpt_group(seqlen_k, head_dim: int, elem_bytes: int):
    """(head, batch) pairs per section of :func:`lpt_tile`: the largest power of two of them whose K
    and V fit in :data:`L2_KV_BUDGET`, at least one. A power of two divides the usual pair counts
    (batch x heads) into equal sections; an uneven last section, or section boundaries that fall
    mid-wave, start a section's longest causal tiles late, and the grid ends on them."""
    kv_bytes = cutlass.max(seqlen_k, 1) * (2 * head_dim * elem_bytes)
    group = cutlass.max(L2_KV_BUDGET // kv_bytes, 1)
    for shift in (1, 2, 4, 8, 16):  # every bit below the highest set
        group = group | (group >> shift)
    return group - (group >> 1)
