"""Packed sequences through the public ``cutefa.flash_attn_varlen_func`` on a CUDA GPU.

Every result is judged against the float32 reference computed sequence by sequence
(tests/gpu/reference.py ``varlen_ref``) with the bars of the dense tests: the output's relative L2
error at most twice that of PyTorch's own attention on the same fp16/bf16 inputs (which computes in
float32 and rounds: the exact result rounded to the dtype), its largest error at most that plus
twice the rounding; the lse within float32 error; gradients (the loss has a term on the lse, so the
lse's gradient is exercised too) at most 3x the error of the reference on the low-precision inputs
(float32 inside, gradients rounded to the dtype at the leaves) plus 1e-3, as
tests/gpu/test_bwd_sm90.py sets them. Outputs and gradients the call allocates come NaN-filled
(test_fwd_sm80's ``nan_filled_allocations``), so an element nothing writes fails. Packed rows of no
sequence (a span's slack past ``seqused``, rows past ``cu_seqlens[-1]``) must be output 0, lse
-inf and zero gradients. Lengths 1, 17, 1000, 4097 and 0 inside a batch, seqlen_q != seqlen_k per
sequence, GQA/MQA, head dims 64-256, fp16/bf16, causal and not; deterministic mode bitwise
repeatable; the padded-batch helpers against dense calls; torch.compile(fullgraph=True); a CUDA
graph replayed on new lengths; errors that name the argument.

The default set is small (seconds per case); ``CUTEFA_FULL_GPU_TESTS=1`` runs the larger sweep.
tests/gpu/test_masks.py shares the checks here. Run on an H100/H200:
``python -m pytest -q tests/gpu/test_varlen.py``.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm80_skip_reason as _skip_reason

import cutefa

ref = _load("reference")
fwd80 = _load("test_fwd_sm80")
bwd80 = _load("test_bwd_sm80")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

FULL = os.environ.get("CUTEFA_FULL_GPU_TESTS", "") not in ("", "0")
DEVICE = "cuda"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# tanh.approx.f32's relative error (PTX ISA): a kernel may evaluate the softcap's tanh with it, so a
# capped score may be off by |score| * this; unit-normal q and k at softmax scale 1/sqrt(d) keep
# |score| below SCORE_BOUND.
TANH_APPROX_ERROR = 2.0**-10.987
SCORE_BOUND = 8.0
# The float32 reference's own lse error (sums of up to ~4k terms in another order): absolute.
FLOAT32_REFERENCE_LSE_ERROR = 1e-5

# Per-sequence (seqlen_q, seqlen_k) of the packed batches.
LENGTHS = {
    # the ragged lengths of the dense tests, with an empty sequence inside the batch
    "ragged": [(1, 1), (17, 17), (1000, 1000), (0, 0), (4097, 4097)],
    # seqlen_q != seqlen_k both ways, a sequence without queries and one without keys
    "uneven": [(17, 1000), (1000, 17), (0, 5), (5, 0), (1, 4097), (128, 129)],
    # many short sequences, most shorter than a tile, and empty ones between them
    "short": [(3, 3), (0, 0), (0, 0), (40, 40), (0, 7), (64, 64), (65, 63), (1, 2), (127, 1), (2, 129)],
}


@dataclass
class Packed:
    """A packed batch: q (total_q, hq, d), k and v (total_k, hkv, d), its int32 metadata on the GPU,
    the max lengths to pass, and ``lengths`` [(seqlen_q, seqlen_k)] used per sequence."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    used_q: torch.Tensor | None
    used_k: torch.Tensor | None
    max_q: int
    max_k: int
    lengths: list[tuple[int, int]]

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def rows_q(self) -> torch.Tensor:
        """(total_q,) bool: the rows of q some sequence uses."""
        return ref.used_rows(self.cu_q, self.used_q, self.q.shape[0])

    def rows_k(self) -> torch.Tensor:
        return ref.used_rows(self.cu_k, self.used_k, self.k.shape[0])

    def has_keys(self, causal: bool, window_size=ref.NO_WINDOW) -> torch.Tensor:
        """(total_q,) bool: the used rows that attend at least one key (bottom-right per sequence)."""
        keys = torch.zeros(self.q.shape[0], dtype=torch.bool)
        for (q0, sq), (_, sk) in zip(
            ref.sequences(self.cu_q, self.used_q), ref.sequences(self.cu_k, self.used_k)
        ):
            keys[q0 + ref.empty_rows(sq, sk, causal, window_size) : q0 + sq] = True
        return keys.to(self.q.device)

    def call(self, q=None, k=None, v=None, **kwargs):
        """``cutefa.flash_attn_varlen_func`` on this batch (or on other q, k, v of its shapes): (out, lse)."""
        return cutefa.flash_attn_varlen_func(
            self.q if q is None else q, self.k if k is None else k, self.v if v is None else v, self.cu_q,
            self.cu_k, self.max_q, self.max_k, seqused_q=self.used_q, seqused_k=self.used_k, return_lse=True,
            **kwargs,
        )  # fmt: skip

    def reference(self, q=None, k=None, v=None, **kwargs):
        """The float32 reference of :meth:`call` (differentiable): (out, lse)."""
        return ref.varlen_ref(
            self.q if q is None else q, self.k if k is None else k, self.v if v is None else v, self.cu_q,
            self.cu_k, seqused_q=self.used_q, seqused_k=self.used_k, **kwargs,
        )  # fmt: skip


def make_packed(gen, lengths, heads_q, heads_kv, head_dim, dtype, *, slack=None, tail=(0, 0)) -> Packed:
    """Unit-normal q, k, v packing ``lengths``. ``slack`` [(extra_q, extra_k)] per sequence: rows
    after each sequence's used ones inside its span (then seqused is passed); ``tail``: rows after
    the last span. Slack and tail keys and values are large (v near 100): attending one shows."""
    spans = lengths if slack is None else [(sq + eq, sk + ek) for (sq, sk), (eq, ek) in zip(lengths, slack)]
    cu_q = [0, *itertools.accumulate(s for s, _ in spans)]
    cu_k = [0, *itertools.accumulate(s for _, s in spans)]
    total_q, total_k = cu_q[-1] + tail[0], cu_k[-1] + tail[1]
    cuda = {"device": DEVICE, "dtype": dtype}
    q = torch.randn(total_q, heads_q, head_dim, generator=gen, **cuda)
    k = torch.randn(total_k, heads_kv, head_dim, generator=gen, **cuda)
    v = torch.randn(total_k, heads_kv, head_dim, generator=gen, **cuda)
    int32 = {"device": DEVICE, "dtype": torch.int32}
    used_q = used_k = None
    if slack is not None:
        used_q = torch.tensor([sq for sq, _ in lengths], **int32)
        used_k = torch.tensor([sk for _, sk in lengths], **int32)
    packed = Packed(
        q, k, v, torch.tensor(cu_q, **int32), torch.tensor(cu_k, **int32), used_q, used_k,
        max((sq for sq, _ in lengths), default=0), max((sk for _, sk in lengths), default=0), list(lengths),
    )  # fmt: skip
    unused_k = ~packed.rows_k()
    with torch.no_grad():
        k[unused_k] = 4 * k[unused_k]
        v[unused_k] = 100 + v[unused_k]
    return packed


# --- judging ----------------------------------------------------------------------------------


def absmax(t: torch.Tensor) -> float:
    """Largest |t| (0 for an empty tensor)."""
    return t.abs().amax().item() if t.numel() else 0.0


def softcap_error(softcap: float) -> float:
    """Largest error of one capped score when the kernel's tanh is tanh.approx.f32."""
    return TANH_APPROX_ERROR * min(softcap, SCORE_BOUND) if softcap > 0 else 0.0


def judge_forward(tag, out, lse, exact, exact_lse, has_keys, *, sinks=None, softcap=0.0, v_absmax=1.0):
    """Hold a forward to the float32 reference, rows layout: out and exact (rows, heads, d), lse and
    exact_lse (heads, rows), has_keys (rows,) bool (the rows that attend a key). Rows without a key:
    out exactly 0 and lse -inf (with sinks: the sink). The others: see the module docstring."""
    dtype = out.dtype
    assert torch.isfinite(out).all(), f"{tag}: non-finite output (NaN: an element was not written)"
    empty = ~has_keys
    if empty.any():
        assert (out[empty] == 0).all(), f"{tag}: rows that attend no key must be 0"
        if sinks is None:
            assert torch.isneginf(lse[:, empty]).all(), f"{tag}: rows that attend no key must have lse -inf"
        else:
            want = sinks.float()[:, None].expand(-1, int(empty.sum()))
            err = ref.max_abs(lse[:, empty], want)
            assert err <= 1e-5 * max(1.0, want.abs().max().item()), (
                f"{tag}: an empty row's lse is not its sink"
            )
    live, live_exact = lse[:, has_keys], exact_lse[:, has_keys]
    assert torch.isfinite(live).all(), f"{tag}: lse not finite on rows that attend keys"
    base = exact.to(dtype)  # PyTorch's own attention on these inputs: float32 inside, rounded
    err, base_err = ref.rel_l2(out, exact), ref.rel_l2(base, exact)
    tol = max(2 * base_err, 1e-3)
    assert err <= tol, f"{tag}: rel L2 error {err:.3g} > {tol:.3g} (rounding alone {base_err:.3g})"
    cap = softcap_error(softcap)
    worst = ref.max_abs(out, exact)
    atol = 4 * ref.rounding_error(exact, dtype) + 4 * cap * v_absmax
    assert worst <= atol, f"{tag}: max abs error {worst:.3g} > {atol:.3g}"
    if live.numel():
        lse_err = ref.max_abs(live, live_exact)
        magnitude = max(1.0, live_exact.abs().max().item())
        ulps = fwd80.LSE_ULPS * fwd80.FLOAT32_ULP * magnitude
        lse_tol = ulps + FLOAT32_REFERENCE_LSE_ERROR + fwd80.EXP2_POLY_ERROR + 2 * cap
        assert lse_err <= lse_tol, (
            f"{tag}: lse error {lse_err:.3g} > {lse_tol:.3g} (|lse| up to {magnitude:.3g})"
        )


def check_varlen_forward(tag, p: Packed, *, causal, **features):
    """One call into NaN-filled outputs, judged by :func:`judge_forward` on the used rows; unused
    rows must be 0 / -inf. Returns (out, lse)."""
    with fwd80.nan_filled_allocations():
        out, lse = p.call(causal=causal, **features)
    torch.cuda.synchronize()
    total_q, heads_q, _ = p.q.shape
    assert out.shape == p.q.shape and out.dtype == p.q.dtype, f"{tag}: out {tuple(out.shape)} {out.dtype}"
    assert lse.shape == (heads_q, total_q) and lse.dtype == torch.float32, f"{tag}: lse {tuple(lse.shape)}"
    rows = p.rows_q()
    unused = ~rows
    if unused.any():
        assert (out[unused] == 0).all(), f"{tag}: rows of no sequence must be 0"
        assert torch.isneginf(lse[:, unused]).all(), f"{tag}: rows of no sequence must have lse -inf"
    with torch.no_grad():
        exact, exact_lse = p.reference(causal=causal, **features)
    window = features.get("window_size", ref.NO_WINDOW)
    has_keys = p.has_keys(causal, window)[rows]
    judge_forward(
        tag, out[rows], lse[:, rows], exact[rows], exact_lse[:, rows], has_keys, sinks=features.get("sinks"),
        softcap=features.get("softcap", 0.0), v_absmax=absmax(p.v[p.rows_k()]),
    )  # fmt: skip
    return out, lse


def loss_fn(dout, dlse, rows_out, rows_lse):
    """out, lse -> sum(out * dout) + sum(lse * dlse) over ``rows_out`` (a mask broadcasting to out)
    and the finite entries of lse inside ``rows_lse``: what a row of no sequence or without a key
    holds (0, -inf) takes no part, and a NaN there would not leak into the loss's value."""

    def loss(out, lse):
        o = torch.where(rows_out, out.float(), torch.zeros((), device=out.device))
        keep = rows_lse & torch.isfinite(lse)
        return (o * dout).sum() + (torch.where(keep, lse, torch.zeros((), device=lse.device)) * dlse).sum()

    return loss


def grads_of(fn, leaves, loss):
    """Gradients of ``loss(*fn(*leaves))`` with respect to fresh copies of ``leaves`` (None stays None)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in leaves]
    loss(*fn(*leaves)).backward()
    return [None if t is None else t.grad for t in leaves]


def dsinks_yardstick(exact_out_rows, exact_lse_rows, dout_rows, dlse_rows, sinks, dtype):
    """dsinks as the API computes it (``sum_i exp(sink - lse_i) * (dlse_i - rowsum(dout_i * out_i))``)
    from the exact lse and the exact output and output gradient rounded to ``dtype`` (as the call
    receives them): what the low-precision output alone costs dsinks. Rows layout: out, dout
    (rows, heads, d); lse, dlse (heads, rows)."""
    p_sink = torch.where(
        torch.isfinite(exact_lse_rows),
        torch.exp(sinks.float()[:, None] - exact_lse_rows),
        torch.zeros_like(exact_lse_rows),
    )
    rowsum = (dout_rows.to(dtype).float() * exact_out_rows.to(dtype).float()).sum(-1).T  # (heads, rows)
    return (p_sink * (dlse_rows - rowsum)).sum(-1)


def judge_grads(tag, got, exact, base, names=("dq", "dk", "dv")):
    """``got`` against ``exact``: finite, same shapes, relative error at most 3x ``base``'s + 1e-3."""
    for name, g, e, b in zip(names, got, exact, base):
        assert g is not None and g.shape == e.shape, (
            f"{tag} {name}: shape {None if g is None else tuple(g.shape)}"
        )
        assert torch.isfinite(g).all(), f"{tag} {name}: non-finite values (unwritten or NaN)"
        err, err_base = bwd80.rel(g, e), bwd80.rel(b, e)
        assert err <= 3 * err_base + 1e-3, f"{tag} {name}: rel err {err:.3g} vs reference {err_base:.3g}"


def compare_grads(tag, call, reference, leaves, loss, to_rows, dout, dlse):
    """Gradients of ``loss`` through ``call(q, k, v, sinks)`` (allocations NaN-filled) against
    ``reference`` with float32 leaves (exact) and with the call's leaves (the yardstick); dsinks
    against :func:`dsinks_yardstick`. ``to_rows(out_like, lse_like)`` gives the rows layout.
    Returns the call's gradients (dq, dk, dv, dsinks or None)."""
    q, k, v, sinks = leaves
    with fwd80.nan_filled_allocations():
        got = grads_of(call, leaves, loss)
    torch.cuda.synchronize()
    exact = grads_of(reference, (q.float(), k.float(), v.float(), sinks), loss)
    base = grads_of(reference, leaves, loss)
    judge_grads(tag, got[:3], exact[:3], base[:3])
    if sinks is not None:
        with torch.no_grad():
            out_rows, lse_rows = to_rows(*reference(*leaves))
        dout_rows, dlse_rows = to_rows(dout, dlse)
        yardstick = dsinks_yardstick(out_rows, lse_rows, dout_rows, dlse_rows, sinks, q.dtype)
        judge_grads(tag, got[3:], exact[3:], [yardstick], names=("dsinks",))
    return got


def check_varlen_grads(tag, p: Packed, gen, *, causal, deterministic=False, **features):
    """:func:`compare_grads` of a loss on the used rows' out and lse of a packed batch; the rows of
    no sequence must get exactly zero gradients."""
    sinks = features.pop("sinks", None)
    rows_q = p.rows_q()
    dout = torch.randn(p.q.shape[:2] + p.v.shape[-1:], generator=gen, device=DEVICE) * rows_q[:, None, None]
    dlse = torch.randn(p.q.shape[1], p.q.shape[0], generator=gen, device=DEVICE) * rows_q
    loss = loss_fn(dout, dlse, rows_q[:, None, None], rows_q[None, :])

    def call(q, k, v, s):
        return p.call(q, k, v, causal=causal, sinks=s, deterministic=deterministic, **features)

    def reference(q, k, v, s):
        return p.reference(q, k, v, causal=causal, sinks=s, **features)

    # unused rows: dout and dlse 0 and lse -inf, so the rows layout is the packed one as it is
    got = compare_grads(tag, call, reference, (p.q, p.k, p.v, sinks), loss, lambda o, l: (o, l), dout, dlse)
    unused_q, unused_k = ~rows_q, ~p.rows_k()
    for name, g, unused in zip(("dq", "dk", "dv"), got, (unused_q, unused_k, unused_k)):
        assert (g[unused] == 0).all(), f"{tag} {name}: rows of no sequence must get zero gradients"
    return got


def _ids(value):
    if isinstance(value, bool):
        return "causal" if value else "full"
    return None


# --- forward ----------------------------------------------------------------------------------


def _params(cases):
    """pytest params of (dtype, head_dim, lengths name, heads_q, heads_kv) with readable ids."""
    return [pytest.param(*c, id="{}-hd{}-{}-hq{}-hkv{}".format(*c)) for c in cases]


def _forward_grid():
    """(dtype, head_dim, lengths name, heads_q, heads_kv): the default set, or the sweep."""
    if FULL:
        dims = (64, 96, 128, 192, 256)
        return [(dt, d, name, 4, 4) for dt in DTYPES for d in dims for name in LENGTHS] + [
            (dt, d, name, hq, hkv) for dt in DTYPES for d in (64, 128) for name in LENGTHS for hq, hkv in ((6, 2), (8, 1))
        ]  # fmt: skip
    return (
        [(dt, d, name, 4, 4) for dt in DTYPES for d in (64, 128, 256) for name in ("ragged", "uneven")]
        + [("bf16", d, "uneven", 4, 4) for d in (96, 192)]
        + [("bf16", 128, "short", 6, 2), ("fp16", 64, "ragged", 8, 1)]
    )


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
@pytest.mark.parametrize("dtype,head_dim,lengths,hq,hkv", _params(_forward_grid()))
def test_forward(gen, dtype, head_dim, lengths, hq, hkv, causal):
    p = make_packed(gen, LENGTHS[lengths], hq, hkv, head_dim, DTYPES[dtype])
    check_varlen_forward(f"{dtype} hd{head_dim} {lengths} hq{hq} hkv{hkv} causal={causal}", p, causal=causal)


SLACK = {
    # seqused shorter than each span (and 0 used of a span), rows after the last span
    "slack": (
        [(300, 500), (17, 1000), (0, 3), (1000, 17), (64, 64)],
        [(5, 3), (0, 40), (7, 0), (1, 1), (64, 0)],
    ),
}


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
@pytest.mark.parametrize("dtype,head_dim", [("bf16", 128), ("fp16", 64)] + ([("bf16", 256)] if FULL else []))
def test_forward_seqused_shorter_than_the_span(gen, dtype, head_dim, causal):
    lengths, slack = SLACK["slack"]
    p = make_packed(gen, lengths, 4, 2, head_dim, DTYPES[dtype], slack=slack, tail=(9, 11))
    check_varlen_forward(f"{dtype} hd{head_dim} seqused causal={causal}", p, causal=causal)


def test_forward_max_seqlen_larger_than_every_sequence(gen):
    """max_seqlen bounds the lengths; a bound above all of them gives the same result."""
    p = make_packed(gen, LENGTHS["uneven"], 4, 4, 128, torch.bfloat16)
    tight, tight_lse = check_varlen_forward("tight", p, causal=True)
    p.max_q, p.max_k = p.max_q + 300, p.max_k + 1000
    loose, loose_lse = check_varlen_forward("loose", p, causal=True)
    assert torch.equal(tight, loose) and torch.equal(tight_lse, loose_lse)


def test_forward_of_a_batch_without_rows(gen):
    """Sequences that are all empty (total_q = 0), and queries over no key at all."""
    p = make_packed(gen, [(0, 0), (0, 5), (0, 0)], 4, 4, 128, torch.bfloat16)
    out, lse = p.call(causal=True)
    assert out.shape == (0, 4, 128) and lse.shape == (4, 0)
    p = make_packed(gen, [(3, 0), (0, 0), (5, 0)], 4, 4, 128, torch.bfloat16)
    check_varlen_forward("no keys", p, causal=False)


# --- backward ---------------------------------------------------------------------------------


def _backward_grid():
    if FULL:
        return [(dt, d, name, 4, 2) for dt in DTYPES for d in (64, 96, 128, 192, 256) for name in LENGTHS]
    return [("bf16", d, "ragged", 4, 4) for d in (64, 128, 256)] + [
        ("fp16", 128, "uneven", 4, 4),
        ("bf16", 96, "uneven", 6, 2),
        ("bf16", 192, "short", 8, 1),
    ]


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
@pytest.mark.parametrize("dtype,head_dim,lengths,hq,hkv", _params(_backward_grid()))
def test_grads(gen, dtype, head_dim, lengths, hq, hkv, causal):
    p = make_packed(gen, LENGTHS[lengths], hq, hkv, head_dim, DTYPES[dtype])
    check_varlen_grads(
        f"{dtype} hd{head_dim} {lengths} hq{hq} hkv{hkv} causal={causal}", p, gen, causal=causal
    )


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
def test_grads_seqused_shorter_than_the_span(gen, causal):
    """Slack rows and the tail take no part: their gradients are exactly 0."""
    lengths, slack = SLACK["slack"]
    p = make_packed(gen, lengths, 4, 2, 128, torch.bfloat16, slack=slack, tail=(9, 11))
    check_varlen_grads(f"seqused causal={causal}", p, gen, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
def test_deterministic_is_bitwise_repeatable(gen, causal):
    """deterministic=True: judged like any call, then two forward+backward runs on the same inputs
    give bitwise the same out, lse and gradients (and within 1e-2 of the default mode's)."""
    p = make_packed(gen, LENGTHS["ragged"] + [(333, 2000)], 8, 2, 128, torch.bfloat16)
    check_varlen_grads(f"deterministic causal={causal}", p, gen, causal=causal, deterministic=True)
    rows_q = p.rows_q()
    dout = torch.randn(p.q.shape, generator=gen, device=DEVICE)
    dlse = torch.randn(p.q.shape[1], p.q.shape[0], generator=gen, device=DEVICE)
    loss = loss_fn(dout, dlse, rows_q[:, None, None], rows_q[None, :])
    runs = []
    for _ in range(2):
        with fwd80.nan_filled_allocations():
            runs.append(
                grads_of(
                    lambda q, k, v: p.call(q, k, v, causal=causal, deterministic=True), (p.q, p.k, p.v), loss
                )
            )
    plain = grads_of(lambda q, k, v: p.call(q, k, v, causal=causal), (p.q, p.k, p.v), loss)
    for name, a, b, c in zip(("dq", "dk", "dv"), *runs, plain):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"
        assert bwd80.rel(a, c) < 1e-2, f"{name}: deterministic and default modes differ"
    outs = [p.call(causal=causal, deterministic=True) for _ in range(2)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# --- the padded-batch helpers -----------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=_ids)
def test_padded_batch_round_trip_matches_dense_calls(gen, causal):
    """unpad_input -> flash_attn_varlen_func -> pad_input on a padded batch (right and left padding,
    a row of padding only) equals, row by row, the dense call on that row's tokens; padding rows
    of the output are 0 and get zero gradients; gradients match the dense calls'."""
    batch, seqlen, hq, hkv, d, dtype = 4, 600, 4, 2, 128, torch.bfloat16
    mask = torch.zeros(batch, seqlen, dtype=torch.bool, device=DEVICE)
    mask[0, :600] = True
    mask[1, :17] = True
    mask[2, 250:] = True  # left padding
    # row 3: padding only
    cuda = {"device": DEVICE, "dtype": dtype}
    q = torch.randn(batch, seqlen, hq, d, generator=gen, **cuda).requires_grad_()
    k = torch.randn(batch, seqlen, hkv, d, generator=gen, **cuda).requires_grad_()
    v = torch.randn(batch, seqlen, hkv, d, generator=gen, **cuda).requires_grad_()
    dout = torch.randn(batch, seqlen, hq, d, generator=gen, **cuda)
    q_u, indices, cu, max_seqlen, seqused = cutefa.unpad_input(q, mask)
    k_u, _, _, _, _ = cutefa.unpad_input(k, mask)
    v_u, _, _, _, _ = cutefa.unpad_input(v, mask)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 600, 617, 967, 967] and max_seqlen == 600
    assert seqused.tolist() == [600, 17, 350, 0]
    out_u = cutefa.flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_seqlen, max_seqlen, causal=causal)
    out = cutefa.pad_input(out_u, indices, batch, seqlen)
    out.backward(dout)
    assert (out[~mask] == 0).all() and torch.isfinite(out).all()
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        assert (t.grad[~mask] == 0).all(), f"{name}: padding must get zero gradients"
    for b in range(3):
        rows = mask[b]
        tag = f"row {b} causal={causal}"
        row = [t.detach()[b, rows][None] for t in (q, k, v)]
        dout_b = dout[b, rows][None]

        def loss(o, _lse, dout_b=dout_b):
            return (o.float() * dout_b.float()).sum()

        def exact_fn(a, b_, c):
            return ref.attention_ref(a, b_, c, causal=causal)

        dense_grads = grads_of(
            lambda a, b_, c: (cutefa.flash_attn_func(a, b_, c, causal=causal), None), row, loss
        )
        dense = cutefa.flash_attn_func(*row, causal=causal)
        with torch.no_grad():
            exact, _ = exact_fn(*row)
        assert ref.rel_l2(out[b, rows], exact[0]) <= max(
            2 * ref.rel_l2(exact[0].to(dtype), exact[0]), 1e-3
        ), tag
        assert ref.rel_l2(out[b, rows], dense[0].float()) <= 1e-2, f"{tag}: out differs from the dense call"
        got = [t.grad[b, rows][None] for t in (q, k, v)]
        exact_grads = grads_of(exact_fn, [t.float() for t in row], loss)
        base_grads = grads_of(exact_fn, row, loss)
        judge_grads(tag, got, exact_grads, base_grads)
        for name, g, d in zip(("dq", "dk", "dv"), got, dense_grads):
            assert bwd80.rel(g, d) <= 2e-2, f"{tag}: {name} differs from the dense call's"


# --- torch.compile and CUDA graphs ------------------------------------------------------------


def test_torch_compile_fullgraph_matches_eager(gen):
    """A function calling flash_attn_varlen_func (with the lse) compiles without a graph break and
    gives the eager gradients."""
    p = make_packed(gen, [(300, 300), (0, 0), (17, 500), (700, 700)], 4, 2, 128, torch.bfloat16)

    def step(q, k, v, cu_q, cu_k, max_q, max_k):
        out, lse = cutefa.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True
        )
        return out.float().square().mean() + lse.mean()

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]
        loss = fn(*leaves, p.cu_q, p.cu_k, p.max_q, p.max_k)
        loss.backward()
        return loss.detach(), [t.grad for t in leaves]

    eager_loss, eager = run(step)
    torch._dynamo.reset()
    compiled_loss, compiled = run(torch.compile(step, fullgraph=True))
    assert torch.isfinite(eager_loss) and bwd80.rel(compiled_loss, eager_loss) < 1e-5
    for name, a, b in zip(("dq", "dk", "dv"), eager, compiled):
        assert torch.isfinite(b).all() and bwd80.rel(b, a) < 1e-3, name


def test_cuda_graph_replays_on_new_lengths(gen, monkeypatch):
    """A warm varlen call captured once; replays after new values (and new sequence lengths, same
    totals, within max_seqlen) are copied into its static inputs give bitwise the eager call's
    out and lse, and match the reference."""
    graphs = _load("test_graphs")
    first = [(300, 300), (0, 0), (17, 500), (700, 700)]
    second = [(500, 500), (17, 500), (0, 0), (500, 500)]
    p = make_packed(gen, first, 4, 2, 128, torch.bfloat16)
    p.max_q = p.max_k = 1024  # bounds every length of both partitions

    def forward():
        return p.call(causal=True)

    graphs._warm_up(forward)
    graph = torch.cuda.CUDAGraph()
    with graphs.nothing_compiles(monkeypatch), torch.cuda.graph(graph):
        captured_out, captured_lse = forward()
    for replay, lengths in enumerate((first, second, first)):
        fresh = make_packed(gen, lengths, 4, 2, 128, torch.bfloat16)
        for static, new in zip(
            (p.q, p.k, p.v, p.cu_q, p.cu_k), (fresh.q, fresh.k, fresh.v, fresh.cu_q, fresh.cu_k)
        ):
            assert static.shape == new.shape
            static.copy_(new)
        p.lengths = lengths
        graph.replay()
        torch.cuda.synchronize()
        out, lse = forward()
        assert torch.equal(captured_out, out), f"replay {replay}: output differs from an eager call"
        assert torch.equal(captured_lse, lse), f"replay {replay}: lse differs from an eager call"
        exact, exact_lse = p.reference(causal=True)
        rows = p.rows_q()
        judge_forward(
            f"replay {replay}",
            out[rows],
            lse[:, rows],
            exact[rows],
            exact_lse[:, rows],
            p.has_keys(True)[rows],
        )


# --- errors -----------------------------------------------------------------------------------


# case: (what replaces which arguments, the error, what its message names)
BAD_INPUTS = {
    "cu_seqlens_q int64": (lambda a: {"cu_seqlens_q": a["cu_seqlens_q"].long()}, TypeError, "cu_seqlens_q"),
    "cu_seqlens_k on the host": (lambda a: {"cu_seqlens_k": a["cu_seqlens_k"].cpu()}, ValueError, "cu_seqlens_k"),
    "cu_seqlens_q 2-D": (lambda a: {"cu_seqlens_q": a["cu_seqlens_q"][None]}, ValueError, "cu_seqlens_q"),
    "cu_seqlens_k of another batch": (lambda a: {"cu_seqlens_k": a["cu_seqlens_k"][:-1]}, ValueError, "cu_seqlens_k"),
    "seqused_q of another batch": (lambda a: {"seqused_q": a["cu_seqlens_q"][:2]}, ValueError, "seqused_q"),
    "seqused_k int64": (lambda a: {"seqused_k": a["cu_seqlens_k"][1:].long()}, TypeError, "seqused_k"),
    "seqused_q on the host": (lambda a: {"seqused_q": a["cu_seqlens_q"][1:].cpu()}, ValueError, "seqused_q"),
    "max_seqlen_q negative": (lambda a: {"max_seqlen_q": -1}, ValueError, "max_seqlen_q"),
    "max_seqlen_k not an int": (lambda a: {"max_seqlen_k": 3.5}, TypeError, "max_seqlen_k"),
    "q of the dense layout": (lambda a: {"q": a["q"][None]}, ValueError, "q"),
    "k of another dtype": (lambda a: {"k": a["k"].half()}, TypeError, "dtype"),
    "heads_q not a multiple of heads_kv": (lambda a: {"k": a["k"][:, :3], "v": a["v"][:, :3]}, ValueError, "heads"),
    "dropout": (lambda a: {"dropout_p": 0.1}, NotImplementedError, "dropout_p"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_INPUTS, ids=str)
def test_bad_input_names_the_argument(gen, case):
    change, error, name = BAD_INPUTS[case]
    p = make_packed(gen, [(5, 5), (0, 3), (7, 9)], 4, 4, 64, torch.bfloat16)
    args = {
        "q": p.q, "k": p.k, "v": p.v, "cu_seqlens_q": p.cu_q, "cu_seqlens_k": p.cu_k, "max_seqlen_q": p.max_q,
        "max_seqlen_k": p.max_k,
    }  # fmt: skip
    args.update(change(args))
    with pytest.raises(error, match=name):
        cutefa.flash_attn_varlen_func(**args)


# Values inside the GPU's length tensors are checked on the device (no host sync): a failure is a
# device-side assert, which ends the process's CUDA context, so each runs in a child process.
BAD_LENGTHS = {
    "valid (the control)": "pass",
    "cu_seqlens_q past total_q": "cu_q[-1] = q.shape[0] + 1",
    "cu_seqlens_k decreasing": "cu_k[2] = cu_k[1] - 1",
    "a length over max_seqlen_q": "max_q = 4",
    "seqused_k past its span": "used_k = (cu_k[1:] - cu_k[:-1]) + 1",
}

_CHILD = """
import torch, cutefa
q = torch.randn(12, 4, 64, device="cuda", dtype=torch.bfloat16)
k = torch.randn(12, 4, 64, device="cuda", dtype=torch.bfloat16)
cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32, device="cuda")
cu_k = torch.tensor([0, 3, 3, 12], dtype=torch.int32, device="cuda")
max_q, used_k = 7, None
{change}
cutefa.flash_attn_varlen_func(q, k, k, cu_q, cu_k, max_q, 9, seqused_k=used_k)
torch.cuda.synchronize()
print("NO ERROR")
"""


@pytest.mark.parametrize("case", BAD_LENGTHS, ids=str)
def test_bad_lengths_fail_on_the_device(case):
    """Each bad value makes the call's process fail with a device-side assertion; the same script
    with valid lengths (the control) runs through."""
    script = textwrap.dedent(_CHILD).format(change=BAD_LENGTHS[case])
    child = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=600
    )
    output = child.stdout + child.stderr
    if BAD_LENGTHS[case] == "pass":
        assert child.returncode == 0 and "NO ERROR" in output, f"the valid lengths failed:\n{output[-2000:]}"
        return
    assert child.returncode != 0 and "NO ERROR" not in output, (
        f"{case}: the call did not fail:\n{output[-2000:]}"
    )
    assert "assert" in output.lower(), f"{case}: not a device-side assertion:\n{output[-2000:]}"
