"""The sm100 forward variants (a sample: cpu_support.compile_sample; every one with
CUTEFA_FULL_COMPILE_TESTS=1) compile for sm_100a on this CPU, and their SASS shows the FA4 design.

No Blackwell GPU exists here: these kernels are compiled and SASS-checked, not run. The checks:
tcgen05 UMMA (UTCHMMA), TMEM loads and stores (LDTM/STTM), TMA loads (UTMALDG), per-role register
budgets (USETMAXREG), the MUFU exp2 path, no local-memory spills, and the TMEM column budget of the
validity predicate. CTA-pair variants (Sm100FwdOptions.cta_pair): the 2-SM forms of UMMA, TMA load,
commit and TMEM allocation, and a cluster barrier; the single-CTA defaults carry none of them.
"""

from __future__ import annotations

import re

import pytest
from cpu_support import all_variants, assert_not_an_option, compile_sample

from cutefa import sass
from cutefa.model.budgets_sm100 import SM100_SMEM_LIMIT, sm100_smem_bytes, sm100_tmem_columns
from cutefa.model.rules import est_registers, why_invalid
from cutefa.model.spec import VariantSpec

ALL_FWD = all_variants("sm100", "fwd")
# one CTA per UMMA; e4m3: test_compile_sm100_fp8.py
SINGLE = [s for s in ALL_FWD if not s.options.cta_pair and s.dtype != "e4m3"]
DEFAULTS = compile_sample(SINGLE)
# Two of the committed CTA-pair variants: two Q tiles per CTA with a causal mask (head dim 128), and
# one Q tile at head dim 256.
PAIRS = [
    VariantSpec("sm100", "fwd", "bf16", 128, 256, 128, 3, 16, causal=True, cta_pair=True, exp_emu=25),
    VariantSpec("sm100", "fwd", "fp16", 256, 128, 64, 2, 16, cta_pair=True),
]
# What cuobjdump prints for the cta_group::2 forms (read from the SASS of the variants above).
PAIR_FORMS = ("UTCHMMA.2CTA", "UTMALDG.4D.2CTA", "UTCBAR.2CTA.MULTICAST", "UTCATOMSWS.2CTA.FIND_AND_SET.ALIGN")


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(DEFAULTS, "sm_100a", tmp_path_factory.mktemp("sm_100a"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", DEFAULTS, ids=lambda s: s.name)
def test_sass_sm100a(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    assert report.missing("sm100") == [], f"{spec.name}: {report.summary()}"
    assert report.counts.get("USETMAXREG", 0) >= 4, f"{spec.name}: warp roles set no register budgets"
    assert report.counts.get("MUFU.EX2", 0) > 0, f"{spec.name}: {report.summary()}"
    # 512 threads on one SM: 128 registers per thread at launch, more only through setmaxnreg.
    assert 0 < report.registers <= 128, f"{spec.name}: {report.summary()}"
    # S = Q K^T and O += P V per Q tile at four call sites of the MMA warp (prologue S, mainloop
    # O and S, tail O); each issues its first k-block, then the rest in a rolled loop (one more).
    q_tiles = spec.tile_m // 128
    assert report.counts["UTCHMMA"] >= 8 * q_tiles, f"{spec.name}: {report.summary()}"
    # One CTA per UMMA: no 2-SM forms, no cluster barrier.
    assert not [f for f in report.forms if ".2CTA" in f or f.startswith("UCGABAR")], f"{spec.name}: {report.forms}"


@pytest.mark.compile
@pytest.mark.parametrize("spec", DEFAULTS, ids=lambda s: s.name)
def test_no_spills_sm100a(cubins, spec):
    """No local memory anywhere: every warp role fits its setmaxnreg budget."""
    report = sass.analyze(cubins[spec.name])
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"


def test_pair_variants_are_committed():
    assert set(PAIRS) <= set(ALL_FWD)


@pytest.fixture(scope="module")
def pair_cubins(tmp_path_factory):
    return sass.dump_cubins(PAIRS, "sm_100a", tmp_path_factory.mktemp("sm_100a_pair"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", PAIRS, ids=lambda s: s.name)
def test_sass_pair_sm100a(pair_cubins, spec):
    """Every UMMA is the 2-SM form (cta_group::2), issued by the leader; K/V/Q arrive by 2-SM TMA
    loads; commits multicast to both CTAs; TMEM is allocated for the pair; no spills."""
    report = sass.analyze(pair_cubins[spec.name])
    assert report.missing("sm100") == [], f"{spec.name}: {report.summary()}"
    for form in PAIR_FORMS:
        assert report.forms.get(form, 0) > 0, f"{spec.name}: no {form} in {report.forms}"
    q_tiles = spec.tile_m // 128
    assert report.forms_of("UTCHMMA") == {"UTCHMMA.2CTA": report.counts["UTCHMMA"]}, report.forms_of("UTCHMMA")
    assert report.counts["UTCHMMA"] >= 8 * q_tiles, f"{spec.name}: {report.summary()}"
    assert all(".2CTA" in f for f in report.forms_of("UTMALDG")), report.forms_of("UTMALDG")
    assert all(".2CTA" in f for f in report.forms_of("UTCBAR")), report.forms_of("UTCBAR")
    assert report.forms.get("UCGABAR_ARV", 0) >= 2 and report.forms.get("UCGABAR_WAIT", 0) >= 2, report.forms
    assert report.counts.get("LDTM", 0) > 0 and report.counts.get("STTM", 0) > 0, report.summary()
    assert report.counts.get("USETMAXREG", 0) >= 4, f"{spec.name}: warp roles set no register budgets"
    assert 0 < report.registers <= 128, f"{spec.name}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"


B300 = compile_sample(s for s in SINGLE if s.dtype == "bf16" and s.head_dim == 128 and not s.causal)


@pytest.mark.compile
@pytest.mark.parametrize("spec", B300, ids=lambda s: s.name)
def test_sass_sm103a(tmp_path, spec):
    """The same family compiled for the B300 (cc 10.3), whose GPUs do not load sm_100a code."""
    report = sass.analyze(sass.dump_cubins([spec], "sm_103a", tmp_path)[spec.name])
    assert report.missing("sm100") == [], f"{spec.name}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"


def test_register_plan_fits_the_register_file():
    """setmaxnreg budgets of the four warpgroups (softmax x2, correction, MMA/load/epilogue) sum to
    at most 512: 64K registers per SM over 512 threads, 128 threads per warpgroup."""
    from cutefa import codegen

    for spec in ALL_FWD:
        text = codegen.render_source(spec)
        regs = {
            k: int(v) for k, v in re.findall(r"^REG_(SOFTMAX|CORRECTION|OTHER) = (\d+)$", text, re.MULTILINE)
        }
        assert 2 * regs["SOFTMAX"] + regs["CORRECTION"] + regs["OTHER"] <= 512, (spec.name, regs)
        assert all(r % 8 == 0 and 24 <= r <= 256 for r in regs.values()), (spec.name, regs)
        assert est_registers(spec) <= regs["SOFTMAX"], spec.name


def test_tmem_budget_in_the_predicate():
    """S and O of every Q tile in flight must fit the 512 TMEM columns; the predicate says so."""
    ok = VariantSpec("sm100", "fwd", "bf16", 128, 256, 128, 3, 16)
    assert sm100_tmem_columns(ok) == 512 and why_invalid(ok) is None
    too_big = VariantSpec("sm100", "fwd", "bf16", 256, 256, 64, 2, 16)
    reason = why_invalid(too_big)
    assert reason is not None and "TMEM columns" in reason and "512" in reason
    for spec in ALL_FWD:
        assert sm100_tmem_columns(spec) <= 512
        assert sm100_smem_bytes(spec) <= SM100_SMEM_LIMIT


def test_exp_emu_rules():
    base = VariantSpec("sm100", "fwd", "bf16", 128, 256, 128, 3, 16)
    assert why_invalid(base.replace(exp_emu=25)) is None
    assert base.replace(exp_emu=25).options.exp_emu == 25
    assert "6.25%" in why_invalid(base.replace(exp_emu=30))
    for arch, direction in (("sm80", "fwd"), ("sm80", "bwd"), ("sm90", "bwd"), ("sm100", "bwd")):
        assert_not_an_option(arch, direction, "bf16", exp_emu=25)
