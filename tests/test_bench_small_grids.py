"""tools/bench.py --batch (small grids: a batch of its own beside every seqlen) and --graphs (every
backend replayed from a CUDA graph, a replay checked before it is timed), on the CPU: the grid, the
labels, the report, and tools/bench_run.py's graph path with the capture replaced by a stand-in."""

from __future__ import annotations

import math

import torch
from cpu_support import load_tool

bench = load_tool("bench")
import bench_check  # tools/ is on sys.path once a tool is loaded
import bench_grid
import bench_report
import bench_run


def test_batch_gives_a_cell_per_batch_and_seqlen():
    args = bench.parse_args(
        ["--hdim", "128", "--seqlen", "1024,2048", "--batch", "1,2", "--heads", "8/8", "--causal", "1", "--pass", "bwd"]
    )
    cells = bench_grid.grid(args)
    assert [(c.batch, c.seqlen) for c in cells] == [(1, 1024), (1, 2048), (2, 1024), (2, 2048)]
    assert cells[0].label == "bwd bf16 hd128 causal=1 s=1024 b=1"
    assert cells[0].flops == 2.5 * 4.0 * 1 * 8 * 1024**2 * 128 / 2
    # without --batch: 16384 tokens per cell, labels as before
    plain = bench_grid.grid(bench.parse_args(["--hdim", "128", "--seqlen", "1024", "--heads", "mha", "--causal", "0"]))
    assert [c.batch for c in plain] == [16] and "b=" not in plain[0].label


def test_batches_have_panels_of_their_own():
    args = bench.parse_args(["--hdim", "128", "--seqlen", "1024", "--batch", "1,2", "--heads", "8/8", "--causal", "0"])
    panels = bench_report.plot_panels([bench_grid.Row(c) for c in bench_grid.grid(args)])
    assert len(panels) == 2


def test_report_states_batches_and_graphs():
    meta = {"timer": "do_bench", "slices": 3, "rounds": 3}
    text = bench_report.report_markdown(meta | {"batches": [1, 2], "graphs": True}, [], ["cutefa"], [])
    assert "batch 1, 2 (as asked)" in text and "replayed from a CUDA graph" in text
    plain = bench_report.report_markdown(meta, [], ["cutefa"], [])
    assert "batch x seqlen = 16384" in plain and "CUDA graph" not in plain


class _Replay:
    """Captured's stand-in: runs the made call on each replay into the same output tensors, or
    (``broken``) leaves them as the poison left them (a replay that writes nothing)."""

    broken = False

    def __init__(self, make):
        self.fn = make()
        self.outputs = self.fn()

    def __call__(self):
        if not self.broken:
            for t, new in zip(self.outputs, self.fn()):
                t.copy_(new)
        return self.outputs

    def poison(self):
        for t in self.outputs:
            t.fill_(math.nan)


def _entry(name):
    x = torch.arange(6.0)
    judge = lambda out: bench_check.Verdict(ok=bool(torch.equal(out[0], x)), message="differs", errors={})
    return bench_run.Entry(name, lambda: (lambda: (x.clone(),)), judge)


def test_graphs_time_the_replay_once_its_output_passed(monkeypatch):
    monkeypatch.setattr(bench_run, "Captured", _Replay)
    timed = []
    res = bench_run.run_entries([_entry("a")], lambda fn: timed.append(fn) or 1.0, rounds=2, device="cpu", graphs=True)
    assert res["a"].status == "ok" and res["a"].ms == 1.0
    assert len(timed) == 2 and all(isinstance(fn, _Replay) for fn in timed)


def test_a_replay_that_writes_nothing_fails(monkeypatch):
    broken = type("Broken", (_Replay,), {"broken": True})
    monkeypatch.setattr(bench_run, "Captured", broken)
    res = bench_run.run_entries([_entry("a")], lambda fn: 1.0, device="cpu", graphs=True)
    assert res["a"].status == "FAIL" and "graph replay" in res["a"].error and res["a"].ms is None


def test_a_call_that_cannot_be_captured_is_err(monkeypatch):
    def refuse(make):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(bench_run, "Captured", refuse)
    res = bench_run.run_entries([_entry("a")], lambda fn: 1.0, device="cpu", graphs=True)
    assert res["a"].status == "err" and res["a"].error.startswith("CUDA graph: RuntimeError")
