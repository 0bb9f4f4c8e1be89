"""The default configs are the measured ones, the committed set is made of them (plus the tuned
tables' picks and the small-shared-memory tiles), the measured alternatives stay apart, and the
candidate grid holds them all."""

from __future__ import annotations

import pytest
from cpu_support import load_tool

from cutefa.model import committed, defaults, rules
from cutefa.model.budgets import TARGET_SMEM_LIMITS
from cutefa.model.budgets_sm80 import SM80_SMEM_LIMIT
from cutefa.model.budgets_sm90 import SM90_FP8_MMA_K
from cutefa.model.budgets_sm100 import SM100_FP8_MMA_K
from cutefa.model.defaults import Tile, default_config
from cutefa.model.options import (
    DqLayout,
    Mask,
    Quant,
    Schedule,
    Scheduler,
    Sm80BwdOptions,
    Sm90FwdOptions,
    VTranspose,
)
from cutefa.model.spec import (
    ARCHS,
    COMMITTED_HEAD_DIMS,
    HEAD_DIM_V_PAIRS,
    HEAD_DIMS,
    TUNED_HEAD_DIMS,
    VariantSpec,
)

ALT = load_tool("alternatives")
OV, OV_PP = Schedule.OVERLAP, Schedule.OVERLAP_PINGPONG


EXPECTED_DEFAULTS = {  # (family, direction, dtype) -> head dim -> the default's name after the dtype
    ("sm80", "fwd", "bf16"): {
        64: "hd64_128x64_s1_w4", 96: "hd96_128x64_s1_w8", 128: "hd128_128x128_s1_w8", 192: "hd192_128x64_s1_w8",
        256: "hd256_128x64_s1_w8",
    },
    ("sm80", "bwd", "bf16"): {
        64: "hd64_128x128_s2_w8_dqtile", 96: "hd96_64x128_s1_w8_dqtile_dqpipe", 128: "hd128_64x128_s1_w8_dqtile",
        192: "hd192_64x64_s1_w8_dqtile_dqpipe", 256: "hd256_64x64_s1_w8_dqtile_dqpipe",
    },
    ("sm90", "fwd", "bf16"): {
        64: "hd64_128x128_s2_w12_ov_pp", 96: "hd96_128x128_s2_w12_ov_pp", 128: "hd128_128x128_s2_w12_ov_pp",
        192: "hd192_128x96_s2_w12_ov_pp", 256: "hd256_128x64_s2_w12_ov_pp",
    },
    ("sm90", "fwd", "e4m3"): {
        64: "hd64_128x128_s2_w12_ov_pp_hvt", 96: "hd96_128x128_s2_w12_ov_pp_hvt", 128: "hd128_128x128_s3_w12_ov_hvt",
        192: "hd192_128x96_s2_w12_ov_pp_hvt", 256: "hd256_128x64_s3_w12_ov_pp_hvt_lres",
    },
    ("sm90", "bwd", "bf16"): {
        64: "hd64_128x128_s2_w12_dqbulk", 96: "hd96_64x128_s2_w12_dqbulk", 128: "hd128_64x128_s2_w12_dqbulk",
        192: "hd192_64x96_s2_w12_dqbulk_dqs", 256: "hd256_64x64_s2_w12_ov_dqbulk",
    },
    ("sm100", "fwd", "bf16"): {
        64: "hd64_256x128_s3_w16_emu25", 96: "hd96_256x128_s3_w16_emu25", 128: "hd128_256x128_s3_w16_emu25",
        192: "hd192_256x64_s3_w16", 256: "hd256_128x64_s2_w16",
    },
    ("sm100", "bwd", "bf16"): {64: "hd64_128x128_s1_w4", 128: "hd128_128x128_s1_w4"},
}  # fmt: skip


@pytest.mark.parametrize("key", list(EXPECTED_DEFAULTS), ids=lambda k: "_".join(k))
def test_default_configs(key):
    """The default of each family, direction and dtype at each head dim (fp16 as bf16; sm100 e4m3
    as its 16-bit defaults), each valid; no default where the table has none."""
    arch, direction, dtype = key
    for hd in HEAD_DIMS:
        for dt in (dtype, "fp16") if dtype == "bf16" else (dtype,):
            spec = defaults.default_spec(arch, direction, dt, hd)
            want = EXPECTED_DEFAULTS[key].get(hd)
            if want is None:
                assert spec is None
                continue
            assert spec.name == f"cutefa_{arch}_{direction}_{dt}_{want}"
            assert rules.why_invalid(spec) is None and rules.why_invalid(spec.replace(causal=True)) is None
            assert defaults.default_spec(arch, direction, dt, hd, causal=True) == spec.replace(causal=True)
    if key == ("sm100", "fwd", "bf16"):
        for hd in HEAD_DIMS:
            assert defaults.default_config("sm100", "fwd", "e4m3", hd) == defaults.default_config(
                "sm100", "fwd", "bf16", hd
            )
    assert defaults.default_config("sm80", "fwd", "e4m3", 128) is None
    assert defaults.default_config("sm90", "bwd", "e4m3", 128) is None


def test_views_of_the_defaults():
    """DEFAULT_TILES, DEFAULT_BWD_TILES and default_tile read the default configs."""
    for arch in ARCHS:
        for hd in HEAD_DIMS:
            fwd, bwd = default_config(arch, "fwd", "fp16", hd), default_config(arch, "bwd", "fp16", hd)
            assert (
                defaults.DEFAULT_TILES[arch].get(hd) == (fwd and fwd.tile) == defaults.default_tile(arch, hd)
            )
            assert defaults.DEFAULT_BWD_TILES[arch].get(hd) == (bwd and bwd.tile)
    assert defaults.default_tile("sm90", 256, "e4m3") == Tile(128, 64, 3, 12)


def test_sm80_defaults_and_fallbacks():
    """The sm80 committed set: the defaults of both dtypes and masks, the tiles of the 99 KiB GPUs
    (forward hd256; backward hd64, hd96, hd128), and the tuned table's other picks. dq_pipe on the
    single-buffered backward tiles of hd96, hd192 and hd256 only."""
    fwd = committed.default_variants("sm80", "fwd")
    bwd = committed.default_variants("sm80", "bwd")
    small = {
        c.spec("sm80", d, dt, hd, mask=m)
        for d in ("fwd", "bwd") for dt in ("fp16", "bf16") for hd in HEAD_DIMS for m in (Mask.NONE, Mask.CAUSAL)
        for c in defaults.small_smem_configs("sm80", d, dt, hd)
    }  # fmt: skip
    assert {(s.direction, s.head_dim) for s in small} == {
        ("fwd", 256),
        ("bwd", 64),
        ("bwd", 96),
        ("bwd", 128),
    }
    for spec in small:
        assert all(rules.why_not_on(spec, t) is None for t in ("sm_86", "sm_89")), spec.name
    tuned = set(committed.tuned_variants()) & set(fwd)
    # 80 and 112: padded tiles of their own; (192, 128): its backward (committed.separate_v_bwd_specs)
    assert len(bwd) == 2 * 2 * (len(COMMITTED_HEAD_DIMS) + 3 + len(HEAD_DIM_V_PAIRS))
    assert (
        set(fwd)
        == {
            defaults.default_spec("sm80", "fwd", dt, hd, causal=c)
            for dt in ("fp16", "bf16")
            for hd in COMMITTED_HEAD_DIMS
            for c in (False, True)
        }
        | {s for s in small if s.direction == "fwd"}
        | tuned
    )
    for spec in bwd:
        assert spec.options.dq_layout is DqLayout.TILE
        assert spec.options.dq_pipe == (spec.stages == 1 and spec.head_dim in (96, 192, 256)), spec.name
        if spec not in small:
            assert rules.why_not_on(spec, "sm_80") is None, spec.name  # every default fits the A100
    assert defaults.small_smem_configs("sm90", "fwd", "bf16", 256) == ()


def test_sm80_backward_alternatives():
    """The double-buffered tiles (hd256's over the A100's 163 KiB: sm_90a and newer only), and the
    QUAD and ROWS dQ layouts in bf16 beside each best tile, twins of TILE variants."""
    alts = ALT.alternative_variants("sm80", "bwd")
    big = VariantSpec("sm80", "bwd", "bf16", 256, 64, 64, 2, 8, dq_layout=DqLayout.TILE)
    assert big in alts and rules.smem_bytes(big) > SM80_SMEM_LIMIT
    assert [t for t in TARGET_SMEM_LIMITS if rules.why_not_on(big, t) is None] == [
        "sm_90a",
        "sm_100a",
        "sm_103a",
    ]
    others = [s for s in alts if s.options.dq_layout is not DqLayout.TILE]
    assert {s.dtype for s in others} == {"bf16"} and len(others) == 2 * 2 * 4
    every = set(ALT.all_variants("sm80", "bwd"))
    assert all(
        s.replace(
            options=Sm80BwdOptions(
                dq_layout=DqLayout.TILE, dq_pipe=s.stages == 1 and s.head_dim != 128 and s.head_dim != 64
            )
        )
        in every
        for s in others
    )


def test_candidates():
    sm80 = committed.candidates("sm80")
    # the grid (standard head dims) and the committed hd80 / hd112 forwards (2 dtypes x 2 masks each)
    assert len(sm80) == 2 * len(HEAD_DIMS) * (2 * 3 * 2 * 2) * 2 + 2 * 2 * len(TUNED_HEAD_DIMS)
    assert {s.dtype for s in sm80} == {"fp16", "bf16"}
    assert {s.dtype for s in committed.candidates("sm90")} == {"fp16", "bf16", "e4m3"}
    assert {s.dtype for s in committed.candidates("sm90", "bwd")} == {"fp16", "bf16"}
    assert {s.warps for s in committed.candidates("sm90") if s.tile_m == 192} == {16}
    assert {s.tile_n for s in committed.candidates("sm90")} == set(range(64, 193, 16))
    assert {s.mask for a in ARCHS for s in committed.candidates(a)} == {Mask.NONE, Mask.CAUSAL}
    for arch in ARCHS:  # the committed variants are candidates
        for direction in ("fwd", "bwd"):
            assert set(committed.default_variants(arch, direction)) <= set(
                committed.candidates(arch, direction)
            )


def test_valid_variants():
    valid = rules.valid_variants("sm80")
    assert valid and all(rules.why_invalid(s) is None for s in valid)
    assert len(valid) < len(committed.candidates("sm80"))
    assert all(s.arch == "sm90" and s.direction == "fwd" for s in rules.valid_variants("sm90"))


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: committed.candidates("sm70"), "arch='sm70' is not one of"),
        (lambda: committed.candidates("sm80", "both"), "direction='both' is not one of"),
        (lambda: committed.default_variants("hopper"), "arch='hopper' is not one of"),
        (lambda: committed.default_variants("sm80", "both"), "direction='both' is not one of"),
        (lambda: defaults.default_config("sm70", "fwd", "bf16", 128), "arch='sm70' is not one of"),
    ],
)
def test_bad_arguments(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_sm100_pairs_are_alternatives():
    assert {s.options.cta_pair for s in committed.candidates("sm100")} == {False, True}
    assert {s.head_dim for s in rules.valid_variants("sm100") if s.options.cta_pair} == {128, 192, 256}
    assert not any(s.options.cta_pair for s in committed.default_variants("sm100", "fwd"))
    pairs = [s for s in ALT.alternative_variants("sm100", "fwd") if s.options.cta_pair]
    assert len(pairs) == 2 * 2 * 3  # dtypes x masks x head dims 128, 192, 256
    for spec in pairs:
        default = default_config("sm100", "fwd", spec.dtype, spec.head_dim)
        assert spec.replace(cta_pair=False) == default.spec(
            "sm100", "fwd", spec.dtype, spec.head_dim, mask=spec.mask
        )


def test_sm100_fp8_defaults():
    """sm100 e4m3: the default tile of each head dim, causal and not, single-CTA; every e4m3
    candidate that passes is single-CTA."""
    fp8 = [s for s in committed.default_variants("sm100", "fwd") if s.dtype == "e4m3"]
    assert {s.head_dim for s in fp8} == set(HEAD_DIMS) and len(fp8) == 2 * len(HEAD_DIMS)
    for s in fp8:
        assert s.tile_n % SM100_FP8_MMA_K == 0 and not s.options.cta_pair and rules.why_invalid(s) is None
    valid = [s for s in rules.valid_variants("sm100") if s.dtype == "e4m3"]
    assert valid and not any(s.options.cta_pair for s in valid)


def test_fp8_committed_set():
    """e4m3 (sm90): the default of each head dim, its block-quantization twin, and the tuned table's
    picks (the centered-v ``_vmean`` ones included), causal and not."""
    fp8 = [s for s in committed.default_variants("sm90") if s.dtype == "e4m3"]
    defaults_ = {
        defaults.default_spec("sm90", "fwd", "e4m3", hd, causal=c) for hd in HEAD_DIMS for c in (False, True)
    }
    blocks = set(committed.fp8_block_specs("sm90"))
    assert blocks == {s.replace(quant=Quant.BLOCK) for s in defaults_}
    assert set(fp8) == defaults_ | blocks | {s for s in committed.tuned_variants() if s.dtype == "e4m3"}
    assert any(s.options.v_mean for s in fp8)
    assert all(s.options.v_transpose is VTranspose.HOISTED for s in fp8)
    assert {s.head_dim for s in defaults_ if not s.options.schedule.pingpong} == {128}
    assert {s.head_dim for s in defaults_ if s.options.lazy_rescale} == {256}
    assert committed.fp8_block_specs("sm100") == [] and committed.BLOCK_QUANT_FAMILIES == ("sm90",)
    # candidates: the sm90 e4m3 grid has both descale granularities
    assert {s.options.quant for s in committed.candidates("sm90") if s.dtype == "e4m3"} == set(Quant)


def test_fp8_alternatives_are_valid_and_differ_from_the_defaults():
    alternatives = ALT.fp8_alternative_specs("sm90")
    assert len(alternatives) <= 62  # a short list for one GPU run, not a sweep
    assert {s.causal for s in alternatives} == {False, True}
    for spec in alternatives:
        assert rules.why_invalid(spec) is None, spec.name
        assert spec.tile_n % SM90_FP8_MMA_K == 0 and spec.tile_m in (128, 192), spec.name
        default = defaults.default_spec("sm90", "fwd", "e4m3", spec.head_dim, causal=spec.causal)
        assert spec != default, spec.name
        if spec.options.v_transpose is not VTranspose.HOISTED:  # the transposes beside the default's
            assert spec.replace(v_transpose=VTranspose.HOISTED, lazy_rescale=spec.head_dim == 256) == default
    twins = [s for s in alternatives if s.options.v_transpose is not VTranspose.HOISTED]
    assert {(s.head_dim, s.options.v_transpose) for s in twins} == {
        (hd, vt) for hd in (128, 256) for vt in (VTranspose.INDEXED, VTranspose.WIDE)
    }


def test_sm90_16bit_alternatives():
    """The measured 16-bit forwards: every schedule on the default tile, the long hd128 tiles with
    paired conversion, FlashAttention-4's hd256 schedules, the longest-first grid, fp16 and bf16,
    both masks; each valid."""
    alts = [s for s in ALT.alternative_variants("sm90", "fwd") if s.dtype != "e4m3"]
    for spec in alts:
        assert rules.why_invalid(spec) is None, spec.name
        assert spec.replace(dtype="fp16" if spec.dtype == "bf16" else "bf16") in alts
        assert spec.replace(causal=not spec.causal) in alts
    hd128 = {
        s.options.schedule for s in alts
        if s.head_dim == 128 and s.tile_n == 128 and s.options == Sm90FwdOptions(schedule=s.options.schedule)
    }  # fmt: skip
    assert hd128 == set(Schedule) - {OV_PP}  # the default's schedule is committed
    assert {s.tile_n for s in alts if s.head_dim == 128 and s.options.pair_cvt} == {128, 144, 160, 176, 192}
    lpt = {(s.head_dim, s.tile_m, s.tile_n) for s in alts if s.options.scheduler is Scheduler.LPT}
    assert lpt == {(64, 192, 128), (256, 128, 80), (128, 128, 128), (128, 128, 160)}
    assert all(s.options.pair_cvt for s in alts if s.options.early_rescale)
