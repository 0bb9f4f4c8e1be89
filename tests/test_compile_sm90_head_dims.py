"""The sm90 16-bit forward at head dims of its own (templates/fwd_sm90.py.j2 with
cutefa/kernels/sm90/head_dims.py): any multiple of 8 up to 256 on tiles padded to WGMMA's k step
(TMA zero-fills the pad columns of Q, K and V and clips the O store at the real V head dim), and a
V head dim apart from the Q/K one (DeepSeek's (192, 128)).

CPU part: the budget model's padded head dims, shared memory and key tiles (80, 112 and (192, 128)
take 128 x 128), and the standard head dims rendering as before. Compile part (marker ``compile``):
a sample compiles for sm_90a with no local-memory spill, the uniform datapath kept, one WGMMA per
k-step of the padded head dims (Q K^T: tile_d / 16, P V: tile_n / 16 per key block and loop body)
and O still leaving through stmatrix and a TMA store.
"""

from __future__ import annotations

import pytest

from cutefa import codegen, sass
from cutefa.model import policy_sm90
from cutefa.model.budgets import SMEM_RESERVE
from cutefa.model.budgets_sm90 import (
    sm90_fwd_own_tile_n,
    sm90_fwd_tile_head_dims,
    sm90_registers,
    sm90_smem_bytes,
)
from cutefa.model.defaults import default_spec
from cutefa.model.options import Mask, Schedule
from cutefa.model.rules import why_invalid
from cutefa.model.spec import Features, VariantSpec


def _spec(head_dim, head_dim_v=None, *, tile_n=128, mask=Mask.NONE, features=None, **options):
    options.setdefault("schedule", Schedule.OVERLAP_PINGPONG)
    return VariantSpec(
        "sm90", "fwd", "bf16", head_dim, 128, tile_n, 2, 12, mask=mask, features=features or Features(),
        head_dim_v=head_dim_v, **options,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The budget model and the rendering (CPU)


@pytest.mark.parametrize(
    ("dims", "tiles"),
    [((8, 8), (16, 16)), ((40, 40), (48, 48)), ((72, 72), (80, 80)), ((80, 80), (80, 80)),
     ((112, 112), (112, 112)), ((192, 128), (192, 128)), ((200, 200), (208, 208)), ((256, 256), (256, 256))],
)  # fmt: skip
def test_tile_head_dims_pad_to_the_wgmma_k_step(dims, tiles):
    spec = _spec(dims[0], dims[1])
    assert sm90_fwd_tile_head_dims(spec) == tiles


def test_shared_memory_counts_padded_columns_and_the_v_head_dim():
    # hd72 computes on 80 columns: Q 128 x 80, two stages of K and V 128 x 80 each
    assert sm90_smem_bytes(_spec(72)) == (128 * 80 + 2 * 128 * 80 * 2) * 2 + SMEM_RESERVE
    # (192, 128): K of 192 columns, V of 128; O staged in the Q slabs
    assert sm90_smem_bytes(_spec(192, 128)) == (128 * 192 + 2 * 128 * 192 + 2 * 128 * 128) * 2 + SMEM_RESERVE
    # a V head dim wider than the Q/K one stages O apart
    assert not policy_sm90.fwd_o_in_q_slab(_spec(128, 192, tile_n=112))
    assert sm90_smem_bytes(_spec(128, 192, tile_n=112)) == (
        (128 * 128 + 2 * 112 * 128 + 2 * 112 * 192 + 128 * 192) * 2 + SMEM_RESERVE
    )
    # the O accumulator has the V head dim's columns
    assert sm90_registers(_spec(192, 128)) == sm90_registers(_spec(128))


@pytest.mark.parametrize(("head_dim", "head_dim_v"), [(80, None), (112, None), (192, 128)])
def test_own_head_dims_take_128x128(head_dim, head_dim_v):
    assert sm90_fwd_own_tile_n("bf16", head_dim, head_dim_v) == 128
    assert sm90_fwd_own_tile_n("fp16", head_dim, head_dim_v) == 128
    assert why_invalid(_spec(head_dim, head_dim_v)) is None


def test_standard_head_dims_render_as_before():
    for hd in (64, 96, 128, 192, 256):
        spec = default_spec("sm90", "fwd", "bf16", hd)
        assert not policy_sm90.fwd_own_head_dims(spec)
        text = codegen.render_source(spec)
        assert "TILE_D" not in text and "head_dims" not in text


def test_own_head_dims_render_the_padded_tiles():
    text = codegen.render_source(_spec(72, mask=Mask.CAUSAL))
    assert "TILE_D = 80\n" in text and "TILE_DV = 80\n" in text and "HEAD_DIM = 72\n" in text
    assert "(parts.WG_ROWS, HEAD_DIM)" not in text  # every tile takes the padded columns
    text = codegen.render_source(_spec(192, 128, features=Features(varlen=True)))
    assert "TILE_D = 192\n" in text and "TILE_DV = 128\n" in text
    assert "packed(total_k, heads_kv, spec.head_dim_v)" in text  # v of its own head dim in the fake arguments


# ---------------------------------------------------------------------------------------------
# Compiled for sm_90a

CHECKED = [
    _spec(80, mask=Mask.CAUSAL),
    _spec(72, mask=Mask.CAUSAL, features=Features(varlen=True)),
    _spec(192, 128),
]
MAX_R2UR = 64  # as tests/test_compile_sm90_features.py: a kernel that lost the uniform datapath has hundreds


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("sm_90a_head_dims"))


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass(cubins, spec):
    assert why_invalid(spec) is None, why_invalid(spec)
    report = sass.analyze(cubins[spec.name])
    assert report.missing("sm90") == [], f"{spec.name}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    r2ur = sum(report.forms_of("R2UR").values())
    assert r2ur <= MAX_R2UR, f"{spec.name}: {r2ur} R2UR: {report.summary()}"
    tile_d, _ = sm90_fwd_tile_head_dims(spec)
    per_block = tile_d // 16 + spec.tile_n // 16
    assert report.counts["HGMMA"] == 3 * per_block, (
        f"{spec.name}: {report.summary()}"
    )  # overlap: 2 bodies + prologue
    assert report.counts["STSM"] > 0, report.summary()
    rank = "5D" if spec.features.varlen else "4D"
    tma_forms = set(report.forms_of("UTMALDG")) | set(report.forms_of("UTMASTG"))
    assert tma_forms == {f"UTMALDG.{rank}", f"UTMASTG.{rank}"}, f"{spec.name}: {sorted(tma_forms)}"
