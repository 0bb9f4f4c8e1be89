"""Context parallelism through PyTorch's engine (``context_parallel``), attention forward+backward:
tokens/s and attention TFLOP/s per GPU on 2 GPUs, cutefa as SDPA's flash provider against the
engine on SDPA's own flash and cuDNN kernels, and the scaling against one GPU running the whole
sequence with the same kernels.

Run: ``torchrun --nproc-per-node 2 tools/bench_cp.py [--seqlens 65536 131072] [--plot cp.svg]``.
Rank 0 prints the table (one row per sequence length, mask and side) and writes the plot: an SVG
bar chart of TFLOP/s per GPU. Attention FLOPs count the matmuls, 4·b·h·s²·d forward and 2.5 times
that backward, halved for the causal mask; per GPU is the total over the GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

SIDES = ("cutefa", "flash", "cudnn")  # cutefa's provider; SDPA's own flash; SDPA's cuDNN kernel


def attention_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> float:
    """Forward + backward matmul FLOPs of the whole attention (3.5 forwards)."""
    forward = 4.0 * batch * heads * seqlen * seqlen * head_dim
    return 3.5 * forward * (0.5 if causal else 1.0)


@dataclass(frozen=True)
class Row:
    seqlen: int
    causal: bool
    side: str
    ms_cp: float  # fwd+bwd under context_parallel on `world` GPUs (NaN: did not run)
    ms_one: float  # fwd+bwd of the whole sequence on one GPU
    world: int
    flops: float

    @property
    def tokens_per_s(self) -> float:
        return self.seqlen / (self.ms_cp * 1e-3)

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops / (self.ms_cp * 1e-3) / self.world / 1e12

    @property
    def scaling(self) -> float:
        return self.ms_one / self.ms_cp


def format_table(rows: list[Row], notes: dict[tuple[int, bool, str], str]) -> str:
    head = f"{'seqlen':>7} {'mask':>6} {'side':>6} {'ms cp':>8} {'tok/s':>10} {'TF/s/GPU':>9} {'ms 1gpu':>8} {'scaling':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        note = notes.get((r.seqlen, r.causal, r.side))
        mask = "causal" if r.causal else "full"
        if note:
            lines.append(f"{r.seqlen:>7} {mask:>6} {r.side:>6} n/a ({note})")
            continue
        lines.append(
            f"{r.seqlen:>7} {mask:>6} {r.side:>6} {r.ms_cp:8.2f} {r.tokens_per_s:10.0f} "
            f"{r.tflops_per_gpu:9.1f} {r.ms_one:8.2f} {r.scaling:7.2f}x"
        )
    return "\n".join(lines)


def svg_bars(rows: list[Row], title: str) -> str:
    """A plain SVG bar chart of TFLOP/s per GPU, one group per (seqlen, mask), one bar per side."""
    groups = sorted({(r.seqlen, r.causal) for r in rows})
    colors = {"cutefa": "#1f77b4", "flash": "#ff7f0e", "cudnn": "#2ca02c"}
    values = [r.tflops_per_gpu for r in rows if r.ms_cp == r.ms_cp]
    top = max(values, default=1.0) * 1.1
    width, height, bar = 120 * len(groups) + 80, 320, 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
           f'<text x="10" y="20" font-size="14">{title}</text>']  # fmt: skip
    for g, (seqlen, causal) in enumerate(groups):
        x0 = 60 + 120 * g
        for s, side in enumerate(SIDES):
            row = next((r for r in rows if (r.seqlen, r.causal, r.side) == (seqlen, causal, side)), None)
            if row is None or row.ms_cp != row.ms_cp:
                continue
            h = 240 * row.tflops_per_gpu / top
            out.append(f'<rect x="{x0 + s * bar}" y="{280 - h:.1f}" width="{bar - 4}" height="{h:.1f}" '
                       f'fill="{colors[side]}"><title>{side} {row.tflops_per_gpu:.1f}</title></rect>')  # fmt: skip
        label = f"{seqlen // 1024}k {'causal' if causal else 'full'}"
        out.append(f'<text x="{x0}" y="300" font-size="11">{label}</text>')
    for s, side in enumerate(SIDES):
        out.append(
            f'<text x="{width - 70}" y="{40 + 16 * s}" font-size="11" fill="{colors[side]}">{side}</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


def _time_ms(fn, iters: int) -> float:
    import torch

    fn()  # warm-up (compiles and caches)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _side(side: str):
    """(enter, leave, backend) of a side: the provider active or not, SDPA's backend."""
    from torch.nn.attention import SDPBackend

    from cutefa import torch_sdpa as ts

    if side == "cutefa":
        return ts.activate, ts.deactivate, SDPBackend.FLASH_ATTENTION
    backend = SDPBackend.FLASH_ATTENTION if side == "flash" else SDPBackend.CUDNN_ATTENTION
    return (lambda: None), (lambda: None), backend


def _measure(mesh, full, causal: bool, side: str, iters: int, one_gpu: bool) -> tuple[float, float]:
    """(ms on one GPU for the whole sequence (NaN unless ``one_gpu``), ms under context_parallel)."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _cp_options,
        context_parallel,
    )
    from torch.nn.attention import sdpa_kernel

    enter, leave, backend = _side(side)

    def step(q, k, v, dout):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        out.backward(dout)

    enter()
    try:
        ms_one = _time_ms(lambda: step(*full), iters) if one_gpu else float("nan")
        _cp_options.enable_load_balance = causal  # PyTorch balances causal masks only
        buffers = [t.clone() for t in full]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
            ms_cp = _time_ms(lambda: step(*buffers), iters)
    finally:
        leave()
    return ms_one, ms_cp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--plot", default="bench_cp.svg", help="where rank 0 writes the SVG chart")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (world,))
    hq, hkv, d = args.heads[0], args.heads[1], args.head_dim
    rows, notes = [], {}
    for seqlen in args.seqlens:
        for causal in (True, False):
            gen = torch.Generator(device="cuda").manual_seed(seqlen)
            full = [torch.randn(1, seqlen, h, d, generator=gen, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                    for h in (hq, hkv, hkv, hq)]  # fmt: skip
            for side in args.sides:
                try:
                    ms_one, ms_cp = _measure(mesh, full, causal, side, args.iters, rank == 0)
                except (RuntimeError, NotImplementedError) as exc:  # a kernel that refuses the shape
                    ms_one = ms_cp = float("nan")
                    notes[(seqlen, causal, side)] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"
                times = torch.tensor([ms_cp], device="cuda")
                dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
                rows.append(
                    Row(
                        seqlen,
                        causal,
                        side,
                        times.item(),
                        ms_one,
                        world,
                        attention_flops(1, hq, seqlen, d, causal),
                    )
                )
            del full
            torch.cuda.empty_cache()
    if rank == 0:
        device = torch.cuda.get_device_name()
        print(f"context parallel, {world} x {device}, heads {hq}/{hkv}, head_dim {d}, bf16, fwd+bwd; "
              f"scaling = 1-GPU ms / {world}-GPU ms (ideal {world}x)")  # fmt: skip
        print(format_table(rows, notes))
        with open(args.plot, "w") as f:
            f.write(svg_bars(rows, f"attention TFLOP/s per GPU, {world} x {device}"))
        print(f"plot: {args.plot}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
