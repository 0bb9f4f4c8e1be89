"""Every committed variant (not only the ones dispatch picks today) is correct on the GPU.

Each kernel is called directly with outputs poisoned with NaN beforehand, so an element the kernel
does not write fails the check. Shapes cover partial tiles on both sides, seqlen_q != seqlen_k,
one-row problems and GQA.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import load_sibling as _load

from cutefa import space

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
    s for arch in ("sm80", "sm90") for s in space.default_variants(arch, "fwd") if s.dtype != "e4m3"
]  # e4m3: test_fp8.py


@pytest.mark.parametrize("spec", FORWARDS, ids=lambda s: s.name)
def test_variant(gen, spec):
    from cutefa.compile import get_kernel
    from cutefa.dispatch import current_target

    target = current_target()
    if not spec.runs_on(target):
        pytest.skip(f"{spec.arch} kernels do not run on {target}")
    kernel = get_kernel(spec, target)
    dtype = fwd.DTYPES[spec.dtype]
    for batch, sq, sk, hq, hkv in SHAPES:
        q, k, v = fwd.make_inputs(gen, batch, sq, sk, hq, hkv, spec.head_dim, dtype)
        out = torch.full_like(q, math.nan)
        lse = torch.full((batch, hq, sq), math.nan, device="cuda")
        kernel(q, k, v, out, lse, 1.0 / math.sqrt(spec.head_dim))
        fwd.check_forward(q, k, v, causal=spec.causal, out=out, lse=lse)
