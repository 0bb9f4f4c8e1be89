"""TRANSITION ONLY: the variant space moved to :mod:`cutefa.model`; this module re-exports the names
other modules still import from here, until every import names the new place. Map:

cutefa.model.rules (the one validity predicate)
    why_invalid, why_no_kernel, why_not_on, fitting_variant, valid_variants, smem_bytes,
    est_registers, IMPLEMENTED; ``_wide_vt_rule`` -> ``_sm90_fp8_wide_transpose``
cutefa.model.defaults (default_config per family, the candidate grid)
    Tile, default_tile, default_extras (option fields by name), DEFAULT_TILES, DEFAULT_BWD_TILES;
    new: Config, default_config, default_spec, small_smem_configs (was SMALL_SMEM_BWD_TILES),
    candidate_grid, FP8_FAMILIES
cutefa.model.committed (the committed set: what dispatch can run)
    default_variants, candidates, fp8_block_specs, BLOCK_QUANT_FAMILIES; new: tuned_variants
cutefa.model.budgets
    SMEM_RESERVE, TARGET_SMEM_LIMITS, bwd_dq_accum_shape
cutefa.model.budgets_sm80
    SM80_SMEM_LIMIT, SM80_FAMILY_SMEM_LIMIT, MAX_REGISTERS, SM80_REG_OVERHEAD,
    SM80_BWD_REG_OVERHEAD; new: sm80_smem_bytes, sm80_registers
cutefa.model.budgets_sm90
    SM90_SMEM_LIMIT, SM90_CONSUMER_REGS, SM90_CONSUMER_REGS_3WG, SM90_REG_OVERHEAD,
    SM90_3WG_NO_SPILL, SM90_PCVT_NO_SPILL, SM90_FP8_CONSUMER_REGS, SM90_FP8_CONSUMER_REGS_HOISTED,
    SM90_FP8_MMA_K, SM90_FP8_TRANSPOSE_THREADS, SM90_BWD_* constants, sm90_consumer_regs,
    sm90_3wg_compiled, sm90_pcvt_compiled, sm90_fp8_consumer_regs, sm90_fp8_producer_regs,
    sm90_fp8_ptxas_options, sm90_bwd_* functions; new: SM90_FP8_NO_SPILL, sm90_fp8_compiled
    (what fp8_alternative_specs did for the register rule), sm90_smem_bytes, sm90_registers
cutefa.model.budgets_sm100
    SM100_* constants (SM100_BWD_TILE is a plain tuple), sm100_tmem_columns, sm100_smem_bytes
    (both also for the backward: sm100_bwd_tmem_columns and sm100_bwd_smem_bytes are these),
    sm100_registers
cutefa.model.spec
    VariantSpec, HEAD_DIMS
tools/alternatives.py (measured alternatives, not dispatchable; not importable from library code)
    SCHEDULE_ALTERNATIVES, TILE_SCHEDULE_ALTERNATIVES (with TUNING_ALTERNATIVES["sm90"]),
    SM80_TUNING_ALTERNATIVES, FP8_ALTERNATIVES, PAIR_ALTERNATIVES,
    SM80_BWD_TUNING_ALTERNATIVES (with LARGE_SMEM_BWD_ALTERNATIVES), SM90_BWD_ALTERNATIVES and
    SM80_BWD_ALTERNATIVES (were BWD_ALTERNATIVES), SM90_FP16_BWD_ALTERNATIVES (was
    BWD_DTYPE_ALTERNATIVES), fp8_alternative_specs, alternative_variants, all_variants
removed (flag tables replaced by the default_config functions; dead)
    DEFAULT_FLAGS, DEFAULT_DTYPE_FLAGS, DEFAULT_DTYPE_TILES, DEFAULT_DTYPE_SCHEDULES,
    DEFAULT_EXP_EMU, DEFAULT_BWD_FLAGS, DEFAULT_BWD_HEAD_DIM_FLAGS, DEFAULT_BWD_SWAP_FLAGS,
    DEFAULT_BWD_SPLIT_FLAGS, DEFAULT_ONLY_DTYPES, TUNING_ALTERNATIVE_DTYPES, BWD_ALTERNATIVE_DTYPES
"""

from cutefa.model.budgets import SMEM_RESERVE, TARGET_SMEM_LIMITS, bwd_dq_accum_shape  # noqa: F401
from cutefa.model.budgets_sm80 import (  # noqa: F401
    MAX_REGISTERS,
    SM80_BWD_REG_OVERHEAD,
    SM80_FAMILY_SMEM_LIMIT,
    SM80_REG_OVERHEAD,
    SM80_SMEM_LIMIT,
)
from cutefa.model.budgets_sm90 import (  # noqa: F401
    SM90_3WG_NO_SPILL,
    SM90_BWD_DQ_SWAP_HEAD_DIMS,
    SM90_BWD_DQ_SWAP_REG_OVERHEAD,
    SM90_BWD_DQ_SWAP_TILE_M,
    SM90_BWD_HEAD_DIMS,
    SM90_BWD_REG_OVERHEAD,
    SM90_BWD_SPLIT_HEAD_DIMS,
    SM90_BWD_SPLIT_TILE_N,
    SM90_BWD_SWAP_HEAD_DIMS,
    SM90_BWD_SWAP_REG_OVERHEAD,
    SM90_BWD_SWAP_TILE_N,
    SM90_BWD_TILE_N,
    SM90_BWD_WARPS,
    SM90_CONSUMER_REGS,
    SM90_CONSUMER_REGS_3WG,
    SM90_FP8_CONSUMER_REGS,
    SM90_FP8_CONSUMER_REGS_HOISTED,
    SM90_FP8_MMA_K,
    SM90_FP8_TRANSPOSE_THREADS,
    SM90_PCVT_NO_SPILL,
    SM90_REG_OVERHEAD,
    SM90_SMEM_LIMIT,
    sm90_3wg_compiled,
    sm90_bwd_dq_bulk_aliases,
    sm90_bwd_dq_bulk_bytes,
    sm90_bwd_dq_pieces,
    sm90_bwd_dq_swap_smem_bytes,
    sm90_bwd_dq_swapped,
    sm90_bwd_head_split,
    sm90_bwd_registers,
    sm90_bwd_smem_bytes,
    sm90_bwd_split_registers,
    sm90_bwd_swap_registers,
    sm90_bwd_swap_smem_bytes,
    sm90_bwd_swapped,
    sm90_consumer_regs,
    sm90_fp8_consumer_regs,
    sm90_fp8_producer_regs,
    sm90_fp8_ptxas_options,
    sm90_pcvt_compiled,
)
from cutefa.model.budgets_sm100 import (  # noqa: F401
    SM100_BWD_REGISTERS,
    SM100_FP8_MMA_K,
    SM100_FP8_V_MN_STEP,
    SM100_PAIR_MIN_HEAD_DIM,
    SM100_SMEM_LIMIT,
    SM100_SOFTMAX_OVERHEAD,
    SM100_SOFTMAX_REGS,
    SM100_TMEM_COLUMNS,
    SM100_WARPS,
    sm100_smem_bytes,
    sm100_tmem_columns,
)
from cutefa.model.budgets_sm100 import sm100_smem_bytes as sm100_bwd_smem_bytes  # noqa: F401
from cutefa.model.budgets_sm100 import sm100_tmem_columns as sm100_bwd_tmem_columns  # noqa: F401
from cutefa.model.committed import BLOCK_QUANT_FAMILIES, candidates, default_variants, fp8_block_specs  # noqa: F401
from cutefa.model.defaults import (  # noqa: F401
    DEFAULT_BWD_TILES,
    DEFAULT_TILES,
    FP8_FAMILIES,
    Tile,
    default_extras,
    default_tile,
)
from cutefa.model.rules import (  # noqa: F401
    IMPLEMENTED,
    est_registers,
    fitting_variant,
    smem_bytes,
    valid_variants,
    why_invalid,
    why_no_kernel,
    why_not_on,
)
from cutefa.model.rules import _sm90_fp8_wide_transpose as _wide_vt_rule  # noqa: F401
from cutefa.model.spec import HEAD_DIMS, VariantSpec  # noqa: F401
