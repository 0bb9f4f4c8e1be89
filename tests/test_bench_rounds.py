"""tools/bench.py's command line and report on the CPU: --rounds (3 by default), --heads (grouped-query
cells in the default grid), --plot (one PNG; a clear error without matplotlib; `cutefa bench` hands
it on), and the report's statement of the checks (a FAIL cell shows no speed)."""

from __future__ import annotations

import importlib.util

import pytest
from cpu_support import load_tool

import cutefa.cli

bench = load_tool("bench")
import bench_grid  # tools/ is on sys.path once a tool is loaded
import bench_report


def test_rounds_parse():
    assert bench.parse_args([]).rounds == 3
    assert bench.parse_args(["--rounds", "5"]).rounds == 5


@pytest.mark.parametrize("bad", ["0", "-2", "x"])
def test_bad_rounds_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", bad])
    assert "--rounds" in capsys.readouterr().err


def test_report_states_the_rounds_and_the_checks():
    meta = {"timer": "triton.testing.do_bench", "slices": 3}
    assert "rounds" not in bench_report.report_markdown(meta | {"rounds": 1}, [], ["cutefa"], [])
    text = bench_report.report_markdown(meta | {"rounds": 3}, [], ["cutefa"], [])
    assert "median of 3 rounds in turns across backends" in text
    assert "float32 reference on 3 (batch, head) slices" in text and "FAIL" in text


def test_default_grid_has_grouped_query_cells():
    args = bench.parse_args(["--hdim", "128", "--seqlen", "1024", "--causal", "0"])
    cells = bench_grid.grid(args)
    assert [(c.heads, c.kv_heads) for c in cells] == [(16, 16), (32, 8), (64, 8), (16, 1)]
    gqa = cells[1]
    assert gqa.gqa and gqa.batch == 16 and gqa.label == "fwd bf16 hd128 h=32/8 causal=0 s=1024"
    assert gqa.flops == 4.0 * 16 * 32 * 1024**2 * 128
    quick = bench.parse_args(["--quick"])
    assert quick.heads == ["mha", "32/8"]
    assert bench.parse_args(["--heads", "mha,mqa,16/2"]).heads == ["mha", "mqa", "16/2"]


@pytest.mark.parametrize("bad", ["32/0", "32/5", "a/b", "gqa", "", "8"])
def test_bad_heads_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--heads", bad])
    assert "--heads" in capsys.readouterr().err


def test_mqa_and_an_explicit_one_kv_head_are_one_cell():
    args = bench.parse_args(["--hdim", "128", "--seqlen", "1024", "--causal", "0", "--heads", "mqa,16/1"])
    assert len(bench_grid.grid(args)) == 1


def test_a_failed_cell_shows_fail_and_no_speed():
    row = bench_grid.Row(bench_grid.Cell("bf16", 128, False, 1024))
    row.results["cutefa"] = bench_grid.Result("FAIL", error="dK rel 0.3 (bar 0.01)")
    row.results["FA2"] = bench_grid.Result("ok", ms=1.0, tflops=300.0)
    table = bench_report.markdown_table([row], ["cutefa", "FA2"])
    assert "| FAIL | 300 |" in table
    assert row.ratio_best() is None and row.ratio_fa2() is None


def test_plot_panels_keep_the_passes_and_head_layouts_apart():
    """With --pass both, the forward and the backward cell of one shape go to two panels, each titled
    with its pass (a backward panel was once titled 'fwd'); a grouped-query layout has its own."""
    rows = [
        bench_grid.Row(bench_grid.Cell("bf16", 128, causal, seqlen, pass_))
        for pass_ in ("fwd", "bwd")
        for causal in (False, True)
        for seqlen in (1024, 4096)
    ]
    rows.append(bench_grid.Row(bench_grid.Cell("bf16", 128, False, 1024, "fwd", 32, 8)))
    panels = bench_report.plot_panels(rows)
    assert list(panels) == [
        ("fwd", "bf16", "128", False, ""), ("fwd", "bf16", "128", True, ""),
        ("bwd", "bf16", "128", False, ""), ("bwd", "bf16", "128", True, ""),
        ("fwd", "bf16", "128", False, "32/8"),
    ]  # fmt: skip
    assert all(len({r.cell.pass_ for r in p}) == 1 for p in panels.values())
    assert bench_report.panel_title(("bwd", "fp16", "64", True, "")) == "bwd fp16 hd64 causal"
    assert (
        bench_report.panel_title(("fwd", "bf16", "256", False, "32/8")) == "fwd bf16 hd256 h=32/8 non-causal"
    )


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    with pytest.raises(SystemExit):
        bench.parse_args(["--plot", str(tmp_path / "grid.png")])
    assert "--plot: matplotlib is not installed" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="matplotlib is not installed"):
        bench_report.plot([], ["cutefa"], None, tmp_path / "grid.png")


def test_plot_wants_a_png_name(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--plot", "grid.pdf"])
    assert "not a .png file name" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib draws the PNG")
def test_plot_writes_one_png(tmp_path):
    row = bench_grid.Row(bench_grid.Cell("bf16", 128, False, 1024))
    row.results["cutefa"] = bench_grid.Result("ok", ms=1.0, tflops=500.0)
    row.results["FA2"] = bench_grid.Result("FAIL", error="O")
    path = tmp_path / "out" / "grid.png"
    bench_report.plot([row], ["cutefa", "FA2"], 700.0, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cutefa_bench_hands_plot_to_the_tool():
    args = cutefa.cli.build_parser().parse_args(["bench", "--plot", "out.png", "--quick", "--heads", "mha"])
    assert args.args == ["--plot", "out.png", "--quick", "--heads", "mha"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert bench.parse_args(args.args).plot.name == "out.png"
