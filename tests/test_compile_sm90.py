"""The sm90 16-bit forward variants (a sample: cpu_support.compile_sample; every one with
CUTEFA_FULL_COMPILE_TESTS=1) compile on this CPU for sm_90a, and their SASS shows the FlashAttention-3
design: WGMMA (HGMMA), TMA loads (UTMALDG), setmaxnreg (USETMAXREG), mbarrier pipelines (SYNCS),
MUFU.EX2 for the softmax, stmatrix (STSM) in the epilogue; no local-memory spills."""

from __future__ import annotations

import pytest
from cpu_support import all_variants, compile_sample

from cutefa import sass

pytestmark = pytest.mark.compile

# fp8: test_compile_sm90_fp8.py
CHECKED = compile_sample(s for s in all_variants("sm90", "fwd") if s.dtype != "e4m3")


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("sm_90a"))


@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    assert report.missing("sm90") == [], f"{spec.name}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    assert report.counts["USETMAXREG"] >= 2, report.summary()  # producer gives, consumers take
    assert report.counts["MUFU.EX2"] > 0, report.summary()
    assert report.counts["STSM"] > 0, report.summary()  # O leaves registers through stmatrix
    # S = Q K^T: head_dim/16 WGMMAs per key block, O += P V: tile_n/16; one body per loop (masked,
    # unmasked), plus the overlap schedule's prologue S and epilogue P V.
    per_block = spec.head_dim // 16 + spec.tile_n // 16
    schedule = spec.options.schedule
    expected = 2 * per_block + ((spec.head_dim // 16) + (spec.tile_n // 16) if schedule.overlap else 0)
    assert report.counts["HGMMA"] == expected, f"{spec.name}: {report.summary()}"
    if schedule.pingpong:  # named-barrier hand-over between the consumer warpgroups
        assert report.counts["BAR.SYNC"] > 2, report.summary()
