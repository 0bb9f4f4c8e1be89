"""The hd256 128x80 forwards closer to FlashAttention-4's sm90 configuration compile for sm_90a with
no spill and keep their WGMMAs in flight: P converted two scores per instruction (pair_cvt: no
element-wise F2FP), the O rescale under S = Q K^T (early_rescale) without ptxas serializing the
WGMMAs (remark C7520: a wait after every HGMMA), and the uniform datapath kept."""

from __future__ import annotations

import re

import pytest

from cutefa import sass, space
from cutefa.spec import parse_name

pytestmark = pytest.mark.compile

NAMES = (
    "cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_causal_ov_erescale_pcvt",
    "cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_ov_pp_pcvt",
)
SPECS = [parse_name(n) for n in NAMES]


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(SPECS, "sm_90a", tmp_path_factory.mktemp("sm_90a_hd256_fa4"))


def test_admitted_and_committed():
    committed = set(space.default_variants("sm90", "fwd"))
    for spec in SPECS:
        assert space.why_invalid(spec) is None, spec.name
        assert spec in committed, spec.name


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_sass(cubins, spec):
    cubin = cubins[spec.name]
    report = sass.analyze(cubin)
    text = sass.disassemble(cubin)
    assert report.missing("sm90") == [], report.summary()
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    assert report.counts["USETMAXREG"] >= 2, report.summary()
    regions = sass.setmaxnreg_regions(text)
    consumer = [r for r in regions if r[0] == 240]
    assert consumer and all(highest < 240 for _, highest in consumer), regions
    # S = Q K^T (16 WGMMAs of k16) and O += P V (5) in the masked and the unmasked loop, plus the
    # overlap schedule's prologue S and epilogue P V
    assert report.counts["HGMMA"] == 3 * (spec.head_dim // 16 + spec.tile_n // 16), report.summary()
    # P (and O in the epilogue) converted in pairs: no F2FP with a zero second operand, which is the
    # element-wise form tensor.to(bf16) takes for a 64x80 accumulator (100 of them in the kernel)
    singles = re.findall(r"F2FP\S*\s+R\d+, RZ, R\d+", text)
    assert not singles, f"{spec.name}: {len(singles)} element-wise conversions"
    # WGMMAs stay asynchronous: one arrive/wait per GEMM group, not one per HGMMA (63 when serialized)
    arrives = sum(report.forms_of("WARPGROUP.ARRIVE").values())
    waits = sum(report.forms_of("WARPGROUP.DEPBAR").values())
    assert arrives <= 8 and waits <= 8, f"{spec.name}: {arrives} arrives, {waits} waits"
    # descriptors and pipeline state in uniform registers (300+ R2UR when ptxas gives that up)
    r2ur = sum(report.forms_of("R2UR").values())
    assert r2ur <= 40, f"{spec.name}: {r2ur} R2UR"
