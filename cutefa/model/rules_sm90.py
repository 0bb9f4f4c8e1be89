"""The sm90 families' rules (templates/fwd_sm90.py.j2, fwd_sm90_fp8.py.j2, bwd_sm90.py.j2,
bwd_sm90_hsplit.py.j2, bwd_sm90_swapkv.py.j2): how a spec's options relate to each other and to the
tile. :mod:`cutefa.model.rules` holds them to the spec with the other families' rules; each returns
a sentence naming what is wrong, or None.
"""

from __future__ import annotations

from cutefa.model.budgets_sm90 import (
    SM90_BWD_DQ_SWAP_HEAD_DIMS,
    SM90_BWD_DQ_SWAP_TILE_M,
    SM90_BWD_HEAD_DIM_STEP,
    SM90_BWD_HEAD_DIMS,
    SM90_BWD_OWN_HEAD_DIMS,
    SM90_BWD_SPLIT_HEAD_DIMS,
    SM90_BWD_SPLIT_TILE_N,
    SM90_BWD_SWAP_HEAD_DIMS,
    SM90_BWD_SWAP_TILE_N,
    SM90_BWD_TILE_N,
    SM90_BWD_WARPS,
    SM90_FP8_MMA_K,
    SM90_FP8_TRANSPOSE_THREADS,
    sm90_bwd_dq_pieces,
    sm90_bwd_dq_swapped,
    sm90_bwd_head_split,
    sm90_bwd_main_head_dim,
    sm90_bwd_over_budget,
    sm90_bwd_swapped,
)
from cutefa.model.options import DqPath, Mask, OAccum, Quant, RowSum, Scheduler, VTranspose
from cutefa.model.spec import VariantSpec

# ---------------------------------------------------------------------------------------------
# sm90 forward (templates/fwd_sm90.py.j2, fwd_sm90_fp8.py.j2)


def _sm90_early_rescale(spec: VariantSpec) -> str | None:
    if not spec.options.early_rescale:
        return None
    if not spec.options.schedule.overlap:
        return (
            "early_rescale needs overlap: without it O is rescaled inside the softmax step, before its "
            "P V is issued, already"
        )
    if spec.tile_m != 128:
        return (
            f"early_rescale needs two consumer warpgroups (tile_m=128), not tile_m={spec.tile_m}: "
            "not compiled within the three-consumer 160-register budget"
        )
    return None


def _sm90_lazy_rescale(spec: VariantSpec) -> str | None:
    if not spec.options.lazy_rescale:
        return None
    if not spec.options.schedule.overlap:
        return "lazy_rescale: the sm90 16-bit forward rescales lazily in the overlap schedule only (its deferred softmax step)"
    if spec.options.exp_emu:
        return "lazy_rescale with exp_emu: the lazy softmax step keeps every exp2 on MUFU"
    return None


def _sm90_fp8_wide_transpose(spec: VariantSpec) -> str | None:
    """The 64-bit V transpose (VTranspose.WIDE) moves 8 keys x 8 head dims a unit."""
    if spec.options.v_transpose is not VTranspose.WIDE:
        return None
    if spec.tile_n % SM90_FP8_MMA_K:
        return (
            f"v_transpose=WIDE: tile_n={spec.tile_n} is not a multiple of {SM90_FP8_MMA_K} (the 32-key blocks "
            "in which V is transposed and permuted; a wide unit spans 8 keys of one block)"
        )
    units = (spec.head_dim // 8) * (spec.tile_n // 8)
    if units % SM90_FP8_TRANSPOSE_THREADS:
        return (
            f"v_transpose=WIDE: (head_dim / 8) x (tile_n / 8) = {units} 8x8-byte units (head_dim={spec.head_dim}, "
            f"tile_n={spec.tile_n}) is not a multiple of the producer warpgroup's {SM90_FP8_TRANSPOSE_THREADS} threads"
        )
    return None


def _sm90_fp8_accumulation(spec: VariantSpec) -> str | None:
    """The row sums by a WGMMA against ones, O accumulated in two levels and v's column means added
    in the epilogue: options of the overlap schedule that the block-quantization path does not take."""
    o = spec.options
    block = o.quant is Quant.BLOCK
    for on, what, why_overlap, why_not_block in (
        (o.row_sum is RowSum.MMA, "row_sum=MMA", "the block sums are added with the rescale after each step's P V wait",
         "the block path's row sums undo each key tile's V ratio, which P carries"),
        (o.o_accum is OAccum.TWO_LEVEL, "o_accum=TWO_LEVEL", "O is promoted after each step's P V wait",
         "not built for the block path"),
    ):  # fmt: skip
        if on and not o.schedule.overlap:
            return f"{what} needs overlap: {why_overlap}"
        if on and block:
            return f"{what} with quant=BLOCK: {why_not_block}"
    if o.v_mean and o.o_accum is OAccum.TWO_LEVEL:
        return "v_mean with o_accum=TWO_LEVEL: centered v needs no two-level accumulation"
    if o.v_mean and block:
        return "v_mean with quant=BLOCK: not built for the block path"
    if o.scheduler in (Scheduler.LPT, Scheduler.HEAVY_FIRST):
        return f"scheduler={o.scheduler.name}: the sm90 e4m3 forward has its own grid (GRID or PERSISTENT)"
    return None


def _sm90_heavy_first(spec: VariantSpec) -> str | None:
    """The heavy-first grid orders the query tiles of a packed batch (templates/fwd_sm90.py.j2):
    a dense batch's tiles are ordered by the GRID, PERSISTENT and LPT schedulers."""
    if spec.options.scheduler is Scheduler.HEAVY_FIRST and not spec.features.varlen:
        return (
            "scheduler=HEAVY_FIRST without varlen: the heavy-first grid walks a packed batch's query tiles "
            "(a dense batch takes GRID, PERSISTENT or LPT)"
        )
    return None


def _sm90_roles(spec: VariantSpec) -> str | None:
    if spec.tile_m % 64 or spec.tile_m // 64 not in (1, 2, 3):
        return f"tile_m={spec.tile_m} must be 64, 128 or 192 (one consumer warpgroup per 64 query rows)"
    if spec.options.schedule.pingpong and spec.tile_m not in (128, 192):
        return (
            f"pingpong needs two or three consumer warpgroups (tile_m=128 or 192), not tile_m={spec.tile_m}"
        )
    if spec.warps != 4 * (spec.tile_m // 64 + 1):
        return (
            f"warps={spec.warps} must be {4 * (spec.tile_m // 64 + 1)}: one producer warpgroup plus "
            f"{spec.tile_m // 64} consumer warpgroup(s) of 4 warps"
        )
    if spec.tile_n % 16 or not 16 <= spec.tile_n <= 256:
        return (
            f"tile_n={spec.tile_n} must be a multiple of 16 in [16, 256] (WGMMA N, and the k16 steps of P@V)"
        )
    if spec.stages < 2:
        return (
            f"stages={spec.stages}: the K/V TMA pipelines need at least 2 stages to overlap loads with MMAs"
        )
    return None


def _sm90_fp8_tile(spec: VariantSpec) -> str | None:
    """The fp8 forward's own limits (templates/fwd_sm90_fp8.py.j2)."""
    o = spec.options
    if spec.tile_m not in (128, 192):
        return (
            f"tile_m={spec.tile_m}: the sm90 fp8 forward runs two or three consumer warpgroups of 64 "
            "query rows (tile_m 128 or 192); its register splits are laid out for those"
        )
    if spec.tile_m == 192 and o.schedule.pingpong:
        return "tile_m=192 with pingpong: the fp8 ping-pong hands the tensor core between two consumers"
    if spec.tile_m == 192 and spec.head_dim != 128:
        return (
            f"tile_m=192 at head_dim {spec.head_dim}: three consumers get 160 registers each, which "
            "holds O and S at head_dim 128 only (budgets_sm90.sm90_fp8_consumer_regs)"
        )
    if spec.tile_n % SM90_FP8_MMA_K:
        return (
            f"tile_n={spec.tile_n} is not a multiple of {SM90_FP8_MMA_K} (the k of an fp8 WGMMA, and the "
            "32-key blocks in which V is transposed and permuted)"
        )
    if o.scheduler is Scheduler.PERSISTENT and o.quant is Quant.BLOCK:
        return (
            "scheduler=PERSISTENT with quant=BLOCK: the block-quantization path has no persistent scheduler"
        )
    return None


def _sm90_fp8_varlen(spec: VariantSpec) -> str | None:
    """The e4m3 forward takes a packed batch on its GRID scheduler with per-(sequence, kv head)
    descales only (templates/fwd_sm90_fp8.py.j2)."""
    if not spec.features.varlen:
        return None
    o = spec.options
    if o.scheduler is not Scheduler.GRID:
        return (
            f"varlen with scheduler={o.scheduler.name}: the sm90 e4m3 forward takes a packed batch on its "
            "GRID scheduler only"
        )
    if o.quant is not Quant.TENSOR:
        return (
            "varlen with quant=BLOCK: the sm90 e4m3 forward takes per-(sequence, kv head) descales on a "
            "packed batch"
        )
    if o.v_mean:
        return "varlen with v_mean: the sm90 e4m3 forward adds no column means on a packed batch"
    return None


# ---------------------------------------------------------------------------------------------
# sm90 backward (templates/bwd_sm90.py.j2, bwd_sm90_hsplit.py.j2, bwd_sm90_swapkv.py.j2)


def _sm90_bwd_dq_path(spec: VariantSpec) -> str | None:
    """The dQ-writer warp and the LSE2/D prefetch are built for the main partition (tile_n=128,
    tile_m 64 or 128) only; the dQ path with its own staging buffer for the swapped one only."""
    o = spec.options
    main = not (sm90_bwd_head_split(spec) or sm90_bwd_swapped(spec) or sm90_bwd_dq_swapped(spec))
    where = f"tile_m={spec.tile_m}, tile_n={spec.tile_n}, head_dim={spec.head_dim}"
    for on, what in (
        (o.dq_path is DqPath.BULK_WARP, "dq_path=BULK_WARP (the dQ-writer warp)"),
        (o.row_prefetch, "row_prefetch"),
    ):
        if on and not main:
            return (
                f"{what} with {where}: built for the tile_n=128 backward with tile_m 64 or 128 "
                "(templates/bwd_sm90.py.j2) only"
            )
        if on and spec.head_dim not in SM90_BWD_HEAD_DIMS:
            return (
                f"{what} with head_dim={spec.head_dim}: built for head dims {SM90_BWD_HEAD_DIMS} (at 80 and "
                "112 its kernels spill on sm_90a)"
            )
    if o.dq_path is DqPath.BULK_STAGED and not sm90_bwd_swapped(spec):
        return (
            f"dq_path=BULK_STAGED with {where}: built for the swapped-dK/dV backward (tile_n=96, head dim 192, "
            "templates/bwd_sm90_swapkv.py.j2) only"
        )
    return None


def _sm90_bwd(spec: VariantSpec) -> str | None:
    featured = spec.features.any or spec.mask is Mask.LOCAL
    if featured and (sm90_bwd_head_split(spec) or sm90_bwd_swapped(spec)):
        return (
            f"head_dim={spec.head_dim}, tile_n={spec.tile_n}: the head-dim-split and swapped-dK/dV sm90 backward "
            "templates take no window, packed batch, softcap or ALiBi (the sm80 backward serves those on Hopper)"
        )
    reason = _sm90_bwd_separate_v(spec)
    if reason is not None:
        return reason
    if spec.warps == SM90_BWD_WARPS and sm90_bwd_swapped(spec) and spec.head_dim in SM90_BWD_SWAP_HEAD_DIMS:
        return _sm90_bwd_swap(spec)
    if spec.warps != SM90_BWD_WARPS or spec.tile_n not in (SM90_BWD_TILE_N, SM90_BWD_SPLIT_TILE_N):
        return (
            f"the sm90 backward runs warps={SM90_BWD_WARPS} and tile_n={SM90_BWD_TILE_N} (a producer "
            "warpgroup and two consumer warpgroups of 64 keys each) or tile_n="
            f"{SM90_BWD_SPLIT_TILE_N} (head dims {SM90_BWD_SPLIT_HEAD_DIMS}: the two consumers share "
            f"64 keys and split the head dim) or tile_n={SM90_BWD_SWAP_TILE_N} (head dims "
            f"{SM90_BWD_SWAP_HEAD_DIMS}: 48 keys per consumer, dK^T/dV^T on WGMMA's M axis)"
        )
    if sm90_bwd_head_split(spec):
        return _sm90_bwd_split(spec) or sm90_bwd_over_budget(spec)
    if sm90_bwd_dq_swapped(spec):
        return _sm90_bwd_dq_swap(spec) or sm90_bwd_over_budget(spec)
    if spec.tile_m not in (64, 128):
        return (
            f"tile_m={spec.tile_m} must be 64 or 128 (the two consumers split dQ into 64-row blocks), "
            f"or {SM90_BWD_DQ_SWAP_TILE_M} with head_dim in {SM90_BWD_DQ_SWAP_HEAD_DIMS} and a bulk dQ path (dQ transposed)"
        )
    if not sm90_bwd_main_head_dim(spec.head_dim):
        return (
            f"head_dim={spec.head_dim}: the sm90 backward with tile_n={SM90_BWD_TILE_N} handles "
            f"{SM90_BWD_HEAD_DIMS} and the other multiples of {SM90_BWD_HEAD_DIM_STEP} from "
            f"{SM90_BWD_OWN_HEAD_DIMS[0]} to {SM90_BWD_OWN_HEAD_DIMS[-1]} (fp32 dK + dV of 64 keys, head_dim "
            "registers per thread, must fit beside S^T and dP^T; WGMMA's k step is 16); head dims "
            f"{SM90_BWD_SPLIT_HEAD_DIMS} run tile_n={SM90_BWD_SPLIT_TILE_N} (the head-dim split), other "
            "multiples of 8 the sm80 backward"
        )
    pieces = sm90_bwd_dq_pieces(spec)
    if pieces is None:
        return (
            f"tile_m=64 with head_dim={spec.head_dim}: the two consumers cannot split dQ's columns at a "
            "swizzle-atom boundary of K into two pieces (tile_m=128 splits dQ by rows)"
        )
    if spec.stages < 2:
        return f"stages={spec.stages}: the Q/dO TMA ring needs at least 2 stages to overlap loads with MMAs"
    if spec.options.overlap and pieces[0][2] != pieces[1][2]:
        return (
            f"overlap with head_dim={spec.head_dim}, tile_m={spec.tile_m}: the consumers' dQ pieces differ "
            f"in width ({pieces[0][2]} and {pieces[1][2]} columns) and overlap carries one accumulator shape"
        )
    return sm90_bwd_over_budget(spec)


def _sm90_bwd_separate_v(spec: VariantSpec) -> str | None:
    """A V head dim of its own (spec.HEAD_DIM_V_PAIRS: (192, 128)) runs on the swapped-dK/dV
    partition with the dQ staging of its own (DqPath.BULK_STAGED): its V, dO and dV^T tiles take
    the V head dim (templates/bwd_sm90_swapkv.py.j2). The tile_n=128 partition would hold fp32 dK
    and dV of 64 keys x (192 + 128) columns, 160 registers a thread beside S^T and dP^T (an
    estimate of 264 registers against 240); the in-stage bulk path stages a 64 x 96 fp32 dQ piece
    in dO's 64 x 128 16-bit tile, which is 8 KiB short."""
    if spec.head_dim_v == spec.head_dim:
        return None
    if sm90_bwd_swapped(spec) and spec.options.dq_path is DqPath.BULK_STAGED:
        return None
    return (
        f"head_dim_v={spec.head_dim_v} with head_dim={spec.head_dim}, tile_n={spec.tile_n} and "
        f"dq_path={spec.options.dq_path.name}: the sm90 backward takes a V head dim of its own on the "
        f"swapped-dK/dV partition (tile_n={SM90_BWD_SWAP_TILE_N}, tile_m=64) with dq_path=BULK_STAGED only"
    )


def _sm90_bwd_swap(spec: VariantSpec) -> str | None:
    """The swapped-dK/dV partition (tile_n = 96, head dim 192): 64 query rows per step, 2 stages."""
    if spec.tile_m != 64:
        return f"tile_m={spec.tile_m}: the swapped-dK/dV sm90 backward takes 64 query rows per step (WGMMA M of S and dP)"
    if spec.stages < 2:
        return f"stages={spec.stages}: the Q/dO TMA ring needs at least 2 stages to overlap loads with MMAs"
    if spec.options.overlap:
        return "overlap: the swapped-dK/dV sm90 backward has no overlap schedule (dV and dK read P and dS from shared memory)"
    return sm90_bwd_over_budget(spec)


def _sm90_bwd_split(spec: VariantSpec) -> str | None:
    """The head-dim split (tile_n = 64): head dims 192 and 256, 64 query rows per step."""
    if spec.head_dim not in SM90_BWD_SPLIT_HEAD_DIMS:
        return (
            f"tile_n={spec.tile_n} with head_dim={spec.head_dim}: the head-dim-split sm90 backward "
            f"(two warpgroups sharing 64 keys) handles head_dim in {SM90_BWD_SPLIT_HEAD_DIMS}; "
            f"head dims {SM90_BWD_HEAD_DIMS} run tile_n={SM90_BWD_TILE_N}"
        )
    if spec.tile_m != 64:
        return (
            f"tile_m={spec.tile_m}: the head-dim-split sm90 backward takes 64 query rows per step "
            "(32 per warpgroup for S^T and dP^T; the Q/dO ring of 128 rows would not fit in shared memory)"
        )
    if spec.stages < 2:
        return f"stages={spec.stages}: the Q/dO TMA ring needs at least 2 stages to overlap loads with MMAs"
    return None


def _sm90_bwd_dq_swap(spec: VariantSpec) -> str | None:
    """tile_m = 80 (:func:`~cutefa.model.budgets_sm90.sm90_bwd_dq_swapped`): head dim 128, a bulk dQ
    path, 2 stages, no overlap."""
    if spec.head_dim not in SM90_BWD_DQ_SWAP_HEAD_DIMS:
        return (
            f"tile_m={spec.tile_m} with head_dim={spec.head_dim}: the transposed-dQ sm90 backward handles "
            f"head_dim in {SM90_BWD_DQ_SWAP_HEAD_DIMS} (each consumer 64 of the head dim's columns)"
        )
    if spec.options.dq_path is DqPath.RED:
        return (
            f"tile_m={spec.tile_m} with dq_path=RED: the transposed dQ piece (head-dim columns x queries) "
            "goes out by a bulk reduce-add only (the per-thread reductions take 64-row pieces)"
        )
    if spec.stages != 2:
        return (
            f"stages={spec.stages}: tile_m={spec.tile_m} fits the shared memory with a 2-stage Q/dO ring only"
        )
    if spec.options.overlap:
        return f"overlap: tile_m={spec.tile_m} has the default schedule only (its registers are full)"
    return None
