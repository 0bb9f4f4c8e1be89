"""The hd128 forwards with longer key tiles (FlashAttention-3's non-causal hd128 tile is 128x176)
compile for sm_90a within the consumers' 240 registers when P is converted two scores per
instruction (pair_cvt): no spill, no element-wise F2FP, the WGMMAs issued as whole groups (no
serialization, remark C7520), and the uniform datapath kept. The register estimate rejects 128x176
and 128x192; space.SM90_PCVT_NO_SPILL admits them with pair_cvt only (without it 128x176 spills)."""

from __future__ import annotations

import re

import pytest

from cutefa import sass, space
from cutefa.spec import parse_name

pytestmark = pytest.mark.compile

NAMES = (
    "cutefa_sm90_fwd_bf16_hd128_128x176_s2_w12_ov_pp_pcvt",
    "cutefa_sm90_fwd_fp16_hd128_128x192_s2_w12_causal_ov_pp_pcvt",
)
SPECS = [parse_name(n) for n in NAMES]


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(SPECS, "sm_90a", tmp_path_factory.mktemp("sm_90a_hd128_long"))


def test_admitted_and_committed():
    committed = set(space.default_variants("sm90", "fwd"))
    for spec in SPECS:
        assert space.why_invalid(spec) is None, spec.name
        assert spec in committed, spec.name
        assert space.est_registers(spec) > space.SM90_CONSUMER_REGS, "admitted by the estimate alone"


@pytest.mark.parametrize(
    "name",
    [
        "cutefa_sm90_fwd_bf16_hd128_128x176_s2_w12_ov_pp",  # spills without pair_cvt
        "cutefa_sm90_fwd_bf16_hd128_128x176_s2_w12_ov_pcvt",  # not compiled without ping-pong
        "cutefa_sm90_fwd_bf16_hd128_128x192_s2_w12_ov_pp_erescale_pcvt",
        "cutefa_sm90_fwd_bf16_hd128_128x192_s2_w12_ov_pp_pcvt_emu25",
    ],
)
def test_rejected_without_the_compiled_schedule(name):
    assert space.why_invalid(parse_name(name)) is not None, name


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_sass(cubins, spec):
    cubin = cubins[spec.name]
    report = sass.analyze(cubin)
    text = sass.disassemble(cubin)
    assert report.missing("sm90") == [], report.summary()
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    assert report.counts["USETMAXREG"] >= 2, report.summary()
    regions = sass.setmaxnreg_regions(text)
    consumer = [r for r in regions if r[0] == space.SM90_CONSUMER_REGS]
    assert consumer and all(highest < space.SM90_CONSUMER_REGS for _, highest in consumer), regions
    # S = Q K^T (8 WGMMAs of k16, N = tile_n) and O += P V (tile_n / 16) in the masked and the
    # unmasked loop, plus the overlap schedule's prologue S and epilogue P V
    assert report.counts["HGMMA"] == 3 * (spec.head_dim // 16 + spec.tile_n // 16), report.summary()
    singles = re.findall(r"F2FP\S*\s+R\d+, RZ, R\d+", text)
    assert not singles, f"{spec.name}: {len(singles)} element-wise conversions"
    arrives = sum(report.forms_of("WARPGROUP.ARRIVE").values())
    waits = sum(report.forms_of("WARPGROUP.DEPBAR").values())
    assert arrives <= 8 and waits <= 8, f"{spec.name}: {arrives} arrives, {waits} waits"
    r2ur = sum(report.forms_of("R2UR").values())
    assert r2ur <= 40, f"{spec.name}: {r2ur} R2UR"
