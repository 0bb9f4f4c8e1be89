"""The sm80-family feature kernels (varlen, local window, softcap, ALiBi, sinks), forward and
backward, called directly (``cutefa.loader.get_kernel`` and the calling convention of
cutefa/api/features.py) against the float32 reference of tests/gpu/reference.py, computed sequence
by sequence.

Error bars: the kernel's largest error against the float32 reference must be at most twice that of
the same reference computed in the kernel's dtype (FlashAttention's own test rule), plus the
rounding of the output dtype; the lse at most twice the low-precision reference's error plus
2e-3 (tanh.approx in softcap moves a capped score by up to c * 2**-11). Rows that attend no key must
be exactly 0 with lse -inf (the sink with sinks). Outputs are NaN-poisoned before each launch, so a
row the kernel should have written and did not fails. Rows of a packed span past seqused are not
compared here (the module's fill makes them 0 / -inf: tests/gpu/test_varlen_fill_gpu.py).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm80_skip_reason as _skip_reason

from cutefa import dispatch
from cutefa.api.features import UNBOUNDED
from cutefa.loader import get_kernel
from cutefa.model.options import DqLayout, Mask
from cutefa.model.spec import Features, VariantSpec

ref = _load("reference")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (head_dim) -> forward tile (tile_m, tile_n, stages, warps) and backward tile + dQ layout: defaults
FWD_TILES = {64: (128, 64, 1, 4), 128: (128, 128, 1, 8)}
BWD_TILES = {64: (64, 128, 2, 8, DqLayout.TILE), 128: (64, 128, 1, 8, DqLayout.TILE)}


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: a packed batch (``lengths_q``/``lengths_k`` the spans, ``used_*`` the used rows)
    or a dense one (``dense``: batch, seqlen_q, seqlen_k), and the features' runtime values."""

    name: str
    lengths_q: tuple[int, ...] = ()
    lengths_k: tuple[int, ...] = ()
    used_q: tuple[int, ...] | None = None
    used_k: tuple[int, ...] | None = None
    dense: tuple[int, int, int] | None = None
    heads: tuple[int, int] = (6, 2)  # (heads_q, heads_kv): grouped
    causal: bool = False
    window: tuple[int, int] | None = None  # FlashAttention's (left, right), -1 unbounded
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    q_scale: float = 1.0  # larger scores: the softcap saturates

    @property
    def varlen(self) -> bool:
        return self.dense is None

    def mask(self) -> Mask:
        return Mask.LOCAL if self.window is not None else Mask.CAUSAL if self.causal else Mask.NONE

    def features(self) -> Features:
        return Features(varlen=self.varlen, softcap=self.softcap > 0, alibi=self.alibi, sinks=self.sinks)

    def window_args(self) -> tuple[int, int]:
        left, right = self.window
        left = UNBOUNDED if left < 0 else left
        right = UNBOUNDED if right < 0 else right
        return left, min(right, 0) if self.causal else right


RAGGED_Q = (1, 17, 0, 1000, 129, 300)
RAGGED_K = (17, 1, 0, 1000, 300, 64)
USED_Q = (1, 17, 0, 900, 129, 200)  # seqused < span for two sequences
USED_K = (17, 1, 0, 1000, 250, 64)

CASES = [
    Case("varlen", RAGGED_Q, RAGGED_K, USED_Q, USED_K),
    Case("varlen_causal", RAGGED_Q, RAGGED_K, USED_Q, USED_K, causal=True),
    Case("local", dense=(2, 1000, 1000), window=(100, 37)),
    Case("local_causal", dense=(2, 700, 1000), window=(300, -1), causal=True),
    Case("local_left_only", dense=(1, 1000, 700), window=(64, -1)),
    # rows 0..~690 see no key: their band ends before key 0
    Case("local_empty_rows", dense=(2, 1000, 300), window=(10, 5)),
    Case("local_right_only", dense=(1, 513, 1000), window=(-1, 3)),
    Case("softcap", dense=(2, 1000, 700), softcap=5.0, q_scale=4.0),
    Case("alibi", dense=(2, 300, 1000), alibi=True),
    Case("alibi_causal", dense=(2, 1000, 1000), alibi=True, causal=True),
    Case("sinks", dense=(2, 1000, 1000), sinks=True),
    Case("sinks_causal_empty_rows", dense=(1, 1000, 200), sinks=True, causal=True),
    Case("varlen_local", RAGGED_Q, RAGGED_K, USED_Q, USED_K, window=(50, 20)),
    Case("varlen_local_causal", RAGGED_Q, RAGGED_K, USED_Q, USED_K, window=(128, 0), causal=True),
    Case(
        "all",
        RAGGED_Q,
        RAGGED_K,
        USED_Q,
        USED_K,
        window=(200, 60),
        softcap=10,
        alibi=True,
        sinks=True,
        q_scale=2,
    ),
]
# Each case at bf16 hd128 and fp16 hd64; the plain varlen case and the all-features one at every
# dtype and head dim.
FULL = ("varlen", "all")
MATRIX = [
    (case, dtype, head_dim)
    for case in CASES
    for dtype, head_dim in (
        [("bf16", 128), ("fp16", 64), ("bf16", 64), ("fp16", 128)]
        if case.name in FULL
        else [("bf16", 128), ("fp16", 64)]
    )
]


def _id(entry) -> str:
    case, dtype, head_dim = entry
    return f"{case.name}-{dtype}-hd{head_dim}"


def _target() -> str:
    return dispatch.device_target(torch.device("cuda"))[0]


def _spec(
    direction: str, dtype: str, head_dim: int, case: Case, dq_layout: DqLayout | None = None
) -> VariantSpec:
    if direction == "fwd":
        tile_m, tile_n, stages, warps = FWD_TILES[head_dim]
        options = {}
    else:
        tile_m, tile_n, stages, warps, layout = BWD_TILES[head_dim]
        options = {"dq_layout": layout if dq_layout is None else dq_layout}
    features = case.features()
    if direction == "bwd":
        features = dataclasses.replace(features, sinks=False)  # the backward needs no sink argument
    return VariantSpec(
        "sm80", direction, dtype, head_dim, tile_m, tile_n, stages, warps, mask=case.mask(), features=features,
        **options,
    )  # fmt: skip


@dataclasses.dataclass
class Problem:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor | None
    cu_k: torch.Tensor | None
    used_q: torch.Tensor | None
    used_k: torch.Tensor | None
    slopes: torch.Tensor | None  # (batch, heads_q)
    sinks: torch.Tensor | None
    scale: float
    batch: int


def _problem(case: Case, dtype: torch.dtype, head_dim: int, gen: torch.Generator) -> Problem:
    hq, hkv = case.heads
    dev = "cuda"
    if case.varlen:
        shape_q, shape_k = (sum(case.lengths_q), hq, head_dim), (sum(case.lengths_k), hkv, head_dim)
        batch = len(case.lengths_q)
    else:
        batch, sq, sk = case.dense
        shape_q, shape_k = (batch, sq, hq, head_dim), (batch, sk, hkv, head_dim)
    q = (torch.randn(shape_q, generator=gen, device=dev) * case.q_scale).to(dtype)
    k = torch.randn(shape_k, generator=gen, device=dev).to(dtype)
    v = torch.randn(shape_k, generator=gen, device=dev).to(dtype)
    cu_q = cu_k = used_q = used_k = None
    if case.varlen:
        i32 = {"dtype": torch.int32, "device": dev}
        cu_q = torch.tensor([0, *torch.tensor(case.lengths_q).cumsum(0).tolist()], **i32)
        cu_k = torch.tensor([0, *torch.tensor(case.lengths_k).cumsum(0).tolist()], **i32)
        used_q = torch.tensor(case.used_q or case.lengths_q, **i32)
        used_k = torch.tensor(case.used_k or case.lengths_k, **i32)
    slopes = None
    if case.alibi:
        slopes = torch.rand((batch, hq), generator=gen, device=dev, dtype=torch.float32) * 0.5
    sinks = torch.randn((hq,), generator=gen, device=dev, dtype=torch.float32) * 2 if case.sinks else None
    return Problem(q, k, v, cu_q, cu_k, used_q, used_k, slopes, sinks, 1.0 / math.sqrt(head_dim), batch)


def _reference(case: Case, p: Problem, compute_dtype=torch.float32, q=None, k=None, v=None):
    q, k, v = (p.q if q is None else q), (p.k if k is None else k), (p.v if v is None else v)
    kw = {
        "causal": case.causal, "window_size": case.window or ref.NO_WINDOW, "softcap": case.softcap,
        "alibi_slopes": p.slopes, "sinks": p.sinks, "softmax_scale": p.scale, "compute_dtype": compute_dtype,
    }  # fmt: skip
    if case.varlen:
        return ref.varlen_ref(q, k, v, p.cu_q, p.cu_k, seqused_q=p.used_q, seqused_k=p.used_k, **kw)
    return ref.attention_ref(q, k, v, **kw)


def _feature_args(case: Case, p: Problem, backward: bool) -> list:
    args = []
    if case.varlen:
        args += [p.cu_q, p.cu_k, p.used_q, p.used_k]
        max_q, max_k = int(p.used_q.max()), int(p.used_k.max())
        args += [max_q, max_k] if backward else [max_q]
    if case.window is not None:
        args += list(case.window_args())
    if case.softcap > 0:
        args.append(float(case.softcap))
    if case.alibi:
        args.append(p.slopes)
    if case.sinks and not backward:
        args.append(p.sinks)
    return args


def _rows_used(case: Case, p: Problem) -> torch.Tensor:
    """Boolean over the output rows (packed rows, or every row of a dense batch) the kernel writes."""
    if case.varlen:
        return ref.used_rows(p.cu_q, p.used_q, p.q.shape[0], p.q.device)
    return torch.ones(p.q.shape[0] * p.q.shape[1], dtype=torch.bool, device=p.q.device)


def _forward(case: Case, dtype_name: str, head_dim: int, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    spec = _spec("fwd", dtype_name, head_dim, case)
    kernel = get_kernel(spec, _target())
    out = torch.full_like(p.q, math.nan)
    hq = p.q.shape[-2]
    lse_shape = (hq, p.q.shape[0]) if case.varlen else (p.q.shape[0], hq, p.q.shape[1])
    lse = torch.full(lse_shape, math.nan, dtype=torch.float32, device=p.q.device)
    kernel(p.q, p.k, p.v, out, lse, p.scale, *_feature_args(case, p, backward=False))
    torch.cuda.synchronize()
    return out, lse


def _flat_rows(case: Case, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out as (rows, heads, d) and lse as (rows, heads), rows packed or batch-major."""
    if case.varlen:
        return out, lse.transpose(0, 1)
    return out.flatten(0, 1), lse.transpose(1, 2).flatten(0, 1)


@pytest.mark.parametrize("entry", MATRIX, ids=_id)
def test_forward(entry, gen):
    case, dtype_name, head_dim = entry
    dtype = DTYPES[dtype_name]
    p = _problem(case, dtype, head_dim, gen)
    out, lse = _forward(case, dtype_name, head_dim, p)
    ref_out, ref_lse = _reference(case, p)
    low_out, low_lse = _reference(case, p, compute_dtype=dtype)
    rows = _rows_used(case, p)
    out, lse = _flat_rows(case, out, lse)
    ref_out, ref_lse = _flat_rows(case, ref_out, ref_lse)
    low_out, low_lse = _flat_rows(case, low_out, low_lse)
    out, lse, ref_out, ref_lse, low_out, low_lse = (
        t[rows] for t in (out, lse, ref_out, ref_lse, low_out, low_lse)
    )
    assert not torch.isnan(out).any(), "unwritten (NaN) output rows"
    assert not torch.isnan(lse).any(), "unwritten (NaN) lse rows"
    # rows with no key (no sinks): out exactly 0, lse -inf
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows with no key differ"
    empty = torch.isneginf(ref_lse)
    assert (out.float()[empty[..., None].expand_as(out)] == 0).all()
    bound = 2 * ref.max_abs(low_out, ref_out) + ref.rounding_error(ref_out, dtype) + 1e-5
    assert ref.max_abs(out, ref_out) <= bound, (ref.max_abs(out, ref_out), bound)
    # lse: float32 work, but for tanh.approx's error on capped scores (<= softcap * 2**-11)
    finite = torch.isfinite(ref_lse)
    err = (lse[finite].double() - ref_lse[finite].double()).abs()
    lse_bound = 1e-3 * (1 + ref_lse[finite].double().abs()) + case.softcap * 2.0**-10
    assert (err <= lse_bound).all(), f"lse error {err.max().item()}"


def test_forward_empty_sequences_with_sinks_get_the_sink(gen):
    """A sequence with queries and no key: out 0 and lse = the head's sink."""
    case = Case("sink_no_keys", (5, 40), (0, 33), sinks=True)
    p = _problem(case, torch.bfloat16, 64, gen)
    out, lse = _forward(case, "bf16", 64, p)
    assert (out[:5].float() == 0).all()
    torch.testing.assert_close(lse[:, :5], p.sinks[:, None].expand(-1, 5), rtol=1e-5, atol=1e-6)
    assert not torch.isnan(out[5:]).any()


# ---------------------------------------------------------------------------------------------
# Backward


def _workspaces(spec: VariantSpec, case: Case, p: Problem, splits: int) -> tuple[torch.Tensor, ...]:
    f32 = {"dtype": torch.float32, "device": p.q.device}
    hq, d = p.q.shape[-2], p.q.shape[-1]
    if case.varlen:
        total_q = p.q.shape[0]
        if spec.options.dq_layout is DqLayout.TILE:
            dq_accum = torch.empty((splits, hq, total_q // spec.tile_m + p.batch, spec.tile_m * d), **f32)
        else:
            dq_accum = torch.empty((splits, total_q, hq, d), **f32)
        rows = (hq, total_q)
    else:
        from cutefa.model.budgets import bwd_dq_accum_shape

        batch, sq = p.q.shape[0], p.q.shape[1]
        dq_accum = torch.empty(bwd_dq_accum_shape(spec, splits, batch, sq, hq), **f32)
        rows = (batch, hq, sq)
    part = torch.empty((1, 2, 2, spec.tile_n * d), **f32)
    count = torch.empty((1,), dtype=torch.int32, device=p.q.device)
    return dq_accum, torch.empty(rows, **f32), torch.empty(rows, **f32), part, count


def _backward(
    case, dtype_name, head_dim, p, out, lse, dout, dlse, deterministic=False, splits=1, dq_layout=None
):
    spec = _spec("bwd", dtype_name, head_dim, case, dq_layout)
    kernel = get_kernel(spec, _target())
    hq = p.q.shape[-2]
    dq = torch.full_like(p.q, math.nan)
    kv_heads = (p.k.shape[0], hq, head_dim) if case.varlen else (p.k.shape[0], p.k.shape[1], hq, head_dim)
    dk = torch.full(kv_heads, math.nan, dtype=p.q.dtype, device=p.q.device)
    dv = torch.full(kv_heads, math.nan, dtype=p.q.dtype, device=p.q.device)
    dq_accum, lse2, dpsum, part, count = _workspaces(spec, case, p, splits)
    kernel(
        p.q, p.k, p.v, out, dout, lse, dlse, dq, dk, dv, dq_accum, lse2, dpsum, part, count, p.scale,
        int(deterministic), 0, *_feature_args(case, p, backward=True),
    )  # fmt: skip
    torch.cuda.synchronize()
    group = hq // p.k.shape[-2]
    dk = dk.unflatten(-2, (-1, group)).float().sum(-2)
    dv = dv.unflatten(-2, (-1, group)).float().sum(-2)
    return dq, dk, dv


def _ref_grads(case, p, dout, dlse, compute_dtype):
    q, k, v = (t.detach().to(compute_dtype).requires_grad_() for t in (p.q, p.k, p.v))
    out, lse = _reference(case, p, compute_dtype, q, k, v)
    if case.varlen:
        rows = _rows_used(case, p)
        lse_rows = rows[None, :].expand_as(lse)
        out_rows = rows[:, None, None].expand_as(out)
    else:
        lse_rows = torch.ones_like(lse, dtype=torch.bool)
        out_rows = torch.ones_like(out, dtype=torch.bool)
    lse_term = torch.where(
        lse_rows & torch.isfinite(lse), lse * dlse.to(compute_dtype), torch.zeros_like(lse)
    )
    loss = torch.where(out_rows, out * dout.to(compute_dtype), torch.zeros_like(out)).sum() + lse_term.sum()
    return torch.autograd.grad(loss, (q, k, v))


def _kv_rows(case: Case, p: Problem) -> torch.Tensor:
    if case.varlen:
        return ref.used_rows(p.cu_k, p.used_k, p.k.shape[0], p.k.device)
    return torch.ones(p.k.shape[0] * p.k.shape[1], dtype=torch.bool, device=p.k.device)


def _written(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows of ``t`` (packed, or a dense batch's rows batch-major) that ``rows`` selects."""
    return t.flatten(0, -3)[rows] if t.dim() == 4 else t[rows]


def _check_grad(name, got, want, low, rows, dtype):
    got, want, low = (_written(t, rows) for t in (got, want, low))
    assert not torch.isnan(got).any(), f"{name}: unwritten (NaN) rows"
    bound = 2 * ref.max_abs(low, want) + ref.rounding_error(want, dtype) + 1e-4
    err = ref.max_abs(got, want)
    assert err <= bound, f"{name}: max error {err} > {bound}"


@pytest.mark.parametrize("entry", MATRIX, ids=_id)
def test_backward(entry, gen):
    case, dtype_name, head_dim = entry
    dtype = DTYPES[dtype_name]
    p = _problem(case, dtype, head_dim, gen)
    out, lse = _forward(case, dtype_name, head_dim, p)
    dout = torch.randn(p.q.shape, generator=gen, device="cuda").to(dtype)
    dlse = torch.randn(lse.shape, generator=gen, device="cuda", dtype=torch.float32)
    dlse = torch.where(torch.isfinite(lse), dlse, torch.zeros_like(dlse))  # the API passes 0 there
    if case.varlen:  # rows no sequence uses: defined values, as the API's allocation would give
        unused = ~_rows_used(case, p)
        out[unused] = 0
        lse[:, unused] = -math.inf
        dlse[:, unused] = 0
    dq, dk, dv = _backward(case, dtype_name, head_dim, p, out, lse, dout, dlse)
    want = _ref_grads(case, p, dout, dlse, torch.float32)
    low = _ref_grads(case, p, dout, dlse, dtype)
    q_rows, k_rows = _rows_used(case, p), _kv_rows(case, p)
    _check_grad("dq", dq, want[0], low[0], q_rows, dtype)
    _check_grad("dk", dk, want[1], low[1], k_rows, dtype)
    _check_grad("dv", dv, want[2], low[2], k_rows, dtype)


@pytest.mark.parametrize("dq_layout", [DqLayout.ROWS, DqLayout.QUAD, DqLayout.TILE], ids=lambda x: x.name)
@pytest.mark.parametrize("case", [CASES[0], CASES[-1]], ids=lambda c: c.name)
def test_backward_deterministic_is_bitwise_repeatable(case, dq_layout, gen):
    """deterministic=1 with several dQ splits: two runs give the same bits, within the error bar.
    The bits are compared on the rows the kernel writes: the packed rows past a sequence's seqused
    keep their NaN poison, and NaN never equals NaN (torch.equal)."""
    dtype, head_dim = torch.bfloat16, 128
    p = _problem(case, dtype, head_dim, gen)
    out, lse = _forward(case, "bf16", head_dim, p)
    dout = torch.randn(p.q.shape, generator=gen, device="cuda").to(dtype)
    dlse = torch.zeros_like(lse)
    lse = torch.where(torch.isnan(lse), torch.full_like(lse, -math.inf), lse)
    out = torch.where(torch.isnan(out), torch.zeros_like(out), out)
    runs = [
        _backward(
            case, "bf16", head_dim, p, out, lse, dout, dlse, deterministic=True, splits=3, dq_layout=dq_layout
        )
        for _ in range(2)
    ]
    q_rows, k_rows = _rows_used(case, p), _kv_rows(case, p)
    for name, a, b, rows in zip(("dq", "dk", "dv"), *runs, (q_rows, k_rows, k_rows)):
        a, b = _written(a, rows), _written(b, rows)
        assert not torch.isnan(a).any() and not torch.isnan(b).any(), f"{name}: unwritten (NaN) rows"
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} values differ between runs"
    want = _ref_grads(case, p, dout, dlse, torch.float32)
    low = _ref_grads(case, p, dout, dlse, dtype)
    _check_grad("dq", runs[0][0], want[0], low[0], q_rows, dtype)
    _check_grad("dk", runs[0][1], want[1], low[1], k_rows, dtype)
    _check_grad("dv", runs[0][2], want[2], low[2], k_rows, dtype)


def kernel_specs() -> list[VariantSpec]:
    """Every variant this file runs (compile them ahead, in parallel, with
    ``python tests/gpu/test_sm80_features_kernels.py --target sm_90a --jobs 16``)."""
    specs = {
        _spec(direction, dtype, head_dim, case)
        for case, dtype, head_dim in MATRIX
        for direction in ("fwd", "bwd")
    }
    specs |= {
        _spec("bwd", "bf16", 128, case, layout) for case in (CASES[0], CASES[-1]) for layout in DqLayout
    }
    specs.add(_spec("fwd", "bf16", 64, Case("sink_no_keys", (5, 40), (0, 33), sinks=True)))
    return sorted(specs)


if __name__ == "__main__":
    import argparse

    from cutefa.compile import compile_variants

    parser = argparse.ArgumentParser(description="compile the variants of this test file into the cache")
    parser.add_argument("--target", default="sm_90a")
    parser.add_argument("--jobs", type=int, default=8)
    args = parser.parse_args()
    failed = [r for r in compile_variants(kernel_specs(), target=args.target, jobs=args.jobs) if not r.ok]
    raise SystemExit(1 if failed else 0)
