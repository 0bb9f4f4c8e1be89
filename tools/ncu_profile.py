"""One cutefa attention call to profile with Nsight Compute, after an unprofiled warm-up.

The call runs between cudaProfilerStart/Stop, so ``ncu --profile-from-start off`` sees only its
kernels (not the inputs' random fill or the warm-up that loads the kernels):

    ncu --clock-control none --profile-from-start off \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \\
        python3 tools/ncu_profile.py --hdim 128 --seqlen 8192 --pass bwd

The problem has 16384 tokens per batch and 2048 hidden (heads = 2048 / hdim), like tools/bench.py.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--causal", type=int, choices=(0, 1), default=0)
    p.add_argument("--dtype", choices=("bf16", "fp16", "e4m3"), default="bf16",
                   help="e4m3: inputs quantized per head (cutefa.quantize_fp8), forward only")
    p.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="fwd")
    p.add_argument("--backend", choices=("cutefa", "fa4"), default="cutefa", help="fa4: flash_attn.cute (FA4)")
    args = p.parse_args(argv)

    import torch

    import cutefa

    if not torch.cuda.is_available():
        print("ncu_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    fp8 = args.dtype == "e4m3"
    if fp8 and (args.which != "fwd" or args.backend != "cutefa"):
        p.error("--dtype e4m3 profiles cutefa's forward only (FA4 has no fp8 on Hopper)")
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

    if args.backend == "fa4":
        from flash_attn.cute import flash_attn_func as attention
    else:
        attention = cutefa.flash_attn_func

    def run() -> None:
        out = attention(q, k, v, causal=causal, **kw)
        out = out[0] if isinstance(out, tuple) else out
        if grad:
            out.backward(torch.ones_like(out))

    for _ in range(3):  # loads the kernels, fills the allocator
        run()
    torch.cuda.synchronize()
    what = cutefa.explain(q, k, v, causal=causal).splitlines()[0] if args.backend == "cutefa" else "FA4"
    print(f"profiling {args.which} {shape} causal={causal} {args.dtype}: {what}")
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
