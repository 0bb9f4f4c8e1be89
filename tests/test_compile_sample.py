"""The compile tests' sample (cpu_support.compile_sample): by default a fixed few variants that
together show every template, dtype, mask, head dim, tile and option value of the list they are
drawn from; every variant with CUTEFA_FULL_COMPILE_TESTS=1. Together the compile tests' default run
compiles every template and every value of every option field."""

from __future__ import annotations

import dataclasses
import importlib

import cpu_support
import pytest
from cpu_support import all_variants, compile_sample, variant_traits

from cutefa import codegen
from cutefa.model.options import Schedule

FAMILIES = [(arch, direction) for arch in ("sm80", "sm90", "sm100") for direction in ("fwd", "bwd")]


@pytest.mark.parametrize(("arch", "direction"), FAMILIES)
def test_sample_shows_every_trait(arch, direction, monkeypatch):
    monkeypatch.setattr(cpu_support, "FULL_COMPILE_TESTS", False)
    variants = all_variants(arch, direction)
    sample = compile_sample(variants)
    assert sample and set(sample) <= set(variants)
    assert [s for s in variants if s in sample] == sample  # the list's order
    assert set().union(*map(variant_traits, sample)) == set().union(*map(variant_traits, variants))
    assert compile_sample(list(variants)) == sample  # the same list, the same sample
    if len(variants) > 20:
        assert len(sample) <= len(variants) // 3


def test_traits_name_the_template_and_every_option_field():
    spec = next(s for s in all_variants("sm90", "fwd") if s.dtype == "bf16" and s.head_dim == 128)
    traits = dict(variant_traits(spec))
    assert traits["template"] == "fwd_sm90.py.j2" and traits["head_dim"] == 128
    assert traits["schedule"] in set(Schedule) and "pair_cvt" in traits and "exp_emu" in traits


def test_keep_and_the_full_run(monkeypatch):
    monkeypatch.setattr(cpu_support, "FULL_COMPILE_TESTS", False)
    variants = all_variants("sm80", "fwd")
    kept = variants[-1]
    sample = compile_sample(variants, keep=[kept])
    assert kept in sample and set(variant_traits(kept)) <= set().union(*map(variant_traits, sample))
    monkeypatch.setattr(cpu_support, "FULL_COMPILE_TESTS", True)
    assert compile_sample(variants) == variants


# The lists of variants each compile test module compiles (its cubin fixtures' inputs).
COMPILED = {
    "test_compile_sm80": ("CHECKED", "A100_SUBSET"),
    "test_compile_sm80_bwd": ("CHECKED", "A100_SUBSET"),
    "test_compile_sm90": ("CHECKED",),
    "test_compile_sm90_fp8": ("CHECKED", "BLOCK_CHECKED", "ALT_COMPILED"),
    "test_compile_sm90_fwd_lazy": ("CHECKED",),
    "test_compile_sm90_fwd_pcvt": ("SPECS",),
    "test_compile_sm90_fwd_hd64_192": ("SPECS",),
    "test_compile_sm90_bwd": ("CHECKED",),
    "test_compile_sm90_bwd_dqbulk": ("CHECKED",),
    "test_compile_sm90_bwd_dqswap": ("SWAPPED",),
    "test_compile_sm90_bwd_dqwarp": ("CHECKED", "RPF_CHECKED"),
    "test_compile_sm90_bwd_hsplit": ("CHECKED",),
    "test_compile_sm90_bwd_swapkv": ("CHECKED",),
    "test_compile_sm90_bwd_dv": ("CHECKED",),
    "test_compile_sm100": ("DEFAULTS", "PAIRS", "B300"),
    "test_compile_sm100_bwd": ("CHECKED",),
    "test_compile_sm100_fp8": ("CHECKED",),
}


def _template_and_options(spec) -> set[tuple]:
    fields = dataclasses.fields(spec.options)
    return {("template", codegen.template_name(spec))} | {
        (type(spec.options).__name__, f.name, getattr(spec.options, f.name)) for f in fields
    }


def test_compile_tests_cover_every_template_and_option_value():
    compiled = {
        spec for module, lists in COMPILED.items() for name in lists for spec in getattr(importlib.import_module(module), name)
    }
    variants = [s for arch in ("sm80", "sm90", "sm100") for s in all_variants(arch)]
    shown = set().union(*map(_template_and_options, compiled))
    missing = set().union(*map(_template_and_options, variants)) - shown
    assert not missing, sorted(missing, key=str)
