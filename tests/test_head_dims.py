"""Head dims beyond the standard five (issue: every multiple of 8 up to 256, and a V head dim of its
own): the spec and its name, the rules of each family, the defaults and the committed set, dispatch
and its explanation, the API's checks, and the sm80 templates' padded tiles. The compile-marked
tests build three samples for sm_80 (hd80, hd40, hd192 against v of 128)."""

from __future__ import annotations

import pytest
import torch

from cutefa import dispatch
from cutefa.api import validate
from cutefa.codegen import render_source
from cutefa.model import committed, defaults, rules
from cutefa.model.budgets_sm80 import sm80_tile_head_dim
from cutefa.model.options import DqLayout, Mask
from cutefa.model.spec import (
    COMMITTED_HEAD_DIMS,
    HEAD_DIM_V_PAIRS,
    HEAD_DIMS,
    TUNED_HEAD_DIMS,
    Features,
    VariantSpec,
    accepted_head_dim,
    parse_name,
    why_not_head_dims,
)
from cutefa.templating import template_context

ACCEPTED = tuple(range(8, 257, 8))
FEATURED = Features(varlen=True, softcap=True, alibi=True, sinks=True)


def test_the_accepted_head_dims_are_the_multiples_of_8_up_to_256():
    assert [d for d in range(300) if accepted_head_dim(d)] == list(ACCEPTED)
    for d in (0, -8, 4, 84, 264, 8.0, True, "64"):
        assert not accepted_head_dim(d)
    assert HEAD_DIMS == (64, 96, 128, 192, 256)  # the standard set stays
    assert COMMITTED_HEAD_DIMS == (64, 80, 96, 112, 128, 192, 256) and TUNED_HEAD_DIMS == (80, 112)
    assert HEAD_DIM_V_PAIRS == ((192, 128),)


def test_odd_combinations_are_refused_naming_what_is_supported():
    assert why_not_head_dims(192, 128) is None and why_not_head_dims(80, 80) is None
    assert why_not_head_dims(84, 84) == "head_dim=84 is not a multiple of 8 from 8 to 256"
    for d, dv in ((128, 64), (192, 96), (64, 128), (128, 192), (192, 120)):
        reason = why_not_head_dims(d, dv)
        assert f"head_dim_v={dv} with head_dim={d}" in reason and "(192, 128)" in reason, reason
        spec = VariantSpec("sm80", "fwd", "bf16", d, 128, 64, 1, 8, head_dim_v=dv)
        assert rules.why_invalid(spec) == reason


@pytest.mark.parametrize("name", ["cutefa_sm80_fwd_bf16_hd80_128x128_s1_w8", "cutefa_sm80_fwd_fp16_hd8_128x64_s1_w4_causal",
                                  "cutefa_sm80_fwd_bf16_hd192v128_128x64_s1_w8_local_varlen"])  # fmt: skip
def test_names_round_trip(name):
    spec = parse_name(name)
    assert spec.name == name
    assert spec.replace(head_dim_v=spec.head_dim_v) == spec


@pytest.mark.parametrize("head_dim", ACCEPTED, ids=lambda d: f"hd{d}")
def test_every_head_dim_has_a_valid_sm80_forward(head_dim):
    """The default of every accepted head dim, both dtypes and masks, and with the local window and
    every feature: valid, and within an A100's shared memory."""
    for dtype in ("fp16", "bf16"):
        for causal in (False, True):
            spec = defaults.default_spec("sm80", "fwd", dtype, head_dim, causal=causal)
            assert spec is not None and spec.head_dim == head_dim
            featured = spec.replace(mask=Mask.LOCAL, features=FEATURED)
            for s in (spec, featured):
                assert rules.why_invalid(s) is None and rules.why_not_on(s, "sm_80") is None, s.name


def test_the_tile_head_dim_pads_to_the_32_column_atom():
    assert [sm80_tile_head_dim(d) for d in (8, 32, 40, 64, 72, 80, 112, 136, 192, 200, 248, 256)] == [
        32, 32, 64, 64, 96, 96, 128, 160, 192, 224, 256, 256,
    ]  # fmt: skip
    spec = defaults.default_spec("sm80", "fwd", "bf16", 80)
    assert rules.tile_head_dims(spec) == (96, 96)
    assert rules.tile_head_dims(defaults.default_spec("sm80", "fwd", "bf16", 192, head_dim_v=128)) == (
        192,
        128,
    )
    # the budget model counts the padded columns
    assert rules.smem_bytes(spec) == rules.smem_bytes(spec.replace(head_dim=96))


def test_the_tuned_head_dims_are_committed_and_nothing_else_new():
    fwd = committed.default_variants("sm80", "fwd")
    for d in TUNED_HEAD_DIMS:
        for dtype in ("fp16", "bf16"):
            want = {defaults.default_spec("sm80", "fwd", dtype, d, causal=c) for c in (False, True)}
            assert want <= set(fwd)
            assert all(s.tile_m == 128 and s.tile_n == 128 and s.warps == 8 for s in want)
    every = [s for a in ("sm80", "sm90", "sm100") for s in committed.default_variants(a)]
    assert {s.head_dim for s in every} <= set(COMMITTED_HEAD_DIMS)
    # a V head dim of its own: the backward of each pair, in the families that take it, only
    pairs = {s for s in every if s.head_dim_v != s.head_dim}
    assert pairs == set(committed.separate_v_bwd_specs("sm90") + committed.separate_v_bwd_specs("sm80"))
    assert {(s.head_dim, s.head_dim_v) for s in pairs} == set(HEAD_DIM_V_PAIRS)
    assert {(s.arch, s.direction) for s in every if s.head_dim in TUNED_HEAD_DIMS} <= {
        ("sm80", "fwd"),
        ("sm80", "bwd"),
        ("sm90", "fwd"),
        ("sm90", "bwd"),  # multiples of 16 up to 128 (tests/test_compile_sm90_bwd_head_dims.py)
    }
    bwd = committed.default_variants("sm80", "bwd")
    for d in TUNED_HEAD_DIMS:
        for dtype in ("fp16", "bf16"):
            want = {defaults.default_spec("sm80", "bwd", dtype, d, causal=c) for c in (False, True)}
            assert want <= set(bwd)
            assert all((s.tile_m, s.tile_n, s.stages, s.warps) == (64, 128, 1, 8) for s in want)


@pytest.mark.parametrize("head_dim", ACCEPTED, ids=lambda d: f"hd{d}")
def test_every_head_dim_has_a_valid_sm80_backward(head_dim):
    """The backward default of every accepted head dim, both masks, and with the local window and
    every feature: valid, on an A100 too; a padded one on its nearest tile with the tiled dQ
    accumulator and no dq_pipe."""
    for causal in (False, True):
        spec = defaults.default_spec("sm80", "bwd", "bf16", head_dim, causal=causal)
        assert spec is not None and spec.head_dim == head_dim
        featured = spec.replace(mask=Mask.LOCAL, features=FEATURED)
        for s in (spec, featured):
            assert rules.why_invalid(s) is None and rules.why_not_on(s, "sm_80") is None, s.name
        if head_dim % 32:
            assert spec.options.dq_layout is DqLayout.TILE and not spec.options.dq_pipe
            padded = sm80_tile_head_dim(head_dim)
            nearest = defaults.default_spec("sm80", "bwd", "bf16", min(d for d in (32, 64, 96, 128, 192, 256) if d >= padded))
            assert (spec.tile_m, spec.tile_n, spec.stages, spec.warps) == (
                nearest.tile_m, nearest.tile_n, nearest.stages, nearest.warps,
            )  # fmt: skip


def test_the_padded_sm80_backward_refuses_what_its_template_lacks():
    bwd = VariantSpec("sm80", "bwd", "bf16", 80, 64, 128, 1, 8, dq_layout=DqLayout.TILE)
    assert rules.why_invalid(bwd) is None
    for other in (bwd.replace(dq_layout=DqLayout.ROWS), bwd.replace(dq_pipe=True)):
        reason = rules.why_invalid(other)
        assert "head_dim=80 (padded to 96 columns)" in reason and "takes dq_layout=TILE without dq_pipe" in reason
    bwd = VariantSpec("sm80", "bwd", "bf16", 192, 64, 64, 1, 8, head_dim_v=128, dq_layout=DqLayout.TILE)
    assert rules.why_invalid(bwd) is None  # a V head dim of its own: the tiled dQ accumulator only
    rows = bwd.replace(dq_layout=DqLayout.ROWS)
    assert "takes a V head dim of its own with dq_layout=TILE" in rules.why_invalid(rows)


def test_the_padded_backward_workspaces():
    """The tiled dQ accumulator's chunks are tile_m x the padded width; the stream-K tail is off."""
    from cutefa.api.backward import tail_slots
    from cutefa.api.feature_bwd import _varlen_dq_accum_shape
    from cutefa.model.budgets import bwd_dq_accum_shape

    spec = defaults.default_spec("sm80", "bwd", "bf16", 80)
    assert bwd_dq_accum_shape(spec, 1, 2, 100, 4) == (1, 2, 4, 2, 64 * 96)
    assert _varlen_dq_accum_shape(spec, 1, 300, 4, 3) == (1, 4, 300 // 64 + 3, 64 * 96)
    plain = defaults.default_spec("sm80", "bwd", "bf16", 96)
    assert bwd_dq_accum_shape(plain, 1, 2, 100, 4) == (1, 2, 4, 2, 64 * 96)
    from cutefa.model.budgets import BWD_HEAD_DIM_ATOM
    from cutefa.model.budgets_sm80 import SM80_HEAD_DIM_ATOM

    assert BWD_HEAD_DIM_ATOM["sm80"] == SM80_HEAD_DIM_ATOM
    assert tail_slots(spec, False, 3, 7, 1000, 1000, 100) == 0
    assert tail_slots(plain, False, 3, 7, 1000, 1000, 100) == 100


def test_the_padded_backward_template_context_and_source():
    spec = defaults.default_spec("sm80", "bwd", "bf16", 40)
    context = template_context(spec, "bwd_sm80.py.j2")
    assert (context["tile_d"], context["head_apart"], context["own_blocks"]) == (64, True, True)
    text = render_source(spec)
    assert "HEAD_DIM = 40" in text and "TILE_D = 64" in text and "mQ = head_pad.padded_view(mQ, TILE_D)" in text
    # every load and store predicated on the column: no copy by rows alone, no stream-K tail
    assert "parts.copy_rows(" not in text and "head_pad.copy_tile(" in text and "tail." not in text
    assert "chunk = spec.tile_m * TILE_D" in text
    plain = render_source(defaults.default_spec("sm80", "bwd", "bf16", 64))
    assert "head_pad" not in plain and "TILE_D" not in plain


@pytest.mark.parametrize(
    "spec",
    [
        VariantSpec("sm100", "fwd", "bf16", 80, 256, 128, 3, 16),
        VariantSpec("sm100", "bwd", "bf16", 80, 128, 128, 1, 4),
        VariantSpec("sm90", "fwd", "e4m3", 80, 128, 128, 2, 12),
        VariantSpec("sm100", "fwd", "bf16", 192, 256, 64, 3, 16, head_dim_v=128),
        VariantSpec("sm100", "bwd", "bf16", 192, 128, 128, 1, 4, head_dim_v=128),
    ],
    ids=lambda s: s.name,
)
def test_other_families_refuse_non_standard_head_dims_with_a_sentence(spec):
    reason = rules.why_invalid(spec)
    assert reason is not None
    assert f"the {spec.dtype} {spec.arch} {spec.direction} kernels take head_dim in {HEAD_DIMS}" in reason, (
        reason
    )
    assert "run on the 16-bit sm80 family and the 16-bit sm90 forward" in reason


def test_the_sm90_forward_rule_lets_its_kernel_decide():
    """The head-dim rule accepts the sm90 16-bit forward at any accepted head dim and (192, 128):
    its template and tile rules decide the rest."""
    for d, dv in ((80, 80), (40, 40), (192, 128)):
        spec = VariantSpec("sm90", "fwd", "bf16", d, 128, 128, 2, 12, head_dim_v=dv)
        assert rules._head_dim(spec) is None


@pytest.mark.parametrize("head_dim", (8, 40, 80, 112, 200, 248))
def test_dispatch_serves_every_head_dim_and_explains_the_padded_tile(head_dim):
    choice = dispatch.choose(
        target="sm_80", dtype="bf16", head_dim=head_dim, causal=True, seqlen_q=4096, seqlen_k=4096, batch=2,
        heads_q=8, heads_kv=8,
    )  # fmt: skip
    assert choice.spec.arch == "sm80" and choice.spec.head_dim == head_dim
    assert choice.spec == defaults.default_spec("sm80", "fwd", "bf16", head_dim, causal=True)
    text = dispatch.explain_problem(
        target="sm_80", dtype="bf16", head_dim=head_dim, causal=True, seqlen_q=4096, seqlen_k=4096, batch=2,
        heads_q=8, heads_kv=8,
    )  # fmt: skip
    tile_d = sm80_tile_head_dim(head_dim)
    padded = f"padded tile: head dim {head_dim} computed on tiles {tile_d} columns wide"
    assert (padded in text) == (tile_d != head_dim), text


def test_dispatch_on_hopper_falls_back_to_sm80_where_sm90_has_no_kernel():
    choice = dispatch.choose(
        target="sm_90a", dtype="fp16", head_dim=72, causal=False, seqlen_q=512, seqlen_k=512, batch=1,
        heads_q=4, heads_kv=4, features=Features(varlen=True),
    )  # fmt: skip
    assert choice.spec.head_dim == 72 and choice.spec.features.varlen


def _meta(*shape):
    return torch.empty(shape, dtype=torch.bfloat16, device="meta")


def test_validation_accepts_every_head_dim_and_names_the_argument():
    for d in ACCEPTED:
        validate.validate_inputs(
            _meta(1, 4, 2, d), _meta(1, 4, 2, d), _meta(1, 4, 2, d), device_types=("meta",)
        )
    with pytest.raises(
        ValueError, match=r"head_dim=84 is not supported \(q.shape\[-1\]\): cutefa takes a multiple of 8"
    ):
        validate.check_heads(_meta(1, 4, 2, 84), _meta(1, 4, 2, 84), _meta(1, 4, 2, 84))
    with pytest.raises(ValueError, match=r"head_dim=264 is not supported"):
        validate.check_heads(_meta(1, 4, 2, 264), _meta(1, 4, 2, 264), _meta(1, 4, 2, 264))
    with pytest.raises(ValueError, match="head_dim differs: q has 80, k has 96"):
        validate.check_heads(_meta(1, 4, 2, 80), _meta(1, 4, 2, 96), _meta(1, 4, 2, 96))
    with pytest.raises(ValueError, match=r"head_dim_v=64 \(v.shape\[-1\]\) with head_dim=128 .*\(192, 128\)"):
        validate.check_heads(_meta(1, 4, 2, 128), _meta(1, 4, 2, 128), _meta(1, 4, 2, 64))
    with pytest.raises(
        NotImplementedError, match=r"head_dim_v=128 \(v.shape\[-1\]\) apart from head_dim=192"
    ):
        validate.check_heads(_meta(1, 4, 2, 192), _meta(1, 4, 2, 192), _meta(1, 4, 2, 128))
    with pytest.raises(ValueError, match=r"head_dim=80 is not supported by the fp8 forward"):
        validate.check_heads(_meta(1, 4, 2, 80), _meta(1, 4, 2, 80), _meta(1, 4, 2, 80), standard_only=True)


def test_the_packed_layout_accepts_every_head_dim():
    from cutefa.api import validate_features

    for d in (8, 80, 200):
        q, k = _meta(100, 4, d), _meta(90, 2, d)
        validate_features.check_heads(q, k, k)


def test_the_padded_template_context_and_source():
    spec = defaults.default_spec("sm80", "fwd", "bf16", 80)
    context = template_context(spec, "fwd_sm80.py.j2")
    assert (context["tile_d"], context["tile_d_v"], context["head_apart"], context["split_v"]) == (
        96,
        96,
        True,
        False,
    )
    text = render_source(spec)
    assert (
        "TILE_D = 96" in text and "head_pad.copy_tile(" in text and "head_pad.padded_view(mQ, TILE_D)" in text
    )
    assert "def fake_arguments" not in text  # the shared dense fake arguments (q, k, v, o of head dim 80)
    split = render_source(defaults.default_spec("sm80", "fwd", "bf16", 192, head_dim_v=128))
    assert "HEAD_DIM_V = 128" in split and "TILE_DV = 128" in split and "def fake_arguments" in split
    plain = render_source(defaults.default_spec("sm80", "fwd", "bf16", 128))
    assert "head_pad" not in plain and "TILE_D" not in plain


# ---------------------------------------------------------------------------------------------
# Compiled for sm_80 (each a few seconds; run one at a time: -m compile -k ...)

COMPILE_SAMPLES = [
    defaults.default_spec("sm80", "fwd", "bf16", 80, causal=True),
    defaults.default_spec("sm80", "fwd", "fp16", 40),
    defaults.default_spec("sm80", "fwd", "bf16", 192, head_dim_v=128).replace(features=Features(varlen=True)),
]


@pytest.mark.compile
@pytest.mark.parametrize("spec", COMPILE_SAMPLES, ids=lambda s: s.name)
def test_compiles_for_sm_80_without_spills(spec, tmp_path):
    from cutefa import sass

    cubins = sass.dump_cubins([spec], "sm_80", tmp_path)
    report = sass.analyze(cubins[spec.name])
    assert report.missing("sm80") == [], report.summary()
    assert 0 < report.registers <= 255 and report.spills == 0, report.summary()
    assert report.counts["HMMA"] > 0 and report.counts["LDGSTS"] > 0
