"""Code-generation policy of the sm80 family (FlashAttention-2 design): the backward's warp grids
and launch order, decided here and written into the generated module (:mod:`cutefa.templating`
hands them to the templates).
"""

from __future__ import annotations

from cutefa.model.budgets_sm80 import sm80_tile_head_dim
from cutefa.model.options import DqLayout, Mask
from cutefa.model.spec import VariantSpec

# The backward's warp grids of dV, dK and dQ (S and dP always take (2, warps / 2)):
SQUARER = "squarer"  # each the squarer of (warps / 2, 2) and (2, warps / 2) (bwd_parts.warp_grid)
TALL_DK = "tall_dk"  # dV and dQ the squarer one, dK (warps / 2, 2)
TALL = "tall"  # all three (warps / 2, 2)
WIDE_HEAD_DIM = 256  # where the fp32 dK and dV accumulators take half the registers
HEAVY_FIRST_HEAD_DIMS = (192,)


def head_dims(spec: VariantSpec) -> dict[str, object]:
    """The tile head dims of an sm80 kernel: ``tile_d`` (Q and K) and ``tile_d_v`` (V and O), each
    the problem's head dim padded to the 32-column shared-memory atom
    (:func:`~cutefa.model.budgets_sm80.sm80_tile_head_dim`), and ``head_apart``: whether a tile
    head dim differs from head_dim (a padded tile or a V head dim of its own), where the kernel
    views its tensors tile-wide and predicates its copies on the columns too
    (:mod:`cutefa.kernels.sm80.head_pad`)."""
    tile_d, tile_d_v = sm80_tile_head_dim(spec.head_dim), sm80_tile_head_dim(spec.head_dim_v)
    return {
        "tile_d": tile_d,
        "tile_d_v": tile_d_v,
        "head_apart": (tile_d, tile_d_v) != (spec.head_dim, spec.head_dim),
        "split_v": spec.head_dim_v != spec.head_dim,
    }


def bwd_warp_grids(spec: VariantSpec) -> str:
    """The sm80 backward's warp grids (:data:`SQUARER`, :data:`TALL_DK` or :data:`TALL`). The
    squarer grid per warp tile reads less of the operands from shared memory; at head_dim 256 the
    fp32 dK and dV accumulators take half the registers and the squarer grid for both spills (8-16
    bytes, sm_80 and sm_90a), so they stay tall, except with the tiled dQ layout: no dQ reduction
    is guarded there, and the squarer dQ grid fits (sm_90a: 253, no spill), as does the squarer
    grid for dV alone (FlashAttention-2's dK/dV grid: 12 fewer ldmatrix per warp and step;
    R250-R252), while dK keeps the tall one (the squarer dK grid spills 15-20 words)."""
    if spec.head_dim < WIDE_HEAD_DIM:
        return SQUARER
    return TALL_DK if spec.options.dq_layout is DqLayout.TILE else TALL


def bwd_heavy_first(spec: VariantSpec) -> bool:
    """Whether the causal sm80 backward launches the longest key blocks of a wave of (batch, head)
    pairs first (bwd_parts.causal_launch_coords): head_dim 192 only, since elsewhere the remapped
    coordinates' registers spill (8-56 bytes); and not with feature axes (their CTAs take the grid's
    own coordinates)."""
    return spec.mask is Mask.CAUSAL and spec.head_dim in HEAVY_FIRST_HEAD_DIMS and not spec.features.any


def score_mod_imports(spec: VariantSpec) -> list[str]:
    """The names a generated sm80 module imports from cutefa.kernels.common.score_mods for its
    score-modifier features (softcap, ALiBi, and forward only, sinks); empty for none."""
    f = spec.features
    names = []
    if f.alibi:
        names += ["apply_alibi_from", "alibi_distance0"] if spec.direction == "fwd" else ["apply_alibi"]
    if f.softcap:
        names += ["apply_softcap", "softcap_pre_scale", "softcap_scale_log2"]
        if spec.direction == "bwd":
            names += ["softcap_dtanh", "softcap_p_dtanh"]
    if f.sinks and spec.direction == "fwd":
        names.append("softmax_finalize_sinks")
    return names
