"""The packed-batch forward's heavy-first grid (Scheduler.HEAVY_FIRST: LPT's order over every
sequence's query tiles, the CTAs past a sequence's tiles exiting at once) and the dense tuned tile
carried over to packed batches (128 x 176 with pair_cvt, policy_sm90.fwd_varlen_from_dense, on the
plain grid and on LPT), called
directly with the calling convention of cutefa/api/features.py against the float32 reference of
tests/gpu/test_sm90_features_kernels.py (sequence by sequence, NaN-poisoned outputs and slack rows,
lengths 0, 1, 17, 1000 and 4097, seqlen_q != seqlen_k, GQA), plus: batches whose (head, sequence)
pairs span several L2 sections of the order (an uneven last one), the edge batch in guarded memory,
a grid wider than every sequence, a batch without queries, and the heavy-first results bit for bit
those of the same tile on today's grid (the same arithmetic per tile, in another order)."""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import hopper_skip_reason
from test_sm90_features_kernels import (
    DTYPES,
    EDGE_LENGTHS,
    EDGE_SLACK,
    HEADS,
    TARGET,
    GuardedMemory,
    extras,
    feature_args,
    run_varlen,
    windows_of,
)

from cutefa.model.options import Mask, Schedule, Scheduler
from cutefa.model.spec import Features, VariantSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(hopper_skip_reason() is not None, reason=str(hopper_skip_reason())),
]


VARLEN = Features(varlen=True)


def _spec(dtype, head_dim, tile, mask, features=VARLEN, **options):
    return VariantSpec(
        "sm90", "fwd", dtype, head_dim, tile[0], tile[1], 2, 4 * (tile[0] // 64 + 1), mask=mask, features=features,
        schedule=Schedule.OVERLAP_PINGPONG, **options,
    )  # fmt: skip


HFIRST = Scheduler.HEAVY_FIRST
SPECS = [
    _spec("bf16", 128, (128, 128), Mask.CAUSAL, scheduler=HFIRST),
    _spec("bf16", 128, (128, 128), Mask.NONE, scheduler=HFIRST),
    _spec("bf16", 128, (128, 176), Mask.NONE, scheduler=HFIRST, pair_cvt=True),
    _spec("fp16", 128, (128, 176), Mask.CAUSAL, scheduler=HFIRST, pair_cvt=True),
    _spec("bf16", 128, (128, 176), Mask.NONE, pair_cvt=True),  # the dense tile on today's grid
    # what dispatch runs for uneven batches: the tables' tiles on the LPT scheduler
    _spec("bf16", 128, (128, 176), Mask.NONE, scheduler=Scheduler.LPT, pair_cvt=True),
    _spec("fp16", 128, (128, 160), Mask.CAUSAL, scheduler=Scheduler.LPT, pair_cvt=True),
    _spec("fp16", 64, (192, 128), Mask.CAUSAL, scheduler=HFIRST),
    _spec(
        "bf16",
        128,
        (128, 128),
        Mask.LOCAL,
        Features(varlen=True, softcap=True, alibi=True, sinks=True),
        scheduler=HFIRST,
    ),
]
HEAVY = [s for s in SPECS if s.options.scheduler is HFIRST]

# Long sequences, so that few (head, sequence) pairs fit an L2 section (parts.lpt_group from the mean
# key count): with 10 query heads, 40 pairs in sections of 8 or 16, the last one shorter.
LONG_LENGTHS = ((4097, 4097), (0, 3), (3000, 5000), (1, 9000))
LONG_SLACK = (1, 0, 2, 0)


def _kernel(spec):
    from cutefa.loader import get_kernel
    from cutefa.model.rules import why_invalid

    assert why_invalid(spec) is None, why_invalid(spec)
    return get_kernel(spec, TARGET)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_packed_batch(gen, spec):
    kernel = _kernel(spec)
    for heads_q, heads_kv in HEADS:
        for window in windows_of(spec):
            run_varlen(gen, spec, kernel, heads_q, heads_kv, window)


@pytest.mark.parametrize("spec", HEAVY, ids=lambda s: s.name)
def test_several_l2_sections(gen, spec):
    kernel = _kernel(spec)
    window = (300, 0) if spec.mask is Mask.LOCAL else None
    run_varlen(gen, spec, kernel, 10, 5, window, LONG_LENGTHS, LONG_SLACK)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_many_sequences(gen, spec):
    """70 sequences, lengths 0 to 700 with zeros among them."""
    kernel = _kernel(spec)
    draw = torch.randint(0, 700, (70, 2), generator=torch.Generator().manual_seed(70))
    draw[::9, 0] = 0
    draw[4::9, 1] = 0
    lengths = [(int(a), int(b)) for a, b in draw]
    slack = [int(x) for x in torch.randint(0, 4, (70,), generator=torch.Generator().manual_seed(71))]
    window = (200, 30) if spec.mask is Mask.LOCAL else None
    run_varlen(gen, spec, kernel, 4, 2, window, lengths, slack)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_guarded(gen, spec):
    """The edge batch with q, k, v and out in guarded memory: any access outside them faults."""
    kernel = _kernel(spec)
    for window in ((0, 0), (-1, 0)) if spec.mask is Mask.LOCAL else (None,):
        with GuardedMemory() as memory:
            run_varlen(gen, spec, kernel, 4, 2, window, EDGE_LENGTHS, EDGE_SLACK, memory)


def _call(gen, spec, kernel, lengths, max_seqlen_q, heads=(4, 2)):
    """(out, lse) of one call on a packed batch of equal q/k spans ``lengths``, outputs NaN-filled."""
    d, dtype = spec.head_dim, DTYPES[spec.dtype]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    used = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(total, heads[0], d, generator=g, device="cuda").to(dtype)
    k = torch.randn(total, heads[1], d, generator=g, device="cuda").to(dtype)
    v = torch.randn(total, heads[1], d, generator=g, device="cuda").to(dtype)
    out = torch.full_like(q, math.nan)
    lse = torch.full((heads[0], total), math.nan, device="cuda")
    slopes, sinks = extras(torch.Generator(device="cuda").manual_seed(6), spec, len(lengths), heads[0])
    window = (300, 0) if spec.mask is Mask.LOCAL else None
    kernel(
        q,
        k,
        v,
        out,
        lse,
        0.125,
        *feature_args(spec, window, slopes, sinks, (cu, cu, used, used, max_seqlen_q)),
    )
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("spec", HEAVY, ids=lambda s: s.name)
def test_same_bits_as_the_grid(gen, spec):
    """The heavy-first grid computes each tile as the grid does: the same bits; and a grid wider
    than every sequence (max_seqlen_q past the longest: whole levels of CTAs exit) changes nothing."""
    lengths = [1000, 0, 17, 4097, 1, 300, 129]
    mine = _call(gen, spec, _kernel(spec), lengths, max(lengths))
    grid = _call(gen, spec, _kernel(spec.replace(scheduler=Scheduler.GRID)), lengths, max(lengths))
    wide = _call(gen, spec, _kernel(spec), lengths, 3 * max(lengths))
    rows = torch.ones(sum(lengths), dtype=torch.bool, device="cuda")
    assert not mine[0][rows].isnan().any() and not mine[1].isnan().any()
    for a, b in ((mine, grid), (mine, wide)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("spec", HEAVY, ids=lambda s: s.name)
def test_batch_without_queries(gen, spec):
    """Every seqused_q 0 (max_seqlen_q 0): one CTA across, which finds no row and writes nothing;
    the module's fill makes every row (one of no sequence) 0 / -inf."""
    kernel = _kernel(spec)
    d, dtype = spec.head_dim, DTYPES[spec.dtype]
    cu = torch.tensor([0, 40, 80], dtype=torch.int32, device="cuda")
    used_q = torch.zeros(2, dtype=torch.int32, device="cuda")
    used_k = torch.tensor([40, 7], dtype=torch.int32, device="cuda")
    q = torch.randn(80, 4, d, generator=gen, device="cuda").to(dtype)
    k = torch.randn(80, 2, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(80, 2, d, generator=gen, device="cuda").to(dtype)
    out = torch.full_like(q, math.nan)
    lse = torch.full((4, 80), math.nan, device="cuda")
    slopes, sinks = extras(gen, spec, 2, 4)
    window = (10, 0) if spec.mask is Mask.LOCAL else None
    kernel(q, k, v, out, lse, 0.125, *feature_args(spec, window, slopes, sinks, (cu, cu, used_q, used_k, 0)))
    torch.cuda.synchronize()
    assert (out == 0).all() and torch.isneginf(lse).all()
