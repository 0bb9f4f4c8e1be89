"""Every default sm80 backward variant compiles on this CPU, and its SASS shows the FlashAttention-2
backward design: mma.sync (HMMA), ldmatrix (LDSM), cp.async (LDGSTS), MUFU.EX2 for the recomputed
probabilities and fp32 reductions (REDG ... ADD.F32) for the dQ accumulator; no local-memory spills.

One cubin holds the preprocess, main and postprocess kernels; counts are summed over the three and
registers are the largest of them (the main kernel).
"""

from __future__ import annotations

import re

import pytest

from cutefa import sass, space

pytestmark = pytest.mark.compile

DEFAULTS = space.default_variants("sm80", "bwd")
A100_SUBSET = [s for s in DEFAULTS if s.dtype == "fp16" and s.causal and s.head_dim in (128, 256)]


@pytest.fixture(scope="module")
def cubins_sm90a(tmp_path_factory):
    return sass.dump_cubins(DEFAULTS, "sm_90a", tmp_path_factory.mktemp("bwd_sm_90a"))


@pytest.fixture(scope="module")
def cubins_sm80(tmp_path_factory):
    return sass.dump_cubins(A100_SUBSET, "sm_80", tmp_path_factory.mktemp("bwd_sm_80"))


def _reductions(cubin) -> int:
    return len(re.findall(r"\bREDG?\.E\.ADD\.F32", sass._cuobjdump(cubin, "-sass")))


def _check(cubin, spec) -> None:
    report = sass.analyze(cubin)
    assert report.missing("sm80") == [], f"{spec.name}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    assert 0 < report.registers <= 255, f"{spec.name}: {report.summary()}"
    # Five GEMMs per query block (S, dP, dV, dK, dQ), each tile_m * tile_n * head_dim MACs per CTA.
    per_warp = spec.tile_m * spec.tile_n * spec.head_dim // (16 * 8 * 16) // spec.warps
    assert report.counts["HMMA"] == 5 * per_warp, f"{spec.name}: {report.summary()}"
    # One fp32 reduction per dQ element a thread holds.
    assert _reductions(cubin) == spec.tile_m * spec.head_dim // spec.threads, spec.name


@pytest.mark.parametrize("spec", DEFAULTS, ids=lambda s: s.name)
def test_sass_sm90a(cubins_sm90a, spec):
    _check(cubins_sm90a[spec.name], spec)


@pytest.mark.parametrize("spec", A100_SUBSET, ids=lambda s: s.name)
def test_sass_sm80(cubins_sm80, spec):
    _check(cubins_sm80[spec.name], spec)
