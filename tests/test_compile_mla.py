"""The MLA decode kernel (templates/decode_mla_sm90.py.j2) compiles for sm_90a on this CPU, and its
SASS shows the design: mma.sync (HMMA) for both products from one cache tile, cp.async (LDGSTS)
for Q and the latent rows, ldmatrix (plain for Q, K and P; transposed for V), no local memory, and
the combine kernel beside it in the same cubin."""

from __future__ import annotations

import pytest

from cutefa import sass
from cutefa.model import policy_mla

pytestmark = pytest.mark.compile

SAMPLES = [
    policy_mla.mla_spec("bf16", 16),  # 16 heads, one token: one row slab, 4 warps
    policy_mla.mla_spec("bf16", 128, causal=True),  # 128 heads (or 64 x 2 tokens): two row slabs, 8 warps
]


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(SAMPLES, "sm_90a", tmp_path_factory.mktemp("sm_90a"))


def _hmma_per_body(spec) -> int:
    """Per key block each warp issues 2 * 576 / 16 HMMAs for its 16 keys of S = Q K^T (two n8 atoms)
    and (512 / 4 / 8) * (64 / 16) for its 128 columns of O += P V."""
    per_warp_keys = spec.tile_n // policy_mla.WARP_COLS
    per_warp_cols = spec.head_dim_v // policy_mla.WARP_COLS
    return (per_warp_keys // 8) * (spec.head_dim // 16) + (per_warp_cols // 8) * (spec.tile_n // 16)


@pytest.mark.parametrize("spec", SAMPLES, ids=lambda s: s.name)
def test_mla_sass(cubins, spec):
    cubin = cubins[spec.name]
    report = sass.analyze(cubin)
    assert report.spills == 0 and report.counts["LDL"] == 0 and report.counts["STL"] == 0, report.summary()
    assert 0 < report.registers <= 255, report.summary()
    # a masked and an unmasked body, each a whole step of HMMAs
    assert report.counts["HMMA"] == 2 * _hmma_per_body(spec), report.summary()
    text = sass.disassemble(cubin)
    kernels = sass.kernel_sections(text)
    assert len(kernels) == 2, list(kernels)
    combine = sass.kernel_text(text, "combine")
    assert "SHFL.BFLY" in combine and "HMMA" not in combine and "MUFU.EX2" in combine
    # the combine is the splits' programmatic dependent: they trigger it (PREEXIT), it waits (ACQBULK)
    assert "ACQBULK" in sass.opcode_forms(combine)
    assert "PREEXIT" in sass.opcode_forms(sass.kernel_text(text, "kernel"))
    forms = sass.opcode_forms(sass.kernel_text(text, "kernel"))
    assert forms.get("LDGSTS.E.BYPASS.LTC128B.128", 0) > 0, forms
    assert forms.get("LDSM.16.M88.4", 0) > 0 and forms.get("LDSM.16.MT88.4", 0) > 0, forms
    assert forms.get("STG.E.64", 0) > 0, forms  # fp32 partial rows as pairs
    assert any(f.startswith("LDG.E") and not f.endswith(".128") for f in forms), forms  # page table reads
