"""Every head dim that is a multiple of 8 from 8 to 256 on the sm80 family, and q/k of 192 against v
of 128 (DeepSeek's prefill), against the float32 reference of tests/gpu/reference.py.

The forward kernels are called directly (``cutefa.loader.get_kernel``: the sm80 default of each head
dim, whatever family dispatch would pick on this GPU), with every tensor a slice of a wider buffer
whose extra columns hold NaN: q, k and v so that a read past the real head dim poisons the output,
and the output so that a write past the real (V) head dim shows (the pad columns must stay NaN).
Outputs start NaN-filled, so an element the kernel does not write fails. The backward goes through
``cutefa.flash_attn_func`` (autograd; dispatch passes over the families that do not take the head
dim) at every head dim: the sm80 backward pads the others to its tile head dim. Its inputs (q, k,
v and dout) are views of NaN-padded buffers too, so that a read past the real head dim poisons
the gradients; a write past it lands in the next row's or head's columns of a gradient, which the
comparison catches.

Error bars (FlashAttention's rule, as tests/gpu/test_sm80_features_kernels.py): at most twice the
error of the same reference computed in the inputs' dtype, plus the output dtype's rounding.

The default run takes a sample of head dims; ``CUTEFA_FULL_GPU_TESTS=1`` (the full GPU suite) takes
all 32.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from gpu_support import load_sibling
from gpu_support import sm80_skip_reason as _skip_reason

import cutefa
from cutefa import dispatch
from cutefa.loader import get_kernel
from cutefa.model.defaults import default_spec
from cutefa.model.rules import why_invalid
from cutefa.model.spec import Features

ref = load_sibling("reference")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

FULL = os.environ.get("CUTEFA_FULL_GPU_TESTS", "") not in ("", "0")
ALL_HEAD_DIMS = tuple(range(8, 257, 8))
SAMPLE = (8, 32, 40, 72, 80, 112, 136, 160, 200, 248)
HEAD_DIMS = ALL_HEAD_DIMS if FULL else SAMPLE
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
PAD = 8  # NaN columns past each tensor's head dim in its buffer (rows stay 16-byte multiples)
HEADS_Q, HEADS_KV = 4, 2
# (batch, seqlen_q, seqlen_k): partial tiles on both sides, one row, more keys than queries and fewer
SHAPES = ((2, 200, 333), (1, 1, 77), (1, 300, 64))


def _target() -> str:
    return dispatch.device_target(torch.device("cuda"))[0]


def _poisoned(gen, shape, dim, dtype, fill_random=True):
    """(view, buffer): a (*shape, dim) view of a (*shape, dim + PAD) NaN buffer, random unless not
    ``fill_random``."""
    buffer = torch.full((*shape, dim + PAD), math.nan, dtype=dtype, device="cuda")
    view = buffer[..., :dim]
    if fill_random:
        view.copy_(torch.randn(*shape, dim, generator=gen, device="cuda").to(dtype))
    return view, buffer


def _check_out(out, lse, ref_out, ref_lse, low_out, dtype, where):
    assert not torch.isnan(out).any(), f"{where}: unwritten (NaN) or poisoned output"
    assert not torch.isnan(lse).any(), f"{where}: unwritten (NaN) lse"
    bound = 2 * ref.max_abs(low_out, ref_out) + ref.rounding_error(ref_out, dtype) + 1e-5
    err = ref.max_abs(out, ref_out)
    assert err <= bound, f"{where}: out max error {err} > {bound}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{where}: rows with no key differ"
    lse_err = (lse[finite].double() - ref_lse[finite].double()).abs()
    assert (lse_err <= 1e-3 * (1 + ref_lse[finite].double().abs())).all(), (
        f"{where}: lse error {lse_err.max()}"
    )


def _forward_direct(gen, spec, shape):
    """The kernel of ``spec`` on NaN-padded dense inputs; checks the pad and the values."""
    dtype, d, dv = DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v
    assert why_invalid(spec) is None, why_invalid(spec)
    kernel = get_kernel(spec, _target())
    batch, sq, sk = shape
    scale = 1.0 / math.sqrt(d)
    q, _ = _poisoned(gen, (batch, sq, HEADS_Q), d, dtype)
    k, _ = _poisoned(gen, (batch, sk, HEADS_KV), d, dtype)
    v, _ = _poisoned(gen, (batch, sk, HEADS_KV), dv, dtype)
    out, out_buffer = _poisoned(gen, (batch, sq, HEADS_Q), dv, dtype, fill_random=False)
    lse = torch.full((batch, HEADS_Q, sq), math.nan, device="cuda")
    kernel(q, k, v, out, lse, scale)
    torch.cuda.synchronize()
    where = f"{spec.name} shape {shape}"
    assert out_buffer[..., dv:].isnan().all(), f"{where}: a pad column of out past head dim {dv} was written"
    ref_out, ref_lse = ref.attention_ref(q, k, v, causal=spec.causal, softmax_scale=scale)
    low_out, _ = ref.attention_ref(q, k, v, causal=spec.causal, softmax_scale=scale, compute_dtype=dtype)
    _check_out(out, lse, ref_out, ref_lse, low_out, dtype, where)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"hd{d}")
def test_forward_kernel(gen, head_dim, dtype, causal):
    spec = default_spec("sm80", "fwd", dtype, head_dim, causal=causal)
    for shape in SHAPES:
        _forward_direct(gen, spec, shape)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_kernel_192_128(gen, dtype, causal):
    spec = default_spec("sm80", "fwd", dtype, 192, causal=causal, head_dim_v=128)
    assert spec.name.startswith(f"cutefa_sm80_fwd_{dtype}_hd192v128_")
    for shape in SHAPES:
        _forward_direct(gen, spec, shape)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_kernel_192_128_varlen(gen, causal):
    """The packed layout: rows of no sequence (slack between spans) 0 / -inf (the module's fill),
    the pad columns NaN."""
    spec = default_spec("sm80", "fwd", "bf16", 192, causal=causal, head_dim_v=128)
    spec = spec.replace(features=Features(varlen=True))
    assert why_invalid(spec) is None, why_invalid(spec)
    kernel = get_kernel(spec, _target())
    dtype, d, dv = torch.bfloat16, 192, 128
    lens = ((1, 1), (17, 300), (300, 17), (0, 5), (129, 129))
    slack = 3
    starts_q = [0]
    starts_k = [0]
    for sq, sk in lens:
        starts_q.append(starts_q[-1] + sq + slack)
        starts_k.append(starts_k[-1] + sk + slack)
    q, _ = _poisoned(gen, (starts_q[-1], HEADS_Q), d, dtype)
    k, _ = _poisoned(gen, (starts_k[-1], HEADS_KV), d, dtype)
    v, _ = _poisoned(gen, (starts_k[-1], HEADS_KV), dv, dtype)
    out, out_buffer = _poisoned(gen, (starts_q[-1], HEADS_Q), dv, dtype, fill_random=False)
    lse = torch.full((HEADS_Q, starts_q[-1]), math.nan, device="cuda")
    cu_q = torch.tensor(starts_q, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(starts_k, dtype=torch.int32, device="cuda")
    used_q = torch.tensor([sq for sq, _ in lens], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([sk for _, sk in lens], dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(d)
    kernel(q, k, v, out, lse, scale, cu_q, cu_k, used_q, used_k, max(sq for sq, _ in lens))
    torch.cuda.synchronize()
    assert out_buffer[..., dv:].isnan().all(), f"{spec.name}: a pad column of out was written"
    written = ref.used_rows(cu_q, used_q, starts_q[-1], q.device)
    assert (out[~written] == 0).all() and torch.isneginf(lse[:, ~written]).all(), (
        "rows of no sequence: not 0 / -inf"
    )
    ref_out, ref_lse = ref.varlen_ref(
        q, k, v, cu_q, cu_k, seqused_q=used_q, seqused_k=used_k, causal=causal, softmax_scale=scale
    )
    low_out, _ = ref.varlen_ref(
        q, k, v, cu_q, cu_k, seqused_q=used_q, seqused_k=used_k, causal=causal, softmax_scale=scale,
        compute_dtype=dtype,
    )  # fmt: skip
    _check_out(
        out[written],
        lse[:, written],
        ref_out[written],
        ref_lse[:, written],
        low_out[written],
        dtype,
        spec.name,
    )


@pytest.mark.parametrize("head_dim", (40, 80, 200), ids=lambda d: f"hd{d}")
def test_forward_kernel_features(gen, head_dim):
    """A padded head dim with the local window, softcap, ALiBi and sinks through the API (whichever
    family dispatch picks), inputs NaN-padded."""
    dtype = torch.bfloat16
    batch, sq, sk = 2, 150, 260
    q, _ = _poisoned(gen, (batch, sq, HEADS_Q), head_dim, dtype)
    k, _ = _poisoned(gen, (batch, sk, HEADS_KV), head_dim, dtype)
    v, _ = _poisoned(gen, (batch, sk, HEADS_KV), head_dim, dtype)
    slopes = torch.rand(batch, HEADS_Q, generator=gen, device="cuda") * 0.1
    sinks = torch.randn(HEADS_Q, generator=gen, device="cuda")
    opts = {"window_size": (64, 16), "softcap": 20.0, "alibi_slopes": slopes}
    out, lse = cutefa.flash_attn_func(q, k, v, causal=False, sinks=sinks, return_lse=True, **opts)
    ref_out, ref_lse = ref.attention_ref(q, k, v, sinks=sinks, **opts)
    low_out, _ = ref.attention_ref(q, k, v, sinks=sinks, compute_dtype=dtype, **opts)
    # tanh.approx moves a capped score by up to softcap * 2**-11: the lse bound of the features test
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    bound = 2 * ref.max_abs(low_out, ref_out) + ref.rounding_error(ref_out, dtype) + 1e-5
    assert ref.max_abs(out, ref_out) <= bound
    finite = torch.isfinite(ref_lse)
    err = (lse[finite].double() - ref_lse[finite].double()).abs()
    assert (err <= 1e-3 * (1 + ref_lse[finite].double().abs()) + 20.0 * 2.0**-10).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"hd{d}")
def test_api_forward_and_backward(gen, head_dim, causal):
    """flash_attn_func at every head dim, inputs NaN-padded: the forward and the gradients against
    the reference."""
    _api_forward_and_backward(gen, head_dim, causal=causal)


@pytest.mark.parametrize("head_dim", (8, 40, 80, 112, 200), ids=lambda d: f"hd{d}")
def test_api_backward_features(gen, head_dim):
    """A padded backward with the local window, softcap and ALiBi (the sm80 backward's feature
    axes), inputs NaN-padded."""
    slopes = torch.rand(2, HEADS_Q, generator=gen, device="cuda") * 0.1
    _api_forward_and_backward(gen, head_dim, window_size=(64, 16), softcap=20.0, alibi_slopes=slopes)


def _api_forward_and_backward(gen, head_dim, **opts):
    dtype = torch.bfloat16
    batch, sq, sk = 2, 130, 190
    q, _ = _poisoned(gen, (batch, sq, HEADS_Q), head_dim, dtype)
    k, _ = _poisoned(gen, (batch, sk, HEADS_KV), head_dim, dtype)
    v, _ = _poisoned(gen, (batch, sk, HEADS_KV), head_dim, dtype)
    q0, k0, v0 = (t.detach() for t in (q, k, v))
    for t in (q, k, v):
        t.requires_grad_()  # leaves: views of the NaN-padded buffers
    out = cutefa.flash_attn_func(q, k, v, **opts)
    assert out.shape == (batch, sq, HEADS_Q, head_dim)
    ref_q, ref_k, ref_v = (t.float().requires_grad_() for t in (q0, k0, v0))
    low_q, low_k, low_v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    ref_out, _ = ref.attention_ref(ref_q, ref_k, ref_v, **opts)
    low_out, _ = ref.attention_ref(low_q, low_k, low_v, compute_dtype=dtype, **opts)
    bound = 2 * ref.max_abs(low_out, ref_out) + ref.rounding_error(ref_out, dtype) + 1e-5
    if "softcap" in opts:
        bound += 20.0 * 2.0**-10  # tanh.approx (the features test's allowance)
    assert ref.max_abs(out, ref_out) <= bound
    dout, _ = _poisoned(gen, out.shape[:-1], head_dim, dtype)
    out.backward(dout)
    ref_out.backward(dout.float())
    low_out.backward(dout)
    for name, got, want, low in (
        ("dq", q.grad, ref_q.grad, low_q.grad), ("dk", k.grad, ref_k.grad, low_k.grad),
        ("dv", v.grad, ref_v.grad, low_v.grad),
    ):  # fmt: skip
        assert got.shape == want.shape and not torch.isnan(got).any(), f"{name}: NaN"
        bound = 2 * ref.max_abs(low, want) + ref.rounding_error(want, dtype) + 1e-4
        assert ref.max_abs(got, want) <= bound, f"{name}: {ref.max_abs(got, want)} > {bound}"
