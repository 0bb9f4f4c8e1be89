"""Variant names are the identity: they round-trip, every field shows in them, bad ones are refused."""

from __future__ import annotations

import dataclasses

import pytest

from cutefa.space import candidates
from cutefa.spec import (
    ARCHS,
    DIRECTIONS,
    DTYPES,
    VariantSpec,
    families_for_target,
    parse_name,
    target_cc,
    target_for_capability,
)

BASE = VariantSpec("sm80", "fwd", "bf16", 128, 128, 64, 1, 4, causal=True)
CHOICES = {"arch": ARCHS, "direction": DIRECTIONS, "dtype": DTYPES}


def _perturbed(spec: VariantSpec, field: dataclasses.Field) -> object:
    value = getattr(spec, field.name)
    if isinstance(value, bool):
        return not value
    if field.name == "exp_emu":
        return 25
    if isinstance(value, int):
        return value * 2
    if field.name in CHOICES:
        return next(c for c in CHOICES[field.name] if c != value)
    raise AssertionError(f"teach this test how to perturb VariantSpec.{field.name}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_every_candidate_name_round_trips(arch, direction):
    specs = candidates(arch, direction)
    assert specs
    for spec in specs:
        assert parse_name(spec.name) == spec
    assert len({s.name for s in specs}) == len(specs)


@pytest.mark.parametrize("field", dataclasses.fields(VariantSpec), ids=lambda f: f.name)
def test_every_field_changes_the_name(field):
    changed = BASE.replace(**{field.name: _perturbed(BASE, field)})
    assert changed.name != BASE.name
    assert parse_name(changed.name) == changed


def test_name_format():
    assert BASE.name == "cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4_causal"
    assert str(BASE.replace(causal=False)) == "cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4"


@pytest.mark.parametrize(
    "spec, flag, name, misordered",
    [
        (
            VariantSpec("sm90", "fwd", "e4m3", 128, 128, 128, 2, 12, causal=True, overlap=True, pingpong=True),
            "block_quant",
            "cutefa_sm90_fwd_e4m3_hd128_128x128_s2_w12_causal_ov_pp_blockq",
            "cutefa_sm90_fwd_e4m3_hd128_128x128_s2_w12_blockq_ov_pp",  # after the schedule flags
        ),
        (
            VariantSpec("sm90", "bwd", "bf16", 192, 64, 96, 2, 12, causal=True, dq_bulk=True),
            "dq_stage",
            "cutefa_sm90_bwd_bf16_hd192_64x96_s2_w12_causal_dqbulk_dqs",
            "cutefa_sm90_bwd_bf16_hd192_64x96_s2_w12_causal_dqs_dqbulk",  # after dq_bulk's token
        ),
    ],
    ids=["block_quant", "dq_stage"],
)
def test_flag_name_token(spec, flag, name, misordered):
    """A flag's token sits in its fixed place in the name, the name parses back, and a bool is required."""
    flagged = spec.replace(**{flag: True})
    assert flagged.name == name
    assert parse_name(flagged.name) == flagged and parse_name(spec.name) == spec
    with pytest.raises(ValueError, match="in the order"):
        parse_name(misordered)
    with pytest.raises(TypeError, match=f"{flag}=1 must be a bool"):
        spec.replace(**{flag: 1})


def test_early_rescale_and_pair_cvt_name_tokens():
    spec = VariantSpec("sm90", "fwd", "bf16", 256, 128, 80, 2, 12, causal=True, overlap=True)
    both = spec.replace(early_rescale=True, pair_cvt=True)
    assert both.name == "cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_causal_ov_erescale_pcvt"
    assert parse_name(both.name) == both and parse_name(spec.name) == spec
    # after the scheduler flags (persistent included), before the exp2 emulation share
    full = both.replace(pingpong=True, persistent=True, exp_emu=25)
    assert full.name == "cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_causal_ov_pp_persist_erescale_pcvt_emu25"
    assert parse_name(full.name) == full
    with pytest.raises(ValueError, match="in the order"):
        parse_name("cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_causal_ov_pcvt_erescale")
    with pytest.raises(TypeError, match="early_rescale=1 must be a bool"):
        spec.replace(early_rescale=1)
    with pytest.raises(TypeError, match="pair_cvt=1 must be a bool"):
        spec.replace(pair_cvt=1)


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4_sliding", "unknown flag"),
        ("cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4_causal_causal", "once each"),
        ("cutefa_sm80_fwd_bf16_hd0128_128x64_s1_w4", "not canonical"),
        ("cutefa_sm80_fwd_bf16_hd128_128x064_s1_w4", "not canonical"),
        ("", "not a cutefa variant name"),
        ("flash_fwd", "not a cutefa variant name"),
        ("cutefa_sm80_fwd_bf16_hd128", "not a cutefa variant name"),
        ("cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4_", "not a cutefa variant name"),
        ("cutefa_sm70_fwd_bf16_hd128_128x64_s1_w4", "arch='sm70'"),
        ("cutefa_sm80_fwd_fp32_hd128_128x64_s1_w4", "dtype='fp32'"),
        ("cutefa_sm80_fwd_bf16_hd128_128x64_s0_w4", "stages=0"),
    ],
)
def test_bad_names_are_refused(name, words):
    with pytest.raises(ValueError, match=words):
        parse_name(name)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"arch": "sm70"}, "arch='sm70' is not one of"),
        ({"direction": "both"}, "direction='both' is not one of"),
        ({"dtype": "fp32"}, "dtype='fp32' is not one of"),
        ({"head_dim": 0}, "head_dim=0 must be a positive int"),
        ({"tile_m": -64}, "tile_m=-64 must be a positive int"),
    ],
)
def test_bad_field_values_are_refused(changes, words):
    with pytest.raises(ValueError, match=words):
        BASE.replace(**changes)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"tile_n": 64.0}, "tile_n=64.0 must be a positive int"),
        ({"stages": True}, "stages=True must be a positive int"),
        ({"warps": "4"}, "warps='4' must be a positive int"),
        ({"causal": 1}, "causal=1 must be a bool"),
    ],
)
def test_bad_field_types_are_refused(changes, words):
    with pytest.raises(TypeError, match=words):
        BASE.replace(**changes)


def test_family_and_target():
    assert BASE.runs_on("sm_80") and BASE.runs_on("sm_90a") and BASE.runs_on("sm_100a")
    hopper = BASE.replace(arch="sm90", warps=12, stages=2)
    assert hopper.runs_on("sm_90a") and not hopper.runs_on("sm_100a") and not hopper.runs_on("sm_80")
    assert families_for_target("sm_90a") == ["sm90", "sm80"]
    assert families_for_target("sm_86") == ["sm80"]
    assert target_cc("sm_100a") == 100
    with pytest.raises(ValueError, match="unknown compile target 'sm_90'"):
        target_cc("sm_90")
    assert [target_for_capability(*cc) for cc in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0))] == [
        "sm_80",
        "sm_86",
        "sm_89",
        "sm_90a",
        "sm_100a",
    ]


def test_version_matches_pyproject():
    import re
    from pathlib import Path

    import cutefa

    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', text, re.MULTILINE).group(1) == cutefa.__version__
