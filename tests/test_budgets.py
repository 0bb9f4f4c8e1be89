"""The resource models: shared memory, registers and TMEM count what the templates allocate, the
setmaxnreg splits add up, and the compiled no-spill lists stand in for the estimate only in their
compiled form."""

from __future__ import annotations

import math

from cpu_support import load_tool

from cutefa.model import committed, defaults, rules
from cutefa.model.budgets import SMEM_RESERVE, TARGET_SMEM_LIMITS
from cutefa.model.budgets_sm80 import SM80_REG_OVERHEAD, SM80_SMEM_LIMIT
from cutefa.model.budgets_sm90 import (
    SM90_BWD_REG_OVERHEAD,
    SM90_CONSUMER_REGS,
    SM90_FP8_CONSUMER_REGS,
    SM90_FP8_NO_SPILL,
    SM90_REG_OVERHEAD,
    SM90_SMEM_LIMIT,
    sm90_bwd_dq_bulk_aliases,
    sm90_bwd_dq_pieces,
    sm90_bwd_head_split,
    sm90_bwd_registers,
    sm90_fp8_compiled,
    sm90_fp8_consumer_regs,
    sm90_fp8_producer_regs,
    sm90_fp8_ptxas_options,
)
from cutefa.model.budgets_sm100 import sm100_smem_bytes, sm100_tmem_columns
from cutefa.model.defaults import Tile, default_config
from cutefa.model.options import (
    DqPath,
    Quant,
    Schedule,
    Scheduler,
    Sm90BwdOptions,
    VTranspose,
)
from cutefa.model.spec import HEAD_DIMS, TARGETS, VariantSpec

ALT = load_tool("alternatives")
SM80 = VariantSpec("sm80", "fwd", "bf16", 64, 128, 64, 1, 4)
FP8 = VariantSpec("sm90", "fwd", "e4m3", 128, 128, 128, 2, 12, schedule=Schedule.OVERLAP_PINGPONG)
SM100_PAIR = VariantSpec("sm100", "fwd", "bf16", 128, 256, 128, 3, 16, cta_pair=True)
SM100_PAIR_EMU = SM100_PAIR.replace(exp_emu=25)
OV, OV_PP = Schedule.OVERLAP, Schedule.OVERLAP_PINGPONG


def _bwd90(head_dim: int, tile_m: int, tile_n: int, stages: int = 2, **options: object) -> VariantSpec:
    return VariantSpec("sm90", "bwd", "bf16", head_dim, tile_m, tile_n, stages, 12, **options)


def _reason(spec: VariantSpec) -> str:
    return rules.why_invalid(spec) or ""


def test_budgets():
    assert rules.smem_bytes(SM80) == (128 + 2 * 64) * 64 * 2 + SMEM_RESERVE
    assert rules.smem_bytes(SM80.replace(stages=2)) == (128 + 4 * 64) * 64 * 2 + SMEM_RESERVE
    assert rules.est_registers(SM80) == 64 + 64 + 32 + SM80_REG_OVERHEAD
    assert rules.est_registers(SM80.replace(warps=8)) == 32 + 32 + 16 + SM80_REG_OVERHEAD
    assert rules.est_registers(SM80.replace(arch="sm90", warps=12)) == 32 + 32 + 16 + SM90_REG_OVERHEAD
    # the persistent 16-bit forward stages O apart from Q
    sm90 = VariantSpec("sm90", "fwd", "bf16", 64, 128, 128, 2, 12, schedule=OV_PP)
    assert (
        rules.smem_bytes(sm90.replace(scheduler=Scheduler.PERSISTENT))
        == rules.smem_bytes(sm90) + 128 * 64 * 2
    )
    assert set(TARGET_SMEM_LIMITS) == set(TARGETS)
    assert TARGET_SMEM_LIMITS["sm_80"] == SM80_SMEM_LIMIT == 163 * 1024
    assert TARGET_SMEM_LIMITS["sm_86"] == TARGET_SMEM_LIMITS["sm_89"] == 99 * 1024


def test_sm90_bwd_dq_pieces():
    """Each consumer's dQ piece: 64-row blocks for tile_m=128, atom-aligned column pieces for 64."""
    bwd = _bwd90(64, 128, 128)
    assert sm90_bwd_dq_pieces(bwd) == ((0, 0, 64), (1, 0, 64))
    assert sm90_bwd_dq_pieces(bwd.replace(head_dim=128, tile_m=64)) == ((0, 0, 64), (0, 64, 64))
    assert sm90_bwd_dq_pieces(bwd.replace(head_dim=96, tile_m=64)) == ((0, 0, 64), (0, 64, 32))
    assert sm90_bwd_dq_pieces(bwd.replace(tile_m=64)) is None  # one 64-column atom: no split


def test_sm90_bwd_head_split():
    """Head dims 192 and 256: tile_n=64 (the two consumers share the keys, each owns half of the
    head dim of dK, dV and dQ), tile_m=64; the budgets follow the split's own models."""
    split = _bwd90(256, 64, 64)
    assert sm90_bwd_head_split(split)
    assert not sm90_bwd_head_split(split.replace(head_dim=128, tile_n=128))
    assert not sm90_bwd_head_split(split.replace(arch="sm80", warps=8))
    assert default_config("sm90", "bwd", "bf16", 256) == defaults.Config(
        Tile(64, 64, 2, 12), Sm90BwdOptions(overlap=True, dq_path=DqPath.BULK)
    )
    assert default_config("sm90", "bwd", "bf16", 192).tile == Tile(64, 96, 2, 12)  # the swapped partition
    for head_dim in (192, 256):
        spec = split.replace(head_dim=head_dim)
        assert rules.why_invalid(spec) is None, spec.name
        half = head_dim // 2
        assert sm90_bwd_dq_pieces(spec) == ((0, 0, half), (0, half, half))
        # dK + dV (64 keys x d/2, fp32 over 128 threads) beside the larger of S^T/dP^T (+ 16-bit
        # copies, 64 x 32) and the fp32 dQ piece (64 x d/2)
        assert sm90_bwd_registers(spec) == half + max(48, half // 2) + SM90_BWD_REG_OVERHEAD
        assert rules.est_registers(spec) == sm90_bwd_registers(spec) <= SM90_CONSUMER_REGS
        # K, V, the Q/dO ring, two dS and two P^T buffers, the LSE2/D rows and 6 mbarriers in a
        # struct rounded up to 1 KiB, plus 1 KiB of static shared memory
        elements = 2 * 64 * head_dim + 2 * 2 * 64 * head_dim + 4 * 64 * 64
        struct = elements * 2 + 2 * 2 * 64 * 4 + 6 * 8
        assert rules.smem_bytes(spec) == math.ceil(struct / 1024) * 1024 + 1024 <= SM90_SMEM_LIMIT
    assert sm90_bwd_registers(split) == 232
    assert rules.smem_bytes(split) == SM90_SMEM_LIMIT  # hd256: the whole opt-in limit
    assert rules.why_invalid(split.replace(head_dim=192, stages=3)) is None  # 3 stages fit at 192 only
    valid = [s for s in rules.valid_variants("sm90", "bwd") if sm90_bwd_head_split(s)]
    assert {(s.head_dim, s.tile_m, s.stages) for s in valid} == {(192, 64, 2), (192, 64, 3), (256, 64, 2)}
    assert {s.replace(overlap=False) for s in valid if s.options.overlap} == {
        s for s in valid if not s.options.overlap
    }
    assert {s.options.dq_path for s in valid} == {DqPath.RED, DqPath.BULK}
    bulk = {
        (s.head_dim, s.stages, sm90_bwd_dq_bulk_aliases(s)) for s in valid if s.options.dq_path is DqPath.BULK
    }
    assert bulk == {(192, 2, False), (192, 3, True), (256, 2, True)}
    # committed: hd256's default, both dtypes and masks; the rest are measured alternatives (bf16)
    splits = [s for s in committed.default_variants("sm90", "bwd") if sm90_bwd_head_split(s)]
    assert sorted((s.dtype, s.head_dim, s.causal) for s in splits) == [
        (d, 256, c) for d in ("bf16", "fp16") for c in (False, True)
    ]
    alternatives = [s for s in ALT.alternative_variants("sm90", "bwd") if sm90_bwd_head_split(s)]
    assert {s.dtype for s in alternatives} == {"bf16"} and len(alternatives) == 2 * (4 + 3)


def test_sm90_bwd_overlap_is_valid_where_the_dq_pieces_match():
    base = _bwd90(64, 128, 128)
    assert rules.why_invalid(base.replace(overlap=True)) is None
    assert rules.why_invalid(base.replace(head_dim=128, tile_m=64, overlap=True)) is None
    assert rules.why_invalid(base.replace(head_dim=128, tile_m=64, stages=3, overlap=True)) is None
    assert base.replace(overlap=True).name == "cutefa_sm90_bwd_bf16_hd64_128x128_s2_w12_ov"
    bwd = rules.valid_variants("sm90", "bwd")
    assert {s.replace(overlap=False) for s in bwd if s.options.overlap} <= set(bwd)


def test_sm80_bwd_smem_counts_the_q_buffers():
    one = VariantSpec("sm80", "bwd", "bf16", 128, 64, 128, 1, 8)
    # Q, dO (64x128), K, V (128x128), P, dS (64x128), 16-bit, plus six 1 KiB alignment reserves.
    assert rules.smem_bytes(one) == (2 * 64 * 128 + 2 * 128 * 128 + 2 * 64 * 128) * 2 + 6 * SMEM_RESERVE
    assert rules.smem_bytes(one.replace(stages=2)) == rules.smem_bytes(one) + 64 * 128 * 2
    assert rules.why_invalid(one.replace(stages=2)) is None


def test_sm100_pair_budgets_per_cta():
    """A CTA of a pair holds half of each K/V stage; its TMEM holds its own S and O, as one CTA does."""
    single = SM100_PAIR_EMU.replace(cta_pair=False)
    assert sm100_smem_bytes(single) - sm100_smem_bytes(SM100_PAIR_EMU) == 3 * 64 * 128 * 2
    assert sm100_tmem_columns(SM100_PAIR_EMU) == sm100_tmem_columns(single) == 512
    assert rules.smem_bytes(SM100_PAIR_EMU) == sm100_smem_bytes(SM100_PAIR_EMU)
    # Half a ring fits where a whole one does not: head dim 256 with 128-key blocks.
    wide = VariantSpec("sm100", "fwd", "bf16", 256, 128, 128, 2, 16, exp_emu=25)
    assert "shared memory" in _reason(wide)
    assert rules.why_invalid(wide.replace(cta_pair=True)) is None
    assert (
        rules.why_invalid(SM100_PAIR_EMU) is None
        and rules.why_invalid(SM100_PAIR_EMU.replace(causal=True)) is None
    )
    # The spill rule spares the shape that compiles clean with every exp2 on MUFU.
    assert rules.why_invalid(SM100_PAIR.replace(tile_m=128)) is None


def test_fp8_three_consumer_register_split():
    """tile_m 192 (512 threads): 128 registers per thread at launch, producer 32 and three
    consumers at 160 fill it exactly; the two-consumer splits stay 40 / 232 and 24 / 240."""
    three = VariantSpec(
        "sm90", "fwd", "e4m3", 128, 192, 96, 2, 16, schedule=OV, v_transpose=VTranspose.HOISTED
    )
    assert sm90_fp8_compiled(three) and rules.why_invalid(three) is None
    assert (sm90_fp8_producer_regs(three), sm90_fp8_consumer_regs(three)) == (32, 160)
    assert 32 * 128 + 3 * 128 * 160 == 128 * 512
    assert (sm90_fp8_producer_regs(FP8), sm90_fp8_consumer_regs(FP8)) == (40, 232)
    wide_tile = VariantSpec(
        "sm90", "fwd", "e4m3", 256, 128, 96, 2, 12, schedule=OV, v_transpose=VTranspose.HOISTED
    )
    assert (sm90_fp8_producer_regs(wide_tile), sm90_fp8_consumer_regs(wide_tile)) == (24, 240)


def test_fp8_budgets():
    # Q (128 x d) plus three rings (K, V as loaded, V transposed) of `stages` tiles, one byte each.
    assert rules.smem_bytes(FP8) == (128 + 3 * 2 * 128) * 128 + SMEM_RESERVE
    # fp32 O (d/2) and S (tile_n/2) per consumer thread, P at one byte (tile_n/8).
    assert rules.est_registers(FP8) == 64 + 64 + 16 + SM90_REG_OVERHEAD
    assert rules.why_invalid(FP8) is None
    # the bf16 kernel's model: P at two bytes
    assert rules.est_registers(FP8.replace(dtype="bf16")) == 64 + 64 + 32 + SM90_REG_OVERHEAD


def test_fp8_no_spill_list_is_strict():
    """Only the compiled forms pass over their register estimate: the like tile with another
    option refuses, each with the estimate's reason."""
    assert {key[:3] for key in SM90_FP8_NO_SPILL} == {(128, 192, 96), (256, 128, 128)}
    for (hd, tile_m, tile_n, stages), records in SM90_FP8_NO_SPILL.items():
        warps = 4 * (tile_m // 64 + 1)
        for options in records:
            spec = VariantSpec("sm90", "fwd", "e4m3", hd, tile_m, tile_n, stages, warps, options=options)
            assert rules.why_invalid(spec) is None and rules.why_invalid(spec.replace(causal=True)) is None
            assert rules.est_registers(spec) > sm90_fp8_consumer_regs(spec)
        options = min(records)
        spec = VariantSpec("sm90", "fwd", "e4m3", hd, tile_m, tile_n, stages, warps, options=options)
        for other in (
            spec.replace(exp_emu=25),
            spec.replace(v_transpose=VTranspose.INDEXED),
            spec.replace(quant=Quant.BLOCK),
        ):
            assert "would spill registers" in _reason(other), other.name
    hd256 = VariantSpec(
        "sm90", "fwd", "e4m3", 256, 128, 128, 2, 12, schedule=OV, v_transpose=VTranspose.HOISTED
    )
    assert "would spill registers" in _reason(hd256)  # the 128x128 tile is compiled with ping-pong only
    assert rules.why_invalid(hd256.replace(schedule=OV_PP)) is None


def test_fp8_ptxas_options():
    """-regUsageLevel 3 on the tiles where ptxas gives up the uniform datapath."""
    hd256 = defaults.default_spec("sm90", "fwd", "e4m3", 256)
    assert (
        sm90_fp8_ptxas_options(hd256) == ""
        and sm90_fp8_ptxas_options(hd256.replace(causal=True)) == "-regUsageLevel 3"
    )
    hd128 = defaults.default_spec("sm90", "fwd", "e4m3", 128)
    assert sm90_fp8_ptxas_options(hd128) == ""
    assert sm90_fp8_ptxas_options(hd128.replace(v_transpose=VTranspose.WIDE)) == "-regUsageLevel 3"
    hd192 = defaults.default_spec("sm90", "fwd", "e4m3", 192, causal=True)
    assert (
        sm90_fp8_ptxas_options(hd192) == ""
        and sm90_fp8_ptxas_options(hd192.replace(quant=Quant.BLOCK)) == "-regUsageLevel 3"
    )


def test_sm90_consumer_registers_of_the_fp8_defaults():
    """Every e4m3 default keeps 232 consumer registers (producer 40); a tile whose estimate exceeds
    that gets 240 (producer 24) when its transpose is the hoisted 32-bit one."""
    fp8 = [defaults.default_spec("sm90", "fwd", "e4m3", hd) for hd in HEAD_DIMS]
    assert all(sm90_fp8_consumer_regs(s) == SM90_FP8_CONSUMER_REGS == 232 for s in fp8)
    assert all(sm90_fp8_producer_regs(s) == 40 for s in fp8)
    long = VariantSpec(
        "sm90", "fwd", "e4m3", 256, 128, 96, 2, 12, schedule=OV_PP, v_transpose=VTranspose.HOISTED
    )
    assert rules.est_registers(long) > 232 and sm90_fp8_consumer_regs(long) == 240
    assert rules.why_invalid(long) is None
    indexed = long.replace(v_transpose=VTranspose.INDEXED)
    assert sm90_fp8_consumer_regs(indexed) == 232 and sm90_fp8_producer_regs(indexed) == 40
    assert sm90_fp8_producer_regs(long) == 24
    assert "would spill registers" in _reason(indexed)
