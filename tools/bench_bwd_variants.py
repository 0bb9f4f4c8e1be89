"""Time every sm80-family backward variant side by side (the committed default tile and the measured
alternatives of tools/alternatives.py, e.g. stages=2), each kernel called directly, so that tiles
dispatch does not pick yet can be compared on one GPU.

Grid as tools/bench.py: (batch, seqlen, heads, head_dim) with batch x seqlen = 16384 tokens and
heads x head_dim = 2048; TFLOP/s counts 2.5 x 4*b*h*s^2*d (halved when causal); median of
triton.testing.do_bench (CUDA events without triton). Inputs: random normal q, k, v, dout; out and
lse from cutefa's forward. Times the whole backward launch (preprocess, main, postprocess) with
one dQ split (deterministic=0), as dispatch runs it.

    python3 tools/bench_bwd_variants.py                          # hd 64,128,192,256, bf16
    python3 tools/bench_bwd_variants.py --hdim 128 --seqlen 2048,8192 --causal 1 --dtype fp16

``--variants`` A/B-tests named sm80 backward variants instead (committed or not: a name the rules
accept is rendered and compiled, or taken from a kernel pack): one row per (causal, seqlen), one
column per variant (a name's causal twin runs the causal rows), the variants and FlashAttention-2's
backward (torch SDPA's flash backend, autograd of its forward) timed in turns for ``--rounds``
rounds, each cell the mean TFLOP/s and its ratio to FA2. Before timing, every variant's dQ, dK and
dV (outputs poisoned with NaN first) are compared with the first variant's (which must be finite):
a variant more than 2% apart (relative L2), or NaN, is marked in its row. The non-causal kernels
run with the stream-K tail as dispatch runs them; ``--tail off`` without it, ``--tail both`` each
variant both ways (a column each).

    python3 tools/bench_bwd_variants.py --variants cutefa_sm80_bwd_bf16_hd192_64x64_s1_w8_dqtile,\
        cutefa_sm80_bwd_bf16_hd192_64x64_s2_w8_dqtile --seqlen 2048,16384 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if str(Path(__file__).resolve().parent) not in sys.path:  # tools/alternatives.py, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

TOKENS, MODEL_DIM = 16384, 2048


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hdim", type=_ints, default=[64, 128, 192, 256])
    p.add_argument("--seqlen", type=_ints, default=[1024, 4096, 16384])
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--variants", help="comma-separated sm80 backward variant names to A/B beside FA2")
    p.add_argument("--rounds", type=int, default=2, help="with --variants: timing rounds, taken in turns")
    p.add_argument(
        "--tail", choices=("on", "off", "both"), default="on",
        help="with --variants: the stream-K tail of the non-causal kernels on (as dispatch runs them), off, or both",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.variants:
        return _ab(args)

    import torch
    from alternatives import all_variants

    import cutefa
    from cutefa.api.backward import device_tail_slots, dq_accum_workspace, sm80_tail_workspaces
    from cutefa.dispatch import current_target
    from cutefa.loader import get_kernel
    from cutefa.model.defaults import default_spec
    from cutefa.model.rules import why_not_on

    try:
        from triton.testing import do_bench

        def bench_ms(fn):
            return float(do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median"))
    except ImportError:

        def bench_ms(fn):
            fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 20

    target = current_target()
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    variants = [s for s in all_variants("sm80", "bwd") if s.dtype == args.dtype]
    variants = [s for s in variants if why_not_on(s, target) is None]
    print("| variant | default | causal | seqlen | ms | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for hd in args.hdim:
        for causal in causals:
            # the default: its tile and options (DqLayout.TILE; dq_pipe at hd96/192/256)
            default = default_spec("sm80", "bwd", args.dtype, hd, causal=causal)
            for seqlen in args.seqlen:
                q, k, v, dout, out, lse = _problem(torch, cutefa, dt, hd, seqlen, causal)
                batch, heads = q.shape[0], q.shape[2]
                scale = 1.0 / math.sqrt(hd)
                f32 = {"dtype": torch.float32, "device": "cuda"}
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                lse_log2, dpsum = torch.empty((batch, heads, seqlen), **f32), torch.empty((batch, heads, seqlen), **f32)
                dlse = torch.zeros_like(lse_log2)
                flops = 2.5 * 4.0 * batch * heads * seqlen**2 * hd / (2 if causal else 1)
                for spec in (s for s in variants if s.head_dim == hd and s.causal == causal):
                    kernel = get_kernel(spec, target)
                    dq_accum = dq_accum_workspace(spec, 1, batch, seqlen, heads, q.device)
                    slots = device_tail_slots(spec, q.device, False, batch, heads, seqlen, seqlen)
                    tail = sm80_tail_workspaces(spec, slots, q.device)
                    args_ = (q, k, v, out, dout, lse, dlse, dq, dk, dv, dq_accum, lse_log2, dpsum, *tail, scale, 0, slots)
                    ms = bench_ms(functools.partial(kernel, *args_))
                    mark = "yes" if spec == default else ""
                    print(
                        f"| {spec.name} | {mark} | {int(causal)} | {seqlen} | {ms:.3f} | {flops / ms / 1e9:.0f} |",
                        flush=True,
                    )
    return 0


def _load_bench():
    """tools/bench_backends.py (the benchmark's timer, FA2 backend, backward closure and error measure)."""
    import importlib.util

    path = Path(__file__).with_name("bench_backends.py")
    spec = importlib.util.spec_from_file_location("cutefa_tools_bench_backends", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _problem(torch, cutefa, dt, hd: int, seqlen: int, causal: bool):
    """Random q, k, v, dout of the grid's shape, and out / lse from cutefa's forward."""
    batch, heads = max(1, TOKENS // seqlen), max(1, MODEL_DIM // hd)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, hd, generator=gen, device="cuda", dtype=dt) for _ in range(4))
    out, lse = cutefa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    return q, k, v, dout, out, lse.float().contiguous()


def _ab(args) -> int:
    """--variants: the named variants and FA2's backward, timed in turns (see the module docs)."""
    import torch

    import cutefa
    from cutefa.api.backward import device_tail_slots, dq_accum_workspace, sm80_tail_workspaces
    from cutefa.dispatch import current_target
    from cutefa.loader import get_kernel
    from cutefa.model.rules import why_invalid
    from cutefa.model.spec import parse_name

    specs = [parse_name(n).replace(causal=False) for n in args.variants.split(",") if n]
    for spec in specs:
        if (spec.arch, spec.direction) != ("sm80", "bwd"):
            raise SystemExit(f"--variants: {spec.name} is not an sm80 backward variant")
        why = why_invalid(spec)
        if why is not None:
            raise SystemExit(f"--variants: {spec.name}: {why}")
    if len({(s.dtype, s.head_dim) for s in specs}) != 1:
        raise SystemExit("--variants: give variants of one dtype and head dim")
    dtype, hd = specs[0].dtype, specs[0].head_dim
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    bench = _load_bench()
    _, time_ms = bench.make_timer(args.warmup, args.rep)
    (fa2_backend,) = bench.load_backends(["FA2"])

    target = current_target()
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    # each variant with the stream-K tail as dispatch runs it (on), without it (off), or both
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.tail]
    labels = [
        s.name.removeprefix(f"cutefa_sm80_bwd_{dtype}_hd{hd}_") + ("" if args.tail != "both" else " +tail" if on else "")
        for s in specs
        for on in modes
    ]
    specs = [(s, on) for s in specs for on in modes]
    print(f"{dtype} hd{hd}: TFLOP/s (x FA2), mean of {args.rounds} rounds taken in turns")
    print("| causal | seqlen | FA2 | " + " | ".join(labels) + " |")
    print("|---|---|---|" + "---|" * len(specs))
    for causal in causals:
        for seqlen in args.seqlen:
            q, k, v, dout, out, lse = _problem(torch, cutefa, dt, hd, seqlen, causal)
            batch, heads = q.shape[0], q.shape[2]
            flops = 2.5 * 4.0 * batch * heads * seqlen**2 * hd / (2 if causal else 1)
            f32 = {"dtype": torch.float32, "device": "cuda"}
            runs, grads = [], []
            for spec, tail_on in specs:
                spec = spec.replace(causal=causal)
                kernel = get_kernel(spec, target)
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                lse_log2, dpsum = torch.empty((batch, heads, seqlen), **f32), torch.empty((batch, heads, seqlen), **f32)
                dq_accum = dq_accum_workspace(spec, 1, batch, seqlen, heads, q.device)
                slots = device_tail_slots(spec, q.device, False, batch, heads, seqlen, seqlen) if tail_on else 0
                call = functools.partial(
                    kernel, q, k, v, out, dout, lse, torch.zeros_like(lse_log2), dq, dk, dv, dq_accum, lse_log2,
                    dpsum, *sm80_tail_workspaces(spec, slots, q.device), 1.0 / math.sqrt(hd), 0, slots,
                )  # fmt: skip
                for t in (dq, dk, dv):
                    t.fill_(float("nan"))
                call()
                grads.append([t.float() for t in (dq, dk, dv)])
                runs.append(call)
            marks = [
                f"{labels[0]} {name} not finite"
                for name, x in zip(("dq", "dk", "dv"), grads[0])
                if not x.isfinite().all()
            ]
            for i, g in enumerate(grads[1:], 1):
                for name, x, ref in zip(("dq", "dk", "dv"), g, grads[0]):
                    err = bench.rel_err(x, ref)  # NaN reads as inf
                    if not err <= 0.02:
                        marks.append(f"{labels[i]} {name} {err:.3g} from {labels[0]}")
            with fa2_backend.context():
                fa2 = bench._backward(fa2_backend.make, q, k, v, causal, dout)

            fa2_t, ours = [], [[] for _ in runs]
            for _ in range(args.rounds):
                fa2_t.append(flops / time_ms(fa2) / 1e9)
                for i, run in enumerate(runs):
                    ours[i].append(flops / time_ms(run) / 1e9)
            base = sum(fa2_t) / len(fa2_t)
            cells = [f"{sum(t) / len(t):.0f} ({sum(t) / len(t) / base:.3f})" for t in ours]
            note = f" MISMATCH: {'; '.join(marks)}" if marks else ""
            print(f"| {int(causal)} | {seqlen} | {base:.0f} | " + " | ".join(cells) + " |" + note, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
