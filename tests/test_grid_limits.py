"""Batch and heads over the launch grid's limits, on the CPU: the kernels take heads_q as grid y and
batch as grid z (at most 65535 each; cutefa.api.validate.GRID_YZ_LIMIT), so a larger problem is a
ValueError from validation, before dispatch, allocation or launch. Meta tensors (and fake CUDA
tensors) stand in for problems that would not fit in memory here."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cutefa
from cutefa.api import backward, dense, launch, validate
from cutefa.api import fp8 as fp8_api

LIMIT = validate.GRID_YZ_LIMIT
OVER = 70000
# (batch, heads_q, heads_kv): over the limit along one axis; GQA leaves heads_kv under it
OVERS = {
    "heads": ((1, OVER, OVER), f"heads_q={OVER} is over cutefa's limit of {LIMIT}: .* grid's y dimension"),
    "heads_gqa": ((1, OVER, 2), f"heads_q={OVER} is over cutefa's limit of {LIMIT}"),
    "batch": ((OVER, 2, 2), f"batch={OVER} is over cutefa's limit of {LIMIT}: .* grid's z dimension"),
}


def meta_qkv(batch, heads_q, heads_kv, dtype=torch.bfloat16, seqlen=1, head_dim=64):
    """q, k, v on the meta device: shapes without memory."""
    q = torch.empty(batch, seqlen, heads_q, head_dim, dtype=dtype, device="meta")
    k = torch.empty(batch, seqlen, heads_kv, head_dim, dtype=dtype, device="meta")
    return q, k, torch.empty_like(k)


@pytest.fixture
def no_launch(monkeypatch):
    """Meta tensors accepted as a device; anything past validation (dispatch, a forward or backward
    launch, the backward's allocations) fails the test."""

    def reached(*args, **kwargs):
        raise AssertionError("the call got past validation")

    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "meta"))
    for module, name in (
        (launch, "choose"), (dense, "choose"), (fp8_api, "choose"), (dense, "_launch"), (fp8_api, "_launch"),
        (backward, "_launch_bwd"), (backward, "_empty_grads"), (backward, "choose_bwd"),
    ):  # fmt: skip
        monkeypatch.setattr(module, name, reached)


def test_the_limit_is_the_grid_y_z_limit():
    assert LIMIT == 2**16 - 1


@pytest.mark.parametrize(("sizes", "message"), OVERS.values(), ids=OVERS.keys())
def test_16_bit_call_over_the_limit(no_launch, sizes, message):
    q, k, v = meta_qkv(*sizes)
    with pytest.raises(ValueError, match=message):
        cutefa.flash_attn_func(q, k, v, causal=True)
    with pytest.raises(ValueError, match=message):
        validate.validate_inputs(q, k, v, device_types=("meta",))


@pytest.mark.parametrize(("sizes", "message"), OVERS.values(), ids=OVERS.keys())
def test_fp8_call_over_the_limit(no_launch, sizes, message):
    q, k, v = meta_qkv(*sizes, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=message):
        cutefa.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match=message):
        validate.validate_fp8_inputs(q, k, v, device_types=("meta",))


@pytest.mark.parametrize(("sizes", "message"), OVERS.values(), ids=OVERS.keys())
def test_explain_over_the_limit(sizes, message):
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match=message):
            cutefa.explain(*meta_qkv(*sizes, dtype=dtype), target="sm_90a")


@pytest.mark.parametrize(("sizes", "message"), OVERS.values(), ids=OVERS.keys())
def test_backward_over_the_limit(no_launch, sizes, message):
    """The backward (cutefa::flash_bwd, and tools' direct calls) refuses before it allocates."""
    q, k, v = meta_qkv(*sizes)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device="meta")
    with pytest.raises(ValueError, match=message):
        backward.gradients(q, q, k, v, q, lse, None, False, 0.125, False)


@pytest.mark.parametrize(("sizes", "message"), OVERS.values(), ids=OVERS.keys())
def test_traced_call_over_the_limit(sizes, message):
    """The ops' fake implementations (what torch.compile traces) validate too."""
    with FakeTensorMode():
        q, k, v = (torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in meta_qkv(*sizes))
        with pytest.raises(ValueError, match=message):
            torch.ops.cutefa.flash_fwd(q, k, v, False, 0.125)
        q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        with pytest.raises(ValueError, match=message):
            torch.ops.cutefa.flash_fwd_fp8(q8, k8, v8, *ones(k), False, 0.125)


def ones(k):
    """Three (batch, heads_kv) descales of 1 on k's device."""
    return [torch.ones(k.shape[0], k.shape[2], device=k.device) for _ in range(3)]


@pytest.mark.parametrize("sizes", [(LIMIT, 2, 2), (1, LIMIT, LIMIT), (LIMIT, LIMIT, 1)])
def test_the_limit_itself_is_accepted(sizes):
    validate.validate_inputs(*meta_qkv(*sizes), device_types=("meta",))
    validate.validate_fp8_inputs(*meta_qkv(*sizes, dtype=torch.float8_e4m3fn), device_types=("meta",))
    text = cutefa.explain(*meta_qkv(*sizes), causal=True, target="sm_90a")
    assert "chosen: cutefa_sm90_fwd_bf16_hd64_" in text, text
