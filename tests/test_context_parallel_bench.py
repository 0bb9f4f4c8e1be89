"""tools/bench_cp.py on the CPU: the attention FLOP count, the rows' derived numbers, the table
(with a side that could not run) and the SVG chart."""

from __future__ import annotations

import math

from cpu_support import load_tool

bench_cp = load_tool("bench_cp")


def test_attention_flops_count_the_matmuls_and_halve_causal():
    full = bench_cp.attention_flops(1, 32, 65536, 128, causal=False)
    assert full == 3.5 * 4 * 32 * 65536**2 * 128
    assert bench_cp.attention_flops(1, 32, 65536, 128, causal=True) == full / 2


def test_rows_table_and_plot():
    flops = bench_cp.attention_flops(1, 32, 65536, 128, causal=True)
    rows = [
        bench_cp.Row(65536, True, "cutefa", 100.0, 180.0, 2, flops),
        bench_cp.Row(65536, True, "flash", 120.0, 200.0, 2, flops),
        bench_cp.Row(65536, True, "cudnn", math.nan, math.nan, 2, flops),
    ]
    assert math.isclose(rows[0].tokens_per_s, 655360.0)
    assert math.isclose(rows[0].tflops_per_gpu, flops / 0.1 / 2 / 1e12)
    assert math.isclose(rows[0].scaling, 1.8)
    table = bench_cp.format_table(rows, {(65536, True, "cudnn"): "RuntimeError: no kernel"})
    lines = table.splitlines()
    assert len(lines) == 5 and "n/a (RuntimeError: no kernel)" in lines[4]
    assert "1.80x" in lines[2] and "655360" in lines[2]
    svg = bench_cp.svg_bars(rows, "title")
    assert svg.startswith("<svg") and svg.count("<rect") == 2 and "64k causal" in svg
