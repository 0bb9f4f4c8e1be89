"""The sm80 backward at head dims that are not multiples of 32 (padded to its tile head dim):
two samples compiled, each with no local memory. Run one at a time: -m compile -k ..."""

from __future__ import annotations

import pytest

from cutefa import sass
from cutefa.model import defaults
from cutefa.model.spec import Features

SAMPLES = [
    # hd80 on its committed 64x128 tile (96 columns), causal, with a packed batch, softcap and ALiBi
    # (with the window as well it spills 40 bytes of stack on sm_90a, as hd96 itself does there)
    (
        defaults.default_spec("sm80", "bwd", "bf16", 80, causal=True).replace(
            features=Features(varlen=True, softcap=True, alibi=True)
        ),
        "sm_90a",
    ),
    # hd40 on hd64's 128x128 double-buffered tile (64 columns)
    (defaults.default_spec("sm80", "bwd", "fp16", 40, causal=True), "sm_80"),
]


@pytest.mark.compile
@pytest.mark.parametrize(("spec", "target"), SAMPLES, ids=lambda x: getattr(x, "name", x))
def test_padded_backward_compiles_without_local_memory(spec, target, tmp_path):
    report = sass.analyze(sass.dump_cubins([spec], target, tmp_path)[spec.name])
    assert report.missing("sm80") == [], report.summary()
    assert 0 < report.registers <= 255 and report.spills == 0, report.summary()
    assert report.counts["LDL"] == 0 and report.counts["STL"] == 0, report.summary()
    assert report.counts["HMMA"] > 0 and report.counts["LDGSTS"] > 0, report.summary()
