"""The sm90 backward's bulk dQ path (DqPath.BULK; FlashAttention-3's dQ path) on a Hopper GPU.

Each committed _dqbulk variant (the hd64/hd128 default tiles and the hd192/hd256 head-dim-split
tile with it, plain and with the overlap schedule, hd256's default with it; hd256 stages dQ in
the Q/dO stage)
is forced: called
directly with the calling convention of cutefa/backward.py (tests/gpu/test_bwd_sm90.py's
``run_kernel``: dq, dk, dv and the tiled dq_accum workspace poisoned with NaN first, so the
preprocess must zero every chunk whole), and through ``backward.gradients(..., spec=...)`` (the
host path that allocates the workspace by the variant's layout). Gradients are judged against float32 autograd of the exact
attention with test_bwd_sm80.py's tolerance (at most 3x the error of PyTorch's attention on the same
low-precision inputs); NaN or an unwritten element never passes. Shapes: seqlen_q 1, 17, 1000 and
4097 (ragged last query blocks: the workspace's padded rows must never reach dq), seqlen_q !=
seqlen_k both ways, GQA and MQA, causal and not. deterministic=1 must be bitwise reproducible, and
bitwise equal to the per-thread-reduction twin (the bulk adds land in the same order as its per-thread ones),
also where each CTA walks several key blocks into one split.

The dQ-writer warp's variants (_dqbulk_dqw) run the same gradient tests, and with deterministic=1
must be bitwise reproducible and bitwise equal to their DqPath.BULK twin (the same bulk adds, in the
same order), also over long query loops and where CTAs have no query block at all.

Run on an H100/H200: ``python -m pytest -q tests/gpu/test_bwd_dqbulk_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import all_variants
from gpu_support import hopper_skip_reason as _skip_reason
from gpu_support import load_sibling as _load

from cutefa.model.budgets_sm90 import (
    sm90_bwd_dq_bulk_aliases,
    sm90_bwd_dq_swapped,
    sm90_bwd_head_split,
    sm90_bwd_swapped,
)
from cutefa.model.options import DqPath

bwd80 = _load("test_bwd_sm80")
bwd90 = _load("test_bwd_sm90")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

# (the swapped-dK/dV partition at head dim 192 has its own tests: test_bwd_sm90_swapkv.py; the
# tile_m=80 tile with dQ transposed runs in test_bwd_sm90.py: every committed variant, the NaN-poisoned
# workspace, deterministic runs against its default twin)
BULK = [
    s
    for s in all_variants("sm90", "bwd")
    if s.options.dq_path is DqPath.BULK and not (sm90_bwd_swapped(s) or sm90_bwd_dq_swapped(s))
]
# The dQ-writer warp's variants (DqPath.BULK_WARP, _dqbulk_dqw: bf16 and fp16 hd64/hd128 on the tuned
# table's tiles): the same adds as their DqPath.BULK twin, issued by producer warp 1.
DQW = [
    s
    for s in all_variants("sm90", "bwd")
    if s.options.dq_path is DqPath.BULK_WARP and not s.options.row_prefetch
]
# LSE2/D read ahead of the WGMMA waits (row_prefetch, _rpf): on the _dqw tiles, beside their twins.
RPF = [s for s in all_variants("sm90", "bwd") if s.options.row_prefetch]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SHAPES = (
    (1, 1, 1, 2, 2),
    (1, 1, 700, 2, 1),
    (2, 17, 17, 2, 2),
    (1, 17, 1000, 4, 2),
    (1, 1000, 17, 3, 3),
    (1, 1000, 1000, 2, 1),
    (2, 333, 257, 6, 2),
    (1, 4097, 4097, 1, 1),
    (1, 128, 4097, 8, 1),
)


@pytest.fixture(scope="module")
def target():
    from cutefa.dispatch import current_target

    return current_target()


def test_bulk_variants_committed():
    """The defaults at head dims 64/80/96/112/128 (both dtypes), the bf16 overlap alternatives, the
    bf16 head-dim-split variants at 192/256 (plain and overlap), and hd256's default (the split with
    the overlap schedule) and the hd64/hd128 overlap alternatives in fp16."""
    assert sorted((s.dtype, s.head_dim, s.causal) for s in BULK if not s.options.overlap) == sorted(
        [
            (dt, hd, causal)
            for dt in ("bf16", "fp16")
            for hd in (64, 80, 96, 112, 128)
            for causal in (False, True)
        ]
        + [("bf16", hd, causal) for hd in (192, 256) for causal in (False, True)]
    )
    assert sorted((s.dtype, s.head_dim, s.causal) for s in BULK if s.options.overlap) == sorted(
        [("bf16", hd, causal) for hd in (64, 128, 192, 256) for causal in (False, True)]
        # 64, 128: tools/alternatives.py SM90_FP16_BWD_ALTERNATIVES
        + [("fp16", hd, causal) for hd in (64, 128, 256) for causal in (False, True)]
    )
    assert all(sm90_bwd_head_split(s) == (s.head_dim >= 192) for s in BULK)
    assert all(sm90_bwd_dq_bulk_aliases(s) == (s.head_dim == 256) for s in BULK)


@pytest.mark.parametrize("spec", BULK + DQW, ids=lambda s: s.name)
def test_bulk_grads_direct(gen, target, spec):
    from cutefa.loader import get_kernel

    kernel = get_kernel(spec, target)
    for shape in SHAPES:
        q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, *shape)
        got = bwd90.run_kernel(kernel, spec, q, k, v, out, lse, dout)
        where = f"{spec.name} b{shape[0]} sq{shape[1]} sk{shape[2]} hq{shape[3]} hkv{shape[4]}"
        bwd90.judge_grads(spec, where, got, q, k, v, dout)


@pytest.mark.parametrize("spec", BULK + DQW, ids=lambda s: s.name)
def test_bulk_grads_through_backward(gen, spec):
    """backward.gradients with the variant forced: the host allocates the tiled workspace."""
    from cutefa.api import backward

    for shape in ((1, 17, 1000, 4, 2), (2, 1000, 777, 4, 4)):
        q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, *shape)
        scale = 1.0 / math.sqrt(spec.head_dim)
        for deterministic in (False, True):
            got = backward.gradients(dout, q, k, v, out, lse, None, spec.causal, scale, deterministic, spec=spec)
            bwd90.judge_grads(spec, f"{spec.name} {shape} deterministic={deterministic}", got, q, k, v, dout)


@pytest.mark.parametrize(
    "spec",
    [s for s in BULK if s.dtype == "bf16" and (s.head_dim == 128 or s.head_dim > 128 and not s.options.overlap)],
    ids=lambda s: s.name,
)
def test_bulk_deterministic(gen, target, spec):
    """deterministic=1 twice: bitwise equal; and bitwise equal to the default twin (same adds in the
    same order; at hd192/hd256 the head-dim split's default, 64 keys per CTA). 16 heads over 4097 keys:
    fewer splits than key blocks, so each CTA adds several key blocks into the same chunks of its
    split one after the other."""
    from cutefa.loader import get_kernel

    twin = spec.replace(dq_path=DqPath.RED, overlap=False)  # the per-thread reductions (committed in bf16)
    q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, 1, 1000, 4097, 16, 4)
    first = bwd90.run_kernel(get_kernel(spec, target), spec, q, k, v, out, lse, dout, deterministic=True)
    second = bwd90.run_kernel(get_kernel(spec, target), spec, q, k, v, out, lse, dout, deterministic=True)
    ref = bwd90.run_kernel(get_kernel(twin, target), twin, q, k, v, out, lse, dout, deterministic=True)
    for name, a, b, c in zip(("dq", "dk", "dv"), first, second, ref):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{spec.name} {name} differs between two deterministic runs"
        assert torch.equal(a, c), f"{spec.name} {name} differs from {twin.name}"


def test_dqw_variants_committed():
    for dtype in ("bf16", "fp16"):  # fp16: tools/alternatives.py SM90_FP16_BWD_ALTERNATIVES
        assert sorted((s.head_dim, s.options.overlap, s.causal) for s in DQW if s.dtype == dtype) == sorted(
            [(hd, ov, c) for hd in (64, 128) for ov in (False, True) for c in (False, True)]
        )
    assert all(s.replace(dq_path=DqPath.BULK) in BULK for s in DQW)


@pytest.mark.parametrize("spec", DQW, ids=lambda s: s.name)
def test_dqw_deterministic_matches_twin(gen, target, spec):
    """deterministic=1: two runs bitwise equal, and bitwise equal to the DqPath.BULK twin (the writer
    warp issues the same bulk adds in the same order, each after the previous one completed). 16
    heads over 4097 keys (several key blocks per split, each adding into the same chunks), 4097
    queries over 200 keys (65 query blocks per key block: a long writer loop), 1 query over 700
    keys (causal: most CTAs have no query block, the writer's and consumers' barrier counts must
    still match)."""
    from cutefa.loader import get_kernel

    twin = spec.replace(dq_path=DqPath.BULK)
    for shape in ((1, 1000, 4097, 16, 4), (1, 4097, 200, 2, 1), (1, 1, 700, 2, 1)):
        q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, *shape)
        first = bwd90.run_kernel(get_kernel(spec, target), spec, q, k, v, out, lse, dout, deterministic=True)
        second = bwd90.run_kernel(get_kernel(spec, target), spec, q, k, v, out, lse, dout, deterministic=True)
        ref = bwd90.run_kernel(get_kernel(twin, target), twin, q, k, v, out, lse, dout, deterministic=True)
        for name, a, b, c in zip(("dq", "dk", "dv"), first, second, ref):
            assert torch.isfinite(a).all(), f"{spec.name} {shape} {name}"
            assert torch.equal(a, b), f"{spec.name} {shape} {name} differs between two deterministic runs"
            assert torch.equal(a, c), f"{spec.name} {shape} {name} differs from {twin.name}"


@pytest.mark.parametrize("spec", DQW, ids=lambda s: s.name)
def test_dqw_repeated_calls(gen, target, spec):
    """Twenty non-deterministic calls in a row on one stream, each judged: a barrier protocol that
    lost a generation would hang or leave a piece un-added (dq off by a whole piece)."""
    from cutefa.loader import get_kernel

    kernel = get_kernel(spec, target)
    q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, 2, 1000, 1000, 4, 2)
    first = bwd90.run_kernel(kernel, spec, q, k, v, out, lse, dout)
    bwd90.judge_grads(spec, f"{spec.name} call 0", first, q, k, v, dout)
    for i in range(1, 20):
        got = bwd90.run_kernel(kernel, spec, q, k, v, out, lse, dout)
        for name, a, b in zip(("dq", "dk", "dv"), got, first):
            assert torch.isfinite(a).all(), f"{spec.name} call {i} {name}"
            assert bwd80.rel(a, b) < 1e-2, f"{spec.name} call {i} {name}"


def test_rpf_variants_committed():
    for dtype in ("bf16", "fp16"):  # fp16: tools/alternatives.py SM90_FP16_BWD_ALTERNATIVES
        assert sorted((s.head_dim, s.options.overlap, s.causal) for s in RPF if s.dtype == dtype) == sorted(
            [(hd, ov, c) for hd in (64, 128) for ov in (False, True) for c in (False, True)]
        )
    assert all(s.replace(row_prefetch=False) in DQW for s in RPF)


@pytest.mark.parametrize("spec", RPF, ids=lambda s: s.name)
def test_rpf_matches_twin(gen, target, spec):
    """Reading LSE2 and D into registers earlier changes when they are read, not what is computed:
    deterministic gradients bitwise equal to the twin's on ragged shapes (partial query and key
    blocks, GQA, seqlen_q != seqlen_k both ways)."""
    from cutefa.loader import get_kernel

    twin = spec.replace(row_prefetch=False)
    for shape in ((1, 1000, 4097, 16, 4), (1, 4097, 200, 2, 1), (2, 17, 333, 3, 3), (1, 1, 700, 2, 1)):
        q, k, v, dout, out, lse = bwd90.random_inputs(gen, spec, *shape)
        got = bwd90.run_kernel(get_kernel(spec, target), spec, q, k, v, out, lse, dout, deterministic=True)
        ref = bwd90.run_kernel(get_kernel(twin, target), twin, q, k, v, out, lse, dout, deterministic=True)
        for name, a, c in zip(("dq", "dk", "dv"), got, ref):
            assert torch.isfinite(a).all(), f"{spec.name} {shape} {name}"
            assert torch.equal(a, c), f"{spec.name} {shape} {name} differs from {twin.name}"
