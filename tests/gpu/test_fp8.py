"""FP8 (e4m3) forward on a Hopper GPU (sm90 family) against a float32 reference of the UNQUANTIZED
inputs.

Tolerance. e4m3 keeps 3 mantissa bits: round-to-nearest makes a relative error of at most 2^-4
per element, about 2^-4/sqrt(3) = 3.6% RMS. The kernel quantizes q, k and v (given) and P (in
registers, scaled by 2^8 so that small probabilities stay normal), so its output differs from the
exact attention by a few percent (relative L2) on unit-variance inputs, with no fixed bound per
element. The yardstick is therefore an emulation in float32 torch of the same quantization steps
(dequantized q/k/v, P rounded to e4m3 against its row max, fp32 row sums): the kernel's relative L2
error must be at most 1.25x the emulation's plus 0.005, and the emulation's own error must stay
under 10% (the sum of the four operands' 3.6% RMS, generously). The log-sum-exp depends only on the
dequantized scores (row sums use unrounded P), so it must match the emulation's to 0.02. Rows that
attend no key must be exactly 0 with lse = -inf; outputs are poisoned with NaN beforehand, so an
element the kernel does not write fails.

The outlier test prints the error of per-tensor, per-head and Hadamard-rotated quantization on
inputs with outlier channels and checks that the rotation reduces it.

The variants' own options (V transposes, persistent scheduler, lazy rescale, row sums by WGMMA,
two-level accumulation, v_mean epilogue) are tested in test_fp8_variants.py, with the helpers here.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import all_variants, sm90_kernel_skip_reason
from gpu_support import load_sibling as _load

import cutefa
from cutefa import fp8
from cutefa.api import plans
from cutefa.model.options import Quant, RowSum

ref = _load("reference")


def _skip_reason() -> str | None:
    return sm90_kernel_skip_reason("fp8 forward")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

# Per-tensor/per-head descales; the block-quantization variants (_blockq): test_fp8_block_gpu.py.
FP8_VARIANTS = [
    s for s in all_variants("sm90", "fwd") if s.dtype == "e4m3" and s.options.quant is Quant.TENSOR
]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): partial tiles, sq != sk both ways, GQA, MQA.
SHAPES = (
    (1, 1, 1, 2, 2),
    (2, 17, 17, 4, 2),
    (1, 1000, 1000, 3, 3),
    (1, 4097, 4097, 2, 1),
    (2, 17, 1000, 4, 2),
    (1, 1000, 17, 8, 1),
    (1, 128, 4097, 4, 4),
)
EMULATION_FACTOR = 1.25
EMULATION_FLOOR = 0.005
EMULATION_MAX_ERROR = 0.10
LSE_TOL = 0.02
# RowSum.MMA variants sum the e4m3-rounded P that the P V product uses (the emulation sums P unrounded):
# each rounded probability is within 2^-4 of its value (3 mantissa bits, round to nearest), so the
# row sums are too, and the lse moves by up to log(1 + 2^-4) more.
SUM_MMA_LSE_TOL = LSE_TOL + math.log1p(2.0**-4)


def make_inputs(gen, batch, sq, sk, hq, hkv, d, head_scales=True):
    """Unit-variance q/k/v; k and v heads scaled differently so per-head descales differ."""
    q = torch.randn(batch, sq, hq, d, generator=gen, device="cuda")
    k = torch.randn(batch, sk, hkv, d, generator=gen, device="cuda")
    v = torch.randn(batch, sk, hkv, d, generator=gen, device="cuda")
    if head_scales:
        scales = torch.linspace(0.5, 2.0, hkv, device="cuda")[None, None, :, None]
        k, v = k * scales, v * scales.flip(2)
    return q, k, v


def quantize(q, k, v, granularity="head", hadamard=False):
    group = q.shape[2] // k.shape[2]
    qq, qd = cutefa.quantize_fp8(q, granularity, hadamard, group=group if granularity == "head" else 1)
    kq, kd = cutefa.quantize_fp8(k, granularity, hadamard)
    vq, vd = cutefa.quantize_fp8(v, granularity)  # v is never rotated
    return (qq, kq, vq), (qd, kd, vd)


def fp8_kernel(spec):
    """The compiled e4m3 kernel of ``spec``, called as (q, k, v, out, lse, q_descale, k_descale,
    v_descale, scale) (a persistent one's ``fn`` also as that plus the grid); a variant with the
    v_mean option is given zero column means there, so that it computes what its twin without the
    option does (test_fp8_variants.py's test_v_mean_variant_adds_the_means gives it others)."""
    from cutefa.dispatch import current_target
    from cutefa.loader import get_kernel

    kernel = get_kernel(spec, current_target())
    return _WithZeroMeans(kernel) if spec.options.v_mean else kernel


class _WithZeroMeans:
    def __init__(self, kernel):
        self.kernel = kernel

    @staticmethod
    def _args(q, k, v, out, lse, q_descale, k_descale, v_descale, scale, *grid):
        zeros = torch.zeros(v.shape[0], v.shape[2], v.shape[3], device=v.device)
        return (q, k, v, out, lse, q_descale, k_descale, v_descale, zeros, scale, *grid)

    def __call__(self, *args):
        return self.kernel(*self._args(*args))

    def fn(self, *args):
        return self.kernel.fn(*self._args(*args))


def kv_head_descales(descales, batch, heads_kv):
    return tuple(
        d.reshape(1, 1).expand(batch, heads_kv).contiguous() if d.dim() == 0 else d for d in descales
    )


def emulate(fp8s, descales, *, causal, scale):
    """What the kernel computes, in float32 torch: dequantized inputs, P rounded to e4m3 (times
    2^8) against the final row max, unrounded row sums. Returns (out, lse)."""
    q, k, v = (fp8.dequantize_fp8(x, d) for x, d in zip(fp8s, descales))
    return emulate_dequantized(q, k, v, causal=causal, scale=scale)


def emulate_dequantized(q, k, v, *, causal, scale, p_ratio=None):
    """:func:`emulate` from the dequantized q, k and v. P is rounded to e4m3 as P * r * 2^8, where r
    is 1 or, given ``p_ratio`` (batch, heads_kv, seqlen_k), its value for the key (the block
    kernels' ratio of v's block descale to its largest). Returns (out, lse)."""
    from cutefa.kernels.sm90.fp8_softmax import P_OFFSET_LOG2  # the kernel's shift of P (imports the DSL)

    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    out = torch.zeros(batch, seqlen_q, heads_q, head_dim, device=q.device)
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf, device=q.device)
    if seqlen_q == 0 or seqlen_k == 0:
        return out, lse
    for blk in ref.blocks(q, k):
        s = (q[blk.batch, blk.row0 : blk.row1, blk.head_q] @ k[blk.batch, :, blk.head_kv].T) * scale
        if causal:
            rows = torch.arange(blk.row0, blk.row1, device=q.device)
            s = s.masked_fill(~ref.causal_allowed(rows, seqlen_q, seqlen_k), -math.inf)
        m = s.amax(dim=-1)
        empty = torch.isneginf(m)
        m = torch.where(empty, torch.zeros_like(m), m)
        p = torch.exp(s - m[:, None])
        shift = 2.0**P_OFFSET_LOG2
        if p_ratio is not None:
            shift = p_ratio[blk.batch, blk.head_kv][None, :] * shift
        p_q = (p * shift).to(torch.float8_e4m3fn).float() / shift
        denom = p.sum(dim=-1)
        o = (p_q @ v[blk.batch, :, blk.head_kv]) / torch.where(empty, torch.ones_like(denom), denom)[:, None]
        out[blk.batch, blk.row0 : blk.row1, blk.head_q] = torch.where(empty[:, None], torch.zeros_like(o), o)
        lse[blk.batch, blk.head_q, blk.row0 : blk.row1] = torch.where(
            empty, torch.full_like(denom, -math.inf), m + torch.log(denom)
        )
    return out, lse


def check_out(out, lse, exact, emul, *, what):
    """out and lse hold no NaN (every element written), and out's relative L2 error against
    ``exact`` is at most EMULATION_FACTOR times the emulation's plus EMULATION_FLOOR, the
    emulation's own at most EMULATION_MAX_ERROR."""
    assert not torch.isnan(out).any(), f"{what}: NaN in out (an element was not written)"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    err = ref.rel_l2(out.float(), exact)
    err_emul = ref.rel_l2(emul, exact)
    assert err_emul <= EMULATION_MAX_ERROR, f"{what}: the e4m3 emulation itself is off by {err_emul:.4f}"
    bound = EMULATION_FACTOR * err_emul + EMULATION_FLOOR
    assert err <= bound, f"{what}: rel L2 {err:.4f} > {bound:.4f} (emulation {err_emul:.4f})"


def check(out, lse, exact, exact_lse, emul, emul_lse, *, what, lse_tol=LSE_TOL):
    """:func:`check_out`, and lse finite where the emulation's is (whose own is finite where the
    reference's is), and there within ``lse_tol`` of the emulation's."""
    check_out(out, lse, exact, emul, what=what)
    finite = torch.isfinite(emul_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: lse finite where the reference is not"
    lse_err = ref.max_abs(lse[finite], emul_lse[finite])
    assert lse_err <= lse_tol, f"{what}: lse off by {lse_err:.4g}"
    exact_finite = torch.isfinite(exact_lse)
    assert torch.equal(finite, exact_finite), f"{what}: the emulation masks other rows than the reference"


@pytest.mark.parametrize("spec", FP8_VARIANTS, ids=lambda s: s.name)
def test_variant(gen, spec):
    """Each committed e4m3 kernel, called directly on NaN-poisoned outputs, on every shape."""

    kernel = fp8_kernel(spec)
    scale = ref.default_scale(spec.head_dim)
    for batch, sq, sk, hq, hkv in SHAPES:
        q, k, v = make_inputs(gen, batch, sq, sk, hq, hkv, spec.head_dim)
        fp8s, descales = quantize(q, k, v)
        out = torch.full((batch, sq, hq, spec.head_dim), math.nan, dtype=torch.bfloat16, device="cuda")
        lse = torch.full((batch, hq, sq), math.nan, device="cuda")
        kernel(*fp8s, out, lse, *kv_head_descales(descales, batch, hkv), scale)
        exact, exact_lse = ref.attention_ref(q, k, v, causal=spec.causal)
        emul, emul_lse = emulate(fp8s, descales, causal=spec.causal, scale=scale)
        lse_tol = SUM_MMA_LSE_TOL if spec.options.row_sum is RowSum.MMA else LSE_TOL
        check(
            out,
            lse,
            exact,
            exact_lse,
            emul,
            emul_lse,
            what=f"{spec.name} {(batch, sq, sk, hq, hkv)}",
            lse_tol=lse_tol,
        )
        if spec.causal and sq > sk:
            rows = sq - sk
            assert torch.all(out[:, :rows] == 0) and torch.all(torch.isneginf(lse[:, :, :rows]))


@pytest.mark.parametrize("head_dim", sorted({s.head_dim for s in FP8_VARIANTS}))
@pytest.mark.parametrize("causal", [False, True])
def test_v_mean_on_long_rows(gen, head_dim, causal):
    """V with a mean (v = 1 + unit noise) through flash_attn_func at 16k keys, centered with
    cutefa.center_v and its mean passed as v_mean: within the e4m3 emulation's error (check_out) of
    the float32 attention of the unquantized inputs, whatever kernel dispatch runs (without the
    mean taken out, those without two-level accumulation are off by ~13% here); rows that attend
    no key (causal, more queries than keys) stay 0 with lse -inf."""
    for batch, sq, sk, hq, hkv in ((1, 2048, 16384, 4, 2), (1, 300, 200, 2, 2)):
        q, k, v = make_inputs(gen, batch, sq, sk, hq, hkv, head_dim)
        v = v + 1.0
        centered, v_mean = cutefa.center_v(v)
        fp8s, descales = quantize(q, k, centered)
        out, lse = cutefa.flash_attn_func(
            *fp8s, causal=causal, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
            v_mean=v_mean, return_lse=True,
        )  # fmt: skip
        exact, _ = ref.attention_ref(q, k, v, causal=causal)
        emul, _ = emulate(fp8s, descales, causal=causal, scale=ref.default_scale(head_dim))
        emul = fp8.add_v_mean(emul, v_mean, sk, causal)
        what = f"v_mean hd{head_dim} {(batch, sq, sk, hq, hkv)} causal {causal}"
        check_out(out, lse, exact, emul, what=what)
        if causal and sq > sk:
            assert torch.all(out[:, : sq - sk] == 0) and torch.all(torch.isneginf(lse[:, :, : sq - sk])), what


@pytest.mark.parametrize("head_dim", sorted({s.head_dim for s in FP8_VARIANTS}))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_api(gen, head_dim, causal, granularity):
    """flash_attn_func with e4m3 inputs: dispatch picks the e4m3 variant; per-tensor descales are
    broadcast; GQA with q's descale per kv head."""
    batch, sq, sk, hq, hkv = 2, 300, 777, 6, 2
    q, k, v = make_inputs(gen, batch, sq, sk, hq, hkv, head_dim)
    fp8s, descales = quantize(q, k, v, granularity)
    out, lse = cutefa.flash_attn_func(
        *fp8s, causal=causal, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
        return_lse=True,
    )  # fmt: skip
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    exact, exact_lse = ref.attention_ref(q, k, v, causal=causal)
    emul, emul_lse = emulate(fp8s, descales, causal=causal, scale=ref.default_scale(head_dim))
    check(out, lse, exact, exact_lse, emul, emul_lse, what=f"api hd{head_dim} {granularity}")
    # The same call again takes its plan (no validation or dispatch): the same result, bitwise,
    # on new NaN-poisoned outputs; new descale values of the same kind go through the plan too.
    plans.clear_plans()
    kwargs = {"causal": causal, "q_descale": descales[0], "k_descale": descales[1], "return_lse": True}
    first = cutefa.flash_attn_func(*fp8s, v_descale=descales[2], **kwargs)
    assert len(plans._FP8_PLANS) == 1
    again = cutefa.flash_attn_func(*fp8s, v_descale=descales[2], **kwargs)
    for a, b in zip(first, again):
        assert a.data_ptr() != b.data_ptr() and torch.equal(a, b), f"api hd{head_dim} {granularity} plan"
    doubled, _ = cutefa.flash_attn_func(*fp8s, v_descale=2 * descales[2], **kwargs)
    assert len(plans._FP8_PLANS) == 1
    torch.testing.assert_close(doubled.float(), 2 * first[0].float(), rtol=1e-2, atol=1e-2)


def test_backward_is_refused(gen):
    q, k, v = make_inputs(gen, 1, 64, 64, 2, 2, 128)
    fp8s, descales = quantize(q, k, v)
    qd = descales[0].clone().requires_grad_()
    out = cutefa.flash_attn_func(*fp8s, q_descale=qd, k_descale=descales[1], v_descale=descales[2])
    with pytest.raises(NotImplementedError, match="no backward for the fp8"):
        out.float().sum().backward()


def outlier_inputs(gen, batch=2, seqlen=1024, heads=4, head_dim=128):
    """q and k with three channels 30x larger than the rest, as trained models show."""
    q, k, v = make_inputs(gen, batch, seqlen, seqlen, heads, heads, head_dim, head_scales=False)
    boost = torch.ones(head_dim, device="cuda")
    boost[[5, 61, 100]] = 30.0
    return q * boost * 0.2, k * boost * 0.2, v


def test_outlier_channels_hadamard_reduces_error(gen):
    q, k, v = outlier_inputs(gen)
    exact, _ = ref.attention_ref(q, k, v)
    errors = {}
    for name, granularity, hadamard in (
        ("per-tensor", "tensor", False),
        ("per-head", "head", False),
        ("hadamard", "tensor", True),
        ("hadamard+per-head", "head", True),
    ):
        fp8s, descales = quantize(q, k, v, granularity, hadamard)
        out = cutefa.flash_attn_func(
            *fp8s, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2]
        )
        errors[name] = ref.rel_l2(out.float(), exact)
    print("fp8 relative L2 error on outlier channels:", {n: f"{e:.4f}" for n, e in errors.items()})
    assert errors["hadamard"] < errors["per-tensor"]
    assert errors["hadamard+per-head"] < errors["per-head"]
