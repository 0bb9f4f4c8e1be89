"""One cutefa attention call to profile with Nsight Compute, after an unprofiled warm-up.

The call runs between cudaProfilerStart/Stop, so ``ncu --profile-from-start off`` sees only its
kernels (not the inputs' random fill or the warm-up that loads the kernels):

    ncu --clock-control none --profile-from-start off \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \\
        python3 tools/ncu_profile.py --hdim 128 --seqlen 8192 --pass bwd

``--backend fa4`` / ``fa2`` profiles FlashAttention-4 / torch SDPA's FlashAttention-2 on the same
problem; ``--bwd-variant NAME`` forces cutefa's backward to one variant (an sm80 one on an sm90 GPU:
the FlashAttention-2 design beside FlashAttention-2 itself).

The problem has 16384 tokens per batch and 2048 hidden (heads = 2048 / hdim), like tools/bench.py.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--causal", type=int, choices=(0, 1), default=0)
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "e4m3"),
        default="bf16",
        help="e4m3: inputs quantized per head (cutefa.quantize_fp8), forward only",
    )
    p.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="fwd")
    p.add_argument(
        "--backend",
        choices=("cutefa", "fa4", "fa2"),
        default="cutefa",
        help="fa4: flash_attn.cute (FA4); fa2: torch SDPA's FlashAttention-2 backend",
    )
    p.add_argument(
        "--bwd-variant",
        metavar="NAME",
        help="cutefa's backward forced to this variant (e.g. an sm80 one on an sm90 GPU)",
    )
    args = p.parse_args(argv)

    import torch

    import cutefa

    if not torch.cuda.is_available():
        print("ncu_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    fp8 = args.dtype == "e4m3"
    if fp8 and (args.which != "fwd" or args.backend != "cutefa"):
        p.error("--dtype e4m3 profiles cutefa's forward only (FA4 has no fp8 on Hopper)")
    if args.bwd_variant and (args.which != "bwd" or args.backend != "cutefa"):
        p.error("--bwd-variant applies to cutefa's backward (--pass bwd --backend cutefa)")
    dtype = torch.bfloat16 if fp8 else {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    batch, heads = max(1, 16384 // args.seqlen), 2048 // args.hdim
    shape = (batch, args.seqlen, heads, args.hdim)
    grad = args.which == "bwd"
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(3))
    causal = bool(args.causal)
    kw = {}
    if fp8:
        (q, qd), (k, kd), (v, vd) = (cutefa.quantize_fp8(x, "head") for x in (q, k, v))
        kw = {"q_descale": qd, "k_descale": kd, "v_descale": vd}

    context = contextlib.nullcontext
    if args.backend == "fa4":
        from flash_attn.cute import flash_attn_func as attention
    elif args.backend == "fa2":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def attention(q, k, v, causal):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
            )
            return out.transpose(1, 2)

        context = functools.partial(sdpa_kernel, SDPBackend.FLASH_ATTENTION)
    else:
        attention = cutefa.flash_attn_func
        if args.bwd_variant:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from bench_backends import forced_bwd_variant

            context = functools.partial(forced_bwd_variant, args.bwd_variant)

    def run() -> None:
        out = attention(q, k, v, causal=causal, **kw)
        out = out[0] if isinstance(out, tuple) else out
        if grad:
            out.backward(torch.ones_like(out))

    with context():
        for _ in range(3):  # loads the kernels, fills the allocator
            run()
        torch.cuda.synchronize()
        what = {"fa4": "FA4", "fa2": "FA2 (SDPA flash)"}.get(args.backend)
        if what is None:
            what = args.bwd_variant or cutefa.explain(q, k, v, causal=causal).splitlines()[0]
        print(f"profiling {args.which} {shape} causal={causal} {args.dtype}: {what}")
        torch.cuda.profiler.start()
        run()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
