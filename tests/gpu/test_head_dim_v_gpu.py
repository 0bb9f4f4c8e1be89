"""q/k of head dim 192 against v of 128 (DeepSeek's prefill) through the public forward calls,
``cutefa.flash_attn_func`` and ``cutefa.flash_attn_varlen_func``, against the float32 reference of
tests/gpu/reference.py, on each kernel family this GPU runs (dispatch held to one family at a
time: the sm90 forward on Hopper, the sm80 forward everywhere).

Every input is a slice of a wider buffer whose extra columns hold NaN, so a read past the real head
dim poisons the output; every output the call allocates comes NaN-filled
(test_fwd_sm80.nan_filled_allocations), so an element nothing writes fails. Dense calls are held to
test_fwd_sm80.check_forward's bars (twice PyTorch's own attention's error on the same inputs), packed
ones to test_varlen.judge_forward's; both check out's shape (v's head dim) and the rows that attend
no key (0, lse -inf). Lengths 1, 17 and 1000 against each other, GQA and MQA, causal and not, fp16
and bf16, a packed batch with empty sequences, slack (seqused) and a tail of unused rows, a sliding
window; the call plan a repeated call takes; torch.compile(fullgraph=True) under no_grad. No backward
kernel takes a V head dim of its own yet: asking for a gradient must raise NotImplementedError
naming what is supported, while the forward of inputs that require grad runs.

Run on an H100/H200: ``python -m pytest -q tests/gpu/test_head_dim_v_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from gpu_support import load_sibling
from gpu_support import sm80_skip_reason as _skip_reason

import cutefa
from cutefa import dispatch
from cutefa.api import launch
from cutefa.model.defaults import default_spec
from cutefa.model.spec import families_for_target

ref = load_sibling("reference")
fwd80 = load_sibling("test_fwd_sm80")
vl = load_sibling("test_varlen")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

D, DV = 192, 128
PAD = 8  # NaN columns past each tensor's head dim in its buffer (rows stay 16-byte multiples)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
FAMILIES = ("sm90", "sm80")
# (dtype, causal): one kernel per pair and family
VARIANTS = (("bf16", False), ("bf16", True), ("fp16", True))
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): GQA and MQA, one row, more keys than queries and fewer
SHAPES = (
    (1, 1, 1, 4, 2),
    (2, 17, 17, 4, 4),
    (1, 1000, 1000, 4, 1),
    (1, 17, 1000, 6, 2),
    (2, 1000, 17, 4, 2),
    (1, 1, 1000, 4, 4),
)
# per sequence (seqlen_q, seqlen_k) of a packed batch, and the unused rows after each (seqused)
LENGTHS = [(1, 1), (17, 17), (1000, 1000), (17, 1000), (1000, 17), (0, 5), (5, 0)]
SLACK = [(0, 0), (3, 2), (0, 0), (1, 0), (0, 4), (0, 0), (2, 0)]


@pytest.fixture(params=FAMILIES)
def family(request, monkeypatch):
    """Dispatch held to one kernel family (one that runs on this GPU)."""
    target = dispatch.device_target(torch.device("cuda"))[0]
    if request.param not in families_for_target(target):
        pytest.skip(f"the {request.param} family does not run on {target}")
    monkeypatch.setattr(dispatch, "families_for_target", lambda target: (request.param,))
    dispatch.clear_caches()
    yield request.param
    dispatch.clear_caches()


def poisoned(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into a view of a buffer PAD columns wider whose extra columns hold NaN."""
    buffer = torch.full((*t.shape[:-1], t.shape[-1] + PAD), math.nan, dtype=t.dtype, device=t.device)
    buffer[..., : t.shape[-1]] = t
    return buffer[..., : t.shape[-1]]


def dense_inputs(gen, shape, dtype):
    batch, sq, sk, hq, hkv = shape
    make = lambda s, h, d: poisoned(torch.randn(batch, s, h, d, generator=gen, device="cuda").to(dtype))
    return make(sq, hq, D), make(sk, hkv, D), make(sk, hkv, DV)


def _expected_spec(family, dtype, causal, q, k, v):
    spec = launch.choose(q, k, causal, v=v).spec
    assert spec == default_spec(family, "fwd", dtype, D, causal=causal, head_dim_v=DV), spec.name
    return spec


@pytest.mark.parametrize(("dtype", "causal"), VARIANTS, ids=[f"{d}-{'causal' if c else 'full'}" for d, c in VARIANTS])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_sq{}_sk{}_hq{}_hkv{}".format(*s))
def test_dense_forward_and_its_plan(gen, family, dtype, causal, shape):
    q, k, v = dense_inputs(gen, shape, DTYPES[dtype])
    spec = _expected_spec(family, dtype, causal, q, k, v)
    out, lse = fwd80.poisoned_call(q, k, v, causal=causal)
    assert out.shape == (*q.shape[:-1], DV), tuple(out.shape)
    fwd80.check_forward(q, k, v, causal=causal, out=out, lse=lse, spec=spec)
    # the repeated call takes the plan (its output template of v's head dim): the same result
    again, again_lse = fwd80.poisoned_call(q, k, v, causal=causal)
    torch.cuda.synchronize()
    assert torch.equal(again, out) and torch.equal(again_lse, lse), f"{spec.name}: the planned call differs"


def test_another_v_head_dim_under_one_plan_key(gen, family):
    """q and k of one shape with v of 128 and of 192 in turn: each call gets its own kernel's result."""
    q, k, v = dense_inputs(gen, (1, 300, 300, 4, 2), torch.bfloat16)
    v_same = poisoned(torch.randn(1, 300, 2, D, generator=gen, device="cuda").bfloat16())
    for values in (v, v_same, v, v_same):
        out, lse = fwd80.poisoned_call(q, k, values, causal=True)
        fwd80.check_forward(q, k, values, causal=True, out=out, lse=lse, spec=launch.choose(q, k, True, v=values).spec)


def packed_inputs(gen, dtype, heads_q, heads_kv):
    """test_varlen's packed batch of LENGTHS with slack and a tail, v of head dim DV, all poisoned."""
    p = vl.make_packed(gen, LENGTHS, heads_q, heads_kv, D, dtype, slack=SLACK, tail=(3, 2))
    v = torch.randn(p.k.shape[0], heads_kv, DV, generator=gen, device="cuda").to(dtype)
    unused_k = ~p.rows_k()
    v[unused_k] = 100 + v[unused_k]  # a value no used key has: attending an unused row shows
    return dataclasses.replace(p, q=poisoned(p.q), k=poisoned(p.k), v=poisoned(v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads_q", "heads_kv"), [(4, 2), (3, 3)])
def test_varlen_forward(gen, family, causal, heads_q, heads_kv):
    p = packed_inputs(gen, torch.bfloat16, heads_q, heads_kv)
    tag = f"{family} varlen causal={causal} heads {heads_q}/{heads_kv}"
    with fwd80.nan_filled_allocations():
        out, lse = p.call(causal=causal)
    torch.cuda.synchronize()
    total_q = p.q.shape[0]
    assert out.shape == (total_q, heads_q, DV) and lse.shape == (heads_q, total_q), f"{tag}: {tuple(out.shape)}"
    rows = p.rows_q()
    assert (out[~rows] == 0).all() and torch.isneginf(lse[:, ~rows]).all(), f"{tag}: rows of no sequence"
    with torch.no_grad():
        exact, exact_lse = p.reference(causal=causal)
    has_keys = p.has_keys(causal)[rows]
    vl.judge_forward(
        tag, out[rows], lse[:, rows], exact[rows], exact_lse[:, rows], has_keys, v_absmax=vl.absmax(p.v[p.rows_k()])
    )


@pytest.mark.parametrize("window_size", [(100, 0), (50, 70)])
def test_windowed_forward(gen, family, window_size):
    q, k, v = dense_inputs(gen, (1, 1000, 1000, 4, 2), torch.bfloat16)
    with fwd80.nan_filled_allocations():
        out, lse = cutefa.flash_attn_func(q, k, v, window_size=window_size, return_lse=True)
    torch.cuda.synchronize()
    assert out.shape == (1, 1000, 4, DV)
    exact, exact_lse = ref.attention_ref(q, k, v, window_size=window_size)
    has_keys = torch.ones(1000, dtype=torch.bool, device="cuda")  # the diagonal is in every row's window
    vl.judge_forward(f"{family} window {window_size}", out[0], lse[0], exact[0], exact_lse[0], has_keys)


def _backward_error():
    return pytest.raises(
        NotImplementedError, match=r"backward of attention with head_dim_v=128 .*head_dim=192.*\(192, 128\)"
    )


def test_the_backward_raises_and_the_forward_runs(gen, family):
    q, k, v = (t.detach().requires_grad_() for t in dense_inputs(gen, (1, 17, 1000, 4, 2), torch.bfloat16))
    with torch.inference_mode():
        plain = cutefa.flash_attn_func(q, k, v, causal=True)
    out = cutefa.flash_attn_func(q, k, v, causal=True)
    assert out.requires_grad and torch.equal(out.detach(), plain)
    with _backward_error():
        out.float().sum().backward()
    p = packed_inputs(gen, torch.bfloat16, 4, 2)
    leaves = [t.detach().requires_grad_() for t in (p.q, p.k, p.v)]
    out, _ = p.call(*leaves, causal=False)
    with _backward_error():
        out.float().sum().backward()
    assert all(t.grad is None for t in leaves)


def test_torch_compile_fullgraph_forward(gen, family):
    q, k, v = dense_inputs(gen, (2, 17, 1000, 4, 2), torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: cutefa.flash_attn_func(q, k, v, causal=True) * 2, fullgraph=True)
    with torch.no_grad():
        got = compiled(q, k, v)
        want = cutefa.flash_attn_func(q, k, v, causal=True) * 2
    torch.cuda.synchronize()
    assert got.shape == (2, 17, 4, DV) and torch.equal(got, want)
