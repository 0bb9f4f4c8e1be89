"""How every benchmark of tools/ times its backends, the same way for each: check first, then time in
turns.

For each entry (a backend on one problem): its timed callable is built, called once (compiles,
plans, warm-up), called once more with every allocation poisoned (NaN,
:func:`bench_check.poisoned_allocations`; outputs allocated beforehand, :class:`Preallocated`, are
filled with NaN first) and those outputs judged; an entry whose outputs fail
is FAIL and is not timed, one that raises is err. The entries that passed are then timed in
``rounds`` rounds, each round timing every entry once, in turns (round r starts at entry r mod n,
so that no entry is always first after the checks), and each entry's time is the median of its
rounds. Every entry is called at the same level: its library's own function (which allocates its
outputs), forward as a plain call, backward as ``torch.autograd.grad`` over a graph its forward
built once (:func:`forward_call`, :func:`backward_call`).

:func:`run_cell` does this for the attention backends on one grid cell (tools/bench.py,
tools/bench_bwd_variants.py); tools/bench_fp8.py builds its own entries. A backend that does not
take the cell by its own check (``Backend.refuses``, asked first: :func:`refusals`) is "n/a" with
the reason, neither run nor timed.
"""

# No `from __future__ import annotations`: tools load this file by path, not always registering it
# in sys.modules, and dataclasses cannot resolve string annotations then.
import contextlib
import math
import statistics
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the bench_* siblings, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

import bench_check
from bench_grid import DTYPE_NAMES, Cell, Result, Row, tflops

ROUNDS = 3


def first_line(exc: BaseException, limit: int = 200) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Entry:
    """One thing to time. ``make()`` builds the timed callable (within ``context``); its return
    value is what ``judge`` (outputs -> :class:`bench_check.Verdict`) checks. ``missing``: why it
    cannot run at all (not installed). ``check_fresh``: the checked call is a callable made anew
    within the poisoned block (a backward whose forward must run under the same settings: the
    poisoning turns on torch's deterministic mode, and a torch.compile'd autograd graph refuses a
    backward in another mode than its forward's)."""

    name: str
    make: Callable[[], Callable[[], object]] | None
    judge: Callable[[object], "bench_check.Verdict"]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    missing: str | None = None
    check_fresh: bool = False


class Preallocated:
    """A timed call that writes into outputs allocated once beforehand (a kernel called directly):
    ``run()`` launches, the call returns ``outputs``; :meth:`poison` fills them with NaN, which
    :func:`run_entries` does right before the checked call (its allocations are not the call's)."""

    def __init__(self, run: Callable[[], object], outputs: tuple):
        self.run, self.outputs = run, outputs

    def __call__(self):
        self.run()
        return self.outputs

    def poison(self) -> None:
        for t in self.outputs:
            if t is not None:
                t.fill_(math.nan)


def turn_order(count: int, round_index: int) -> list[int]:
    """The entries' order in round ``round_index``: a rotation that starts at round_index mod count."""
    if count == 0:
        return []
    start = round_index % count
    return list(range(start, count)) + list(range(start))


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def host_timer(iters: int, warmup: int, totals: dict) -> Callable[[Callable], float]:
    """A timer of the host's cost of a call: median microseconds per call over 5 loops of ``iters``
    calls (after ``warmup`` calls and a synchronize); each loop's total with the final synchronize
    goes into ``totals[id(fn)]`` (the median of the five, one per timing)."""
    import time

    import torch

    def host_us(fn) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        host, total = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            host.append((t1 - t0) / iters * 1e6)
            total.append((t2 - t0) / iters * 1e6)
        totals.setdefault(id(fn), []).append(statistics.median(total))
        return statistics.median(host)

    return host_us


class Captured:
    """A timed call captured once in a CUDA graph: calling it replays the graph and returns the
    captured call's outputs (rewritten by each replay, :meth:`poison` fills them with NaN). ``make``
    builds the call on the capturing stream (after a synchronize with the current one) and runs it
    twice there before the capture: a backward's forward then runs on that stream too, so that
    autograd puts the backward's kernels on it (they run on their forward's stream)."""

    def __init__(self, make: Callable[[], Callable[[], object]]):
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn = make()
            fn()
            fn()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side):
            self.outputs = fn()
        torch.cuda.current_stream().wait_stream(side)

    def __call__(self):
        self.graph.replay()
        return self.outputs

    def poison(self) -> None:
        for t in _tensors(self.outputs):
            if t.is_floating_point():
                t.fill_(math.nan)


def _tensors(value) -> list:
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return [] if value is None or not hasattr(value, "fill_") else [value]


def _graph_checked(entry: Entry, device) -> tuple[Callable, "bench_check.Verdict"]:
    """The entry's call captured in a CUDA graph (:class:`Captured`), and the verdict on a replay's
    outputs, poisoned before it."""
    with entry.context():
        replay = Captured(entry.make)
        replay.poison()
        outputs = replay()
        _sync(device)
        return replay, entry.judge(outputs)


def run_entries(
    entries: list[Entry], time_ms: Callable, rounds: int = ROUNDS, device="cuda", graphs: bool = False
) -> dict[str, Result]:
    """Check every entry, then time those that passed in turns (module docstring). Returns name ->
    :class:`Result` (status ok | FAIL | err | missing; ms the median of the rounds). ``graphs``: an
    entry that passed is captured in a CUDA graph (:class:`Captured`), a replay checked the same way,
    and the replays timed (the host's cost of a call drops out)."""
    results: dict[str, Result] = {}
    ready: list[tuple[Entry, Callable]] = []
    for entry in entries:
        if entry.make is None:
            results[entry.name] = Result("missing", error=entry.missing)
            continue
        try:
            with entry.context():
                fn = entry.make()
                fn()  # warm-up: compile, plans, caches
                _sync(device)
                if hasattr(fn, "poison"):
                    fn.poison()
                with bench_check.poisoned_allocations(device):
                    outputs = (entry.make() if entry.check_fresh else fn)()
                    _sync(device)
                verdict = entry.judge(outputs)
                del outputs
        except Exception as exc:  # noqa: BLE001 - one failing backend must not kill the table
            results[entry.name] = Result("err", error=first_line(exc))
            continue
        if not verdict.ok:
            results[entry.name] = Result("FAIL", error=verdict.message, checks=verdict.errors)
            continue
        if graphs:
            del fn  # its autograd graph and outputs: the captured call builds its own
            try:
                fn, verdict = _graph_checked(entry, device)
            except Exception as exc:  # noqa: BLE001 - a backend that cannot be captured is reported
                results[entry.name] = Result("err", error=f"CUDA graph: {first_line(exc)}")
                continue
            if not verdict.ok:
                results[entry.name] = Result("FAIL", error=f"graph replay: {verdict.message}", checks=verdict.errors)
                continue
        results[entry.name] = Result("ok", checks=verdict.errors)
        ready.append((entry, fn))
    for r in range(rounds):
        for i in turn_order(len(ready), r):
            entry, fn = ready[i]
            res = results[entry.name]
            if res.status != "ok":
                continue  # raised in an earlier round
            try:
                with entry.context():
                    res.rounds_ms.append(float(time_ms(fn)))
            except Exception as exc:  # noqa: BLE001 - reported in the table
                res.status, res.error = "err", f"round {r + 1}: {first_line(exc)}"
    for res in results.values():
        if res.status == "ok" and res.rounds_ms:
            res.ms = statistics.median(res.rounds_ms)
    return results


# ---------------------------------------------------------------------------------------------
# the attention backends on one cell


def forward_call(backend, q, k, v, causal: bool) -> Callable[[], object]:
    """The backend's forward on (q, k, v): its raw call, timed as is. The judged outputs are its
    canonical (out (b, sq, hq, d), lse (b, hq, sq) or None): see :func:`canonical_forward`."""
    return backend.make(q, k, v, causal)


def canonical_forward(backend, raw):
    return backend.outputs(raw)


def backward_call(backend, q, k, v, dout, causal: bool) -> Callable[[], object]:
    """The backend's backward: its forward runs once here on leaves that require grad, the
    returned callable runs ``torch.autograd.grad`` of its output over that graph (retained) and
    gives (dq, dk, dv)."""
    import torch

    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
    out, _ = backend.outputs(backend.make(*leaves, causal)())
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def cell_inputs(cell: Cell, device="cuda", seed: int | None = None):
    """q, k, v (and dout for a backward cell): unit normal, in the cell's dtype, seeded per cell;
    v and dout of the cell's V head dim."""
    import torch

    dtype = getattr(torch, DTYPE_NAMES[cell.dtype])
    gen = torch.Generator(device=device).manual_seed(
        zlib.crc32(cell.label.encode()) if seed is None else seed
    )
    qs = (cell.batch, cell.seqlen, cell.heads, cell.hdim)
    ks = (cell.batch, cell.seqlen, cell.kv_heads, cell.hdim)
    vs = (cell.batch, cell.seqlen, cell.kv_heads, cell.v_dim)
    dos = (cell.batch, cell.seqlen, cell.heads, cell.v_dim)
    shapes = [qs, ks, vs] + ([dos] if cell.pass_ == "bwd" else [])
    return [torch.randn(s, generator=gen, device=device, dtype=dtype) for s in shapes]


def entries_for(cell: Cell, backends, inputs, expect) -> list[Entry]:
    """One :class:`Entry` per backend on the cell: forward or backward by the cell's pass."""
    q, k, v, *rest = inputs
    entries = []
    for b in backends:
        if b.make is None:
            entries.append(Entry(b.name, None, expect.judge, b.context, b.missing))
            continue
        if cell.pass_ == "fwd":
            make = lambda b=b: forward_call(b, q, k, v, cell.causal)
            judge = lambda raw, b=b: expect.judge(canonical_forward(b, raw))
        else:
            make = lambda b=b: backward_call(b, q, k, v, rest[0], cell.causal)
            judge = expect.judge
        # a backward is checked on a forward made within the poisoned block (Entry.check_fresh)
        entries.append(Entry(b.name, make, judge, b.context, check_fresh=cell.pass_ == "bwd"))
    return entries


def refusals(backends, inputs, causal: bool, pass_: str) -> dict[str, str]:
    """Backend name -> why it does not take the problem of ``inputs`` ((q, k, v[, dout])), for each
    present backend whose ``refuses`` says so (asked within its context, on leaves that require grad
    for a backward). A check that raises refuses nothing: the call then decides."""
    q, k, v = inputs[:3]
    if pass_ == "bwd":
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    found = {}
    for b in backends:
        if b.make is None or getattr(b, "refuses", None) is None:
            continue
        try:
            with b.context():
                why = b.refuses(q, k, v, causal)
        except Exception:  # noqa: BLE001 - an advisory check: the call itself decides then
            why = None
        if why:
            found[b.name] = str(why)
    return found


def run_cell(cell: Cell, backends, time_ms: Callable, *, rounds: int = ROUNDS, device="cuda",
             slices: int = bench_check.SLICES, variants=(), describe: Callable | None = None,
             graphs: bool = False) -> Row:  # fmt: skip
    """Every backend (and each ``variants`` backend: --bwd-variants) on one cell: inputs, the
    expectation (tools/bench_check.py), check and time in turns; a backend that refuses the cell
    (:func:`refusals`) is "n/a" with its reason. ``describe(q, k, v[, dout])`` labels the row
    (:attr:`Row.variant`); ``graphs``: each timed from a CUDA graph (:func:`run_entries`). Returns
    the cell's :class:`Row`."""
    inputs = cell_inputs(cell, device)
    q, k, v, *rest = inputs
    everyone = list(backends) + list(variants)
    refused = refusals(everyone, inputs, cell.causal, cell.pass_)
    taking = [b for b in everyone if b.name not in refused]
    results = {name: Result("n/a", error=why) for name, why in refused.items()}
    if taking:
        expect = bench_check.expectation(
            q, k, v, causal=cell.causal, scale=1.0 / math.sqrt(cell.hdim), dout=rest[0] if rest else None,
            slices=slices, seed=zlib.crc32(cell.label.encode()),
        )  # fmt: skip
        results |= run_entries(entries_for(cell, taking, inputs, expect), time_ms, rounds, device, graphs)
    row = Row(cell, variant=describe(*inputs) if describe is not None else None)
    variant_names = {b.name for b in variants}
    for b in everyone:
        res = results[b.name]
        if res.ms is not None:
            res.tflops = tflops(cell.flops, res.ms)
        (row.bwd_variants if b.name in variant_names else row.results)[b.name] = res
    return row
