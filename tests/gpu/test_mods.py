"""User mods through ``cutefa.flash_attn_func(..., score_mod=, mask_mod=, block_mask=)`` on a CUDA GPU.

The example mods of tests/test_mods_examples.py (document masking with captured document ids,
prefix-LM, a relative-position bias table (heads, 2 L - 1), softcap written as a score_mod) against a
float32 reference that applies the same functions in torch, judged with tests/gpu/test_varlen.py's
bars (outputs into NaN-filled allocations, rows that attend no key exactly 0 with lse -inf). With
and without causal, with and without a block mask (which must not change the result beyond
rounding), seqlen_q != seqlen_k, grouped-query heads; softcap as a mod against ``softcap=``; a second
call with the same mods compiles nothing; dq, dk, dv against autograd through the reference.

Run on an H100/H200: ``python -m pytest -q tests/gpu/test_mods.py``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm80_skip_reason as _skip_reason
from test_mods_examples import document_mask, prefix_lm, random_docs, relative_bias, softcap_mod

import cutefa
from cutefa import loader

ref = _load("reference")
vl = _load("test_varlen")
fwd80 = _load("test_fwd_sm80")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

DEVICE = "cuda"
HEADS = (4, 2)
# (batch, seqlen_q, seqlen_k): square, fewer queries than keys, more queries than keys, ragged tiles
SHAPES = ((2, 512, 512), (1, 200, 777), (2, 333, 129))


def inputs(gen, batch, sq, sk, dtype=torch.bfloat16, head_dim=128):
    hq, hkv = HEADS
    cuda = {"device": DEVICE, "dtype": dtype}
    q = torch.randn(batch, sq, hq, head_dim, generator=gen, **cuda)
    k = torch.randn(batch, sk, hkv, head_dim, generator=gen, **cuda)
    v = torch.randn(batch, sk, hkv, head_dim, generator=gen, **cuda)
    return q, k, v


def reference(q, k, v, scale, causal, score_mod=None, mask_mod=None):
    """float32 (out (batch, sq, heads, d), lse (batch, heads, sq), has_keys (batch, heads, sq))."""
    batch, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kf = k.float().repeat_interleave(hq // hkv, dim=2)
    vf = v.float().repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    b = torch.arange(batch, device=DEVICE).view(-1, 1, 1, 1)
    h = torch.arange(hq, device=DEVICE).view(1, -1, 1, 1)
    qi = torch.arange(sq, device=DEVICE).view(1, 1, -1, 1)
    ki = torch.arange(sk, device=DEVICE).view(1, 1, 1, -1)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki).float()
    keep = torch.ones(batch, hq, sq, sk, dtype=torch.bool, device=DEVICE)
    if mask_mod is not None:
        keep = keep & mask_mod(b, h, qi, ki)
    if causal:
        keep = keep & (ki <= qi + sk - sq)
    s = s.masked_fill(~keep, -torch.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])  # rows without a key: 0
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    return out, lse, keep.any(dim=-1)


def judge(tag, out, lse, exact, exact_lse, has_keys, softcap=0.0):
    for b in range(out.shape[0]):
        keys = has_keys[b, 0]
        assert torch.equal(has_keys[b], keys.expand_as(has_keys[b])), "the example masks are head-independent"
        vl.judge_forward(f"{tag} b={b}", out[b], lse[b], exact[b], exact_lse[b], keys, softcap=softcap)


NAMES = ("document", "document_causal_ids", "prefix_lm", "relative_bias", "softcap", "bias_and_documents")


def cases():
    docs = random_docs(2, 1024, 5, seed=1).to(DEVICE)
    table = torch.randn(HEADS[0], 2 * 1024 - 1, device=DEVICE)
    return {
        "document": (None, document_mask(docs)),
        "document_causal_ids": (None, document_mask(docs, causal=True)),
        "prefix_lm": (None, prefix_lm(100)),
        "relative_bias": (
            relative_bias(table, 1024),
            None,
        ),  # index q - kv + 1023: inside for lengths <= 1024
        "softcap": (softcap_mod(), None),
        "bias_and_documents": (relative_bias(table, 1024), document_mask(docs)),
    }


# (case, with a block mask): every case plain, and those with a mask_mod also with its block mask
CASES = [(name, False) for name in NAMES] + [
    (name, True) for name in NAMES if name not in ("relative_bias", "softcap")
]


@pytest.mark.parametrize(("name", "use_block_mask"), CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_reference(gen, name, shape, causal, use_block_mask):
    score_mod, mask_mod = cases()[name]
    batch, sq, sk = shape
    q, k, v = inputs(gen, batch, sq, sk)
    scale = q.shape[-1] ** -0.5
    block_mask = None
    if use_block_mask:
        block_mask = cutefa.create_block_mask(mask_mod, batch, None, sq, sk, device=DEVICE)
    with fwd80.nan_filled_allocations():
        out, lse = cutefa.flash_attn_func(
            q,
            k,
            v,
            causal=causal,
            return_lse=True,
            score_mod=score_mod,
            mask_mod=mask_mod,
            block_mask=block_mask,
        )
    exact, exact_lse, has_keys = reference(q, k, v, scale, causal, score_mod, mask_mod)
    softcap = vl.SCORE_BOUND if name == "softcap" else 0.0
    judge(
        f"{name} {shape} causal={causal} block_mask={use_block_mask}",
        out,
        lse,
        exact,
        exact_lse,
        has_keys,
        softcap,
    )


def test_softcap_as_a_score_mod_matches_the_builtin(gen):
    """Both against the float32 reference of the capped scores: each kernel's tanh is the hardware
    approximation (relative error 2^-11, so a score moves by up to cap * 2^-11 in natural-log units),
    which bounds the lse's error by that and the output's by about twice that times max |v| beside
    the output's own rounding. The two kernels may be different families (the mod's forward runs on
    the sm90 kernel on sm_90a, else the sm80 one; the built-in on the GPU's own)."""
    cap = 30.0
    q, k, v = inputs(gen, 2, 300, 500)
    q = q * 4  # scores large enough for the cap to bend them
    tanh_err = cap * 2.0**-11
    for causal in (False, True):
        exact, lse_exact, _ = reference(q, k, v, q.shape[-1] ** -0.5, causal, softcap_mod(cap))
        tol = 4 * ref.rounding_error(exact, q.dtype) + 2 * tanh_err * v.float().abs().max().item() + 1e-3
        for what, (out, lse) in {
            "built-in": cutefa.flash_attn_func(q, k, v, causal=causal, softcap=cap, return_lse=True),
            "score_mod": cutefa.flash_attn_func(q, k, v, causal=causal, return_lse=True, score_mod=softcap_mod(cap)),
        }.items():
            assert not out.isnan().any() and not lse.isnan().any(), f"{what} causal={causal}: NaN"
            assert ref.max_abs(out, exact) <= tol, f"{what} causal={causal}: out {ref.max_abs(out, exact)} > {tol}"
            lse_err = ref.max_abs(lse, lse_exact)
            assert lse_err <= tanh_err + 1e-3, f"{what} causal={causal}: lse {lse_err}"


def test_same_mods_compile_once(gen):
    q, k, v = inputs(gen, 1, 256, 256)
    docs = random_docs(1, 256, 3, seed=7).to(DEVICE)
    cutefa.flash_attn_func(q, k, v, mask_mod=document_mask(docs))
    before = dict(loader.loaded_kernels())
    other_docs = random_docs(1, 256, 4, seed=8).to(DEVICE)  # other values, a new closure: same kernel
    out = cutefa.flash_attn_func(q, k, v, mask_mod=document_mask(other_docs))
    assert loader.loaded_kernels() == before
    exact, _, _ = reference(q, k, v, q.shape[-1] ** -0.5, False, None, document_mask(other_docs))
    assert ref.rel_l2(out, exact) <= 1e-2  # the new ids were read, not the first call's


def test_empty_rows_and_block_mask_of_another_shape(gen):
    q, k, v = inputs(gen, 1, 128, 256)

    def nothing(b, h, qi, ki):  # every row attends no key
        return (qi < 0) & (ki < 0)

    with fwd80.nan_filled_allocations():
        out, lse = cutefa.flash_attn_func(q, k, v, mask_mod=nothing, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    bm = cutefa.create_block_mask(prefix_lm(3), 1, 1, 128, 128, device=DEVICE)
    with pytest.raises(ValueError, match="KV_LEN=128"):
        cutefa.flash_attn_func(q, k, v, block_mask=bm)


# (batch, seqlen_q, seqlen_k) of the gradient tests: every row attends a key with each case
GRAD_SHAPES = ((2, 384, 384), (1, 200, 200))


@pytest.mark.parametrize(("name", "use_block_mask"), CASES)
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_reference(gen, name, shape, causal, use_block_mask):
    """dq, dk, dv through a loss on out and lse against the float32 reference (autograd through the
    same mods in torch), judged like tests/gpu/test_varlen.py's (3x the error of the reference
    computed from the 16-bit inputs, + 1e-3)."""
    score_mod, mask_mod = cases()[name]
    batch, sq, sk = shape
    q, k, v = inputs(gen, batch, sq, sk)
    scale = q.shape[-1] ** -0.5
    dout = torch.randn(q.shape, generator=gen, device=DEVICE)
    dlse = torch.randn(batch, HEADS[0], sq, generator=gen, device=DEVICE)
    every = torch.ones((), dtype=torch.bool, device=DEVICE)
    loss = vl.loss_fn(dout, dlse, every, every)
    block_mask = (
        cutefa.create_block_mask(mask_mod, batch, 1, sq, sk, device=DEVICE) if use_block_mask else None
    )

    def call(q, k, v):
        return cutefa.flash_attn_func(
            q,
            k,
            v,
            causal=causal,
            return_lse=True,
            score_mod=score_mod,
            mask_mod=mask_mod,
            block_mask=block_mask,
        )

    def reference_call(q, k, v):
        return reference(q, k, v, scale, causal, score_mod, mask_mod)[:2]

    with fwd80.nan_filled_allocations():
        got = vl.grads_of(call, (q, k, v), loss)
    torch.cuda.synchronize()
    exact = vl.grads_of(reference_call, (q.float(), k.float(), v.float()), loss)
    base = vl.grads_of(reference_call, (q, k, v), loss)
    vl.judge_grads(f"{name} {shape} causal={causal} block_mask={use_block_mask}", got, exact, base)


def test_captured_tensors_that_require_grad_are_refused(gen):
    q, k, v = (t.requires_grad_() for t in inputs(gen, 1, 64, 64))
    table = torch.zeros(HEADS[0], 127, device=DEVICE, requires_grad=True)
    with pytest.raises(NotImplementedError, match="requires grad"):
        cutefa.flash_attn_func(q, k, v, score_mod=relative_bias(table, 64))
    out = cutefa.flash_attn_func(q, k, v, score_mod=relative_bias(table.detach(), 64))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
