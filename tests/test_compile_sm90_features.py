"""The sm90 16-bit forward's feature kernels (packed batches, the local window, softcap, ALiBi,
sinks; templates/fwd_sm90.py.j2) compile on this CPU for sm_90a, a sample of combinations on the
dispatched default (128 x tile_n, overlap + ping-pong, grid) and on the other schedules and
schedulers (packed batches on the persistent and longest-first ones walk the batch's tile list,
cutefa/kernels/sm90/varlen.py), and their SASS keeps the design: no local-memory spills, the uniform datapath kept
(few R2UR), one S = Q K^T and one O += P V per key block and loop body (the local window's
three: its right edge, the unmasked blocks, its left edge), tanh on MUFU for softcap, O still
leaving through a TMA store for packed batches (the ragged view clips it at a sequence's end), and
the packed batches' TMA copies have the ragged views' five modes.
The dense modules are unchanged (``cutefa generate --check``, tests/test_sass_reference.py)."""

from __future__ import annotations

import pytest

from cutefa import sass
from cutefa.model.defaults import default_config
from cutefa.model.options import Mask, Schedule, Scheduler
from cutefa.model.rules import why_invalid
from cutefa.model.spec import Features, VariantSpec

pytestmark = pytest.mark.compile

ALL = Features(varlen=True, softcap=True, alibi=True, sinks=True)


def _default(dtype: str, head_dim: int, mask: Mask, features: Features) -> VariantSpec:
    """The variant dispatch runs a feature call on: the family default with the mask and features."""
    config = default_config("sm90", "fwd", dtype, head_dim)
    return config.spec("sm90", "fwd", dtype, head_dim, mask=mask).replace(features=features)


def _spec(head_dim, tile, mask, features, **options) -> VariantSpec:
    return VariantSpec(
        "sm90", "fwd", "bf16", head_dim, tile[0], tile[1], 2, 4 * (tile[0] // 64 + 1), mask=mask,
        features=features, **options,
    )  # fmt: skip


CHECKED = [
    _default("bf16", 128, Mask.NONE, Features(varlen=True)),
    _default("fp16", 128, Mask.CAUSAL, Features(varlen=True)),
    _default("bf16", 64, Mask.LOCAL, Features()),
    _default("bf16", 96, Mask.CAUSAL, Features(softcap=True)),
    _default("bf16", 192, Mask.LOCAL, Features(sinks=True)),
    _default("fp16", 256, Mask.NONE, Features(alibi=True)),
    _default("bf16", 128, Mask.NONE, Features(softcap=True)),
    _default("fp16", 64, Mask.NONE, Features(sinks=True)),
    _default("bf16", 128, Mask.LOCAL, ALL),
    _default("bf16", 256, Mask.LOCAL, ALL),
    _spec(128, (128, 128), Mask.LOCAL, Features(varlen=True, sinks=True), schedule=Schedule.SERIAL),
    _spec(
        64,
        (128, 128),
        Mask.LOCAL,
        Features(softcap=True, alibi=True, sinks=True),
        schedule=Schedule.OVERLAP_PINGPONG,
        scheduler=Scheduler.PERSISTENT,
    ),
    _spec(
        64,
        (192, 128),
        Mask.LOCAL,
        Features(sinks=True),
        schedule=Schedule.OVERLAP_PINGPONG,
        scheduler=Scheduler.LPT,
    ),
    # packed batches on the persistent and longest-first schedulers (varlen.locate_tile)
    _spec(
        64,
        (128, 128),
        Mask.CAUSAL,
        Features(varlen=True),
        schedule=Schedule.OVERLAP_PINGPONG,
        scheduler=Scheduler.PERSISTENT,
    ),
    _spec(
        64,
        (192, 128),
        Mask.LOCAL,
        Features(varlen=True, alibi=True),
        schedule=Schedule.OVERLAP_PINGPONG,
        scheduler=Scheduler.LPT,
    ),
    _spec(
        256,
        (128, 80),
        Mask.CAUSAL,
        Features(varlen=True, softcap=True),
        schedule=Schedule.OVERLAP_PINGPONG,
        scheduler=Scheduler.LPT,
        early_rescale=True,
        pair_cvt=True,
        lazy_rescale=True,
    ),
    _spec(
        64,
        (192, 128),
        Mask.LOCAL,
        Features(varlen=True, softcap=True),
        schedule=Schedule.OVERLAP_PINGPONG,
        lazy_rescale=True,
    ),
    _spec(
        128,
        (128, 176),
        Mask.CAUSAL,
        Features(varlen=True, sinks=True),
        schedule=Schedule.OVERLAP_PINGPONG,
        pair_cvt=True,
    ),
    _spec(
        256,
        (128, 80),
        Mask.CAUSAL,
        ALL,
        schedule=Schedule.OVERLAP_PINGPONG,
        early_rescale=True,
        pair_cvt=True,
        lazy_rescale=True,
    ),
]
# R2UR moves registers into the uniform datapath; a kernel that lost it has hundreds (WGMMA
# descriptors and pipeline state in regular registers), one that kept it a few dozen.
MAX_R2UR = 64


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("sm_90a_features"))


def test_checked_specs_are_valid():
    assert [s.name for s in CHECKED if why_invalid(s) is not None] == []
    assert all(s.options.schedule is Schedule.OVERLAP_PINGPONG for s in CHECKED[:10])  # the defaults


@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    assert report.missing("sm90") == [], f"{spec.name}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    r2ur = sum(report.forms_of("R2UR").values())
    assert r2ur <= MAX_R2UR, f"{spec.name}: {r2ur} R2UR (the uniform datapath lost?): {report.summary()}"
    per_block = spec.head_dim // 16 + spec.tile_n // 16
    bodies = 3 if spec.mask is Mask.LOCAL else 2
    expected = bodies * per_block + (per_block if spec.options.schedule.overlap else 0)
    assert report.counts["HGMMA"] == expected, f"{spec.name}: {report.summary()}"
    tanh = sum(report.forms_of("MUFU.TANH").values())
    assert (tanh > 0) == spec.features.softcap, f"{spec.name}: {tanh} MUFU.TANH"
    assert sum(report.forms_of("UTMASTG").values()) > 0, f"{spec.name}: O leaves through a TMA store"
    # Packed batches go through the ragged views' five modes (the wrap-around mode keeps the
    # descriptors' base address at the packed tensors' own: varlen module docs); dense, four.
    tma_forms = set(report.forms_of("UTMALDG")) | set(report.forms_of("UTMASTG"))
    rank = "5D" if spec.features.varlen else "4D"
    assert tma_forms == {f"UTMALDG.{rank}", f"UTMASTG.{rank}"}, f"{spec.name}: {sorted(tma_forms)}"
    assert report.counts["STSM"] > 0, report.summary()
