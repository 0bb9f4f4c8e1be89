"""Forward correctness of cutefa on a CUDA GPU against an exact float32 reference.

Each result is judged against what PyTorch's own attention (SDPA, math backend) gets on the same
fp16/bf16 inputs: cutefa's relative L2 error must be at most twice SDPA's (with a small floor), its
largest element error at most twice SDPA's plus the rounding of the output dtype, and the
log-sum-exp must match. Rows that attend no key must be exactly 0 with lse = -inf.

Cases are ordered variant by variant (dtype, head_dim, causal) so each kernel variant is compiled
once and then reused by every shape.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm80_skip_reason as _skip_reason

import cutefa

ref = _load("reference")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEAD_DIMS = (64, 96, 128, 192, 256)
SEQLENS = ((1, 1), (17, 17), (1000, 1000), (4097, 4097), (17, 1000), (1000, 17), (128, 4097), (1, 4097))
HEADS = 3  # odd on purpose: a head-indexing slip shows up


def make_inputs(gen, batch, sq, sk, hq, hkv, d, dtype):
    q = torch.randn(batch, sq, hq, d, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, hkv, d, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, hkv, d, generator=gen, device="cuda", dtype=dtype)
    return q, k, v


def poison_free_memory(q, v):
    """Leave NaN in the allocator's free blocks of the output's and lse's sizes before a call.

    The API allocates its own outputs, so they cannot be pre-filled; but the caching allocator
    usually hands back a just-freed block of the same size, so an element the kernel never writes
    then reads NaN (not a stale, possibly correct value from an earlier call) and fails the checks.
    """
    batch, sq, hq, _ = q.shape
    shapes = (((batch, sq, hq, v.shape[-1]), q.dtype), ((batch, hq, sq), torch.float32))
    junk = [
        torch.full(shape, math.nan, dtype=dtype, device=q.device) for shape, dtype in shapes for _ in range(3)
    ]
    del junk


def _worst_row(out, expect):
    """(batch, row, head) of the largest error, for the failure message."""
    err = (out.float() - expect).abs().amax(dim=-1)
    err = torch.nan_to_num(err, nan=math.inf)
    flat = int(err.argmax())
    b, rest = divmod(flat, err.shape[1] * err.shape[2])
    i, h = divmod(rest, err.shape[2])
    got, want = out[b, i, h, :4].tolist(), expect[b, i, h, :4].tolist()
    return f"worst at (batch={b}, row={i}, head={h}): got {got}... expected {want}..."


def check_forward(q, k, v, *, causal, softmax_scale=None, out=None, lse=None):
    """Run cutefa (unless out/lse are given) and hold it to the reference. Returns (out, lse)."""
    batch, sq, hq, d = q.shape
    sk = k.shape[1]
    if out is None:
        poison_free_memory(q, v)
        out, lse = cutefa.flash_attn_func(
            q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True
        )
    torch.cuda.synchronize()
    tag = f"{q.dtype} b={batch} sq={sq} sk={sk} hq={hq} hkv={k.shape[2]} d={d} causal={causal}"

    assert out.shape == (batch, sq, hq, v.shape[-1]), f"{tag}: out shape {tuple(out.shape)}"
    assert out.dtype == q.dtype and out.device == q.device, f"{tag}: out is {out.dtype} on {out.device}"
    assert lse.shape == (batch, hq, sq), f"{tag}: lse shape {tuple(lse.shape)}"
    assert lse.dtype == torch.float32, f"{tag}: lse dtype {lse.dtype}"

    expect, expect_lse = ref.attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale)
    base = ref.sdpa_baseline(q, k, v, causal=causal, softmax_scale=softmax_scale)

    assert torch.isfinite(out).all(), f"{tag}: non-finite output; {_worst_row(out, expect)}"
    n_empty = ref.empty_rows(sq, sk, causal)
    if n_empty:
        assert (out[:, :n_empty] == 0).all(), f"{tag}: rows attending no key must be 0"
        assert torch.isneginf(lse[:, :, :n_empty]).all(), f"{tag}: rows attending no key must have lse -inf"
    live = lse[:, :, n_empty:]
    assert torch.isfinite(live).all(), f"{tag}: lse not finite on rows that attend keys"

    err, base_err = ref.rel_l2(out, expect), ref.rel_l2(base, expect)
    tol = max(2 * base_err, 1e-3)
    assert err <= tol, (
        f"{tag}: rel L2 error {err:.3g} > {tol:.3g} (SDPA {base_err:.3g}); {_worst_row(out, expect)}"
    )

    worst, base_worst = ref.max_abs(out, expect), ref.max_abs(base, expect)
    atol = 2 * base_worst + 2 * ref.rounding_error(expect, q.dtype)
    assert worst <= atol, f"{tag}: max abs error {worst:.3g} > {atol:.3g}; {_worst_row(out, expect)}"

    lse_err = (live - expect_lse[:, :, n_empty:]).abs()
    lse_tol = 1e-2 * expect_lse[:, :, n_empty:].abs().clamp(min=1.0)
    bad = ~(lse_err <= lse_tol)  # NaN counts as bad
    assert not bad.any(), f"{tag}: lse error up to {lse_err.max().item():.3g} on {int(bad.sum())} rows"
    return out, lse


def _grid():
    """Every (dtype, head_dim, causal) variant, each followed by all its shapes."""
    for dname in DTYPES:
        for d in HEAD_DIMS:
            for causal in (False, True):
                for sq, sk in SEQLENS:
                    batch = 1 if sq * sk > 4_000_000 else 2
                    yield pytest.param(
                        dname,
                        d,
                        causal,
                        batch,
                        sq,
                        sk,
                        id=f"{dname}-hd{d}-{'causal' if causal else 'full'}-{sq}x{sk}",
                    )


@pytest.mark.parametrize("dname,d,causal,batch,sq,sk", list(_grid()))
def test_forward_grid(gen, dname, d, causal, batch, sq, sk):
    q, k, v = make_inputs(gen, batch, sq, sk, HEADS, HEADS, d, DTYPES[dname])
    check_forward(q, k, v, causal=causal)


GQA_SHAPES = ((1000, 1000), (17, 1000), (1000, 17), (1, 4097))


@pytest.mark.parametrize("hkv", [2, 1])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", GQA_SHAPES, ids=[f"{a}x{b}" for a, b in GQA_SHAPES])
@pytest.mark.parametrize("dname,d", [("bf16", 128), ("fp16", 64)])
def test_forward_gqa(gen, dname, d, sq, sk, causal, hkv):
    q, k, v = make_inputs(gen, 2, sq, sk, 8, hkv, d, DTYPES[dname])
    check_forward(q, k, v, causal=causal)


@pytest.mark.parametrize("pattern", ["offset_values", "rising_scores", "falling_scores"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_inputs_that_expose_wrong_results(gen, pattern, causal):
    """Inputs under which an unwritten, stale or unrescaled output cannot pass.

    offset_values: every value is about 4, so each output row is near 4 everywhere and a row left
    at 0 or garbage stands out; rising/falling_scores: a large score trend along the keys moves the
    row maximum on every key tile (or never), so a missing online-softmax rescale is off by
    a factor of e^20 or more.
    """
    dtype, d, sq, sk = torch.bfloat16, 128, 1000, 3000
    q, k, v = make_inputs(gen, 2, sq, sk, 4, 2, d, dtype)
    if pattern == "offset_values":
        v = (4.0 + 0.5 * v.float()).to(dtype)
    else:
        trend = torch.linspace(-16.0, 16.0, sk, device="cuda")
        if pattern == "falling_scores":
            trend = trend.flip(0)
        q[..., 0] = 16.0
        k[..., 0] = trend[None, :, None].to(dtype)
    out, _ = check_forward(q, k, v, causal=causal)
    # attention output is a convex combination of value rows: it stays inside their per-column range
    n_empty = ref.empty_rows(sq, sk, causal)
    for b in range(out.shape[0]):
        for h in range(out.shape[2]):
            vb = v[b, :, h // 2].float()
            o = out[b, n_empty:, h].float()
            slack = 1e-2 * vb.abs().max()
            assert (o >= vb.amin(0) - slack).all() and (o <= vb.amax(0) + slack).all(), (
                f"{pattern}: output of (batch {b}, head {h}) leaves the range of the values"
            )


def test_repeated_runs_are_bitwise_identical(gen):
    q, k, v = make_inputs(gen, 2, 1000, 1000, 8, 2, 128, torch.bfloat16)
    first, first_lse = cutefa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    check_forward(q, k, v, causal=True, out=first, lse=first_lse)
    for i in range(20):
        poison_free_memory(q, v)
        out, lse = cutefa.flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert torch.equal(out.view(torch.int16), first.view(torch.int16)), f"run {i} differs from run 0"
        assert torch.equal(lse.view(torch.int32), first_lse.view(torch.int32)), f"run {i} lse differs"


def _layouts(gen, batch, sq, sk, h, d, dtype):
    """Non-contiguous (q, k, v) triples, each the same logical layout (batch, seqlen, heads, dim)."""
    # views of (batch, heads, seqlen, dim) tensors
    q, k, v = (torch.randn(batch, h, s, d, generator=gen, device="cuda", dtype=dtype) for s in (sq, sk, sk))
    yield "transposed", (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    # packed qkv projection output (batch, seqlen, 3, heads, dim)
    qkv = torch.randn(batch, sq, 3, h, d, generator=gen, device="cuda", dtype=dtype)
    yield "packed_qkv", (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
    # every other token of a longer sequence, and the first half of a wider head
    big = torch.randn(3, batch, 2 * sq, h, 2 * d, generator=gen, device="cuda", dtype=dtype)
    yield "strided_slices", (big[0, :, ::2, :, :d], big[1, :, ::2, :, d:], big[2, :, 1::2, :, :d])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_non_contiguous_inputs(gen, causal):
    for name, (q, k, v) in _layouts(gen, 2, 300, 300, 4, 128, torch.bfloat16):
        assert not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()), name
        out, _ = check_forward(q, k, v, causal=causal)
        dense = cutefa.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal)
        assert ref.rel_l2(out, dense.float()) <= 1e-2, f"{name}: differs from the contiguous-input result"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softmax_scale_is_honoured(gen, causal):
    q, k, v = make_inputs(gen, 2, 500, 700, 4, 4, 64, torch.float16)
    default = cutefa.flash_attn_func(q, k, v, causal=causal)
    for scale in (0.3, 0.02, 1.0 / math.sqrt(64)):
        out, _ = check_forward(q, k, v, causal=causal, softmax_scale=scale)
        moved = ref.rel_l2(out, default.float())
        if scale == 1.0 / math.sqrt(64):
            assert moved <= 1e-3, f"softmax_scale=1/sqrt(d) should equal the default, differs by {moved:.3g}"
        else:
            assert moved > 5e-2, f"softmax_scale={scale} barely changed the output (rel diff {moved:.3g})"


def test_return_lse_false_returns_the_same_output(gen):
    q, k, v = make_inputs(gen, 1, 257, 513, 4, 4, 128, torch.bfloat16)
    out = cutefa.flash_attn_func(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor), f"return_lse=False must return a tensor, got {type(out)}"
    out2, _ = cutefa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16))


def test_explain_names_a_variant(gen):
    q, k, v = make_inputs(gen, 1, 128, 128, 4, 4, 128, torch.bfloat16)
    text = cutefa.explain(q, k, v, causal=True)
    assert isinstance(text, str) and "cutefa_" in text and "hd128" in text, text
