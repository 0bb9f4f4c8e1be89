"""The sm90 backward at head dims 192 and 256 (the head-dim split, templates/bwd_sm90_hsplit.py.j2)
on a Hopper GPU.

Each split variant with per-thread dQ reductions (DqPath.RED; bf16 alternatives at head dims 192 and
256: 64 keys per CTA
shared by both consumer warpgroups, each owning half of the head dim; and its committed overlap
alternative, _ov; hd256's default, the split with the bulk dQ path and the overlap schedule, runs in
tests/gpu/test_bwd_dqbulk_gpu.py) is called directly with the calling convention of
cutefa/backward.py through tests/gpu/test_bwd_sm90.py's ``run_kernel`` (dq, dk, dv and every
workspace poisoned with NaN, so an element the kernel does not write fails; grouped heads summed
as backward.py does) and judged against float32 autograd of the exact attention with the
tolerance of tests/gpu/test_bwd_sm80.py (at most 3x the error of PyTorch's own attention on the
same low-precision inputs). Shapes: seqlens 1, 17, 1000, 4097, seqlen_q != seqlen_k both ways,
GQA and MQA, and the split's own edges: a key past a 64-key block (65), a query past one
consumer's 32 queries (33), causal diagonals that cross a consumer's half. deterministic=1 must be
bitwise reproducible, also where each CTA walks several key blocks. Through the public API the
dispatcher must run these kernels and the log-sum-exp gradient must flow.

Run on an H100/H200: ``python -m pytest -q tests/gpu/test_bwd_sm90_hsplit.py``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import all_variants
from gpu_support import hopper_skip_reason as _skip_reason
from gpu_support import load_sibling as _load

from cutefa.model.budgets_sm90 import sm90_bwd_head_split, sm90_bwd_swapped
from cutefa.model.options import DqPath

bwd80 = _load("test_bwd_sm80")
bwd90 = _load("test_bwd_sm90")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

# The bf16 split alternatives at hd192/hd256, plain and with the overlap schedule.
# (the DqPath.BULK twins have their own test: tests/gpu/test_bwd_dqbulk_gpu.py)
SPLIT = [
    s
    for s in all_variants("sm90", "bwd")
    if sm90_bwd_head_split(s) and s.options.dq_path is DqPath.RED
]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SHAPES = bwd90.COMMON_SHAPES + (
    (1, 33, 65, 2, 2),  # one query past consumer 0's half, one key past a block
    (2, 95, 64, 4, 1),  # MQA; causal: the diagonal crosses both consumers' halves
    (1, 64, 127, 6, 2),  # GQA; one key short of two blocks
    (1, 128, 4097, 8, 1),
)


@pytest.fixture(scope="module")
def target():
    from cutefa.dispatch import current_target

    return current_target()


def test_split_variants_are_the_defaults_and_overlap():
    # bf16 alternatives: hd256's default is the split with the bulk dQ path and the overlap schedule
    # (tests/gpu/test_bwd_dqbulk_gpu.py), hd192's the swapped partition
    assert sorted((s.head_dim, s.dtype, s.causal) for s in SPLIT if not s.options.overlap) == sorted(
        (d, "bf16", c) for d in (192, 256) for c in (False, True)
    )
    assert sorted((s.head_dim, s.dtype, s.causal) for s in SPLIT if s.options.overlap) == sorted(
        (d, "bf16", c) for d in (192, 256) for c in (False, True)
    )


@pytest.mark.parametrize("spec", SPLIT, ids=lambda s: s.name)
def test_split_grads(gen, target, spec):
    bwd90.check_shapes(spec, target, SHAPES, gen)


@pytest.mark.parametrize("spec", SPLIT, ids=lambda s: s.name)
def test_split_deterministic(gen, target, spec):
    """deterministic=1: two runs bitwise equal and as accurate as the atomic mode; with 32 (batch,
    head) pairs each CTA walks several of the 16 key blocks (one dq_accum split per CTA)."""
    bwd90.check_deterministic_split(spec, target, gen)


@pytest.mark.parametrize("head_dim", [192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dispatched_backward_runs_the_split(gen, target, head_dim, causal):
    """cutefa.flash_attn_func's backward picks a Hopper kernel built for wide heads (the head-dim
    split; at hd192 the tuned table may take the swapped 64x96 tile instead) and matches the
    reference."""
    from cutefa.api.backward import choose_bwd

    spec = choose_bwd(target, torch.bfloat16, head_dim, causal, seqlen_k=777)
    wide = sm90_bwd_head_split(spec) or (head_dim == 192 and sm90_bwd_swapped(spec))
    assert spec.arch == "sm90" and wide, spec.name
    q = torch.randn(2, 500, 4, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 777, 2, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 777, 2, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    bwd80.check(q, k, v, causal, gen)


def test_lse_gradient_hd256(gen):
    """The incoming log-sum-exp gradient (D = rowsum(dO * O) - dLSE) through the split kernel."""
    q, k, v = (torch.randn(1, 300, 2, 256, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    w = torch.randn(1, 2, 300, generator=gen, device="cuda")
    bwd80.check_lse_gradient(q, k, v, w)
