"""Time every committed sm80-family backward variant side by side (the default tile and its tuning
alternatives, e.g. stages=2), each kernel called directly, so that tiles dispatch does not pick
yet can be compared on one GPU.

Grid as tools/bench.py: (batch, seqlen, heads, head_dim) with batch x seqlen = 16384 tokens and
heads x head_dim = 2048; TFLOP/s counts 2.5 x 4*b*h*s^2*d (halved when causal); median of
triton.testing.do_bench (CUDA events without triton). Inputs: random normal q, k, v, dout; out and
lse from cutefa's forward. Times the whole backward launch (preprocess, main, postprocess) with
one dQ split (deterministic=0), as dispatch runs it.

    python3 tools/bench_bwd_variants.py                          # hd 64,128,192,256, bf16
    python3 tools/bench_bwd_variants.py --hdim 128 --seqlen 2048,8192 --causal 1 --dtype fp16
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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
    args = p.parse_args(argv)

    import torch

    import cutefa
    from cutefa import space
    from cutefa.backward import dq_accum_workspace
    from cutefa.compile import get_kernel
    from cutefa.dispatch import current_target
    from cutefa.spec import VariantSpec

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
    variants = [s for s in space.default_variants("sm80", "bwd") if s.dtype == args.dtype and space.why_not_on(s, target) is None]
    print("| variant | default | causal | seqlen | ms | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for hd in args.hdim:
        tile = space.DEFAULT_BWD_TILES["sm80"].get(hd)
        extras = space.default_extras("sm80", "bwd", hd)
        for causal in causals:
            # the default: the default tile with the family's default flags (dq_tile)
            default = tile and VariantSpec("sm80", "bwd", args.dtype, hd, *tile, causal=causal, **extras)
            for seqlen in args.seqlen:
                batch, heads = max(1, TOKENS // seqlen), max(1, MODEL_DIM // hd)
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, dout = (
                    torch.randn(batch, seqlen, heads, hd, generator=gen, device="cuda", dtype=dt) for _ in range(4)
                )
                out, lse = cutefa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
                scale = 1.0 / math.sqrt(hd)
                f32 = {"dtype": torch.float32, "device": "cuda"}
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                lse_log2, dpsum = torch.empty((batch, heads, seqlen), **f32), torch.empty((batch, heads, seqlen), **f32)
                dlse = torch.zeros_like(lse_log2)
                lse = lse.float().contiguous()
                flops = 2.5 * 4.0 * batch * heads * seqlen**2 * hd / (2 if causal else 1)
                for spec in (s for s in variants if s.head_dim == hd and s.causal == causal):
                    kernel = get_kernel(spec, target)
                    dq_accum = dq_accum_workspace(spec, 1, batch, seqlen, heads, q.device)
                    args_ = (q, k, v, out, dout, lse, dlse, dq, dk, dv, dq_accum, lse_log2, dpsum, scale, 0)
                    ms = bench_ms(functools.partial(kernel, *args_))
                    mark = "yes" if spec == default else ""
                    print(
                        f"| {spec.name} | {mark} | {int(causal)} | {seqlen} | {ms:.3f} | {flops / ms / 1e9:.0f} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
