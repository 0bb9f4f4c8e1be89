"""The sm90 16-bit backward's feature kernels (templates/bwd_sm90.py.j2: packed sequences, the local
window, softcap, ALiBi) on a Hopper GPU. Through the public API: gradients of the packed and the
dense calls (incl. the dLSE term) against a float32 reference computed sequence by sequence
(tests/gpu/reference.py), judged against three times the error of the same reference computed in
the input dtype; lengths 1, 17, 1000 and empty sequences, seqused below the spans, windows with
empty-window rows, causal with a window, sq != sk, GQA groups 1/2/4/8 and MQA (the kernel's fp32 dK/dV
workspace); the variant chosen is the sm90 family's (not the sm80 fallback). The kernel called
directly with NaN-poisoned dq, dk, dv: every row of a sequence written (bitwise the API's result
in deterministic mode), rows of no sequence left alone. Deterministic mode bitwise repeatable."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from gpu_support import hopper_skip_reason
from gpu_support import load_sibling as _load

import cutefa
from cutefa import dispatch
from cutefa.api import feature_bwd
from cutefa.api.backward import dq_splits
from cutefa.api.features import FeatureArgs
from cutefa.api.launch import call_on
from cutefa.loader import get_kernel

ref = _load("reference")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(hopper_skip_reason() is not None, reason=str(hopper_skip_reason())),
]


@dataclass(frozen=True)
class Case:
    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...]
    heads_q: int = 4
    heads_kv: int = 4
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    slack: int = 0  # rows of each span past seqused (seqused below the spans)


CASES = [
    Case((1, 17, 1000, 0), (1, 17, 1000, 0)),
    Case((17, 0, 1000), (40, 5, 700), heads_q=8, heads_kv=2, causal=True, slack=3),
    Case((300, 129), (500, 64), window=(64, 0), causal=True),
    Case((250, 1000), (250, 900), window=(3, 5), slack=2),  # rows 0..94 of the second: empty windows
    Case((1000, 17), (1000, 33), heads_q=8, heads_kv=1, softcap=30.0, window=(128, -1)),
    Case((257, 64), (300, 1), heads_q=8, heads_kv=4, alibi=True, causal=True),
    Case((513,), (513,), heads_q=8, heads_kv=8, softcap=10.0, alibi=True, window=(100, 100)),
]


def _id(c: Case) -> str:
    parts = [f"q{'-'.join(map(str, c.lens_q))}_k{'-'.join(map(str, c.lens_k))}_h{c.heads_q}x{c.heads_kv}"]
    parts += ["causal"] * c.causal + [f"w{c.window[0]}_{c.window[1]}"] * (c.window != (-1, -1))
    parts += (
        [f"cap{c.softcap:g}"] * (c.softcap > 0) + ["alibi"] * c.alibi + [f"slack{c.slack}"] * (c.slack > 0)
    )
    return "_".join(parts)


def _cu(lens: tuple[int, ...], slack: int) -> torch.Tensor:
    return torch.tensor(
        [0] + [sum(n + slack for n in lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32
    )


@dataclass
class Problem:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    used_q: torch.Tensor
    used_k: torch.Tensor
    slopes: torch.Tensor | None
    dout: torch.Tensor
    dlse: torch.Tensor


def _problem(c: Case, dtype: torch.dtype, head_dim: int, seed: int = 0) -> Problem:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cu_q, cu_k = _cu(c.lens_q, c.slack), _cu(c.lens_k, c.slack)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    slopes = None
    if c.alibi:
        slopes = torch.rand(len(c.lens_q), c.heads_q, generator=gen, device="cuda") * 0.1
    return Problem(
        rand(total_q, c.heads_q, head_dim), rand(total_k, c.heads_kv, head_dim), rand(total_k, c.heads_kv, head_dim),
        cu_q.cuda(), cu_k.cuda(), torch.tensor(c.lens_q, dtype=torch.int32, device="cuda"),
        torch.tensor(c.lens_k, dtype=torch.int32, device="cuda"), slopes, rand(total_q, c.heads_q, head_dim),
        rand(c.heads_q, total_q).float(),
    )  # fmt: skip


def _run(c: Case, p: Problem, deterministic: bool = False):
    """(dq, dk, dv) of the API's packed call."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v))
    out, lse = cutefa.flash_attn_varlen_func(
        q, k, v, p.cu_q, p.cu_k, max(c.lens_q), max(c.lens_k), causal=c.causal, window_size=c.window,
        softcap=c.softcap, alibi_slopes=p.slopes, deterministic=deterministic, seqused_q=p.used_q, seqused_k=p.used_k,
        return_lse=True,
    )  # fmt: skip
    torch.autograd.backward((out, lse), (p.dout, p.dlse))
    return q.grad, k.grad, v.grad


def _reference(c: Case, p: Problem, dtype: torch.dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (p.q, p.k, p.v))
    out, lse = ref.varlen_ref(
        q, k, v, p.cu_q, p.cu_k, seqused_q=p.used_q, seqused_k=p.used_k, causal=c.causal, window_size=c.window,
        softcap=c.softcap, alibi_slopes=p.slopes, compute_dtype=dtype,
    )  # fmt: skip
    rows = ref.used_rows(p.cu_q, p.used_q, p.q.shape[0], "cuda")
    dout = p.dout.to(out.dtype) * rows[:, None, None]
    dlse = torch.where(torch.isfinite(lse), p.dlse.to(lse.dtype), 0) * rows[None, :]
    torch.autograd.backward((out, torch.where(torch.isfinite(lse), lse, 0)), (dout, dlse))
    return q.grad, k.grad, v.grad


def _features(c: Case, p: Problem) -> FeatureArgs:
    return FeatureArgs(
        cu_seqlens_q=p.cu_q, cu_seqlens_k=p.cu_k, seqused_q=p.used_q, seqused_k=p.used_k, max_seqlen_q=max(c.lens_q),
        max_seqlen_k=max(c.lens_k), window=None if c.window == (-1, -1) else c.window, softcap=c.softcap,
        alibi_slopes=p.slopes,
    )  # fmt: skip


def _spec_for(c: Case, p: Problem):
    target, gpu = dispatch.device_target(p.q.device)
    f = _features(c, p)
    return feature_bwd.choose_bwd(
        target, p.q.dtype, p.q.shape[-1], c.causal, f, seqlen_k=max(c.lens_k), gpu_name=gpu
    )


def _check(
    name: str, got: torch.Tensor, want: torch.Tensor, low: torch.Tensor, rows: torch.Tensor, dtype
) -> None:
    """``got`` within three times the error of the ``dtype`` reference ``low`` (both against the
    float32 ``want``) on ``rows``, plus a floor of 1e-3 of the gradient's largest value."""
    assert not got.isnan().any(), f"{name} has NaN"
    if not rows.any():
        return
    g, w, lo = (t[rows].double() for t in (got, want, low))
    err = (g - w).abs().max().item()
    bound = 3 * (lo - w).abs().max().item() + 1e-3 * w.abs().max().item()
    assert err <= bound, f"{name}: max error {err:.3e} > 3 x the {dtype} reference's + floor ({bound:.3e})"


@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 64)], ids=str
)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_packed_gradients(case, dtype, head_dim):
    p = _problem(case, dtype, head_dim)
    spec = _spec_for(case, p)
    assert spec.arch == "sm90" and spec.features.varlen, spec.name
    got = _run(case, p)
    want = _reference(case, p, torch.float32)
    low = _reference(case, p, dtype)
    rows_q = ref.used_rows(p.cu_q, p.used_q, p.q.shape[0], "cuda")
    rows_k = ref.used_rows(p.cu_k, p.used_k, p.k.shape[0], "cuda")
    for name, g, w, lo, rows in zip(["dq", "dk", "dv"], got, want, low, (rows_q, rows_k, rows_k)):
        assert (g[~rows] == 0).all(), f"{name}: rows of no sequence must be zero"
        _check(name, g, w, lo, rows, dtype)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (8, 1), (16, 2)])
def test_dense_window_softcap_gqa(heads):
    """The dense layout with a window, softcap and ALiBi, GQA groups 1/2/4/8 and MQA, sq != sk."""
    torch.manual_seed(1)
    hq, hkv = heads
    q = torch.randn(2, 300, hq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 451, hkv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 451, hkv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    slopes = torch.rand(2, hq, device="cuda") * 0.1
    kw = {"causal": True, "window_size": (96, 0), "softcap": 20.0, "alibi_slopes": slopes}
    out = cutefa.flash_attn_func(q, k, v, **kw)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    grads = []
    for dt in (torch.float32, torch.bfloat16):
        qq, kk, vv = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
        o, _ = ref.attention_ref(qq, kk, vv, compute_dtype=dt, **kw)
        grads.append(torch.autograd.grad(o, (qq, kk, vv), dout.to(o.dtype)))
    for name, g, w, lo in zip(["dq", "dk", "dv"], got, *grads):
        _check(name, g, w, lo, torch.ones(g.shape[:2], dtype=torch.bool, device=g.device), torch.bfloat16)


def test_deterministic_is_bitwise_repeatable():
    case = Case(
        (1000, 17, 600), (900, 33, 600), heads_q=8, heads_kv=2, causal=True, window=(200, 0), softcap=15.0
    )
    p = _problem(case, torch.bfloat16, 128)
    first = _run(case, p, deterministic=True)
    second = _run(case, p, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _direct(c: Case, p: Problem, spec, poison: float):
    """The kernel called as the API calls it (cutefa/api/feature_bwd.py, deterministic), but with dq,
    dk, dv filled with ``poison`` instead of zeros."""
    dq, dk, dv = (torch.full_like(t, poison) for t in (p.q, p.k, p.v))
    heads_q = p.q.shape[1]
    n_seqs = len(c.lens_q)
    splits = dq_splits(
        True,
        n_seqs,
        heads_q,
        max(c.lens_k),
        spec.tile_n,
        torch.cuda.get_device_properties(0).multi_processor_count,
    )
    shape = feature_bwd._varlen_dq_accum_shape(spec, splits, p.q.shape[0], heads_q, n_seqs)
    dq_accum = torch.empty(shape, dtype=torch.float32, device="cuda")
    dkv_accum = feature_bwd._dkv_accum(spec, True, p.q, p.k, _features(c, p), n_seqs, dq_accum)
    out, lse = cutefa.flash_attn_varlen_func(
        p.q, p.k, p.v, p.cu_q, p.cu_k, max(c.lens_q), max(c.lens_k), causal=c.causal, window_size=c.window,
        softcap=c.softcap, alibi_slopes=p.slopes, seqused_q=p.used_q, seqused_k=p.used_k, return_lse=True,
    )  # fmt: skip
    f32 = {"dtype": torch.float32, "device": "cuda"}
    args = (
        p.q, p.k, p.v, out, p.dout, lse.float().contiguous(), p.dlse.contiguous(), dq, dk, dv, dq_accum, dkv_accum,
        torch.empty(lse.shape, **f32), torch.empty(lse.shape, **f32), float(1.0 / math.sqrt(p.q.shape[-1])), 1,
    )  # fmt: skip
    call_on(
        p.q.device,
        get_kernel(spec, dispatch.device_target(p.q.device)[0]),
        *args,
        *_features(c, p).kernel_args(c.causal, "bwd"),
    )
    torch.cuda.synchronize()
    return dq, dk, dv


@pytest.mark.parametrize(
    "case",
    [
        Case((17, 0, 1000, 1), (40, 0, 999, 1), heads_q=8, heads_kv=2, causal=True, slack=5, softcap=20.0),
        Case((300, 129), (500, 64), heads_q=4, heads_kv=4, window=(64, 0), causal=True, slack=7, alibi=True),
    ],
    ids=_id,
)
def test_poisoned_outputs_rows_of_sequences_written_others_zeroed(case):
    """The module called directly on NaN-poisoned dq, dk, dv: the sequences' rows are the API's,
    the rows of no sequence exactly 0 (the module's own fill, cutefa/kernels/common/varlen_fill.py:
    the API allocates the gradients with no memset)."""
    p = _problem(case, torch.bfloat16, 128, seed=3)
    spec = _spec_for(case, p)
    assert spec.arch == "sm90"
    dq, dk, dv = _direct(case, p, spec, math.nan)
    want = _run(case, p, deterministic=True)
    rows_q = ref.used_rows(p.cu_q, p.used_q, p.q.shape[0], "cuda")
    rows_k = ref.used_rows(p.cu_k, p.used_k, p.k.shape[0], "cuda")
    for name, g, w, rows in zip(["dq", "dk", "dv"], (dq, dk, dv), want, (rows_q, rows_k, rows_k)):
        assert torch.equal(g[rows], w[rows]), f"{name}: the rows of the sequences differ from the API's"
        assert (g[~rows] == 0).all(), f"{name}: a row of no sequence is not 0 (NaN: nothing wrote it)"
