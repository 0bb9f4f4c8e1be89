"""The validity rules: each fires with its own reason (budgets: tests/test_budgets.py; the default
configs and the committed set: tests/test_defaults.py, tests/test_committed.py)."""

from __future__ import annotations

import pytest

from cutefa.model import rules
from cutefa.model.budgets_sm90 import (
    SM90_CONSUMER_REGS,
    SM90_SMEM_LIMIT,
)
from cutefa.model.defaults import default_config
from cutefa.model.options import (
    DqLayout,
    DqPath,
    OAccum,
    Quant,
    RowSum,
    Schedule,
    Scheduler,
    VTranspose,
)
from cutefa.model.spec import Features, VariantSpec

SM80 = VariantSpec("sm80", "fwd", "bf16", 64, 128, 64, 1, 4)
OV, PP, OV_PP = Schedule.OVERLAP, Schedule.PINGPONG, Schedule.OVERLAP_PINGPONG


def _bwd90(head_dim: int, tile_m: int, tile_n: int, stages: int = 2, **options: object) -> VariantSpec:
    return VariantSpec("sm90", "bwd", "bf16", head_dim, tile_m, tile_n, stages, 12, **options)


def _reason(spec: VariantSpec) -> str:
    return rules.why_invalid(spec) or ""


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (_bwd90(64, 128, 96), "the sm90 backward runs warps=12 and tile_n=128"),
        (
            _bwd90(64, 128, 64),
            (
                "tile_n=64 with head_dim=64: the head-dim-split sm90 backward (two warpgroups sharing 64 keys) "
                "handles head_dim in (192, 256)"
            ),
        ),
        (_bwd90(256, 128, 64), "tile_m=128: the head-dim-split sm90 backward takes 64 query rows per step"),
        (_bwd90(256, 64, 64, stages=1), "the Q/dO TMA ring needs at least 2 stages"),
        (
            _bwd90(256, 64, 64, stages=3),
            "needs 291.0 KiB of shared memory, over the 227 KiB per-block opt-in limit of the H100/H200",
        ),
        (_bwd90(64, 192, 128), "tile_m=192 must be 64 or 128 (the two consumers split dQ"),
        (_bwd90(192, 128, 128), "head_dim=192: the sm90 backward with tile_n=128 handles (64, 96, 128)"),
        (
            _bwd90(64, 64, 128),
            "tile_m=64 with head_dim=64: the two consumers cannot split dQ's columns at a swizzle-atom",
        ),
        (_bwd90(64, 128, 128, stages=1), "the Q/dO TMA ring needs at least 2 stages"),
        (_bwd90(128, 128, 128), "would spill registers (estimated 296 > 240 per consumer thread"),
        (
            _bwd90(64, 128, 128, stages=4),
            "KiB of shared memory, over the 227 KiB per-block opt-in limit of the H100/H200",
        ),
        (
            _bwd90(96, 64, 128, overlap=True),
            "overlap with head_dim=96, tile_m=64: the consumers' dQ pieces differ in width (64 and 32 columns)",
        ),
        (_bwd90(128, 80, 128), "tile_m=80 with dq_path=RED: the transposed dQ piece"),
        (
            _bwd90(128, 80, 128, stages=3, dq_path=DqPath.BULK),
            "stages=3: tile_m=80 fits the shared memory with a 2-stage",
        ),
        (
            _bwd90(128, 80, 128, overlap=True, dq_path=DqPath.BULK),
            "overlap: tile_m=80 has the default schedule only",
        ),
        (
            _bwd90(64, 80, 128, dq_path=DqPath.BULK),
            "tile_m=80 with head_dim=64: the transposed-dQ sm90 backward handles",
        ),
        (_bwd90(192, 128, 96), "tile_m=128: the swapped-dK/dV sm90 backward takes 64 query rows per step"),
        (
            _bwd90(192, 64, 96, overlap=True),
            "overlap: the swapped-dK/dV sm90 backward has no overlap schedule",
        ),
        (_bwd90(192, 64, 96, stages=3), "needs 255.0 KiB of shared memory"),
        (
            _bwd90(256, 64, 64, dq_path=DqPath.BULK_WARP),
            (
                "dq_path=BULK_WARP (the dQ-writer warp) with tile_m=64, tile_n=64, head_dim=256: built for the "
                "tile_n=128 backward with tile_m 64 or 128"
            ),
        ),
        (
            _bwd90(192, 64, 96, row_prefetch=True),
            "row_prefetch with tile_m=64, tile_n=96, head_dim=192: built for",
        ),
        (
            _bwd90(128, 80, 128, dq_path=DqPath.BULK_WARP),
            "dq_path=BULK_WARP (the dQ-writer warp) with tile_m=80",
        ),
        (
            _bwd90(128, 64, 128, dq_path=DqPath.BULK_STAGED),
            "dq_path=BULK_STAGED with tile_m=64, tile_n=128, head_dim=128: built for the swapped-dK/dV backward",
        ),
        (
            SM80.replace(
                arch="sm100", dtype="e4m3", tile_m=128, tile_n=128, warps=16, stages=2, cta_pair=True
            ),
            "cta_pair: the sm100 e4m3 forward is single-CTA only",
        ),
        (
            SM80.replace(arch="sm100", dtype="e4m3", tile_m=128, tile_n=80, warps=16, stages=2),
            "tile_n=80 is not a multiple of 32 (the k of an e4m3 UMMA",
        ),
        (
            SM80.replace(
                arch="sm100", dtype="e4m3", head_dim=256, tile_m=256, tile_n=128, warps=16, stages=2
            ),
            "needs 768 TMEM columns",
        ),
        (SM80.replace(arch="sm100", warps=12, stages=2), "warps=12 must be 16 (softmax x2, correction"),
        (SM80.replace(arch="sm100", tile_m=64, warps=16, stages=2), "tile_m=64 must be 128 or 256"),
        (
            SM80.replace(arch="sm100", tile_m=128, tile_n=96, warps=16, stages=2),
            "tile_n=96 must be 64 or 128",
        ),
        (
            SM80.replace(arch="sm100", tile_m=128, warps=16, stages=1),
            "the K/V TMA ring needs at least 2 stages",
        ),
        (
            SM80.replace(arch="sm100", tile_m=128, warps=16, stages=2, exp_emu=30),
            "exp_emu=30 must be a multiple of 6.25%",
        ),
        (SM80.replace(arch="sm90", tile_m=64, warps=8, stages=2, schedule=PP), "pingpong needs two or three"),
        (SM80.replace(arch="sm90", warps=8, stages=2), "warps=8 must be 12: one producer warpgroup plus 2"),
        (SM80.replace(arch="sm90", warps=12, stages=1), "the K/V TMA pipelines need at least 2 stages"),
        (SM80.replace(arch="sm90", warps=12, stages=2, tile_n=72), "tile_n=72 must be a multiple of 16"),
        (SM80.replace(arch="sm90", tile_m=256, warps=20, stages=2), "tile_m=256 must be 64, 128 or 192"),
        (
            SM80.replace(arch="sm90", head_dim=256, warps=12, stages=4, tile_n=128),
            "over the 227 KiB per-block",
        ),
        (SM80.replace(arch="sm90", warps=12, stages=2, tile_n=256), "would spill registers (estimated 272"),
        (SM80.replace(arch="sm90", warps=12, stages=2, exp_emu=10), "exp_emu=10 must be a multiple of 6.25%"),
        (
            SM80.replace(arch="sm100", direction="bwd", warps=16, stages=2),
            "the sm100 backward runs tile_m=128",
        ),
        (
            SM80.replace(arch="sm100", direction="bwd", head_dim=96, tile_m=128, tile_n=128),
            "head_dim=96: the sm100 backward reads Q, dO and K both K-major and MN-major",
        ),
        (
            SM80.replace(arch="sm100", direction="bwd", head_dim=256, tile_m=128, tile_n=128),
            "needs 768 TMEM columns (S^T + dP^T + dK + dV), over the 512",
        ),
        (
            SM80.replace(direction="bwd", tile_m=64, tile_n=128, warps=8, stages=3),
            "stages=3: the sm80 backward loads K and V once per CTA and has 1 or 2 buffers for Q",
        ),
        (
            SM80.replace(direction="bwd", tile_m=64, tile_n=128, warps=2),
            "warps=2: the sm80 backward runs 4 or 8 warps",
        ),
        (
            SM80.replace(direction="bwd", head_dim=256, tile_m=64, tile_n=128, warps=8, stages=2),
            "needs 262.0 KiB of shared memory, over the 227 KiB per-block opt-in limit of the largest GPU",
        ),
        (SM80.replace(direction="bwd", tile_m=64, tile_n=32, warps=8), "tile_n=32 is not a multiple of 64"),
        (
            VariantSpec("sm80", "bwd", "bf16", 128, 64, 128, 1, 8, dq_pipe=True),
            "dq_pipe without dq_layout=TILE",
        ),
        (
            VariantSpec("sm80", "bwd", "bf16", 128, 64, 128, 2, 8, dq_layout=DqLayout.TILE, dq_pipe=True),
            "dq_pipe with stages > 1: the double-buffered order already spreads its dQ reductions",
        ),
        (SM80.replace(dtype="e4m3"), "e4m3 is only for sm90/sm100 forward kernels, not sm80 fwd"),
        (SM80.replace(arch="sm90", direction="bwd", dtype="e4m3"), "e4m3 is only for sm90/sm100 forward"),
        (SM80.replace(head_dim=84), "head_dim=84 is not a multiple of 8 from 8 to 256"),
        (
            SM80.replace(tile_m=64, warps=8),
            "tile_m=64 is not a multiple of 16*warps=128 (each of the 8 warps",
        ),
        (SM80.replace(tile_n=40), "tile_n=40 is not a multiple of 16"),
        (
            SM80.replace(head_dim=96, tile_n=32, warps=8),
            "the K tile (32x96) does not split into 128-bit copies over 256 threads",
        ),
        (
            SM80.replace(head_dim=256, stages=3, warps=8),
            "needs 257.0 KiB of shared memory, over the 227 KiB per-block opt-in limit of the largest GPU",
        ),
        (SM80.replace(tile_n=128), "would spill registers (estimated 320 > 255 per thread)"),
    ],
    ids=lambda x: x.name if isinstance(x, VariantSpec) else None,
)
def test_each_rule_names_itself(spec, reason):
    assert rules.why_invalid(spec) == rules.why_invalid(spec)  # pure
    assert reason in _reason(spec)


def test_a_padded_sm80_backward_takes_the_tiled_dq_layout_only():
    bwd = VariantSpec("sm80", "bwd", "bf16", 80, 64, 128, 1, 8, dq_layout=DqLayout.TILE)
    assert rules.why_invalid(bwd) is None  # padded to 96 columns
    for other in (bwd.replace(dq_layout=DqLayout.ROWS), bwd.replace(dq_layout=DqLayout.QUAD), bwd.replace(dq_pipe=True)):
        assert "the padded sm80 backward takes dq_layout=TILE without dq_pipe" in _reason(other)
    assert rules.why_invalid(SM80.replace(head_dim=80, warps=8)) is None  # the forward pads it to 96
    # dq_accum's chunks are tile_m x the padded width: 32 x 96 words fill whole 16-byte vectors
    assert rules._sm80_dq_layout(VariantSpec("sm80", "bwd", "bf16", 80, 32, 128, 1, 8, dq_layout=DqLayout.TILE)) is None


def test_a_kernel_that_does_not_exist_says_so(monkeypatch):
    monkeypatch.setattr(rules, "IMPLEMENTED", {("sm90", "fwd"): ("fp16", "bf16")})
    hopper = SM80.replace(arch="sm90", warps=12, stages=2)
    assert rules.why_invalid(hopper) is None
    assert rules.why_invalid(hopper.replace(dtype="e4m3")) == "no e4m3 sm90 fwd kernel exists yet"
    assert rules.why_invalid(SM80) == "no sm80 fwd kernel exists yet"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"features": Features(paged_kv=True)}, "no bf16 sm90 fwd kernel implements the paged feature(s) yet"),
        (
            {"features": Features(paged_kv=True, softcap=True, split_kv=True)},
            "no bf16 sm90 fwd kernel implements the paged + split feature(s) yet",
        ),
    ],
)
def test_the_new_axes_have_no_kernel_yet(changes, reason):
    """Feature axes and a separate V head dim that have a place in the spec but no template: each
    says which is missing (the codegen raises NotImplementedError for it)."""
    spec = default_config("sm90", "fwd", "bf16", 128).spec("sm90", "fwd", "bf16", 128).replace(**changes)
    assert rules.why_invalid(spec) == rules.why_no_kernel(spec) == reason


SM100_PAIR = VariantSpec("sm100", "fwd", "bf16", 128, 256, 128, 3, 16, cta_pair=True)


SM100_PAIR_EMU = SM100_PAIR.replace(exp_emu=25)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (
            SM100_PAIR.replace(head_dim=96),
            "head_dim=96: cta_pair is for head_dim >= 128: each CTA would load 48 columns",
        ),
        (SM100_PAIR.replace(head_dim=64), "head_dim=64: cta_pair is for head_dim >= 128"),
        (
            SM100_PAIR.replace(head_dim=256, tile_n=64),
            "needs 640 TMEM columns (2 x (S 64 + O 256)), over the 512",
        ),
        (SM100_PAIR, "tile_n=128 with exp_emu=0 spills registers in the pair's softmax/correction warps"),
        (SM100_PAIR.replace(head_dim=192, tile_m=128, stages=2), "at head_dim=192, tile_m=128"),
        (
            SM100_PAIR_EMU.replace(head_dim=256, tile_m=128, tile_n=128, stages=3),
            "needs 228.0 KiB of shared memory, over the 227 KiB of a B200 block",
        ),
    ],
    ids=lambda x: x.name if isinstance(x, VariantSpec) else None,
)
def test_sm100_pair_rules(spec, reason):
    assert reason in _reason(spec)


FP8 = VariantSpec("sm90", "fwd", "e4m3", 128, 128, 128, 2, 12, schedule=OV_PP)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (
            FP8.replace(tile_m=64, warps=8, schedule=OV),
            "tile_m=64: the sm90 fp8 forward runs two or three consumer",
        ),
        (FP8.replace(tile_n=80), "tile_n=80 is not a multiple of 32 (the k of an fp8 WGMMA"),
        (
            FP8.replace(scheduler=Scheduler.PERSISTENT, quant=Quant.BLOCK),
            "scheduler=PERSISTENT with quant=BLOCK: the block-quantization path has no persistent scheduler",
        ),
        (FP8.replace(scheduler=Scheduler.LPT), "scheduler=LPT: the sm90 e4m3 forward has its own grid"),
        # Q 32 KiB + 2 stages x (K, V, Vt) of 32 KiB each = 224 KiB, with 3 stages over the limit.
        (FP8.replace(head_dim=256, stages=3), "needs 321.0 KiB of shared memory, over the 227 KiB"),
        # O 128 + S 64 + P 16 + 48 = 256 registers per consumer thread.
        (FP8.replace(head_dim=256), "would spill registers (estimated 256 > 232 per consumer thread"),
        # three consumer warpgroups (tile_m 192): hd128 only, no ping-pong
        (FP8.replace(tile_m=192, tile_n=96, warps=16), "tile_m=192 with pingpong"),
        (
            FP8.replace(tile_m=192, tile_n=64, warps=16, schedule=OV, head_dim=256),
            "tile_m=192 at head_dim 256",
        ),
    ],
    ids=lambda x: x.name if isinstance(x, VariantSpec) else None,
)
def test_fp8_rules_name_themselves(spec, reason):
    assert reason in _reason(spec)


def test_wide_transpose_rule():
    """VTranspose.WIDE (the 64-bit V transpose): on tiles whose 8x8-byte units split evenly over the
    producer warpgroup's 128 threads."""
    hd128 = VariantSpec(
        "sm90", "fwd", "e4m3", 128, 128, 128, 2, 12, schedule=OV_PP, v_transpose=VTranspose.HOISTED
    )
    wide = hd128.replace(v_transpose=VTranspose.WIDE)
    assert rules.why_invalid(wide) is None
    assert wide.name == "cutefa_sm90_fwd_e4m3_hd128_128x128_s2_w12_ov_pp_hvt_wvt"
    assert rules.why_invalid(wide.replace(head_dim=256, tile_n=64, stages=3)) is None
    assert rules.why_invalid(wide.replace(head_dim=64)) is None
    for bad, words in (
        # 12 x 16 = 192 units (hd96), 16 x 20 = 320 (tile_n 160), 24 x 12 = 288 (hd192 x 96)
        (wide.replace(head_dim=96), "v_transpose=WIDE: (head_dim / 8) x (tile_n / 8) = 192 8x8-byte units"),
        (wide.replace(tile_n=160, stages=3, schedule=PP), "= 320 8x8-byte units"),
        (wide.replace(head_dim=192, tile_n=96), "= 288 8x8-byte units"),
        (wide.replace(tile_n=80), "v_transpose=WIDE: tile_n=80 is not a multiple of 32"),
    ):
        assert words in _reason(bad), bad.name


def test_fp8_sum_mma_two_level_and_v_mean_rules():
    """The row sums by WGMMA, the two-level accumulation of O and v's column means added in the
    epilogue: options of the overlap schedule, not with block quantization; two_level's fp32 copy
    of O counts in the shared memory (4 bytes per value of the CTA's tile: 96 KiB at hd128 192x96),
    so hd256's tiles cannot hold it."""
    tuned = VariantSpec(
        "sm90",
        "fwd",
        "e4m3",
        128,
        192,
        96,
        2,
        16,
        schedule=OV,
        v_transpose=VTranspose.HOISTED,
        lazy_rescale=True,
    )
    for field, value, what, extra in (
        ("row_sum", RowSum.MMA, "row_sum=MMA", 1024),
        ("o_accum", OAccum.TWO_LEVEL, "o_accum=TWO_LEVEL", 96 * 1024),
    ):
        spec = tuned.replace(**{field: value})
        assert rules.why_invalid(spec) is None
        assert f"{what} needs overlap" in _reason(spec.replace(tile_m=128, warps=12, schedule=PP))
        assert f"{what} with quant=BLOCK" in _reason(spec.replace(quant=Quant.BLOCK))
        assert rules.smem_bytes(spec) == rules.smem_bytes(tuned) + extra
    hd256 = VariantSpec(
        "sm90", "fwd", "e4m3", 256, 128, 96, 2, 12, schedule=OV_PP, v_transpose=VTranspose.HOISTED
    )
    assert "shared memory" in _reason(hd256.replace(o_accum=OAccum.TWO_LEVEL))
    assert rules.smem_bytes(hd256.replace(row_sum=RowSum.MMA)) <= SM90_SMEM_LIMIT
    v_mean = tuned.replace(v_mean=True)
    assert rules.why_invalid(v_mean) is None
    assert "v_mean with o_accum=TWO_LEVEL: centered v needs no two-level accumulation" in _reason(
        v_mean.replace(o_accum=OAccum.TWO_LEVEL)
    )
    assert "v_mean with quant=BLOCK: not built for the block path" in _reason(
        v_mean.replace(quant=Quant.BLOCK)
    )


def test_sm90_16bit_forward_option_rules():
    """early_rescale needs an overlap schedule and two consumers; lazy_rescale an overlap schedule
    and every exp2 on MUFU; the compiled paired-conversion and three-consumer tiles pass over their
    estimate only in their compiled form."""
    base = VariantSpec(
        "sm90", "fwd", "bf16", 256, 128, 80, 2, 12, causal=True, schedule=OV, early_rescale=True
    )
    assert rules.why_invalid(base) is None and rules.why_invalid(base.replace(pair_cvt=True)) is None
    for bad, words in (
        (base.replace(schedule=PP), "early_rescale needs overlap"),
        (
            base.replace(head_dim=64, tile_m=192, tile_n=128, warps=16),
            "early_rescale needs two consumer warpgroups",
        ),
        (
            base.replace(early_rescale=False, lazy_rescale=True, schedule=Schedule.SERIAL),
            "rescales lazily in the overlap schedule only",
        ),
        (base.replace(lazy_rescale=True, exp_emu=25), "lazy_rescale with exp_emu"),
    ):
        assert words in _reason(bad), bad.name
    for hd, n in ((128, 176), (128, 192)):
        spec = VariantSpec("sm90", "fwd", "bf16", hd, 128, n, 2, 12, schedule=OV_PP, pair_cvt=True)
        assert rules.est_registers(spec) > SM90_CONSUMER_REGS
        assert (
            rules.why_invalid(spec) is None
            and rules.why_invalid(spec.replace(causal=True, dtype="fp16")) is None
        )
        for other in (
            spec.replace(pair_cvt=False), spec.replace(schedule=OV), spec.replace(scheduler=Scheduler.PERSISTENT),
            spec.replace(early_rescale=True), spec.replace(exp_emu=25), spec.replace(tile_n=208),
        ):  # fmt: skip
            assert "would spill registers" in _reason(other) or "shared memory" in _reason(other), other.name
    three = VariantSpec("sm90", "fwd", "fp16", 64, 192, 128, 2, 16, schedule=OV)
    assert rules.est_registers(three) > 160 and rules.why_invalid(three) is None
    assert rules.why_invalid(three.replace(scheduler=Scheduler.LPT)) is None
    assert "would spill registers" in _reason(three.replace(scheduler=Scheduler.PERSISTENT))
    assert "would spill registers" in _reason(three.replace(tile_n=144))
