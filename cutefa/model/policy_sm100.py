"""Code-generation policy of the sm100 family (FlashAttention-4 design: tcgen05 + TMEM): the warp
roles' register budgets, the TMEM layout, and the softmax's rescale threshold and P shift, decided
here and written into the generated module as constants (:mod:`cutefa.templating` hands them to
the templates). Compiled and SASS-checked for sm_100a, not hardware-tested.
"""

from __future__ import annotations

from cutefa.model.budgets_sm100 import (
    SM100_FEATURE_SOFTMAX_REGS,
    SM100_SOFTMAX_REGS,
    SM100_TMEM_COLUMNS,
    sm100_tmem_columns,
)
from cutefa.model.options import Mask
from cutefa.model.spec import VariantSpec

Q_TILE_ROWS = 128  # query rows of one Q tile in flight (one TMEM lane per row)
CORRECTION_REGS = 80  # setmaxnreg of the correction warpgroup (O rescale and epilogue, by chunks)
OTHER_REGS = 64  # of the MMA / load / epilogue warpgroup
FEATURE_OTHER_REGS = 48  # the same with feature axes: its 8 more per softmax thread
O_CHUNK = 16  # TMEM columns of O per correction load/store
RESCALE_THRESHOLD_LOG2 = 8  # 16-bit: a row's running max is raised only when it grows by more than 2^8
FP8_P_SHIFT_LOG2 = 8  # e4m3: P = exp2(s - max + 8) keeps probabilities down to 2^-14 normal


def fwd_register_split(spec: VariantSpec) -> tuple[int, int, int]:
    """(softmax, correction, other) setmaxnreg budgets of the sm100 forward's warpgroups: two
    softmax warpgroups hold a row of S each (184), the correction and the remaining warpgroup give
    registers up; 128 x (2 x 184 + 80 + 64) fills the 128 x 512 launch allocation."""
    if fwd_featured(spec):
        return SM100_FEATURE_SOFTMAX_REGS, CORRECTION_REGS, FEATURE_OTHER_REGS
    return SM100_SOFTMAX_REGS, CORRECTION_REGS, OTHER_REGS


def fwd_featured(spec: VariantSpec) -> bool:
    """Whether the forward takes feature arguments (:mod:`cutefa.api.features`): a feature axis
    (varlen, softcap, alibi, sinks) or the local mask. Such a kernel defines its own fake
    arguments and finishes its rows through the feature-aware epilogue."""
    return spec.features.any or spec.mask is Mask.LOCAL


def q_tiles(spec: VariantSpec) -> int:
    """128-row Q tiles a forward CTA keeps in flight (one softmax warpgroup each)."""
    return spec.tile_m // Q_TILE_ROWS


def fwd_tmem_s(spec: VariantSpec) -> tuple[int, ...]:
    """TMEM column of each Q tile's S (P and the row statistics live inside it)."""
    return tuple(q * spec.tile_n for q in range(q_tiles(spec)))


def fwd_tmem_o(spec: VariantSpec) -> tuple[int, ...]:
    """TMEM column of each Q tile's O, after every S."""
    return tuple(q_tiles(spec) * spec.tile_n + q * spec.head_dim for q in range(q_tiles(spec)))


def fwd_tmem_alloc(spec: VariantSpec) -> int:
    """TMEM columns a forward CTA allocates: the columns it uses
    (:func:`~cutefa.model.budgets_sm100.sm100_tmem_columns`) rounded up to 128, 256 or 512."""
    used = sm100_tmem_columns(spec)
    for size in (128, 256):
        if used <= size:
            return size
    return SM100_TMEM_COLUMNS


def fwd_rescale_threshold(spec: VariantSpec) -> int:
    """log2 growth of a row's max below which the softmax keeps the old reference (and the
    correction warps skip the O rescale). e4m3: 0, since P already carries the 2^8 shift
    (:func:`fwd_p_shift`) and a threshold t would let it reach 2^(8 + t), past e4m3's 448."""
    return 0 if spec.dtype == "e4m3" else RESCALE_THRESHOLD_LOG2


def fwd_p_shift(spec: VariantSpec) -> int:
    """log2 of the factor P carries (P = exp2(s - max + shift)): 8 for e4m3, which keeps
    probabilities down to 2^-14 normal (the row sums carry it too and the LSE subtracts it)."""
    return FP8_P_SHIFT_LOG2 if spec.dtype == "e4m3" else 0


def bwd_tmem_columns(spec: VariantSpec) -> tuple[int, int, int, int]:
    """First TMEM columns of the backward's dP^T, dV and dK and the end of dK (S^T starts at 0,
    dQ reuses S^T and dP^T)."""
    return spec.tile_m, 2 * spec.tile_m, 2 * spec.tile_m + spec.head_dim, 2 * spec.tile_m + 2 * spec.head_dim
