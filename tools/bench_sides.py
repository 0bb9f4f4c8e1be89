"""What tools/bench_varlen.py and tools/bench_features.py share: a backend of theirs (:class:`Side`),
its entries for tools/bench_run.py (checked, then timed in turns), the table, the JSON and the plot.

A side's ``make(problem)`` returns ``fwd(q, k, v) -> (out, lse or None)`` in the problem's own
layout (packed (total, heads, d) with lse (heads, total) for a packed problem; (batch, seqlen, heads,
d) with lse (batch, heads, seqlen) for a dense one), or raises :class:`NotApplicable` (the cell is
"n/a (why)" in the table, never a crash); a side whose library is absent has ``missing``. Forward
cells time ``fwd`` as called; backward cells run it once on leaves that require grad and time
``torch.autograd.grad`` of its output over that graph (the same level for every side,
tools/bench_run.py).
"""

# No `from __future__ import annotations`: tools load this file by path (dataclasses).
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the bench_* siblings
    sys.path.append(str(Path(__file__).resolve().parent))

from bench_grid import Result, tflops
from bench_run import Entry, first_line, run_entries


class NotApplicable(Exception):
    """A side cannot run a cell (a feature it lacks): the table says n/a and why."""


@dataclass
class Side:
    name: str
    make: Callable | None
    missing: str | None = None


@dataclass
class Line:
    """One cell's row: its label, its pass, the unmasked FLOPs, each side's result."""

    label: str
    pass_: str
    flops: float
    group: str = ""
    results: dict = field(default_factory=dict)

    def tflops(self, name: str) -> float | None:
        r = self.results.get(name)
        return r.tflops if r is not None and r.status == "ok" else None


def side_entries(sides: list[Side], problem, inputs, expect, pass_: str,
                 judges: dict | None = None) -> tuple[list[Entry], dict[str, str]]:  # fmt: skip
    """The entries of the sides that can run ``problem`` and, for the others, why not (n/a).
    ``inputs``: (q, k, v) and for a backward dout; ``judges``: side name -> its own expectation
    (a side computing another problem, such as the same call without a feature)."""
    import torch

    q, k, v, *rest = inputs
    entries, not_applicable = [], {}
    for side in sides:
        if side.make is None:
            entries.append(Entry(side.name, None, expect.judge, missing=side.missing))
            continue
        try:
            fwd = side.make(problem)
        except NotApplicable as why:
            not_applicable[side.name] = str(why)
            continue
        except Exception as exc:  # noqa: BLE001 - a side that cannot be built is reported, not fatal
            not_applicable[side.name] = first_line(exc)
            continue
        if pass_ == "fwd":
            make = lambda fwd=fwd: lambda: fwd(q, k, v)
        else:

            def make(fwd=fwd):
                leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
                out, _ = fwd(*leaves)
                return lambda: torch.autograd.grad(out, leaves, rest[0], retain_graph=True)

        judge = (judges or {}).get(side.name, expect).judge
        entries.append(Entry(side.name, make, judge, check_fresh=pass_ != "fwd"))
    return entries, not_applicable


def run_line(line: Line, sides: list[Side], problem, inputs, expect, time_ms, rounds: int, device="cuda",
             judges: dict | None = None) -> Line:  # fmt: skip
    """Check, then time every side on one cell (tools/bench_run.py); fills ``line.results``."""
    entries, not_applicable = side_entries(sides, problem, inputs, expect, line.pass_, judges)
    results = run_entries(entries, time_ms, rounds, device)
    for side in sides:
        if side.name in not_applicable:
            line.results[side.name] = Result("n/a", error=not_applicable[side.name])
            continue
        res = results[side.name]
        if res.ms is not None:
            res.tflops = tflops(line.flops, res.ms)
        line.results[side.name] = res
    return line


def cell_text(res: Result | None) -> str:
    """A result as the table shows it: TFLOP/s, FAIL, err, or n/a (why)."""
    if res is None:
        return ""
    if res.status == "ok" and res.tflops is not None:
        return f"{res.tflops:.0f}"
    if res.status in ("missing", "n/a"):
        return f"n/a ({res.error})" if res.error else "n/a"
    return res.status


def ratio(mine: float | None, other: float | None) -> str:
    return f"{mine / other:.2f}x" if mine and other else "-"


def table(lines: list[Line], names: list[str], extra: dict[str, Callable[[Line], str]] | None = None) -> str:
    """Markdown: one row per cell, a column per side (TFLOP/s of unmasked work), cutefa over the best
    peer, then ``extra`` columns (title -> text of a line)."""
    extra = extra or {}
    peers = [n for n in names if n != "cutefa" and not n.startswith("cutefa")]
    head = ["cell", *names, "cutefa / best peer", *extra]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for line in lines:
        best = max((v for v in (line.tflops(n) for n in peers) if v), default=None)
        cells = [
            line.label,
            *(cell_text(line.results.get(n)) for n in names),
            ratio(line.tflops("cutefa"), best),
        ]
        out.append("| " + " | ".join([*cells, *(f(line) for f in extra.values())]) + " |")
    return "\n".join(out)


def notes(lines: list[Line]) -> str:
    """Every FAIL and err with its message (the table has no room for them)."""
    found = [
        f"- {line.label}, {name}: {res.status}: {res.error}"
        for line in lines for name, res in line.results.items() if res.status in ("FAIL", "err")
    ]  # fmt: skip
    return "\n".join(found)


def write_json(path: Path, meta: dict, lines: list[Line]) -> None:
    rows = [
        {"label": ln.label, "pass": ln.pass_, "group": ln.group, "flops": ln.flops,
         "results": {n: asdict(r) for n, r in ln.results.items()}}
        for ln in lines
    ]  # fmt: skip
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")


def plot(lines: list[Line], names: list[str], path: Path, title: str) -> bool:
    """Grouped bars of TFLOP/s per cell, one panel per pass; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    passes = [p for p in ("fwd", "bwd") if any(ln.pass_ == p for ln in lines)]
    fig, axes = plt.subplots(
        len(passes), 1, figsize=(max(8, 0.5 * len(lines)), 4.5 * len(passes)), squeeze=False
    )
    width = 0.8 / max(1, len(names))
    for ax, p in zip(axes[:, 0], passes):
        mine = [ln for ln in lines if ln.pass_ == p]
        for i, n in enumerate(names):
            ys = [ln.tflops(n) or 0.0 for ln in mine]
            ax.bar([x + i * width for x in range(len(mine))], ys, width, label=n)
        ax.set_xticks([x + 0.4 for x in range(len(mine))], [ln.label for ln in mine], rotation=75, fontsize=6)
        ax.set_ylabel("TFLOP/s (unmasked work)")
        ax.set_title(f"{title}: {p}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def precompile(specs, jobs: int) -> list[str]:
    """Compile cutefa's variants of a grid in parallel processes (as tools/bench_decode.py
    --precompile); the failures' messages."""
    from cutefa import dispatch
    from cutefa.compile import compile_variants

    specs = sorted(set(specs), key=lambda s: s.name)
    if not specs:
        return []
    results = compile_variants(specs, target=dispatch.current_target(), jobs=jobs, progress=True)
    return [f"{r.spec.name}: {r.error}" for r in results if not r.ok]
