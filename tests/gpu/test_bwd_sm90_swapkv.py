"""The sm90 backward at head dim 192 with dK/dV on WGMMA's M axis (templates/bwd_sm90_swapkv.py.j2:
96 keys per CTA, 48 per consumer warpgroup, dQ split by head-dim columns) on a Hopper GPU.

The variants (head dim 192's default for both dtypes: the bulk dQ path on FlashAttention-4's
shared-memory budget (DqPath.BULK_STAGED: a 2-stage Q ring, a 1-stage dO pipeline, one dS buffer, a
dQ staging buffer of its own); the measured alternatives, bf16: per-thread dQ reductions
(DqPath.RED) and the bulk path staged in the Q/dO stage (DqPath.BULK)) and the fp16 twins of the
alternatives (compiled on first use) are called directly with the calling convention of
cutefa/backward.py through
tests/gpu/test_bwd_sm90.py's ``run_kernel`` (dq, dk, dv and every workspace poisoned with NaN, so an
element the kernel does not write fails; grouped heads summed as backward.py does) and judged
against float32 autograd of the exact attention with the tolerance of tests/gpu/test_bwd_sm80.py
(at most 3x the error of PyTorch's own attention on the same low-precision inputs). Shapes:
seqlens 1, 17, 1000, 4097, seqlen_q != seqlen_k both ways, GQA and MQA, and the partition's own
edges: a key past consumer 0's 48 (49), one short of and one past a 96-key block (95, 97), a query
past a 64-row block (65), causal diagonals that cross the consumers' key halves, long query loops
over few key blocks (DqPath.BULK gives each Q/dO stage back one query block late; BULK_STAGED
refills dO's one stage and reuses the one dS buffer every query block), the causal bulk path's
launch order over several chunks of (batch, head) pairs, the last one partial. deterministic=1
must be bitwise reproducible, also where each CTA walks several key blocks; the gradients must be
close to the head-dim split's (the other hd192 partition; fp16's compiled on first use); through backward.gradients
with the variant forced the host allocates the (bulk paths: tiled) workspace.

Run on an H100/H200: ``python -m pytest -q tests/gpu/test_bwd_sm90_swapkv.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import all_variants
from gpu_support import hopper_skip_reason as _skip_reason
from gpu_support import load_sibling as _load

from cutefa.model.budgets_sm90 import sm90_bwd_head_split, sm90_bwd_swapped
from cutefa.model.options import DqPath
from cutefa.model.rules import why_invalid

bwd80 = _load("test_bwd_sm80")
bwd90 = _load("test_bwd_sm90")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

# (head dim 192 for q, k and v; the (192, 128) pair on this partition: tests/gpu/test_bwd_sm90_dv_gpu.py)
COMMITTED = [s for s in all_variants("sm90", "bwd") if sm90_bwd_swapped(s) and s.head_dim_v == s.head_dim]
# the committed ones (bf16 alternatives, the fp16/bf16 defaults) and the fp16 twins of the rest
SWAPPED = COMMITTED + [t for t in (s.replace(dtype="fp16") for s in COMMITTED) if t not in COMMITTED]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SHAPES = bwd90.COMMON_SHAPES + (
    (1, 65, 49, 2, 2),  # one query past a 64-row block, one key past consumer 0's 48
    (2, 95, 97, 4, 1),  # MQA; one key past a 96-key block; causal: diagonals cross both halves
    (1, 64, 95, 6, 2),  # GQA; one key short of a block
    (2, 333, 257, 6, 2),
    (1, 128, 4097, 8, 1),
    (1, 4097, 200, 4, 2),  # 65 query blocks per key block, 3 key blocks: the deferred ring release
    (2, 2048, 2000, 5, 1),  # 21 key blocks, 10 (batch, head) pairs: the causal bulk order, chunks of 6, 4
)


@pytest.fixture(scope="module")
def target():
    from cutefa.dispatch import current_target

    return current_target()


def test_swapped_variants():
    assert sorted((s.dtype, s.causal, s.options.dq_path) for s in SWAPPED) == sorted(
        (t, c, path) for t in ("bf16", "fp16") for c in (False, True) for path in set(DqPath) - {DqPath.BULK_WARP}
    )
    for spec in SWAPPED:
        assert (spec.head_dim, spec.tile_m, spec.tile_n, spec.stages, spec.warps) == (192, 64, 96, 2, 12)
        assert why_invalid(spec) is None, spec.name


@pytest.mark.parametrize("spec", SWAPPED, ids=lambda s: s.name)
def test_swapped_grads(gen, target, spec):
    bwd90.check_shapes(spec, target, SHAPES, gen)


@pytest.mark.parametrize("spec", SWAPPED, ids=lambda s: s.name)
def test_swapped_deterministic(gen, target, spec):
    """deterministic=1: two runs bitwise equal and as accurate as the atomic mode; with 32 (batch,
    head) pairs each CTA walks several of the 11 key blocks (one dq_accum split per CTA)."""
    bwd90.check_deterministic_split(spec, target, gen)


def _head_split_twin(spec):
    """The head-dim split (64 keys per CTA, each consumer half of the head dim) of spec's dtype and
    mask: bf16's is committed, fp16's compiles on first use."""
    return spec.replace(tile_n=64, dq_path=DqPath.RED)


@pytest.mark.parametrize("spec", SWAPPED, ids=lambda s: s.name)
def test_swapped_matches_head_split(gen, target, spec):
    """The same gradients as the head-dim split (another partition: close, not bitwise)."""
    from cutefa.loader import get_kernel

    twin = _head_split_twin(spec)
    assert sm90_bwd_head_split(twin) and why_invalid(twin) is None, twin.name
    q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, 2, 1000, 777, 4, 2)
    mine = bwd90.run_kernel(get_kernel(spec, target), spec, q, k, v, out, lse, dout, deterministic=True)
    ref = bwd90.run_kernel(get_kernel(twin, target), twin, q, k, v, out, lse, dout, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), mine, ref):
        assert torch.isfinite(a).all(), f"{spec.name} {name}"
        assert bwd80.rel(a, b) < 1e-2, f"{spec.name} {name} vs {twin.name}"


STAGED = [s for s in SWAPPED if s.options.dq_path is DqPath.BULK_STAGED]


@pytest.mark.parametrize("spec", STAGED, ids=lambda s: s.name)
def test_dq_stage_matches_in_stage_twin_bitwise(gen, target, spec):
    """DqPath.BULK_STAGED changes where the fp32 dQ piece is staged and when the WGMMAs are waited
    for, not what is computed: the same WGMMAs over the same operands and, with deterministic=1, the
    same bulk adds in the same order per dq_accum element, so dq, dk and dv are bitwise those of the
    DqPath.BULK twin that stages dQ in the Q/dO stage (also over long query loops: dO's one stage and
    the one dS
    buffer reused every query block, and over several key blocks per CTA). deterministic=0: dK and
    dV (no atomics) still bitwise, dQ close."""
    from cutefa.loader import get_kernel

    twin = spec.replace(dq_path=DqPath.BULK)
    assert twin in SWAPPED, twin.name
    kernel, twin_kernel = get_kernel(spec, target), get_kernel(twin, target)
    # long query loops over few key blocks, a ragged edge, several key blocks per deterministic CTA
    shapes = ((2, 1000, 777, 4, 2), (1, 4097, 200, 4, 2), (1, 65, 49, 2, 2), (2, 300, 2000, 16, 16))
    for batch, sq, sk, hq, hkv in shapes:
        q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, batch, sq, sk, hq, hkv)
        where = f"{spec.name} b{batch} sq{sq} sk{sk} hq{hq} hkv{hkv}"
        for det in (True, False):
            mine = bwd90.run_kernel(kernel, spec, q, k, v, out, lse, dout, deterministic=det)
            ref = bwd90.run_kernel(twin_kernel, twin, q, k, v, out, lse, dout, deterministic=det)
            for name, a, b in zip(("dq", "dk", "dv"), mine, ref):
                assert torch.isfinite(a).all(), f"{where} {name}"
                if det or name != "dq":
                    assert torch.equal(a, b), f"{where} deterministic={det}: {name} differs from {twin.name}"
                else:
                    assert bwd80.rel(a, b) < 1e-2, f"{where}: {name} vs {twin.name}"  # other add order


@pytest.mark.parametrize("spec", SWAPPED, ids=lambda s: s.name)
def test_swapped_through_backward(gen, spec):
    """backward.gradients with the variant forced (the host allocates the workspace), both modes."""
    from cutefa.api import backward

    for batch, sq, sk, hq, hkv in ((1, 17, 1000, 4, 2), (2, 1000, 777, 4, 4)):
        q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, batch, sq, sk, hq, hkv)
        scale = 1.0 / math.sqrt(spec.head_dim)
        exact, base = bwd90.reference_grads(spec, q, k, v, dout)
        for deterministic in (False, True):
            got = backward.gradients(dout, q, k, v, out, lse, None, spec.causal, scale, deterministic, spec=spec)
            where = f"{spec.name} b{batch} sq{sq} sk{sk} deterministic={deterministic}"
            bwd90.assert_grads_close(where, got, exact, base)
