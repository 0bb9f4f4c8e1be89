"""Accuracy of e4m3 forward variants on long rows whose V carries a mean (Hopper GPU).

Hopper's e4m3 tensor cores add into the fp32 accumulator of P V with fewer mantissa bits than fp32,
so an O summed over many keys in one accumulator comes out low by a share that grows with the key
count where V's columns carry a mean (docs/log/perf-notes.md, "What the e4m3 tensor cores do to a long
O"). This script runs each named variant (called directly, no dispatch) on q, k unit normal and
v = MEAN + unit normal, quantized per head, and prints per key count the relative L2 error of the
output against the float32 attention of the unquantized inputs, its mean signed error relative to
mean |O| (the bias), and the same for the e4m3 emulation (exact accumulation, P rounded to e4m3):
the error the inputs' rounding alone gives. ``--center`` also runs each variant with V's mean per
(batch, head, column) taken out before quantization and added back to the output.

    python3 tools/fp8_accuracy.py --variants cutefa_sm90_fwd_e4m3_hd128_192x96_s2_w16_ov_hvt_lres_tlacc
    python3 tools/fp8_accuracy.py --variants NAME,NAME --seqlen 4096,16384 --center
"""

from __future__ import annotations

import argparse
import math


def _reference(q, k, v, causal, scale, p_e4m3):
    """float32 attention (b, s, h, d) on the GPU, one head at a time; with ``p_e4m3`` the e4m3
    emulation: P (times 2^8, against the row max) rounded to e4m3 for P V, row sums unrounded."""
    import torch

    out = torch.zeros(q.shape, device=q.device)
    sq, sk = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            s = (q[b, :, h] @ k[b, :, h // group].T) * scale
            if causal:
                rows = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
                s = s.masked_fill(torch.arange(sk, device=q.device)[None, :] > rows, -math.inf)
            m = s.amax(dim=-1, keepdim=True).clamp_min(-1e30)
            p = torch.exp(s - m)
            num = (p * 256.0).to(torch.float8_e4m3fn).float() / 256.0 if p_e4m3 else p
            out[b, :, h] = (num @ v[b, :, h // group]) / p.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return out


def _rel_l2(x, ref) -> float:
    return ((x - ref).norm() / ref.norm()).item()


def _bias(x, ref) -> float:
    return ((x - ref).mean() / ref.abs().mean()).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", required=True, help="e4m3 forward variant names, comma-separated")
    p.add_argument("--seqlen", default="1024,4096,16384", help="key counts (default 1024,4096,16384)")
    p.add_argument("--queries", type=int, default=2048, help="query rows, at most the key count (default 2048)")
    p.add_argument("--mean", type=float, default=1.0, help="V's mean (default 1)")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--center", action="store_true", help="also with V's mean taken out and added back")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch

    import cutefa
    from cutefa.dispatch import current_target
    from cutefa.loader import get_kernel
    from cutefa.model.spec import parse_name

    specs = [parse_name(n.strip()) for n in args.variants.split(",") if n.strip()]
    bad = [s.name for s in specs if s.dtype != "e4m3" or s.direction != "fwd"]
    if bad:
        p.error(f"not e4m3 forward variants: {', '.join(bad)}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed)
    print("| variant | causal | keys | queries | rel L2 | bias | emulation rel L2 |" + (" centered rel L2 |" if args.center else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if args.center else ""))
    for spec in specs:
        kernel = get_kernel(spec, current_target())
        d, heads = spec.head_dim, args.heads
        scale = 1.0 / math.sqrt(d)
        for sk in [int(x) for x in args.seqlen.split(",") if x.strip()]:
            sq = min(args.queries, sk)
            q = torch.randn(1, sq, heads, d, generator=gen, device="cuda")
            k = torch.randn(1, sk, heads, d, generator=gen, device="cuda")
            v = torch.randn(1, sk, heads, d, generator=gen, device="cuda") + args.mean
            exact = _reference(q, k, v, spec.causal, scale, p_e4m3=False)
            cells = []
            for centered in (False, True) if args.center else (False,):
                mu = v.mean(dim=1, keepdim=True) if centered else torch.zeros_like(v[:, :1])
                fp8s, descales = zip(*(cutefa.quantize_fp8(x, "head") for x in (q, k, v - mu)))
                descales = [x.reshape(1, heads).contiguous() for x in descales]
                out = torch.full((1, sq, heads, d), math.nan, dtype=torch.bfloat16, device="cuda")
                lse = torch.full((1, heads, sq), math.nan, device="cuda")
                if getattr(spec.options, "v_mean", False):  # the kernel adds the means (an sm90 option)
                    kernel(*fp8s, out, lse, *descales, mu[:, 0].contiguous(), scale)
                    o = out.float()
                else:
                    kernel(*fp8s, out, lse, *descales, scale)
                    o = out.float() + mu
                if torch.isnan(o).any():
                    raise SystemExit(f"{spec.name}: NaN in the output")
                if not centered:
                    dq = [cutefa.fp8.dequantize_fp8(x, s) for x, s in zip(fp8s, descales)]
                    emul = _reference(*dq, spec.causal, scale, p_e4m3=True)
                    cells += [f"{_rel_l2(o, exact):.4f}", f"{_bias(o, exact):+.4f}", f"{_rel_l2(emul, exact):.4f}"]
                else:
                    cells.append(f"{_rel_l2(o, exact):.4f}")
            print(f"| {spec.name} | {int(spec.causal)} | {sk} | {sq} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
