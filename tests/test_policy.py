"""The code-generation policy each family decides in Python (cutefa.model.policy_*): register
splits, ptxas options, descriptors, masks, TMEM layout and warp grids."""

from __future__ import annotations

import pytest

from cutefa.model import policy_sm80, policy_sm90, policy_sm100
from cutefa.model.options import DqLayout, Quant, Schedule, Scheduler, VTranspose
from cutefa.model.spec import VariantSpec

LAUNCH_REGISTERS = 65536  # per SM


def sm90(tile_m=128, tile_n=128, head_dim=128, dtype="bf16", causal=False, **options):
    return VariantSpec(
        "sm90", "fwd", dtype, head_dim, tile_m, tile_n, 2, 4 * (tile_m // 64 + 1), causal=causal, **options
    )


@pytest.mark.parametrize(
    ("tile_m", "dtype"), [(64, "bf16"), (128, "bf16"), (192, "bf16"), (128, "e4m3"), (192, "e4m3")]
)
def test_sm90_forward_register_split_fits_the_launch(tile_m, dtype):
    spec = sm90(tile_m=tile_m, dtype=dtype, schedule=Schedule.OVERLAP)
    producer, consumer = policy_sm90.fwd_register_split(spec)
    consumers = policy_sm90.consumers(spec)
    assert consumers == tile_m // 64
    assert 128 * producer + 128 * consumers * consumer <= LAUNCH_REGISTERS
    assert producer < consumer


def test_sm90_register_splits():
    assert policy_sm90.fwd_register_split(sm90()) == (24, 240)
    assert policy_sm90.fwd_register_split(sm90(tile_m=192)) == (24, 160)
    bwd = VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 2, 12)
    assert policy_sm90.bwd_register_split(bwd) == (24, 240)


def test_sm90_ptxas_options():
    three = sm90(tile_m=192, tile_n=128, head_dim=64, causal=True, schedule=Schedule.OVERLAP_PINGPONG)
    assert policy_sm90.fwd_ptxas_options(three) == "-regUsageLevel 3"
    lpt = three.replace(schedule=Schedule.OVERLAP, scheduler=Scheduler.LPT)
    assert policy_sm90.fwd_ptxas_options(lpt) == "-regUsageLevel 3"
    assert policy_sm90.fwd_ptxas_options(three.replace(causal=False)) == ""
    assert policy_sm90.fwd_ptxas_options(three.replace(schedule=Schedule.OVERLAP)) == ""
    assert policy_sm90.fwd_ptxas_options(sm90(causal=True, schedule=Schedule.OVERLAP_PINGPONG)) == ""
    fp8 = sm90(head_dim=256, tile_n=64, dtype="e4m3", causal=True, schedule=Schedule.OVERLAP_PINGPONG)
    assert policy_sm90.fwd_ptxas_options(fp8) == "-regUsageLevel 3"  # the e4m3 rule


def test_sm90_descriptors_hoisted_except_on_the_widest_causal_two_consumer_tiles():
    assert policy_sm90.fwd_hoisted_descriptors(sm90(causal=True))  # 128 x 128 = 16384 columns
    assert policy_sm90.fwd_hoisted_descriptors(sm90(head_dim=256, tile_n=80))  # non-causal
    assert not policy_sm90.fwd_hoisted_descriptors(sm90(head_dim=256, tile_n=80, causal=True))  # 20480
    hd192 = sm90(head_dim=192, tile_n=96, causal=True)  # 18432
    assert not policy_sm90.fwd_hoisted_descriptors(hd192)
    assert policy_sm90.fwd_hoisted_descriptors(hd192.replace(pair_cvt=True))
    assert not policy_sm90.fwd_hoisted_descriptors(sm90(causal=True, exp_emu=25))
    assert policy_sm90.fwd_hoisted_descriptors(sm90(tile_m=192, head_dim=256, tile_n=96, causal=True))


def test_sm90_mask_select():
    assert policy_sm90.fwd_mask_select(sm90(causal=True))
    assert not policy_sm90.fwd_mask_select(sm90())
    assert policy_sm90.fwd_mask_select(sm90(tile_m=192))  # three consumers: the select
    assert not policy_sm90.fwd_mask_select(sm90(tile_m=192, dtype="e4m3"))
    assert policy_sm90.fwd_mask_select(sm90(dtype="e4m3", causal=True))


def test_sm90_scheduling_choices():
    persistent = sm90(
        dtype="e4m3", scheduler=Scheduler.PERSISTENT, quant=Quant.TENSOR, v_transpose=VTranspose.HOISTED
    )
    assert policy_sm90.fwd_lpt_single_section(persistent.replace(causal=True))
    assert not policy_sm90.fwd_lpt_single_section(persistent)
    bwd = VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 2, 12, overlap=True)
    assert policy_sm90.bwd_early_dv(bwd)
    assert not policy_sm90.bwd_early_dv(bwd.replace(overlap=False))
    assert not policy_sm90.bwd_early_dv(bwd.replace(tile_m=128))
    assert policy_sm90.bwd_dq_transposed(bwd.replace(tile_m=80))
    assert not policy_sm90.bwd_dq_transposed(bwd)


@pytest.mark.parametrize(
    ("tile", "head_dim", "s", "o", "alloc"),
    [
        ((256, 128), 128, (0, 128), (256, 384), 512),
        ((128, 64), 64, (0,), (64,), 128),
        ((128, 64), 128, (0,), (64,), 256),
    ],
)
def test_sm100_tmem_layout(tile, head_dim, s, o, alloc):
    spec = VariantSpec("sm100", "fwd", "bf16", head_dim, *tile, 2, 16)
    assert policy_sm100.fwd_tmem_s(spec) == s
    assert policy_sm100.fwd_tmem_o(spec) == o
    assert policy_sm100.fwd_tmem_alloc(spec) == alloc
    assert policy_sm100.q_tiles(spec) == tile[0] // 128


def test_sm100_softmax_and_registers():
    bf16 = VariantSpec("sm100", "fwd", "bf16", 128, 256, 128, 3, 16)
    fp8 = bf16.replace(dtype="e4m3")
    assert (policy_sm100.fwd_rescale_threshold(bf16), policy_sm100.fwd_p_shift(bf16)) == (8, 0)
    assert (policy_sm100.fwd_rescale_threshold(fp8), policy_sm100.fwd_p_shift(fp8)) == (0, 8)
    softmax, correction, other = policy_sm100.fwd_register_split(bf16)
    assert 128 * (2 * softmax + correction + other) == LAUNCH_REGISTERS
    bwd = VariantSpec("sm100", "bwd", "bf16", 128, 128, 128, 1, 4)
    assert policy_sm100.bwd_tmem_columns(bwd) == (128, 256, 384, 512)


def test_sm80_backward_warp_grids_and_launch_order():
    spec = VariantSpec("sm80", "bwd", "bf16", 128, 64, 64, 2, 8, causal=True)
    assert policy_sm80.bwd_warp_grids(spec) == policy_sm80.SQUARER
    wide = spec.replace(head_dim=256)
    assert policy_sm80.bwd_warp_grids(wide) == policy_sm80.TALL
    assert policy_sm80.bwd_warp_grids(wide.replace(dq_layout=DqLayout.TILE)) == policy_sm80.TALL_DK
    assert policy_sm80.bwd_heavy_first(spec.replace(head_dim=192))
    assert not policy_sm80.bwd_heavy_first(spec)
    assert not policy_sm80.bwd_heavy_first(spec.replace(head_dim=192, causal=False))
