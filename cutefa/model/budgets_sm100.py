"""The sm100 family's resource models (FlashAttention-4 design: tcgen05 + TMEM): tensor memory,
shared memory and softmax registers of the forward, and the backward's. Compiled and SASS-checked
for sm_100a, not hardware-tested."""

from __future__ import annotations

from cutefa.model.budgets import SMEM_RESERVE, TARGET_SMEM_LIMITS
from cutefa.model.options import Mask
from cutefa.model.spec import VariantSpec

SM100_SMEM_LIMIT = TARGET_SMEM_LIMITS["sm_100a"]  # B200 per-block opt-in limit
SM100_TMEM_COLUMNS = 512  # 128 lanes x 512 columns x 32 bit per SM
SM100_WARPS = 16  # softmax 0 and 1, correction, MMA / load / epilogue / spare: 4 warpgroups
SM100_SOFTMAX_REGS = 184  # setmaxnreg of a softmax thread (a whole row of S lives in registers)
SM100_FEATURE_SOFTMAX_REGS = 192  # the same with feature axes (band bounds, softcap, ALiBi terms)
SM100_SOFTMAX_OVERHEAD = 48  # row max/sum, coordinates, pipeline state, TMEM addresses
SM100_PAIR_MIN_HEAD_DIM = 128  # a CTA pair splits V by head-dim columns: at least 64 each
SM100_FP8_MMA_K = 32  # k of a tcgen05 kind::f8f6f4 UMMA: O += P V steps over keys 32 at a time
SM100_FP8_V_MN_STEP = 16  # UMMA N step with an 8-bit MN-major B (V as TMA lands it), cta_group::1
# Backward: one warpgroup, no setmaxnreg (up to 255 per thread). Calibrated on compiled SASS
# (sm_100a, DSL 4.8.1): 105-128 registers, no spill; the 32-column S^T and dP^T chunks (64) plus
# their 16-bit copies dominate.
SM100_BWD_REGISTERS = 128
# The backward's one tile (templates/bwd_sm100.py.j2): 128 keys per CTA, 128 query rows per step,
# 4 warps (128-row UMMAs, one TMEM lane per thread); (tile_m, tile_n, stages, warps).
SM100_BWD_TILE = (128, 128, 1, 4)


def sm100_tmem_columns(spec: VariantSpec) -> int:
    """TMEM columns one CTA uses. Forward: per Q tile of 128 rows, S (tile_n fp32 columns, P and
    the row statistics live inside it) and O (head_dim fp32 columns). Backward: S^T and dP^T
    (tile_m each; dQ reuses them) + dK + dV."""
    if spec.direction == "bwd":
        return 2 * spec.tile_m + 2 * spec.head_dim
    return spec.tile_m // 128 * (spec.tile_n + spec.head_dim)


def sm100_smem_bytes(spec: VariantSpec) -> int:
    """Forward: Q tiles, the K/V ring (K and V share its stages) and one 128-row O staging tile
    (none with varlen), plus mbarriers and 1 KiB alignment of each buffer. A CTA of a pair (``cta_pair``) holds half of
    each K/V stage: tile_n / 2 keys of K or head_dim / 2 columns of V. e4m3: Q, K and V take one
    byte per element, the staged O (bf16 output) two. Backward: K, V (tile_n x d), Q, dO (tile_m x
    d), P^T and dS^T (tile_n x tile_m), 1 KiB-aligned each, plus mbarriers and the LSE/D rows of a
    step."""
    if spec.direction == "bwd":
        elements = 2 * (spec.tile_n + spec.tile_m) * spec.head_dim + 2 * spec.tile_n * spec.tile_m
        return elements * spec.elem_bytes + 7 * SMEM_RESERVE
    ring_rows = spec.tile_n // 2 if spec.options.cta_pair else spec.tile_n
    operands = (spec.tile_m + spec.stages * ring_rows) * spec.head_dim * spec.elem_bytes
    out_bytes = 2  # fp16/bf16 output; e4m3 inputs give bf16 output
    staged_rows = 0 if spec.features.varlen else 128  # varlen: the correction warps store O from registers
    return operands + staged_rows * spec.head_dim * out_bytes + 4 * SMEM_RESERVE


def sm100_registers(spec: VariantSpec) -> int:
    """Forward: a softmax thread owns one query row: tile_n fp32 scores, P converted 32 scores at a
    time. Backward: :data:`SM100_BWD_REGISTERS`."""
    if spec.direction == "bwd":
        return SM100_BWD_REGISTERS
    return spec.tile_n + SM100_SOFTMAX_OVERHEAD


def sm100_over_budget(spec: VariantSpec) -> str | None:
    """Why ``spec`` does not fit an SM's TMEM, a B200 block's shared memory or (forward) a softmax
    thread's registers, or None."""
    cols = sm100_tmem_columns(spec)
    if cols > SM100_TMEM_COLUMNS:
        parts = (
            "S^T + dP^T + dK + dV"
            if spec.direction == "bwd"
            else (f"{spec.tile_m // 128} x (S {spec.tile_n} + O {spec.head_dim})")
        )
        return f"needs {cols} TMEM columns ({parts}), over the {SM100_TMEM_COLUMNS} of an SM"
    needed = sm100_smem_bytes(spec)
    if needed > SM100_SMEM_LIMIT:
        return f"needs {needed / 1024:.1f} KiB of shared memory, over the {SM100_SMEM_LIMIT // 1024} KiB of a B200 block"
    estimate = sm100_registers(spec)
    if spec.direction == "fwd" and estimate > SM100_SOFTMAX_REGS:
        return f"a softmax thread would need ~{estimate} registers, over its {SM100_SOFTMAX_REGS}"
    if spec.direction == "fwd" and spec.options.cta_pair and sm100_score_features(spec):
        # Calibrated on compiled SASS (sm_100a, DSL 4.8.1): with every feature the pair's softmax
        # warps spill 8-104 bytes at head dims 128-256, softcap + ALiBi alone 72 at 192; the single-CTA
        # twins (192 registers per softmax thread) and the pair with varlen alone compile clean.
        return (
            f"cta_pair with {' + '.join(sm100_score_features(spec))}: the pair's softmax warps spill registers "
            "(compiled SASS); these features run single-CTA (the pair takes varlen alone)"
        )
    return None


def sm100_score_features(spec: VariantSpec) -> list[str]:
    """The local window and the score modifiers (softcap, ALiBi, sinks) a forward spec has, by name."""
    names = ["local"] if spec.mask is Mask.LOCAL else []
    return names + [name for name in ("softcap", "alibi", "sinks") if getattr(spec.features, name)]
