"""Every committed variant (not only the ones dispatch picks today) is correct on the GPU.

Each kernel is called directly with outputs poisoned with NaN beforehand, so an element the kernel
does not write fails the check. Shapes cover partial tiles on both sides, seqlen_q != seqlen_k,
one-row problems and GQA.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import all_variants
from gpu_support import load_sibling as _load

fwd = _load("test_fwd_sm80")
pytestmark = fwd.pytestmark

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv); the last has more tiles than the H200 has SMs, so
# a persistent variant's CTAs each walk several tiles (and several sections of its tile order).
SHAPES = (
    (1, 1, 1, 2, 2),
    (2, 17, 1000, 4, 2),
    (1, 1000, 17, 3, 3),
    (1, 1000, 4097, 8, 1),
    (2, 333, 257, 6, 2),
    (4, 1000, 1100, 16, 4),
)


FORWARDS = [
    s for arch in ("sm80", "sm90") for s in all_variants(arch, "fwd") if s.dtype != "e4m3"
]  # e4m3: test_fp8.py


@pytest.mark.parametrize("spec", FORWARDS, ids=lambda s: s.name)
def test_variant(gen, spec):
    from cutefa.dispatch import current_target
    from cutefa.loader import get_kernel
    from cutefa.model.rules import why_not_on

    target = current_target()
    if why_not_on(spec, target) is not None:
        pytest.skip(f"{spec.name} does not run on {target}: {why_not_on(spec, target)}")
    kernel = get_kernel(spec, target)
    dtype = fwd.DTYPES[spec.dtype]
    for batch, sq, sk, hq, hkv in SHAPES:
        q, k, v = fwd.make_inputs(gen, batch, sq, sk, hq, hkv, spec.head_dim, dtype)
        out = torch.full_like(q, math.nan)
        lse = torch.full((batch, hq, sq), math.nan, device="cuda")
        kernel(q, k, v, out, lse, 1.0 / math.sqrt(spec.head_dim))
        fwd.check_forward(q, k, v, causal=spec.causal, out=out, lse=lse)


# The 16-bit lazy O rescale (Sm90FwdOptions.lazy_rescale, _lres): committed on the tuned table's
# hd128 and hd256 tiles, each beside its twin without it.
LAZY = [s for s in FORWARDS if s.arch == "sm90" and s.options.lazy_rescale]


def test_lazy_variants_are_tested():
    assert {(s.dtype, s.head_dim, s.causal) for s in LAZY} == {
        (dt, hd, c) for dt in ("fp16", "bf16") for hd in (64, 128, 256) for c in (False, True)
    }
    assert all(s.replace(lazy_rescale=False) in FORWARDS for s in LAZY)


@pytest.mark.parametrize("spec", LAZY, ids=lambda s: s.name)
def test_lazy_rescale_on_rising_maxes(gen, spec):
    """Row maxes that keep rising through the key loop past the 2^8 threshold (keys carry a mean
    that grows toward key 0, the kernel walking the keys from the last block to the first, queries
    a positive mean: about 1 log2 unit per 64 keys), so the lazy variant takes both of its branches
    many times: checked against the float32 reference, and against its twin without it to
    within the 16-bit rounding of P (the kept max shifts P by up to 2^8)."""
    from cutefa.dispatch import current_target
    from cutefa.loader import get_kernel

    target = current_target()
    kernels = (get_kernel(spec, target), get_kernel(spec.replace(lazy_rescale=False), target))
    dtype = fwd.DTYPES[spec.dtype]
    d = spec.head_dim
    scale = 1.0 / math.sqrt(d)
    for batch, sq, sk, hq, hkv in ((1, 4097, 4097, 2, 1), (2, 1000, 1100, 4, 2), (1, 300, 2500, 2, 2)):
        q, k, v = fwd.make_inputs(gen, batch, sq, sk, hq, hkv, d, dtype)
        # q's mean 0.5 times a key's mean m over d elements, times the scale and log2(e): a ramp of
        # one log2 unit per 64 keys
        ramp_top = (sk / 64.0) / (0.5 * d * scale * math.log2(math.e))
        ramp = torch.linspace(ramp_top, 0.0, sk, device="cuda")[None, :, None, None]
        q, k = (q.float() + 0.5).to(dtype), (k.float() + ramp).to(dtype)
        outs = []
        for kernel in kernels:
            out = torch.full_like(q, math.nan)
            lse = torch.full((batch, hq, sq), math.nan, device="cuda")
            kernel(q, k, v, out, lse, scale)
            outs.append((out, lse))
        (out, lse), (out_twin, lse_twin) = outs
        fwd.check_forward(q, k, v, causal=spec.causal, out=out, lse=lse)
        fwd.check_forward(q, k, v, causal=spec.causal, out=out_twin, lse=lse_twin)
        diff = ((out.float() - out_twin.float()).norm() / out_twin.float().norm()).item()
        assert diff <= 1e-2, f"{spec.name} {(batch, sq, sk, hq, hkv)}: rel L2 {diff:.3g} against the twin"
        finite = torch.isfinite(lse_twin)
        assert torch.equal(torch.isfinite(lse), finite)
        assert (lse[finite] - lse_twin[finite]).abs().max().item() <= 1e-3, spec.name
