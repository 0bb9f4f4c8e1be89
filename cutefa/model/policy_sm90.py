"""Code-generation policy of the sm90 family (FlashAttention-3 design): the choices a kernel's
schedule makes that no option names, decided here and written into the generated module as
constants (:mod:`cutefa.templating` hands them to the templates): register splits, ptxas options,
where the WGMMA descriptors are computed, how masks are applied, how tiles are ordered. Each
function says what measurement settled it.
"""

from __future__ import annotations

from cutefa.model.budgets_sm90 import (
    SM90_CONSUMER_REGS,
    sm90_consumer_regs,
    sm90_fp8_consumer_regs,
    sm90_fp8_producer_regs,
    sm90_fp8_ptxas_options,
    sm90_fwd_tile_head_dims,
)
from cutefa.model.options import Mask, Scheduler
from cutefa.model.spec import PACKED, VariantSpec

WG_ROWS = 64  # query rows of one consumer warpgroup (WGMMA's M)
PRODUCER_REGS = 24  # setmaxnreg of the 16-bit producer warpgroup (TMA issue only)
UNIFORM_DATAPATH_PTXAS = "-regUsageLevel 3"  # ptxas keeps the uniform datapath at levels 0-3
# Causal two-consumer forwards whose S x O accumulator columns (tile_n x head_dim) reach these lose
# the uniform datapath with descriptors held across the loop (with / without pair_cvt).
HOISTED_DESCRIPTOR_COLUMNS = 20480
HOISTED_DESCRIPTOR_COLUMNS_NO_PCVT = 18432


def consumers(spec: VariantSpec) -> int:
    """Consumer warpgroups of an sm90 forward: one per 64 query rows."""
    return spec.tile_m // WG_ROWS


def fwd_register_split(spec: VariantSpec) -> tuple[int, int]:
    """(producer, consumer) setmaxnreg budgets of an sm90 forward. 16-bit: the producer keeps 24
    and each consumer gets :func:`~cutefa.model.budgets_sm90.sm90_consumer_regs` (24 x 128 +
    240 x 256 fills the 168 x 384 launch allocation; three consumers 160); e4m3: the producer keeps
    what the V transpose needs (:func:`~cutefa.model.budgets_sm90.sm90_fp8_producer_regs`)."""
    if spec.dtype == "e4m3":
        return sm90_fp8_producer_regs(spec), sm90_fp8_consumer_regs(spec)
    return PRODUCER_REGS, sm90_consumer_regs(spec)


def bwd_register_split(spec: VariantSpec) -> tuple[int, int]:
    """(producer, consumer) setmaxnreg budgets of every sm90 backward: two consumers at 240."""
    return PRODUCER_REGS, SM90_CONSUMER_REGS


def fwd_ptxas_options(spec: VariantSpec) -> str:
    """Extra ptxas options of an sm90 forward ("" for none; cutefa.compile passes the module's
    PTXAS_OPTIONS). 16-bit: ``-regUsageLevel 3`` for causal three-consumer tiles with ping-pong or
    the 1-D longest-first grid: at its default level (above 3) ptxas gives them up the uniform
    datapath at 160 registers (WGMMA descriptors and pipeline state in regular registers, ~130 R2UR,
    ~55 more instructions per key block); levels 0-3 keep it (the packed batches' heavy-first grid,
    LPT's order, likewise). e4m3:
    :func:`~cutefa.model.budgets_sm90.sm90_fp8_ptxas_options`."""
    if spec.dtype == "e4m3":
        return sm90_fp8_ptxas_options(spec)
    o = spec.options
    if (
        consumers(spec) == 3
        and spec.mask is Mask.CAUSAL
        and (o.schedule.pingpong or o.scheduler in (Scheduler.LPT, Scheduler.HEAVY_FIRST))
    ):
        return UNIFORM_DATAPATH_PTXAS
    return ""


def fwd_hoisted_descriptors(spec: VariantSpec) -> bool:
    """Whether a 16-bit sm90 forward computes the WGMMA descriptors of Q, K and V once, before the
    key loop (descriptors.hoisted), rather than at each GEMM issue. Held across the loop, they make
    ptxas give up the uniform datapath on the causal two-consumer tiles with the widest S and O
    accumulators (tile_n x head_dim from 20480, from 18432 without pair_cvt: hd192) or the FMA exp2:
    200-300 R2UR, up to ~110 more instructions per key block, some WGMMAs serialized. Those rebuild
    them per issue, and so do the masked (causal or local) two-consumer tiles with feature
    arguments; every other tile hoists them."""
    o = spec.options
    if fwd_feature_args(spec) and spec.mask is not Mask.NONE and consumers(spec) == 2:
        # Masked two-consumer feature kernels (causal or local with varlen, softcap...): hoisted, the
        # default tiles of hd192 (causal with softcap or varlen: 250-260 R2UR, 11 spills) and hd256
        # (local: 390 R2UR) lose the uniform datapath; rebuilt per issue, 9-24 R2UR, no spill.
        return False
    columns = spec.tile_n * sm90_fwd_tile_head_dims(spec)[1]  # of the O accumulator
    wide = columns >= HOISTED_DESCRIPTOR_COLUMNS or (
        columns >= HOISTED_DESCRIPTOR_COLUMNS_NO_PCVT and not o.pair_cvt
    )
    return not (spec.mask is Mask.CAUSAL and consumers(spec) == 2 and (wide or o.exp_emu))


def fwd_mask_select(spec: VariantSpec) -> bool:
    """Whether an sm90 forward masks a key block with one select per score against thread 0's
    compile-time columns (the row from the thread index: ``apply_mask(..., cS0_mn)``), rather than
    a branch per score. Causal tiles select; so do the 16-bit three-consumer ones (at 160 registers
    the branch costs the uniform datapath). A non-causal two-consumer tile masks only its first
    (last, partial) key block, and there the select made ptxas schedule the unmasked loop worse
    (hd64 -3 to -11% on the H200), so it keeps the branch; the e4m3 kernel does the same."""
    if spec.mask is Mask.CAUSAL:
        return True
    return spec.dtype != "e4m3" and consumers(spec) == 3


def fwd_lpt_single_section(spec: VariantSpec) -> bool:
    """Whether the persistent e4m3 forward walks all (head, batch) pairs as one section of its
    longest-first order: causal, so that its boustrophedon rounds run down one order (sections
    restart it, and a round across a section boundary pairs long tiles with long); non-causal
    tiles take L2-sized sections (parts.lpt_group)."""
    return spec.mask is Mask.CAUSAL


def bwd_early_dv(spec: VariantSpec) -> bool:
    """Whether the overlapped sm90 backward issues dV as soon as P^T is formed: at tile_m 64 only.
    At tile_m 128 the fp32 S^T/dP^T and 16-bit P^T/dS^T of 64 x 128 would not fit beside dK/dV
    with P^T held for dV, and ptxas would serialize every WGMMA (insufficient register resources)."""
    return spec.options.overlap and spec.tile_m == WG_ROWS


def bwd_dq_transposed(spec: VariantSpec) -> bool:
    """Whether the sm90 backward (templates/bwd_sm90.py.j2) computes dQ transposed, dQ^T = K^T
    dS^T, each consumer 64 head-dim columns of all rows: where tile_m is not a multiple of WGMMA's
    64-row M (80, FlashAttention-4's non-causal hd128 tile)."""
    return spec.tile_m % WG_ROWS != 0


def bwd_separate_v(spec: VariantSpec) -> bool:
    """Whether an sm90 backward takes v of a head dim of its own (spec.HEAD_DIM_V_PAIRS; the
    swapped-dK/dV template, rules_sm90._sm90_bwd_separate_v): V, dO and dV^T tiles of that head dim,
    D = rowsum(dO * O) over it. Equal head dims render as before."""
    return spec.head_dim_v != spec.head_dim


def fwd_feature_args(spec: VariantSpec) -> bool:
    """Whether a 16-bit sm90 forward takes feature arguments after its own (cutefa.api.features:
    the local window's bounds or a feature axis): its module then defines its own
    ``fake_arguments`` for the compile."""
    return spec.features.any or spec.mask is Mask.LOCAL


def fwd_own_head_dims(spec: VariantSpec) -> bool:
    """Whether a 16-bit sm90 forward's tiles take head dims apart from the tensors' (kernels/sm90/
    head_dims.py): a head dim padded to WGMMA's k step (TMA zero-fills the pad columns and clips the
    O store), or a V head dim apart from the Q/K one. The standard head dims render as before."""
    d, dv = sm90_fwd_tile_head_dims(spec)
    return (d, dv) != (spec.head_dim, spec.head_dim) or spec.head_dim_v != spec.head_dim


def fwd_o_in_q_slab(spec: VariantSpec) -> bool:
    """Whether a 16-bit sm90 forward with head dims of its own stages O in the consumer's own Q slab
    (not persistent, and O's slab no wider than Q's); else O has a buffer of its own
    (:func:`~cutefa.model.budgets_sm90.sm90_smem_bytes` counts it)."""
    d, dv = sm90_fwd_tile_head_dims(spec)
    return spec.options.scheduler is not Scheduler.PERSISTENT and dv <= d


# A packed batch is uneven when its query rows fill at most this share of batch x max_seqlen_q.
UNEVEN_FILL = 0.5


def uneven_batch(batch: int, max_seqlen_q: int, total_q: int | None) -> bool:
    """Whether a packed batch of ``batch`` sequences, the longest ``max_seqlen_q`` rows, holds
    ``total_q`` packed rows of at most :data:`UNEVEN_FILL` of the padded size (a few long sequences
    among many short ones): shapes only, no read of the lengths. None: not known (every sequence
    taken as full)."""
    return total_q is not None and batch > 1 and total_q <= UNEVEN_FILL * batch * max_seqlen_q


def varlen_uneven(spec: VariantSpec) -> VariantSpec:
    """The variant an uneven packed batch runs instead of ``spec`` (the family default with the
    varlen axis): the 16-bit sm90 forward with nothing but varlen (no or the causal mask) on the LPT
    scheduler, its query tiles longest first in a 1-D grid. H100, bf16 hd128, TFLOP/s long-tail
    (16k tokens of long-tailed lengths) non-causal / causal, uniform 8 x 2k non-causal / causal:
    GRID 390 / 297 / 539 / 499, LPT 400 / 311 / 553 / 473 (+3% / +5% on the uneven batch, -5% on
    the uniform causal one, hence by evenness). Any other spec is returned as it is."""
    if (spec.arch, spec.direction) != ("sm90", "fwd") or spec.dtype == "e4m3":
        return spec
    if spec.features != PACKED or spec.mask not in (Mask.NONE, Mask.CAUSAL):
        return spec
    if spec.options.scheduler is not Scheduler.GRID:
        return spec
    return spec.replace(scheduler=Scheduler.LPT)


def fwd_varlen_from_dense(dense: VariantSpec, uneven: bool = False) -> VariantSpec | None:
    """The packed-batch variant that a 16-bit sm90 forward problem's dense choice carries over to
    (``dense``: the tuned table's variant of the same problem, max_seqlen_k as its length, mask
    included): its tile, stages and options (the tuned non-causal hd128 128x176 with pair_cvt, say)
    with the varlen axis, on the scheduler the packed batch's evenness asks for whatever scheduler
    the dense call runs: LPT for an uneven batch (:func:`uneven_batch`), the plain grid otherwise
    (the measurements of :func:`varlen_uneven`; the heavy-first grid measured within 3% of the plain
    one and is not taken). H100, bf16 hd128, TFLOP/s (two runs): the long-tailed batch non-causal on
    the table's 128x176 pcvt + LPT 465 / 448 against the default 128x128 + LPT 428 / 419 (+4-9%; FA4
    481 / 464); causal, the table's 128x160 pcvt + LPT 324 / 329 against 128x128 + LPT 350 / 348
    (-6%: a causal batch of mostly short sequences is mostly diagonal blocks, which the dense tuning
    at one length does not see), so an uneven causal batch keeps the default (None here).

    None for that, a variant of another family, an e4m3 one, one with features or a sliding window:
    dispatch then runs the family default with the varlen axis."""
    if (dense.arch, dense.direction) != ("sm90", "fwd") or dense.dtype == "e4m3" or dense.features.any:
        return None
    if dense.mask is Mask.LOCAL or (uneven and dense.mask is Mask.CAUSAL):
        return None
    scheduler = Scheduler.LPT if uneven else Scheduler.GRID
    return dense.replace(features=PACKED, scheduler=scheduler)


def fwd_varlen_forms(dense: VariantSpec) -> list[VariantSpec]:
    """Every packed form :func:`fwd_varlen_from_dense` makes of ``dense`` (an even and an uneven
    batch's, where it makes them): what a pack ships for the packed batches of its problem."""
    forms = (fwd_varlen_from_dense(dense, uneven) for uneven in (False, True))
    return [spec for spec in forms if spec is not None]
