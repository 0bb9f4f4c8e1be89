"""The eager training path (cutefa.api.dense.attention -> _Attention, the forward's and the
backward's call plans) against the custom op path it bypasses, on CPU tensors with kernels that
compute real results in float32 (an H200 pretended): the same outputs and gradients, a plan made
once per signature and missed by another shape, dtype, mask or mode, and torch.compile still
tracing the custom ops."""

from __future__ import annotations

import pytest
import torch
from cpu_support import load_tool, pretend_h200, reference
from torch.utils._python_dispatch import TorchDispatchMode

import cutefa
from cutefa.api import backward, dense, plans


class _H200:
    multi_processor_count = 132
    regs_per_multiprocessor = 65536
    shared_memory_per_multiprocessor = 228 * 1024


def forward_kernel(causal):
    def kernel(q, k, v, out, lse, scale):
        o, l = reference(q, k, v, causal, scale)
        out.copy_(o.to(out.dtype))
        lse.copy_(l)

    return kernel


def backward_kernel(spec, calls):
    """A backward kernel of ``spec``'s calling convention (sm90: dK/dV per KV head) computing the
    float32 reference gradients of (out, lse) for (dout, dlse); records its arguments."""

    def kernel(q, k, v, out, dout, lse, dlse, dq, dk, dv, dq_accum, dkv_accum, lse_log2, dpsum, scale, det):
        calls.append((dlse, dq_accum, dkv_accum, lse_log2, dpsum, scale, det))
        grads = reference_grads(q, k, v, dout, dlse, spec.causal, scale)
        for t, g in zip((dq, dk, dv), grads):
            t.copy_(g.to(t.dtype))

    return kernel


def reference_grads(q, k, v, dout, dlse, causal, scale):
    """(dq, dk, dv) in float32 of out and lse for (dout, dlse), written out (a kernel runs below
    autograd): dS = P * (dO V^T - (rowsum(dO * O) - dLSE))."""
    group = q.shape[2] // k.shape[2]
    q32, k32, v32 = (t.float() for t in (q, k, v))
    kk, vv = k32.repeat_interleave(group, 2), v32.repeat_interleave(group, 2)
    o, lse = reference(q32, k32, v32, causal, scale)
    lse = torch.where(torch.isinf(lse), 0.0, lse)
    s = torch.einsum("bqhd,bkhd->bhqk", q32, kk) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq, -torch.inf)
    p = torch.exp(s - lse[..., None])
    do = dout.float()
    d = (do * o).sum(-1).transpose(1, 2) - dlse.float()
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, vv) - d[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q32) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    shape = (*dk.shape[:2], k.shape[2], group, dk.shape[-1])
    return dq, dk.view(shape).sum(3), dv.view(shape).sum(3)


def test_reference_grads_are_autograds():
    q, k, v = (t.detach().float().requires_grad_() for t in qkv(hq=4, hkv=2))
    o, lse = reference(q, k, v, True, 0.3)
    dout, dlse = torch.randn_like(o), torch.randn_like(lse)
    want = torch.autograd.grad((o, lse), (q, k, v), (dout, dlse))
    for got, w in zip(reference_grads(q, k, v, dout, dlse, True, 0.3), want):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-4)


@pytest.fixture
def kernels(monkeypatch):
    """Real-result CPU kernels for every forward and (sm90) backward spec; returns the backward
    kernel's calls and the specs choose_bwd returned."""
    pretend_h200(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _H200())
    calls, chosen = [], []
    choose_bwd = backward.choose_bwd

    def counting_choose_bwd(*args, **kwargs):
        chosen.append(choose_bwd(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(dense, "get_kernel", lambda spec, target: forward_kernel(spec.causal))
    monkeypatch.setattr(backward, "get_kernel", lambda spec, target: backward_kernel(spec, calls))
    monkeypatch.setattr(backward, "choose_bwd", counting_choose_bwd)
    for table in ("_PLANS", "_TRAIN_PLANS", "_BWD_PLANS"):
        monkeypatch.setattr(plans, table, {})
    return calls, chosen


def qkv(batch=2, sq=33, sk=40, hq=4, hkv=2, d=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda s, h: torch.randn(batch, s, h, d, generator=g).to(dtype).requires_grad_()
    return mk(sq, hq), mk(sk, hkv), mk(sk, hkv)


def run(q, k, v, fast, causal=True, deterministic=False, with_lse=True, seed=1):
    """out, lse and the gradients of q, k, v for random output (and lse) gradients."""
    for t in (q, k, v):
        t.grad = None
    saved = dense.FAST_TRAINING
    dense.FAST_TRAINING = fast
    try:
        out, lse = cutefa.flash_attn_func(
            q, k, v, causal=causal, softmax_scale=0.3, return_lse=True, deterministic=deterministic
        )
        g = torch.Generator().manual_seed(seed)
        dout = torch.randn(out.shape, generator=g).to(out.dtype)
        if with_lse:
            dlse = torch.where(torch.isinf(lse), 0.0, torch.randn(lse.shape, generator=g))
            torch.autograd.backward((out, lse), (dout, dlse))
        else:
            torch.autograd.backward(out, dout)
    finally:
        dense.FAST_TRAINING = saved
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_fast_path_matches_the_custom_op(kernels, causal, with_lse):
    """Outputs and gradients of the eager training path equal those of the custom op path,
    bitwise (the same kernels), on the calls that validate and make the plans and on the calls
    that take them."""
    calls, _ = kernels
    q, k, v = qkv()
    want = run(q, k, v, fast=False, causal=causal, with_lse=with_lse)  # validates
    assert not plans._TRAIN_PLANS and len(plans._BWD_PLANS) == 1  # the op's backward left its plan
    results = [run(q, k, v, fast=True, causal=causal, with_lse=with_lse) for _ in range(3)]
    assert len(plans._TRAIN_PLANS) == 1 and len(plans._BWD_PLANS) == 1
    results.append(run(q, k, v, fast=False, causal=causal, with_lse=with_lse))  # the op, planned
    plans.clear_plans()
    results.append(run(q, k, v, fast=True, causal=causal, with_lse=with_lse))  # fast, validating
    for got in results:
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    if not with_lse:  # the fast path reads zeros where no lse gradient flows, never allocating them
        zero = calls[2][0]
        assert not zero.any() and zero.data_ptr() == calls[3][0].data_ptr()


def test_a_plan_decides_nothing_again(kernels):
    """The backward variant is chosen once per signature, by the op path and the fast path alike;
    the plan's workspaces have the shapes the validating path gives them."""
    calls, chosen = kernels
    q, k, v = qkv(hq=8, hkv=2)
    run(q, k, v, fast=False)
    assert len(chosen) == 1
    for _ in range(3):
        run(q, k, v, fast=True)
        run(q, k, v, fast=False)
    assert len(chosen) == 1
    validated, planned = calls[0], calls[-1]
    for a, b in zip(validated[1:5], planned[1:5]):  # dq_accum, dkv_accum, lse_log2, dpsum
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous()
    assert validated[5:] == planned[5:]


@pytest.mark.parametrize(
    "change",
    [
        {"sq": 34},
        {"sk": 41},
        {"hq": 8},
        {"d": 128},
        {"dtype": torch.float16},
        {"causal": False},
        {"deterministic": True},
    ],
    ids=lambda c: next(iter(c)),
)
def test_another_signature_misses_the_plans(kernels, change):
    _, chosen = kernels
    shape = {k: v for k, v in change.items() if k not in ("causal", "deterministic")}
    options = {k: v for k, v in change.items() if k in ("causal", "deterministic")}
    q, k, v = qkv()
    run(q, k, v, fast=True)
    assert len(chosen) == 1
    q2, k2, v2 = qkv(**shape)
    got = run(q2, k2, v2, fast=True, **options)
    assert len(chosen) == 2 and len(plans._BWD_PLANS) == 2
    plans.clear_plans()
    want = run(q2, k2, v2, fast=False, **options)  # validating
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert len(chosen) == 3 and len(plans._BWD_PLANS) == 1


def test_clearing_the_caches_drops_the_training_plans(kernels):
    q, k, v = qkv()
    run(q, k, v, fast=True)
    assert plans._TRAIN_PLANS and plans._BWD_PLANS
    cutefa.dispatch.clear_caches()
    assert not plans._TRAIN_PLANS and not plans._BWD_PLANS


def test_dispatch_modes_and_no_grad_take_the_other_paths(kernels):
    """Under a dispatch mode the custom op runs (the mode sees cutefa::flash_fwd); without
    gradients the inference plan; neither leaves a training plan."""
    seen = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q, k, v = qkv()
    with Recording():
        cutefa.flash_attn_func(q, k, v, causal=True)
    assert torch.ops.cutefa.flash_fwd.default in seen
    with torch.no_grad():
        cutefa.flash_attn_func(q, k, v, causal=True)
    assert not plans._TRAIN_PLANS and not plans._BWD_PLANS


def test_torch_compile_still_traces_the_custom_ops(kernels):
    """fullgraph=True with gradients: the forward graph calls cutefa::flash_fwd and the backward
    graph cutefa::flash_bwd, and the compiled gradients equal the eager training path's."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    from torch._functorch.aot_autograd import aot_module_simplified

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=capture, bw_compiler=capture)

    def loss(q, k, v):
        return cutefa.flash_attn_func(q, k, v, causal=True).float().square().sum()

    torch._dynamo.reset()
    q, k, v = qkv()
    loss(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    assert plans._BWD_PLANS
    for t in (q, k, v):
        t.grad = None
    torch.compile(loss, fullgraph=True, backend=backend)(q, k, v).backward()
    called = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.cutefa.flash_fwd.default in called
    assert torch.ops.cutefa.flash_bwd.default in called
    for got, want in zip((q.grad, k.grad, v.grad), eager):
        assert torch.equal(got, want)


def test_the_first_backward_validates(kernels, monkeypatch):
    """The fast path's first backward of a signature checks what the op checks (the head dims'
    backward, the grid's limits); the planned calls do not need to (their key fixes both)."""
    checked = []
    check = backward.check_grid_limits
    monkeypatch.setattr(backward, "check_grid_limits", lambda q: checked.append(q.shape) or check(q))
    q, k, v = qkv()
    for _ in range(3):
        run(q, k, v, fast=True)
    assert checked == [q.shape]
    monkeypatch.setattr(
        backward, "check_grid_limits", lambda q: (_ for _ in ()).throw(ValueError("batch=2 over"))
    )
    q2, k2, v2 = qkv(sq=5)
    out = cutefa.flash_attn_func(q2, k2, v2, causal=True)
    with pytest.raises(ValueError, match="batch=2"):
        out.float().sum().backward()


def test_zero_lse_buffers_grow_and_are_kept(monkeypatch):
    monkeypatch.setattr(plans, "_ZEROS", {})
    monkeypatch.setattr(plans, "_RETIRED", [])
    monkeypatch.setattr(plans, "MAX_SCRATCH_ELEMENTS", 1 << 14)
    cpu = torch.device("cpu")
    a = plans.zero_lse(cpu, (1, 2, 3))
    assert a.shape == (1, 2, 3) and not a.any() and plans._ZEROS[cpu].numel() == 4096
    b = plans.zero_lse(cpu, (2, 4, 1000))
    assert b.shape == (2, 4, 1000) and not b.any()
    assert plans._RETIRED and plans._RETIRED[0].data_ptr() == a.data_ptr()  # never freed
    assert plans.zero_lse(cpu, (1, 4, 1 << 13)) is None  # over the limit: the caller allocates


def test_a_replaced_variant_choice_gets_plans_of_its_own(kernels, monkeypatch):
    """Benchmarks force a backward variant by replacing choose_bwd (tools/bench_backends.py): a
    plan made before does not serve the forced calls, and the forced plan not the calls after."""
    from cutefa.model.defaults import default_spec

    forced_bwd_variant = load_tool("bench_backends").forced_bwd_variant

    calls, _ = kernels
    q, k, v = qkv()
    run(q, k, v, fast=True)
    dispatched = backward.choose_bwd("sm_90a", q.dtype, 64, True, seqlen_k=40, gpu_name="NVIDIA H200")
    forced = default_spec("sm90", "bwd", "bf16", 64, causal=True).replace(stages=1)
    assert forced != dispatched
    seen = []
    monkeypatch.setattr(
        backward, "get_kernel", lambda spec, target: seen.append(spec) or backward_kernel(spec, calls)
    )
    with forced_bwd_variant(forced.name):
        run(q, k, v, fast=True)
        run(q, k, v, fast=True)
    run(q, k, v, fast=True)
    assert seen == [forced]  # the forced plan was made once; the calls after took the first plan
    assert len(plans._BWD_PLANS) == 2
