"""The CTA-pair sm100 forward (cta_pair, 2-SM UMMA) on a Blackwell GPU: correct, and the same as its
single-CTA twin up to rounding.

These kernels are compiled and SASS-checked on the CPU only; this file is their first run. It
skips unless the current GPU runs the sm100 family (cc 10.0 / 10.3). Outputs are poisoned with NaN
first, so a row no CTA writes fails. Shapes: query lengths whose 128-row tiles are odd in number
(the grid is rounded up to whole pairs, the second CTA's rows partly or wholly past the end), a
pair whose first CTA sees no key (causal, seqlen_q > seqlen_k), seqlen_q != seqlen_k and GQA.

Run on a B200: ``python -m pytest -q tests/gpu/test_fwd_sm100_pair.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import all_variants
from gpu_support import load_sibling as _load

fwd = _load("test_fwd_sm80")
pytestmark = fwd.pytestmark

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SHAPES = (
    (1, 1, 1, 2, 2),
    (1, 129, 129, 2, 2),
    (2, 300, 1000, 4, 2),
    (1, 1000, 17, 3, 3),
    (1, 640, 4097, 8, 1),
    (2, 2048, 2048, 2, 1),
)

PAIRS = [s for s in all_variants("sm100", "fwd") if s.options.cta_pair]


def _kernel_or_skip(spec):
    from cutefa.dispatch import current_target
    from cutefa.loader import get_kernel

    target = current_target()
    if not spec.runs_on(target):
        pytest.skip(f"{spec.arch} kernels do not run on {target}")
    return get_kernel(spec, target)


def _run(kernel, spec, q, k, v):
    batch, sq, hq, _ = q.shape
    out = torch.full_like(q, math.nan)
    lse = torch.full((batch, hq, sq), math.nan, device="cuda")
    kernel(q, k, v, out, lse, 1.0 / math.sqrt(spec.head_dim))
    torch.cuda.synchronize()
    return out, lse


def test_pair_variants_exist():
    assert PAIRS, "no CTA-pair variant in the committed sm100 set"


@pytest.mark.parametrize("spec", PAIRS, ids=lambda s: s.name)
def test_pair_variant(gen, spec):
    kernel = _kernel_or_skip(spec)
    dtype = fwd.DTYPES[spec.dtype]
    for batch, sq, sk, hq, hkv in SHAPES:
        q, k, v = fwd.make_inputs(gen, batch, sq, sk, hq, hkv, spec.head_dim, dtype)
        out, lse = _run(kernel, spec, q, k, v)
        fwd.check_forward(q, k, v, causal=spec.causal, out=out, lse=lse)


@pytest.mark.parametrize("spec", [s for s in PAIRS if s.dtype == "bf16"], ids=lambda s: s.name)
def test_pair_matches_single_cta(gen, spec):
    """Each output row is the same reduction in both schedules (the pair splits keys of K and
    columns of V between CTAs, not a reduction): the two agree to a few output ulps."""
    pair = _kernel_or_skip(spec)
    single = _kernel_or_skip(spec.replace(cta_pair=False))
    q, k, v = fwd.make_inputs(gen, 2, 1000, 1500, 4, 2, spec.head_dim, fwd.DTYPES[spec.dtype])
    out_p, lse_p = _run(pair, spec, q, k, v)
    out_s, lse_s = _run(single, spec, q, k, v)
    torch.testing.assert_close(out_p.float(), out_s.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse_p, lse_s, atol=1e-3, rtol=1e-4)
