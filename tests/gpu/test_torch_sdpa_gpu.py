"""cutefa behind PyTorch's SDPA (cutefa.torch_sdpa) on the GPU: with the provider active, SDPA's
flash backend runs cutefa (forward and backward, causal or not, grouped-query attention, under
torch.compile, and varlen_attn), within twice the error of PyTorch's own flash kernel against a
float32 reference; what cutefa does not serve still runs, on PyTorch's kernel, and each call's
log line says which way it went.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
import torch.nn.functional as F
from gpu_support import sm80_skip_reason
from reference import rel_l2
from torch.nn.attention import SDPBackend, sdpa_kernel

from cutefa import dispatch
from cutefa import torch_sdpa as ts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(sm80_skip_reason() is not None, reason=str(sm80_skip_reason())),
    pytest.mark.skipif(
        not hasattr(torch.nn.attention, "register_flash_attention_impl"),
        reason=f"torch {torch.__version__} has no flash-attention provider registry (torch 2.10 and later)",
    ),
]


@pytest.fixture
def active():
    ts.activate()
    yield
    ts.deactivate()


@pytest.fixture
def lines(caplog):
    """The provider's log lines of the test: ("served" or "pytorch", message)."""
    dispatch.set_logging(True)
    caplog.set_level(logging.INFO, logger="cutefa")
    found = []

    def read():
        found.clear()
        for record in caplog.records:
            text = record.getMessage()
            if text.startswith("cutefa sdpa:"):
                found.append(("served" if "served by cutefa" in text else "pytorch", text))
        return found

    yield read
    dispatch.set_logging(False)


def inputs(gen, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype):
    """q, k, v as SDPA gets them from projections viewed as heads: (batch, heads, seqlen, head_dim)
    views of (batch, seqlen, heads, head_dim) memory."""
    shapes = ((batch, seqlen_q, heads_q), (batch, seqlen_k, heads_kv), (batch, seqlen_k, heads_kv))
    return [
        torch.randn(*s, head_dim, generator=gen, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
        for s in shapes
    ]


def run(q, k, v, grad, causal, **kwargs):
    """(out, dq, dk, dv) of SDPA with only the flash backend allowed."""
    for t in (q, k, v):
        t.grad = None
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1], **kwargs
        )
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def reference(q, k, v, grad, causal):
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(
            q32, k32, v32, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
        )
    out.backward(grad.float())
    return out.detach(), q32.grad, k32.grad, v32.grad


CASES = {
    "bf16-hd128-causal": (2, 1024, 1024, 8, 8, 128, torch.bfloat16, True),
    "bf16-hd128-gqa-causal": (2, 2048, 2048, 8, 2, 128, torch.bfloat16, True),
    "fp16-hd64-gqa": (1, 777, 1500, 16, 4, 64, torch.float16, False),
    "bf16-hd256": (1, 512, 512, 4, 4, 256, torch.bfloat16, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_runs_cutefa_when_active(gen, lines, case):
    batch, sq, sk, hq, hkv, d, dtype, causal = CASES[case]
    q, k, v = inputs(gen, batch, sq, sk, hq, hkv, d, dtype)
    grad = torch.randn(batch, hq, sq, d, generator=gen, device="cuda", dtype=dtype)
    ref = reference(q, k, v, grad, causal)
    theirs = run(q, k, v, grad, causal)
    assert [kind for kind, _ in lines()] == []  # inactive: nothing of ours ran
    ts.activate()
    try:
        ours = run(q, k, v, grad, causal)
    finally:
        ts.deactivate()
    assert [kind for kind, _ in lines()] == ["served", "served"], lines()
    for name, mine, pytorchs, exact in zip(("out", "dq", "dk", "dv"), ours, theirs, ref):
        assert mine.stride() == pytorchs.stride(), name  # the layout of PyTorch's kernel
        assert rel_l2(mine, exact) <= 2 * rel_l2(pytorchs, exact) + 1e-3, name


def test_what_cutefa_does_not_serve_runs_pytorchs_kernel(gen, lines, active):
    # head dim 84: SDPA pads it to 88 before its flash ops, and cutefa serves every multiple of 8
    # forward and backward, so the padded call is cutefa's, with SDPA's result
    q, k, v = inputs(gen, 2, 256, 256, 4, 4, 84, torch.bfloat16)
    grad = torch.randn(2, 4, 256, 84, generator=gen, device="cuda", dtype=torch.bfloat16)
    out, dq, _, _ = run(q, k, v, grad, True)
    ref_out, ref_dq, _, _ = reference(q, k, v, grad, True)
    assert out.shape == q.shape and dq.shape == q.shape
    assert rel_l2(out, ref_out) < 1e-2 and rel_l2(dq, ref_dq) < 2e-2
    kinds = lines()
    assert [kind for kind, _ in kinds] == ["served", "served"] and "88)" in kinds[0][1], kinds

    q, k, v = inputs(gen, 2, 256, 256, 4, 4, 64, torch.bfloat16)
    torch.manual_seed(0)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        dropped = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert dropped.shape == q.shape and torch.isfinite(dropped).all()
    assert "dropout_p=0.5" in lines()[-1][1]


class Attention(torch.nn.Module):
    """A causal self-attention block with grouped-query heads, written against SDPA."""

    def __init__(self, hidden=1024, heads=8, kv_heads=2, head_dim=128):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = torch.nn.Linear(hidden, heads * head_dim, bias=False)
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * head_dim, bias=False)
        self.o = torch.nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        out = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


def test_a_compiled_module_runs_cutefa(gen, lines, active):
    torch.manual_seed(0)
    module = Attention().cuda().to(torch.bfloat16)
    x = torch.randn(2, 1024, 1024, generator=gen, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(module)
    for _ in range(2):  # compile, then the compiled graph again
        module.zero_grad()
        loss = compiled(x).float().square().mean()
        loss.backward()
    compiled_grads = [p.grad.clone() for p in module.parameters()]
    served = [kind for kind, _ in lines()]
    assert served and set(served) == {"served"}, lines()
    ts.deactivate()
    module.zero_grad()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        eager_loss = module(x).float().square().mean()
        eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=2e-2, atol=1e-4)
    for mine, theirs in zip(compiled_grads, (p.grad for p in module.parameters())):
        assert rel_l2(mine, theirs) < 2e-2


@pytest.mark.skipif(
    importlib.util.find_spec("torch.nn.attention.varlen") is None,
    reason=f"torch {torch.__version__} has no varlen_attn",
)
def test_varlen_attn_runs_cutefa(gen, lines):
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
    lengths = [300, 1, 777, 1024]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, longest = sum(lengths), max(lengths)
    q, k, v = (
        torch.randn(total, heads, 128, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for heads in ((8, 2, 2) if gqa else (8, 8, 8))
    )
    grad = torch.randn(total, 8, 128, generator=gen, device="cuda", dtype=torch.bfloat16)

    def both():
        for t in (q, k, v):
            t.grad = None
        out = varlen_attn(q, k, v, cu, cu, longest, longest, **causal, **gqa)
        out.backward(grad)
        return out.detach(), q.grad, k.grad, v.grad

    theirs = both()
    ts.activate()
    try:
        ours = both()
    finally:
        ts.deactivate()
    assert [kind for kind, _ in lines()] == ["served", "served"], lines()
    for name, mine, pytorchs in zip(("out", "dq", "dk", "dv"), ours, theirs):
        assert rel_l2(mine, pytorchs) < 2e-2, name
