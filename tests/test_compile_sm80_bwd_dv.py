"""The sm80 backward with a V head dim of its own, (192, 128) (DeepSeek's prefill): two samples
compiled, each with no local memory and exactly one step's MMAs of the narrower V: S = Q K^T, dQ
and dK over 192 columns, dP = dO V^T and dV = P^T dO over 128 (a V padded to 192 columns would
issue 240 per warp at 64x64 with 8 warps, not 208). Run one at a time: -m compile -k ..."""

from __future__ import annotations

import pytest

from cutefa import sass
from cutefa.model import defaults
from cutefa.model.spec import Features

D, DV = 192, 128
SAMPLES = [
    # the committed default's tile, causal, dense, for the A100
    (defaults.default_spec("sm80", "bwd", "bf16", D, causal=True, head_dim_v=DV), "sm_80"),
    # packed sequences with softcap and ALiBi, for Hopper (where dispatch routes the pair here)
    (
        defaults.default_spec("sm80", "bwd", "fp16", D, head_dim_v=DV).replace(
            features=Features(varlen=True, softcap=True, alibi=True)
        ),
        "sm_90a",
    ),
]


def step_mmas_per_warp(spec) -> int:
    """m16n8k16 MMAs of one query-block step per warp: S and dQ, dK over head_dim; dP, dV over head_dim_v."""
    m, n = spec.tile_m, spec.tile_n
    macs = m * n * (3 * spec.head_dim + 2 * spec.head_dim_v)
    return macs // (16 * 8 * 16) // spec.warps


@pytest.mark.compile
@pytest.mark.parametrize(("spec", "target"), SAMPLES, ids=lambda x: getattr(x, "name", x))
def test_backward_of_v_head_dim_compiles_without_local_memory(spec, target, tmp_path):
    report = sass.analyze(sass.dump_cubins([spec], target, tmp_path)[spec.name])
    assert report.missing("sm80") == [], report.summary()
    assert 0 < report.registers <= 255 and report.spills == 0, report.summary()
    assert report.counts["LDL"] == 0 and report.counts["STL"] == 0, report.summary()
    assert report.counts["LDGSTS"] > 0, report.summary()
    assert report.counts["HMMA"] == step_mmas_per_warp(spec) == 208, report.summary()
