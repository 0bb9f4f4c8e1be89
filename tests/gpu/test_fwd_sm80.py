"""Forward correctness of cutefa on a CUDA GPU against an exact (float64) reference.

Each result is judged against that reference and what PyTorch's own attention (SDPA,
math backend) gets on the same fp16/bf16 inputs: cutefa's relative L2 error must be at most twice
SDPA's (with a small floor), its largest element error at most twice SDPA's plus the rounding of the
output dtype. The log-sum-exp is computed in float32 from the same inputs, so it is held to a
float32 bound: at most 8 times the error of the reference computed in float32, plus 32 float32
ulps of its magnitude (and, for a variant that evaluates part of its exp2 by a polynomial, that
polynomial's relative error). Rows that attend no key must be exactly 0 with lse = -inf. Outputs
are NaN-filled when the call allocates them (:func:`nan_filled_allocations`), so an element the
kernel does not write fails.

Cases are ordered variant by variant (dtype, head_dim, causal) so each kernel variant is compiled
once and then reused by every shape.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm80_skip_reason as _skip_reason

import cutefa
from cutefa.api import launch

ref = _load("reference")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEAD_DIMS = (64, 96, 128, 192, 256)
SEQLENS = ((1, 1), (17, 17), (1000, 1000), (4097, 4097), (17, 1000), (1000, 17), (128, 4097), (1, 4097))
HEADS = 3  # odd on purpose: a head-indexing slip shows up
# The lse bound (see the module docstring). The kernels' scores are float32 sums on the tensor cores
# (other orders and roundings than the reference's), their exp2 and log2 MUFU approximations
# (relative errors ~2^-22); 8x the float32 reference's own error and 32 ulps cover those.
LSE_FACTOR = 8
LSE_ULPS = 32
FLOAT32_ULP = 2.0**-23  # float32's spacing at 1
# cutefa/kernels/common/exp2.py: exp2 on the FMA units (a variant's exp_emu percent of its scores),
# relative error 7.5e-5; a relative error e on probabilities moves the lse by at most -log(1 - e).
EXP2_POLY_ERROR = 7.5e-5


def make_inputs(gen, batch, sq, sk, hq, hkv, d, dtype):
    q = torch.randn(batch, sq, hq, d, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, hkv, d, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, hkv, d, generator=gen, device="cuda", dtype=dtype)
    return q, k, v


@contextlib.contextmanager
def nan_filled_allocations():
    """Every tensor torch allocates without initializing (``torch.empty``, ``empty_like``: the
    outputs of a call, on its validating way and its call plan alike) comes filled with NaN, so an
    element the kernel never writes reads NaN and fails the checks (torch's deterministic mode with
    ``fill_uninitialized_memory``, warnings only, around the call alone)."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        probe = torch.empty(8, device="cuda")
        assert torch.isnan(probe).all(), "uninitialized allocations are not NaN-filled"
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]


def poisoned_call(q, k, v, **kwargs):
    """``cutefa.flash_attn_func(q, k, v, return_lse=True, **kwargs)`` writing into NaN-filled outputs."""
    with nan_filled_allocations():
        return cutefa.flash_attn_func(q, k, v, return_lse=True, **kwargs)


def exp2_error(spec):
    """The relative error of variant ``spec``'s exp2 beyond float32 rounding: the FMA polynomial's
    where the variant evaluates part of its exp2 with it, else 0 (MUFU.EX2: within the ulps)."""
    return EXP2_POLY_ERROR if getattr(spec.options, "exp_emu", 0) else 0.0


def _worst_row(out, expect):
    """(batch, row, head) of the largest error, for the failure message."""
    err = (out.float() - expect).abs().amax(dim=-1)
    err = torch.nan_to_num(err, nan=math.inf)
    flat = int(err.argmax())
    b, rest = divmod(flat, err.shape[1] * err.shape[2])
    i, h = divmod(rest, err.shape[2])
    got, want = out[b, i, h, :4].tolist(), expect[b, i, h, :4].tolist()
    return f"worst at (batch={b}, row={i}, head={h}): got {got}... expected {want}..."


def check_forward(q, k, v, *, causal, softmax_scale=None, out=None, lse=None, spec=None):
    """Run cutefa (unless out/lse are given) on NaN-filled outputs and hold it to the reference.
    ``spec``: the variant that wrote out/lse (for its exp2's error); by default the variant dispatch
    picks for an API call, and for given out/lse any variant's (the polynomial's error allowed).
    Returns (out, lse)."""
    batch, sq, hq, d = q.shape
    sk = k.shape[1]
    if out is None:
        out, lse = poisoned_call(q, k, v, causal=causal, softmax_scale=softmax_scale)
        spec = launch.choose(q, k, causal).spec if spec is None else spec
    torch.cuda.synchronize()
    tag = f"{q.dtype} b={batch} sq={sq} sk={sk} hq={hq} hkv={k.shape[2]} d={d} causal={causal}"

    assert out.shape == (batch, sq, hq, v.shape[-1]), f"{tag}: out shape {tuple(out.shape)}"
    assert out.dtype == q.dtype and out.device == q.device, f"{tag}: out is {out.dtype} on {out.device}"
    assert lse.shape == (batch, hq, sq), f"{tag}: lse shape {tuple(lse.shape)}"
    assert lse.dtype == torch.float32, f"{tag}: lse dtype {lse.dtype}"

    expect, expect_lse = ref.attention_ref(
        q, k, v, causal=causal, softmax_scale=softmax_scale, compute_dtype=torch.float64
    )
    _, float32_lse = ref.attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale)
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

    exact_lse = expect_lse[:, :, n_empty:]
    lse_err = ref.max_abs(live, exact_lse)
    float32_err = ref.max_abs(float32_lse[:, :, n_empty:], exact_lse)
    magnitude = max(1.0, exact_lse.abs().max().item()) if exact_lse.numel() else 1.0
    lse_tol = (
        LSE_FACTOR * float32_err
        + LSE_ULPS * FLOAT32_ULP * magnitude
        + (EXP2_POLY_ERROR if spec is None else exp2_error(spec))
    )
    assert lse_err <= lse_tol, (  # NaN fails
        f"{tag}: lse error {lse_err:.3g} > {lse_tol:.3g} (float32 reference {float32_err:.3g}, |lse| up to "
        f"{magnitude:.3g})"
    )
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
    """The first call (the validating way) and 20 more (the call plan), each into NaN-filled outputs."""
    q, k, v = make_inputs(gen, 2, 1000, 1000, 8, 2, 128, torch.bfloat16)
    first, first_lse = poisoned_call(q, k, v, causal=True)
    check_forward(q, k, v, causal=True, out=first, lse=first_lse, spec=launch.choose(q, k, True).spec)
    for i in range(20):
        out, lse = poisoned_call(q, k, v, causal=True)
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
    default, _ = poisoned_call(q, k, v, causal=causal)
    for scale in (0.3, 0.02, 1.0 / math.sqrt(64)):
        out, _ = check_forward(q, k, v, causal=causal, softmax_scale=scale)
        moved = ref.rel_l2(out, default.float())
        if scale == 1.0 / math.sqrt(64):
            assert moved <= 1e-3, f"softmax_scale=1/sqrt(d) should equal the default, differs by {moved:.3g}"
        else:
            assert moved > 5e-2, f"softmax_scale={scale} barely changed the output (rel diff {moved:.3g})"


def test_return_lse_false_returns_the_same_output(gen):
    """The output without the lse (written to a scratch buffer) equals the one with it; both
    calls into NaN-filled outputs (the second takes the call plan)."""
    q, k, v = make_inputs(gen, 1, 257, 513, 4, 4, 128, torch.bfloat16)
    with nan_filled_allocations():
        out = cutefa.flash_attn_func(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor), f"return_lse=False must return a tensor, got {type(out)}"
    out2, _ = poisoned_call(q, k, v, causal=True)
    assert torch.isfinite(out).all(), "return_lse=False: non-finite output (an element was not written)"
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16))


def test_explain_names_a_variant(gen):
    q, k, v = make_inputs(gen, 1, 128, 128, 4, 4, 128, torch.bfloat16)
    text = cutefa.explain(q, k, v, causal=True)
    assert isinstance(text, str) and "cutefa_" in text and "hd128" in text, text
