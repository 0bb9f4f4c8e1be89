"""The sm80 feature kernels (varlen, local window, softcap, ALiBi, sinks; forward and backward)
render, compile on this CPU for sm_90a and sm_80, and keep the FlashAttention-2 design in SASS:
mma.sync (HMMA), ldmatrix (LDSM), cp.async (LDGSTS), MUFU.EX2, MUFU.TANH where there is a softcap;
registers within 255. The block-range helpers of the local band are checked against brute force
(no compile: plain integers).
"""

from __future__ import annotations

import random

import pytest

from cutefa import sass
from cutefa.codegen import render_source
from cutefa.model.options import DqLayout, Mask
from cutefa.model.rules import why_invalid
from cutefa.model.spec import Features, VariantSpec

FWD = VariantSpec("sm80", "fwd", "bf16", 128, 128, 128, 1, 8)
FWD64 = VariantSpec("sm80", "fwd", "fp16", 64, 128, 64, 1, 4)
BWD = VariantSpec("sm80", "bwd", "bf16", 128, 64, 128, 1, 8, dq_layout=DqLayout.TILE)
BWD64 = VariantSpec("sm80", "bwd", "fp16", 64, 64, 128, 2, 8, dq_layout=DqLayout.TILE)
BWD192 = VariantSpec("sm80", "bwd", "bf16", 192, 64, 64, 1, 8, dq_layout=DqLayout.TILE, dq_pipe=True)

ALL = Features(varlen=True, softcap=True, alibi=True, sinks=True)
SAMPLE_SM90A = [
    FWD.replace(mask=Mask.LOCAL, features=Features(varlen=True)),
    FWD.replace(features=Features(softcap=True, sinks=True)),
    FWD.replace(causal=True, features=Features(varlen=True, alibi=True)),
    FWD64.replace(mask=Mask.LOCAL, features=Features(sinks=True)),
    BWD.replace(mask=Mask.LOCAL, features=Features(varlen=True, softcap=True, alibi=True)),
    BWD.replace(causal=True, features=Features(varlen=True)),
    BWD.replace(dq_layout=DqLayout.QUAD, mask=Mask.LOCAL, features=Features(varlen=True)),
    BWD64.replace(features=Features(softcap=True, alibi=True)),
    BWD192.replace(mask=Mask.LOCAL, features=Features(varlen=True)),
]
SAMPLE_SM80 = [
    FWD.replace(mask=Mask.LOCAL, features=ALL),
    BWD.replace(dq_layout=DqLayout.ROWS, mask=Mask.LOCAL, features=Features(varlen=True, softcap=True)),
]


def _check(report: sass.SassReport, spec: VariantSpec) -> None:
    assert report.missing("sm80") == [], f"{spec.name}: {report.summary()}"
    assert 0 < report.registers <= 255, f"{spec.name}: {report.summary()}"
    assert report.counts["HMMA"] > 0
    tanh = sum(report.forms_of("MUFU.TANH").values())
    assert (tanh > 0) == spec.features.softcap, f"{spec.name}: {tanh} MUFU.TANH"


@pytest.fixture(scope="module")
def cubins_sm90a(tmp_path_factory):
    return sass.dump_cubins(SAMPLE_SM90A, "sm_90a", tmp_path_factory.mktemp("sm_90a"))


@pytest.fixture(scope="module")
def cubins_sm80(tmp_path_factory):
    return sass.dump_cubins(SAMPLE_SM80, "sm_80", tmp_path_factory.mktemp("sm_80"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", SAMPLE_SM90A, ids=lambda s: s.name)
def test_sass_sm90a(cubins_sm90a, spec):
    report = sass.analyze(cubins_sm90a[spec.name])
    _check(report, spec)
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"


@pytest.mark.compile
@pytest.mark.parametrize("spec", SAMPLE_SM80, ids=lambda s: s.name)
def test_sass_sm80(cubins_sm80, spec):
    _check(sass.analyze(cubins_sm80[spec.name]), spec)


def test_feature_specs_are_valid_and_render():
    """Every sample is valid, renders, and names its feature arguments in its docstring; the local
    variants use the band's helpers and the varlen ones take the packed layouts."""
    for spec in {*SAMPLE_SM90A, *SAMPLE_SM80}:
        assert why_invalid(spec) is None, spec.name
        source = render_source(spec)
        assert "def fake_arguments(" in source
        assert ("apply_local_mask" in source) == (spec.mask is Mask.LOCAL), spec.name
        assert ("mCuSeqlensQ" in source) == spec.features.varlen, spec.name
        assert "from cutefa.kernels.sm80 import tail" not in source, (
            spec.name
        )  # no stream-K tail with features


def test_dense_sources_take_no_feature_argument():
    for spec in (FWD, FWD.replace(causal=True), BWD, BWD.replace(causal=True)):
        source = render_source(spec)
        for name in ("mCuSeqlensQ", "window_left", "softcap", "mAlibiSlopes", "mSinks", "score_mods"):
            assert name not in source, (spec.name, name)


def _band(i, sq, sk, left, right):
    from cutefa.kernels.common.mask import local_key_bounds

    lo, hi = local_key_bounds(i, sq, sk, left, right)
    return set(range(max(lo, 0), min(hi, sk)))


def test_local_block_ranges_match_brute_force():
    """local_key_blocks, local_query_blocks and local_block_needs_mask on plain integers: every
    key block holding a key of some row's band is visited and no other, the unmasked range holds
    only blocks inside every row's band, and the query range of a key block is exact."""
    from cutefa.api.features import UNBOUNDED
    from cutefa.kernels.common.mask import local_block_needs_mask, local_key_blocks, local_query_blocks

    rng = random.Random(0)
    for _ in range(400):
        sq, sk = rng.randint(1, 200), rng.randint(0, 200)
        left = rng.choice([UNBOUNDED, 0, 1, 5, 17, 64, 150])
        right = rng.choice([UNBOUNDED, 0, 1, 3, 33, 100])
        tile_m, tile_n = rng.choice([(64, 64), (128, 64), (64, 128)])
        bands = [_band(i, sq, sk, left, right) for i in range(sq)]
        for row0 in range(0, sq, tile_m):
            last = min(row0 + tile_m, sq) - 1
            n_first, n_last, u_first, u_last = local_key_blocks(row0, last, tile_n, sq, sk, left, right)
            assert n_first <= u_first <= u_last <= n_last
            needed = {j // tile_n for i in range(row0, last + 1) for j in bands[i]}
            assert needed == set(range(n_first, n_last)) or (not needed and n_first == n_last)
            for n in range(u_first, u_last):
                keys = set(range(n * tile_n, (n + 1) * tile_n))
                assert all(keys <= bands[i] for i in range(row0, last + 1))
        for n0 in range(0, sk, tile_n):
            col_last = min(n0 + tile_n, sk) - 1
            m_first, m_last = local_query_blocks(n0, col_last, tile_m, sq, sk, left, right)
            keys = set(range(n0, col_last + 1))
            needed = {i // tile_m for i in range(sq) if bands[i] & keys}
            assert needed == set(range(m_first, m_last)) or (not needed and m_first == m_last)
            for m in range(m_first, m_last):
                rows = range(m * tile_m, min(m * tile_m + tile_m, sq))
                full = all(set(range(n0, n0 + tile_n)) <= bands[i] for i in rows)
                assert (
                    bool(local_block_needs_mask(rows[0], rows[-1], n0, n0 + tile_n - 1, sq, sk, left, right))
                    != full
                )
