"""User mods on a Hopper GPU: the forward runs the sm90 kernel (WGMMA, warp-specialized) with the
mods fused, the backward the sm80 kernel with the same mods (cutefa.mods.base).

The four README examples (document masking with captured ids, prefix-LM, a relative-position bias
table read per score, softcap written as a score_mod), causal and not, with and without a block
mask for the mask_mods, seqlen 1 / 17 / 1000 with seqlen_q != seqlen_k, through
``cutefa.flash_attn_func`` against the float32 reference of tests/gpu/test_mods.py (the same mods
applied in torch), outputs into NaN-filled allocations (rows that attend no key exactly 0, lse -inf);
dq, dk, dv against autograd through the reference. Each call checks which kernels ran.

Run on an H100/H200: ``python -m pytest -q tests/gpu/test_mods_sm90_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import hopper_skip_reason as _skip_reason
from gpu_support import load_sibling as _load

import cutefa
from cutefa import loader

mods_gpu = _load("test_mods")
vl = _load("test_varlen")
fwd80 = _load("test_fwd_sm80")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

DEVICE = "cuda"
# (batch, seqlen_q, seqlen_k): one query, a few, many; fewer queries than keys and more
SHAPES = ((2, 1, 1000), (1, 17, 1000), (2, 1000, 17), (1, 1000, 1000), (2, 17, 1), (1, 1, 1))
# the gradient tests' shapes: seqlen_q <= seqlen_k, so that every row attends a key in each case
GRAD_SHAPES = ((2, 1, 1000), (1, 17, 1000), (2, 17, 17), (1, 1000, 1000))
EXAMPLES = ("document", "prefix_lm", "relative_bias", "softcap")
CASES = [(name, False) for name in EXAMPLES] + [(name, True) for name in ("document", "prefix_lm")]


def _new_kernels(before):
    return {name for name, _ in set(loader.loaded_kernels()) - set(before)}


def _kernels_ran(call):
    """call() and the names of the kernels it loaded first in this process (a kernel an earlier
    call loaded comes from the process's memo and is not listed again)."""
    before = dict(loader.loaded_kernels())
    result = call()
    return result, _new_kernels(before)


def _call(q, k, v, causal, score_mod, mask_mod, block_mask):
    return cutefa.flash_attn_func(
        q, k, v, causal=causal, return_lse=True, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask
    )


def _block_mask(mask_mod, use, batch, sq, sk):
    return cutefa.create_block_mask(mask_mod, batch, None, sq, sk, device=DEVICE) if use else None


@pytest.mark.parametrize(("name", "use_block_mask"), CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_forward_matches_reference(gen, name, shape, causal, use_block_mask):
    score_mod, mask_mod = mods_gpu.cases()[name]
    batch, sq, sk = shape
    q, k, v = mods_gpu.inputs(gen, batch, sq, sk)
    block_mask = _block_mask(mask_mod, use_block_mask, batch, sq, sk)
    with fwd80.nan_filled_allocations():
        (out, lse), ran = _kernels_ran(lambda: _call(q, k, v, causal, score_mod, mask_mod, block_mask))
    assert all(n.startswith("cutefa_sm90_fwd_") and "_mod" in n for n in ran), ran
    exact, exact_lse, has_keys = mods_gpu.reference(q, k, v, q.shape[-1] ** -0.5, causal, score_mod, mask_mod)
    softcap = vl.SCORE_BOUND if name == "softcap" else 0.0
    tag = f"sm90 {name} {shape} causal={causal} block_mask={use_block_mask}"
    mods_gpu.judge(tag, out, lse, exact, exact_lse, has_keys, softcap)


def test_the_forward_kernel_is_the_sm90_one(gen):
    """A mod not called before: its first call loads the sm90 forward (the relative-bias table, read
    per score, on 64-key blocks), its backward the sm80 one."""
    q, k, v = mods_gpu.inputs(gen, 1, 200, 300)
    table = torch.randn(mods_gpu.HEADS[0], 2 * 300 - 1, device=DEVICE)

    def bias_by_half(score, b, h, q_idx, kv_idx):  # traced to an expression no other test uses
        return score + 0.5 * table[h, q_idx - kv_idx + 299]

    (out, _), ran = _kernels_ran(lambda: _call(q, k, v, True, bias_by_half, None, None))
    assert len(ran) == 1 and next(iter(ran)).startswith("cutefa_sm90_fwd_bf16_hd128_128x64_"), ran
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    before = dict(loader.loaded_kernels())
    out, _ = _call(*leaves, True, bias_by_half, None, None)
    out.float().sum().backward()
    bwd = _new_kernels(before)
    assert len(bwd) == 1 and next(iter(bwd)).startswith("cutefa_sm80_bwd_bf16_hd128_"), bwd


def test_rows_without_keys_are_zero(gen):
    q, k, v = mods_gpu.inputs(gen, 2, 17, 1000)

    def nothing(b, h, qi, ki):  # every row attends no key
        return (qi < 0) & (ki < 0)

    for block_mask in (None, cutefa.create_block_mask(nothing, 2, None, 17, 1000, device=DEVICE)):
        with fwd80.nan_filled_allocations():
            out, lse = _call(q, k, v, False, None, nothing, block_mask)
        assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize(("name", "use_block_mask"), CASES)
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_through_the_sm90_forward(gen, name, shape, causal, use_block_mask):
    """dq, dk, dv (the sm80 backward from the sm90 forward's out and lse) through a loss on out and
    lse against the float32 reference, judged like tests/gpu/test_mods.py's."""
    score_mod, mask_mod = mods_gpu.cases()[name]
    batch, sq, sk = shape
    q, k, v = mods_gpu.inputs(gen, batch, sq, sk)
    scale = q.shape[-1] ** -0.5
    dout = torch.randn(q.shape, generator=gen, device=DEVICE)
    dlse = torch.randn(batch, mods_gpu.HEADS[0], sq, generator=gen, device=DEVICE)
    every = torch.ones((), dtype=torch.bool, device=DEVICE)
    loss = vl.loss_fn(dout, dlse, every, every)
    block_mask = _block_mask(mask_mod, use_block_mask, batch, sq, sk)

    def call(q, k, v):
        return _call(q, k, v, causal, score_mod, mask_mod, block_mask)

    def reference_call(q, k, v):
        return mods_gpu.reference(q, k, v, scale, causal, score_mod, mask_mod)[:2]

    with fwd80.nan_filled_allocations():
        got = vl.grads_of(call, (q, k, v), loss)
    torch.cuda.synchronize()
    exact = vl.grads_of(reference_call, (q.float(), k.float(), v.float()), loss)
    base = vl.grads_of(reference_call, (q, k, v), loss)
    vl.judge_grads(f"sm90 {name} {shape} causal={causal} block_mask={use_block_mask}", got, exact, base)
