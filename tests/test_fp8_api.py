"""The fp8 API on the CPU: quantize_fp8 (granularities, Hadamard rotation, errors) and the fp8
route of flash_attn_func (validation, descale handling, forward-only autograd) with the kernel
launch replaced by a float32 reference of the dequantized problem. Block quantization:
tests/test_fp8_block.py."""

from __future__ import annotations

import math

import pytest
import torch
from cpu_support import pretend_h200, rand, reference, trace_attention_block
from torch._subclasses.fake_tensor import FakeTensorMode

import cutefa
from cutefa import dispatch, fp8
from cutefa.api import descales as descales_api
from cutefa.api import fp8 as fp8_api
from cutefa.api import launch, plans, validate
from cutefa.model.options import OAccum

E4M3_EPS = 2.0**-3  # e4m3 has 3 mantissa bits: relative spacing 2^-3, rounding error <= 2^-4


# ---------------------------------------------------------------------------------------------
# quantize_fp8


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_round_trip_error_is_within_e4m3_rounding(granularity):
    x = rand(2, 33, 4, 64) * torch.tensor([1.0, 10.0, 0.1, 3.0])[None, None, :, None]
    q, descale = cutefa.quantize_fp8(x, granularity)
    assert q.dtype == torch.float8_e4m3fn and descale.dtype == torch.float32
    assert descale.shape == (() if granularity == "tensor" else (2, 4))
    back = fp8.dequantize_fp8(q, descale)
    scale = descale if granularity == "tensor" else descale[:, None, :, None]
    # normal e4m3 numbers round to within half a spacing; below 2^-6 (subnormal) the step is 2^-9
    bound = x.abs() * E4M3_EPS / 2 + scale * 2.0**-10
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    # each group's largest magnitude maps to the largest e4m3 value
    amax = q.float().abs().amax() if granularity == "tensor" else q.float().abs().amax(dim=(1, 3))
    assert torch.all(amax == fp8.E4M3_MAX)


def test_head_granularity_with_groups_gives_kv_head_descales():
    x = rand(2, 8, 8, 64)
    _, descale = cutefa.quantize_fp8(x, "head", group=4)
    assert descale.shape == (2, 2)
    expected = x.reshape(2, 8, 2, 4 * 64).abs().amax(dim=(1, 3)) / fp8.E4M3_MAX
    torch.testing.assert_close(descale, expected)


def test_zero_input_gets_descale_one():
    q, descale = cutefa.quantize_fp8(torch.zeros(1, 4, 2, 64), "head")
    assert torch.all(descale == 1.0) and torch.all(q.float() == 0)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_hadamard_matrix_is_orthogonal_and_seeded(head_dim):
    m = fp8.hadamard_matrix(head_dim, seed=3)
    torch.testing.assert_close(m @ m.T, torch.eye(head_dim), atol=1e-6, rtol=0)
    assert torch.equal(m, fp8.hadamard_matrix(head_dim, seed=3))
    assert not torch.equal(m, fp8.hadamard_matrix(head_dim, seed=4))
    # every entry has the same magnitude within its Hadamard block: energy spreads evenly
    block = head_dim & -head_dim
    assert torch.allclose(m.abs()[m != 0], torch.tensor(block**-0.5))


def test_hadamard_keeps_scores():
    q, k = rand(1, 16, 2, 128, seed=1), rand(1, 16, 2, 128, seed=2)
    m = fp8.hadamard_matrix(128, seed=7)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    torch.testing.assert_close(torch.einsum("bqhd,bkhd->bhqk", q @ m, k @ m), s, atol=1e-4, rtol=1e-4)


def outlier_qk(seed=0):
    """q and k with a few channels 50x larger than the rest (the outliers of trained models)."""
    q, k = rand(2, 64, 4, 128, seed=seed), rand(2, 64, 4, 128, seed=seed + 1)
    boost = torch.ones(128)
    boost[[3, 77, 100]] = 50.0
    return q * boost, k * boost


def score_error(granularity, hadamard):
    q, k = outlier_qk()
    qq, qd = cutefa.quantize_fp8(q, granularity, hadamard, seed=5)
    kq, kd = cutefa.quantize_fp8(k, granularity, hadamard, seed=5)
    rotated = fp8.hadamard_matrix(128, seed=5) if hadamard else torch.eye(128)
    exact = torch.einsum("bqhd,bkhd->bhqk", q @ rotated, k @ rotated)
    approx = torch.einsum("bqhd,bkhd->bhqk", fp8.dequantize_fp8(qq, qd), fp8.dequantize_fp8(kq, kd))
    return ((approx - exact).norm() / exact.norm()).item()


def test_hadamard_reduces_score_error_on_outlier_channels():
    errors = {(g, h): score_error(g, h) for g in ("tensor", "head") for h in (False, True)}
    print(
        "relative Q K^T error:",
        {f"{g}{'+hadamard' if h else ''}": f"{e:.4f}" for (g, h), e in errors.items()},
    )
    assert errors[("tensor", True)] < errors[("tensor", False)]
    assert errors[("head", True)] < errors[("head", False)]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: cutefa.quantize_fp8([1.0]), TypeError, "x must be a torch.Tensor; got list"),
        (
            lambda: cutefa.quantize_fp8(torch.ones(1, 2, 2, 64, dtype=torch.int32)),
            TypeError,
            "got dtype torch.int32",
        ),
        (lambda: cutefa.quantize_fp8(torch.ones(2, 2, 64)), ValueError, "x must be 4-D"),
        (
            lambda: cutefa.quantize_fp8(torch.ones(1, 2, 2, 64), "row"),
            ValueError,
            "granularity='row' is not one of",
        ),
        (
            lambda: cutefa.quantize_fp8(torch.ones(1, 2, 2, 64), "block"),
            ValueError,
            "granularity='block' needs block=",
        ),
        (
            lambda: cutefa.quantize_fp8(torch.ones(1, 2, 2, 64), hadamard=1),
            TypeError,
            "hadamard must be a bool",
        ),
        (
            lambda: cutefa.quantize_fp8(torch.ones(1, 2, 6, 64), "head", group=4),
            ValueError,
            "group=4 must be a positive",
        ),
        (
            lambda: cutefa.quantize_fp8(torch.ones(1, 2, 4, 64), group=2),
            ValueError,
            "applies to granularity 'head'",
        ),
        (lambda: fp8.hadamard_matrix(0), ValueError, "head_dim must be a positive int"),
    ],
)
def test_quantize_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# flash_attn_func with fp8 inputs


class _Calls(list):
    def __init__(self) -> None:
        super().__init__()
        self.centered: list[bool] = []


@pytest.fixture
def on_cpu(monkeypatch):
    """Accept CPU tensors; the fp8 launch computes the dequantized reference (plus v_mean on the
    rows that attend a key, as the kernels do). Records calls (the descales of each;
    ``calls.centered``: whether each was given a v_mean)."""
    calls = _Calls()

    def launch(q, k, v, out, lse, descales, causal, softmax_scale, v_mean=None):
        calls.append(tuple(d.clone() for d in descales))
        calls.centered.append(v_mean is not None)
        group = q.shape[2] // k.shape[2]
        qd, kd, vd = (d.repeat_interleave(g, 1)[:, None, :, None] for d, g in zip(descales, (group, 1, 1)))
        o, l = reference(q.float() * qd, k.float() * kd, v.float() * vd, causal, softmax_scale)
        out.copy_(o.to(out.dtype))
        lse.copy_(l)
        if v_mean is not None:
            fp8.add_v_mean(out, v_mean, k.shape[1], causal)

    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(fp8_api, "_launch", launch)
    return calls


def fp8_inputs(batch=2, sq=16, sk=24, hq=4, hkv=2, d=64):
    q, k, v = rand(batch, sq, hq, d, seed=1), rand(batch, sk, hkv, d, seed=2), rand(batch, sk, hkv, d, seed=3)
    return (q, k, v), (
        cutefa.quantize_fp8(q, "head", group=hq // hkv),
        cutefa.quantize_fp8(k, "head"),
        cutefa.quantize_fp8(v),
    )


def test_fp8_call_passes_kv_head_descales(on_cpu):
    (q, k, v), ((qq, qd), (kq, kd), (vq, vd)) = fp8_inputs()
    out, lse = cutefa.flash_attn_func(
        qq, kq, vq, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True
    )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.shape == q.shape
    sent = on_cpu[-1]
    assert all(d.shape == (2, 2) and d.dtype == torch.float32 and d.is_contiguous() for d in sent)
    assert torch.all(sent[2] == vd)  # the per-tensor descale broadcast to every (batch, kv head)
    # the op hands the kernel the dequantized problem: x_e4m3 * descale per (batch, kv head)
    deq, deq_lse = reference(
        fp8.dequantize_fp8(qq, qd), fp8.dequantize_fp8(kq, kd), fp8.dequantize_fp8(vq, vd), True, 1 / 8
    )
    torch.testing.assert_close(out.float(), deq, atol=2e-2, rtol=2e-2)  # bf16 output
    torch.testing.assert_close(lse, deq_lse)
    # which is close to the unquantized one (tests/gpu/test_fp8.py justifies the bound)
    ref, _ = reference(q, k, v, True, 1 / 8)
    assert (out.float() - ref).norm() / ref.norm() < 0.1


def test_fp8_call_without_descales_uses_one(on_cpu):
    (_, (qq, _), (kq, _), (vq, _)) = (None, *fp8_inputs()[1])
    cutefa.flash_attn_func(qq, kq, vq, out_dtype=torch.bfloat16)
    assert all(torch.all(d == 1.0) for d in on_cpu[-1])


def test_fp8_forward_has_no_backward(on_cpu):
    _, ((qq, qd), (kq, kd), (vq, vd)) = fp8_inputs()
    qd = qd.clone().requires_grad_()
    out = cutefa.flash_attn_func(qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="no backward for the fp8"):
        out.float().sum().backward()


def test_fp8_empty_and_keyless_problems(on_cpu):
    _, ((qq, _), (kq, _), (vq, _)) = fp8_inputs()
    out, lse = cutefa.flash_attn_func(qq, kq[:, :0], vq[:, :0], return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf) and not on_cpu


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            lambda t: {**t, "k": t["k"].to(torch.bfloat16)},
            TypeError,
            "k has dtype torch.bfloat16; an fp8 call",
        ),
        (
            lambda t: {**t, "q_descale": torch.ones(3)},
            ValueError,
            r"q_descale must have shape \(\) or \(batch, heads_kv\)",
        ),
        (
            lambda t: {**t, "k_descale": torch.ones(2, 2, dtype=torch.float64)},
            TypeError,
            "k_descale must be float32",
        ),
        (
            lambda t: {**t, "v_descale": 2.0},
            TypeError,
            "v_descale must be a float32 torch.Tensor or None; got float",
        ),
        (
            lambda t: {**t, "out_dtype": torch.float16},
            NotImplementedError,
            "writes torch.bfloat16 output only",
        ),
        (lambda t: {**t, "out_dtype": "bf16"}, TypeError, "out_dtype must be a torch.dtype or None"),
        (lambda t: {**t, "causal": 1}, TypeError, "causal must be a bool"),
    ],
)
def test_fp8_validation(on_cpu, change, error, match):
    _, ((qq, qd), (kq, kd), (vq, vd)) = fp8_inputs()
    args = change({"q": qq, "k": kq, "v": vq, "q_descale": qd, "k_descale": kd, "v_descale": vd})
    with pytest.raises(error, match=match):
        cutefa.flash_attn_func(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    assert not on_cpu


@pytest.mark.parametrize("option", ["q_descale", "out_dtype"])
def test_fp8_options_with_16_bit_inputs_are_refused(on_cpu, option):
    q = k = v = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    value = torch.ones(()) if option == "q_descale" else torch.bfloat16
    with pytest.raises(ValueError, match=f"{option} apply to fp8"):
        cutefa.flash_attn_func(q, k, v, **{option: value})


def test_fp8_fake_impl_and_torch_compile_trace_the_fp8_op():
    with FakeTensorMode():
        q = torch.empty(2, 5, 8, 128, device="cuda", dtype=torch.float8_e4m3fn)
        k = v = torch.empty(2, 7, 2, 128, device="cuda", dtype=torch.float8_e4m3fn)
        qd, kd, vd = (
            torch.ones(2, 2, device="cuda"),
            torch.ones(2, 2, device="cuda"),
            torch.ones((), device="cuda"),
        )
        (out, lse), called = trace_attention_block(q, k, v, qd, kd, vd)
        (centered, _), with_mean = trace_attention_block(q, k, v, qd, kd, vd, torch.zeros(2, 2, 128, device="cuda"))
    assert (out.shape, out.dtype) == ((2, 5, 8, 128), torch.bfloat16) and lse.shape == (2, 8, 5)
    assert torch.ops.cutefa.flash_fwd_fp8.default in called
    assert (centered.shape, centered.dtype) == (out.shape, out.dtype)
    assert torch.ops.cutefa.flash_fwd_fp8.default in with_mean  # v_mean goes into the op


def test_explain_names_the_e4m3_variant():
    _, ((qq, _), (kq, _), (vq, _)) = fp8_inputs(d=128)
    text = cutefa.explain(qq, kq, vq, causal=True, target="sm_90a")
    assert "cutefa_sm90_fwd_e4m3_hd128_" in text


# ---------------------------------------------------------------------------------------------
# The fp8 call plan: a repeated plain call skips validation and dispatch


class FakeFp8Kernel:
    """Stands in for a compiled e4m3 forward: refuses what its TVM-FFI entry would refuse (dtypes
    of k and v, v's shape) and otherwise writes the dequantized reference. Records the descales."""

    def __init__(self):
        self.calls = []
        self.means = []  # the v_mean each call was given (None: the variant takes none)

    def __call__(self, q, k, v, out, lse, qd, kd, vd, *rest):
        """``rest``: (scale), or (v_mean, scale) for a variant with the v_mean flag (added here)."""
        *v_mean, scale = rest
        if not q.dtype == k.dtype == v.dtype == torch.float8_e4m3fn:
            raise TypeError("the kernel takes float8_e4m3fn q, k and v")
        if v.shape != k.shape:
            raise ValueError("v must have k's shape")
        self.calls.append((qd, kd, vd))
        if qd.dim() != 2:  # the block-quantization kernel's arguments: not modelled here
            return
        group = q.shape[2] // k.shape[2]
        dq, dk, dv = (d.repeat_interleave(g, 1)[:, None, :, None] for d, g in zip((qd, kd, vd), (group, 1, 1)))
        o, l = reference(q.float() * dq, k.float() * dk, v.float() * dv, False, scale)
        out.copy_(o.to(out.dtype))
        lse.copy_(l)
        self.means.append(v_mean[0] if v_mean else None)
        if v_mean:
            fp8.add_v_mean(out, v_mean[0], k.shape[1], False)


@pytest.fixture
def fp8_plans(monkeypatch):
    """Plans on CPU tensors: CPU accepted, an H200 pretended, the kernel a FakeFp8Kernel; counts
    the validations."""
    kernel = FakeFp8Kernel()
    validations = []
    real_validate = fp8_api.validate_fp8_inputs

    def count(*args, **kwargs):
        validations.append(args[0].shape)
        return real_validate(*args, **kwargs)

    pretend_h200(monkeypatch)
    monkeypatch.setattr(fp8_api, "get_kernel", lambda spec, target: kernel)
    monkeypatch.setattr(fp8_api, "validate_fp8_inputs", count)
    monkeypatch.setattr(plans, "_FP8_PLANS", {})
    return kernel, validations


def test_fp8_second_call_takes_the_plan(fp8_plans):
    kernel, validations = fp8_plans
    _, ((qq, qd), (kq, kd), (vq, vd)) = fp8_inputs()
    vd_scalar = vd.reshape(())  # per tensor: broadcast to (batch, heads_kv) per call
    first = cutefa.flash_attn_func(qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=vd_scalar)
    assert len(plans._FP8_PLANS) == 1 and len(validations) == 1
    second, lse = cutefa.flash_attn_func(
        qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=vd_scalar, return_lse=True
    )
    assert len(validations) == 1 and len(kernel.calls) == 2  # the plan's way: no validation
    assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()
    assert second.dtype == torch.bfloat16 and lse.shape == (2, 4, 16) and lse.dtype == torch.float32
    qd_sent, kd_sent, vd_sent = kernel.calls[-1]
    assert qd_sent is qd and kd_sent is kd  # contiguous (batch, heads_kv) descales as they are
    assert vd_sent.shape == (2, 2) and vd_sent.is_contiguous() and torch.all(vd_sent == vd_scalar)
    # new descale values take effect through the same plan
    third = cutefa.flash_attn_func(qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=2 * vd_scalar)
    assert len(validations) == 1 and torch.all(kernel.calls[-1][2] == 2 * vd_scalar)
    torch.testing.assert_close(third.float(), 2 * first.float(), rtol=1e-2, atol=1e-2)


def test_fp8_plans_follow_the_descale_kinds(fp8_plans):
    kernel, validations = fp8_plans
    _, ((qq, qd), (kq, kd), (vq, vd)) = fp8_inputs()
    for _ in range(2):
        cutefa.flash_attn_func(qq, kq, vq)  # no descales: ones
        cutefa.flash_attn_func(qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=vd)
        cutefa.flash_attn_func(qq, kq, vq, q_descale=qd.t().contiguous().t(), k_descale=kd, v_descale=vd)
        cutefa.flash_attn_func(qq, kq, vq, out_dtype=torch.bfloat16)
    assert len(plans._FP8_PLANS) == 4 and len(validations) == 4
    assert all(torch.all(d == 1.0) for d in kernel.calls[4])  # the planned call without descales
    assert kernel.calls[6][0].is_contiguous() and torch.equal(kernel.calls[6][0], qd)  # a copy of the strided one


def test_fp8_descale_subclasses_have_no_plan(fp8_plans):
    _, validations = fp8_plans
    _, ((qq, qd), (kq, kd), (vq, vd)) = fp8_inputs()
    qd = torch.nn.Parameter(qd, requires_grad=False)  # a tensor subclass: the key cannot vouch for it
    cutefa.flash_attn_func(qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=vd)
    first = len(validations)
    cutefa.flash_attn_func(qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=vd)
    assert not plans._FP8_PLANS and first > 0 and len(validations) == 2 * first  # validated again


def test_fp8_block_descales_have_no_plan(fp8_plans):
    _, validations = fp8_plans
    q, k, v = rand(1, 256, 2, 64, seed=1), rand(1, 256, 2, 64, seed=2), rand(1, 256, 2, 64, seed=3)
    q_block, kv_block = cutefa.fp8_block_sizes(q, k)
    (qq, qd), (kq, kd), (vq, vd) = (
        cutefa.quantize_fp8(x, "block", block=b) for x, b in ((q, q_block), (k, kv_block), (v, kv_block))
    )
    for _ in range(2):
        cutefa.flash_attn_func(qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=vd)
    assert not plans._FP8_PLANS and len(validations) == 2


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda t: {**t, "k": t["k"].to(torch.bfloat16)}, TypeError, "k has dtype torch.bfloat16; an fp8 call"),
        (lambda t: {**t, "v": t["v"][:, :8]}, ValueError, "k and v must have the same shape"),
        (lambda t: {**t, "causal": 1}, TypeError, "causal must be a bool"),
        (lambda t: {**t, "k_descale": t["k_descale"].double()}, TypeError, "k_descale must be float32"),
    ],
)
def test_an_fp8_plan_never_accepts_what_validation_refuses(fp8_plans, change, error, match):
    _, ((qq, qd), (kq, kd), (vq, vd)) = fp8_inputs()
    args = {"q": qq, "k": kq, "v": vq, "q_descale": qd, "k_descale": kd, "v_descale": vd}
    for _ in range(2):
        cutefa.flash_attn_func(**args)
    assert len(plans._FP8_PLANS) == 1
    args = change(args)
    with pytest.raises(error, match=match):
        cutefa.flash_attn_func(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_fp8_planned_call_host_overhead_is_small(fp8_plans, monkeypatch):
    """Host cost of a planned fp8 call with a no-op kernel (the GPU adds the launch): the plan's
    Python path, and the check of the descales' values (cutefa.api.descales.assert_finite_positive:
    one fused device-side assert per call, a few small torch ops: launches on a GPU)."""
    import timeit

    _, ((qq, qd), (kq, kd), (vq, vd)) = fp8_inputs()
    cutefa.flash_attn_func(qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    (key,) = plans._FP8_PLANS
    choice = launch.choose(qq, kq, True)
    given = (qd, kd, vd)
    n = 2000

    def call():
        return cutefa.flash_attn_func(qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)

    def seconds(checked):
        with monkeypatch.context() as m:
            if not checked:
                m.setattr(descales_api, "assert_finite_positive", lambda names, values: None)
            plan = fp8_api.make_plan(choice, lambda *args: None, qq, kq, True, None, 0.125, None, given)
        plans._FP8_PLANS[key] = plan
        return min(timeit.repeat(call, number=n, repeat=5)) / n

    unchecked, checked = seconds(False), seconds(True)
    print(f"planned fp8 call on the host: {unchecked * 1e6:.1f} us, {checked * 1e6:.1f} us with the check")
    assert unchecked < 30e-6, f"{unchecked * 1e6:.1f} us per planned fp8 call on the host (no descale check)"
    assert checked < 50e-6, f"{checked * 1e6:.1f} us per planned fp8 call on the host"


def test_center_v_and_add_v_mean():
    """cutefa.center_v takes out v's mean over seqlen per (batch, head, column); add_v_mean puts it
    back in place on the rows that attend a key (causal, more queries than keys: all but the first
    seqlen_q - seqlen_k), each kv head's mean on its group of query heads, and leaves the others
    (0) alone; with no keys it adds nothing."""
    from cutefa.fp8 import add_v_mean

    v = torch.randn(2, 7, 2, 16, generator=torch.Generator().manual_seed(0)) + 3.0
    centered, mean = cutefa.center_v(v.to(torch.bfloat16))
    assert centered.dtype == mean.dtype == torch.float32 and mean.shape == (2, 2, 16)
    assert torch.allclose(centered + mean[:, None], v.to(torch.bfloat16).float(), atol=1e-5)
    assert centered.mean(dim=1).abs().max() < 1e-5
    out = torch.zeros(2, 5, 4, 16, dtype=torch.bfloat16)  # 4 query heads, 2 kv heads
    got = add_v_mean(out, mean, 3, True)  # 5 queries, 3 keys: the first two rows attend no key
    assert got is out and got.dtype == torch.bfloat16
    assert torch.all(got[:, :2] == 0)
    expect = mean.repeat_interleave(2, 1)[:, None].expand(2, 3, 4, 16).to(torch.bfloat16)
    assert torch.equal(got[:, 2:], expect)
    every = add_v_mean(torch.zeros(2, 5, 4, 16), mean, 3, False)  # not causal: every row
    assert torch.equal(every, mean.repeat_interleave(2, 1)[:, None].expand(2, 5, 4, 16))
    assert torch.all(add_v_mean(torch.zeros(2, 5, 4, 16), mean, 0, False) == 0)  # no keys
    with pytest.raises(TypeError, match="before quantization"):
        cutefa.center_v(v.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="4-D"):
        cutefa.center_v(v[0])


def test_v_mean_is_validated():
    """v_mean: fp8 calls only, float32 (batch, heads_kv, head_dim) on v's device; named in the error."""
    q = torch.randn(1, 8, 4, 64)
    k = v = torch.randn(1, 8, 2, 64)
    with pytest.raises(ValueError, match="v_mean applies to fp8"):
        cutefa.flash_attn_func(q, k, v, v_mean=torch.zeros(1, 2, 64))
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    for bad in (torch.zeros(1, 4, 64), torch.zeros(1, 2, 64, dtype=torch.float16), torch.zeros(2, 64)):
        with pytest.raises(ValueError, match=r"v_mean must be float32 of shape \(batch, heads_kv, head_dim\)"):
            cutefa.flash_attn_func(q8, k8, v8, v_mean=bad)
    with pytest.raises(TypeError, match="v_mean must be a torch.Tensor"):
        cutefa.flash_attn_func(q8, k8, v8, v_mean=[0.0])


def test_v_mean_goes_back_on_the_rows_that_attend_a_key(on_cpu):
    """flash_attn_func(v_mean=) dispatches for centered v and adds the mean to every row that
    attends a key (causal, 40 queries and 24 keys: all but the first 16, which stay 0 with lse
    -inf), each kv head's mean on its query heads: the attention of the uncentered v."""
    (_, _, v), ((qq, qd), (kq, kd), _) = fp8_inputs(sq=40, sk=24)
    v = v + 3.0
    centered, mean = cutefa.center_v(v)
    vq, vd = cutefa.quantize_fp8(centered)
    out, lse = cutefa.flash_attn_func(
        qq, kq, vq, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, v_mean=mean, return_lse=True
    )
    assert on_cpu.centered == [True]
    deq = [fp8.dequantize_fp8(x, d) for x, d in ((qq, qd), (kq, kd), (vq, vd))]
    expect, expect_lse = reference(deq[0], deq[1], deq[2] + mean[:, None], True, 1 / 8)
    assert torch.all(out[:, :16] == 0) and torch.all(torch.isneginf(lse[:, :, :16]))
    torch.testing.assert_close(out.float(), expect, atol=3e-2, rtol=2e-2)  # bf16 output
    torch.testing.assert_close(lse, expect_lse)
    cutefa.flash_attn_func(qq, kq, vq, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert on_cpu.centered == [True, False]


def test_v_mean_calls_dispatch_for_centered_v_and_have_their_plan(fp8_plans, monkeypatch):
    """On an H200 an hd128 call with v_mean runs the table's v_centered pick (no two-level
    accumulation, the v_mean flag: the kernel takes the means), one without it the two-level pick;
    each signature gets its own plan, and the planned v_mean call passes the means as the
    validating one did."""
    kernel, validations = fp8_plans
    picked = []
    monkeypatch.setattr(fp8_api, "get_kernel", lambda spec, target: picked.append(spec) or kernel)
    (_, _, v), ((qq, qd), (kq, kd), _) = fp8_inputs(d=128)
    centered, mean = cutefa.center_v(v + 2.0)
    vq, vd = cutefa.quantize_fp8(centered)
    descales = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    plain = cutefa.flash_attn_func(qq, kq, vq, **descales)
    first = cutefa.flash_attn_func(qq, kq, vq, **descales, v_mean=mean)
    again = cutefa.flash_attn_func(qq, kq, vq, **descales, v_mean=mean)
    assert [(s.options.o_accum, s.options.v_mean) for s in picked] == [(OAccum.TWO_LEVEL, False), (OAccum.ONE_LEVEL, True)]
    assert len(plans._FP8_PLANS) == 2 and len(validations) == 2 and len(kernel.calls) == 3
    assert kernel.means[0] is None and kernel.means[1] is mean and kernel.means[2] is mean
    assert torch.equal(first, again) and first.data_ptr() != again.data_ptr()
    expect = plain.float() + mean.repeat_interleave(2, 1)[:, None]
    torch.testing.assert_close(first.float(), expect, atol=3e-2, rtol=1e-2)
    # a v_mean strided in its last dim: the kernel is given a contiguous copy, the first time and planned
    strided = mean.transpose(1, 2).contiguous().transpose(1, 2)
    for _ in range(2):
        torch.testing.assert_close(cutefa.flash_attn_func(qq, kq, vq, **descales, v_mean=strided), first)
    assert all(m.is_contiguous() for m in kernel.means[3:]) and len(plans._FP8_PLANS) == 3


def test_v_mean_is_added_after_a_kernel_without_the_flag(fp8_plans, monkeypatch):
    """Where the dispatched variant has no v_mean flag (hd64: no v_centered entries, no such
    variant), the kernel runs as for any call and the mean is added to its output afterwards,
    the validating way and the planned way alike."""
    kernel, _ = fp8_plans
    picked = []
    monkeypatch.setattr(fp8_api, "get_kernel", lambda spec, target: picked.append(spec) or kernel)
    (_, _, v), ((qq, qd), (kq, kd), _) = fp8_inputs(d=64)
    centered, mean = cutefa.center_v(v + 2.0)
    vq, vd = cutefa.quantize_fp8(centered)
    descales = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    plain = cutefa.flash_attn_func(qq, kq, vq, **descales)
    first = cutefa.flash_attn_func(qq, kq, vq, **descales, v_mean=mean)
    again = cutefa.flash_attn_func(qq, kq, vq, **descales, v_mean=mean)
    assert picked[0] == picked[1] and not picked[1].options.v_mean and kernel.means == [None, None, None]
    expect = plain.float() + mean.repeat_interleave(2, 1)[:, None]
    torch.testing.assert_close(first.float(), expect, atol=3e-2, rtol=1e-2)
    assert torch.equal(first, again)


def test_explain_asks_dispatch_for_centered_v():
    """cutefa.explain(v_centered=True) explains what a call with v_mean= runs: the pick among the
    v_centered entries (hd128 on sm_90a: a kernel that takes the means), not the plain pick; a
    16-bit problem has no centered variants."""
    q = torch.empty(1, 4096, 4, 128, dtype=torch.float8_e4m3fn)
    k = torch.empty(1, 4096, 2, 128, dtype=torch.float8_e4m3fn)
    problem = {
        "target": "sm_90a", "dtype": q.dtype, "head_dim": 128, "causal": True, "seqlen_q": 4096, "seqlen_k": 4096,
        "batch": 1, "heads_q": 4, "heads_kv": 2,
    }  # fmt: skip
    centered = dispatch.choose(**problem, v_centered=True).spec
    plain = dispatch.choose(**problem).spec
    assert centered.options.v_mean and not plain.options.v_mean
    text = cutefa.explain(q, k, k, causal=True, target="sm_90a", v_centered=True)
    assert "v centered" in text.splitlines()[0] and text.splitlines()[1].startswith(f"chosen: {centered.name} ")
    text = cutefa.explain(q, k, k, causal=True, target="sm_90a")
    assert "v centered" not in text and text.splitlines()[1].startswith(f"chosen: {plain.name} ")
    half = q.to(torch.bfloat16), k.to(torch.bfloat16), k.to(torch.bfloat16)
    with pytest.raises(ValueError, match="v_centered applies to e4m3"):
        cutefa.explain(*half, target="sm_90a", v_centered=True)
