"""cutefa inside CUDA graphs: forward, and forward + backward, captured once and replayed on new data.

Inputs live in static tensors that each replay reads after they are overwritten in place. Every
kernel is loaded and every call plan made during the warm-up on a side stream, as torch asks
before capturing; during capture nothing may load or compile a kernel (``cutefa.loader`` is set
to fail if asked to), and a host synchronization would fail the capture itself. A replay
must then give bitwise what an eager call gives on the same inputs (with ``deterministic=True``
for the backward, whose default mode adds dQ with atomics in any order). The backward test skips
only where no committed backward variant runs on the GPU for its problem; anywhere else a missing
backward (NotImplementedError) fails. An e4m3 call is captured with its descale check (Hopper).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from gpu_support import sm80_skip_reason as _skip_reason
from gpu_support import sm90_kernel_skip_reason

import cutefa
from cutefa import loader

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, causal)
PROBLEMS = {
    "bf16-hd128-causal": (2, 1000, 1000, 8, 8, 128, torch.bfloat16, True),
    "fp16-hd64-gqa": (1, 333, 1029, 8, 2, 64, torch.float16, False),
}


@contextlib.contextmanager
def nothing_compiles(monkeypatch):
    """Fail on any kernel preparation (load or compile). A host synchronization needs no check of
    its own: inside capture it is an error that invalidates the graph."""

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was prepared (loaded or compiled) inside CUDA graph capture")

    with monkeypatch.context() as m:
        m.setattr(loader, "_prepare", refuse)
        m.setattr(loader, "_jit", refuse)
        yield


def _static_inputs(gen, batch, sq, sk, hq, hkv, d, dtype, requires_grad=False):
    shapes = ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d))
    return [
        torch.randn(s, generator=gen, device="cuda", dtype=dtype).requires_grad_(requires_grad)
        for s in shapes
    ]


def _refill(gen, tensors):
    with torch.no_grad():
        for t in tensors:
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda", dtype=t.dtype))


def _warm_up(fn, iterations=3):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iterations):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("problem", PROBLEMS.values(), ids=PROBLEMS.keys())
def test_forward_graph_replays(gen, monkeypatch, problem, return_lse):
    *shape, dtype, causal = problem
    q, k, v = _static_inputs(gen, *shape, dtype)

    def forward():
        return cutefa.flash_attn_func(q, k, v, causal=causal, return_lse=return_lse)

    _warm_up(forward)
    graph = torch.cuda.CUDAGraph()
    with nothing_compiles(monkeypatch), torch.cuda.graph(graph):
        captured = forward()
    captured_out, captured_lse = captured if return_lse else (captured, None)

    for replay in range(3):
        _refill(gen, (q, k, v))
        graph.replay()
        torch.cuda.synchronize()
        expect = forward()
        expect_out, expect_lse = expect if return_lse else (expect, None)
        assert torch.equal(captured_out, expect_out), f"replay {replay}: output differs from an eager call"
        if return_lse:
            assert torch.equal(captured_lse, expect_lse), f"replay {replay}: lse differs from an eager call"


def test_graph_of_several_calls_and_other_work(gen, monkeypatch):
    """Attention between other captured kernels, twice, on one graph: the order is kept."""
    q, k, v = _static_inputs(gen, 1, 512, 512, 4, 4, 128, torch.bfloat16)

    def block():
        h = cutefa.flash_attn_func(q * 0.5, k, v, causal=True)
        return cutefa.flash_attn_func(h, k, v) + 1

    _warm_up(block)
    graph = torch.cuda.CUDAGraph()
    with nothing_compiles(monkeypatch), torch.cuda.graph(graph):
        captured = block()
    _refill(gen, (q, k, v))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, block())


def _missing_backward(dtype, head_dim, causal):
    """Why this GPU has no backward kernel for the problem, or None: no committed backward variant
    of its dtype, head dim and mask, in any family that runs on the GPU's compile target, fits it
    (its family runs there and its shared memory is within the target's per-block limit). Every
    target cutefa knows has one for PROBLEMS; where one exists the backward must run."""
    from cutefa.dispatch import current_target
    from cutefa.model.committed import default_variants
    from cutefa.model.rules import why_not_on
    from cutefa.model.spec import TORCH_DTYPE_NAMES, families_for_target

    target = current_target()
    token = TORCH_DTYPE_NAMES[str(dtype).removeprefix("torch.")]
    found, reasons = [], []
    for family in families_for_target(target):
        alike = [
            s for s in default_variants(family, "bwd") if (s.dtype, s.head_dim, s.causal) == (token, head_dim, causal)
        ]  # fmt: skip
        found += [s for s in alike if why_not_on(s, target) is None]
        reasons += [f"{s.name}: {why_not_on(s, target)}" for s in alike] or [f"{family}: no such variant"]
    if found:
        return None
    return f"no committed {token} head_dim={head_dim} causal={causal} backward runs on {target}: {reasons}"


@pytest.mark.parametrize("problem", PROBLEMS.values(), ids=PROBLEMS.keys())
def test_forward_and_backward_graph_replays(gen, monkeypatch, problem):
    *shape, dtype, causal = problem
    q, k, v = _static_inputs(gen, *shape, dtype, requires_grad=True)
    dout = torch.randn(q.shape, generator=gen, device="cuda", dtype=dtype)

    def step():
        for t in (q, k, v):
            t.grad = None
        out = cutefa.flash_attn_func(q, k, v, causal=causal, deterministic=True)
        out.backward(dout)
        return out

    missing = _missing_backward(dtype, q.shape[-1], causal)
    if missing is not None:
        pytest.skip(missing)
    _warm_up(step)  # where a backward variant exists, NotImplementedError or any other error fails
    for t in (q, k, v):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with nothing_compiles(monkeypatch), torch.cuda.graph(graph):
        out = cutefa.flash_attn_func(q, k, v, causal=causal, deterministic=True)
        out.backward(dout)
    captured = (out, q.grad, k.grad, v.grad)

    for replay in range(2):
        _refill(gen, (q, k, v, dout))
        graph.replay()
        torch.cuda.synchronize()
        results = [t.clone() for t in captured]
        expect_out = step()
        expected = (expect_out, q.grad, k.grad, v.grad)
        for name, got, want in zip(("out", "dq", "dk", "dv"), results, expected):
            assert torch.equal(got, want), f"replay {replay}: {name} differs from an eager step"


def _quantized(gen, batch, sq, sk, hq, hkv, d):
    """Fresh e4m3 q, k, v (per-head descales, q's per kv head; v's per tensor) and their descales."""
    q, k, v = _static_inputs(gen, batch, sq, sk, hq, hkv, d, torch.float32)
    (qq, qd), (kq, kd), (vq, vd) = (
        cutefa.quantize_fp8(q, "head", group=hq // hkv),
        cutefa.quantize_fp8(k, "head"),
        cutefa.quantize_fp8(v),
    )
    return (qq, kq, vq), (qd, kd, vd)


@pytest.mark.skipif(
    sm90_kernel_skip_reason("fp8 forward") is not None, reason=str(sm90_kernel_skip_reason("fp8 forward"))
)
def test_fp8_forward_graph_replays_with_its_descale_check(gen, monkeypatch):
    """An e4m3 call with descales, captured: its check of the descales' values (a device-side
    assert, no host sync) is captured with it, and replays on new inputs and descales give bitwise
    what an eager call gives."""
    shape = (2, 1000, 1000, 8, 2, 128)
    tensors, descales = _quantized(gen, *shape)

    def forward():
        qd, kd, vd = descales
        return cutefa.flash_attn_func(*tensors, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)

    _warm_up(forward)
    graph = torch.cuda.CUDAGraph()
    with nothing_compiles(monkeypatch), torch.cuda.graph(graph):
        captured = forward()
    for replay in range(3):
        new_tensors, new_descales = _quantized(gen, *shape)
        for static, new in zip((*tensors, *descales), (*new_tensors, *new_descales)):
            static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(captured).all(), f"replay {replay}: non-finite output"
        assert torch.equal(captured, forward()), f"replay {replay}: output differs from an eager call"
