"""The eager training path (cutefa.api.dense.attention: the forward's and the backward's call
plans, the backward's bound launcher) against the custom op path on real kernels: the same
outputs and gradients (bitwise in deterministic mode), the bound launcher taken on Hopper, strided
and misaligned gradients through the full call, and a training step captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from gpu_support import sm80_skip_reason as _skip_reason

import cutefa
from cutefa.api import backward_plan, dense, plans

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, causal)
PROBLEMS = {
    "bf16-gqa8/2-hd128-causal": (2, 1000, 1000, 8, 2, 128, torch.bfloat16, True),
    "bf16-mha-hd128": (1, 333, 1029, 4, 4, 128, torch.bfloat16, False),
    "fp16-gqa4/1-hd64-causal": (2, 257, 300, 4, 1, 64, torch.float16, True),
}


def inputs(problem, gen):
    batch, sq, sk, hq, hkv, d, dtype, causal = problem
    mk = lambda s, h: torch.randn(batch, s, h, d, device="cuda", generator=gen).to(dtype).requires_grad_()
    q, k, v = mk(sq, hq), mk(sk, hkv), mk(sk, hkv)
    dout = torch.randn(q.shape, device="cuda", generator=gen).to(dtype)
    dlse = torch.randn(batch, hq, sq, device="cuda", generator=gen)
    return q, k, v, dout, dlse, causal


def step(q, k, v, dout, dlse, causal, fast, deterministic, with_lse=True):
    saved = dense.FAST_TRAINING
    dense.FAST_TRAINING = fast
    try:
        out, lse = cutefa.flash_attn_func(
            q, k, v, causal=causal, return_lse=True, deterministic=deterministic
        )
        if with_lse:
            grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
        else:
            grads = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        dense.FAST_TRAINING = saved
    return (out.detach(), lse.detach(), *grads)


@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("name", PROBLEMS)
def test_fast_path_matches_the_op_bitwise_in_deterministic_mode(name, with_lse, gen):
    q, k, v, dout, dlse, causal = inputs(PROBLEMS[name], gen)
    want = step(q, k, v, dout, dlse, causal, fast=False, deterministic=True, with_lse=with_lse)
    for _ in range(3):  # makes the plans, then takes them
        got = step(q, k, v, dout, dlse, causal, fast=True, deterministic=True, with_lse=with_lse)
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), what
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", PROBLEMS)
def test_fast_path_matches_the_op(name, gen):
    q, k, v, dout, dlse, causal = inputs(PROBLEMS[name], gen)
    want = step(q, k, v, dout, dlse, causal, fast=False, deterministic=False)
    for _ in range(3):
        got = step(q, k, v, dout, dlse, causal, fast=True, deterministic=False)
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2, msg=what)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the sm90 backward binds",
)
def test_the_backward_plan_binds_on_hopper(gen, monkeypatch):
    """On Hopper, with backward_plan.BIND on, the backward plan gets a bound launcher whose results
    equal the full call's bit for bit, and a call it cannot take (a strided dout) goes through the
    full call with the same result."""
    q, k, v, dout, dlse, causal = inputs(PROBLEMS["bf16-gqa8/2-hd128-causal"], gen)
    monkeypatch.setattr(plans, "_BWD_PLANS", {})
    want = step(q, k, v, dout, dlse, causal, fast=False, deterministic=True)  # BIND off: the full call
    bound = []
    real_bind = backward_plan.bind
    monkeypatch.setattr(backward_plan, "BIND", True)
    monkeypatch.setattr(backward_plan, "bind", lambda *a: bound.append(real_bind(*a)) or bound[-1])
    monkeypatch.setattr(plans, "_BWD_PLANS", {})
    for fast in (True, False):
        got = step(q, k, v, dout, dlse, causal, fast=fast, deterministic=True)
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), f"bound launch, fast={fast}: {what}"
    assert len(bound) == 1 and bound[0] is not None
    strided = torch.empty((*dout.shape[:-1], 2 * dout.shape[-1]), device="cuda", dtype=dout.dtype)[..., ::2]
    strided.copy_(dout)
    got = step(q, k, v, strided, dlse, causal, fast=True, deterministic=True)
    for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), what


def test_training_step_in_a_cuda_graph(gen):
    """A fwd + bwd captured after warm-up (the plans exist) replays to the eager result."""
    q, k, v, dout, dlse, causal = inputs(PROBLEMS["bf16-gqa8/2-hd128-causal"], gen)
    want = step(q, k, v, dout, dlse, causal, fast=True, deterministic=True, with_lse=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(q, k, v, dout, dlse, causal, fast=True, deterministic=True, with_lse=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(q, k, v, dout, dlse, causal, fast=True, deterministic=True, with_lse=False)
    for t in captured:
        t.fill_(float("nan"))  # the replay writes them again
    graph.replay()
    torch.cuda.synchronize()
    for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), captured, want):
        assert torch.equal(a, b), what
