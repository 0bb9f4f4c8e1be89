"""The three-consumer hd64 forward (tile 192x128: three consumer warpgroups of 64 query rows, 160
registers per consumer thread after setmaxnreg) compiles for sm_90a with no spill, its masked blocks
select each score once, and ptxas keeps the uniform datapath (WGMMA descriptors and pipeline state
in uniform registers) where it did when these variants were admitted
(cutefa.model.budgets_sm90.SM90_3WG_NO_SPILL)."""

from __future__ import annotations

import re

import pytest
from cpu_support import all_variants

from cutefa import codegen, sass
from cutefa.model.budgets_sm90 import sm90_consumer_regs, sm90_fp8_ptxas_options
from cutefa.model.options import Schedule, Scheduler
from cutefa.model.rules import why_invalid
from cutefa.model.spec import parse_name

pytestmark = pytest.mark.compile

NAMES = (
    "cutefa_sm90_fwd_bf16_hd64_192x128_s2_w16_causal_ov",
    "cutefa_sm90_fwd_fp16_hd64_192x128_s2_w16_ov",
    "cutefa_sm90_fwd_bf16_hd64_192x128_s2_w16_causal_ov_pp",
    "cutefa_sm90_fwd_bf16_hd64_192x128_s2_w16_causal_ov_pp_lpt",
)
SPECS = [parse_name(n) for n in NAMES]
# Causal with ping-pong or the 1-D longest-first grid: at ptxas's default register-usage level
# (sm_90a, DSL 4.8.1) the WGMMA descriptors moved to regular registers (~130 R2UR, about 55 more
# instructions per key block); their generated modules ask ptxas for level 3 (PTXAS_OPTIONS),
# which keeps the uniform datapath.
PTXAS_OPTIONS = {
    f"cutefa_sm90_fwd_{dtype}_hd64_192x128_s2_w16_causal_{flags}": "-regUsageLevel 3"
    for dtype in ("bf16", "fp16")
    for flags in ("ov_pp", "ov_lpt", "ov_pp_lpt", "ov_pp_lres")
}


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(SPECS, "sm_90a", tmp_path_factory.mktemp("sm_90a_hd64_192"))


def _count(report: sass.SassReport, base: str) -> int:
    return sum(n for op, n in report.forms.items() if op == base or op.startswith(base + "."))


def test_admitted_and_committed():
    variants = set(all_variants("sm90", "fwd"))
    for spec in SPECS:
        assert why_invalid(spec) is None, spec.name
        assert spec in variants, spec.name
        assert sm90_consumer_regs(spec) == 160
    # the same tile with another schedule is not admitted by the compiled list
    assert why_invalid(SPECS[0].replace(schedule=Schedule.SERIAL)) is not None


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_sass(cubins, spec):
    cubin = cubins[spec.name]
    report = sass.analyze(cubin)
    assert report.missing("sm90") == [], report.summary()
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    assert report.counts["USETMAXREG"] >= 2, report.summary()
    # (budget, highest register) per setmaxnreg region: the consumers run within 160
    regions = sass.setmaxnreg_regions(sass.disassemble(cubin))
    consumer = [r for r in regions if r[0] == 160]
    assert consumer, regions
    assert all(highest < 160 for _, highest in consumer), regions
    # S = Q K^T (4 WGMMAs) and O += P V (8) in the masked and the unmasked loop, plus the overlap
    # schedule's prologue S and epilogue P V
    per_block = spec.head_dim // 16 + spec.tile_n // 16
    assert report.counts["HGMMA"] == 3 * per_block, report.summary()
    # Masked blocks (the prologue and the masked loop) select each of a thread's 64 scores once;
    # the softmax adds a few for rows that saw no key. A branch per score had ptxas emit ~2,000.
    selects = _count(report, "FSEL") + _count(report, "SEL")
    assert selects <= 2 * 64 + 32, f"{spec.name}: {selects} selects"
    if spec.causal:
        assert _count(report, "R2P") > 0, "causal rows: bit masks to predicates"
    r2ur = _count(report, "R2UR")
    # the 1-D grid's tile arithmetic (divisions, once per CTA) adds ~20 outside the key loops
    limit = 40 if spec.options.scheduler is Scheduler.LPT else 16
    assert r2ur <= limit, f"{spec.name}: {r2ur} R2UR (descriptors left the uniform registers)"
    # one warpgroup arrive and one wait per WGMMA group (S, P V in each loop, prologue S and last
    # P V): ptxas did not serialize the WGMMAs
    assert _count(report, "WARPGROUP.ARRIVE") == 6, report.summary()
    assert _count(report, "WARPGROUP.DEPBAR") == 6, report.summary()


def test_ptxas_options_only_where_needed():
    """Only the causal three-way ping-pong forms and the e4m3 tiles of sm90_fp8_ptxas_options
    carry ptxas options; every other committed variant is compiled with ptxas's defaults."""
    variants = all_variants("sm90", "fwd")
    fp8 = {s.name: sm90_fp8_ptxas_options(s) for s in variants if s.dtype == "e4m3"}
    expected = PTXAS_OPTIONS | {name: options for name, options in fp8.items() if options}
    assert len(expected) == len(PTXAS_OPTIONS) + 10  # ten e4m3 tiles (docs/log/perf-notes.md)
    for spec in variants:
        source = codegen.render_source(spec)
        found = re.findall(r'^PTXAS_OPTIONS = "([^"]*)"$', source, re.MULTILINE)
        assert found == ([expected[spec.name]] if spec.name in expected else []), spec.name
    assert set(PTXAS_OPTIONS) <= {s.name for s in variants}
