"""Side-by-side attention benchmark on one GPU: cutefa vs FA4, SDPA's cuDNN, FlashAttention-2 and
memory-efficient backends, and FlexAttention, in one run.

Grid (as in the anchor figures): layout (batch, seqlen, heads, head_dim) with batch x seqlen =
16384 tokens; head dims (``--hdim``) D for q, k and v, or QK:V pairs (q and k of head dim d_qk, v
and the output of d_v: 192:128 is DeepSeek's prefill); heads (``--heads``) "mha" = 2048 // d_qk query
and key/value heads (rounded down where d_qk does not divide 2048: 25 at 80, 18 at 112, 10 at 192),
grouped-query "32/8" (Llama 3 8B) and "64/8" (Llama 3 70B), "mqa" = 2048 // d_qk query heads over
one key/value head. Random normal inputs; median time of ``triton.testing.do_bench`` (CUDA events
when triton is missing). TFLOP/s counts 2*b*hq*s^2*(d_qk + d_v) for the forward (4*b*hq*s^2*d with
one head dim; 2.5x that for the backward), halved when causal.
The dense bf16 matmul rate (8192^3) is measured in the same run: the ceiling the attention figures
are read against.

Every backend is checked before it is timed, on every cell (tools/bench_check.py): its outputs
(forward: O and its log-sum-exp; backward: dQ, dK and dV), allocated NaN-poisoned, against a
float32 reference on a sample of (batch, head) slices (``--slices``), each within a bar set from the
error of the same reference computed in the inputs' 16-bit dtype (3x it, plus an epsilon). A cell
that fails prints FAIL and no speed; a backend that raises prints "err" (the message in the notes);
one that is not installed leaves its column empty; one that does not take the cell's head dims, by
its own library's check (cutefa's head-dim rule, FA4's head-dim validation, torch's SDPA dispatcher
checks where v's head dim differs from q's), prints "n/a (why)" and has no bar in the plot. Every backend is timed the same way
(tools/bench_run.py): through its library's own call (which allocates its outputs), forward as a
plain call, backward as autograd over a graph its forward built once, all backends of a cell in
turns for ``--rounds`` rounds (default 3), the median kept.

    python3 tools/bench.py                      # full grid, bf16, causal and not
    python3 tools/bench.py --quick              # a few cells
    python3 tools/bench.py --hdim 128 --seqlen 4096,8192 --causal 1 --dtype bf16,fp16 --heads mha,32/8
    python3 tools/bench.py --hdim 80,112,192:128 --seqlen 8192 --pass fwd,bwd --causal both --heads mha
    python3 tools/bench.py --pass both --plot bench_out/bench.png
    python3 tools/bench.py --enqueue            # host cost per call, all backends
    python3 tools/bench.py --enqueue --pack DIR # ... with cutefa's kernel from a kernel pack
    python3 tools/bench.py --enqueue --train    # host cost per fwd+bwd training call, side by side
    python3 tools/bench.py --startup            # import cutefa -> first result from a pack, ms
    python3 tools/bench.py --pass bwd --hdim 128 --seqlen 2048 --causal 0 \
        --bwd-variants cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_ov,cutefa_sm90_bwd_bf16_hd128_64x128_s3_w12

``--bwd-variants NAME,...`` times each named backward variant (or ``sm90`` / ``ARCH``: every
committed backward variant of that family and the measured alternatives, tools/alternatives.py) on
the backward cells whose dtype, head dim and mask it serves, as one more backend of the cell
(cutefa's forward, autograd's backward forced to that variant, checked and timed in the same turns);
each gets a row of its own in a "Backward variants" table beside FA4 and the default cutefa backward.

Writes ``bench.md`` and ``bench.json`` (``enqueue.md``/``enqueue.json`` for ``--enqueue``,
``enqueue_train.md``/``enqueue_train.json`` for ``--enqueue --train``,
``startup.md``/``startup.json`` for ``--startup``) under ``--out`` (default ``bench_out/``);
``--plot FILE.png`` also draws the grid side by side (needs matplotlib). ``--pack DIR`` (default for
``--startup``: ``<out>/pack``) names the kernel pack cutefa runs from; the kernel of the tiny
problem is compiled into it first when it lacks it. ``cutefa bench ARGS`` runs this with ARGS.

This file holds the command line and the grid's run; beside it: bench_grid.py (shapes, cells,
results), bench_backends.py (timer, backends), bench_check.py (the reference and the bars),
bench_run.py (check, then time in turns), bench_report.py (tables, JSON, plot), bench_host.py
(--enqueue, --startup) and bench_train_host.py (--enqueue --train).
"""

import argparse
import json
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # tools/alternatives.py and the bench_* siblings
    sys.path.append(str(Path(__file__).resolve().parent))

from bench_backends import (
    _first_line,
    _variant,
    bwd_variant_backend,
    environment,
    load_backends,
    make_timer,
    measure_matmul,
)
from bench_check import SLICES
from bench_grid import (
    BACKENDS,
    DTYPE_NAMES,
    HDIMS,
    HEADS,
    QUICK_HDIMS,
    QUICK_HEADS,
    QUICK_SEQLENS,
    SEQLENS,
    TOKENS,
    grid,
    parse_hdim,
    parse_heads,
    variant_serves,
)
from bench_host import run_enqueue, run_startup
from bench_report import check_plot, not_taken_notes, plot, report_json, report_markdown
from bench_run import ROUNDS, run_cell

# ----------------------------------------------------------------------------------------------
# arguments


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _parsed_list(text: str, parse, empty: str) -> list:
    """A comma list, each item through ``parse`` (its ValueError the argparse error), duplicates
    dropped in order; ``empty``: the error of a list without items."""
    try:
        values = [parse(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not values:
        raise argparse.ArgumentTypeError(f"{empty}, got {text!r}")
    return list(dict.fromkeys(values))


def _hdim_list(text: str) -> list[tuple[int, int]]:
    """``--hdim``: a comma list of D and QK:V items, as (d_qk, d_v) pairs."""
    return _parsed_list(text, parse_hdim, "--hdim takes head dims D or QK:V pairs")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _dtype_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in values if x not in DTYPE_NAMES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"--dtype takes a list of {sorted(DTYPE_NAMES)}, got {text!r}")
    return values


def _pass_list(text: str) -> list[str]:
    values = ["fwd", "bwd"] if text.strip() == "both" else [x.strip() for x in text.split(",") if x.strip()]
    if not values or any(x not in ("fwd", "bwd") for x in values):
        raise argparse.ArgumentTypeError(f"--pass takes fwd, bwd, fwd,bwd or both, got {text!r}")
    return values


def _backend_list(text: str) -> list[str]:
    by_lower = {b.lower(): b for b in BACKENDS}
    values = [x.strip().lower() for x in text.split(",") if x.strip()]
    bad = [x for x in values if x not in by_lower]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"--backends takes a list of {list(BACKENDS)}, got {text!r}")
    return [by_lower[x] for x in values]


def _heads_list(text: str) -> list[str]:
    return _parsed_list(text, parse_heads, "--heads takes mha, mqa or HQ/HKV entries")


def _bwd_variant_list(text: str) -> list[str]:
    """Backward variant names, checked: a comma list of names and/or family names (sm90: every
    committed sm90 backward variant and the measured alternatives)."""
    from alternatives import all_variants

    from cutefa.model import rules
    from cutefa.model.spec import ARCHS, parse_name

    names: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item in ARCHS:
            names += [s.name for s in all_variants(item, "bwd")]
            continue
        try:
            spec = parse_name(item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if spec.direction != "bwd":
            raise argparse.ArgumentTypeError(f"--bwd-variants: {item!r} is not a backward variant")
        why = rules.why_invalid(spec)
        if why is not None:
            raise argparse.ArgumentTypeError(f"--bwd-variants: {item!r} is not valid: {why}")
        names.append(item)
    if not names:
        raise argparse.ArgumentTypeError(f"--bwd-variants takes variant names, got {text!r}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench.py",
        description="cutefa vs FA4 / cuDNN / FA2 / efficient / FlexAttention, checked and timed side by "
        "side on one GPU.",
    )
    p.add_argument(
        "--hdim", type=_hdim_list, default=None,
        help="head dims: D (q, k and v) or QK:V (q and k of QK, v and the output of V), e.g. 64,128,256 "
        "(default) or 80,112,192:128",
    )  # fmt: skip
    p.add_argument("--seqlen", type=_int_list, default=None, help="seqlens (default 1024..16384)")
    p.add_argument(
        "--batch", type=_int_list, default=None,
        help=f"batch sizes, each with every seqlen (default: {TOKENS} tokens per cell, batch = {TOKENS} // seqlen); "
        "small grids: e.g. --batch 1,2 --heads 8/8,16/16",
    )  # fmt: skip
    p.add_argument(
        "--graphs", action="store_true",
        help="time every backend replayed from a CUDA graph (captured once after its check, a replay checked "
        "too): the host's cost of a call drops out, as in a captured training or serving step. Known problem: "
        "backward cells with cutefa and FA4 (and cuDNN) in one run have hit an illegal memory access at the "
        "next cell (cause not found; docs/log/perf-notes.md); one backend per run has not",
    )  # fmt: skip
    p.add_argument(
        "--heads", type=_heads_list, default=None,
        help=f"head layouts: mha, mqa or HQ/HKV (default {','.join(HEADS)}; --quick {','.join(QUICK_HEADS)})",
    )  # fmt: skip
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--dtype", type=_dtype_list, default=["bf16"], help="bf16 (default), fp16 or bf16,fp16")
    p.add_argument("--pass", dest="passes", type=_pass_list, default=["fwd"], help="fwd, bwd or both (fwd)")
    p.add_argument(
        "--quick", action="store_true", help="small grid: hdim 128, seqlen 1024,4096, heads mha,32/8"
    )
    p.add_argument("--backends", type=_backend_list, default=list(BACKENDS), help="subset of backends")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder (bench_out/)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument(
        "--rounds", type=_positive_int, default=ROUNDS,
        help=f"time every backend of a cell this many times, in turns (backend after backend, round "
        f"after round), and report the median: clock and power drift then falls on all backends alike "
        f"(default {ROUNDS})",
    )  # fmt: skip
    p.add_argument(
        "--slices", type=_positive_int, default=SLICES,
        help=f"(batch, head) slices of each cell checked against the float32 reference (default {SLICES})",
    )  # fmt: skip
    p.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png", help="draw the grid side by side (matplotlib)"
    )
    p.add_argument("--enqueue", action="store_true", help="measure host cost per call instead of the grid")
    p.add_argument("--enqueue-iters", type=int, default=1000, help="calls per enqueue loop")
    p.add_argument(
        "--train", action="store_true",
        help="with --enqueue: host cost per forward + backward call of inputs that require gradients",
    )  # fmt: skip
    p.add_argument(
        "--startup",
        action="store_true",
        help="time from `import cutefa` to the first result from a kernel pack",
    )
    p.add_argument("--startup-runs", type=int, default=7, help="fresh processes timed by --startup")
    p.add_argument("--pack", type=Path, default=None, help="kernel pack for cutefa (--enqueue, --startup)")
    p.add_argument(
        "--bwd-variants",
        type=_bwd_variant_list,
        default=[],
        help="backward variant names (comma-separated), or a family (sm90) for all its committed ones: "
        "each timed on the matching bwd cells, one row per variant (implies --pass bwd)",
    )
    args = p.parse_args(argv)
    if args.plot is not None:
        why = check_plot(args.plot)
        if why:
            p.error(f"--plot: {why}")
    if args.bwd_variants and "bwd" not in args.passes:
        args.passes = [*args.passes, "bwd"]
    if args.hdim is None:
        args.hdim = [(hd, hd) for hd in (QUICK_HDIMS if args.quick else HDIMS)]
    if args.seqlen is None:
        args.seqlen = list(QUICK_SEQLENS if args.quick else SEQLENS)
    if args.heads is None:
        args.heads = list(QUICK_HEADS if args.quick else HEADS)
    return args


def run_grid(args: argparse.Namespace) -> int:
    """Every cell of the grid: each backend checked, then timed in turns (tools/bench_run.py).
    Returns 1 when cutefa (or a --bwd-variants variant) failed a check on some cell, else 0."""
    backends = load_backends(args.backends)
    names = [b.name for b in backends]
    for b in backends:
        if b.missing:
            print(b.missing)
    cutefa_backend = next((b for b in backends if b.name == "cutefa"), None)
    if args.bwd_variants and cutefa_backend is None:
        (cutefa_backend,) = load_backends(["cutefa"])
    timer_name, time_ms = make_timer(args.warmup, args.rep)
    meta = environment() | {"timer": timer_name, "rounds": args.rounds, "slices": args.slices}
    meta |= {"graphs": args.graphs, "batches": args.batch}
    meta["argv"] = sys.argv[1:]
    notes: list[str] = []
    try:
        meta["matmul_tflops"] = measure_matmul(time_ms)
        print(f"dense bf16 matmul 8192^3: {meta['matmul_tflops']:.0f} TFLOP/s", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported in the notes
        meta["matmul_tflops"] = None
        notes.append(f"dense matmul: {_first_line(exc)}")

    rows = []
    no_lse: dict[str, int] = {}
    for cell in grid(args):
        variants = [
            bwd_variant_backend(n, cutefa_backend) for n in args.bwd_variants if variant_serves(n, cell)
        ]
        describe = (lambda q, k, v, *_, c=cell.causal: _variant(q, k, v, c)) if "cutefa" in names else None
        row = run_cell(
            cell,
            backends,
            time_ms,
            rounds=args.rounds,
            slices=args.slices,
            variants=variants,
            describe=describe,
            graphs=args.graphs,
        )
        for name, res in [*row.results.items(), *row.bwd_variants.items()]:
            if res.status in ("FAIL", "err"):
                notes.append(f"{name} {cell.label}: {res.status}: {res.error}")
            if res.checks.get("LSE") == "not returned":
                no_lse[name] = no_lse.get(name, 0) + 1
        for name, res in row.bwd_variants.items():
            print(f"    {name}: {res.text() or '-'}", file=sys.stderr, flush=True)
        rows.append(row)
        shown = ", ".join(f"{n} {row.results[n].text() or '-'}" for n in names)
        batch = f" b={cell.batch}" if cell.batch_ is None else ""  # (a --batch cell's label has it)
        print(f"[{len(rows)}] {cell.label}{batch}: {shown}", file=sys.stderr, flush=True)

    notes += [
        f"{name} returned no log-sum-exp on {n} forward cell(s): O checked alone there"
        for name, n in no_lse.items()
    ]
    notes += not_taken_notes(rows)
    md_text = report_markdown(meta, rows, names, notes)
    print()
    print(md_text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.md").write_text(md_text + "\n")
    (args.out / "bench.json").write_text(json.dumps(report_json(meta, rows, notes), indent=1) + "\n")
    if args.plot is not None:
        plot(rows, names, meta.get("matmul_tflops"), args.plot)
        print(f"plot: {args.plot}")
    print(f"wrote {args.out / 'bench.md'} and {args.out / 'bench.json'}")
    ours = [
        r for row in rows for r in [row.results.get("cutefa"), *row.bwd_variants.values()] if r is not None
    ]
    return 1 if any(r.status == "FAIL" for r in ours) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if args.startup:
        return run_startup(args)
    if args.enqueue and args.train:
        from bench_train_host import run_train_enqueue

        return run_train_enqueue(args)
    if args.enqueue:
        return run_enqueue(args)
    return run_grid(args)


if __name__ == "__main__":
    sys.exit(main())
