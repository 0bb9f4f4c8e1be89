"""The eager call path on the CPU (a stand-in for the kernel): the call plan a repeated call takes
without validating again, what it refuses, its bounds, its log line and its host overhead."""

from __future__ import annotations

import logging
import timeit

import pytest
import torch
from cpu_support import pretend_h200, replace_in

import cutefa
from cutefa import dispatch
from cutefa.api import attention, dense, fp8, launch, plans, validate


class FakeKernel:
    """Writes attention into out and lse like the real kernel and, like its TVM-FFI entry, refuses
    (ValueError, before writing anything) inconsistent shapes, tensors of another dtype or device,
    and misaligned ones."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.calls = []

    def __call__(self, q, k, v, out, lse, scale):
        if v.shape != k.shape or out.shape != q.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
            raise ValueError("Mismatched Shape on argument")
        for t in (q, k, v, out):
            if t.dtype != self.dtype or t.device != q.device:
                raise ValueError("Mismatched Tensor on argument")
            if t.data_ptr() % 16 or any(s % (16 // t.element_size()) for s in t.stride()[:-1]):
                raise ValueError("Misaligned Tensor data on argument")
        self.calls.append((q, k, v, out, lse, scale))
        group = q.shape[2] // k.shape[2]
        kk, vv = k.float().repeat_interleave(group, 2), v.float().repeat_interleave(group, 2)
        s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
        out.copy_(torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv).to(out.dtype))
        lse.copy_(torch.logsumexp(s, -1))


@pytest.fixture
def fake_gpu(monkeypatch):
    """Plans on CPU tensors: CPU accepted, an H200 pretended, kernels replaced by FakeKernel."""
    kernels = {}
    validations = []
    real_validate = validate.validate_inputs

    def get_kernel(spec, target):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
        return kernels.setdefault(spec.name, FakeKernel(dtype))

    def counting_validate(*args, **kwargs):
        validations.append(args[0].shape)
        return real_validate(*args, **kwargs)

    pretend_h200(monkeypatch)
    replace_in(monkeypatch, (dense, fp8), "get_kernel", get_kernel)
    replace_in(monkeypatch, (validate, dense, attention), "validate_inputs", counting_validate)
    monkeypatch.setattr(plans, "_PLANS", {})
    return kernels, validations


def qkv(batch=1, sq=8, sk=8, hq=4, hkv=2, d=64, dtype=None):
    dtype = dtype or torch.bfloat16
    return tuple(torch.randn(batch, s, h, d, dtype=dtype) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def test_second_call_takes_the_plan_without_validation(fake_gpu):
    kernels, validations = fake_gpu
    q, k, v = qkv()
    first = cutefa.flash_attn_func(q, k, v, causal=True)
    assert len(plans._PLANS) == 1 and validations == [q.shape]
    (kernel,) = kernels.values()
    second = cutefa.flash_attn_func(q, k, v, causal=True)
    assert validations == [q.shape] and len(kernel.calls) == 2  # no validation on the plan's way
    assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()
    assert second.is_contiguous() and second.shape == q.shape and second.dtype == q.dtype

    out, lse = cutefa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    _, lse2 = cutefa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, first) and lse.shape == (1, 4, 8) and lse.dtype == torch.float32
    assert lse.data_ptr() != lse2.data_ptr() and torch.equal(lse, lse2)  # a fresh lse when it is returned
    cutefa.flash_attn_func(q, k, v, causal=True)
    lses = [
        call[4] for call in kernel.calls
    ]  # first call (validating way), plan, plan (lse), plan (lse), plan
    assert lses[1].data_ptr() == lses[4].data_ptr()  # an unwanted lse goes to one scratch buffer
    assert lses[1].data_ptr() not in (lses[0].data_ptr(), lse.data_ptr(), lse2.data_ptr())
    assert validations == [q.shape]


def test_other_signatures_get_their_own_plans(fake_gpu):
    q, k, v = qkv()
    cutefa.flash_attn_func(q, k, v, causal=True)
    cutefa.flash_attn_func(q, k, v, causal=False)
    cutefa.flash_attn_func(q, k, v, causal=True, softmax_scale=0.5)
    cutefa.flash_attn_func(*qkv(sq=9))
    cutefa.flash_attn_func(*qkv(dtype=torch.float16))
    assert len(plans._PLANS) == 5


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"causal": 1}, TypeError, "causal must be a bool; got 1"),
        (
            {"softmax_scale": True},
            TypeError,
            "softmax_scale must be a positive finite float or None; got True",
        ),
        ({"softmax_scale": [0.1]}, TypeError, "softmax_scale must be a positive finite float or None"),
        ({"deterministic": "yes"}, TypeError, "deterministic must be a bool; got 'yes'"),
    ],
)
def test_a_plan_never_accepts_what_validation_refuses(fake_gpu, kwargs, error, words):
    q, k, v = qkv()
    cutefa.flash_attn_func(q, k, v, causal=True, softmax_scale=1.0)
    cutefa.flash_attn_func(q, k, v, causal=True, softmax_scale=1.0)
    call = {"causal": True, "softmax_scale": 1.0} | kwargs
    with pytest.raises(error, match=words):
        cutefa.flash_attn_func(q, k, v, **call)


def test_refused_tensors_take_the_validating_way(fake_gpu):
    _, validations = fake_gpu
    q, k, v = qkv()
    expect = cutefa.flash_attn_func(q, k, v)
    odd = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)  # misaligned pointer
    assert torch.equal(cutefa.flash_attn_func(odd, k, v), expect)  # copied aligned by the slow path
    assert len(validations) == 2
    with pytest.raises(TypeError, match="q, k and v must have one dtype"):
        cutefa.flash_attn_func(q, k.half(), v)
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        cutefa.flash_attn_func(q, k, v[:, :4])


def test_no_plan_for_launchless_problems_or_tracked_gradients(fake_gpu):
    q, k, v = qkv(sk=0)
    out = cutefa.flash_attn_func(q, k, v)
    assert (out == 0).all() and not plans._PLANS
    empty = qkv(batch=0)
    assert cutefa.flash_attn_func(*empty).shape == empty[0].shape and not plans._PLANS
    q, k, v = qkv()
    cutefa.flash_attn_func(q, k.requires_grad_(), v)  # the custom op, for autograd
    assert not plans._PLANS
    with torch.no_grad():
        cutefa.flash_attn_func(q, k, v)
    assert len(plans._PLANS) == 1


def test_plans_and_scratch_are_bounded(fake_gpu, monkeypatch):
    monkeypatch.setattr(plans, "MAX_PLANS", 2)
    monkeypatch.setattr(plans, "MAX_SCRATCH_ELEMENTS", 4 * 9)
    monkeypatch.setattr(plans, "_SCRATCH", {})
    for sq in (8, 9, 10):
        q, k, v = qkv(sq=sq)
        cutefa.flash_attn_func(q, k, v)  # makes the plan
        cutefa.flash_attn_func(q, k, v)  # runs it
        cutefa.flash_attn_func(q, k, v)
    assert [key[0][1] for key in plans._PLANS] == [9, 10]  # the oldest plan went
    kernels, _ = fake_gpu
    (kernel,) = kernels.values()
    lse = [call[4].data_ptr() for call in kernel.calls]
    assert lse[1] == lse[2] == lse[4] == lse[5]  # lse of 4 x 8 and 4 x 9 rows: one scratch buffer
    assert [b.numel() for b in plans._SCRATCH[torch.device("cpu")]] == [4 * 9]
    assert lse[7] != lse[8]  # 4 x 10 rows: more than the scratch limit, allocated per call


def test_plan_logs_each_run(fake_gpu, caplog):
    q, k, v = qkv()
    cutefa.flash_attn_func(q, k, v)
    try:
        dispatch.set_logging(True)
        with caplog.at_level(logging.INFO, logger="cutefa"):
            cutefa.flash_attn_func(q, k, v)
    finally:
        dispatch.set_logging(False)
    assert (
        "cutefa: ran cutefa_" in caplog.text
        and "for q=(1, 8, 4, 64) k=(1, 8, 2, 64) causal=False" in caplog.text
    )


def test_call_path_host_overhead_is_small(fake_gpu):
    """Pure Python cost of a planned call with a no-op kernel (the GPU adds the launch itself)."""
    q, k, v = qkv(d=128, sq=128, sk=128, hq=16, hkv=16)
    cutefa.flash_attn_func(q, k, v, causal=True)
    (key,) = plans._PLANS
    plans._PLANS[key] = dense.make_plan(launch.choose(q, k, True), lambda *args: None, q, k, True, 0.1)
    n = 2000
    seconds = min(timeit.repeat(lambda: cutefa.flash_attn_func(q, k, v, causal=True), number=n, repeat=5)) / n
    assert seconds < 20e-6, f"{seconds * 1e6:.1f} us per planned call on the host"


def test_clearing_dispatch_caches_drops_the_plans(fake_gpu):
    cutefa.flash_attn_func(*qkv())
    assert plans._PLANS
    dispatch.clear_caches()
    assert not plans._PLANS
