"""The sm90 16-bit forward at head dims of its own (templates/fwd_sm90.py.j2 with
cutefa/kernels/sm90/head_dims.py): multiples of 8 that WGMMA's k step pads (8, 40, 72), the tuned
80 and 112, and q/k of 192 against v of 128 (DeepSeek's prefill), called directly with the calling
convention of cutefa/api/features.py against a float32 reference (tests/gpu/test_sm90_features_kernels.py's
``check``: errors within twice those of the same attention in the inputs' dtype).

Every tensor is a slice of a wider buffer whose extra columns hold NaN: q, k and v so that a read
past the real head dim (a TMA box that is not zero-filled past the tensor's extent) poisons the
output, and the output so that a write past the real V head dim shows (the pad columns of O must
stay NaN). Outputs start NaN-filled, so an element the kernel does not write fails. Lengths 1, 17
and 1000 against each other, causal and not, a packed batch (the ragged views), a local window with
every score modifier, the persistent scheduler, fp16 and bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import hopper_skip_reason, load_sibling

from cutefa.model.budgets_sm90 import sm90_fwd_own_tile_n
from cutefa.model.options import Mask, Schedule, Scheduler
from cutefa.model.spec import Features, VariantSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(hopper_skip_reason() is not None, reason=str(hopper_skip_reason())),
]

features_kernels = load_sibling("test_sm90_features_kernels")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TARGET = "sm_90a"
PAD = 8  # NaN columns past each tensor's head dim in its buffer (rows stay 16-byte multiples)


def _spec(head_dim, head_dim_v=None, *, dtype="bf16", mask=Mask.NONE, tile_n=None, **flags):
    """A 16-bit sm90 forward: 128 x the budget model's key tile for these head dims unless given,
    overlap + ping-pong; ``flags``: the Features fields and option fields."""
    feature_names = {"varlen", "softcap", "alibi", "sinks"}
    features = Features(**{k: v for k, v in flags.items() if k in feature_names})
    options = {k: v for k, v in flags.items() if k not in feature_names}
    tile_n = tile_n or sm90_fwd_own_tile_n(dtype, head_dim, head_dim_v)
    return VariantSpec(
        "sm90", "fwd", dtype, head_dim, 128, tile_n, 2, 12, mask=mask, features=features, head_dim_v=head_dim_v,
        schedule=Schedule.OVERLAP_PINGPONG, **options,
    )  # fmt: skip


SPECS = [
    _spec(8),
    _spec(40, mask=Mask.CAUSAL),
    _spec(72, dtype="fp16"),
    _spec(72, mask=Mask.CAUSAL),
    _spec(80),
    _spec(80, mask=Mask.CAUSAL),
    _spec(112, dtype="fp16"),
    _spec(112, mask=Mask.CAUSAL),
    _spec(192, 128),
    _spec(192, 128, dtype="fp16", mask=Mask.CAUSAL),
    _spec(200),
    # a packed batch (the ragged views clip at each sequence's end)
    _spec(72, mask=Mask.CAUSAL, varlen=True),
    _spec(80, varlen=True),
    _spec(192, 128, varlen=True),
    _spec(192, 128, mask=Mask.CAUSAL, varlen=True),
    # the local window with every score modifier; the persistent scheduler (O staged apart)
    _spec(40, mask=Mask.LOCAL, softcap=True, alibi=True, sinks=True),
    _spec(112, mask=Mask.CAUSAL, scheduler=Scheduler.PERSISTENT),
    _spec(192, 128, mask=Mask.CAUSAL, tile_n=96, scheduler=Scheduler.PERSISTENT, varlen=True),
]
# (batch, seqlen_q, seqlen_k) of the dense calls
DENSE_SHAPES = ((1, 1, 1), (2, 17, 1000), (1, 1000, 17), (1, 1000, 1000), (1, 1, 17))
# (seqlen_q, seqlen_k) per sequence of a packed batch, and the NaN rows past each span's seqused
VARLEN_LENGTHS = ((1, 1), (17, 1000), (1000, 17), (0, 5), (300, 129), (1, 1000))
SLACK = (0, 3, 0, 2, 1, 0)
WINDOWS = ((100, 50), (-1, 0))
HEADS_Q, HEADS_KV = 4, 2


def _poisoned(gen, shape, dim, dtype, fill_random=True):
    """(view, buffer): a (*shape, dim) view of a (*shape, dim + PAD) NaN buffer, random unless not
    ``fill_random`` (then NaN throughout)."""
    buffer = torch.full((*shape, dim + PAD), math.nan, dtype=dtype, device="cuda")
    view = buffer[..., :dim]
    if fill_random:
        view.copy_(torch.randn(*shape, dim, generator=gen, device="cuda").to(dtype))
    return view, buffer


def _pad_untouched(buffer, dim, name, where):
    assert buffer[..., dim:].isnan().all(), f"{where}: a pad column of {name} past head dim {dim} was written"


def run_dense(gen, spec, kernel, window, shape):
    dtype, d, dv = DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v
    scale = 1.0 / math.sqrt(d)
    batch, sq, sk = shape
    q, _ = _poisoned(gen, (batch, sq, HEADS_Q), d, dtype)
    k, _ = _poisoned(gen, (batch, sk, HEADS_KV), d, dtype)
    v, _ = _poisoned(gen, (batch, sk, HEADS_KV), dv, dtype)
    out, out_buffer = _poisoned(gen, (batch, sq, HEADS_Q), dv, dtype, fill_random=False)
    lse = torch.full((batch, HEADS_Q, sq), math.nan, device="cuda")
    slopes, sinks = features_kernels.extras(gen, spec, batch, HEADS_Q)
    kernel(q, k, v, out, lse, scale, *features_kernels.feature_args(spec, window, slopes, sinks))
    torch.cuda.synchronize()
    where = f"{spec.name} window {window} shape {shape}"
    _pad_untouched(out_buffer, dv, "out", where)
    for b in range(batch):
        features_kernels.check(
            out[b], lse[b], q[b], k[b], v[b], scale, spec, window, None if slopes is None else slopes[b], sinks,
            f"{where} batch {b}",
        )  # fmt: skip


def run_varlen(gen, spec, kernel, window):
    dtype, d, dv = DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v
    scale = 1.0 / math.sqrt(d)
    lens_q = [sq for sq, _ in VARLEN_LENGTHS]
    lens_k = [sk for _, sk in VARLEN_LENGTHS]
    starts_q = [0, *torch.tensor([n + s for n, s in zip(lens_q, SLACK, strict=True)]).cumsum(0).tolist()]
    starts_k = [0, *torch.tensor([n + s for n, s in zip(lens_k, SLACK, strict=True)]).cumsum(0).tolist()]
    total_q, total_k = starts_q[-1] + 5, starts_k[-1] + 5  # a packed tail past the last span
    q, _ = _poisoned(gen, (total_q, HEADS_Q), d, dtype, fill_random=False)
    k, _ = _poisoned(gen, (total_k, HEADS_KV), d, dtype, fill_random=False)
    v, _ = _poisoned(gen, (total_k, HEADS_KV), dv, dtype, fill_random=False)
    for b in range(len(lens_q)):  # each sequence's rows random; slack, tail and pad columns NaN
        q[starts_q[b] : starts_q[b] + lens_q[b]] = torch.randn(
            lens_q[b], HEADS_Q, d, generator=gen, device="cuda"
        ).to(dtype)
        k[starts_k[b] : starts_k[b] + lens_k[b]] = torch.randn(
            lens_k[b], HEADS_KV, d, generator=gen, device="cuda"
        ).to(dtype)
        v[starts_k[b] : starts_k[b] + lens_k[b]] = torch.randn(
            lens_k[b], HEADS_KV, dv, generator=gen, device="cuda"
        ).to(dtype)
    out, out_buffer = _poisoned(gen, (total_q, HEADS_Q), dv, dtype, fill_random=False)
    lse = torch.full((HEADS_Q, total_q), math.nan, device="cuda")
    cu_q = torch.tensor(starts_q, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(starts_k, dtype=torch.int32, device="cuda")
    used_q = torch.tensor(lens_q, dtype=torch.int32, device="cuda")
    used_k = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    slopes, sinks = features_kernels.extras(gen, spec, len(lens_q), HEADS_Q)
    varlen = (cu_q, cu_k, used_q, used_k, max(lens_q))
    kernel(q, k, v, out, lse, scale, *features_kernels.feature_args(spec, window, slopes, sinks, varlen))
    torch.cuda.synchronize()
    _pad_untouched(out_buffer, dv, "out", spec.name)
    written = torch.zeros(total_q, dtype=torch.bool, device="cuda")
    for b in range(len(lens_q)):
        rq = slice(starts_q[b], starts_q[b] + lens_q[b])
        rk = slice(starts_k[b], starts_k[b] + lens_k[b])
        written[rq] = True
        features_kernels.check(
            out[rq], lse[:, rq], q[rq], k[rk], v[rk], scale, spec, window,
            None if slopes is None else slopes[b], sinks, f"{spec.name} window {window} sequence {b} {VARLEN_LENGTHS[b]}",
        )  # fmt: skip
    assert (out[~written] == 0).all(), f"{spec.name}: packed rows of no sequence must be 0 (the fill)"
    assert torch.isneginf(lse[:, ~written]).all(), (
        f"{spec.name}: packed rows of no sequence must have lse -inf"
    )


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_head_dim_kernel(gen, spec):
    from cutefa.loader import get_kernel
    from cutefa.model.rules import why_invalid

    assert why_invalid(spec) is None, why_invalid(spec)
    kernel = get_kernel(spec, TARGET)  # a persistent kernel's SM count is appended last
    for window in WINDOWS if spec.mask is Mask.LOCAL else (None,):
        if spec.features.varlen:
            run_varlen(gen, spec, kernel, window)
        else:
            for shape in DENSE_SHAPES:
                run_dense(gen, spec, kernel, window, shape)
