"""The sm80 family's resource models (FlashAttention-2 design: mma.sync + cp.async): shared memory
and registers per thread, forward and backward, with the compiled SASS that calibrated them."""

from __future__ import annotations

from cutefa.model.budgets import SMEM_RESERVE, TARGET_SMEM_LIMITS
from cutefa.model.spec import VariantSpec

SM80_SMEM_LIMIT = TARGET_SMEM_LIMITS["sm_80"]  # A100 per-block opt-in limit: the family's defaults fit it
# The family runs on every target, so a variant is valid up to the largest of their limits
# (H100/H200/B200); :func:`cutefa.model.rules.why_not_on` holds it to each target's own.
SM80_FAMILY_SMEM_LIMIT = max(TARGET_SMEM_LIMITS.values())
MAX_REGISTERS = 255  # per thread
SM80_REG_OVERHEAD = 64  # row max/sum, Q/K/V operand fragments in flight, addresses, counters
SM80_BWD_REG_OVERHEAD = 48  # backward: LSE/D rows, operand fragments in flight, addresses
SM80_HEAD_DIM_ATOM = 32  # columns of the narrowest swizzled shared-memory atom (kernels.sm80.parts)
# Forward with a padded head dim: the column predicates of its copies. Calibrated on compiled SASS
# (sm_80, DSL 4.8.1): hd248 (tile head dim 256) 128x64 w8 causal spills 40 B where hd256 fits in
# 255 registers; hd248 128x32 w8 (246), hd200 128x64 w8 (250), hd40 128x64 w4 (254) and hd80
# 128x128 w8 (240) do not spill.
SM80_PAD_REG_OVERHEAD = 16


def sm80_tile_head_dim(head_dim: int) -> int:
    """The head dim of the sm80 kernels' tiles for a problem's ``head_dim``: the next multiple of
    :data:`SM80_HEAD_DIM_ATOM` (the shared-memory atoms, the warp grids' 16-column pieces and the
    k16 steps of Q K^T all divide it). The columns past ``head_dim`` are zero-filled in shared
    memory by predicated copies and never stored."""
    return -(-head_dim // SM80_HEAD_DIM_ATOM) * SM80_HEAD_DIM_ATOM


def sm80_smem_bytes(spec: VariantSpec) -> int:
    """Forward: the Q tile plus ``stages`` buffers each of K and V. Backward: Q (``stages``
    buffers) and dO (tile_m x d), K and V (tile_n x d), P and dS (tile_m x tile_n), 1 KiB-aligned
    each."""
    d, d_v = sm80_tile_head_dim(spec.head_dim), sm80_tile_head_dim(spec.head_dim_v)
    if spec.direction == "bwd":
        elements = spec.stages * spec.tile_m * d + spec.tile_m * d_v + spec.tile_n * (d + d_v)
        elements += 2 * spec.tile_m * spec.tile_n
        return elements * spec.elem_bytes + 6 * SMEM_RESERVE
    elements = spec.tile_m * d + spec.stages * spec.tile_n * (d + d_v)
    return elements * spec.elem_bytes + SMEM_RESERVE


def sm80_registers(spec: VariantSpec) -> int:
    """Registers per thread at the peak.

    Forward: fp32 O and S accumulators plus P (S packed to 16 bit), which ptxas keeps live beside
    S while it hoists the V ldmatrix loads. Calibrated on compiled SASS (sm_90a, DSL 4.8.1): hd128
    128x64 w4 (estimate 288) and hd96 128x64 w4 (256) spill; hd64 128x64 w4 (224), hd128 128x128
    w8 (224) and hd256 128x64 w8 (240) compile to <= 255 registers, no spill.

    Backward: fp32 dK and dV accumulators (tile_n x d) live throughout; at the peak beside them
    either S and dP (tile_m x tile_n each) or the dQ accumulator (tile_m x d). Calibrated on
    compiled SASS (sm_90a, DSL 4.8.1): the default tiles (estimates 192-240) compile with no spill.
    """
    d, d_v = sm80_tile_head_dim(spec.head_dim), sm80_tile_head_dim(spec.head_dim_v)
    if spec.direction == "bwd":
        acc_dkv = spec.tile_n * (d + d_v) // spec.threads
        acc_sdp = 2 * spec.tile_m * spec.tile_n // spec.threads
        acc_dq = spec.tile_m * d // spec.threads
        return acc_dkv + max(acc_sdp, acc_dq) + SM80_BWD_REG_OVERHEAD
    acc_o = spec.tile_m * d_v // spec.threads
    acc_s = spec.tile_m * spec.tile_n // spec.threads
    padded = (d, d_v) != (spec.head_dim, spec.head_dim_v)
    return acc_o + acc_s + acc_s // 2 + SM80_REG_OVERHEAD + SM80_PAD_REG_OVERHEAD * padded


def sm80_over_budget(spec: VariantSpec) -> str | None:
    """Why ``spec`` does not fit the family's shared memory or registers, or None."""
    needed = sm80_smem_bytes(spec)
    if needed > SM80_FAMILY_SMEM_LIMIT:
        return (
            f"needs {needed / 1024:.1f} KiB of shared memory, over the {SM80_FAMILY_SMEM_LIMIT // 1024} KiB "
            "per-block opt-in limit of the largest GPU that runs the sm80 family (H100/H200/B200)"
        )
    estimate = sm80_registers(spec)
    if estimate > MAX_REGISTERS:
        return f"would spill registers (estimated {estimate} > {MAX_REGISTERS} per thread)"
    return None
