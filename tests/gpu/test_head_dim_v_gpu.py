"""q/k of head dim 192 against v of 128 (DeepSeek's prefill) through the public calls,
``cutefa.flash_attn_func`` and ``cutefa.flash_attn_varlen_func``, against the float32 reference of
tests/gpu/reference.py: the forward on each kernel family this GPU runs (dispatch held to one family
at a time: the sm90 forward on Hopper, the sm80 forward everywhere), and the gradients (dQ and dK
over 192 columns, dV and D = rowsum(dO * O) over 128): dense calls on the backward dispatch picks
(the sm90 one on Hopper, tests/gpu/test_bwd_sm90_dv_gpu.py has its own checks; the sm80 one
elsewhere) and on the sm80 one held to, packed calls on the sm80 backward on every GPU.

Every input is a slice of a wider buffer whose extra columns hold NaN, so a read past the real head
dim poisons the output; every output the call allocates comes NaN-filled
(test_fwd_sm80.nan_filled_allocations), so an element nothing writes fails. Dense calls are held to
test_fwd_sm80.check_forward's bars (twice PyTorch's own attention's error on the same inputs), packed
ones to test_varlen.judge_forward's; both check out's shape (v's head dim) and the rows that attend
no key (0, lse -inf). Lengths 1, 17 and 1000 against each other, GQA and MQA, causal and not, fp16
and bf16, a packed batch with empty sequences, slack (seqused) and a tail of unused rows, a sliding
window; the call plan a repeated call takes; torch.compile(fullgraph=True) under no_grad.

Gradients (dq, dk, dv of a loss on out and lse) are judged against the float32 reference's with
test_varlen.judge_grads: a relative error at most 3x that of the same reference computed in the
input dtype, + 1e-3. Dense calls take NaN-poisoned views for q, k, v and dO and write into
NaN-filled allocations (dq, dk, dv and the per-query-head dK/dV of grouped heads); batch 2, lengths
1, 17 and 1000 against each other, causal and not, MHA and GQA 8/2, and deterministic mode; packed
ones a batch with empty sequences, slack and unused rows (whose gradients must be 0). Backward
NotImplementedError remains for an odd pair of head dims, named by the forward's ValueError first.

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
from cutefa.api import backward, feature_bwd, launch
from cutefa.api.features import FeatureArgs
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


# --- the backward ------------------------------------------------------------------------------

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): MHA and GQA 8/2 at lengths 1, 17 and 1000 and sq != sk
BWD_SHAPES = tuple(
    (2, sq, sk, hq, hkv)
    for sq, sk in ((1, 1), (17, 17), (1000, 1000), (17, 1000), (1000, 17))
    for hq, hkv in ((4, 4), (8, 2))
)


def _expected_bwd_spec(dtype, causal):
    """The backward dispatch picks for a dense (192, 128) call on this GPU: the sm90 default on
    Hopper, the sm80 one elsewhere (or where the families are held to it: :func:`bwd_family`)."""
    target = dispatch.device_target(torch.device("cuda"))[0]
    spec = backward.choose_bwd(target, dtype, D, causal, head_dim_v=DV)
    token = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    family = "sm90" if "sm90" in backward.families_for_target(target) else "sm80"
    assert spec == default_spec(family, "bwd", token, D, causal=causal, head_dim_v=DV), spec.name
    return spec


@pytest.fixture(params=["dispatched", "sm80"])
def bwd_family(request, monkeypatch):
    """The backward families as dispatch has them on this GPU, or held to the sm80 one (which a
    Hopper GPU runs for packed calls only)."""
    if request.param == "sm80":
        monkeypatch.setattr(backward, "families_for_target", lambda target: ("sm80",))
    dispatch.clear_caches()  # (the call plans keep the variant they chose)
    yield request.param
    dispatch.clear_caches()


def _dense_grads(q, k, v, dout, dlse, causal, deterministic=False):
    """(dq, dk, dv) of the call on ``q``, ``k``, ``v`` (views of poisoned buffers, kept as they are)
    with out's gradient ``dout`` and lse's ``dlse``, every allocation NaN-filled."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with fwd80.nan_filled_allocations():
        out, lse = cutefa.flash_attn_func(
            *leaves, causal=causal, return_lse=True, deterministic=deterministic
        )
        assert out.shape == (*q.shape[:-1], DV)
        torch.autograd.backward([out, lse], [dout, dlse])
    torch.cuda.synchronize()
    return [t.grad for t in leaves]


def _reference_grads(q, k, v, dout, dlse, causal, compute_dtype):
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    out, lse = ref.attention_ref(*leaves, causal=causal, compute_dtype=compute_dtype)
    torch.autograd.backward([out, lse], [dout.to(compute_dtype), dlse.to(compute_dtype)])
    return [t.grad for t in leaves]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=lambda s: "b{}_sq{}_sk{}_hq{}_hkv{}".format(*s))
def test_dense_backward(gen, bwd_family, causal, shape):
    dtype = torch.bfloat16
    spec = _expected_bwd_spec(dtype, causal)
    q, k, v = dense_inputs(gen, shape, dtype)
    batch, sq, sk, hq, _ = shape
    dout = poisoned(torch.randn(batch, sq, hq, DV, generator=gen, device="cuda").to(dtype))
    # lse's gradient on the rows that attend a key (a row of none has lse -inf and no slope)
    rows = torch.arange(sq, device="cuda")
    has_key = rows + sk - sq >= 0 if causal else rows >= 0
    dlse = torch.randn(batch, hq, sq, generator=gen, device="cuda") * has_key
    got = _dense_grads(q, k, v, dout, dlse, causal)
    assert [tuple(g.shape) for g in got] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    exact = _reference_grads(q, k, v, dout, dlse, causal, torch.float32)
    base = _reference_grads(q, k, v, dout, dlse, causal, dtype)
    vl.judge_grads(f"{spec.name} {shape}", got, exact, base)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_backward_is_reproducible(gen, bwd_family, causal):
    dtype = torch.float16
    _expected_bwd_spec(dtype, causal)
    q, k, v = dense_inputs(gen, (2, 1000, 1000, 8, 2), dtype)
    dout = poisoned(torch.randn(2, 1000, 8, DV, generator=gen, device="cuda").to(dtype))
    dlse = torch.zeros(2, 8, 1000, device="cuda")
    first = _dense_grads(q, k, v, dout, dlse, causal, deterministic=True)
    second = _dense_grads(q, k, v, dout, dlse, causal, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "deterministic gradients differ"
    exact = _reference_grads(q, k, v, dout, dlse, causal, torch.float32)
    base = _reference_grads(q, k, v, dout, dlse, causal, dtype)
    vl.judge_grads(f"deterministic causal={causal}", first, exact, base)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("heads_q", "heads_kv"), [(4, 4), (8, 2)])
def test_varlen_backward(gen, causal, heads_q, heads_kv):
    """A packed batch with empty sequences, slack and a tail (test_varlen.check_varlen_grads: rows of
    no sequence get zero gradients): the sm80 backward on every GPU (the sm90 template that takes
    the pair takes no packed batch)."""
    target = dispatch.device_target(torch.device("cuda"))[0]
    f = dataclasses.replace(FeatureArgs(), cu_seqlens_q=torch.zeros(2, dtype=torch.int32))
    spec = feature_bwd.choose_bwd(target, torch.bfloat16, D, causal, f, seqlen_k=1000, head_dim_v=DV)
    assert spec.arch == "sm80" and spec.features.varlen, spec.name
    p = packed_inputs(gen, torch.bfloat16, heads_q, heads_kv)
    tag = f"varlen causal={causal} heads {heads_q}/{heads_kv}"
    dq, dk, dv = vl.check_varlen_grads(tag, p, gen, causal=causal)[:3]
    assert dq.shape[-1] == dk.shape[-1] == D and dv.shape[-1] == DV


def test_torch_compile_fullgraph_forward(gen, family):
    q, k, v = dense_inputs(gen, (2, 17, 1000, 4, 2), torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: cutefa.flash_attn_func(q, k, v, causal=True) * 2, fullgraph=True)
    with torch.no_grad():
        got = compiled(q, k, v)
        want = cutefa.flash_attn_func(q, k, v, causal=True) * 2
    torch.cuda.synchronize()
    assert got.shape == (2, 17, 4, DV) and torch.equal(got, want)
