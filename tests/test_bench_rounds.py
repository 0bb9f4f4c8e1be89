"""tools/bench.py --rounds on the CPU: the option's parsing and the report's statement of it (the
timing itself needs a GPU)."""

from __future__ import annotations

import pytest
from cpu_support import load_tool


def test_rounds_parse():
    bench = load_tool("bench")
    assert bench.parse_args([]).rounds == 1
    assert bench.parse_args(["--rounds", "3"]).rounds == 3


@pytest.mark.parametrize("bad", ["0", "-2", "x"])
def test_bad_rounds_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        load_tool("bench").parse_args(["--rounds", bad])
    assert "--rounds" in capsys.readouterr().err


def test_report_states_the_rounds():
    bench_report = load_tool("bench_report")
    meta = {"timer": "triton.testing.do_bench", "check_tol": 0.02}
    assert "rounds" not in bench_report.report_markdown(meta | {"rounds": 1}, [], ["cutefa"], [])
    assert "median of 3 rounds in turns across backends" in bench_report.report_markdown(
        meta | {"rounds": 3}, [], ["cutefa"], []
    )


def test_plot_panels_keep_the_passes_apart():
    """With --pass both, the forward and the backward cell of one shape go to two panels, each titled
    with its pass (a backward panel was once titled 'fwd')."""
    bench_grid, bench_report = load_tool("bench_grid"), load_tool("bench_report")
    rows = [
        bench_grid.Row(bench_grid.Cell("bf16", 128, causal, seqlen, pass_))
        for pass_ in ("fwd", "bwd")
        for causal in (False, True)
        for seqlen in (1024, 4096)
    ]
    panels = bench_report.plot_panels(rows)
    assert list(panels) == [
        ("fwd", "bf16", 128, False), ("fwd", "bf16", 128, True),
        ("bwd", "bf16", 128, False), ("bwd", "bf16", 128, True),
    ]  # fmt: skip
    assert all(len(p) == 2 and len({r.cell.pass_ for r in p}) == 1 for p in panels.values())
    assert bench_report.panel_title(("bwd", "fp16", 64, True)) == "bwd fp16 hd64 causal"
    assert bench_report.panel_title(("fwd", "bf16", 256, False)) == "fwd bf16 hd256 non-causal"
