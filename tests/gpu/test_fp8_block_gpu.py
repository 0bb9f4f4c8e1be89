"""FP8 block quantization (the sm90 e4m3 forward's _blockq variants) on a Hopper GPU.

Inputs are quantized with one descale per block of rows along seqlen (q: the kernel's tile_m
rows, k and v: its tile_n rows; cutefa.fp8_block_sizes). The yardstick is the one of
tests/gpu/test_fp8.py: a float32 reference of the DEQUANTIZED inputs (what the kernel must compute
up to the e4m3 rounding of P) and an emulation of that rounding; here P is rounded as the kernel
rounds it, scaled by r[n] = v's block descale over its largest (the ratio rides in the exp2 bias)
and by 2^8. The kernel's relative L2 error against the dequantized reference must be at most 1.25x
the emulation's plus 0.005; the log-sum-exp (row sums of unrounded P) must match the reference to
0.02 plus 2^-9 of its size plus 2^-12 of a bound on the row's scores (the e4m3 tensor cores
accumulate with fewer mantissa bits than fp32, which shows on the outlier tokens' scores of a few
hundred and on their cancelling sums; see check). Outputs are poisoned with NaN beforehand, so an element the kernel does not write fails; rows
that attend no key must be exactly 0 with lse = -inf.

Inputs: unit-variance q/k/v with per-head scales and every 97th token 8x larger, so the block
descales (and the V ratios) differ from block to block.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm90_kernel_skip_reason

import cutefa
from cutefa import dispatch, fp8
from cutefa.api.descales import kernel_args
from cutefa.model.committed import fp8_block_specs
from cutefa.model.defaults import DEFAULT_TILES
from cutefa.model.options import Quant

ref = _load("reference")
fp8t = _load("test_fp8")


def _skip_reason() -> str | None:
    return sm90_kernel_skip_reason("fp8 block forward")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

BLOCK_VARIANTS = fp8_block_specs("sm90")
# test_fp8.py's (batch, seqlen_q, seqlen_k, heads_q, heads_kv): seqlens 1/17/1000/4097 (partial
# tiles), sq != sk both ways, GQA and MQA.
SHAPES = fp8t.SHAPES
LSE_TOL = fp8t.LSE_TOL
LSE_REL_TOL = 2.0**-9  # of |lse|: the e4m3 tensor cores' accumulation (see check)
LSE_SCORE_TOL = 2.0**-12  # of the row's score bound (score_bounds): the same, on cancelling sums


def make_inputs(gen, batch, sq, sk, hq, hkv, d):
    """Unit-variance q/k/v; k and v heads scaled differently; every 97th token 8x larger."""

    def tokens(x):
        boost = torch.ones(x.shape[1], device="cuda")
        boost[::97] = 8.0
        return x * boost[None, :, None, None]

    q, k, v = fp8t.make_inputs(gen, batch, sq, sk, hq, hkv, d)
    return tokens(q), tokens(k), tokens(v)


def quantize_blocks(q, k, v, q_block, kv_block):
    group = q.shape[2] // k.shape[2]
    qq, qd = cutefa.quantize_fp8(q, "block", block=q_block, group=group)
    kq, kd = cutefa.quantize_fp8(k, "block", block=kv_block)
    vq, vd = cutefa.quantize_fp8(v, "block", block=kv_block)
    return (qq, kq, vq), (qd, kd, vd)


def dequantized(fp8s, descales, q_block, kv_block):
    return tuple(
        fp8.dequantize_fp8(x, d, block) for x, d, block in zip(fp8s, descales, (q_block, kv_block, kv_block))
    )


def emulate(deq, v_descale, kv_block, *, causal, scale):
    """The kernel's result in float32 torch: dequantized inputs, P rounded to e4m3 as P * r * 2^8
    (r = v's block descale over its largest, per key) against the final row max, unrounded row
    sums. Returns (out, lse)."""
    seqlen_k = deq[1].shape[1]
    ratio = v_descale / v_descale.amax(dim=2, keepdim=True)  # (batch, heads_kv, blocks)
    ratio = ratio.repeat_interleave(kv_block, 2)[:, :, :seqlen_k]  # per key
    return fp8t.emulate_dequantized(*deq, causal=causal, scale=scale, p_ratio=ratio)


def score_bounds(deq, scale):
    """Per (batch, head, query row): scale * |q_row| * max over the row's kv head of |k_j|, a bound
    on the size of every score of the row and of the partial sums the tensor cores accumulate for
    it (Cauchy-Schwarz)."""
    q, k = deq[0].float(), deq[1].float()
    group = q.shape[2] // k.shape[2]
    k_max = k.norm(dim=-1).amax(dim=1).repeat_interleave(group, dim=1)  # (batch, heads_q)
    return (q.norm(dim=-1) * k_max[:, None, :] * scale).permute(0, 2, 1)  # (batch, heads_q, seqlen_q)


def check(out, lse, exact, exact_lse, emul, *, what, bounds):
    """test_fp8.py's check of out against the emulation, and lse finite where the reference's is,
    and there within LSE_TOL + LSE_REL_TOL |lse| + LSE_SCORE_TOL x the row's score bound
    (:func:`score_bounds`) of it."""
    fp8t.check_out(out, lse, exact, emul, what=what)
    finite = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: lse finite where the reference is not"
    # Hopper's e4m3 tensor cores accumulate with fewer mantissa bits than fp32: a score's error
    # grows with the size of its terms, and the outlier tokens here make scores of a few hundred
    # (measured on an H200: per-head and block kernels alike, lse off by up to 2.7e-4 of the row's
    # lse there, by 1e-3 where scores stay below 10) and partial sums that cancel: an outlier
    # query's row whose only key is the outlier key (causal, 17 tokens, hd256) came out 0.044 off
    # at lse 8.2 (5e-3 of it, 2^-14.5 of its score bound; the lazy_rescale kernel and its twin
    # without it gave the same lse to 2e-6). The bound per row: LSE_TOL + 2^-9 |lse| + 2^-12
    # of the row's score bound.
    lse_err = (lse[finite].double() - exact_lse[finite].double()).abs()
    bound = LSE_TOL + LSE_REL_TOL * exact_lse[finite].double().abs() + LSE_SCORE_TOL * bounds[finite].double()
    worst = int(torch.argmax(lse_err - bound))
    assert bool(torch.all(lse_err <= bound)), (
        f"{what}: lse off by {lse_err[worst].item():.4g} > {bound[worst].item():.4g} where the lse is "
        f"{exact_lse[finite][worst].item():.4g}"
    )


@pytest.mark.parametrize("spec", BLOCK_VARIANTS, ids=lambda s: s.name)
def test_variant(gen, spec):
    """Each committed _blockq kernel, called directly (arguments from cutefa.api.descales.kernel_args) on
    NaN-poisoned outputs, on every shape."""
    from cutefa.loader import get_kernel

    target = dispatch.current_target()
    kernel = get_kernel(spec, target)
    scale = ref.default_scale(spec.head_dim)
    for batch, sq, sk, hq, hkv in SHAPES:
        q, k, v = make_inputs(gen, batch, sq, sk, hq, hkv, spec.head_dim)
        fp8s, descales = quantize_blocks(q, k, v, spec.tile_m, spec.tile_n)
        twin = dispatch.Choice(spec.replace(quant=Quant.TENSOR), target, "test")
        choice, args = kernel_args(fp8s[0], fp8s[1], descales, twin)
        assert choice.spec == spec
        out = torch.full((batch, sq, hq, spec.head_dim), math.nan, dtype=torch.bfloat16, device="cuda")
        lse = torch.full((batch, hq, sq), math.nan, device="cuda")
        kernel(*fp8s, out, lse, *args, scale)
        deq = dequantized(fp8s, descales, spec.tile_m, spec.tile_n)
        exact, exact_lse = ref.attention_ref(*deq, causal=spec.causal)
        emul, _ = emulate(deq, descales[2], spec.tile_n, causal=spec.causal, scale=scale)
        check(
            out, lse, exact, exact_lse, emul, what=f"{spec.name} {(batch, sq, sk, hq, hkv)}",
            bounds=score_bounds(deq, scale),
        )  # fmt: skip
        if spec.causal and sq > sk:
            rows = sq - sk
            assert torch.all(out[:, :rows] == 0) and torch.all(torch.isneginf(lse[:, :, :rows]))


@pytest.mark.parametrize("head_dim", sorted({s.head_dim for s in BLOCK_VARIANTS}))
@pytest.mark.parametrize("causal", [False, True])
def test_api(gen, head_dim, causal):
    """flash_attn_func with block descales: block sizes from cutefa.fp8_block_sizes, GQA (q's
    descale per kv head), sq != sk."""
    batch, sq, sk, hq, hkv = 2, 300, 777, 6, 2
    q, k, v = make_inputs(gen, batch, sq, sk, hq, hkv, head_dim)
    q_block, kv_block = cutefa.fp8_block_sizes(q, k, causal=causal)
    assert q_block == 128 and kv_block == DEFAULT_TILES["sm90"][head_dim].tile_n
    fp8s, descales = quantize_blocks(q, k, v, q_block, kv_block)
    out, lse = cutefa.flash_attn_func(
        *fp8s,
        causal=causal,
        q_descale=descales[0],
        k_descale=descales[1],
        v_descale=descales[2],
        return_lse=True,
    )
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    deq = dequantized(fp8s, descales, q_block, kv_block)
    exact, exact_lse = ref.attention_ref(*deq, causal=causal)
    emul, _ = emulate(deq, descales[2], kv_block, causal=causal, scale=ref.default_scale(head_dim))
    check(
        out, lse, exact, exact_lse, emul, what=f"api hd{head_dim} causal={causal}",
        bounds=score_bounds(deq, ref.default_scale(head_dim)),
    )  # fmt: skip


def test_api_mixed_granularities(gen):
    """A per-head q descale and a per-tensor v descale next to a block k descale: the block
    variant runs with the others broadcast over the blocks."""
    batch, sq, sk, hq, hkv, d = 1, 1000, 1000, 4, 2, 128
    q, k, v = make_inputs(gen, batch, sq, sk, hq, hkv, d)
    _, kv_block = cutefa.fp8_block_sizes(q, k)
    qq, qd = cutefa.quantize_fp8(q, "head", group=hq // hkv)
    kq, kd = cutefa.quantize_fp8(k, "block", block=kv_block)
    vq, vd = cutefa.quantize_fp8(v)
    out = cutefa.flash_attn_func(qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=vd)
    deq = (fp8.dequantize_fp8(qq, qd), fp8.dequantize_fp8(kq, kd, kv_block), fp8.dequantize_fp8(vq, vd))
    exact, exact_lse = ref.attention_ref(*deq)
    v_blocks = vd.reshape(1, 1, 1).expand(batch, hkv, -(-sk // kv_block))
    emul, _ = emulate(deq, v_blocks, kv_block, causal=False, scale=ref.default_scale(d))
    _, lse = cutefa.flash_attn_func(qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    check(
        out,
        lse,
        exact,
        exact_lse,
        emul,
        what="mixed granularities",
        bounds=score_bounds(deq, ref.default_scale(d)),
    )


def test_block_size_mismatch_is_refused(gen):
    q, k, v = make_inputs(gen, 1, 300, 300, 2, 2, 128)
    fp8s, descales = quantize_blocks(q, k, v, 128, 64)  # hd128 runs 128x128
    with pytest.raises(ValueError, match=r"k_descale must have shape .*tile_n=128"):
        cutefa.flash_attn_func(*fp8s, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])


def test_outlier_channels_block_vs_tensor_and_head(gen):
    """The accuracy table of tests/test_fp8_block.py on the GPU kernel: q and k with outlier
    channels; block quantization's error against exact attention of the unquantized inputs is below
    per-tensor's (printed with per-head's)."""
    batch, seqlen, heads, d = 4, 1024, 4, 128
    boost = torch.ones(d, device="cuda")
    boost[[5, 61, 100]] = 30.0
    q, k, v = (torch.randn(batch, seqlen, heads, d, generator=gen, device="cuda") for _ in range(3))
    q, k = q * boost * 0.2, k * boost * 0.2
    exact, _ = ref.attention_ref(q, k, v)
    q_block, kv_block = cutefa.fp8_block_sizes(q, k)
    errors = {}
    for granularity in ("tensor", "head", "block"):
        blocks = (q_block, kv_block) if granularity == "block" else (None, None)
        qq, qd = cutefa.quantize_fp8(q, granularity, block=blocks[0])
        kq, kd = cutefa.quantize_fp8(k, granularity, block=blocks[1])
        vq, vd = cutefa.quantize_fp8(v, granularity, block=blocks[1])
        out = cutefa.flash_attn_func(qq, kq, vq, q_descale=qd, k_descale=kd, v_descale=vd)
        errors[granularity] = ref.rel_l2(out.float(), exact)
    print("fp8 relative L2 error, outlier channels:", {n: f"{e:.4f}" for n, e in errors.items()})
    assert errors["block"] < errors["tensor"]
