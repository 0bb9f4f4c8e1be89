"""FP8 (e4m3) forward of the sm100 family (tcgen05 kind::f8f6f4, P in TMEM) on a Blackwell GPU,
against a float32 reference of the UNQUANTIZED inputs.

These kernels are compiled and SASS-checked on the CPU only; this file is their first run. It skips
unless the current GPU runs the sm100 family (cc 10.0 / 10.3). The yardstick and tolerances are the
sm90 fp8 tests' (tests/gpu/test_fp8.py: a float32 emulation of the same quantization steps, P
scaled by 2^8 before rounding to e4m3, fp32 row sums; outputs poisoned with NaN first), which apply
because the sm100 kernels shift P by the same 2^8 (checked below) and raise the running max whenever
it grows, as the sm90 kernel does.

Run on a B200: ``python -m pytest -q tests/gpu/test_fp8_sm100.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import load_sibling as _load

import cutefa
from cutefa import dispatch, fp8
from cutefa.model.committed import default_variants

fp8t = _load("test_fp8")
ref = fp8t.ref


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False"
    if torch.cuda.get_device_capability() not in ((10, 0), (10, 3)):
        return f"the sm100 fp8 forward needs a cc 10.0/10.3 GPU; this one is {torch.cuda.get_device_capability()}"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

FP8_VARIANTS = [s for s in default_variants("sm100", "fwd") if s.dtype == "e4m3"]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): partial tiles, two Q tiles where the second is
# past the end, sq != sk both ways (causal rows that see no key), GQA, MQA, long key ranges.
SHAPES = (
    (1, 1, 1, 2, 2),
    (2, 17, 17, 4, 2),
    (1, 129, 129, 2, 2),
    (1, 1000, 1000, 3, 3),
    (1, 4097, 4097, 2, 1),
    (2, 17, 1000, 4, 2),
    (1, 1000, 17, 8, 1),
    (1, 128, 4097, 4, 4),
)


def test_the_emulation_applies():
    """The sm90 tests' emulation rounds P * 2^P_OFFSET_LOG2; the sm100 kernels shift P the same."""
    from cutefa.compile import load_kernel_module
    from cutefa.kernels.sm90.fp8_softmax import P_OFFSET_LOG2

    for spec in FP8_VARIANTS:
        module = load_kernel_module(spec)
        assert module.P_SHIFT_LOG2 == P_OFFSET_LOG2, spec.name
        assert module.RESCALE_THRESHOLD == 0.0, spec.name  # P never exceeds 2^8 (e4m3 max 448)


@pytest.mark.parametrize("spec", FP8_VARIANTS, ids=lambda s: s.name)
def test_variant(gen, spec):
    """Each committed sm100 e4m3 kernel, called directly on NaN-poisoned outputs, on every shape."""
    from cutefa.loader import get_kernel

    kernel = get_kernel(spec, dispatch.current_target())
    scale = ref.default_scale(spec.head_dim)
    for batch, sq, sk, hq, hkv in SHAPES:
        q, k, v = fp8t.make_inputs(gen, batch, sq, sk, hq, hkv, spec.head_dim)
        fp8s, descales = fp8t.quantize(q, k, v)
        out = torch.full((batch, sq, hq, spec.head_dim), math.nan, dtype=torch.bfloat16, device="cuda")
        lse = torch.full((batch, hq, sq), math.nan, device="cuda")
        kernel(*fp8s, out, lse, *fp8t.kv_head_descales(descales, batch, hkv), scale)
        torch.cuda.synchronize()
        exact, exact_lse = ref.attention_ref(q, k, v, causal=spec.causal)
        emul, emul_lse = fp8t.emulate(fp8s, descales, causal=spec.causal, scale=scale)
        fp8t.check(out, lse, exact, exact_lse, emul, emul_lse, what=f"{spec.name} {(batch, sq, sk, hq, hkv)}")
        if spec.causal and sq > sk:
            rows = sq - sk
            assert torch.all(out[:, :rows] == 0) and torch.all(torch.isneginf(lse[:, :, :rows]))


@pytest.mark.parametrize("head_dim", sorted({s.head_dim for s in FP8_VARIANTS}))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_api(gen, head_dim, causal, granularity):
    """flash_attn_func with e4m3 inputs on a Blackwell GPU: dispatch picks the sm100 e4m3 variant."""
    batch, sq, sk, hq, hkv = 2, 300, 777, 6, 2
    q, k, v = fp8t.make_inputs(gen, batch, sq, sk, hq, hkv, head_dim)
    fp8s, descales = fp8t.quantize(q, k, v, granularity)
    choice = dispatch.choose(
        target=dispatch.current_target(), dtype=torch.float8_e4m3fn, head_dim=head_dim, causal=causal,
        seqlen_q=sq, seqlen_k=sk, batch=batch, heads_q=hq, heads_kv=hkv,
    )  # fmt: skip
    assert (choice.spec.arch, choice.spec.dtype) == ("sm100", "e4m3"), choice.spec.name
    out, lse = cutefa.flash_attn_func(
        *fp8s, causal=causal, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
        return_lse=True,
    )  # fmt: skip
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    exact, exact_lse = ref.attention_ref(q, k, v, causal=causal)
    emul, emul_lse = fp8t.emulate(fp8s, descales, causal=causal, scale=ref.default_scale(head_dim))
    fp8t.check(out, lse, exact, exact_lse, emul, emul_lse, what=f"api hd{head_dim} {granularity}")


def test_against_the_bf16_kernel(gen):
    """The e4m3 kernel and the sm100 bf16 kernel on the same dequantized inputs agree to e4m3
    rounding of P (a few percent relative L2), and their LSEs to 0.02."""
    from cutefa.loader import get_kernel

    spec = next(s for s in FP8_VARIANTS if s.head_dim == 128 and s.causal)
    twin = spec.replace(dtype="bf16")
    assert twin in default_variants("sm100", "fwd")
    target = dispatch.current_target()
    batch, sq, sk, hq, hkv = 2, 1000, 1000, 4, 2
    q, k, v = fp8t.make_inputs(gen, batch, sq, sk, hq, hkv, 128)
    fp8s, descales = fp8t.quantize(q, k, v)
    scale = ref.default_scale(128)
    out = torch.empty(batch, sq, hq, 128, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(batch, hq, sq, device="cuda")
    get_kernel(spec, target)(*fp8s, out, lse, *fp8t.kv_head_descales(descales, batch, hkv), scale)
    deq = [fp8.dequantize_fp8(x, d).to(torch.bfloat16).contiguous() for x, d in zip(fp8s, descales)]
    out16 = torch.empty_like(out)
    lse16 = torch.empty_like(lse)
    get_kernel(twin, target)(*deq, out16, lse16, scale)
    torch.cuda.synchronize()
    assert ref.rel_l2(out.float(), out16.float()) < 0.06
    assert ref.max_abs(lse, lse16) < 0.02
