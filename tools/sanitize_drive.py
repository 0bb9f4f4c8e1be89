"""The driver that tools/sanitize.py runs under the sanitizer (``sanitize.py --drive PAYLOAD``): one
process launching one dense kernel variant (or, through tools/sanitize_features.py, a feature or
decode one) on its cases, optionally judging the outputs against the float32 reference."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # sanitize_features, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

import sanitize_features

DRIVER_WRONG = 3  # the driver's exit status when an output failed its check


def drive(payload: dict) -> int:
    """Launch ``payload["spec"]``'s kernel (its causal twin for causal cases) on every case; with
    ``check`` judge the outputs against the float32 reference. 0, or DRIVER_WRONG when a case's
    outputs failed."""
    import math

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_check

    from cutefa.api import backward
    from cutefa.api.fp8 import takes_v_mean
    from cutefa.dispatch import current_target
    from cutefa.fp8 import dequantize_fp8, quantize_fp8
    from cutefa.loader import get_kernel
    from cutefa.model.spec import parse_name

    base = parse_name(payload["spec"])
    if base.features.any or base.mask.name == "LOCAL":
        return sanitize_features.drive(payload, DRIVER_WRONG)
    target = current_target()
    gen = torch.Generator(device="cuda").manual_seed(0)
    wrong = 0
    for batch, sq, sk, hq, hkv, causal in payload["cases"]:
        spec = base.replace(causal=bool(causal))
        d = spec.head_dim
        scale = 1.0 / math.sqrt(d)

        def rand(*shape):
            return torch.randn(*shape, generator=gen, device="cuda")

        q, k, v = rand(batch, sq, hq, d), rand(batch, sk, hkv, d), rand(batch, sk, hkv, d)
        poison = bench_check.poisoned_allocations("cuda") if payload["poison"] else _nothing()
        if spec.direction == "bwd":
            q, k, v = (x.bfloat16() for x in (q, k, v))
            dout = rand(batch, sq, hq, d).bfloat16()
            out, lse = _forward_reference(bench_check, q, k, v, causal, scale)
            with poison:
                outputs = backward.gradients(
                    dout, q, k, v, out, lse, None, bool(causal), scale, False, spec=spec
                )
            expect = {"q": q, "k": k, "v": v, "dout": dout} if payload["check"] else None
        else:
            kernel = get_kernel(spec, target)
            if spec.dtype == "e4m3":
                quant = [
                    quantize_fp8(q, "head", group=hq // hkv),
                    quantize_fp8(k, "head"),
                    quantize_fp8(v, "head"),
                ]
                inputs, extra = tuple(x for x, _ in quant), tuple(s for _, s in quant)
                if takes_v_mean(spec):
                    extra = (*extra, torch.zeros(batch, hkv, d, device="cuda"))
                ref_inputs = [dequantize_fp8(x, s) for x, s in quant]
            else:
                inputs, extra = tuple(x.bfloat16() for x in (q, k, v)), ()
                ref_inputs = list(inputs)
            with poison:
                out = torch.empty(batch, sq, hq, d, dtype=torch.bfloat16, device="cuda")
                lse = torch.empty(batch, hq, sq, device="cuda")
            kernel(*inputs, out, lse, *extra, scale)
            outputs = (out, lse)
            expect = dict(zip("qkv", ref_inputs)) if payload["check"] else None
        torch.cuda.synchronize()
        label = f"{spec.name} b={batch} sq={sq} sk={sk} hq={hq} hkv={hkv} causal={int(causal)}"
        if expect is None:
            print(f"{label}: launched", flush=True)
            continue
        low = (
            {"low_dtype": torch.float32, "p_round": bench_check.round_e4m3, "score_eps": bench_check.E4M3_SCORE_EPS}
            if spec.dtype == "e4m3"
            else {}
        )
        verdict = bench_check.expectation(
            expect["q"], expect["k"], expect["v"], causal=bool(causal), scale=scale, dout=expect.get("dout"),
            slices=batch * (hq if spec.direction == "fwd" else hkv), out_dtype=torch.bfloat16, **low,
        ).judge(outputs)  # fmt: skip
        print(f"{label}: {'ok' if verdict.ok else 'WRONG: ' + verdict.message}", flush=True)
        wrong += not verdict.ok
    return DRIVER_WRONG if wrong else 0


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _forward_reference(bench_check, q, k, v, causal: bool, scale: float):
    """(out bf16, lse float32) of float32 attention, for the backward's inputs."""
    import torch

    batch, sq, hq, _ = q.shape
    group = hq // k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, hq, sq, device=q.device)
    with bench_check.exact_matmuls():
        for b in range(batch):
            for h in range(hq):
                r = bench_check.attend(q[b, :, h : h + 1].transpose(0, 1), k[b, :, h // group], v[b, :, h // group],
                                       causal=bool(causal), scale=scale)  # fmt: skip
                out[b, :, h] = r["O"][0].to(q.dtype)
                lse[b, h] = r["LSE"][0]
    return out, lse
