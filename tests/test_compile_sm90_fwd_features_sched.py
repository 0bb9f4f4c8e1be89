"""The packed-batch forward's heavy-first grid (Scheduler.HEAVY_FIRST) and the dense tuned tile
carried over to packed batches (policy_sm90.fwd_varlen_from_dense) compile on this CPU for sm_90a,
and their SASS keeps the design: no local-memory spills, the uniform datapath kept (few R2UR), one
S = Q K^T and one O += P V per key block and loop body, the ragged views' five-mode TMA copies, and,
on the heavy-first grid, a CTA without a tile leaving (EXIT) before the first barrier of the
pipeline setup."""

from __future__ import annotations

import re

import pytest

from cutefa import sass
from cutefa.model.options import Mask, Schedule, Scheduler
from cutefa.model.rules import why_invalid
from cutefa.model.spec import Features, VariantSpec

pytestmark = pytest.mark.compile

VARLEN = Features(varlen=True)
MAX_R2UR = 64  # as tests/test_compile_sm90_features.py: hundreds when the uniform datapath is lost


def _spec(dtype, head_dim, tile, mask, **options) -> VariantSpec:
    return VariantSpec(
        "sm90", "fwd", dtype, head_dim, tile[0], tile[1], 2, 4 * (tile[0] // 64 + 1), mask=mask, features=VARLEN,
        schedule=Schedule.OVERLAP_PINGPONG, **options,
    )  # fmt: skip


CHECKED = [
    # today's default tile on the heavy-first grid, causal (the dense causal choice carried over)
    _spec("bf16", 128, (128, 128), Mask.CAUSAL, scheduler=Scheduler.HEAVY_FIRST),
    # the dense non-causal tuned tile carried over, on the heavy-first grid and on the grid
    _spec("bf16", 128, (128, 176), Mask.NONE, scheduler=Scheduler.HEAVY_FIRST, pair_cvt=True),
    _spec("bf16", 128, (128, 176), Mask.NONE, pair_cvt=True),
    # three consumers at 160 registers, causal (-regUsageLevel 3)
    _spec("fp16", 64, (192, 128), Mask.CAUSAL, scheduler=Scheduler.HEAVY_FIRST),
]


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("sm_90a_varlen_sched"))


def test_checked_specs_are_valid():
    assert [s.name for s in CHECKED if why_invalid(s) is not None] == []


@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    assert report.missing("sm90") == [], f"{spec.name}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    r2ur = sum(report.forms_of("R2UR").values())
    assert r2ur <= MAX_R2UR, f"{spec.name}: {r2ur} R2UR (the uniform datapath lost?): {report.summary()}"
    per_block = spec.head_dim // 16 + spec.tile_n // 16
    assert report.counts["HGMMA"] == 3 * per_block, (
        f"{spec.name}: {report.summary()}"
    )  # overlap: 2 bodies + prologue
    tma_forms = set(report.forms_of("UTMALDG")) | set(report.forms_of("UTMASTG"))
    assert tma_forms == {"UTMALDG.5D", "UTMASTG.5D"}, f"{spec.name}: {sorted(tma_forms)}"
    text = sass.kernel_text(sass.disassemble(cubins[spec.name]), "kernel")
    first_barrier = re.search(r"^\s+/\*([0-9a-f]+)\*/\s+BAR\.SYNC", text, re.MULTILINE)
    exits = [m.group(1) for m in re.finditer(r"^\s+/\*([0-9a-f]+)\*/\s+@!?P\d+\s+EXIT", text, re.MULTILINE)]
    assert first_barrier is not None
    early = [e for e in exits if int(e, 16) < int(first_barrier.group(1), 16)]
    if spec.options.scheduler is Scheduler.HEAVY_FIRST:
        assert early, f"{spec.name}: no predicated EXIT before the first barrier"
    else:
        assert not early, f"{spec.name}: the grid's CTAs set up before they look at their tile"
