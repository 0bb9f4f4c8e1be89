"""FP8 (e4m3) forward on a Hopper GPU (sm90 family): the variants' own options, each against
what it must compute. The on-chip V transpose places every byte (an exact check); the hoisted and
wide transposes and the persistent scheduler match their twins bitwise; the lazy rescale, the row
sums by WGMMA, the two-level O accumulation and the v_mean epilogue stay within their bounds of the
twin without the option or of the e4m3 emulation. Yardstick, tolerances and helpers: test_fp8.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm90_kernel_skip_reason

from cutefa import fp8
from cutefa.model.options import OAccum, RowSum, Scheduler, VTranspose

ref = _load("reference")
fp8t = _load("test_fp8")


def _skip_reason() -> str | None:
    return sm90_kernel_skip_reason("fp8 forward")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

FP8_VARIANTS, SHAPES, LSE_TOL = fp8t.FP8_VARIANTS, fp8t.SHAPES, fp8t.LSE_TOL
make_inputs, quantize, kv_head_descales = fp8t.make_inputs, fp8t.quantize, fp8t.kv_head_descales
fp8_kernel, emulate, check_out = fp8t.fp8_kernel, fp8t.emulate, fp8t.check_out


@pytest.mark.parametrize("spec", FP8_VARIANTS, ids=lambda s: s.name)
def test_v_transpose_places_every_byte(spec):
    """An exact check of the on-chip V transpose (which byte of V lands in which word of Vt, in
    every ring stage): q = 0 makes every score 0, so every unmasked key gets P = 2^8 exactly and
    row r of O is the plain mean of V over its keys (keys <= r when causal). V holds small integers
    (exact in e4m3) that differ per key and per head dim, so a byte moved to another head dim,
    another key of the causal diagonal or another stage's tile changes the mean by far more than
    the bf16 rounding of the output allowed here."""

    kernel = fp8_kernel(spec)
    batch, heads = 1, 2
    seqlen = 3 * spec.tile_n + 17  # several blocks (both ring stages used), a partial last one
    d = spec.head_dim
    keys = torch.arange(seqlen, device="cuda", dtype=torch.float64)[:, None, None]
    dims = torch.arange(d, device="cuda", dtype=torch.float64)[None, None, :]
    hs = torch.arange(heads, device="cuda", dtype=torch.float64)[None, :, None]
    v_vals = torch.remainder(7 * keys + 3 * dims + 5 * hs, 9) - 4  # integers in [-4, 4]
    q8 = torch.zeros(batch, seqlen, heads, d, device="cuda").to(torch.float8_e4m3fn)
    k8 = torch.randn(batch, seqlen, heads, d, device="cuda").to(torch.float8_e4m3fn)
    v8 = v_vals[None].float().to(torch.float8_e4m3fn)
    assert torch.equal(v8.double()[0], v_vals)
    ones = torch.ones(batch, heads, device="cuda")
    out = torch.full((batch, seqlen, heads, d), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((batch, heads, seqlen), math.nan, device="cuda")
    kernel(q8, k8, v8, out, lse, ones, ones, ones, ref.default_scale(d))
    torch.cuda.synchronize()
    if spec.causal:
        counts = torch.arange(1, seqlen + 1, device="cuda", dtype=torch.float64)
        expected = torch.cumsum(v_vals, dim=0) / counts[:, None, None]
    else:
        counts = torch.full((seqlen,), float(seqlen), device="cuda", dtype=torch.float64)
        expected = (v_vals.sum(dim=0, keepdim=True) / seqlen).expand(seqlen, heads, d)
    err = (out[0].double() - expected).abs()
    bound = expected.abs() * 2.0**-8 + 1e-3  # bf16 rounding of the output, fp32 sums
    assert torch.all(err <= bound), (
        f"{spec.name}: max error {err.max().item():.4g} at {divmod(int(err.argmax()), heads * d)}"
    )
    expected_lse = torch.log(counts)[None, None, :].expand(batch, heads, seqlen)
    assert torch.allclose(lse.double(), expected_lse, atol=1e-3), spec.name


# The e4m3 defaults carry VTranspose.HOISTED; hd128's and hd256's keep a twin with the indexed
# transpose among the alternatives.
def _indexed(spec):
    return spec.replace(v_transpose=VTranspose.INDEXED)


HOISTED = [
    s for s in FP8_VARIANTS if s.options.v_transpose is VTranspose.HOISTED and _indexed(s) in FP8_VARIANTS
]


def test_hoisted_transpose_variants_are_tested():
    assert {(s.head_dim, s.causal) for s in HOISTED} == {(128, False), (128, True), (256, False), (256, True)}
    without_twin = [s for s in FP8_VARIANTS if _indexed(s) not in FP8_VARIANTS]
    assert all(s.options.v_transpose is not VTranspose.INDEXED for s in without_twin)


def _twin_runs(gen, spec, twin):
    """For each of the ragged SHAPES (partial tiles, sq != sk, GQA; causal or not as the spec says,
    with several key blocks so every ring stage is used): (what, (out, lse), (out_twin, lse_twin)),
    ``spec`` and ``twin`` run on the same quantized inputs, NaN-poisoned outputs."""

    kernels = (fp8_kernel(spec), fp8_kernel(twin))
    scale = ref.default_scale(spec.head_dim)
    for batch, sq, sk, hq, hkv in SHAPES:
        q, k, v = make_inputs(gen, batch, sq, sk, hq, hkv, spec.head_dim)
        fp8s, descales = quantize(q, k, v)
        results = []
        for kernel in kernels:
            out = torch.full((batch, sq, hq, spec.head_dim), math.nan, dtype=torch.bfloat16, device="cuda")
            lse = torch.full((batch, hq, sq), math.nan, device="cuda")
            kernel(*fp8s, out, lse, *kv_head_descales(descales, batch, hkv), scale)
            results.append((out, lse))
        torch.cuda.synchronize()
        yield f"{spec.name} vs {twin.name} {(batch, sq, sk, hq, hkv)}", *results


def _assert_bitwise_equal_to_twin(gen, spec, twin):
    """``spec`` and ``twin`` give bitwise equal outputs and LSEs on the ragged SHAPES."""
    for what, (out, lse), (out_twin, lse_twin) in _twin_runs(gen, spec, twin):
        assert torch.equal(out.view(torch.int16), out_twin.view(torch.int16)), what
        assert torch.equal(lse.view(torch.int32), lse_twin.view(torch.int32)), what


@pytest.mark.parametrize("spec", HOISTED, ids=lambda s: s.name)
def test_hoisted_transpose_matches_its_twin(gen, spec):
    """A _hvt variant moves the same V bytes into the same Vt words as its twin with the indexed
    transpose, and nothing else differs: outputs and LSEs bitwise equal."""
    _assert_bitwise_equal_to_twin(gen, spec, _indexed(spec))


# The wide transpose (VTranspose.WIDE, _hvt_wvt: 64-bit LDS/STS): committed on the hd128 and hd256
# default tiles and schedules, whose _hvt defaults are the twins.
WIDE = [s for s in FP8_VARIANTS if s.options.v_transpose is VTranspose.WIDE]

# An option checked against its twin, by name token: (which variants have it, the twin's options).
# (a persistent variant's twin is the one-CTA-per-tile one: test_persistent_matches_its_twin;
# RowSum.MMA, OAccum.TWO_LEVEL and v_mean are committed with lazy_rescale only, so a lazy one's twin
# has none of them)
OPTION_TWINS = {
    "wvt": (lambda s: s.options.v_transpose is VTranspose.WIDE, {"v_transpose": VTranspose.HOISTED}),
    "lres": (
        lambda s: s.options.lazy_rescale,
        {"lazy_rescale": False, "row_sum": RowSum.FADD, "o_accum": OAccum.ONE_LEVEL, "v_mean": False},
    ),
    "smma": (lambda s: s.options.row_sum is RowSum.MMA, {"row_sum": RowSum.FADD}),
}


@pytest.mark.parametrize("token", list(OPTION_TWINS))
def test_option_variants_are_tested(token):
    """The wide transpose, the lazy rescale and the row sums by WGMMA: committed at hd128 and hd256,
    both masks, each beside its twin without the option."""
    has = OPTION_TWINS[token][0]
    flagged = [s for s in FP8_VARIANTS if has(s)]
    assert {(s.head_dim, s.causal) for s in flagged} == {(128, False), (128, True), (256, False), (256, True)}
    assert all(_twin(s, token) in FP8_VARIANTS for s in flagged)


def _twin(spec, token):
    """``spec`` without the option of name token ``token`` (OPTION_TWINS), on the one-CTA-per-tile grid."""
    return spec.replace(**OPTION_TWINS[token][1], scheduler=Scheduler.GRID)


@pytest.mark.parametrize("spec", WIDE, ids=lambda s: s.name)
def test_wide_transpose_matches_its_twin(gen, spec):
    """A _wvt variant writes the same Vt bytes as its _hvt twin (8x8-byte units with 64-bit shared
    loads and stores instead of 4x4 with 32-bit ones) and nothing else differs: outputs and LSEs
    bitwise equal. (test_variant and test_v_transpose_places_every_byte take the _wvt variants too:
    they run every committed e4m3 variant.)"""
    _assert_bitwise_equal_to_twin(gen, spec, _twin(spec, "wvt"))


# The persistent scheduler (Scheduler.PERSISTENT, _persist): committed on the tuned hd128 192x96 and
# hd256 128x96 tiles.
PERSISTENT = [s for s in FP8_VARIANTS if s.options.scheduler is Scheduler.PERSISTENT]


def _one_cta_per_tile(spec):
    return spec.replace(scheduler=Scheduler.GRID)


def test_persistent_variants_are_tested():
    assert {(s.head_dim, s.causal) for s in PERSISTENT} == {
        (128, False),
        (128, True),
        (256, False),
        (256, True),
    }
    assert all(_one_cta_per_tile(s) in FP8_VARIANTS for s in PERSISTENT)


@pytest.mark.parametrize("spec", PERSISTENT, ids=lambda s: s.name)
def test_persistent_matches_its_twin(gen, spec):
    """A _persist variant computes every tile as its one-CTA-per-tile twin does: outputs and LSEs
    bitwise equal on the ragged SHAPES, with the grid the GPU's SM count and also 1 and 7 CTAs, so
    that each CTA walks many tiles (both directions of the boustrophedon order, the pipelines'
    state carried from tile to tile, causal tiles of every length, partial last tiles)."""

    persistent, twin = fp8_kernel(spec), fp8_kernel(_one_cta_per_tile(spec))
    scale = ref.default_scale(spec.head_dim)
    for batch, sq, sk, hq, hkv in SHAPES:
        q, k, v = make_inputs(gen, batch, sq, sk, hq, hkv, spec.head_dim)
        fp8s, descales = quantize(q, k, v)
        args = (*kv_head_descales(descales, batch, hkv), scale)
        expect_out = torch.full((batch, sq, hq, spec.head_dim), math.nan, dtype=torch.bfloat16, device="cuda")
        expect_lse = torch.full((batch, hq, sq), math.nan, device="cuda")
        twin(*fp8s, expect_out, expect_lse, *args)
        for grid in (None, 1, 7):
            out, lse = torch.full_like(expect_out, math.nan), torch.full_like(expect_lse, math.nan)
            if grid is None:
                persistent(*fp8s, out, lse, *args)  # the SM count
            else:
                persistent.fn(*fp8s, out, lse, *args, grid)
            what = f"{spec.name} grid {grid} {(batch, sq, sk, hq, hkv)}"
            assert torch.equal(out.view(torch.int16), expect_out.view(torch.int16)), what
            assert torch.equal(lse.view(torch.int32), expect_lse.view(torch.int32)), what


# lazy_rescale (_lres): committed beside the hd128 and hd256 defaults (and hd256's 128x96 tile).
LAZY = [s for s in FP8_VARIANTS if s.options.lazy_rescale]


@pytest.mark.parametrize("spec", LAZY, ids=lambda s: s.name)
def test_lazy_rescale_on_rising_maxes(gen, spec):
    """Scores whose row maxes keep rising through the key loop, so that the lazy variant takes both
    of its paths many times: keys carry a mean that grows toward key 0 (the kernel walks the keys
    from the last block to the first), queries a positive mean, so each row's max climbs by about
    2^0.5 per 64 keys (past the 2^4 threshold every ~8 blocks) on top of the unit-variance noise.
    Checked against the float32 attention of the dequantized inputs and the emulation as in
    test_variant, and against the twin without the flag (same quantized inputs): relative L2
    within the e4m3 rounding of P."""

    # the twin without the option (of a persistent variant: the committed one-CTA-per-tile twin; of
    # a RowSum.MMA or OAccum.TWO_LEVEL one: the twin without those too; RowSum.MMA's row sums are of
    # the rounded P)
    twin = _twin(spec, "lres")
    kernels = (fp8_kernel(spec), fp8_kernel(twin))
    d = spec.head_dim
    scale = ref.default_scale(d)
    for batch, sq, sk, hq, hkv in ((1, 4097, 4097, 2, 1), (2, 1000, 1000, 2, 2), (1, 300, 2500, 4, 2)):
        q, k, v = make_inputs(gen, batch, sq, sk, hq, hkv, d)
        q = q + 0.5
        # q's mean 0.5 times a key's mean m over d elements, times the scale and log2(e): m moves
        # a score by 0.5 * d * scale * log2(e) * m log2 units; the ramp rises 0.5 per 64 keys.
        ramp_top = 0.5 * (sk / 64.0) / (0.5 * d * scale * math.log2(math.e))
        ramp = torch.linspace(ramp_top, 0.0, sk, device="cuda")[None, :, None, None]
        k = k + ramp
        fp8s, descales = quantize(q, k, v)
        outs = []
        for kernel in kernels:
            out = torch.full((batch, sq, hq, d), math.nan, dtype=torch.bfloat16, device="cuda")
            lse = torch.full((batch, hq, sq), math.nan, device="cuda")
            kernel(*fp8s, out, lse, *kv_head_descales(descales, batch, hkv), scale)
            outs.append((out, lse))
        torch.cuda.synchronize()
        (out, lse), (out_twin, lse_twin) = outs
        what = f"{spec.name} {(batch, sq, sk, hq, hkv)}"
        # The reference takes the dequantized inputs: with scores this peaked, the rounding of q, k
        # and v alone would exceed the emulation's 10% bound; what the ramp tests is the kernel's
        # handling of P and O, which the emulation models exactly but for P's rounding.
        dequantized = [fp8.dequantize_fp8(x, scale_) for x, scale_ in zip(fp8s, descales)]
        exact, _ = ref.attention_ref(*dequantized, causal=spec.causal)
        emul, emul_lse = emulate(fp8s, descales, causal=spec.causal, scale=scale)
        check_out(out, lse, exact, emul, what=what)
        assert not torch.isnan(out_twin).any(), what
        diff = ref.rel_l2(out.float(), out_twin.float())
        assert diff <= 0.05, f"{what}: rel L2 {diff:.4f} against the twin without lazy_rescale"
        # Against the emulation: scores of a few hundred here, and the e4m3 tensor cores'
        # accumulation (fewer mantissa bits than fp32) moves the lse by up to ~2^-12 of its size,
        # so the bound grows with it as in test_fp8_block_gpu.py. Against the twin (the same S
        # from the same tensor cores; only the fp32 row sums' offsets differ): 1e-3.
        # (RowSum.MMA: the rounded P's sums, up to log(1 + 2^-4) from the unrounded ones'.)
        rounded = math.log1p(2.0**-4) if spec.options.row_sum is RowSum.MMA else 0.0
        cases = (
            (emul_lse, "the emulation", 2.0**-9, LSE_TOL + rounded),
            (lse_twin, "the twin", 0.0, 1e-3 + rounded),
        )
        for other, against, rel, tol in cases:
            finite = torch.isfinite(other)
            assert torch.equal(torch.isfinite(lse), finite), f"{what}: lse finite where {against}'s is not"
            err = (lse[finite] - other[finite]).abs()
            assert torch.all(err <= tol + rel * other[finite].abs()), (
                f"{what}: lse off {against} by {err.max().item():.4g}"
            )


# RowSum.MMA (_smma): the row sums by a P x ones WGMMA, committed on the tuned tiles (with lazy_rescale).
SUM_MMA = [s for s in FP8_VARIANTS if s.options.row_sum is RowSum.MMA]


@pytest.mark.parametrize("spec", SUM_MMA, ids=lambda s: s.name)
def test_sum_mma_sums_the_p_it_uses(gen, spec):
    """With V all ones, O is the sum of the e4m3 P the P V product used divided by the row sum: 1
    exactly (in bf16) if the row sums are those of the same P, key block by key block, rescaled with
    O. The twin without the flag divides by the unrounded P's sums and is off by up to 2^-4. Every
    row that attends a key is 1 within one bf16 rounding (2^-8); q and k random, the ragged SHAPES
    with at most two key blocks."""

    kernel = fp8_kernel(spec)
    scale = ref.default_scale(spec.head_dim)
    # Up to two key blocks: the P V product's own accumulation in the tensor core (fewer mantissa
    # bits than fp32, docs/log/perf-notes.md) stays below 2^-9 there; over thousands of keys it does not.
    for batch, sq, sk, hq, hkv in [shape for shape in SHAPES if shape[2] <= 2 * spec.tile_n] + [
        (2, 300, 150, 4, 2)
    ]:
        q, k, _ = make_inputs(gen, batch, sq, sk, hq, hkv, spec.head_dim)
        v = torch.ones(batch, sk, hkv, spec.head_dim, device="cuda")
        fp8s, descales = quantize(q, k, v)
        out = torch.full((batch, sq, hq, spec.head_dim), math.nan, dtype=torch.bfloat16, device="cuda")
        lse = torch.full((batch, hq, sq), math.nan, device="cuda")
        kernel(*fp8s, out, lse, *kv_head_descales(descales, batch, hkv), scale)
        torch.cuda.synchronize()
        what = f"{spec.name} {(batch, sq, sk, hq, hkv)}"
        attends = torch.isfinite(lse).transpose(1, 2)[..., None].expand_as(out)  # (batch, sq, hq, d)
        assert not torch.isnan(out).any(), what
        err = (out.float()[attends] - 1.0).abs().max().item() if attends.any() else 0.0
        assert err <= 2.0**-8, f"{what}: |O - 1| = {err:.4g} with V = 1"
        assert torch.all(out.float()[~attends] == 0), what


@pytest.mark.parametrize("spec", SUM_MMA, ids=lambda s: s.name)
def test_sum_mma_matches_its_twin(gen, spec):
    """A _smma variant against its twin without the flag (same quantized inputs): the same P and O,
    row sums of the rounded instead of the unrounded P, so outputs within 2^-4 (relative L2) and
    lses within log(1 + 2^-4)."""
    for what, (out, lse), (out_twin, lse_twin) in _twin_runs(gen, spec, spec.replace(row_sum=RowSum.FADD)):
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), what
        diff = ref.rel_l2(out.float(), out_twin.float())
        assert diff <= 2.0**-4, f"{what}: rel L2 {diff:.4g}"
        finite = torch.isfinite(lse_twin)
        assert torch.equal(torch.isfinite(lse), finite), what
        lse_err = (lse[finite] - lse_twin[finite]).abs().max().item() if finite.any() else 0.0
        assert lse_err <= math.log1p(2.0**-4), f"{what}: lse off by {lse_err:.4g}"


# OAccum.TWO_LEVEL (_tlacc): O accumulated in two levels, committed on hd128's tuned tile.
TWO_LEVEL = [s for s in FP8_VARIANTS if s.options.o_accum is OAccum.TWO_LEVEL]


def test_two_level_variants_are_tested():
    assert {s.causal for s in TWO_LEVEL} == {False, True}
    assert all(s.replace(o_accum=OAccum.ONE_LEVEL) in FP8_VARIANTS for s in TWO_LEVEL)


@pytest.mark.parametrize("spec", TWO_LEVEL, ids=lambda s: s.name)
def test_two_level_on_long_rows_with_a_mean(gen, spec):
    """V's columns carry a mean (v = 1 + unit noise), so O is about 1 and every key adds to it: the
    tensor cores' accumulation alone would lose a share of O that grows with the number of keys
    (about 6% at 4k keys, 25% at 16k; docs/log/perf-notes.md). With O promoted to fp32 every
    fp8_two_level.PROMOTE_BLOCKS key blocks the output is within the e4m3 emulation's error (check_out) of the
    float32 attention of the unquantized inputs, at 4k and 16k keys."""

    kernel = fp8_kernel(spec)
    scale = ref.default_scale(spec.head_dim)
    for batch, sq, sk, hq, hkv in ((1, 4097, 4097, 2, 1), (1, 2048, 16384, 2, 2)):
        q, k, v = make_inputs(gen, batch, sq, sk, hq, hkv, spec.head_dim)
        v = v + 1.0
        fp8s, descales = quantize(q, k, v)
        out = torch.full((batch, sq, hq, spec.head_dim), math.nan, dtype=torch.bfloat16, device="cuda")
        lse = torch.full((batch, hq, sq), math.nan, device="cuda")
        kernel(*fp8s, out, lse, *kv_head_descales(descales, batch, hkv), scale)
        exact, _ = ref.attention_ref(q, k, v, causal=spec.causal)
        emul, _ = emulate(fp8s, descales, causal=spec.causal, scale=scale)
        check_out(out, lse, exact, emul, what=f"{spec.name} {(batch, sq, sk, hq, hkv)} v mean 1")


# v_mean (_vmean): the kernel adds v's column means in its epilogue, for centered v.
V_MEAN = [s for s in FP8_VARIANTS if s.options.v_mean]


def test_v_mean_variants_are_tested():
    assert {(s.head_dim, s.causal) for s in V_MEAN} == {(128, False), (128, True), (256, False), (256, True)}
    assert all(s.replace(v_mean=False) in FP8_VARIANTS for s in V_MEAN)


@pytest.mark.parametrize("spec", V_MEAN, ids=lambda s: s.name)
def test_v_mean_variant_adds_the_means(gen, spec):
    """Given column means (batch, heads_kv, head_dim), a v_mean kernel's output is its twin's plus
    each kv head's means on the rows that attend a key: within the bf16 rounding of the twin's
    output, which is rounded before the means are added; rows that attend no key (causal, more
    queries than keys) stay exactly 0 with lse -inf; the lse is the twin's."""
    from cutefa.dispatch import current_target
    from cutefa.loader import get_kernel

    kernel, twin = get_kernel(spec, current_target()), fp8_kernel(spec.replace(v_mean=False))
    scale = ref.default_scale(spec.head_dim)
    for batch, sq, sk, hq, hkv in ((2, 17, 1000, 4, 2), (1, 1000, 17, 8, 1), (1, 4097, 4097, 2, 1)):
        what = f"{spec.name} {(batch, sq, sk, hq, hkv)}"
        q, k, v = make_inputs(gen, batch, sq, sk, hq, hkv, spec.head_dim)
        fp8s, descales = quantize(q, k, v)
        descales = kv_head_descales(descales, batch, hkv)
        means = 3.0 * torch.randn(batch, hkv, spec.head_dim, generator=gen, device="cuda")
        outs, lses = [], []
        for run, extra in ((kernel, (means,)), (twin, ())):
            out = torch.full((batch, sq, hq, spec.head_dim), math.nan, dtype=torch.bfloat16, device="cuda")
            lse = torch.full((batch, hq, sq), math.nan, device="cuda")
            run(*fp8s, out, lse, *descales, *extra, scale)
            outs.append(out)
            lses.append(lse)
        assert not torch.isnan(outs[0]).any() and not torch.isnan(lses[0]).any(), what
        expect = fp8.add_v_mean(outs[1].float(), means, sk, spec.causal)
        bound = 2.0**-8 * (outs[1].float().abs() + expect.abs()) + 1e-6
        worst = ((outs[0].float() - expect).abs() - bound).max().item()
        assert worst <= 0, f"{what}: off by {worst:.3g} beyond the bf16 rounding"
        torch.testing.assert_close(lses[0], lses[1], atol=1e-6, rtol=0, msg=what)
        if spec.causal and sq > sk:
            rows = sq - sk
            assert torch.all(outs[0][:, :rows] == 0) and torch.all(torch.isneginf(lses[0][:, :, :rows])), what
