"""WGMMA descriptors computed once per kernel (cutefa/kernels/sm90/descriptors.py) on this CPU.

Before, every GEMM issue rebuilt its operand's shared-memory descriptor from the shared-memory base
(``UIADD3`` base + offset, ``USHF.R`` 4, ``ULOP3`` & 0x3fc0, ``ULOP3`` | layout bits) inside the
key (forward) or query (backward) loop. Checked on the sm_90a SASS: the loop that issues one
step's GEMMs masks no descriptor start address (the forwards of both precisions and the backward
templates, the head-dim split included), no spill, no serialized WGMMA; and the causal
two-consumer forward tiles the template leaves out (ptxas gave up the uniform datapath there)
keep their descriptors at the issues and their WGMMAs asynchronous.
"""

from __future__ import annotations

import re

import pytest
from cpu_support import step_loop

from cutefa import codegen, sass
from cutefa.model.spec import parse_name

pytestmark = pytest.mark.compile

# variant, the GEMM issues of one loop step (its WGMMA instructions)
HOISTED = {
    "cutefa_sm90_fwd_bf16_hd64_192x128_s2_w16_ov_pp": 64 // 16 + 128 // 16,
    "cutefa_sm90_fwd_fp16_hd256_128x80_s2_w12_ov_pp_erescale_pcvt_lres": 256 // 16 + 80 // 16,
    "cutefa_sm90_fwd_e4m3_hd256_128x96_s2_w12_ov_pp_hvt_lres": 256 // 32 + 96 // 32,
    "cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_ov_dqbulk_dqw": 44,
    "cutefa_sm90_bwd_bf16_hd256_64x64_s2_w12_ov_dqbulk": 44,
}
KEPT = [
    "cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_causal_ov_pp_erescale_pcvt_lres",
    "cutefa_sm90_fwd_fp16_hd128_128x176_s2_w12_causal_ov_pp_pcvt",
]
# the descriptor's start-address field taken from a shared-memory address (bits 4..17, 1 KiB aligned)
_ADDRESS_MASK = re.compile(r"ULOP3\.LUT\s+UR\d+,\s*UR\d+,\s*0x3fc0,")


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    specs = [parse_name(n) for n in [*HOISTED, *KEPT]]
    return sass.dump_cubins(specs, "sm_90a", tmp_path_factory.mktemp("sm_90a_descriptors"))


def test_generated_sources_follow_the_rule():
    for name in HOISTED:
        assert "hoisted(" in codegen.render_source(parse_name(name)), name
    for name in KEPT:
        assert not re.search(r"= hoisted\(", codegen.render_source(parse_name(name))), name


@pytest.mark.parametrize("name", list(HOISTED))
def test_descriptors_leave_the_loop(cubins, name):
    text = sass.disassemble(cubins[name])
    body = step_loop(text, HOISTED[name])
    assert not [i for i in body if _ADDRESS_MASK.match(i)], f"{name}: descriptors rebuilt in the loop"
    assert _ADDRESS_MASK.search(text), f"{name}: no descriptor computed at all (pattern out of date?)"
    report = sass.analyze(cubins[name])
    assert report.spills == 0, report.summary()
    waits = sum(report.forms_of("WARPGROUP.DEPBAR").values())
    gmma = report.counts["HGMMA"] + report.counts["QGMMA"]
    assert waits < gmma // 2, f"{name}: {waits} WGMMA waits for {gmma} WGMMAs (serialized)"


@pytest.mark.parametrize("name", KEPT)
def test_left_out_tiles_keep_the_uniform_datapath(cubins, name):
    report = sass.analyze(cubins[name])
    assert report.spills == 0, report.summary()
    assert sum(report.forms_of("R2UR").values()) <= 64, report.summary()
    assert sum(report.forms_of("WARPGROUP.ARRIVE").values()) <= 12, report.summary()
