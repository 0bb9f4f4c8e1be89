"""Side-by-side attention benchmark on one GPU: cutefa vs FA4, cuDNN and FA2, in one run.

Grid (as in the anchor figures): layout (batch, seqlen, heads, head_dim) with batch x seqlen =
16384 tokens and heads x head_dim = 2048, random normal inputs, median time of
``triton.testing.do_bench`` (CUDA events when triton is missing). TFLOP/s counts 4*b*h*s^2*d for
the forward, halved when causal. The dense bf16 matmul rate (8192^3) is measured in the same run:
that is the ceiling the attention figures are read against.

Before cutefa is timed on a cell, its output is checked against SDPA; a cell whose relative error
exceeds the tolerance is reported as WRONG and its speed is not. A backend that raises is shown as
"err" with the message in the notes; a backend that is not installed leaves its column empty.

    python3 tools/bench.py                      # full grid, bf16, causal and not
    python3 tools/bench.py --quick              # a few cells
    python3 tools/bench.py --hdim 128 --seqlen 4096,8192 --causal 1 --dtype bf16,fp16
    python3 tools/bench.py --enqueue            # host cost per call, all backends
    python3 tools/bench.py --enqueue --pack DIR # ... with cutefa's kernel from a kernel pack
    python3 tools/bench.py --startup            # import cutefa -> first result from a pack, ms
    python3 tools/bench.py --pass bwd --hdim 128 --seqlen 2048 --causal 0 \
        --bwd-variants cutefa_sm90_bwd_bf16_hd128_64x128_s2_w12_ov,cutefa_sm90_bwd_bf16_hd128_64x128_s3_w12

``--bwd-variants NAME,...`` times each named backward variant (or ``sm90`` / ``ARCH``: every
committed backward variant of that family and the measured alternatives, tools/alternatives.py) on
the backward cells whose dtype, head dim and mask it serves, exactly as the cutefa column is timed
(cutefa's forward, then autograd's backward, checked against SDPA) but with the backward forced to
that variant; each gets a row of its own in a "Backward variants" table beside FA4 and the default
cutefa backward of the same cell.

Writes ``bench.md``, ``bench.json`` and ``bench.png`` (``enqueue.md``/``enqueue.json`` for
``--enqueue``, ``startup.md``/``startup.json`` for ``--startup``) under ``--out`` (default
``bench_out/``). ``--pack DIR`` (default for ``--startup``: ``<out>/pack``) names the kernel pack
cutefa runs from; the kernel of the tiny problem is compiled into it first when it lacks it.

This file holds the command line and the grid's run; beside it: bench_grid.py (shapes, cells,
results), bench_backends.py (timer, backends, checks against SDPA), bench_report.py (tables, JSON,
plot) and bench_host.py (--enqueue, --startup).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # tools/alternatives.py and the bench_* siblings
    sys.path.append(str(Path(__file__).resolve().parent))

from bench_backends import (
    _first_line,
    _sdpa_dq,
    _sdpa_out,
    _variant,
    bwd_variant_backend,
    environment,
    load_backends,
    make_timer,
    measure_matmul,
    run_backend,
)
from bench_grid import (
    BACKENDS,
    DTYPE_NAMES,
    HDIMS,
    QUICK_HDIMS,
    QUICK_SEQLENS,
    SEQLENS,
    Row,
    grid,
    tflops,
    variant_serves,
)
from bench_host import run_enqueue, run_startup
from bench_report import plot, report_json, report_markdown

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
        description="cutefa vs FA4 / cuDNN / FA2 attention throughput, side by side on one GPU.",
    )
    p.add_argument("--hdim", type=_int_list, default=None, help="head dims, e.g. 64,128,256 (default)")
    p.add_argument("--seqlen", type=_int_list, default=None, help="seqlens (default 1024..16384)")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--dtype", type=_dtype_list, default=["bf16"], help="bf16 (default), fp16 or bf16,fp16")
    p.add_argument("--pass", dest="passes", type=_pass_list, default=["fwd"], help="fwd, bwd or both (fwd)")
    p.add_argument("--quick", action="store_true", help="small grid: hdim 128, seqlen 1024,4096")
    p.add_argument("--backends", type=_backend_list, default=list(BACKENDS), help="subset of backends")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder (bench_out/)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument(
        "--rounds", type=_positive_int, default=1,
        help="time every backend of a cell this many times, in turns (backend after backend, round "
        "after round), and report the median: clock and power drift then falls on all backends alike",
    )  # fmt: skip
    p.add_argument("--check-tol", type=float, default=2e-2, help="max rel error of cutefa vs SDPA")
    p.add_argument("--no-plot", action="store_true", help="skip bench.png")
    p.add_argument("--enqueue", action="store_true", help="measure host cost per call instead of the grid")
    p.add_argument("--enqueue-iters", type=int, default=1000, help="calls per enqueue loop")
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
    if args.bwd_variants and "bwd" not in args.passes:
        args.passes = [*args.passes, "bwd"]
    if args.hdim is None:
        args.hdim = list(QUICK_HDIMS if args.quick else HDIMS)
    if args.seqlen is None:
        args.seqlen = list(QUICK_SEQLENS if args.quick else SEQLENS)
    return args


def run_grid(args: argparse.Namespace) -> int:
    import torch

    backends = load_backends(args.backends)
    names = [b.name for b in backends]
    for b in backends:
        if b.missing:
            print(b.missing)
    cutefa_backend = next((b for b in backends if b.name == "cutefa"), None)
    if args.bwd_variants and cutefa_backend is None:
        (cutefa_backend,) = load_backends(["cutefa"])
    timer_name, time_ms = make_timer(args.warmup, args.rep)
    meta = environment() | {"timer": timer_name, "rounds": args.rounds, "check_tol": args.check_tol}
    meta["argv"] = sys.argv[1:]
    notes: list[str] = []
    try:
        meta["matmul_tflops"] = measure_matmul(time_ms)
        print(f"dense bf16 matmul 8192^3: {meta['matmul_tflops']:.0f} TFLOP/s", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported in the notes
        meta["matmul_tflops"] = None
        notes.append(f"dense matmul: {_first_line(exc)}")

    rows = []
    for cell in grid(args):
        dtype = getattr(torch, DTYPE_NAMES[cell.dtype])
        shape = (cell.batch, cell.seqlen, cell.heads, cell.hdim)
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
        row = Row(cell)
        dout = torch.randn_like(q) if cell.pass_ == "bwd" else None
        try:
            expect = _sdpa_out(q, k, v, cell.causal) if dout is None else _sdpa_dq(q, k, v, cell.causal, dout)
        except Exception as exc:  # noqa: BLE001 - reported in the notes
            expect = None
            notes.append(f"{cell.label}: SDPA reference failed, cutefa unchecked: {_first_line(exc)}")
        for _ in range(args.rounds):
            for b in backends:
                first = row.results.get(b.name)
                if first is not None and first.ms is None:
                    continue  # failed or missing in an earlier round
                check = expect if b.name == "cutefa" and first is None else None
                res = run_backend(b, q, k, v, cell.causal, time_ms, check, args.check_tol, dout)
                if first is not None:
                    first.rounds_ms.append(res.ms)  # None: this round failed
                    continue
                if res.ms is not None:
                    res.rounds_ms.append(res.ms)
                row.results[b.name] = res
        for b in backends:
            res = row.results[b.name]
            if res.ms is not None:
                if None in res.rounds_ms:
                    res.status, res.ms, res.error = "err", None, f"failed in a later round: {res.rounds_ms}"
                else:
                    res.ms = statistics.median(res.rounds_ms)
            if res.ms is not None:
                res.tflops = tflops(cell.flops, res.ms)
            if b.name == "cutefa" and expect is None and res.status == "ok":
                res.status = "unchecked"
            if res.status in ("WRONG", "err"):
                notes.append(f"{b.name} {cell.label}: {res.error}")
        for vname in [n for n in args.bwd_variants if variant_serves(n, cell)]:
            vb = bwd_variant_backend(vname, cutefa_backend)
            res = run_backend(vb, q, k, v, cell.causal, time_ms, expect, args.check_tol, dout)
            if res.ms is not None:
                res.tflops = tflops(cell.flops, res.ms)
            if expect is None and res.status == "ok":
                res.status = "unchecked"
            if res.status in ("WRONG", "err"):
                notes.append(f"{vname} {cell.label}: {res.error}")
            row.bwd_variants[vname] = res
            print(f"    {vname}: {res.text() or '-'}", file=sys.stderr, flush=True)
        if "cutefa" in names:
            row.variant = _variant(q, k, v, cell.causal)
        rows.append(row)
        shown = ", ".join(f"{n} {row.results[n].text() or '-'}" for n in names)
        print(
            f"[{len(rows)}] {cell.label} b={cell.batch} h={cell.heads}: {shown}", file=sys.stderr, flush=True
        )
        del q, k, v, expect

    md_text = report_markdown(meta, rows, names, notes)
    print()
    print(md_text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.md").write_text(md_text + "\n")
    (args.out / "bench.json").write_text(json.dumps(report_json(meta, rows, notes), indent=1) + "\n")
    if not args.no_plot:
        why = plot(rows, names, meta.get("matmul_tflops"), args.out / "bench.png")
        print(why or f"plot: {args.out / 'bench.png'}")
    print(f"wrote {args.out / 'bench.md'} and {args.out / 'bench.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if args.startup:
        return run_startup(args)
    if args.enqueue:
        return run_enqueue(args)
    return run_grid(args)


if __name__ == "__main__":
    sys.exit(main())
