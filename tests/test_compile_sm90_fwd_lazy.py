"""The sm90 16-bit forward's lazy O rescale (Sm90FwdOptions.lazy_rescale, name token _lres) on this CPU.

A warp keeps its rows' running maxes until a key block raises one of them by more than 2^8 and
rescales its rows of O only then (cutefa/kernels/common/lazy_rescale.py). Checked: the option's rule
and committed variants, and the SASS (sm_90a) of one bf16 and one fp16 variant: one warp vote per
softmax step (the overlap prologue and the two loop bodies), the O rescale (head_dim / 2 FMULs per
thread) behind a branch of its own at each place the twin rescales, the twin's WGMMA waits (no
serialized WGMMA), no spill, both setmaxnreg budgets kept. Correctness on hardware:
tests/gpu/test_variants.py (every committed variant, and rising row maxes against the twin).
"""

from __future__ import annotations

import pytest
from cpu_support import all_variants, assert_not_an_option, skipped_fmuls

from cutefa import sass
from cutefa.model.options import Schedule, Scheduler
from cutefa.model.rules import why_invalid
from cutefa.model.spec import VariantSpec

LAZY = [s for s in all_variants("sm90", "fwd") if s.dtype != "e4m3" and s.options.lazy_rescale]
# hd256 non-causal with the early rescale (bf16) and hd128 causal without it (fp16)
CHECKED = [
    s
    for s in LAZY
    if s.options.scheduler is Scheduler.GRID
    and (s.dtype, s.head_dim, s.causal, s.tile_n) in (("bf16", 256, False, 80), ("fp16", 128, True, 176))
]


def test_rule_and_committed_variants():
    options = {"schedule": Schedule.OVERLAP_PINGPONG, "pair_cvt": True, "lazy_rescale": True}
    spec = VariantSpec("sm90", "fwd", "bf16", 256, 128, 80, 2, 12, **options)
    assert spec.name == "cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_ov_pp_pcvt_lres"
    assert why_invalid(spec) is None
    for schedule in (Schedule.SERIAL, Schedule.PINGPONG):
        assert "overlap schedule" in why_invalid(spec.replace(schedule=schedule)), schedule
    assert why_invalid(spec.replace(schedule=Schedule.OVERLAP)) is None
    assert "exp_emu" in why_invalid(spec.replace(exp_emu=25))
    for arch, direction in (("sm80", "fwd"), ("sm90", "bwd"), ("sm100", "fwd")):
        assert_not_an_option(arch, direction, "bf16", lazy_rescale=True)
    assert {(s.dtype, s.head_dim, s.causal) for s in LAZY} == {
        (dt, hd, c) for dt in ("fp16", "bf16") for hd in (64, 128, 256) for c in (False, True)
    }
    variants = set(all_variants("sm90", "fwd"))
    assert all(s.options.schedule.overlap and s.replace(lazy_rescale=False) in variants for s in LAZY)
    # the tuned table's tiles and schedules: hd256 128x80 overlap + ping-pong with the early rescale
    # and paired conversion (on both grids), hd128 128x160 and 128x176 overlap + ping-pong, paired;
    # hd64's three-consumer 192x128 overlap + ping-pong
    assert {s.name.removeprefix(f"cutefa_sm90_fwd_{s.dtype}_").replace("_causal", "") for s in LAZY} == {
        "hd256_128x80_s2_w12_ov_pp_erescale_pcvt_lres",
        "hd256_128x80_s2_w12_ov_pp_lpt_erescale_pcvt_lres",
        "hd128_128x160_s2_w12_ov_pp_pcvt_lres",
        "hd128_128x176_s2_w12_ov_pp_pcvt_lres",
        "hd64_192x128_s2_w16_ov_pp_lres",
    }
    assert len(LAZY) == 5 * 2 * 2  # x dtypes x masks
    assert len(CHECKED) == 2


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    specs = CHECKED + [s.replace(lazy_rescale=False) for s in CHECKED]
    return sass.dump_cubins(specs, "sm_90a", tmp_path_factory.mktemp("sm_90a_lazy"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_lazy_rescale_sass(cubins, spec):
    text = sass.disassemble(cubins[spec.name])
    twin = spec.replace(lazy_rescale=False)
    twin_text = sass.disassemble(cubins[twin.name])
    report, twin_report = sass.analyze(cubins[spec.name]), sass.analyze(cubins[twin.name])
    assert text.count("VOTE.ANY") == 3, report.summary()
    # the rescale sites: each loop body's, and with the early rescale the last block's P V (ptxas
    # may copy a site: at least that many more branches over head_dim / 2 FMULs than the twin has)
    sites = 3 if spec.options.early_rescale else 2
    half = spec.head_dim // 2
    assert skipped_fmuls(text).count(half) >= skipped_fmuls(twin_text).count(half) + sites, (
        skipped_fmuls(text), skipped_fmuls(twin_text)
    )
    assert text.count("WARPGROUP.DEPBAR") == twin_text.count("WARPGROUP.DEPBAR")
    assert report.counts["HGMMA"] == twin_report.counts["HGMMA"]
    assert report.spills == 0 and report.counts["LDL"] == 0 and report.counts["STL"] == 0, report.summary()
    regions = sass.setmaxnreg_regions(text)
    assert regions and all(used < budget for budget, used in regions), regions
