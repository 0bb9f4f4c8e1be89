"""The SDPA provider (cutefa.torch_sdpa, its kernels in cutefa.sdpa_serve) on the CPU:
registration, activation, which calls cutefa serves and why the others go back to PyTorch's
kernel, and that served outputs are views in the layout PyTorch's own kernel gives them.

The provider is installed on the CPU dispatch key here (aten's flash ops have no CPU kernels), an
H100 is pretended, and the kernel calls are replaced by a float32 reference, so the real aten ops,
autograd and dispatcher run around them.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys

import pytest
import torch

from cutefa import dispatch, sdpa_serve
from cutefa import torch_sdpa as ts
from cutefa.api import validate

aten = torch.ops.aten


def reference(q, k, v, causal, scale, window=(-1, -1)):
    """(out, lse) of (batch, seqlen, heads, head_dim) inputs, float32 math; GQA by repetition."""
    _, sq, hq, d = q.shape
    sk, group = k.shape[1], hq // k.shape[2]
    scale = scale or 1 / math.sqrt(d)
    kk, vv = (t.float().repeat_interleave(group, 2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window[0] >= 0:
        keep &= j >= i - window[0]
    if window[1] >= 0:
        keep &= j <= i + window[1]
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv)
    return out.to(q.dtype).contiguous(), lse  # cutefa's outputs are contiguous


def reference_backward(dout, q, k, v, out, lse, causal, scale):
    """(dq, dk, dv) in closed form (autograd does not run below the dispatcher's autograd key)."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = hq // hk
    scale = scale or 1 / math.sqrt(d)
    kk, vv = (t.float().repeat_interleave(group, 2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
    if causal:
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq), float("-inf"))
    p = torch.exp(s - lse[..., None])
    do = dout.float()
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vv)
    ds = p * (dp - (do * out.float()).sum(-1).permute(0, 2, 1)[..., None]) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float())
    dk, dv = (t.view(b, sk, hk, group, d).sum(3) for t in (dk, dv))
    return tuple(t.to(q.dtype).contiguous() for t in (dq, dk, dv))


class Recorder:
    """The kernel calls the provider made (replacing cutefa's), and PyTorch's kernels' calls."""

    def __init__(self):
        self.calls = []
        self.outputs = []

    def dense_forward(self, q, k, v, causal, scale, window, alibi):
        self.calls.append(("dense_forward", causal, scale, window, q.stride()))
        result = reference(q, k, v, causal, scale, window)
        self.outputs.append(result[0])
        return result

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, alibi, seqused_k):
        self.calls.append(("varlen_forward", cu_q.tolist(), cu_k.tolist(), max_q, max_k, causal, window))
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])

    def backward(self, dout, q, k, v, out, lse, causal, scale, window, packed):
        self.calls.append(("backward", causal, window, packed is not None))
        if packed is not None:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        grads = reference_backward(dout, q, k, v, out, lse, causal, scale)
        self.outputs.extend(grads)
        return grads


class FakeOriginal:
    """Stands for PyTorch's kernel of one op (``torch.library.get_kernel``'s result)."""

    def __init__(self, op, result):
        self.op, self.result, self.calls = op, result, []

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


@pytest.fixture
def provider(monkeypatch):
    """The provider installed on the CPU key, an H100 pretended, kernel calls recorded."""
    recorder = Recorder()
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(sdpa_serve, "_device_target", lambda device: ("sm_90a", "NVIDIA H100 80GB HBM3"))
    monkeypatch.setattr(sdpa_serve, "_REASONS", {})
    monkeypatch.setattr(sdpa_serve, "_dense_forward", recorder.dense_forward)
    monkeypatch.setattr(sdpa_serve, "_varlen_forward", recorder.varlen_forward)
    monkeypatch.setattr(sdpa_serve, "_backward", recorder.backward)
    handle = ts._install(prefer_flash=False, dispatch_key="CPU")
    yield recorder, handle
    handle.remove()


@pytest.fixture
def logged(caplog):
    dispatch.set_logging(True)
    caplog.set_level(logging.INFO, logger="cutefa")
    yield caplog
    dispatch.set_logging(False)


def bhsd(batch=2, seqlen=16, heads=4, head_dim=64, dtype=torch.bfloat16, grad=False):
    """A (batch, heads, seqlen, head_dim) view of (batch, seqlen, heads, head_dim) memory: what a
    projection viewed as heads gives SDPA."""
    t = torch.randn(batch, seqlen, heads, head_dim, dtype=dtype).transpose(1, 2)
    return t.requires_grad_() if grad else t


# ---------------------------------------------------------------------------------------------
# Registration and activation


def test_register_is_idempotent_and_never_activates():
    ts.register()
    ts.register()
    impls = torch.nn.attention.list_flash_attention_impls()
    assert impls.count("cutefa") == 1
    assert torch.nn.attention.current_flash_attention_impl() != "cutefa" and not ts.is_active()


def run_fresh(code):
    """Run ``code`` in a fresh interpreter (this one imported everything long ago); it must pass."""
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr


def test_register_before_torch_is_imported_waits_for_its_registry():
    code = (
        "import sys\n"
        "from cutefa import torch_sdpa as ts\n"
        "ts.register(); ts.register()\n"
        "assert 'torch' not in sys.modules, 'register imported torch'\n"
        "import torch\n"
        "assert 'cutefa' in torch.nn.attention.list_flash_attention_impls()\n"
        "assert ts._watch is None and not any(isinstance(f, ts._Watch) for f in sys.meta_path)\n"
        "assert torch.nn.attention.current_flash_attention_impl() is None\n"
    )
    run_fresh(code)


def test_the_serving_module_loads_with_the_provider_only():
    code = (
        "import sys\n"
        "import torch, cutefa\n"
        "from cutefa import torch_sdpa as ts\n"
        "assert 'cutefa' in torch.nn.attention.list_flash_attention_impls()\n"
        "assert 'cutefa.sdpa_serve' not in sys.modules, 'import cutefa loaded the serving module'\n"
        "handle = ts._install(prefer_flash=False, dispatch_key='CPU')\n"
        "assert 'cutefa.sdpa_serve' in sys.modules and ts.is_active()\n"
        "handle.remove()\n"
        "from cutefa import sdpa_serve\n"
        "assert ts.why_not is sdpa_serve.why_not and 'why_not' in vars(ts)\n"
        "try:\n"
        "    ts.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    run_fresh(code)


def test_activate_overrides_the_flash_ops_and_deactivate_restores_them():
    ops = [f"aten::{op}" for op in sdpa_serve.OPS]
    before = {op: torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") for op in ops}
    order = list(torch._C._get_sdp_priority_order())
    flash = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    ts.activate()
    try:
        assert ts.is_active() and torch.nn.attention.current_flash_attention_impl() == "cutefa"
        assert all(torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") for op in ops)
        assert next(iter(torch._C._get_sdp_priority_order())) == flash
        ts.activate()  # again: still one installation
        assert ts.is_active()
    finally:
        ts.deactivate()
    assert not ts.is_active() and torch.nn.attention.current_flash_attention_impl() is None
    assert {op: torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") for op in ops} == before
    assert list(torch._C._get_sdp_priority_order()) == order
    ts.deactivate()  # nothing active: nothing happens


def test_the_registry_activates_it_too():
    torch.nn.attention.activate_flash_attention_impl("cutefa")
    try:
        assert ts.is_active()
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    assert not ts.is_active()


def test_a_torch_without_get_kernel_is_told_so(monkeypatch):
    monkeypatch.delattr(torch.library, "get_kernel")
    with pytest.raises(NotImplementedError, match="torch.library.get_kernel"):
        ts.activate()
    assert not ts.is_active()


# ---------------------------------------------------------------------------------------------
# The routing decision


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "meta"))
    monkeypatch.setattr(sdpa_serve, "_device_target", lambda device: ("sm_90a", "NVIDIA H100"))
    monkeypatch.setattr(sdpa_serve, "_REASONS", {})


def meta(batch, heads, seqlen, head_dim, dtype=torch.bfloat16):
    return torch.empty(batch, heads, seqlen, head_dim, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    ("shapes", "dtype", "options", "words"),
    [
        (((2, 8, 128, 128), (2, 2, 128, 128)), torch.bfloat16, {}, None),  # GQA
        (((1, 4, 100, 64), (1, 4, 300, 64)), torch.float16, {}, None),
        (((2, 8, 128, 256), (2, 8, 128, 256)), torch.bfloat16, {}, None),
        (((2, 8, 128, 128), (2, 8, 128, 128)), torch.float32, {}, "float16 or bfloat16"),
        (((2, 8, 128, 80), (2, 8, 128, 80)), torch.bfloat16, {}, None),  # padded tiles, both directions
        (((2, 8, 128, 160), (2, 8, 128, 160)), torch.bfloat16, {}, None),  # padded tiles, both directions
        (((2, 8, 128, 84), (2, 8, 128, 84)), torch.bfloat16, {}, "head dims [84]"),
        (((2, 6, 128, 64), (2, 4, 128, 64)), torch.bfloat16, {}, "heads: q has 6, k/v 4"),
        (((2, 8, 128, 64), (2, 8, 128, 64)), torch.bfloat16, {"dropout_p": 0.1}, "dropout_p=0.1"),
        (((2, 8, 128, 64), (2, 8, 128, 64)), torch.bfloat16, {"debug_mask": True}, "return_debug_mask"),
    ],
)
def test_which_calls_cutefa_serves(h100, shapes, dtype, options, words):
    q_shape, kv_shape = shapes
    q, k, v = meta(*q_shape, dtype=dtype), meta(*kv_shape, dtype=dtype), meta(*kv_shape, dtype=dtype)
    why = ts.why_not(q, k, v, layout="bhsd", **options)
    assert why is None if words is None else words in why


def test_a_gpu_without_cutefa_kernels_goes_to_pytorch(monkeypatch):
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "meta"))
    monkeypatch.setattr(sdpa_serve, "_REASONS", {})
    monkeypatch.setattr(sdpa_serve, "_device_target", lambda device: ("sm_75", "Tesla T4"))
    q = meta(1, 4, 64, 64)
    assert "Tesla T4" in ts.why_not(q, q, q, layout="bhsd")


def test_cpu_tensors_are_not_served(monkeypatch):
    monkeypatch.setattr(sdpa_serve, "_REASONS", {})
    q = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    assert "CUDA" in ts.why_not(q, q, q, layout="bhsd")


def test_the_decision_is_memoized_per_shape(h100):
    q = meta(1, 4, 64, 64)
    assert ts.why_not(q, q, q, layout="bhsd") is None
    assert len(sdpa_serve._REASONS) == 1
    ts.why_not(q, q, q, layout="bhsd")
    assert len(sdpa_serve._REASONS) == 1


@pytest.mark.parametrize(
    ("causal", "left", "right", "expected"),
    [
        (False, None, None, (False, (-1, -1))),
        (True, None, None, (True, (-1, -1))),
        (False, -1, 0, (True, (-1, -1))),  # varlen_attn's causal
        (True, 128, None, (True, (128, 0))),
        (True, 128, 64, (True, (128, 0))),  # causal caps the right side
        (False, 128, 64, (False, (128, 64))),
        (False, -1, -1, (False, (-1, -1))),
    ],
)
def test_aten_windows_map_to_cutefa_masks(causal, left, right, expected):
    assert sdpa_serve._mask(causal, left, right) == expected


# ---------------------------------------------------------------------------------------------
# Served calls, through the dispatcher and autograd


@pytest.mark.parametrize(("heads_q", "heads_kv", "causal"), [(4, 4, False), (4, 2, True), (8, 1, True)])
def test_sdpa_forward_and_backward_are_served_as_views(provider, logged, heads_q, heads_kv, causal):
    recorder, _ = provider
    q, k, v = bhsd(heads=heads_q, grad=True), bhsd(heads=heads_kv, grad=True), bhsd(heads=heads_kv, grad=True)
    out, lse, cu_q, cu_k, max_q, max_k, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    assert (cu_q, cu_k, max_q, max_k) == (None, None, 16, 16)
    assert out.shape == q.shape and lse.shape == (2, heads_q, 16) and lse.dtype == torch.float32
    kernel_out = recorder.outputs[0]
    assert out.data_ptr() == kernel_out.data_ptr() and out.stride() == q.stride()  # a view: no copy
    assert recorder.calls[0][4] == q.transpose(1, 2).stride()  # the kernel got a view of q too

    grad = torch.randn_like(out)
    out.backward(grad)
    assert [c[0] for c in recorder.calls] == ["dense_forward", "backward"]
    for g, kernel_g, t in zip((q.grad, k.grad, v.grad), recorder.outputs[1:], (q, k, v)):
        assert g.data_ptr() == kernel_g.data_ptr() and g.stride() == t.stride()

    qm, km, vm = (t.detach().float().requires_grad_() for t in (q, k, v))
    expected = torch.nn.functional.scaled_dot_product_attention(qm, km, vm, is_causal=causal, enable_gqa=True)
    expected.backward(grad.float())
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    for got, want in ((q.grad, qm.grad), (k.grad, km.grad), (v.grad, vm.grad)):
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    served = [r.getMessage() for r in logged.records if "served by cutefa" in r.getMessage()]
    assert len(served) == 2 and "_scaled_dot_product_flash_attention_backward" in served[1]


@pytest.mark.parametrize(
    "layout",
    ["bshd", "bhsd", "sliced"],  # projections viewed as heads; contiguous; a slice of packed qkv
)
def test_outputs_have_the_layout_of_pytorchs_kernel(provider, layout):
    """The strides torch.compile's graphs assume are those of the ops' meta functions."""
    if layout == "bshd":
        q, k, v = bhsd(grad=True), bhsd(grad=True), bhsd(grad=True)
    elif layout == "bhsd":
        q, k, v = (torch.randn(2, 4, 16, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    else:
        qkv = torch.randn(2, 16, 3, 4, 64, dtype=torch.bfloat16)
        q, k, v = (qkv[:, :, i].transpose(1, 2).requires_grad_() for i in range(3))
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
    metas = [t.detach().to("meta") for t in (q, k, v)]
    meta_out, meta_lse, *_ = aten._scaled_dot_product_flash_attention(*metas, 0.0, True)
    assert same_layout(out, meta_out) and same_layout(lse, meta_lse)
    grads = aten._scaled_dot_product_flash_attention_backward(
        torch.randn_like(out), q, k, v, out, lse, None, None, 16, 16, 0.0, True, *_empty_rng(), scale=None
    )
    meta_grads = aten._scaled_dot_product_flash_attention_backward(
        torch.empty_like(meta_out), *metas, meta_out, meta_lse, None, None, 16, 16, 0.0, True,
        *_empty_rng("meta"), scale=None,
    )  # fmt: skip
    assert all(same_layout(g, m) for g, m in zip(grads, meta_grads))


def _empty_rng(device="cpu"):
    return torch.empty(2, dtype=torch.uint64, device=device), torch.empty(
        (), dtype=torch.uint64, device=device
    )


def same_layout(t, meta_t):
    """Equal shapes and strides, strides of size-1 dims aside (as torch.compile's checks take them)."""
    return t.shape == meta_t.shape and all(
        a == b or n == 1 for a, b, n in zip(t.stride(), meta_t.stride(), t.shape)
    )


def test_flash_attention_forward_routes_packed_sequences_and_windows(provider):
    recorder, _ = provider
    q, k, v = (torch.randn(10, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    out, lse, *_ = aten._flash_attention_forward(
        q, k, v, cu, cu, 7, 7, 0.0, False, False, window_size_left=-1, window_size_right=0
    )
    assert recorder.calls[-1] == ("varlen_forward", [0, 3, 10], [0, 3, 10], 7, 7, True, (-1, -1))
    assert out.shape == q.shape and lse.shape == (4, 10)
    qd, kd, vd = (torch.randn(1, 16, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    aten._flash_attention_forward(qd, kd, vd, None, None, 16, 16, 0.0, True, False, window_size_left=4)
    assert recorder.calls[-1][:4] == ("dense_forward", True, None, (4, 0))


def test_flash_attention_backward_of_packed_sequences_takes_their_lengths(provider):
    recorder, _ = provider
    q, k, v, out, dout = (torch.randn(10, 4, 64, dtype=torch.bfloat16) for _ in range(5))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    lse = torch.zeros(4, 10)
    dq, dk, dv = aten._flash_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu,
        cu,
        7,
        7,
        0.0,
        True,
        *_empty_rng(),
        window_size_left=-1,
        window_size_right=0,
    )
    assert recorder.calls[-1] == ("backward", True, (-1, -1), True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# ---------------------------------------------------------------------------------------------
# What goes back to PyTorch's kernel, and why


def _install_original(handle, op, result):
    fake = FakeOriginal(op, result)
    handle.originals[op] = fake
    return fake


def test_dropout_goes_to_pytorchs_kernel_with_the_call_unchanged(provider, logged):
    recorder, handle = provider
    q, k, v = bhsd(), bhsd(), bhsd()
    marker = (torch.zeros(1),) * 9
    fake = _install_original(handle, sdpa_serve._SDPA_FWD, marker)
    result = aten._scaled_dot_product_flash_attention(q, k, v, 0.25, True, scale=0.5)
    assert result[0] is marker[0] or torch.equal(result[0], marker[0])
    ((args, kwargs),) = fake.calls
    assert args[3:] == (0.25, True, False) and kwargs == {"scale": 0.5} and args[0] is q
    assert recorder.calls == []
    (line,) = [r.getMessage() for r in logged.records if "PyTorch's kernel" in r.getMessage()]
    assert "dropout_p=0.25" in line


def test_a_call_cutefa_refuses_goes_to_pytorchs_kernel(provider, logged, monkeypatch):
    _, handle = provider

    def refuse(*args):
        raise NotImplementedError("no cutefa kernel for this problem")

    monkeypatch.setattr(sdpa_serve, "_dense_forward", refuse)
    fake = _install_original(handle, sdpa_serve._SDPA_FWD, (torch.zeros(1),) * 9)
    q = bhsd()
    aten._scaled_dot_product_flash_attention(q, q, q, 0.0, False)
    assert len(fake.calls) == 1
    assert any("no cutefa kernel for this problem" in r.getMessage() for r in logged.records)


def test_unsupported_head_dims_and_paged_kv_go_to_pytorchs_kernel(provider, logged):
    recorder, handle = provider
    fake_sdpa = _install_original(handle, sdpa_serve._SDPA_FWD, (torch.zeros(1),) * 9)
    fake_flash = _install_original(handle, sdpa_serve._FLASH_FWD, (torch.zeros(1),) * 5)
    q = bhsd(head_dim=84)
    aten._scaled_dot_product_flash_attention(q, q, q, 0.0, False)
    qd = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    aten._flash_attention_forward(qd, qd, qd, None, None, 16, 16, 0.0, False, False, block_table=table)
    assert len(fake_sdpa.calls) == 1 and len(fake_flash.calls) == 1 and recorder.calls == []
    assert fake_flash.calls[0][1]["block_table"] is table  # the options go on unchanged
    lines = [r.getMessage() for r in logged.records if "PyTorch's kernel" in r.getMessage()]
    assert "head dims [84]" in lines[0] and "block_table" in lines[1]


def test_a_backward_with_a_foreign_lse_goes_to_pytorchs_kernel(provider):
    recorder, handle = provider
    fake = _install_original(handle, sdpa_serve._SDPA_BWD, (torch.zeros(1),) * 3)
    q = bhsd()
    padded_lse = torch.zeros(2, 4, 128)  # not (batch, heads, seqlen)
    aten._scaled_dot_product_flash_attention_backward(
        q, q, q, q, q, padded_lse, None, None, 16, 16, 0.0, False, *_empty_rng(), scale=None
    )
    assert len(fake.calls) == 1 and recorder.calls == []


def test_without_a_kernel_of_pytorchs_the_refusal_is_an_error(provider):
    _, handle = provider
    handle.originals[sdpa_serve._SDPA_FWD] = None
    q = bhsd(head_dim=84)
    with pytest.raises(NotImplementedError, match="head dims"):
        aten._scaled_dot_product_flash_attention(q, q, q, 0.0, False)


def test_a_plain_dense_backward_calls_the_ops_implementation_directly(monkeypatch):
    """The SDPA backward of a plain eager call (autograd runs it with grad mode off) goes straight to
    the backward plan, the ``cutefa::flash_bwd`` op's implementation, without the op's dispatch; one
    that must be traced or differentiated again goes through the op."""
    from cutefa.api import backward

    callers = []

    def planned(dout, q, k, v, out, lse, dlse, causal, scale, deterministic):
        callers.append(sys._getframe(1).f_code.co_name)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(backward, "planned_gradients", planned)
    q, k, v, dout, out = (torch.randn(1, 8, 2, 64, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(1, 2, 8)
    with torch.no_grad():
        dq, dk, dv = sdpa_serve._backward(dout, q, k, v, out, lse, True, None, (-1, -1), None)
    assert dk.shape == k.shape
    assert callers == ["_backward"] and dq.shape == q.shape and dv.shape == v.shape
    leaf = q.clone().requires_grad_()
    sdpa_serve._backward(dout, leaf, k, v, out, lse, True, None, (-1, -1), None)
    assert callers == ["_backward", "_flash_bwd"]  # through the op, whose implementation it is
