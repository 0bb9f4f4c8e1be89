"""The sm90 e4m3 forward on packed sequences (templates/fwd_sm90_fp8.py.j2 with the varlen axis)
compiles on this CPU for sm_90a, two samples of the variants dispatch takes (head dim 64 with the
ping-pong schedule, not causal; head dim 128, causal), each beside its dense twin: no local memory,
the twin's tensor-core work (as many e4m3 WGMMAs, P conversions and exp2 per step), the TMA loads
through the ragged views' five modes (cutefa/kernels/sm90/varlen.py) and the dense twin's four."""

from __future__ import annotations

import pytest

from cutefa import sass
from cutefa.model.defaults import default_spec
from cutefa.model.rules import why_invalid
from cutefa.model.spec import Features

pytestmark = pytest.mark.compile

CHECKED = [
    default_spec("sm90", "fwd", "e4m3", 64, causal=False).replace(features=Features(varlen=True)),
    default_spec("sm90", "fwd", "e4m3", 128, causal=True).replace(features=Features(varlen=True)),
]
TWINS = [s.replace(features=Features()) for s in CHECKED]


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED + TWINS, "sm_90a", tmp_path_factory.mktemp("sm_90a_fp8_varlen"))


def test_checked_specs_are_valid():
    assert [s.name for s in CHECKED if why_invalid(s) is not None] == []


@pytest.mark.parametrize(("spec", "twin"), list(zip(CHECKED, TWINS)), ids=lambda s: s.name)
def test_sass(cubins, spec, twin):
    report, dense = sass.analyze(cubins[spec.name]), sass.analyze(cubins[twin.name])
    assert report.spills == 0 and report.local_bytes == 0, f"{spec.name}: {report.summary()}"
    for op in ("QGMMA", "F2FP.SATFINITE.E4M3", "MUFU.EX2", "USETMAXREG"):
        assert report.counts[op] == dense.counts[op], (
            f"{spec.name} {op}: {report.summary()} vs {dense.summary()}"
        )
    assert report.counts["HGMMA"] == 0
    assert set(report.forms_of("UTMALDG")) == {"UTMALDG.5D"}, report.summary()
    assert set(dense.forms_of("UTMALDG")) == {"UTMALDG.4D"}, dense.summary()
