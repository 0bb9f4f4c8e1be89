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
    bench = load_tool("bench")
    meta = {"timer": "triton.testing.do_bench", "check_tol": 0.02}
    assert "rounds" not in bench.report_markdown(meta | {"rounds": 1}, [], ["cutefa"], [])
    assert "median of 3 rounds in turns across backends" in bench.report_markdown(
        meta | {"rounds": 3}, [], ["cutefa"], []
    )
