"""FP8 (e4m3) forward benchmark on a Hopper GPU (or a Blackwell one: the sm100 e4m3 kernels, not yet
hardware-tested): cutefa fp8 vs cutefa bf16 on the same problems,
and FlashAttention-3's fp8 forward (``flash_attn_interface``) when it is installed.

Grid as in tools/bench.py: batch x seqlen = 16384 tokens, heads x head_dim = 2048, random normal
inputs quantized per head. TFLOP/s counts 4*b*h*s^2*d, halved when causal. Each fp8 result is
checked against the float32 attention of the unquantized inputs (relative L2 error shown; e4m3
inputs give a few percent, see tests/gpu/test_fp8.py).

    python3 tools/bench_fp8.py                        # hd 64, 128, 256; seqlen 1k..16k; causal both
    python3 tools/bench_fp8.py --hdim 128 --seqlen 4096,8192 --causal 1
"""

import argparse
import importlib.util
import sys
from pathlib import Path

TOKENS = 16384
MODEL_DIM = 2048


def _load_bench():
    spec = importlib.util.spec_from_file_location("cutefa_tools_bench", Path(__file__).with_name("bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hdim", type=_ints, default=[64, 128, 256])
    p.add_argument("--seqlen", type=_ints, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", type=_ints, default=[0, 1])
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    args = p.parse_args(argv)

    import torch

    import cutefa

    try:
        from flash_attn_interface import flash_attn_func as fa3
    except ImportError:
        fa3 = None
    _, time_ms = _load_bench().make_timer(args.warmup, args.rep)
    header = [
        "hdim",
        "causal",
        "seqlen",
        "b x h",
        "bf16 TFLOP/s",
        "fp8 TFLOP/s",
        "fp8 rel err",
        "FA3 fp8 TFLOP/s",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for seqlen in args.seqlen:
                cells = _cell(torch, cutefa, fa3, time_ms, hdim, causal, seqlen)
                print("| " + " | ".join(cells) + " |", flush=True)
    return 0


def _cell(torch, cutefa, fa3, time_ms, hdim: int, causal: bool, seqlen: int) -> list[str]:
    heads = MODEL_DIM // hdim
    batch = max(1, TOKENS // seqlen)
    shape = (batch, seqlen, heads, hdim)
    q, k, v = (torch.randn(shape, device="cuda") for _ in range(3))
    flops = 4 * batch * heads * seqlen * seqlen * hdim / (2 if causal else 1)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    (qq, qd), (kq, kd), (vq, vd) = (cutefa.quantize_fp8(x, "head") for x in (q, k, v))
    kw = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    cells = [str(hdim), str(int(causal)), str(seqlen), f"{batch} x {heads}"]
    ms = time_ms(lambda: cutefa.flash_attn_func(qb, kb, vb, causal=causal))
    cells.append(f"{flops / ms / 1e9:.0f}")
    out = cutefa.flash_attn_func(qq, kq, vq, causal=causal, **kw)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal
    ).transpose(1, 2)  # float32; seqlen_q == seqlen_k, so top-left causal = bottom-right
    err = ((out.float() - ref).norm() / ref.norm()).item()
    ms = time_ms(lambda: cutefa.flash_attn_func(qq, kq, vq, causal=causal, **kw))
    cells += [f"{flops / ms / 1e9:.0f}", f"{err:.4f}"]
    if fa3 is None:
        return [*cells, "-"]
    try:
        ms = time_ms(lambda: fa3(qq, kq, vq, causal=causal, **kw))
    except Exception as exc:  # noqa: BLE001 - shown in the table
        return [*cells, f"err: {str(exc).splitlines()[0][:40]}"]
    return [*cells, f"{flops / ms / 1e9:.0f}"]


if __name__ == "__main__":
    sys.exit(main())
