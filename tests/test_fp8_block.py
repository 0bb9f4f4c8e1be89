"""FP8 block quantization on the CPU: quantize_fp8(granularity="block"), the kernel's blockwise
algorithm emulated in float64 torch against dequantize-then-attend, the API's route to the
block-quantization variant (_blockq) with its argument checks, and an accuracy table.

The emulation (:func:`emulate_kernel`) follows templates/fwd_sm90_fp8.py.j2 with Quant.BLOCK step
by step: key tiles last to first, the query tile's descale folded into the softmax scale, each key
tile's scores scaled by its k descale with the row max kept in scaled log2 units, log2 of v's
ratio r[n] = sv[n] / max(sv) folded into the exp2 bias (so the probabilities carry V's scale), row
sums of the unscaled probabilities (tile sum times 1 / r[n]), O times max(sv) at the end. It
takes exactly the arguments the kernel takes (cutefa.api.descales.kernel_args builds them).
"""

from __future__ import annotations

import math

import pytest
import torch
from cpu_support import rand, reference, trace_attention_block
from torch._subclasses.fake_tensor import FakeTensorMode

import cutefa
from cutefa import dispatch, fp8
from cutefa.api import descales as api_descales
from cutefa.api import fp8 as fp8_api
from cutefa.api import validate
from cutefa.model.committed import default_variants, fp8_block_specs
from cutefa.model.options import Quant, VTranspose

P_OFFSET_LOG2 = 8.0  # cutefa.kernels.sm90.fp8_softmax.P_OFFSET_LOG2 (importing it would import the DSL)
LOG2_E = math.log2(math.e)


def token_outliers(x, seed, every=37, factor=60.0):
    """``x`` with every ``every``-th token (and a random few) ``factor`` times larger: activations
    whose magnitude varies along the sequence, which block quantization confines to their blocks."""
    boost = torch.ones(x.shape[1])
    boost[::every] = factor
    boost[torch.randint(0, x.shape[1], (3,), generator=torch.Generator().manual_seed(seed))] = factor
    return x * boost[None, :, None, None]


def emulate_kernel(q, k, v, q_descale, kv_scales, v_descale, *, causal, scale, tile_m, tile_n, round_p=False):
    """The block-quantization kernel's arithmetic in float64 on its own arguments: e4m3 q/k/v,
    q_descale (b, hkv, q tiles), kv_scales (b, hkv, k tiles, 4), v_descale (b, hkv). ``round_p``
    rounds the probabilities to e4m3 as the kernel does before P V. Returns (out, lse)."""
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    qf, kf, vf = q.double(), k.double(), v.double()
    kv = kv_scales.double()
    out = torch.zeros(batch, sq, hq, d, dtype=torch.float64)
    lse = torch.full((batch, hq, sq), -math.inf, dtype=torch.float64)
    n_tiles = -(-sk // tile_n)
    for b in range(batch):
        for h in range(hq):
            hk = h // group
            for m in range(-(-sq // tile_m)):
                rows = torch.arange(m * tile_m, min((m + 1) * tile_m, sq))
                c = scale * LOG2_E * q_descale[b, hk, m].double()  # folded at kernel start
                row_max = torch.full((len(rows),), -math.inf, dtype=torch.float64)
                row_sum = torch.zeros(len(rows), dtype=torch.float64)
                acc = torch.zeros(len(rows), d, dtype=torch.float64)
                for n in reversed(range(n_tiles)):
                    keys = torch.arange(n * tile_n, min((n + 1) * tile_n, sk))
                    s = qf[b, rows, h] @ kf[b, keys, hk].T
                    if causal:
                        allowed = keys[None, :] <= rows[:, None] + sk - sq
                        s = s.masked_fill(~allowed, -math.inf)
                    k_scale, ratio_log2, ratio_inv = kv[b, hk, n, 0], kv[b, hk, n, 1], kv[b, hk, n, 2]
                    tile_scale = c * k_scale
                    new_max = torch.maximum(row_max, s.amax(dim=1) * tile_scale)
                    offset = torch.where(torch.isneginf(new_max), 0.0, new_max)
                    p = torch.exp2(s * tile_scale - (offset - (P_OFFSET_LOG2 + ratio_log2))[:, None])
                    corr = torch.exp2(row_max - offset)
                    row_sum = row_sum * corr + p.sum(dim=1) * ratio_inv
                    row_max = new_max
                    if round_p:
                        p = p.float().to(torch.float8_e4m3fn).double()
                    acc = acc * corr[:, None] + p @ vf[b, keys, hk]
                empty = row_sum == 0
                inv = torch.where(empty, 0.0, v_descale[b, hk].double() / torch.where(empty, 1.0, row_sum))
                out[b, rows, h] = acc * inv[:, None]
                lse[b, h, rows] = torch.where(
                    empty,
                    -math.inf,
                    (row_max + torch.log2(torch.where(empty, 1.0, row_sum)) - P_OFFSET_LOG2) * math.log(2),
                )
    return out, lse


def sm90_choice(q, k, causal, v_centered=False):
    return dispatch.choose(
        target="sm_90a", dtype=q.dtype, head_dim=q.shape[3], causal=causal, seqlen_q=q.shape[1],
        seqlen_k=k.shape[1], batch=q.shape[0], heads_q=q.shape[2], heads_kv=k.shape[2], v_centered=v_centered,
    )  # fmt: skip


def block_inputs(batch=2, sq=300, sk=777, hq=4, hkv=2, d=64, *, tiles=(128, 128), seed=0):
    """Unquantized (q, k, v) with token outliers and per-head scales, and their block quantization
    in tiles of (q rows, k/v rows)."""
    q = token_outliers(rand(batch, sq, hq, d, seed=seed), seed)
    k = (
        token_outliers(rand(batch, sk, hkv, d, seed=seed + 1), seed + 1)
        * torch.tensor([0.5, 2.0])[:hkv, None]
    )
    v = token_outliers(rand(batch, sk, hkv, d, seed=seed + 2), seed + 2, every=53)
    tm, tn = tiles
    quantized = (
        cutefa.quantize_fp8(q, "block", block=tm, group=hq // hkv),
        cutefa.quantize_fp8(k, "block", block=tn),
        cutefa.quantize_fp8(v, "block", block=tn),
    )
    return (q, k, v), quantized


# ---------------------------------------------------------------------------------------------
# quantize_fp8(granularity="block")


def test_block_descales_shape_and_values():
    x = token_outliers(rand(2, 300, 4, 64, seed=3), 3)
    q, descale = cutefa.quantize_fp8(x, "block", block=128, group=2)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert descale.dtype == torch.float32 and descale.shape == (2, 2, 3) and descale.is_contiguous()
    for b in range(2):
        for g in range(2):
            for blk, (r0, r1) in enumerate(((0, 128), (128, 256), (256, 300))):  # the last block is partial
                amax = x[b, r0:r1, 2 * g : 2 * g + 2].abs().amax()
                assert descale[b, g, blk] == pytest.approx(amax.item() / fp8.E4M3_MAX, rel=1e-6)
                # the block's largest magnitude maps to the largest e4m3 value
                assert q[b, r0:r1, 2 * g : 2 * g + 2].float().abs().amax() == fp8.E4M3_MAX
    back = fp8.dequantize_fp8(q, descale, block=128)
    scale = fp8.expand_descale(descale, x.shape, 128)
    bound = x.abs() * 2.0**-4 + scale * 2.0**-10  # half an e4m3 spacing; subnormal step 2^-9
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


def test_block_of_the_whole_sequence_is_the_head_descale():
    x = rand(2, 100, 4, 64, seed=4)
    qb, db = cutefa.quantize_fp8(x, "block", block=100, group=2)
    qh, dh = cutefa.quantize_fp8(x, "head", group=2)
    assert torch.equal(db[:, :, 0], dh) and torch.equal(qb.float(), qh.float())


def test_block_quantization_keeps_small_tokens_precise_next_to_huge_ones():
    """e4m3 is a float format: scaling matters only where magnitudes within one scale span more
    than its normal range (2^-6 to 448, about 2^15). With tokens 10^4 times the rest, one scale per
    head pushes the small tokens into subnormals; blocks without a huge token keep them normal.
    Measured on the small tokens (the whole tensor's error is the huge tokens' and does not move)."""
    x = rand(1, 512, 2, 64, seed=5)
    boost = torch.ones(512)
    boost[::97] = 1e4
    x = x * boost[None, :, None, None]
    small = boost == 1
    errors = {}
    for granularity, block in (("tensor", None), ("head", None), ("block", 64)):
        q, d = cutefa.quantize_fp8(x, granularity, block=block)
        diff = fp8.dequantize_fp8(q, d, block) - x
        errors[granularity] = (
            (diff.norm() / x.norm()).item(),
            (diff[:, small].norm() / x[:, small].norm()).item(),
        )
    print(
        "round-trip relative error (all / small tokens):",
        {g: f"{a:.4f}/{b:.4f}" for g, (a, b) in errors.items()},
    )
    assert all(whole < 0.03 for whole, _ in errors.values())  # e4m3 rounding: <= 2^-4, ~2.6% RMS
    assert errors["block"][1] < 0.85 * errors["head"][1]
    assert errors["head"][1] <= errors["tensor"][1] * 1.01


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda x: cutefa.quantize_fp8(x, "block"), ValueError, "granularity='block' needs block="),
        (lambda x: cutefa.quantize_fp8(x, "block", block=0), ValueError, "block=0 must be a positive int"),
        (
            lambda x: cutefa.quantize_fp8(x, "block", block=True),
            ValueError,
            "block=True must be a positive int",
        ),
        (
            lambda x: cutefa.quantize_fp8(x, "head", block=64),
            ValueError,
            "block=64 applies to granularity 'block'",
        ),
        (
            lambda x: cutefa.quantize_fp8(x, "block", block=64, group=3),
            ValueError,
            "group=3 must be a positive",
        ),
        (lambda x: fp8.dequantize_fp8(x, torch.ones(1, 2, 1)), ValueError, "needs block="),
        (lambda x: fp8.dequantize_fp8(x, torch.ones(1, 2, 3), block=8), ValueError, "descale has 3 blocks"),
    ],
)
def test_block_quantize_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.ones(1, 10, 2, 64))


# ---------------------------------------------------------------------------------------------
# The kernel's algorithm equals dequantize-then-attend


@pytest.mark.parametrize("causal", [False, True])
def test_block_choice_of_a_pick_without_a_block_twin(causal):
    """A dispatched e4m3 variant whose block twin is not committed (the tuned table picks hd256's
    128x96 tile, whose block twin would spill) runs block descales on the committed block variant of
    its head dim and mask, and says so."""
    committed_set = default_variants("sm90")
    picked = next(
        s for s in committed_set
        if (s.dtype, s.head_dim, s.tile_m, s.tile_n, s.causal) == ("e4m3", 256, 128, 96, causal)
        and s.options.quant is Quant.TENSOR and s.options.v_transpose is VTranspose.HOISTED
    )  # fmt: skip
    assert picked.replace(quant=Quant.BLOCK) not in committed_set
    choice = api_descales.block_choice(dispatch.Choice(picked, "sm_90a", "tuned"))
    committed = [s for s in fp8_block_specs("sm90") if (s.head_dim, s.causal) == (256, causal)]
    assert [choice.spec] == committed
    assert f"block quantization on the committed {choice.spec.name}" in choice.reason
    default = dispatch.Choice(committed[0].replace(quant=Quant.TENSOR), "sm_90a", "heuristic")
    assert api_descales.block_choice(default).spec == committed[0]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("sq", "sk", "hq", "hkv", "d"),
    [(300, 777, 4, 2, 64), (1, 17, 2, 2, 256), (200, 100, 3, 1, 192), (128, 256, 2, 2, 128)],
)
def test_blockwise_algorithm_is_exact(causal, sq, sk, hq, hkv, d):
    """Folded scales, ratios in the exp2 bias and unscaled row sums: in float64, without the e4m3
    rounding of P, the kernel's arithmetic on its arguments gives dequantize-then-attend."""
    q, k = (
        torch.empty(2, sq, hq, d, dtype=torch.float8_e4m3fn),
        torch.empty(2, sk, hkv, d, dtype=torch.float8_e4m3fn),
    )
    choice = api_descales.block_choice(sm90_choice(q, k, causal))
    spec = choice.spec
    assert spec.options.quant is Quant.BLOCK and spec.options.v_transpose is VTranspose.HOISTED and "_blockq_hvt" in spec.name
    assert (spec.tile_m, spec.tile_n) == cutefa.fp8_block_sizes(q, k, causal=causal, target="sm_90a")
    (_, _, _), ((q8, qd), (k8, kd), (v8, vd)) = block_inputs(
        2, sq, sk, hq, hkv, d, tiles=(spec.tile_m, spec.tile_n)
    )
    assert len(set(vd.flatten().tolist())) > 2  # ratios differ from tile to tile
    _, args = api_descales.kernel_args(q8, k8, (qd, kd, vd), choice)
    scale = d**-0.5
    out, lse = emulate_kernel(
        q8, k8, v8, *args, causal=causal, scale=scale, tile_m=spec.tile_m, tile_n=spec.tile_n
    )
    # dequantized exactly (float64 products of the e4m3 values and the float32 descales)
    deq = [
        x.double() * fp8.expand_descale(s, x.shape, block).double()
        for x, s, block in ((q8, qd, spec.tile_m), (k8, kd, spec.tile_n), (v8, vd, spec.tile_n))
    ]
    exact, exact_lse = reference(*deq, causal, scale, torch.float64)
    # What is left is the rounding of the kernel's float32 arguments (log2 r and 1 / r): ~1e-7.
    tol = 2e-6
    torch.testing.assert_close(out, exact, atol=tol * exact.abs().max().item(), rtol=tol)
    finite = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], exact_lse[finite], atol=tol, rtol=tol)
    if causal and sq > sk:
        assert torch.all(out[:, : sq - sk] == 0)


def test_kernel_arguments():
    """kv_scales holds (k descale, log2 r, 1 / r, 0) per key tile with r = v's descale over its
    largest; v_descale is that largest; per-head and per-tensor descales broadcast over the blocks."""
    (_, _, _), ((q8, qd), (k8, kd), (_, vd)) = block_inputs()
    choice, (q_arg, kv, v_max) = api_descales.kernel_args(q8, k8, (qd, kd, vd), sm90_choice(q8, k8, False))
    assert choice.spec.name == "cutefa_sm90_fwd_e4m3_hd64_128x128_s2_w12_ov_pp_blockq_hvt"
    assert kv.shape == (2, 2, 7, 4) and kv.is_contiguous() and kv.dtype == torch.float32
    assert torch.equal(q_arg, qd) and torch.equal(kv[..., 0], kd) and torch.all(kv[..., 3] == 0)
    torch.testing.assert_close(v_max, vd.amax(-1))
    ratio = vd / v_max[..., None]
    torch.testing.assert_close(kv[..., 1], torch.log2(ratio))
    torch.testing.assert_close(kv[..., 2], 1 / ratio)
    assert torch.all(kv[..., 1] <= 0) and torch.all(kv[..., 1].amax(-1) == 0)  # r in (0, 1], max 1
    # a per-head q descale and a per-tensor v descale next to a block k descale
    head_q = torch.rand(2, 2) + 0.5
    _, (q_arg, kv, v_max) = api_descales.kernel_args(
        q8, k8, (head_q, kd, torch.full((2, 2), 0.25)), sm90_choice(q8, k8, False)
    )
    assert torch.equal(q_arg, head_q[:, :, None].expand(2, 2, 3))
    assert torch.all(kv[..., 1] == 0) and torch.all(kv[..., 2] == 1) and torch.all(v_max == 0.25)
    # per-head descales everywhere keep the per-head variant and its arguments
    same = (torch.ones(2, 2),) * 3
    choice, args = api_descales.kernel_args(q8, k8, same, sm90_choice(q8, k8, True))
    assert choice.spec.options.quant is Quant.TENSOR and args == same


def test_block_size_mismatch_names_both():
    (_, _, _), ((q8, qd), (k8, kd), (_, vd)) = block_inputs(tiles=(128, 64))  # hd64 runs 128x128
    with pytest.raises(
        ValueError,
        match=r"k_descale must have shape \(batch, heads_kv, ceil\(seqlen_k / 128\)\) = \(2, 2, 7\)",
    ) as info:
        api_descales.kernel_args(q8, k8, (qd, kd, vd), sm90_choice(q8, k8, False))
    text = str(info.value)
    assert "tile_n=128" in text and "got (2, 2, 13)" in text and "blocks of about 60 rows" in text
    assert "cutefa_sm90_fwd_e4m3_hd64_128x128_s2_w12_ov_pp_blockq_hvt" in text and "block=128" in text
    with pytest.raises(
        ValueError, match=r"q_descale must have shape .* = \(2, 2, 3\).*tile_m=128.*got \(2, 2, 5\)"
    ):
        api_descales.kernel_args(q8, k8, (torch.ones(2, 2, 5), kd, vd), sm90_choice(q8, k8, False))


def test_block_descales_on_a_family_without_block_kernel():
    (_, _, _), ((q8, qd), (k8, _), (_, _)) = block_inputs()
    choice = dispatch.choose(
        target="sm_100a", dtype=q8.dtype, head_dim=64, causal=False, seqlen_q=300, seqlen_k=777, batch=2,
        heads_q=4, heads_kv=2,
    )  # fmt: skip
    with pytest.raises(
        NotImplementedError, match="block-quantized fp8 descales .* no kernel for cutefa_sm100"
    ):
        api_descales.kernel_args(q8, k8, (qd, torch.ones(2, 2), torch.ones(2, 2)), choice)
    with pytest.raises(NotImplementedError, match=r"the sm100 e4m3 forward has no block quantization \(Sm100FwdOptions\)"):
        cutefa.fp8_block_sizes(q8, k8, target="sm_100a")


def test_fp8_block_sizes_per_head_dim():
    for d, expected in (
        (64, (128, 128)),
        (96, (128, 128)),
        (128, (128, 128)),
        (192, (128, 96)),
        (256, (128, 64)),
    ):
        q = torch.empty(1, 1000, 4, d, dtype=torch.bfloat16)  # shapes only: the tensors before quantization
        for causal in (False, True):
            assert cutefa.fp8_block_sizes(q, q[:, :, :2], causal=causal, target="sm_90a") == expected
    with pytest.raises(TypeError, match="causal must be a bool"):
        cutefa.fp8_block_sizes(q, q, causal=1, target="sm_90a")
    with pytest.raises(ValueError, match="cutefa runs on CUDA tensors"):
        cutefa.fp8_block_sizes(q, q)


# ---------------------------------------------------------------------------------------------
# flash_attn_func with block descales, the kernel replaced by the emulation


@pytest.fixture
def on_cpu(monkeypatch):
    """CPU tensors accepted; dispatch for sm_90a; the kernel is :func:`emulate_kernel` (block
    variants) on its real arguments. Records (variant name, args) of each launch."""
    calls = []

    def get_kernel(spec, target):
        def kernel(q, k, v, out, lse, *args):
            *descales, scale = args
            calls.append((spec.name, descales))
            if spec.options.quant is not Quant.BLOCK:  # per-head: one block of each
                descales = [descales[0][:, :, None], torch.stack(
                    (descales[1], torch.zeros_like(descales[1]), torch.ones_like(descales[1]),
                     torch.zeros_like(descales[1])), -1)[:, :, None], descales[2]]  # fmt: skip
                tiles = (q.shape[1], k.shape[1])
            else:
                tiles = (spec.tile_m, spec.tile_n)
            o, l = emulate_kernel(
                q, k, v, *descales, causal=spec.causal, scale=scale, tile_m=tiles[0], tile_n=tiles[1]
            )
            out.copy_(o.to(out.dtype))
            lse.copy_(l.float())

        return kernel

    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(fp8_api, "choose", sm90_choice)
    monkeypatch.setattr(fp8_api, "get_kernel", get_kernel)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # CPU tensors have device index None
    return calls


@pytest.mark.parametrize("causal", [False, True])
def test_api_runs_the_block_variant(on_cpu, causal):
    (q, _, _), ((q8, qd), (k8, kd), (v8, vd)) = block_inputs()
    out, lse = cutefa.flash_attn_func(
        q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True
    )
    name, args = on_cpu[-1]
    assert name == f"cutefa_sm90_fwd_e4m3_hd64_128x128_s2_w12{'_causal' if causal else ''}_ov_pp_blockq_hvt"
    assert [a.shape for a in args] == [(2, 2, 3), (2, 2, 7, 4), (2, 2)]
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (2, 4, 300)
    deq = [fp8.dequantize_fp8(x, s, b) for x, s, b in ((q8, qd, 128), (k8, kd, 128), (v8, vd, 128))]
    exact, exact_lse = reference(*deq, causal, 1 / 8, torch.float64)
    torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=2e-2)  # bf16 output
    torch.testing.assert_close(lse.double(), exact_lse, atol=1e-4, rtol=1e-5)


def test_api_per_head_descales_keep_the_per_head_variant(on_cpu):
    (_, _, _), ((q8, _), (k8, _), (v8, _)) = block_inputs()
    cutefa.flash_attn_func(q8, k8, v8, q_descale=torch.ones(2, 2), k_descale=torch.ones(()), v_descale=None)
    name, args = on_cpu[-1]
    assert (
        name == "cutefa_sm90_fwd_e4m3_hd64_128x128_s2_w12_ov_pp_hvt" and [a.shape for a in args] == [(2, 2)] * 3
    )


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            lambda d: {**d, "k_descale": torch.ones(2, 3, 7)},
            ValueError,
            r"k_descale must have shape \(\) or \(batch, heads_kv\) = \(2, 2\), or \(batch, heads_kv, blocks\)",
        ),
        (lambda d: {**d, "v_descale": torch.ones(2, 2, 7, 1)}, ValueError, r"v_descale must have shape"),
        (
            lambda d: {**d, "v_descale": torch.ones(2, 2, 6)},
            ValueError,
            r"v_descale must have shape \(batch, heads_kv, ceil\(seqlen_k / 128\)\) = \(2, 2, 7\)",
        ),
        (
            lambda d: {**d, "q_descale": torch.ones(2, 2, 3, dtype=torch.float64)},
            TypeError,
            "q_descale must be float32",
        ),
    ],
)
def test_api_block_validation(on_cpu, change, error, match):
    (_, _, _), ((q8, qd), (k8, kd), (v8, vd)) = block_inputs()
    kwargs = change({"q_descale": qd, "k_descale": kd, "v_descale": vd})
    with pytest.raises(error, match=match):
        cutefa.flash_attn_func(q8, k8, v8, **kwargs)
    assert not on_cpu


# ---------------------------------------------------------------------------------------------
# Accuracy


def outlier_inputs(seed=0, batch=4, seqlen=512, heads=2, d=128):
    """q and k with three channels 30x larger than the rest (the outliers of trained models; as in
    tests/gpu/test_fp8.py), unit-variance v."""
    gen = torch.Generator().manual_seed(seed)
    boost = torch.ones(d)
    boost[[5, 61, 100]] = 30.0
    q, k, v = (torch.randn(batch, seqlen, heads, d, generator=gen) for _ in range(3))
    return q * boost * 0.2, k * boost * 0.2, v


def test_accuracy_table_block_vs_tensor_vs_head():
    """Relative L2 error of the output (the kernel's arithmetic on its arguments, P rounded to
    e4m3 as the kernel does) against exact float64 attention of the unquantized inputs, with
    outlier channels, per granularity. The error is mostly the e4m3 rounding of the outlier
    channels' large products, which no scale along seqlen removes (Hadamard rotation does), so the
    granularities differ by the smaller amax of a block than of a head; per-seed differences are
    noisy, so 4 batches are measured at once. Block quantization comes out below per-tensor."""
    q, k, v = outlier_inputs()
    tiles = (128, 128)  # hd128's sm90 e4m3 tile
    exact, _ = reference(q, k, v, False, 128**-0.5, torch.float64)
    choice = sm90_choice(
        torch.empty(q.shape, dtype=torch.float8_e4m3fn),
        torch.empty(k.shape, dtype=torch.float8_e4m3fn),
        False,
    )
    errors = {}
    for granularity in ("tensor", "head", "block"):
        q_block, kv_block = tiles if granularity == "block" else (None, None)
        qq, qd = cutefa.quantize_fp8(q, granularity, block=q_block)
        kq, kd = cutefa.quantize_fp8(k, granularity, block=kv_block)
        vq, vd = cutefa.quantize_fp8(v, granularity, block=kv_block)
        descales = [d.reshape(1, 1).expand(*q.shape[:1], 2) if d.dim() == 0 else d for d in (qd, kd, vd)]
        if granularity != "block":  # the same arithmetic, one descale for all blocks
            descales[0] = descales[0][:, :, None].expand(-1, -1, 4).contiguous()
        _, args = api_descales.kernel_args(qq, kq, descales, choice)
        out, _ = emulate_kernel(
            qq, kq, vq, *args, causal=False, scale=128**-0.5, tile_m=128, tile_n=128, round_p=True
        )
        errors[granularity] = ((out - exact).norm() / exact.norm()).item()
    print("\nfp8 output relative L2 error, q and k with outlier channels:")
    for granularity, err in errors.items():
        print(f"  {granularity:>6}: {err:.5f}")
    assert errors["block"] < errors["tensor"]
    # below per-head on most seeds, not all (seeds 0-3: 0.85, 0.84, 0.82, 1.03 times per-head)
    assert errors["block"] < 1.1 * errors["head"]


def test_torch_compile_traces_block_descales():
    """3-D descales go through the cutefa::flash_fwd_fp8 op like 2-D ones: the fake implementation
    needs no dispatch, so torch.compile traces a block-quantized call without a GPU."""
    with FakeTensorMode():
        q = torch.empty(2, 300, 8, 128, device="cuda", dtype=torch.float8_e4m3fn)
        k = v = torch.empty(2, 777, 2, 128, device="cuda", dtype=torch.float8_e4m3fn)
        qd, kd, vd = (torch.ones(2, 2, n, device="cuda") for n in (3, 7, 7))
        (out, lse), called = trace_attention_block(q, k, v, qd, kd, vd)
    assert (out.shape, out.dtype) == ((2, 300, 8, 128), torch.bfloat16) and lse.shape == (2, 8, 300)
    assert torch.ops.cutefa.flash_fwd_fp8.default in called


def test_api_block_descales_with_v_mean(on_cpu):
    """Block descales and v_mean together at hd128, whose pick for centered v is a _vmean kernel:
    the block variant runs (it takes no means) and the mean is added to its output."""
    _, ((q8, qd), (k8, kd), (v8, vd)) = block_inputs(d=128)
    mean = 3.0 * torch.randn(2, 2, 128, generator=torch.Generator().manual_seed(5))
    descales = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    base = cutefa.flash_attn_func(q8, k8, v8, **descales)
    out = cutefa.flash_attn_func(q8, k8, v8, **descales, v_mean=mean)
    name, args = on_cpu[-1]
    assert fp8_api.choose(q8, k8, False, True).spec.options.v_mean  # what the call dispatched before blocks
    assert "_blockq" in name and "_vmean" not in name and len(args) == 3
    expect = base.float() + mean.repeat_interleave(2, 1)[:, None]
    torch.testing.assert_close(out.float(), expect, atol=3e-2, rtol=1e-2)
