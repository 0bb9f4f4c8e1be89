"""fp8 descales must be finite and positive (cutefa.api.descales.assert_finite_positive), on the CPU.

The check is a device-side assert (``torch._assert_async``): no host sync, so calls stay capturable
in CUDA graphs; on a GPU a bad value surfaces as a device-side assert at the next synchronizing
call, on the CPU (here) it raises RuntimeError at once. The validating way checks each given
descale under its own name; a call plan checks all of a call's given descales in one assert.
Either way the check comes before the kernel launch.
"""

from __future__ import annotations

import math

import pytest
import torch
from cpu_support import pretend_h200, rand
from torch.utils._python_dispatch import TorchDispatchMode

import cutefa
from cutefa.api import descales, plans
from cutefa.api import fp8 as fp8_api

NAMES = descales.DESCALE_NAMES
BAD = {"negative": -0.5, "zero": 0.0, "inf": math.inf, "nan": math.nan, "minus_inf": -math.inf}


class RecordingKernel:
    """Stands in for a compiled e4m3 forward: records its calls, writes nothing."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def kernel(monkeypatch):
    """CPU tensors accepted, an H200 pretended, the fp8 kernel a RecordingKernel; no plans yet."""
    recording = RecordingKernel()
    pretend_h200(monkeypatch)
    monkeypatch.setattr(fp8_api, "get_kernel", lambda spec, target: recording)
    monkeypatch.setattr(plans, "_FP8_PLANS", {})
    return recording


def fp8_problem(batch=2, sq=16, sk=24, hq=4, hkv=2, d=64):
    """e4m3 q, k, v and their per-head descales (batch, heads_kv)."""
    q, k, v = rand(batch, sq, hq, d, seed=1), rand(batch, sk, hkv, d, seed=2), rand(batch, sk, hkv, d, seed=3)
    (qq, qd), (kq, kd), (vq, vd) = (
        cutefa.quantize_fp8(x, "head", group=g) for x, g in ((q, hq // hkv), (k, 1), (v, 1))
    )
    return (qq, kq, vq), {"q_descale": qd, "k_descale": kd, "v_descale": vd}


def spoiled(d, value, per_tensor):
    """``d`` with one element set to ``value`` (per_tensor: a 0-d descale of ``value``)."""
    if per_tensor:
        return torch.tensor(value, dtype=torch.float32)
    d = d.clone()
    d[-1, -1] = value
    return d


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per_head", "per_tensor"])
@pytest.mark.parametrize("value", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("name", NAMES)
def test_a_bad_descale_is_named_before_the_launch(kernel, name, value, per_tensor):
    (q, k, v), given = fp8_problem()
    given[name] = spoiled(given[name], value, per_tensor)
    with pytest.raises(RuntimeError, match=f"cutefa: {name} is not finite and positive"):
        cutefa.flash_attn_func(q, k, v, causal=True, **given)
    assert not kernel.calls and not plans._FP8_PLANS


@pytest.mark.parametrize("value", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("name", NAMES)
def test_a_planned_call_checks_the_descales_too(kernel, name, value):
    (q, k, v), given = fp8_problem()
    given["v_descale"] = given["v_descale"][0, 0].clone()  # per tensor: broadcast by the plan
    for _ in range(2):
        cutefa.flash_attn_func(q, k, v, **given)
    assert len(plans._FP8_PLANS) == 1 and len(kernel.calls) == 2
    given[name] = spoiled(given[name], value, name == "v_descale")
    with pytest.raises(RuntimeError, match="cutefa: one of q_descale, k_descale, v_descale is not finite"):
        cutefa.flash_attn_func(q, k, v, **given)
    assert len(kernel.calls) == 2  # refused by the plan, before its launch


def test_a_planned_call_names_the_descales_it_was_given(kernel):
    (q, k, v), given = fp8_problem()
    for _ in range(2):
        cutefa.flash_attn_func(q, k, v, k_descale=given["k_descale"])
    with pytest.raises(RuntimeError, match="cutefa: k_descale is not finite and positive"):
        cutefa.flash_attn_func(q, k, v, k_descale=-given["k_descale"])


@pytest.mark.parametrize("value", BAD.values(), ids=BAD.keys())
def test_a_bad_block_descale_is_named(kernel, value):
    q, k, v = rand(1, 256, 2, 64, seed=1), rand(1, 256, 2, 64, seed=2), rand(1, 256, 2, 64, seed=3)
    q_block, kv_block = cutefa.fp8_block_sizes(q, k)
    (qq, qd), (kq, kd), (vq, vd) = (
        cutefa.quantize_fp8(x, "block", block=b) for x, b in ((q, q_block), (k, kv_block), (v, kv_block))
    )
    kd[0, 1, -1] = value
    with pytest.raises(RuntimeError, match="cutefa: k_descale is not finite and positive"):
        cutefa.flash_attn_func(qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=vd)
    assert not kernel.calls


def test_good_descales_pass_at_the_edges_of_float32(kernel):
    (q, k, v), given = fp8_problem()
    tiny, huge = 2.0**-149, torch.finfo(torch.float32).max  # the smallest subnormal, the largest finite
    given["q_descale"] = torch.full_like(given["q_descale"], tiny)
    given["k_descale"] = torch.full_like(given["k_descale"], huge)
    for _ in range(2):
        cutefa.flash_attn_func(q, k, v, **given)
    assert len(kernel.calls) == 2 and len(plans._FP8_PLANS) == 1


class OpLog(TorchDispatchMode):
    """Records the aten ops called under it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("given_names", [(), ("k_descale",), ("q_descale", "v_descale"), NAMES])
def test_a_plan_checks_in_one_assert_without_a_host_sync(kernel, given_names):
    """One fused check per planned call however many descales it is given, none for the ones made
    for None; no op that copies a value to the host (``.item()``, ``bool(tensor)``: the syncs a
    CUDA graph capture refuses)."""
    (q, k, v), given = fp8_problem()
    given = {n: d for n, d in given.items() if n in given_names}
    for _ in range(2):
        cutefa.flash_attn_func(q, k, v, **given)
    (plan,) = plans._FP8_PLANS.values()
    with OpLog() as log:
        plan(q, k, v, *(given.get(n) for n in NAMES), None, False)
    asserts = [op for op in log.ops if op.overloadpacket is torch.ops.aten._assert_async]
    assert len(asserts) == (1 if given else 0), log.ops
    assert torch.ops.aten._local_scalar_dense.default not in log.ops, log.ops
    assert len(kernel.calls) == 3


def test_the_validating_way_checks_without_a_host_sync(kernel):
    (q, k, v), given = fp8_problem()
    given["v_descale"] = given["v_descale"][0, 0].clone()
    # OpLog is a dispatch mode: the call goes through the custom op, whose implementation launches
    with OpLog() as log:
        cutefa.flash_attn_func(q, k, v, **given)
    asserts = [op for op in log.ops if op.overloadpacket is torch.ops.aten._assert_async]
    assert len(asserts) == 3 and len(kernel.calls) == 1
    assert torch.ops.aten._local_scalar_dense.default not in log.ops, log.ops


def test_meta_descales_are_not_checked():
    """On the meta device (shapes only, as under tracing) the assert is a no-op."""
    d = torch.full((2, 2), -1.0, device="meta")
    descales.assert_finite_positive(("q_descale",), (d,))
