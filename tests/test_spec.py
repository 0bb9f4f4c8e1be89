"""Variant names are the identity: they round-trip, every field (each option of each family's record
included) shows in them, and bad names and values are refused naming what is wrong."""

from __future__ import annotations

import dataclasses

import pytest
from cpu_support import load_tool

from cutefa.model.committed import candidates
from cutefa.model.options import (
    Choice,
    DqLayout,
    DqPath,
    Mask,
    OAccum,
    Quant,
    RowSum,
    Schedule,
    Scheduler,
    Sm80BwdOptions,
    Sm80FwdOptions,
    Sm90BwdOptions,
    Sm90Fp8FwdOptions,
    Sm90FwdOptions,
    Sm100BwdOptions,
    Sm100FwdOptions,
    VTranspose,
    options_class,
)
from cutefa.model.spec import (
    ARCHS,
    DIRECTIONS,
    DTYPES,
    Features,
    VariantSpec,
    families_for_target,
    parse_name,
    target_cc,
    target_for_capability,
)

BASE = VariantSpec("sm80", "fwd", "bf16", 128, 128, 64, 1, 4, causal=True)
CHOICES = {"arch": ARCHS, "direction": DIRECTIONS, "dtype": DTYPES}
# one spec per option record (family, direction, dtype class)
FAMILIES = {
    Sm80FwdOptions: BASE,
    Sm80BwdOptions: VariantSpec("sm80", "bwd", "fp16", 128, 64, 128, 1, 8),
    Sm90FwdOptions: VariantSpec("sm90", "fwd", "bf16", 128, 128, 128, 2, 12, schedule=Schedule.OVERLAP),
    Sm90Fp8FwdOptions: VariantSpec("sm90", "fwd", "e4m3", 128, 128, 128, 2, 12, causal=True),
    Sm90BwdOptions: VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 2, 12),
    Sm100FwdOptions: VariantSpec("sm100", "fwd", "fp16", 128, 256, 128, 3, 16),
    Sm100BwdOptions: VariantSpec("sm100", "bwd", "bf16", 64, 128, 128, 1, 4, causal=True),
}


def _perturbed(spec: VariantSpec, name: str) -> object:
    value = getattr(spec, name)
    if name == "mask":
        return Mask.NONE if value is not Mask.NONE else Mask.CAUSAL
    if name == "features":
        return Features(varlen=True)
    if name == "options":
        return next(o for o in _option_values(spec) if o != value)
    if name == "head_dim_v":
        return spec.head_dim // 2
    if isinstance(value, int):
        return value * 2
    if name in CHOICES:
        return next(c for c in CHOICES[name] if c != value)
    raise AssertionError(f"teach this test how to perturb VariantSpec.{name}")


def _option_values(spec: VariantSpec) -> list:
    """The record with each of its fields moved off its value in turn."""
    records = []
    for field in dataclasses.fields(spec.options):
        for value in _field_values(field, getattr(spec.options, field.name)):
            records.append(spec.options.replace(**{field.name: value}))
    return records


def _field_values(field: dataclasses.Field, value: object) -> list:
    """Every other value of an option field worth naming: each member of an enum, the other bool,
    another exp2 share."""
    if isinstance(value, Choice):
        return [m for m in type(value) if m is not value]
    if isinstance(value, bool):
        return [not value]
    if field.name == "exp_emu":
        return [25 if value != 25 else 50]
    raise AssertionError(f"teach this test how to perturb option {field.name}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_every_candidate_name_round_trips(arch, direction):
    specs = candidates(arch, direction)
    assert specs
    for spec in specs:
        assert parse_name(spec.name) == spec
    assert len({s.name for s in specs}) == len(specs)


def test_every_alternative_name_round_trips():
    """The measured alternatives (tools/alternatives.py) too, each unique."""
    specs = load_tool("alternatives").all_variants()
    assert {s.arch for s in specs} == set(ARCHS)
    for spec in specs:
        assert parse_name(spec.name) == spec
    assert len({s.name for s in specs}) == len(specs)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(VariantSpec)])
@pytest.mark.parametrize("family", list(FAMILIES), ids=lambda cls: cls.__name__)
def test_every_spec_field_changes_the_name(family, field):
    spec = FAMILIES[family]
    if field == "options" and not dataclasses.fields(family):
        assert spec.options == family() and spec.name == spec.replace(options=family()).name
        return  # a record without fields has one value
    value = _perturbed(spec, field)
    changed = spec.replace(**{field: value})
    assert getattr(changed, field) == value
    assert changed.name != spec.name
    assert parse_name(changed.name) == changed


@pytest.mark.parametrize("family", list(FAMILIES), ids=lambda cls: cls.__name__)
def test_every_option_field_changes_the_name(family):
    """Each field of each family's record, at each of its values, gives its own name, which parses
    back to the same spec; two fields at once parse back too."""
    spec = FAMILIES[family]
    assert type(spec.options) is family
    names = {spec.name}
    for field in dataclasses.fields(family):
        for value in _field_values(field, getattr(spec.options, field.name)):
            changed = spec.replace(**{field.name: value})
            assert getattr(changed.options, field.name) == value
            assert changed.name not in names, (field.name, value, changed.name)
            assert parse_name(changed.name) == changed
            names.add(changed.name)
    everything = spec.options.replace(
        **{f.name: _field_values(f, getattr(spec.options, f.name))[-1] for f in dataclasses.fields(family)}
    )
    full = spec.replace(options=everything)
    assert parse_name(full.name) == full


def test_name_format():
    assert BASE.name == "cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4_causal"
    assert str(BASE.replace(causal=False)) == "cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4"
    assert BASE.replace(head_dim_v=64).name == "cutefa_sm80_fwd_bf16_hd128v64_128x64_s1_w4_causal"
    assert BASE.replace(mask=Mask.LOCAL, features=Features(varlen=True, softcap=True)).name == (
        "cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4_local_varlen_softcap"
    )


@pytest.mark.parametrize(
    "spec, name, misordered",
    [
        (
            VariantSpec(
                "sm90",
                "fwd",
                "bf16",
                256,
                128,
                80,
                2,
                12,
                causal=True,
                schedule=Schedule.OVERLAP_PINGPONG,
                scheduler=Scheduler.LPT,
                early_rescale=True,
                pair_cvt=True,
                exp_emu=25,
            ),
            "cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_causal_ov_pp_lpt_erescale_pcvt_emu25",
            "cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_causal_ov_pp_erescale_pcvt_lpt_emu25",
        ),
        (
            VariantSpec(
                "sm90",
                "fwd",
                "e4m3",
                128,
                128,
                128,
                2,
                12,
                schedule=Schedule.OVERLAP_PINGPONG,
                quant=Quant.BLOCK,
            ),
            "cutefa_sm90_fwd_e4m3_hd128_128x128_s2_w12_ov_pp_blockq",
            "cutefa_sm90_fwd_e4m3_hd128_128x128_s2_w12_blockq_ov_pp",
        ),
        (
            VariantSpec("sm90", "bwd", "bf16", 192, 64, 96, 2, 12, causal=True, dq_path=DqPath.BULK_STAGED),
            "cutefa_sm90_bwd_bf16_hd192_64x96_s2_w12_causal_dqbulk_dqs",
            "cutefa_sm90_bwd_bf16_hd192_64x96_s2_w12_causal_dqs_dqbulk",
        ),
        (
            VariantSpec("sm80", "bwd", "bf16", 96, 64, 128, 1, 8, dq_layout=DqLayout.TILE, dq_pipe=True),
            "cutefa_sm80_bwd_bf16_hd96_64x128_s1_w8_dqtile_dqpipe",
            "cutefa_sm80_bwd_bf16_hd96_64x128_s1_w8_dqpipe_dqtile",
        ),
    ],
    ids=["sm90_fwd", "sm90_fp8", "sm90_bwd", "sm80_bwd"],
)
def test_option_tokens_follow_the_record(spec, name, misordered):
    """Tokens come in the record's field order (the scheduler right after the schedule); the name
    with two of them swapped is refused."""
    assert spec.name == name
    assert parse_name(name) == spec
    with pytest.raises(ValueError, match="not in its field order"):
        parse_name(misordered)


@pytest.mark.parametrize(
    ("name", "words"),
    [
        (
            "cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4_sliding",
            r"token\(s\) \['sliding'\] are not options of Sm80FwdOptions",
        ),
        ("cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4_causal_causal", r"\['causal'\] are not options"),
        ("cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4_ov", r"\['ov'\] are not options of Sm80FwdOptions"),
        ("cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_pp", r"\['pp'\] are not options of Sm90BwdOptions"),
        (
            "cutefa_sm90_fwd_e4m3_hd128_128x128_s2_w12_pcvt",
            r"\['pcvt'\] are not options of Sm90Fp8FwdOptions",
        ),
        (
            "cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_ov_pp_pcvt_lpt",
            "not options of Sm90FwdOptions .or not in its field order",
        ),
        ("cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_emu7x", r"\['emu7x'\] are not options"),
        ("cutefa_sm80_fwd_bf16_hd0128_128x64_s1_w4", "not canonical"),
        ("cutefa_sm80_fwd_bf16_hd128_128x064_s1_w4", "not canonical"),
        ("cutefa_sm80_fwd_bf16_hd128v128_128x64_s1_w4", "not canonical"),
        ("", "not a cutefa variant name"),
        ("flash_fwd", "not a cutefa variant name"),
        ("cutefa_sm80_fwd_bf16_hd128", "not a cutefa variant name"),
        ("cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4_", "not a cutefa variant name"),
        ("cutefa_sm70_fwd_bf16_hd128_128x64_s1_w4", "unknown family or dtype"),
        ("cutefa_sm80_fwd_fp32_hd128_128x64_s1_w4", "unknown family or dtype"),
        ("cutefa_sm80_fwd_bf16_hd128_128x64_s0_w4", "stages=0"),
    ],
)
def test_bad_names_are_refused(name, words):
    with pytest.raises(ValueError, match=words):
        parse_name(name)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"arch": "sm70"}, "VariantSpec.arch='sm70' is not one of"),
        ({"direction": "both"}, "VariantSpec.direction='both' is not one of"),
        ({"dtype": "fp32"}, "VariantSpec.dtype='fp32' is not one of"),
        ({"head_dim": 0}, "VariantSpec.head_dim=0 must be a positive int"),
        ({"tile_m": -64}, "VariantSpec.tile_m=-64 must be a positive int"),
        ({"head_dim_v": 0}, "VariantSpec.head_dim_v=0 must be a positive int"),
        ({"exp_emu": 101}, "exp_emu=101 must be a percentage in .0, 100."),
        ({"mask": Mask.NONE, "causal": True}, "causal=True contradicts mask=Mask.NONE"),
    ],
)
def test_bad_field_values_are_refused(changes, words):
    fields = {"arch": "sm90", "direction": "fwd", "dtype": "bf16", "head_dim": 128, "tile_m": 128, "tile_n": 128,
              "stages": 2, "warps": 12}  # fmt: skip
    positional = [changes.get(k, v) for k, v in fields.items()]
    keywords = {k: v for k, v in changes.items() if k not in fields}
    with pytest.raises(ValueError, match=words):
        VariantSpec(*positional, **keywords)


@pytest.mark.parametrize(
    ("spec", "changes", "words"),
    [
        (BASE, {"tile_n": 64.0}, "tile_n=64.0 must be a positive int"),
        (BASE, {"stages": True}, "stages=True must be a positive int"),
        (BASE, {"warps": "4"}, "warps='4' must be a positive int"),
        (BASE, {"causal": 1}, "causal=1 must be a bool"),
        (BASE, {"mask": "causal"}, "mask='causal' must be a cutefa Mask"),
        (BASE, {"features": {"varlen": True}}, "features=.* must be a Features record"),
        (BASE, {"options": Sm90FwdOptions()}, "a sm80 fwd bf16 variant takes Sm80FwdOptions"),
        (
            FAMILIES[Sm90FwdOptions],
            {"options": Sm90FwdOptions(pair_cvt=1)},
            "Sm90FwdOptions.pair_cvt=1 must be a bool",
        ),
        (FAMILIES[Sm90FwdOptions], {"schedule": "ov"}, "Sm90FwdOptions.schedule='ov' must be a Schedule"),
        (FAMILIES[Sm90FwdOptions], {"exp_emu": 2.5}, "Sm90FwdOptions.exp_emu=2.5 must be an int percentage"),
        (FAMILIES[Sm90BwdOptions], {"dq_path": DqLayout.TILE}, "Sm90BwdOptions.dq_path=.* must be a DqPath"),
    ],
)
def test_bad_field_types_are_refused(spec, changes, words):
    with pytest.raises(TypeError, match=words):
        spec.replace(**changes)


@pytest.mark.parametrize(
    ("spec", "option"),
    [
        (BASE, {"schedule": Schedule.OVERLAP}),
        (BASE, {"dq_layout": DqLayout.TILE}),
        (FAMILIES[Sm80BwdOptions], {"dq_path": DqPath.BULK}),
        (FAMILIES[Sm90FwdOptions], {"quant": Quant.BLOCK}),
        (FAMILIES[Sm90FwdOptions], {"v_transpose": VTranspose.HOISTED}),
        (FAMILIES[Sm90Fp8FwdOptions], {"dq_path": DqPath.BULK}),
        (FAMILIES[Sm90BwdOptions], {"schedule": Schedule.PINGPONG}),
        (FAMILIES[Sm90BwdOptions], {"dq_layout": DqLayout.TILE}),
        (FAMILIES[Sm100FwdOptions], {"scheduler": Scheduler.PERSISTENT}),
        (FAMILIES[Sm100BwdOptions], {"row_sum": RowSum.MMA}),
        (FAMILIES[Sm100BwdOptions], {"o_accum": OAccum.TWO_LEVEL}),
    ],
    ids=lambda x: x.name if isinstance(x, VariantSpec) else next(iter(x)),
)
def test_an_option_of_another_family_is_refused(spec, option):
    """A family's record cannot hold another family's option: no rule needs to say so."""
    cls = options_class(spec.arch, spec.direction, spec.dtype)
    with pytest.raises(
        TypeError, match=rf"\['{next(iter(option))}'\] are not options of the .*\({cls.__name__}: "
    ):
        spec.replace(**option)


def test_options_records_per_family():
    assert {options_class(a, d, t) for a in ARCHS for d in DIRECTIONS for t in ("bf16", "e4m3")} == set(
        FAMILIES
    )
    assert options_class("sm90", "fwd", "fp16") is Sm90FwdOptions
    assert options_class("sm90", "fwd", "e4m3") is Sm90Fp8FwdOptions
    assert options_class("sm100", "fwd", "e4m3") is Sm100FwdOptions
    with pytest.raises(ValueError, match="no option record for family 'sm70'"):
        options_class("sm70", "fwd", "bf16")
    # a new family or direction resets the options; the same family keeps them
    sm90 = FAMILIES[Sm90FwdOptions]
    assert sm90.replace(dtype="e4m3").options == Sm90Fp8FwdOptions()
    assert sm90.replace(dtype="fp16").options == sm90.options


def test_family_and_target():
    assert BASE.runs_on("sm_80") and BASE.runs_on("sm_90a") and BASE.runs_on("sm_100a")
    hopper = BASE.replace(arch="sm90", warps=12, stages=2)
    assert hopper.runs_on("sm_90a") and not hopper.runs_on("sm_100a") and not hopper.runs_on("sm_80")
    blackwell = BASE.replace(arch="sm100", warps=16, stages=2)
    assert blackwell.runs_on("sm_100a") and blackwell.runs_on("sm_103a") and not blackwell.runs_on("sm_90a")
    assert families_for_target("sm_90a") == ["sm90", "sm80"]
    assert families_for_target("sm_86") == ["sm80"]
    assert families_for_target("sm_103a") == ["sm100", "sm80"]
    assert target_cc("sm_100a") == 100
    with pytest.raises(ValueError, match="unknown compile target 'sm_90'"):
        target_cc("sm_90")
    assert [target_for_capability(*cc) for cc in ((8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3))] == [
        "sm_80", "sm_86", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_103a",
    ]  # fmt: skip


def test_version_matches_pyproject():
    import re
    from pathlib import Path

    import cutefa

    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', text, re.MULTILINE).group(1) == cutefa.__version__
