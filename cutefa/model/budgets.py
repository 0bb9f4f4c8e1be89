"""What the families' resource models share: the shared-storage alignment reserve, the per-block
shared-memory limit of each compile target's GPUs, and the layout of the backward's fp32 dQ
workspace.

Each family's own models (shared memory, registers, TMEM) are in :mod:`cutefa.model.budgets_sm80`,
:mod:`cutefa.model.budgets_sm90` and :mod:`cutefa.model.budgets_sm100`.
"""

from __future__ import annotations

from cutefa.model.options import DqLayout, DqPath
from cutefa.model.spec import VariantSpec

SMEM_RESERVE = 1024  # alignment slack of the shared-storage struct (1 KiB swizzle atoms)

# Per-block opt-in shared memory (cudaDevAttrMaxSharedMemoryPerBlockOptin) of the GPUs of each
# compile target: a variant runs on a target only if its shared memory fits
# (:func:`cutefa.model.rules.why_not_on`). The sm80 family runs on all of them, so its rule admits
# the largest (H100/H200/B200); tiles above the A100's 163 KiB run on sm_90a and newer only, as
# FlashAttention-2 picks its hd256 backward tile by the device's limit.
TARGET_SMEM_LIMITS: dict[str, int] = {
    "sm_80": 163 * 1024,  # A100
    "sm_86": 99 * 1024,  # RTX 30xx / A40 / A10
    "sm_89": 99 * 1024,  # RTX 40xx / L40 / L4
    "sm_90a": 227 * 1024,  # H100 / H200
    "sm_100a": 227 * 1024,  # B200 (232448 B; the DSL's capacity for sm_100)
    "sm_103a": 227 * 1024,  # B300
}


def bwd_dq_accum_shape(
    spec: VariantSpec, splits: int, batch: int, seqlen_q: int, heads_q: int
) -> tuple[int, ...]:
    """Shape of the fp32 dQ workspace of a backward variant. Default layout (splits, batch,
    seqlen_q, heads_q, head_dim). The sm90 bulk dQ paths (``dq_path`` other than RED) and the sm80
    fragment-order layout (``dq_layout=TILE``): (splits, batch, heads_q, query blocks, tile_m *
    head_dim), seqlen_q rounded up to whole query blocks; each block one contiguous chunk in the dQ
    MMA's fragment order: the bulk path the consumers' pieces one after the other, each in its WGMMA
    fragment's order (cutefa/kernels/sm90/bwd_parts.py,
    :func:`~cutefa.kernels.sm90.bwd_parts.bulk_dq_coords`); TILE every thread's mma.sync fragment
    (cutefa/kernels/sm80/dq_tile.py)."""
    bulk = getattr(spec.options, "dq_path", DqPath.RED) is not DqPath.RED
    tiled = getattr(spec.options, "dq_layout", DqLayout.ROWS) is DqLayout.TILE
    if not (bulk or tiled):
        return (splits, batch, seqlen_q, heads_q, spec.head_dim)
    blocks = -(-seqlen_q // spec.tile_m)
    return (splits, batch, heads_q, blocks, bwd_dq_chunk_words(spec))


# The column step a family's tiles pad a head dim to, where it pads one in the backward: the sm80
# family's 32-column shared-memory atom (budgets_sm80.SM80_HEAD_DIM_ATOM, which imports this module).
BWD_HEAD_DIM_ATOM = {"sm80": 32}


def bwd_dq_chunk_words(spec: VariantSpec) -> int:
    """Words of one query block's chunk of the tiled dQ workspace: tile_m times the head dim of the
    kernel's tiles (the sm80 family pads a head dim to its 32-column atoms,
    :func:`cutefa.model.budgets_sm80.sm80_tile_head_dim`; the pad columns' words stay zero)."""
    atom = BWD_HEAD_DIM_ATOM.get(spec.arch, 1)
    return spec.tile_m * (-(-spec.head_dim // atom) * atom)
