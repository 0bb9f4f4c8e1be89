"""The packed-batch forward's heavy-first grid (Scheduler.HEAVY_FIRST, templates/fwd_sm90.py.j2) and
the policy that carries a dense choice over to a packed batch (policy_sm90.fwd_varlen_from_dense):
which specs take them, the names, what the generated module does (LPT's order over every
sequence's query tiles, a CTA past its sequence's tiles leaving before any setup), and what
dispatch runs for a packed batch (its dense problem's table variant carried over; LPT when uneven)."""

from __future__ import annotations

import pytest

from cutefa import codegen
from cutefa.model import policy_sm90
from cutefa.model.options import Mask, Schedule, Scheduler
from cutefa.model.rules import why_invalid
from cutefa.model.spec import Features, VariantSpec, parse_name

VARLEN = Features(varlen=True)


def _spec(
    dtype="bf16", head_dim=128, tile=(128, 128), mask=Mask.CAUSAL, features=VARLEN, **options
) -> VariantSpec:
    options.setdefault("schedule", Schedule.OVERLAP_PINGPONG)
    return VariantSpec(
        "sm90", "fwd", dtype, head_dim, tile[0], tile[1], 2, 4 * (tile[0] // 64 + 1), mask=mask, features=features,
        **options,
    )  # fmt: skip


def test_heavy_first_takes_packed_16_bit_batches_only():
    hfirst = _spec(scheduler=Scheduler.HEAVY_FIRST)
    assert hfirst.name == "cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_causal_varlen_ov_pp_hfirst"
    assert parse_name(hfirst.name) == hfirst
    for spec in (
        hfirst,
        _spec(mask=Mask.NONE, tile=(128, 176), scheduler=Scheduler.HEAVY_FIRST, pair_cvt=True),
        _spec("fp16", 64, (192, 128), scheduler=Scheduler.HEAVY_FIRST),
        _spec(
            mask=Mask.LOCAL,
            features=Features(varlen=True, softcap=True, sinks=True),
            scheduler=Scheduler.HEAVY_FIRST,
        ),
    ):
        assert why_invalid(spec) is None, (spec.name, why_invalid(spec))
    assert "without varlen" in why_invalid(hfirst.replace(features=Features()))
    assert "without varlen" in why_invalid(hfirst.replace(features=Features(softcap=True)))
    fp8 = VariantSpec("sm90", "fwd", "e4m3", 128, 128, 128, 2, 12, scheduler=Scheduler.HEAVY_FIRST)
    assert "own grid" in why_invalid(fp8)
    assert why_invalid(fp8.replace(features=VARLEN)) is not None


def test_the_heavy_first_module_exits_before_any_setup():
    text = codegen.render_source(_spec(scheduler=Scheduler.HEAVY_FIRST))
    kernel = text[text.index("    def kernel(") :]
    exit_at = kernel.index("varlen.exit_past(m_block * TILE_M, seqlen_q)")
    assert (
        kernel.index("parts.lpt_tile(bx, cutlass.max(num_m, 1), heads_q, heads_q * batch_size, lpt_pairs)")
        < exit_at
    )
    assert exit_at < kernel.index("SmemAllocator()") < kernel.index("pipeline_init_arrive")
    assert "if m_block >= 0:" not in kernel  # no tile is gated: the CTAs without one have left
    assert "grid = (cutlass.max(num_m * mQ.shape[1] * batch, 1), 1, 1)" in text
    assert "lpt_pairs = parts.lpt_group(mK.shape[0] // cutlass.max(batch, 1), HEAD_DIM" in text
    # today's grid scheduler is unchanged: its CTAs past a sequence's tiles are gated
    grid = codegen.render_source(_spec())
    assert "exit_past" not in grid and "if m_block >= 0:" in grid and "lpt_pairs" not in grid


def test_three_consumer_causal_heavy_first_keeps_the_uniform_datapath_option():
    spec = _spec("bf16", 64, (192, 128), scheduler=Scheduler.HEAVY_FIRST)
    assert policy_sm90.fwd_ptxas_options(spec) == policy_sm90.UNIFORM_DATAPATH_PTXAS
    assert policy_sm90.fwd_ptxas_options(spec.replace(mask=Mask.NONE)) == ""


@pytest.mark.parametrize(
    "dense, expected",
    [
        ("cutefa_sm90_fwd_bf16_hd128_128x176_s2_w12_ov_pp_pcvt",
         "cutefa_sm90_fwd_bf16_hd128_128x176_s2_w12_varlen_ov_pp_pcvt"),
        ("cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_causal_ov_pp_persist",
         "cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_causal_varlen_ov_pp"),
        ("cutefa_sm90_fwd_fp16_hd64_192x128_s2_w16_causal_ov_pp_lpt",
         "cutefa_sm90_fwd_fp16_hd64_192x128_s2_w16_causal_varlen_ov_pp"),
    ],
)  # fmt: skip
def test_a_dense_choice_carries_over_to_a_packed_batch(dense, expected):
    """Its tile and options, the plain grid for an even batch and LPT for an uneven non-causal one,
    whatever scheduler the dense call runs; an uneven causal batch keeps the family default (None)."""
    spec = policy_sm90.fwd_varlen_from_dense(parse_name(dense))
    assert spec is not None and spec.name == expected and why_invalid(spec) is None
    uneven = policy_sm90.fwd_varlen_from_dense(parse_name(dense), uneven=True)
    if spec.mask is Mask.CAUSAL:
        assert uneven is None
    else:
        assert uneven == spec.replace(scheduler=Scheduler.LPT) and why_invalid(uneven) is None


def test_no_packed_form_outside_the_16_bit_sm90_forward():
    for name in (
        "cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4",
        "cutefa_sm90_fwd_e4m3_hd128_128x128_s2_w12_ov_pp",
    ):
        assert policy_sm90.fwd_varlen_from_dense(parse_name(name)) is None
    assert (
        policy_sm90.fwd_varlen_from_dense(_spec(features=Features(softcap=True), scheduler=Scheduler.GRID))
        is None
    )
    assert policy_sm90.fwd_varlen_from_dense(_spec(mask=Mask.LOCAL, features=Features())) is None


def test_dispatch_runs_the_packed_form_of_the_tables_variant():
    """A packed batch with nothing else runs its dense problem's tuned-table variant (max lengths as
    its lengths) with the varlen axis; explain says so."""
    import torch

    from cutefa import dispatch

    for causal, length in ((False, 2048), (True, 2048), (False, 1000), (True, 16384)):
        kw = {
            "target": "sm_90a", "dtype": torch.bfloat16, "causal": causal, "gpu_name": "NVIDIA H100 80GB HBM3",
            "head_dim": 128, "seqlen_q": length, "seqlen_k": length, "batch": 8, "heads_q": 16, "heads_kv": 16,
        }  # fmt: skip
        dense = dispatch.choose(**kw)
        assert "tuned table" in dense.reason
        packed = dispatch.choose(**kw, features=VARLEN, total_q=8 * length)
        assert packed.spec == policy_sm90.fwd_varlen_from_dense(dense.spec), (causal, length)
        assert packed.spec.options.scheduler is Scheduler.GRID
        assert "its packed form (varlen, the plain grid)" in packed.reason
    # e4m3 has no packed form of its table's variants: the family default with the varlen axis
    fp8 = dispatch.choose(**{**kw, "dtype": torch.float8_e4m3fn}, features=VARLEN, total_q=8 * length)
    assert "heuristic" in fp8.reason and fp8.spec.features == VARLEN


# --- an uneven packed batch: the LPT scheduler -------------------------------------------------


def test_uneven_batch_is_decided_from_shapes():
    assert policy_sm90.uneven_batch(40, 8192, 16384)  # a long-tailed batch: 5% full
    assert policy_sm90.uneven_batch(4, 4097, 1 + 17 + 1000 + 4097)
    assert not policy_sm90.uneven_batch(8, 2048, 8 * 2048)  # uniform
    assert not policy_sm90.uneven_batch(8, 2048, 8 * 1024 + 1)  # just over half full
    assert policy_sm90.uneven_batch(8, 2048, 8 * 1024)
    assert not policy_sm90.uneven_batch(1, 4096, 100)  # one sequence: nothing to order
    assert not policy_sm90.uneven_batch(40, 8192, None)  # not known: every sequence full


def test_varlen_uneven_takes_plain_packed_16_bit_forwards_only():
    grid = _spec(scheduler=Scheduler.GRID)
    assert policy_sm90.varlen_uneven(grid) == grid.replace(scheduler=Scheduler.LPT)
    assert why_invalid(policy_sm90.varlen_uneven(grid)) is None
    assert policy_sm90.varlen_uneven(grid).name.endswith("_causal_varlen_ov_pp_lpt")
    for other in (
        _spec(mask=Mask.LOCAL),  # a window: its own masks' order
        _spec(features=Features(varlen=True, softcap=True)),
        _spec(features=Features()),  # dense
        _spec(scheduler=Scheduler.HEAVY_FIRST),
        _spec(dtype="e4m3", scheduler=Scheduler.GRID),
    ):
        assert policy_sm90.varlen_uneven(other) == other, other.name


def _choose(total_q, *, batch=40, seqlen=8192, causal=False, features=VARLEN, dtype=None):
    import torch

    from cutefa import dispatch

    return dispatch.choose(
        target="sm_90a", dtype=dtype or torch.bfloat16, causal=causal, gpu_name="NVIDIA H100 80GB HBM3",
        head_dim=128, seqlen_q=seqlen, seqlen_k=seqlen, batch=batch, heads_q=16, heads_kv=16, features=features,
        total_q=total_q,
    )  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
def test_dispatch_runs_lpt_on_an_uneven_batch_and_grid_on_an_even_one(causal):
    uneven = _choose(16384, causal=causal)
    assert uneven.spec.options.scheduler is Scheduler.LPT and uneven.spec.features == VARLEN
    assert "the LPT scheduler: an uneven packed batch (16384 query rows of 40 x 8192" in uneven.reason
    # non-causal: the H100 table's tile for the dense problem (128x160, paired conversions); causal:
    # the family default's 128x128
    if causal:
        assert "heuristic" in uneven.reason and (uneven.spec.tile_n, uneven.spec.options.pair_cvt) == (128, False)
    else:
        dense = _choose(None, features=Features()).spec
        assert "tuned table sm90_h100.json" in uneven.reason and (dense.tile_n, dense.options.pair_cvt) == (160, True)
        assert (uneven.spec.tile_n, uneven.spec.options.pair_cvt) == (dense.tile_n, dense.options.pair_cvt)
    even = _choose(8 * 2048, batch=8, seqlen=2048, causal=causal)
    assert even.spec.options.scheduler is Scheduler.GRID
    assert _choose(None, causal=causal).spec.options.scheduler is Scheduler.GRID  # not known: as before
    # the memo keeps the two apart: the same key but for evenness
    assert _choose(16384, causal=causal).spec == uneven.spec
    assert _choose(40 * 8192, causal=causal).spec.options.scheduler is Scheduler.GRID
    # features beside varlen keep the family default's grid
    softcap = _choose(16384, causal=causal, features=Features(varlen=True, softcap=True))
    assert softcap.spec.options.scheduler is Scheduler.GRID and "heuristic" in softcap.reason


def test_the_packs_ship_what_an_uneven_batch_runs():
    from cutefa.model.feature_sets import feature_variants

    shipped = set(feature_variants("sm90", "fwd"))
    for causal in (False, True):
        assert _choose(16384, causal=causal).spec in shipped
        assert _choose(8 * 2048, batch=8, seqlen=2048, causal=causal).spec in shipped


def test_explain_names_the_rows_and_the_scheduler(capsys):
    from cutefa.cli import main

    argv = [
        "explain",
        "--shape",
        "40,8192,8192,16,16,128",
        "--gpu",
        "sm_90a",
        "--varlen",
        "--total-q",
        "16384",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("cutefa forward: varlen: 40 sequences, 16384 query rows, max_seqlen_q=8192")
    assert "_varlen_ov_pp_lpt_pcvt " in out and "an uneven packed batch" in out
