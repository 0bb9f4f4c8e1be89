"""The 16-bit sm100 forward's feature kernels (templates/fwd_sm100.py.j2 with varlen, the local
window, softcap, ALiBi and sinks: each alone, and combined) compile for sm_100a on this CPU, and
their SASS shows each feature's code.

No Blackwell GPU exists here: these kernels are compiled and SASS-checked, not run
(tests/gpu/test_sm100_features_kernels.py is written to be their first run). The checks: no local
memory anywhere (every warp role fits its setmaxnreg budget: 192 per softmax thread, 80 correction,
48 for the MMA/load/epilogue warpgroup); one MUFU.TANH per score of a block and softmax warpgroup
with softcap and none without; varlen stores O from the correction warps with 16-byte stores (no
TMA store, whose box would overwrite the next sequence) and loads through rank-3 packed TMA
descriptors; the others keep the dense kernel's TMA store. The dense kernels render byte-identical
to generated/ (their SASS is test_sass_reference's).
"""

from __future__ import annotations

import re

import pytest
from cpu_support import FULL_COMPILE_TESTS

from cutefa import codegen, sass
from cutefa.api.features import FeatureArgs
from cutefa.identity import GENERATED_DIR
from cutefa.model import policy_sm100
from cutefa.model.committed import default_variants
from cutefa.model.options import Mask
from cutefa.model.rules import why_invalid
from cutefa.model.spec import Features, VariantSpec

ALL = Features(varlen=True, softcap=True, alibi=True, sinks=True)
NO_FEATURES = Features()
# The default tile of each head dim (docs/design/sm100.md): (tile_m, tile_n, stages, exp_emu)
TILES = {
    64: (256, 128, 3, 25),
    96: (256, 128, 3, 25),
    128: (256, 128, 3, 25),
    192: (256, 64, 3, 0),
    256: (128, 64, 2, 0),
}


def _spec(head_dim=128, dtype="bf16", *, mask=Mask.NONE, features=NO_FEATURES, **options):
    tile_m, tile_n, stages, exp_emu = TILES[head_dim]
    options = {"exp_emu": exp_emu, **options}
    return VariantSpec(
        "sm100", "fwd", dtype, head_dim, tile_m, tile_n, stages, 16, mask=mask, features=features, **options
    )


# Each feature alone (head dim 128), then combinations.
SAMPLE = [
    _spec(features=Features(varlen=True)),
    _spec(mask=Mask.LOCAL),
    _spec(features=Features(softcap=True)),
    _spec(features=Features(alibi=True)),
    _spec(features=Features(sinks=True)),
    _spec(mask=Mask.LOCAL, features=ALL),
    _spec(256, "fp16", mask=Mask.CAUSAL, features=ALL),
    _spec(128, mask=Mask.CAUSAL, features=Features(varlen=True), cta_pair=True),
]
MORE = [
    _spec(64, mask=Mask.LOCAL, features=ALL),
    _spec(96, "fp16", mask=Mask.LOCAL, features=ALL),
    _spec(192, mask=Mask.LOCAL, features=ALL),
    _spec(256, mask=Mask.LOCAL, features=ALL),
    _spec(128, mask=Mask.CAUSAL, features=ALL),
    _spec(128, mask=Mask.LOCAL, features=ALL, exp_emu=0),
    _spec(256, "fp16", features=Features(varlen=True), cta_pair=True),
    _spec(192, mask=Mask.CAUSAL, features=Features(varlen=True), cta_pair=True),
]
SPECS = SAMPLE + MORE if FULL_COMPILE_TESTS else SAMPLE

# setmaxnreg budgets of a feature kernel's warpgroups, as cuobjdump prints them
FEATURE_BUDGETS = {0xC0, 0x50, 0x30}


def test_specs_are_valid():
    for spec in SAMPLE + MORE:
        assert why_invalid(spec) is None, (spec.name, why_invalid(spec))


def test_pair_takes_varlen_alone():
    """A CTA pair with the window or a score modifier spills in its softmax warps: refused."""
    pair = _spec(mask=Mask.CAUSAL, features=Features(varlen=True), cta_pair=True)
    assert why_invalid(pair) is None
    for refused in (
        pair.replace(mask=Mask.LOCAL),
        pair.replace(features=Features(varlen=True, softcap=True)),
        pair.replace(features=Features(alibi=True)),
        pair.replace(features=Features(sinks=True)),
    ):
        reason = why_invalid(refused)
        assert reason is not None and "cta_pair" in reason and "spill" in reason, (refused.name, reason)
        assert why_invalid(refused.replace(cta_pair=False)) is None, refused.name


def test_dense_modules_render_unchanged():
    """No feature, no local mask: the template renders the committed modules byte for byte."""
    dense = [s for s in default_variants("sm100", "fwd") if not policy_sm100.fwd_featured(s)]
    assert dense
    for spec in dense:
        committed = GENERATED_DIR / spec.arch / f"{spec.name}.py"
        assert committed.read_text() == codegen.render_source(spec), spec.name


def test_feature_register_split_fills_the_register_file():
    for spec in SAMPLE + MORE:
        softmax, correction, other = policy_sm100.fwd_register_split(spec)
        assert 2 * softmax + correction + other == 512, spec.name
        assert (softmax, correction, other) == (192, 80, 48), spec.name


@pytest.mark.parametrize("spec", SAMPLE + MORE, ids=lambda s: s.name)
def test_signature_follows_the_calling_convention(spec):
    """The launcher's parameters after softmax_scale are the convention's (cutefa.api.features),
    in its order, then the stream."""
    text = codegen.render_source(spec)
    call = re.search(r"def __call__\(\s*self,(.*?)\):", text, re.DOTALL).group(1)
    params = [p.split(":")[0].strip() for p in call.split(",") if p.strip()]
    assert params[:6] == ["mQ", "mK", "mV", "mO", "mLSE", "softmax_scale"], params
    expected = []
    if spec.features.varlen:
        expected += ["mCuSeqlensQ", "mCuSeqlensK", "mSeqUsedQ", "mSeqUsedK", "max_seqlen_q"]
    if spec.mask is Mask.LOCAL:
        expected += ["window_left", "window_right"]
    if spec.features.softcap:
        expected.append("softcap")
    if spec.features.alibi:
        expected.append("mAlibiSlopes")
    if spec.features.sinks:
        expected.append("mSinks")
    assert params[6:] == [*expected, "stream"], params
    # as many as the API passes for such a call
    args = FeatureArgs(
        cu_seqlens_q=0 if spec.features.varlen else None, window=(8, 0) if spec.mask is Mask.LOCAL else None,
        softcap=1.0 if spec.features.softcap else 0.0, alibi_slopes=0 if spec.features.alibi else None,
        sinks=0 if spec.features.sinks else None,
    )  # fmt: skip
    assert len(args.kernel_args(causal=False)) == len(expected)
    assert "def fake_arguments" not in text and "import fake_arguments" in text


def _first(sass_text: str, pattern: str) -> int:
    """Index of the first instruction of ``sass_text`` matching ``pattern`` (a large number if none)."""
    ins = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+([^;]*);", sass_text, re.MULTILINE)
    return next((i for i, x in enumerate(ins) if re.match(pattern, x)), len(ins) + 1)


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(SPECS, "sm_100a", tmp_path_factory.mktemp("sm_100a_features"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_feature_kernel_sass(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    text = sass.disassemble(cubins[spec.name])
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    assert report.missing("sm100") == [], f"{spec.name}: {report.summary()}"
    assert 0 < report.registers <= 128, f"{spec.name}: {report.summary()}"
    budgets = {budget for budget, _ in sass.setmaxnreg_regions(text)}
    assert budgets == FEATURE_BUDGETS, (spec.name, budgets)
    q_tiles = spec.tile_m // 128
    # softcap: one tanh per score of a block in each softmax warpgroup's code
    tanh = report.forms.get("MUFU.TANH", 0)
    assert tanh == (q_tiles * spec.tile_n if spec.features.softcap else 0), (spec.name, tanh)
    # the attention kernel's stores (a varlen module also holds the fill of the rows of no sequence:
    # cutefa/kernels/common/varlen_fill.py, checked in tests/test_varlen_fill.py)
    main = sass.kernel_text(text, "kernel")
    stores = {f: n for f, n in sass.opcode_forms(main).items() if f.startswith("STG")}
    if spec.features.varlen:
        # O by the correction warps: two 16-byte stores per 16 columns of a row, per Q tile
        assert stores.get("STG.E.128", 0) == q_tiles * spec.head_dim // 8, (spec.name, stores)
        assert not report.forms_of("UTMASTG"), report.forms_of("UTMASTG")
        loads = report.forms_of("UTMALDG")
        assert loads and all(".3D" in f for f in loads), loads  # packed (rows, dim, heads) descriptors
        # a CTA past its sequence's query rows leaves before its first barrier operation
        assert _first(main, r"@!?P\d EXIT") < _first(main, r"SYNCS"), spec.name
    else:
        assert report.forms_of("UTMASTG"), f"{spec.name}: no TMA store of O"
        assert "STG.E.128" not in stores, stores
    if spec.options.cta_pair:
        assert report.forms_of("UTCHMMA") == {"UTCHMMA.2CTA": report.counts["UTCHMMA"]}, report.forms_of(
            "UTCHMMA"
        )
