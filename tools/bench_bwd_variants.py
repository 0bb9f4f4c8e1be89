"""Time sm80-family backward variants side by side with FlashAttention-2's backward, so that tiles
dispatch does not pick yet can be compared on one GPU.

Grid as tools/bench.py: (batch, seqlen, heads, head_dim) with batch x seqlen = 16384 tokens and
heads x head_dim = 2048; TFLOP/s counts 2.5 x 4*b*h*s^2*d (halved when causal). Every column is
timed the same way (tools/bench_run.py): autograd's backward over a graph its forward built once,
cutefa's backward forced to the variant (dispatch's choice replaced, tools/bench_backends.py
``forced_bwd_variant``) and FlashAttention-2's through torch SDPA's flash backend, all of a cell in
turns for ``--rounds`` rounds (default 3), each the median of its rounds. Before timing, each
column's dQ, dK and dV (allocated NaN-poisoned) are checked against the float32 reference on a
sample of (batch, head) slices, within 3x the error of the same reference computed in the 16-bit
dtype (tools/bench_check.py): a column that fails shows FAIL and no time. The non-causal sm80
kernels run with the stream-K tail as dispatch runs them; ``--tail off`` without it, ``--tail both``
each variant both ways (a column each).

    python3 tools/bench_bwd_variants.py                          # every sm80 bwd variant, hd 64..256, bf16
    python3 tools/bench_bwd_variants.py --hdim 128 --seqlen 2048,8192 --causal 1 --dtype fp16

``--variants`` A/B-tests named sm80 backward variants instead (committed or not: a name the rules
accept is rendered and compiled, or taken from a kernel pack): one row per (causal, seqlen), one
column per variant (a name's causal twin runs the causal rows), each cell "TFLOP/s (ratio to FA2)".

    python3 tools/bench_bwd_variants.py --variants cutefa_sm80_bwd_bf16_hd192_64x64_s1_w8_dqtile,\\
        cutefa_sm80_bwd_bf16_hd192_64x64_s2_w8_dqtile --seqlen 2048,16384 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if str(Path(__file__).resolve().parent) not in sys.path:  # the bench_* siblings, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench_run import ROUNDS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hdim", type=_ints, default=[64, 128, 192, 256])
    p.add_argument("--seqlen", type=_ints, default=[1024, 4096, 16384])
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--variants", help="comma-separated sm80 backward variant names to A/B beside FA2")
    p.add_argument(
        "--rounds", type=int, default=ROUNDS, help=f"timing rounds, taken in turns (default {ROUNDS})"
    )
    p.add_argument("--slices", type=int, default=3, help="(batch, head) slices checked per cell (default 3)")
    p.add_argument(
        "--tail", choices=("on", "off", "both"), default="on",
        help="the stream-K tail of the non-causal kernels on (as dispatch runs them), off, or both",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def named_variants(text: str):
    """The non-causal twins of the named sm80 backward variants (SystemExit naming a bad one, or
    variants of several dtypes or head dims)."""
    from cutefa.model.rules import why_invalid
    from cutefa.model.spec import parse_name

    specs = [parse_name(n).replace(causal=False) for n in text.split(",") if n]
    for spec in specs:
        if (spec.arch, spec.direction) != ("sm80", "bwd"):
            raise SystemExit(f"--variants: {spec.name} is not an sm80 backward variant")
        why = why_invalid(spec)
        if why is not None:
            raise SystemExit(f"--variants: {spec.name}: {why}")
    if len({(s.dtype, s.head_dim) for s in specs}) != 1:
        raise SystemExit("--variants: give variants of one dtype and head dim")
    return specs


def columns(specs, tail: str, short: bool) -> list[tuple[object, bool | None, str]]:
    """(spec, tail, label) per column: each spec with the tail as dispatch runs it (None), off
    (False), or both; labels without the common name prefix when ``short``."""
    modes = {"on": [None], "off": [False], "both": [False, None]}[tail]
    out = []
    for spec in specs:
        base = (
            spec.name.removeprefix(f"cutefa_sm80_bwd_{spec.dtype}_hd{spec.head_dim}_") if short else spec.name
        )
        for mode in modes:
            label = base + ("" if tail != "both" else " +tail" if mode is None else " -tail")
            out.append((spec, mode, label))
    return out


def _cell_results(cell, cols, fa2, cutefa_backend, time_ms, args):
    """FA2 and every column's variant (its causal twin for a causal cell) on one cell: the Row."""
    from bench_backends import bwd_variant_backend
    from bench_run import run_cell

    variants = [
        bwd_variant_backend(spec.replace(causal=cell.causal).name, cutefa_backend, label, tail)
        for spec, tail, label in cols
    ]  # fmt: skip
    return run_cell(cell, [fa2], time_ms, rounds=args.rounds, slices=args.slices, variants=variants)


def _ratio_text(res, base) -> str:
    if res.status != "ok" or res.tflops is None:
        return res.status
    return f"{res.tflops:.0f}" + (f" ({res.tflops / base:.3f})" if base else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from alternatives import all_variants
    from bench_backends import load_backends, make_timer
    from bench_grid import Cell

    from cutefa.dispatch import current_target
    from cutefa.model.defaults import default_spec
    from cutefa.model.rules import why_not_on

    if not torch.cuda.is_available():
        print("bench_bwd_variants.py needs a CUDA GPU", file=sys.stderr)
        return 2
    _, time_ms = make_timer(args.warmup, args.rep)
    fa2, cutefa_backend = load_backends(["FA2", "cutefa"])
    target = current_target()
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    failed = False
    if args.variants:
        specs = named_variants(args.variants)
        cols = columns(specs, args.tail, short=True)
        dtype, hd = specs[0].dtype, specs[0].head_dim
        print(
            f"{dtype} hd{hd}: TFLOP/s (x FA2), median of {args.rounds} rounds taken in turns, checked first"
        )
        print("| causal | seqlen | FA2 | " + " | ".join(label for _, _, label in cols) + " |")
        print("|---|---|---|" + "---|" * len(cols))
        for causal in causals:
            for seqlen in args.seqlen:
                row = _cell_results(
                    Cell(dtype, hd, causal, seqlen, "bwd"), cols, fa2, cutefa_backend, time_ms, args
                )
                base = row.value("FA2")
                cells = [_ratio_text(row.bwd_variants[label], base) for _, _, label in cols]
                notes = [f"{n}: {r.status}: {r.error}" for n, r in [*row.results.items(), *row.bwd_variants.items()]
                         if r.status in ("FAIL", "err")]  # fmt: skip
                failed |= any(r.status == "FAIL" for r in row.bwd_variants.values())
                fa2_text = f"{base:.0f}" if base else row.results["FA2"].status
                print(f"| {int(causal)} | {seqlen} | {fa2_text} | " + " | ".join(cells) + " |"
                      + (f" {'; '.join(notes)}" if notes else ""), flush=True)  # fmt: skip
        return 1 if failed else 0

    variants = [
        s for s in all_variants("sm80", "bwd") if s.dtype == args.dtype and why_not_on(s, target) is None
    ]
    print(f"median of {args.rounds} rounds taken in turns with FA2, each column checked first")
    print("| variant | default | causal | seqlen | ms | TFLOP/s | x FA2 |")
    print("|---|---|---|---|---|---|---|")
    for hd in args.hdim:
        for causal in causals:
            default = default_spec("sm80", "bwd", args.dtype, hd, causal=causal)
            specs = [s.replace(causal=False) for s in variants if s.head_dim == hd and s.causal == causal]
            cols = columns(specs, args.tail, short=False)
            for seqlen in args.seqlen:
                row = _cell_results(
                    Cell(args.dtype, hd, causal, seqlen, "bwd"), cols, fa2, cutefa_backend, time_ms, args
                )
                base = row.value("FA2")
                for spec, _, label in cols:
                    res = row.bwd_variants[label]
                    failed |= res.status == "FAIL"
                    mark = "yes" if spec.replace(causal=causal) == default else ""
                    ms = f"{res.ms:.3f}" if res.ms is not None else res.status
                    tf = f"{res.tflops:.0f}" if res.tflops is not None else (res.error or "")
                    ratio = f"{res.tflops / base:.3f}" if res.tflops and base else ""
                    print(
                        f"| {label} | {mark} | {int(causal)} | {seqlen} | {ms} | {tf} | {ratio} |", flush=True
                    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
