"""sm90 forwards that convert P two scores per instruction (pair_cvt) compile for sm_90a within the
consumers' 240 registers and keep their WGMMAs in flight: no spill, no element-wise F2FP (the form
``tensor.to(bf16)`` takes for a 64x80 or a 64x144-192 accumulator), one arrive/wait per GEMM group
(not one per HGMMA: ptxas's serialization, remark C7520), and the uniform datapath kept.

- hd256 128x80, closer to FlashAttention-4's configuration: with the O rescale under S = Q K^T
  (early_rescale), and with ping-pong; and on the longest-first 1-D grid (Scheduler.LPT).
- hd128 with longer key tiles (FlashAttention-3's non-causal hd128 tile is 128x176): the register
  estimate rejects 128x176 and 128x192; budgets_sm90.SM90_PCVT_NO_SPILL admits them with the compiled
  schedule only (overlap + ping-pong + pair_cvt; without pair_cvt 128x176 spills)."""

from __future__ import annotations

import re

import pytest
from cpu_support import all_variants

from cutefa import sass
from cutefa.model.budgets_sm90 import SM90_CONSUMER_REGS
from cutefa.model.options import Scheduler
from cutefa.model.rules import est_registers, why_invalid
from cutefa.model.spec import parse_name

pytestmark = pytest.mark.compile

LONG_HD128 = (
    "cutefa_sm90_fwd_bf16_hd128_128x176_s2_w12_ov_pp_pcvt",
    "cutefa_sm90_fwd_fp16_hd128_128x192_s2_w12_causal_ov_pp_pcvt",
)
NAMES = (
    "cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_causal_ov_erescale_pcvt",
    "cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_ov_pp_pcvt",
    # on the longest-first 1-D grid (Scheduler.LPT; the overlap schedule there spills without pair_cvt)
    "cutefa_sm90_fwd_bf16_hd256_128x80_s2_w12_causal_ov_lpt_pcvt",
    "cutefa_sm90_fwd_fp16_hd256_128x80_s2_w12_causal_ov_pp_lpt_erescale_pcvt",
    *LONG_HD128,
)
SPECS = [parse_name(n) for n in NAMES]


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(SPECS, "sm_90a", tmp_path_factory.mktemp("sm_90a_pcvt"))


def test_admitted_and_committed():
    variants = set(all_variants("sm90", "fwd"))
    for spec in SPECS:
        assert why_invalid(spec) is None, spec.name
        assert spec in variants, spec.name
    for name in LONG_HD128:
        spec = parse_name(name)
        assert est_registers(spec) > SM90_CONSUMER_REGS, "admitted by the estimate alone"


@pytest.mark.parametrize(
    "name",
    [
        "cutefa_sm90_fwd_bf16_hd128_128x176_s2_w12_ov_pp",  # spills without pair_cvt
        "cutefa_sm90_fwd_bf16_hd128_128x176_s2_w12_ov_pcvt",  # not compiled without ping-pong
        "cutefa_sm90_fwd_bf16_hd128_128x192_s2_w12_ov_pp_erescale_pcvt",
        "cutefa_sm90_fwd_bf16_hd128_128x192_s2_w12_ov_pp_pcvt_emu25",
    ],
)
def test_long_hd128_rejected_without_the_compiled_schedule(name):
    assert why_invalid(parse_name(name)) is not None, name


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_sass(cubins, spec):
    cubin = cubins[spec.name]
    report = sass.analyze(cubin)
    text = sass.disassemble(cubin)
    assert report.missing("sm90") == [], report.summary()
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    assert report.counts["USETMAXREG"] >= 2, report.summary()
    regions = sass.setmaxnreg_regions(text)
    consumer = [r for r in regions if r[0] == SM90_CONSUMER_REGS]
    assert consumer and all(highest < SM90_CONSUMER_REGS for _, highest in consumer), regions
    # S = Q K^T (head_dim / 16 WGMMAs of k16) and O += P V (tile_n / 16) in the masked and the
    # unmasked loop, plus the overlap schedule's prologue S and epilogue P V
    assert report.counts["HGMMA"] == 3 * (spec.head_dim // 16 + spec.tile_n // 16), report.summary()
    # P (and O in the epilogue) converted in pairs: no F2FP with a zero second operand
    singles = re.findall(r"F2FP\S*\s+R\d+, RZ, R\d+", text)
    assert not singles, f"{spec.name}: {len(singles)} element-wise conversions"
    # WGMMAs stay asynchronous: one arrive/wait per GEMM group, not one per HGMMA
    arrives = sum(report.forms_of("WARPGROUP.ARRIVE").values())
    waits = sum(report.forms_of("WARPGROUP.DEPBAR").values())
    assert arrives <= 8 and waits <= 8, f"{spec.name}: {arrives} arrives, {waits} waits"
    # descriptors and pipeline state in uniform registers (hundreds of R2UR when ptxas gives that up)
    # (the longest-first grid's tile decode adds ~30, once per CTA before the first WGMMA)
    r2ur = sum(report.forms_of("R2UR").values())
    assert r2ur <= (64 if spec.options.scheduler is Scheduler.LPT else 40), f"{spec.name}: {r2ur} R2UR"
