"""tools/bench.py --bwd-variants and tools/bench_bwd_variants.py on the CPU: argument checking,
which cells a variant serves, the forced backward choice (and the stream-K tail turned off), the
columns, and the per-variant table (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch
from cpu_support import all_variants, load_tool

from cutefa.api import backward

OV = "cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_ov"
S3 = "cutefa_sm90_bwd_bf16_hd128_64x128_s3_w12"


def test_names_and_families_parse():
    bench = load_tool("bench")
    args = bench.parse_args(["--bwd-variants", f"{OV},{S3},{OV}"])
    assert args.bwd_variants == [OV, S3]  # duplicates dropped, order kept
    assert "bwd" in args.passes  # implied
    every = bench.parse_args(["--bwd-variants", "sm90"]).bwd_variants
    assert every == [s.name for s in all_variants("sm90", "bwd")]
    assert OV in every and S3 in every


@pytest.mark.parametrize(
    "bad",
    [
        "cutefa_sm90_fwd_bf16_hd128_128x128_s2_w12_ov_pp",  # a forward
        "cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_pp",  # invalid: no backward ping-pong
        "not_a_variant",
        ",",
    ],
)
def test_bad_names_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        load_tool("bench").parse_args(["--bwd-variants", bad])
    assert "--bwd-variants" in capsys.readouterr().err


def test_a_variant_serves_its_own_cells_only():
    bench_grid = load_tool("bench_grid")
    assert bench_grid.variant_serves(OV, bench_grid.Cell("bf16", 128, False, 2048, "bwd"))
    assert not bench_grid.variant_serves(OV, bench_grid.Cell("bf16", 128, True, 2048, "bwd"))
    assert not bench_grid.variant_serves(OV, bench_grid.Cell("bf16", 64, False, 2048, "bwd"))
    assert not bench_grid.variant_serves(OV, bench_grid.Cell("fp16", 128, False, 2048, "bwd"))
    assert not bench_grid.variant_serves(OV, bench_grid.Cell("bf16", 128, False, 2048, "fwd"))


def test_forced_variant_replaces_the_backward_choice_and_restores_it():
    bench_backends = load_tool("bench_backends")
    default = backward.choose_bwd("sm_90a", torch.bfloat16, 128, False)
    assert default.name == "cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_dqbulk"  # the default (DqPath.BULK)
    with bench_backends.forced_bwd_variant(OV):
        assert backward.choose_bwd("sm_90a", torch.bfloat16, 128, False).name == OV
        # the backward passes the key length and the GPU (for tuned tables): forced all the same
        forced = backward.choose_bwd(
            "sm_90a", torch.bfloat16, 128, False, seqlen_k=4096, gpu_name="NVIDIA H200"
        )
        assert forced.name == OV
        with pytest.raises(ValueError, match="does not serve"):
            backward.choose_bwd("sm_90a", torch.bfloat16, 64, False)
    assert backward.choose_bwd("sm_90a", torch.bfloat16, 128, False) == default


def test_forced_variant_can_turn_the_tail_off_and_restores_it():
    bench_backends = load_tool("bench_backends")
    saved = backward.TAIL_SLOTS
    with bench_backends.forced_bwd_variant(OV, tail=False):
        assert backward.TAIL_SLOTS == 0
    with bench_backends.forced_bwd_variant(OV):
        assert backward.TAIL_SLOTS == saved
    assert backward.TAIL_SLOTS == saved


def test_variant_backend_is_cutefa_under_the_forced_choice():
    bench_backends = load_tool("bench_backends")
    cutefa_backend = bench_backends.Backend("cutefa", lambda q, k, v, causal: None)
    vb = bench_backends.bwd_variant_backend(OV, cutefa_backend, label="ov")
    assert vb.name == "ov" and vb.make is cutefa_backend.make and vb.outputs is cutefa_backend.outputs
    with vb.context():
        assert backward.choose_bwd("sm_90a", torch.bfloat16, 128, False).name == OV


SM80 = "cutefa_sm80_bwd_bf16_hd192_64x64_s1_w8_dqtile"


def test_bwd_variants_tool_columns_and_names():
    tool = load_tool("bench_bwd_variants")
    (spec,) = tool.named_variants(SM80.replace("_w8_", "_w8_causal_"))
    assert spec.name == SM80  # the non-causal twin
    cols = tool.columns([spec], "both", short=True)
    assert [(tail, label) for _, tail, label in cols] == [
        (False, "64x64_s1_w8_dqtile -tail"),
        (None, "64x64_s1_w8_dqtile +tail"),
    ]
    assert [label for _, _, label in tool.columns([spec], "on", short=False)] == [SM80]
    with pytest.raises(SystemExit, match="not an sm80 backward variant"):
        tool.named_variants(OV)
    with pytest.raises(SystemExit, match="one dtype and head dim"):
        tool.named_variants(f"{SM80},cutefa_sm80_bwd_bf16_hd128_64x128_s1_w8_dqtile")


def test_table_has_one_row_per_variant_with_ratios():
    bench_grid, bench_report = load_tool("bench_grid"), load_tool("bench_report")
    row = bench_grid.Row(bench_grid.Cell("bf16", 128, False, 2048, "bwd"))
    row.results["FA4"] = bench_grid.Result("ok", ms=1.0, tflops=500.0)
    row.results["cutefa"] = bench_grid.Result("ok", ms=1.0, tflops=400.0)
    row.bwd_variants[OV] = bench_grid.Result("ok", ms=1.0, tflops=450.0)
    row.bwd_variants[S3] = bench_grid.Result("err", error="boom")
    lines = bench_report.bwd_variants_table([row]).splitlines()
    assert len(lines) == 2 + 2
    assert lines[2].split(" | ")[1:] == ["128", "0", "2048", "450", "500", "0.90", "400", "1.12 |"]
    assert lines[3].startswith(f"| {S3} |") and "| err |" in lines[3]
    text = bench_report.report_markdown({"slices": 3}, [row], ["cutefa", "FA4"], [])
    assert "## Backward variants" in text
