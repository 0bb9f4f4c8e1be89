"""The sm90 family's resource models (FlashAttention-3 design: TMA + WGMMA + warp specialization):
shared memory, registers per consumer thread and the setmaxnreg splits, for the 16-bit and e4m3
forwards and the backward's partitions, with the compiled SASS that calibrated them.

Where the register estimate is known to be pessimistic for a shape that has been compiled, the
compiled form is listed (``*_NO_SPILL``) and stands in for the estimate; a compile test checks each.
"""

from __future__ import annotations

from cutefa.model.budgets import SMEM_RESERVE, TARGET_SMEM_LIMITS
from cutefa.model.options import (
    DqPath,
    OAccum,
    Quant,
    RowSum,
    Schedule,
    Scheduler,
    Sm90Fp8FwdOptions,
    Sm90FwdOptions,
    VTranspose,
)
from cutefa.model.spec import VariantSpec

SM90_SMEM_LIMIT = TARGET_SMEM_LIMITS["sm_90a"]  # H100/H200 per-block opt-in limit
SM90_CONSUMER_REGS = 240  # setmaxnreg budget of a consumer warpgroup (producer keeps 24)
SM90_CONSUMER_REGS_3WG = 160  # with three consumer warpgroups: 24 x 128 + 160 x 384 <= 64K registers
SM90_REG_OVERHEAD = 48  # row max/sum, descriptors, pipeline state, addresses

# ---------------------------------------------------------------------------------------------
# Forward, 16-bit

# With three consumer warpgroups (160 registers each) the same overhead held on compiled SASS
# (sm_90a, DSL 4.8.1) while a masked block's scores were selected through a branch per element:
# hd64 192x112 overlap (estimate 164) spilled 1-5 registers in fp16 (none in bf16), 192x128 (176)
# spilled 9 in bf16. The model stays as it is for the tiles nobody has compiled; the entries below
# have been, and stand in for it.
# Three-consumer forwards (tile_m 192, 160 registers per consumer thread) that compile for sm_90a
# with no spill and keep the uniform datapath, fp16 and bf16, causal or not, with or without
# ping-pong: (head_dim, tile_n) of the overlap schedule, exp_emu 0, not persistent. The overhead
# above is what ptxas spends with a 240-register budget (it schedules more freely when it may);
# held to 160, hd64 192x128 peaks at 151-152 registers (S 64 + P 32 + O 32 fp32/packed registers
# and ~24 of state), with the mask a select per element (kernels/common/mask.py) and the mask's row
# taken from the thread index (templates/fwd_sm90.py.j2). Checked by
# tests/test_compile_sm90_fwd_hd64_192.py.
SM90_3WG_NO_SPILL: frozenset[tuple[int, int]] = frozenset({(64, 128)})
# Two-consumer forwards whose key tile the estimate rejects but which compile for sm_90a with no
# spill, six WGMMA arrives and waits and the uniform datapath kept, fp16 and bf16, causal or not:
# (head_dim, tile_n) of the overlap + ping-pong schedule with P converted two scores per
# instruction (pair_cvt), exp_emu 0, not persistent. hd128 128x176 (FlashAttention-3's non-causal
# hd128 tile) peaks at R230-R236 of 240 and 128x192 at R234-R236; without pair_cvt 128x176 spills
# (182 local loads and stores) and ptxas issues P V one k-step at a time (36 arrives). Checked by
# tests/test_compile_sm90_fwd_pcvt.py.
SM90_PCVT_NO_SPILL: frozenset[tuple[int, int]] = frozenset({(128, 176), (128, 192)})


# The 16-bit forward computes on head dims padded to WGMMA's k step (16 elements of a 16-bit operand;
# V's N = the V head dim then also a multiple of 16, as the stmatrix epilogue and the 32-byte swizzle
# atom want): templates/fwd_sm90.py.j2 with cutefa/kernels/sm90/head_dims.py.
SM90_HEAD_DIM_STEP = 16
# The key tiles a head dim of its own may take (two consumers, two stages), widest first: up to
# FlashAttention-3's 128 of head dims <= 192 (its 128 x 128 tile of DeepSeek's (192, 128)).
SM90_OWN_HEAD_DIM_TILE_N = (128, 112, 96, 80, 64)


def sm90_fwd_tile_head_dims(spec: VariantSpec) -> tuple[int, int]:
    """(Q/K, V) head dims an sm90 forward's tiles take: the spec's own, padded to
    :data:`SM90_HEAD_DIM_STEP` for the 16-bit kernel (e4m3: unpadded; its rules take the standard
    head dims only)."""
    if spec.dtype == "e4m3":
        return spec.head_dim, spec.head_dim_v
    step = SM90_HEAD_DIM_STEP
    return -(-spec.head_dim // step) * step, -(-spec.head_dim_v // step) * step


def sm90_fwd_own_tile_n(dtype: str, head_dim: int, head_dim_v: int | None = None) -> int | None:
    """The key tile of a 16-bit sm90 forward at a head dim of its own (not one of the standard
    head dims, or a V head dim apart): the widest of :data:`SM90_OWN_HEAD_DIM_TILE_N` whose
    128 x tile_n two-stage overlap + ping-pong tile the budget model accepts; None if none does."""
    options = Sm90FwdOptions(schedule=Schedule.OVERLAP_PINGPONG)
    for tile_n in SM90_OWN_HEAD_DIM_TILE_N:
        spec = VariantSpec(
            "sm90", "fwd", dtype, head_dim, 128, tile_n, 2, 12, head_dim_v=head_dim_v, options=options
        )
        if sm90_fwd_over_budget(spec) is None:
            return tile_n
    return None


def sm90_consumer_regs(spec: VariantSpec) -> int:
    """setmaxnreg budget of one consumer thread: 240 with up to two consumer warpgroups, 160 with three."""
    return SM90_CONSUMER_REGS_3WG if spec.tile_m // 64 == 3 else SM90_CONSUMER_REGS


def sm90_3wg_compiled(spec: VariantSpec) -> bool:
    """Whether ``spec`` is a three-consumer 16-bit forward of :data:`SM90_3WG_NO_SPILL`."""
    o = spec.options
    return (
        (spec.arch, spec.direction) == ("sm90", "fwd")
        and spec.dtype in ("fp16", "bf16")
        and spec.tile_m == 192
        and (spec.head_dim, spec.tile_n) in SM90_3WG_NO_SPILL
        and o.schedule.overlap
        and o.scheduler is not Scheduler.PERSISTENT
        and o.exp_emu == 0
    )


def sm90_pcvt_compiled(spec: VariantSpec) -> bool:
    """Whether ``spec`` is a two-consumer paired-conversion 16-bit forward of :data:`SM90_PCVT_NO_SPILL`."""
    o = spec.options
    return (
        (spec.arch, spec.direction) == ("sm90", "fwd")
        and spec.dtype in ("fp16", "bf16")
        and spec.tile_m == 128
        and (spec.head_dim, spec.tile_n) in SM90_PCVT_NO_SPILL
        and o.schedule is Schedule.OVERLAP_PINGPONG
        and o.pair_cvt
        and not o.early_rescale
        and o.scheduler is not Scheduler.PERSISTENT
        and o.exp_emu == 0
    )


# ---------------------------------------------------------------------------------------------
# Forward, e4m3

# The producer warpgroup keeps 40 registers for the on-chip V transpose, so the two consumer
# warpgroups get 232 (40 * 128 + 232 * 256 = 168 * 384, what the CTA holds at launch).
SM90_FP8_CONSUMER_REGS = 232
# With the hoisted 32-bit transpose (VTranspose.HOISTED) the producer fits 24 registers (it peaks
# at R17-R27 on sm_90a with 40 to spare, at R21 when held to 24), so a tile that needs it can give
# the consumers 240 (24 * 128 + 240 * 256 = 168 * 384, as in the 16-bit kernels); the wide
# transpose's producer peaks at R35 and keeps 40. setmaxnreg only moves registers inside the CTA's
# launch allocation: a split that adds up to more than 168 * 384 (e.g. 32 * 128 + 240 * 256) makes
# the consumers' increase wait forever (tests/test_register_pool.py).
SM90_FP8_CONSUMER_REGS_HOISTED = 240
SM90_FP8_MMA_K = 32  # k of an fp8 WGMMA: P V steps over keys 32 at a time
SM90_FP8_TRANSPOSE_THREADS = 128  # the producer warpgroup that transposes V (parts.WG_THREADS)


def _hoisted(schedule: Schedule, **fields: object) -> Sm90Fp8FwdOptions:
    return Sm90Fp8FwdOptions(schedule=schedule, v_transpose=VTranspose.HOISTED, **fields)


_LAZY = {"lazy_rescale": True}
_PERSIST_LAZY = {"lazy_rescale": True, "scheduler": Scheduler.PERSISTENT}
# e4m3 forwards whose register estimate is over their budget but which compile for sm_90a with no
# spill, causal or not: (head_dim, tile_m, tile_n, stages) -> the option records compiled.
# hd128 192x96: three consumer warpgroups at 160 registers (estimate 172; R157, causal R147 with
# the select mask). hd256 128x128: FlashAttention-3's fp8 hd256 tile at 240 (estimate 256; R231).
# Checked by tests/test_compile_sm90_fp8.py.
SM90_FP8_NO_SPILL: dict[tuple[int, int, int, int], frozenset[Sm90Fp8FwdOptions]] = {
    (128, 192, 96, 2): frozenset(
        _hoisted(Schedule.OVERLAP, **fields)
        for fields in (
            {},
            _LAZY,
            {**_LAZY, "v_mean": True},
            {**_LAZY, "o_accum": OAccum.TWO_LEVEL},
            {**_LAZY, "row_sum": RowSum.MMA},
            {**_LAZY, "row_sum": RowSum.MMA, "o_accum": OAccum.TWO_LEVEL},
            _PERSIST_LAZY,
            {**_PERSIST_LAZY, "v_mean": True},
            {**_PERSIST_LAZY, "o_accum": OAccum.TWO_LEVEL},
        )
    ),
    (256, 128, 128, 2): frozenset(
        _hoisted(Schedule.OVERLAP_PINGPONG, **fields) for fields in ({}, _LAZY, _PERSIST_LAZY)
    ),
}


def sm90_fp8_compiled(spec: VariantSpec) -> bool:
    """Whether ``spec`` is an e4m3 forward of :data:`SM90_FP8_NO_SPILL`."""
    if (spec.arch, spec.direction, spec.dtype) != ("sm90", "fwd", "e4m3"):
        return False
    key = (spec.head_dim, spec.tile_m, spec.tile_n, spec.stages)
    return spec.options in SM90_FP8_NO_SPILL.get(key, frozenset())


def sm90_fp8_consumer_regs(spec: VariantSpec) -> int:
    """The consumers' setmaxnreg budget of an sm90 fp8 forward (the producer gets the rest of the
    CTA's launch allocation): with two consumers (168 x 384) 240 where the tile's estimate exceeds
    232 and the hoisted 32-bit transpose lets the producer give up 16 more registers (24 left), 232
    otherwise (every default); with three (tile_m 192, 128 x 512 at launch) the 16-bit kernels'
    three-consumer budget, 160 (the producer keeps 32: 32 * 128 + 160 * 384 = 128 * 512). 160 holds
    O and S at hd128 with up to 96 keys (192x96 peaks at R157 on sm_90a, 192x128 spills)."""
    if spec.tile_m == 192:
        return sm90_consumer_regs(spec)
    if spec.options.v_transpose is VTranspose.HOISTED and sm90_registers(spec) > SM90_FP8_CONSUMER_REGS:
        return SM90_FP8_CONSUMER_REGS_HOISTED
    return SM90_FP8_CONSUMER_REGS


def sm90_fp8_producer_regs(spec: VariantSpec) -> int:
    """The producer warpgroup's setmaxnreg budget of an sm90 fp8 forward: what the CTA's launch
    allocation (65536 / threads rounded down to 8 registers, times threads) leaves beside the
    consumer warpgroups' :func:`sm90_fp8_consumer_regs` (40 beside two at 232, 24 beside two at 240,
    32 beside three at 160)."""
    launch = 65536 // spec.threads // 8 * 8
    consumers = spec.tile_m // 64
    return (launch * spec.threads - consumers * 128 * sm90_fp8_consumer_regs(spec)) // 128


def sm90_fp8_ptxas_options(spec: VariantSpec) -> str:
    """Extra ptxas options of an sm90 e4m3 forward (templates/fwd_sm90_fp8.py.j2 renders them as
    PTXAS_OPTIONS): ``-regUsageLevel 3`` for the tiles on which ptxas, at its default level, gives
    up the uniform datapath since P is converted a register at a time (fp8.convert_p): WGMMA
    descriptors and pipeline state in regular registers, 150-290 R2UR, ~450 more instructions,
    and spills in some (hd256 128x64 causal, hd192 causal with block quantization, hd128 128x128
    non-causal with 3 stages with the indexed or the wide transpose). Level 3 keeps them uniform;
    on the other tiles it costs instructions (hd256 128x96: +10 per key block), so it is not the
    rule. tests/test_compile_sm90_fp8.py bounds every variant's R2UR count."""
    o = spec.options
    narrow_causal = spec.causal and spec.head_dim == 256 and spec.tile_n == 64
    block_causal = spec.causal and o.quant is Quant.BLOCK and spec.head_dim == 192
    wide_s3 = (
        not spec.causal and spec.head_dim == 128 and (spec.tile_m, spec.tile_n, spec.stages) == (128, 128, 3)
        and o.v_transpose is not VTranspose.HOISTED
    )  # fmt: skip
    return "-regUsageLevel 3" if narrow_causal or block_causal or wide_s3 else ""


def sm90_smem_bytes(spec: VariantSpec) -> int:
    """Shared memory of one CTA. Forward: the Q tile plus ``stages`` buffers each of K and V (e4m3:
    and of the transposed V that the P V WGMMA reads; the ones operand of the row-sum WGMMA and the
    fp32 copy of O where those options are on; 16-bit persistent: O staged apart from Q, so that
    the next tile's Q loads during the epilogue; 16-bit with a V head dim wider than the Q/K one:
    O staged apart, as its slab outgrows a Q slab). 16-bit head dims as the tiles take them
    (:func:`sm90_fwd_tile_head_dims`): Q and K of the Q/K one, V of the V one. Backward:
    :func:`sm90_bwd_smem_bytes`."""
    if spec.direction == "bwd":
        return sm90_bwd_smem_bytes(spec)
    o = spec.options
    if spec.dtype == "e4m3":
        elements = (spec.tile_m + 3 * spec.stages * spec.tile_n) * spec.head_dim
        if o.row_sum is RowSum.MMA:  # the ones operand of the row-sum WGMMA (8 x tile_n), 1 KiB-aligned
            elements += -(-8 * spec.tile_n // 1024) * 1024
        if o.o_accum is OAccum.TWO_LEVEL:  # the fp32 copy of O (4 bytes per value)
            elements += 4 * spec.tile_m * spec.head_dim
        return elements * spec.elem_bytes + SMEM_RESERVE
    d, dv = sm90_fwd_tile_head_dims(spec)
    elements = (spec.tile_m + spec.stages * spec.tile_n) * d + spec.stages * spec.tile_n * dv
    if o.scheduler is Scheduler.PERSISTENT or dv > d:  # O staged apart from Q
        elements += spec.tile_m * dv
    return elements * spec.elem_bytes + SMEM_RESERVE


def sm90_registers(spec: VariantSpec) -> int:
    """Per consumer thread at the peak. Forward (a warpgroup owns 64 query rows): fp32 O (64 x d)
    and S (64 x tile_n) accumulators, P packed to 16 bit (e4m3: 8 bit) for the register-A WGMMA,
    and the softmax state. Backward: :func:`sm90_bwd_registers`."""
    if spec.direction == "bwd":
        return sm90_bwd_registers(spec)
    acc_o = 64 * sm90_fwd_tile_head_dims(spec)[1] // 128
    acc_s = 64 * spec.tile_n // 128
    p_regs = acc_s // 4 if spec.dtype == "e4m3" else acc_s // 2
    return acc_o + acc_s + p_regs + SM90_REG_OVERHEAD


def sm90_fwd_over_budget(spec: VariantSpec) -> str | None:
    """Why a forward ``spec`` does not fit the H100/H200's shared memory or its consumers'
    registers (the compiled forms of the ``*_NO_SPILL`` lists stand in for the estimate), or None."""
    needed = sm90_smem_bytes(spec)
    if needed > SM90_SMEM_LIMIT:
        return (
            f"needs {needed / 1024:.1f} KiB of shared memory, over the "
            f"{SM90_SMEM_LIMIT // 1024} KiB per-block opt-in limit of the H100/H200"
        )
    if sm90_fp8_compiled(spec) or sm90_3wg_compiled(spec) or sm90_pcvt_compiled(spec):
        return None  # compiled with no spill on sm_90a
    estimate = sm90_registers(spec)
    budget = sm90_fp8_consumer_regs(spec) if spec.dtype == "e4m3" else sm90_consumer_regs(spec)
    if estimate > budget:
        return f"would spill registers (estimated {estimate} > {budget} per consumer thread after setmaxnreg)"
    return None


# ---------------------------------------------------------------------------------------------
# Backward (templates/bwd_sm90*.py.j2, FlashAttention-3 design): one producer warpgroup (TMA of
# K/V once per key block, of Q/dO through a `stages`-deep ring) and two consumer warpgroups of 64
# keys each, so tile_n = 128 and warps = 12; tile_m query rows per step. dK and dV (64 x d fp32 per
# warpgroup) live in registers through the whole query loop, beside S^T and dP^T (64 x tile_m) and
# the 16-bit P^T/dS^T operands: hd64 takes 128 query rows per step, hd96 and hd128 64.

SM90_BWD_TILE_N = 128
SM90_BWD_WARPS = 12
SM90_BWD_HEAD_DIMS = (64, 96, 128)
# Head dims of their own on the same partition: every multiple of WGMMA's 16-element k step from 32
# to 128 (80 in Phi-2, StableLM and InternViT, 112), unpadded: S^T and dP^T step over the head dim
# 16 at a time, dK and dV take it as WGMMA's N, and each shared-memory operand takes the widest
# swizzle its rows' bytes allow (hd80's 160 and hd112's 224 bytes: 32-byte atoms,
# :func:`sm90_bwd_swizzle_columns`), which the TMA boxes follow. A multiple of 8 that is not one of
# 16 runs the sm80 backward.
SM90_BWD_HEAD_DIM_STEP = 16
SM90_BWD_OWN_HEAD_DIMS = tuple(range(32, 129, SM90_BWD_HEAD_DIM_STEP))
SM90_BWD_REG_OVERHEAD = 40  # descriptors, pipeline state, coordinates, LSE/D reads, addresses
SM90_BWD_SWAP_REG_OVERHEAD = 40  # as SM90_BWD_REG_OVERHEAD (sm90_bwd_swap_registers: SASS 226 vs 232)
# FlashAttention-4's non-causal hd128 tile: 80 query rows per step (tile_m not a multiple of 64, so
# dQ is computed transposed, dQ^T = K^T dS^T: each consumer 64 head-dim columns x tile_m queries on
# WGMMA's M x N; a bulk dQ path only). Its register model: S^T + dP^T (64 x 80 fp32) beside dK + dV.
SM90_BWD_DQ_SWAP_TILE_M = 80
SM90_BWD_DQ_SWAP_HEAD_DIMS = (128,)
# Calibrated on SASS (sm_90a, DSL 4.8.1): estimate 128 + 80 + 28 = 236; the consumers use 236
# (non-causal, R235) and 234 (causal) of their 240 registers, no spill, six WGMMA waits.
SM90_BWD_DQ_SWAP_REG_OVERHEAD = 28
# Head dims 192 and 256 (templates/bwd_sm90_hsplit.py.j2): fp32 dK + dV of 64 keys would take d
# registers per thread, so the two consumer warpgroups share the CTA's 64 keys instead and split the
# head dim of dK, dV and dQ between them (d/2 columns each); S^T and dP^T (64 keys x 64 queries) are
# split by queries (32 each), and P^T, dS^T go through shared memory so that each warpgroup reads
# all 64 queries of them as the K of its dV and dK WGMMAs. tile_n = 64, tile_m = 64.
SM90_BWD_SPLIT_TILE_N = 64
SM90_BWD_SPLIT_HEAD_DIMS = (192, 256)
# Head dim 192 with dK/dV on WGMMA's M axis (templates/bwd_sm90_swapkv.py.j2, FlashAttention-3's
# hd192 partition): a CTA owns 96 keys, each consumer warpgroup 48 of them for S, dP, dK and dV
# (computed as dK^T, dV^T: head_dim x 48, so no M = 64 key slab is needed); dQ split by head-dim
# columns (96 each) over all 96 keys. tile_n = 96, tile_m = 64, P and dS through shared memory.
# The same partition takes q/k of head dim 192 against v of 128 (DeepSeek's prefill,
# spec.HEAD_DIM_V_PAIRS) with DqPath.BULK_STAGED: V, dO and dV^T of their own head dim.
SM90_BWD_SWAP_TILE_N = 96
SM90_BWD_SWAP_HEAD_DIMS = (192,)


def _bulk(spec: VariantSpec) -> bool:
    return spec.options.dq_path is not DqPath.RED


def sm90_bwd_dq_swapped(spec: VariantSpec) -> bool:
    """Whether ``spec`` is the sm90 backward (templates/bwd_sm90.py.j2, tile_n = 128) with a query
    block that is not a multiple of WGMMA's 64-row M (tile_m = 80, FlashAttention-4's non-causal
    hd128 tile): dQ is computed transposed, dQ^T = K^T dS^T, consumer c owning head-dim columns
    [64 c, 64 c + 64) of all tile_m rows (WGMMA M = 64 columns, N = tile_m queries, K = the 128 keys;
    A = K^T and B = dS^T both MN-major in shared memory, the same bytes as the other tiles' dQ
    operands). Its dQ piece is the transposed fragment, so it goes out by a bulk dQ path only."""
    return (spec.arch, spec.direction, spec.tile_n) == (
        "sm90",
        "bwd",
        SM90_BWD_TILE_N,
    ) and spec.tile_m == SM90_BWD_DQ_SWAP_TILE_M


def sm90_bwd_head_split(spec: VariantSpec) -> bool:
    """Whether ``spec`` is the head-dim-split sm90 backward (templates/bwd_sm90_hsplit.py.j2): the
    two consumer warpgroups share tile_n = 64 keys and each owns half of the head dim."""
    return (spec.arch, spec.direction, spec.tile_n) == ("sm90", "bwd", SM90_BWD_SPLIT_TILE_N)


def sm90_bwd_swapped(spec: VariantSpec) -> bool:
    """Whether ``spec`` is the swapped-dK/dV sm90 backward (templates/bwd_sm90_swapkv.py.j2): 96
    keys per CTA, 48 per consumer warpgroup, dK^T and dV^T with the head dim on WGMMA's M axis."""
    return (spec.arch, spec.direction, spec.tile_n) == ("sm90", "bwd", SM90_BWD_SWAP_TILE_N)


def sm90_bwd_dq_pieces(spec: VariantSpec) -> tuple[tuple[int, int, int], ...] | None:
    """The dQ piece of each consumer warpgroup, (64-row block, first column, columns), or None
    where none fits. tile_m=128: one 64-row block each, all columns. tile_m=64: a column split at a
    swizzle-atom boundary of K (:func:`sm90_bwd_swizzle_columns`: 64 columns at head dims 64 and
    128, 32 at 96, 16 at 80 and 112): halves for head_dim 128, 64 + 32 for 96, 64 + 16 for 80,
    96 + 16 for 112; the second piece must tile the columns from its start.
    The head-dim split and the swapped-dK/dV partition: each consumer half the columns, all 64 rows."""
    if sm90_bwd_head_split(spec) or sm90_bwd_swapped(spec):
        half = spec.head_dim // 2
        return ((0, 0, half), (0, half, half))
    if spec.tile_m == 128:
        return ((0, 0, spec.head_dim), (1, 0, spec.head_dim))
    if sm90_bwd_dq_swapped(spec):  # dQ^T: each consumer 64 head-dim columns of all tile_m rows
        return ((0, 0, 64), (0, 64, 64))
    if spec.tile_m != 64:
        return None
    # the first piece: the narrowest run of whole atoms from half the columns on whose width the
    # second piece divides (the second starts at a whole multiple of its own width): hd96 64 + 32,
    # hd80 64 + 16, hd112 96 + 16
    atom = sm90_bwd_swizzle_columns(spec.head_dim, spec.elem_bytes)
    first = -(-spec.head_dim // 2 // atom) * atom
    while first < spec.head_dim and first % (spec.head_dim - first):
        first += atom
    second = spec.head_dim - first
    if second <= 0:
        return None
    return ((0, 0, first), (0, first, second))


def sm90_bwd_swizzle_columns(head_dim: int, elem_bytes: int = 2) -> int:
    """Columns of the swizzle atom of a head_dim-wide row in shared memory (the DSL's
    ``get_smem_layout_atom``: 128-, 64- or 32-byte swizzle, the widest that divides the row's bytes):
    64 at head dims 64 and 128, 32 at 96, 16 at 80 and 112."""
    row = head_dim * elem_bytes
    return next((sw for sw in (128, 64, 32) if row % sw == 0), 16) // elem_bytes  # 16: interleaved


def sm90_bwd_main_head_dim(head_dim: int) -> bool:
    """Whether the tile_n = 128 backward (templates/bwd_sm90.py.j2) takes ``head_dim``: the standard
    :data:`SM90_BWD_HEAD_DIMS` and :data:`SM90_BWD_OWN_HEAD_DIMS`."""
    return head_dim in SM90_BWD_HEAD_DIMS or head_dim in SM90_BWD_OWN_HEAD_DIMS


def sm90_bwd_smem_bytes(spec: VariantSpec) -> int:
    """K and V (tile_n x d), the Q and dO ring (stages x tile_m x d each), two dS buffers
    (tile_m x tile_n), 1 KiB-aligned each, plus the LSE2/D rows (two buffers) and mbarriers.
    The head-dim split (:func:`sm90_bwd_head_split`) also keeps two P^T buffers (tile_n x tile_m);
    its struct (the 1 KiB-aligned buffers, then the rows and mbarriers) is counted exactly, rounded
    up to its 1 KiB alignment as the DSL sizes it, plus the kernel's 1 KiB of static shared memory
    (every compiled sm_90a backward cubin has it): hd256 s2 and hd192 s3 need exactly the 232,448
    bytes of the opt-in limit (a 231,424-byte struct, Storage.size_in_bytes()). A bulk dQ path adds
    its 1 KiB-aligned staging buffers (:func:`sm90_bwd_dq_bulk_bytes`) to that struct: hd192 s2 then
    needs exactly the limit too (48 KiB more); hd256 s2 and hd192 s3 stage dQ in the Q/dO stage
    instead (:func:`sm90_bwd_dq_bulk_aliases`, no extra bytes)."""
    if sm90_bwd_head_split(spec):
        return _split_smem_bytes(spec, sm90_bwd_dq_bulk_bytes(spec))
    if sm90_bwd_swapped(spec):
        return sm90_bwd_swap_smem_bytes(spec)
    if sm90_bwd_dq_swapped(spec):
        return sm90_bwd_dq_swap_smem_bytes(spec)
    elements = 2 * spec.tile_n * spec.head_dim + 2 * spec.stages * spec.tile_m * spec.head_dim
    elements += 2 * spec.tile_m * spec.tile_n
    staged_dq = sm90_bwd_dq_bulk_bytes(spec)
    return elements * spec.elem_bytes + staged_dq + 4 * 2 * spec.tile_m * 4 + 6 * SMEM_RESERVE


def sm90_bwd_swap_do_stages(spec: VariantSpec) -> int:
    """Stages of the dO pipeline of the swapped backward with DqPath.BULK_STAGED (a pipeline of its
    own beside the Q ring): as many as the Q ring where the shared memory holds them, else one. At
    hd192 s2 a second 24 KiB dO stage would need 243 KiB, so one (FlashAttention-4's budget); at
    (192, 128) dO is 16 KiB a stage, and two fit in 215 KiB (FlashAttention-3/4's two dO stages for a
    V head dim of 128), so the next block's dO loads while this one's dK^T and dQ run. The other
    dQ paths load Q and dO into one ring of ``stages``."""
    if spec.options.dq_path is not DqPath.BULK_STAGED:
        return spec.stages
    if _swap_staged_smem_bytes(spec, spec.stages) <= SM90_SMEM_LIMIT:
        return spec.stages
    return 1


def _swap_staged_smem_bytes(spec: VariantSpec, do_stages: int) -> int:
    """:func:`sm90_bwd_swap_smem_bytes` of DqPath.BULK_STAGED with ``do_stages`` dO stages."""
    d, dv = spec.head_dim, spec.head_dim_v
    elements = spec.tile_n * (d + dv) + spec.stages * spec.tile_m * d + do_stages * spec.tile_m * dv
    elements += 2 * spec.tile_m * spec.tile_n
    staging = 4 * spec.tile_m * d
    rows = 2 * 2 * spec.tile_m * 4
    barriers = (2 + 2 * spec.stages + 2 * do_stages) * 8
    struct = elements * spec.elem_bytes + staging + rows + barriers
    return -(-struct // SMEM_RESERVE) * SMEM_RESERVE + SMEM_RESERVE


def sm90_bwd_swap_smem_bytes(spec: VariantSpec) -> int:
    """The swapped backward's struct: K and V (tile_n x d), the Q and dO ring (stages x tile_m x d
    each), one P buffer and two dS buffers (tile_m x tile_n), 1 KiB-aligned each, the LSE2/D rows
    and mbarriers, rounded up to 1 KiB, plus the kernel's 1 KiB of static shared memory. DqPath.BULK
    adds nothing: each consumer stages its fp32 dQ piece (64 x d/2) in its 16-bit tile of the
    current Q/dO stage (consumer 0 dO's, consumer 1 Q's: the same bytes).
    DqPath.BULK_STAGED (FlashAttention-4's budget): a Q ring of ``stages`` and a dO pipeline of
    :func:`sm90_bwd_swap_do_stages`, one P and one dS buffer, and the fp32 dQ staging of its own
    (tile_m x d: each consumer's 64 x d/2 piece); hd192 s2: 72 + 48 + 24 + 12 + 12 + 48 KiB of
    buffers, 219 KiB in all. V and dO take the V head dim: (192, 128) s2 36 + 24 + 48 + 32 (two dO
    stages) + 12 + 12 + 48 KiB, 215 KiB in all."""
    if spec.options.dq_path is DqPath.BULK_STAGED:
        return _swap_staged_smem_bytes(spec, sm90_bwd_swap_do_stages(spec))
    elements = 2 * spec.tile_n * spec.head_dim + 2 * spec.stages * spec.tile_m * spec.head_dim
    elements += 3 * spec.tile_m * spec.tile_n
    rows = 2 * 2 * spec.tile_m * 4
    barriers = (2 + 2 * spec.stages) * 8
    struct = elements * spec.elem_bytes + rows + barriers
    return -(-struct // SMEM_RESERVE) * SMEM_RESERVE + SMEM_RESERVE


def sm90_bwd_dq_swap_smem_bytes(spec: VariantSpec) -> int:
    """The tile_m = 80 struct (:func:`sm90_bwd_dq_swapped`) counted exactly as the template lays it
    out: mbarriers and the LSE2/D rows (two buffers each) first, then K, V, the Q and dO ring, two dS
    buffers and the fp32 dQ staging (tile_m x d), each 1 KiB-aligned, rounded up to 1 KiB, plus the
    kernel's 1 KiB of static shared memory. hd128 s2: a 2,048-byte head + 229,376 bytes of buffers =
    231,424, + 1 KiB = 232,448, exactly the opt-in limit (FlashAttention-4's budget for this tile:
    the same buffers)."""
    head = (2 + 2 * spec.stages) * 8
    head = -(-head // 16) * 16 + 2 * spec.tile_m * 4  # sLSE, 16-byte aligned
    head = -(-head // 16) * 16 + 2 * spec.tile_m * 4  # sD
    buffers = (
        2 * spec.tile_n * spec.head_dim + 2 * spec.stages * spec.tile_m * spec.head_dim
    ) * spec.elem_bytes
    buffers += 2 * spec.tile_m * spec.tile_n * spec.elem_bytes + sm90_bwd_dq_bulk_bytes(spec)
    struct = -(-head // SMEM_RESERVE) * SMEM_RESERVE + buffers
    return -(-struct // SMEM_RESERVE) * SMEM_RESERVE + SMEM_RESERVE


def _split_smem_bytes(spec: VariantSpec, staging: int) -> int:
    """The head-dim split's struct with ``staging`` bytes of 1 KiB-aligned dQ staging, rounded up to
    1 KiB, plus the kernel's 1 KiB of static shared memory (:func:`sm90_bwd_smem_bytes`)."""
    elements = 2 * spec.tile_n * spec.head_dim + 2 * spec.stages * spec.tile_m * spec.head_dim
    elements += 4 * spec.tile_m * spec.tile_n
    rows = 2 * 2 * spec.tile_m * 4  # LSE2 and D, two buffers each, fp32
    barriers = (2 + 2 * spec.stages) * 8
    struct = elements * spec.elem_bytes + staging + rows + barriers
    return -(-struct // SMEM_RESERVE) * SMEM_RESERVE + SMEM_RESERVE


def sm90_bwd_dq_bulk_aliases(spec: VariantSpec) -> bool:
    """Whether the bulk dQ path of the head-dim split stages dQ in the current Q/dO stage instead of
    buffers of its own (which would not fit: hd256 s2, hd192 s3). After the consumers' barrier a
    warpgroup's own head-dim columns of that stage (64 x d/2 of Q and of dO, 16-bit: exactly the
    bytes of its fp32 64 x d/2 dQ piece, each a run of whole swizzle-atom panels) are read only by
    its own dV and dK WGMMAs, and refilled only after it releases the stage: the piece goes out in
    two halves (dO's columns once dV is done, Q's once dK is), and the stage is released after the
    bulk copies have read them."""
    if not (_bulk(spec) and sm90_bwd_head_split(spec)):
        return False
    return _split_smem_bytes(spec, 4 * spec.tile_m * spec.head_dim) > SM90_SMEM_LIMIT


def sm90_bwd_dq_bulk_bytes(spec: VariantSpec) -> int:
    """Shared memory of a bulk dQ path: the fp32 dQ of one query block (tile_m x head_dim), each
    consumer's piece staged in its own buffer for the bulk reduce-add; 0 on the RED path and where
    the head-dim split stages it in the Q/dO stage (:func:`sm90_bwd_dq_bulk_aliases`)."""
    if not _bulk(spec) or sm90_bwd_dq_bulk_aliases(spec):
        return 0
    return 4 * spec.tile_m * spec.head_dim


def sm90_bwd_dkv_accum_shape(
    spec: VariantSpec, slots: int, batch: int, seqlen_k: int, heads_kv: int
) -> tuple[int, int, int, int, int]:
    """Shape of the fp32 grouped-query dK/dV workspace of an sm90 backward (cutefa/kernels/sm90/
    bwd_dkv.py): (slots, batch, heads_kv, key blocks, tile_n * (head_dim + head_dim_v)), seqlen_k
    rounded up to whole key blocks; per key block a chunk of dK (tile_n x head_dim), then one of dV
    (tile_n x head_dim_v), each the consumers' pieces in their WGMMA fragment's order. ``slots``: 1,
    or the group size in deterministic mode (one slot per query head of a group, summed in order by
    the conversion kernel)."""
    blocks = -(-seqlen_k // spec.tile_n)
    return (slots, batch, heads_kv, blocks, spec.tile_n * (spec.head_dim + spec.head_dim_v))


def sm90_bwd_registers(spec: VariantSpec) -> int:
    """Registers of a consumer thread at the peak (one warpgroup: 64 keys, 128 threads): fp32 dK
    and dV (64 x d each) for the whole query loop, beside fp32 S^T and dP^T (64 x tile_m each;
    the 16-bit P^T/dS^T replace them as they are formed, the dQ piece comes after them).
    Calibrated on compiled SASS (sm_90a, DSL 4.8.1): the defaults (estimates 232) compile within
    the 240 registers of setmaxnreg with no spill."""
    if sm90_bwd_head_split(spec):
        return sm90_bwd_split_registers(spec)
    if sm90_bwd_swapped(spec):
        return sm90_bwd_swap_registers(spec)
    acc_dkv = 2 * 64 * spec.head_dim // 128
    acc_sdp = 2 * 64 * spec.tile_m // 128
    if sm90_bwd_dq_swapped(spec):
        return acc_dkv + acc_sdp + SM90_BWD_DQ_SWAP_REG_OVERHEAD
    return acc_dkv + acc_sdp + SM90_BWD_REG_OVERHEAD


def sm90_bwd_split_registers(spec: VariantSpec) -> int:
    """The head-dim split's consumer thread at the peak: fp32 dK and dV of 64 keys x d/2 columns
    for the whole query loop, beside the larger of S^T + dP^T (64 keys x tile_m/2 queries each,
    with their 16-bit copies) and the fp32 dQ piece (64 queries x d/2 columns, formed after P^T and
    dS^T have gone to shared memory). Calibrated on compiled SASS (sm_90a, DSL 4.8.1): the
    defaults' consumers use 216 (hd256, estimate 232) and 168 (hd192, estimate 184) of their 240
    registers, no spill; the estimate stays 16 high (the 16-bit copies are short-lived)."""
    acc_dkv = 2 * 64 * (spec.head_dim // 2) // 128
    acc_sdp = 3 * 64 * (spec.tile_m // 2) // 128
    acc_dq = 64 * (spec.head_dim // 2) // 128
    return acc_dkv + max(acc_sdp, acc_dq) + SM90_BWD_REG_OVERHEAD


def sm90_bwd_swap_registers(spec: VariantSpec) -> int:
    """The swapped backward's consumer thread at the peak: fp32 dK^T (d x tile_n/2) and dV^T (d_v x
    tile_n/2) for the whole query loop, beside the larger of S + dP (tile_m x tile_n/2 each, fp32)
    and the fp32 dQ piece (64 queries x d/2 columns, after P and dS have gone to shared memory).
    Calibrated on compiled SASS (sm_90a, DSL 4.8.1): estimate 232; the consumers use 226 (non-causal)
    and 222-224 (causal) of their 240 registers, no spill, on the RED and BULK dQ paths. (192, 128):
    estimate 208 (dV^T of 128 rows: 24 registers fewer)."""
    keys = spec.tile_n // 2
    acc_dkv = (spec.head_dim + spec.head_dim_v) * keys // 128
    acc_sdp = 2 * spec.tile_m * keys // 128
    acc_dq = 64 * (spec.head_dim // 2) // 128
    return acc_dkv + max(acc_sdp, acc_dq) + SM90_BWD_SWAP_REG_OVERHEAD


def sm90_bwd_over_budget(spec: VariantSpec) -> str | None:
    """Why a backward ``spec`` does not fit its consumers' registers or the H100/H200's shared
    memory (each partition by its own model), or None."""
    estimate = sm90_bwd_registers(spec)
    if estimate > SM90_CONSUMER_REGS:
        return (
            f"would spill registers (estimated {estimate} > {SM90_CONSUMER_REGS} per consumer thread "
            "after setmaxnreg)"
        )
    needed = sm90_bwd_smem_bytes(spec)
    if needed > SM90_SMEM_LIMIT:
        return (
            f"needs {needed / 1024:.1f} KiB of shared memory, over the {SM90_SMEM_LIMIT // 1024} KiB "
            "per-block opt-in limit of the H100/H200"
        )
    return None
