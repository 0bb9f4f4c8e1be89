"""Default sm100 backward variants (every head dim and mask; fp16 and bf16 alternate, as they differ
only in the operand type) compile for sm_100a on this CPU, and their SASS shows the design: tcgen05
UMMA (UTCHMMA) for all five products, TMEM loads (LDTM) of S^T, dP^T, dQ, dK and
dV, TMA loads (UTMALDG) of K, V, Q and dO, MUFU.EX2 for the recomputed probabilities and fp32
reductions (REDG ... ADD.F32) into the dQ accumulator; no local-memory spills.

No Blackwell GPU exists here: compiled and SASS-checked, not run. One cubin holds the preprocess,
main and postprocess kernels; counts are summed over the three, registers are the largest.
"""

from __future__ import annotations

import re

import pytest

from cutefa import sass
from cutefa.model.budgets_sm100 import (
    SM100_SMEM_LIMIT,
    SM100_TMEM_COLUMNS,
    sm100_smem_bytes,
    sm100_tmem_columns,
)
from cutefa.model.committed import default_variants
from cutefa.model.rules import why_invalid

DEFAULTS = default_variants("sm100", "bwd")
# fp16 and bf16 differ only in the operand type: every head dim and mask, alternating dtypes, keeps
# the compile suite's time down.
CHECKED = [s for s in DEFAULTS if (s.dtype == "bf16") == (s.causal == (s.head_dim == 64))]


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_100a", tmp_path_factory.mktemp("bwd_sm_100a"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass_sm100a_bwd(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    for op in ("UTCHMMA", "LDTM", "UTMALDG", "MUFU.EX2"):
        assert report.counts.get(op, 0) > 0, f"{spec.name}: no {op}: {report.summary()}"
    # Five GEMMs (S^T, dP^T, dV, dK, dQ), each its first k-block plus a rolled loop over the rest.
    assert report.counts["UTCHMMA"] >= 10, f"{spec.name}: {report.summary()}"
    assert 0 < report.registers <= 255, f"{spec.name}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    reductions = re.findall(r"\bREDG?\.E\.ADD\.F32", sass._cuobjdump(cubins[spec.name], "-sass"))
    assert reductions, f"{spec.name}: no fp32 reductions into dq_accum"


def test_bwd_budgets_in_the_predicate():
    """TMEM (S^T + dP^T + dK + dV <= 512 columns) and shared memory of every default fit."""
    assert [s.head_dim for s in DEFAULTS if s.dtype == "bf16" and not s.causal] == [64, 128]
    for spec in DEFAULTS:
        assert why_invalid(spec) is None
        assert sm100_tmem_columns(spec) <= SM100_TMEM_COLUMNS
        assert sm100_smem_bytes(spec) <= SM100_SMEM_LIMIT
