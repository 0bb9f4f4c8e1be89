"""CPU checks of the reference attention that the GPU tests trust (tests/gpu/reference.py)."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch


def _load_reference():
    name = "cutefa_tests_reference"
    if name not in sys.modules:
        path = Path(__file__).parent / "gpu" / "reference.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


ref = _load_reference()


def naive(q, k, v, *, causal, scale=None, window=(-1, -1), softcap=0.0, slopes=None, sinks=None):
    """Textbook attention in float64 with Python loops over (batch, head, query row), written from
    the definitions (window band, softcap, ALiBi bias, sink logit) independently of the reference."""
    q, k, v = q.double(), k.double(), v.double()
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    left, right = window
    out = torch.zeros(batch, sq, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((batch, hq, sq), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(hq):
            hk = h * hkv // hq
            sink = None if sinks is None else float(sinks[h])
            for i in range(sq):
                diag = i + sk - sq
                keys = [
                    j
                    for j in range(sk)
                    if (not causal or j <= diag)
                    and (left is None or left < 0 or j >= diag - left)
                    and (right is None or right < 0 or j <= diag + right)
                ]
                logits = []
                for j in keys:
                    s = float((q[b, i, h] * k[b, j, hk]).sum()) * scale
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        slope = slopes[h] if slopes.dim() == 1 else slopes[b, h]
                        s -= float(slope) * abs(diag - j)
                    logits.append(s)
                every = logits + ([sink] if sink is not None else [])
                if not every or max(every) == -math.inf:
                    continue
                m = max(every)
                total = sum(math.exp(x - m) for x in every)
                lse[b, h, i] = m + math.log(total)
                for j, s in zip(keys, logits):
                    out[b, i, h] += math.exp(s - lse[b, h, i].item()) * v[b, j, hk]
    return out, lse


def inputs(batch, sq, sk, hq, hkv, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, generator=g, dtype=dtype)
    k = torch.randn(batch, sk, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(batch, sk, hkv, d, generator=g, dtype=dtype)
    return q, k, v


def assert_lse_equal(lse, expect, atol):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expect))
    finite = torch.isfinite(expect)
    assert torch.isfinite(lse[finite]).all()
    assert (lse[finite] - expect[finite]).abs().max().item() <= atol if finite.any() else True


CASES = [
    # batch, sq, sk, hq, hkv, d
    (1, 1, 1, 1, 1, 8),
    (2, 5, 5, 2, 2, 8),
    (1, 3, 7, 2, 1, 16),  # sq < sk: bottom-right diagonal starts at column 4
    (1, 7, 3, 4, 2, 8),  # sq > sk: first 4 rows are empty when causal
    (2, 9, 4, 3, 3, 4),
    (1, 1, 6, 4, 1, 8),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_sq{}_sk{}_hq{}_hkv{}_d{}".format(*c))
def test_reference_matches_naive(case, causal):
    batch, sq, sk, hq, hkv, d = case
    q, k, v = inputs(batch, sq, sk, hq, hkv, d, seed=sum(case) + causal)
    out_n, lse_n = naive(q, k, v, causal=causal)
    out64, lse64 = ref.attention_ref(q, k, v, causal=causal, compute_dtype=torch.float64)
    torch.testing.assert_close(out64, out_n, rtol=1e-12, atol=1e-12)
    assert_lse_equal(lse64, lse_n, 1e-12)
    out32, lse32 = ref.attention_ref(q.float(), k.float(), v.float(), causal=causal)
    assert out32.dtype == torch.float32 and lse32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out_n, rtol=1e-5, atol=1e-5)
    assert_lse_equal(lse32.double(), lse_n, 1e-5)


def test_causal_is_bottom_right():
    """Hand-built case: every key but the last is zero, so each row's output tells what it saw."""
    sq, sk, d = 3, 5, 4
    q = torch.ones(1, sq, 1, d, dtype=torch.float64)
    k = torch.zeros(1, sk, 1, d, dtype=torch.float64)
    v = torch.arange(sk, dtype=torch.float64)[None, :, None, None].expand(1, sk, 1, d).contiguous()
    out, lse = ref.attention_ref(q, k, v, causal=True, compute_dtype=torch.float64)
    # row i sees keys 0 .. i + 2 (uniform weights since every score is 0)
    expect = torch.tensor([sum(range(i + 3)) / (i + 3) for i in range(sq)], dtype=torch.float64)
    torch.testing.assert_close(out[0, :, 0, 0], expect)
    torch.testing.assert_close(lse[0, 0], torch.log(torch.tensor([3.0, 4.0, 5.0], dtype=torch.float64)))


def test_empty_rows_are_zero_and_neg_inf():
    q, k, v = inputs(2, 6, 2, 2, 1, 8, seed=3)
    out, lse = ref.attention_ref(q, k, v, causal=True, compute_dtype=torch.float64)
    n_empty = ref.empty_rows(6, 2, True)
    assert n_empty == 4
    assert torch.equal(out[:, :n_empty], torch.zeros_like(out[:, :n_empty]))
    assert torch.isneginf(lse[:, :, :n_empty]).all()
    assert torch.isfinite(lse[:, :, n_empty:]).all()
    assert torch.isfinite(out).all()
    assert ref.empty_rows(6, 2, False) == 0
    assert ref.empty_rows(2, 6, True) == 0
    assert ref.empty_rows(3, 0, False) == 3


def test_block_boundaries_do_not_change_result():
    q, k, v = inputs(2, 37, 23, 4, 2, 8, seed=5)
    for causal in (False, True):
        whole, lse_whole = ref.attention_ref(q, k, v, causal=causal, compute_dtype=torch.float64)
        tiny, lse_tiny = ref.attention_ref(
            q, k, v, causal=causal, compute_dtype=torch.float64, max_elements=23 * 5
        )
        # a matmul over fewer rows may round differently in the last bit: compare, not equal
        torch.testing.assert_close(tiny, whole, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(lse_tiny, lse_whole, rtol=1e-13, atol=1e-13)


def test_blocks_cover_every_row_once():
    q, k, _ = inputs(2, 10, 7, 4, 2, 4)
    seen = torch.zeros(2, 10, 4, dtype=torch.int64)
    for blk in ref.blocks(q, k, max_elements=7 * 3):
        assert blk.head_kv == blk.head_q // 2
        assert blk.row1 - blk.row0 <= 3
        seen[blk.batch, blk.row0 : blk.row1, blk.head_q] += 1
    assert (seen == 1).all()
    with pytest.raises(ValueError, match="multiple"):
        list(ref.blocks(q, k[:, :, :1].expand(2, 7, 3, 4)))


def test_softmax_scale_is_used():
    q, k, v = inputs(1, 4, 6, 2, 2, 8, seed=7)
    out_n, lse_n = naive(q, k, v, causal=False, scale=0.3)
    out, lse = ref.attention_ref(q, k, v, softmax_scale=0.3, compute_dtype=torch.float64)
    torch.testing.assert_close(out, out_n)
    torch.testing.assert_close(lse, lse_n)
    out_default, _ = ref.attention_ref(q, k, v, compute_dtype=torch.float64)
    assert not torch.allclose(out, out_default)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sq,sk", [(5, 5), (3, 8), (8, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_baseline_matches_reference(dtype, sq, sk, causal):
    q, k, v = (t.to(dtype) for t in inputs(2, sq, sk, 4, 2, 16, seed=sq * 10 + sk))
    base = ref.sdpa_baseline(q, k, v, causal=causal)
    expect, _ = ref.attention_ref(q, k, v, causal=causal, compute_dtype=torch.float64)
    assert base.dtype == dtype and base.shape == expect.shape
    assert torch.isfinite(base).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ref.rel_l2(base, expect) <= tol


def test_sdpa_is_causal_is_top_left_so_the_baseline_builds_its_own_mask():
    """Documents why sdpa_baseline passes an explicit mask instead of is_causal."""
    q, k, v = inputs(1, 3, 8, 1, 1, 8, seed=11, dtype=torch.float32)
    top_left = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    bottom_right, _ = ref.attention_ref(q, k, v, causal=True)
    assert ref.rel_l2(ref.sdpa_baseline(q, k, v, causal=True), bottom_right) < 1e-5
    assert ref.rel_l2(top_left, bottom_right) > 1e-2


def test_error_metrics():
    x = torch.tensor([3.0, 4.0])
    assert ref.rel_l2(x, x) == 0.0
    assert ref.rel_l2(torch.zeros(2), x) == pytest.approx(1.0)
    assert ref.rel_l2(torch.zeros(2), torch.zeros(2)) == 0.0
    assert ref.rel_l2(torch.ones(2), torch.zeros(2)) == math.inf
    assert math.isnan(ref.rel_l2(torch.tensor([math.nan, 4.0]), x))
    assert ref.max_abs(torch.tensor([3.5, 4.0]), x) == pytest.approx(0.5)
    assert math.isnan(ref.max_abs(torch.tensor([math.nan, 4.0]), x))
    assert ref.rounding_error(torch.tensor([1.0 + 2**-12]), torch.bfloat16) == pytest.approx(2**-12)


# --- windows, softcap, ALiBi, sinks ------------------------------------------------------------

FEATURE_CASES = [
    # batch, sq, sk, hq, hkv, d
    (2, 6, 6, 2, 1, 8),
    (1, 4, 9, 2, 2, 8),  # sq < sk
    (1, 9, 4, 4, 2, 8),  # sq > sk: leading rows fall outside narrow windows
]
WINDOWS = [(-1, -1), (0, 0), (2, 1), (-1, 0), (0, -1), (3, -1), (1, 100), (100, 100), (None, 2)]


def seeded(shape, seed, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def features(case, seed, *, per_batch_slopes=False):
    """Non-trivial softcap-able scores, ALiBi slopes and sinks for ``case``."""
    batch, _, _, hq, _, _ = case
    slopes = seeded((batch, hq) if per_batch_slopes else (hq,), seed).abs() * 0.5
    sinks = seeded((hq,), seed + 1)
    return slopes, sinks


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: "b{}_sq{}_sk{}_hq{}_hkv{}_d{}".format(*c))
def test_window_matches_naive(case, window, causal):
    q, k, v = inputs(*case, seed=sum(case))
    out_n, lse_n = naive(q, k, v, causal=causal, window=window)
    out, lse = ref.attention_ref(q, k, v, causal=causal, window_size=window, compute_dtype=torch.float64)
    torch.testing.assert_close(out, out_n, rtol=1e-12, atol=1e-12)
    assert_lse_equal(lse, lse_n, 1e-12)
    # the empty rows are exactly the leading ones empty_rows counts
    n_empty = ref.empty_rows(case[1], case[2], causal, window)
    empty = torch.isneginf(lse_n)
    assert empty[:, :, :n_empty].all() and not empty[:, :, n_empty:].any()
    assert torch.equal(out[:, :n_empty], torch.zeros_like(out[:, :n_empty]))


@pytest.mark.parametrize("per_batch_slopes", [False, True], ids=["slopes_h", "slopes_bh"])
@pytest.mark.parametrize(
    "window,causal", [((-1, -1), False), ((-1, -1), True), ((2, 1), False), ((1, 3), True)]
)
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: "b{}_sq{}_sk{}_hq{}_hkv{}_d{}".format(*c))
def test_score_modifiers_match_naive(case, window, causal, per_batch_slopes):
    """softcap, ALiBi and sinks together (and each alone) against the loops of :func:`naive`."""
    q, k, v = inputs(*case, seed=sum(case) + 1)
    q = 3 * q  # scores of several units, so that a softcap of 2 bends them
    slopes, sinks = features(case, 7, per_batch_slopes=per_batch_slopes)
    for softcap, use_slopes, use_sinks in (
        (2.0, True, True),
        (2.0, False, False),
        (0.0, True, False),
        (0.0, False, True),
    ):
        sl = slopes if use_slopes else None
        sn = sinks if use_sinks else None
        out_n, lse_n = naive(
            q, k, v, causal=causal, window=window, softcap=softcap, slopes=sl, sinks=sn, scale=0.4
        )
        out, lse = ref.attention_ref(
            q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=sl, sinks=sn,
            softmax_scale=0.4, compute_dtype=torch.float64,
        )  # fmt: skip
        where = f"softcap={softcap} alibi={use_slopes} sinks={use_sinks}"
        torch.testing.assert_close(out, out_n, rtol=1e-12, atol=1e-12, msg=where)
        assert_lse_equal(lse, lse_n, 1e-12)


def test_neutral_settings_change_nothing():
    """Window (-1, -1) is no window, (-1, 0) is causal (and causal caps any right side at 0), a -inf
    sink is no sink, a huge softcap is no softcap, zero ALiBi slopes are no ALiBi."""
    q, k, v = inputs(2, 7, 11, 4, 2, 8, seed=21)
    run = functools.partial(ref.attention_ref, q, k, v, compute_dtype=torch.float64)
    for causal in (False, True):
        plain, plain_lse = run(causal=causal)
        variants = {
            "window (-1, -1)": run(causal=causal, window_size=(-1, -1)),
            "window (None, None)": run(causal=causal, window_size=(None, None)),
            "sink -inf": run(causal=causal, sinks=torch.full((4,), -math.inf, dtype=torch.float64)),
            "softcap 1e7": run(causal=causal, softcap=1e7),
            "alibi 0 (h)": run(causal=causal, alibi_slopes=torch.zeros(4, dtype=torch.float64)),
            "alibi 0 (b, h)": run(causal=causal, alibi_slopes=torch.zeros(2, 4, dtype=torch.float64)),
        }
        for name, (out, lse) in variants.items():
            torch.testing.assert_close(out, plain, rtol=1e-10, atol=1e-10, msg=f"{name} causal={causal}")
            torch.testing.assert_close(lse, plain_lse, rtol=1e-10, atol=1e-10, msg=f"{name} causal={causal}")
    causal = run(causal=True)
    for same in (
        run(window_size=(-1, 0)),
        run(causal=True, window_size=(-1, 5)),
        run(causal=True, window_size=(50, -1)),
    ):
        torch.testing.assert_close(same[0], causal[0], rtol=0, atol=0)
        torch.testing.assert_close(same[1], causal[1], rtol=0, atol=0)


def test_sink_joins_the_denominator():
    """lse with a sink is logaddexp(lse without it, sink); the output shrinks by exp(lse0 - lse)."""
    q, k, v = inputs(1, 5, 8, 3, 3, 8, seed=13)
    sinks = torch.tensor([0.5, -1.0, 3.0], dtype=torch.float64)
    out0, lse0 = ref.attention_ref(q, k, v, causal=True, compute_dtype=torch.float64)
    out, lse = ref.attention_ref(q, k, v, causal=True, sinks=sinks, compute_dtype=torch.float64)
    torch.testing.assert_close(lse, torch.logaddexp(lse0, sinks[None, :, None]))
    shrink = torch.exp(lse0 - lse).transpose(1, 2)[..., None]  # (batch, sq, hq, 1)
    torch.testing.assert_close(out, out0 * shrink)


def test_rows_without_keys_with_and_without_sinks():
    """Rows outside the window (and every row when seqlen_k is 0): out 0; lse -inf, or the sink."""
    q, k, v = inputs(1, 9, 3, 2, 1, 8, seed=17)
    sinks = torch.tensor([0.25, -2.0], dtype=torch.float64)
    for keys in (3, 0):
        kk, vv = k[:, :keys], v[:, :keys]
        n_empty = ref.empty_rows(9, keys, False, (4, 0))
        assert n_empty == (6 if keys else 9)
        out, lse = ref.attention_ref(q, kk, vv, window_size=(4, 0), compute_dtype=torch.float64)
        assert torch.equal(out[:, :n_empty], torch.zeros_like(out[:, :n_empty]))
        assert torch.isneginf(lse[:, :, :n_empty]).all() and torch.isfinite(lse[:, :, n_empty:]).all()
        out_s, lse_s = ref.attention_ref(
            q, kk, vv, window_size=(4, 0), sinks=sinks, compute_dtype=torch.float64
        )
        assert torch.equal(out_s[:, :n_empty], torch.zeros_like(out_s[:, :n_empty]))
        assert torch.equal(lse_s[0, :, :n_empty], sinks[:, None].expand(2, n_empty))
        assert torch.isfinite(out_s).all() and torch.isfinite(lse_s).all()


def test_alibi_slopes_per_head_equal_the_same_slopes_per_batch():
    q, k, v = inputs(3, 6, 10, 4, 2, 8, seed=19)
    slopes = torch.tensor([0.5, 0.25, 0.125, 1.0], dtype=torch.float64)
    a = ref.attention_ref(q, k, v, alibi_slopes=slopes, compute_dtype=torch.float64)
    b = ref.attention_ref(q, k, v, alibi_slopes=slopes.expand(3, 4), compute_dtype=torch.float64)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="alibi_slopes"):
        ref.attention_ref(q, k, v, alibi_slopes=slopes[:3])


def test_alibi_is_a_distance_bias_from_the_bottom_right_diagonal():
    """Zero scores (q = 0): the probabilities of a row are softmax(-slope * |i + sk - sq - j|)."""
    sq, sk, d = 3, 6, 4
    q = torch.zeros(1, sq, 1, d, dtype=torch.float64)
    k = torch.randn(1, sk, 1, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    v = torch.eye(sk, dtype=torch.float64)[None, :, None, :]  # out row = the probabilities
    out, _ = ref.attention_ref(
        q, k, v, alibi_slopes=torch.tensor([0.7], dtype=torch.float64), compute_dtype=torch.float64
    )
    for i in range(sq):
        dist = torch.tensor([abs(i + sk - sq - j) for j in range(sk)], dtype=torch.float64)
        torch.testing.assert_close(out[0, i, 0], torch.softmax(-0.7 * dist, 0))


def test_softcap_bends_the_scores():
    """q.k scaled to +-20 with softcap 5: the logits are 5 * tanh(s / 5), within +-5."""
    q, k, v = inputs(1, 4, 6, 1, 1, 8, seed=23)
    out, lse = ref.attention_ref(q * 10, k, v, softcap=5.0, compute_dtype=torch.float64)
    out_n, lse_n = naive(q * 10, k, v, causal=False, softcap=5.0)
    torch.testing.assert_close(out, out_n)
    torch.testing.assert_close(lse, lse_n)
    assert (lse <= 5.0 + math.log(6) + 1e-12).all()
    uncapped, _ = ref.attention_ref(q * 10, k, v, compute_dtype=torch.float64)
    assert not torch.allclose(out, uncapped, atol=1e-3)


def test_large_max_elements_and_tiny_blocks_agree():
    """Blocks of a few rows of a few heads (heads chunked too) give the whole-matrix result."""
    q, k, v = inputs(2, 13, 7, 6, 3, 8, seed=29)
    slopes, sinks = torch.rand(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    kwargs = {"causal": True, "window_size": (3, 2), "softcap": 2.0, "alibi_slopes": slopes, "sinks": sinks}
    whole = ref.attention_ref(q, k, v, compute_dtype=torch.float64, **kwargs)
    for max_elements in (1, 7 * 2, 7 * 6 * 2):
        tiny = ref.attention_ref(q, k, v, compute_dtype=torch.float64, max_elements=max_elements, **kwargs)
        torch.testing.assert_close(tiny, whole, rtol=1e-13, atol=1e-13)


def _finite_lse(fn):
    """fn's (out, lse) with the -inf of rows without keys as 0 (finite differences need finite)."""

    def wrapped(*args):
        out, lse = fn(*args)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    return wrapped


@pytest.mark.parametrize(
    "causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (1, 0)), (True, (2, 3))]
)
def test_gradients_match_finite_differences(causal, window):
    """q, k, v and sinks gradients (through out and lse) of the float64 reference, with softcap,
    ALiBi and rows that attend no key (sq > sk), checked by torch.autograd.gradcheck."""
    q, k, v = inputs(1, 5, 3, 2, 1, 4, seed=31)
    sinks = torch.tensor([0.3, -0.6], dtype=torch.float64)
    slopes = torch.tensor([0.4, 0.1], dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]

    def fn(a, b, c, s):
        return ref.attention_ref(
            a, b, c, causal=causal, window_size=window, softcap=1.5, alibi_slopes=slopes, sinks=s,
            compute_dtype=torch.float64,
        )  # fmt: skip

    assert torch.autograd.gradcheck(_finite_lse(fn), leaves)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(_finite_lse(lambda a, b, c: fn(a, b, c, None)), leaves)


def test_rows_without_keys_give_zero_gradients_not_nan():
    q, k, v = inputs(1, 8, 3, 2, 2, 8, seed=37)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    sinks = torch.tensor([0.5, 1.0], requires_grad=True)
    out_sink, lse_sink = ref.attention_ref(q, k, v, causal=True, sinks=sinks)
    out, lse = ref.attention_ref(q, k, v, causal=True)
    n_empty = ref.empty_rows(8, 3, True)
    loss = out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum() + lse_sink.sum() + 0 * out_sink.sum()
    loss.backward()
    for t in (q, k, v, sinks):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :n_empty], torch.zeros_like(q.grad[:, :n_empty]))
    # an empty row's lse is the sink itself: each adds exactly 1 to the sink's gradient, every
    # other row exp(sink - lse) > 0
    assert (sinks.grad >= n_empty).all()


def test_dsinks_is_minus_the_sink_probability_times_the_output_gradient_term():
    """d lse / d sink = exp(sink - lse); d out / d sink = -out * exp(sink - lse)."""
    q, k, v = inputs(1, 4, 6, 2, 2, 8, seed=41)
    sinks = torch.tensor([0.2, -0.4], dtype=torch.float64, requires_grad=True)
    out, lse = ref.attention_ref(q, k, v, sinks=sinks, compute_dtype=torch.float64)
    p_sink = torch.exp(sinks.detach()[None, :, None] - lse.detach())  # (batch, hq, sq)
    (grad_lse,) = torch.autograd.grad(lse.sum(), sinks, retain_graph=True)
    torch.testing.assert_close(grad_lse, p_sink.sum((0, 2)))
    (grad_out,) = torch.autograd.grad(out.sum(), sinks)
    expect = -(out.detach().sum(-1) * p_sink.transpose(1, 2)).sum((0, 1))
    torch.testing.assert_close(grad_out, expect)


# --- the packed (variable-length) reference ---------------------------------------------------


def packed(lengths, hq, hkv, d, seed=0, slack=None):
    """q, k, v packed from per-sequence (sq, sk) ``lengths`` with ``slack`` (extra_q, extra_k)
    unused rows after each sequence, and cu_seqlens / seqused (int32) describing them."""
    slack = slack or [(0, 0)] * len(lengths)
    spans_q = [sq + eq for (sq, _), (eq, _) in zip(lengths, slack)]
    spans_k = [sk + ek for (_, sk), (_, ek) in zip(lengths, slack)]
    cu_q = torch.tensor([0, *itertools.accumulate(spans_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(spans_k)], dtype=torch.int32)
    used_q = torch.tensor([sq for sq, _ in lengths], dtype=torch.int32)
    used_k = torch.tensor([sk for _, sk in lengths], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(int(cu_k[-1]), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(int(cu_k[-1]), hkv, d, generator=g, dtype=torch.float64)
    return q, k, v, cu_q, cu_k, used_q, used_k


VARLEN_LENGTHS = [(1, 1), (5, 5), (0, 0), (3, 7), (6, 2), (4, 0), (0, 3)]


@pytest.mark.parametrize("modifiers", ["plain", "window", "all"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_ref_is_attention_ref_per_sequence(causal, modifiers):
    """Each used span of the packed reference is the dense reference of that sequence alone (its
    own bottom-right alignment); rows outside every used span are 0 / -inf."""
    slack = [(1, 2), (0, 0), (2, 0), (0, 1), (3, 3), (0, 0), (1, 1)]
    q, k, v, cu_q, cu_k, used_q, used_k = packed(VARLEN_LENGTHS, 4, 2, 8, seed=43, slack=slack)
    batch = len(VARLEN_LENGTHS)
    kwargs = {"window": {"window_size": (2, 1)}, "plain": {}}.get(modifiers)
    if kwargs is None:
        kwargs = {
            "window_size": (3, 0), "softcap": 1.5, "alibi_slopes": torch.rand(batch, 4, dtype=torch.float64),
            "sinks": torch.randn(4, dtype=torch.float64),
        }  # fmt: skip
    out, lse = ref.varlen_ref(
        q,
        k,
        v,
        cu_q,
        cu_k,
        seqused_q=used_q,
        seqused_k=used_k,
        causal=causal,
        compute_dtype=torch.float64,
        **kwargs,
    )
    assert out.shape == (q.shape[0], 4, 8) and lse.shape == (4, q.shape[0])
    used = ref.used_rows(cu_q, used_q, q.shape[0])
    assert int(used.sum()) == sum(sq for sq, _ in VARLEN_LENGTHS)
    assert torch.equal(out[~used], torch.zeros_like(out[~used])) and torch.isneginf(lse[:, ~used]).all()
    for b, ((q0, sq), (k0, sk)) in enumerate(zip(ref.sequences(cu_q, used_q), ref.sequences(cu_k, used_k))):
        one = dict(kwargs)
        if "alibi_slopes" in one:
            one["alibi_slopes"] = one["alibi_slopes"][b]
        o, l = ref.attention_ref(
            q[None, q0 : q0 + sq], k[None, k0 : k0 + sk], v[None, k0 : k0 + sk], causal=causal,
            compute_dtype=torch.float64, **one,
        )  # fmt: skip
        torch.testing.assert_close(out[q0 : q0 + sq], o[0], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, q0 : q0 + sq], l[0], rtol=0, atol=0)


def test_varlen_ref_of_equal_lengths_is_the_dense_batch():
    q, k, v = inputs(3, 5, 7, 4, 2, 8, seed=47)
    cu_q = torch.arange(0, 16, 5, dtype=torch.int32)
    cu_k = torch.arange(0, 22, 7, dtype=torch.int32)
    for causal in (False, True):
        dense, dense_lse = ref.attention_ref(q, k, v, causal=causal, compute_dtype=torch.float64)
        out, lse = ref.varlen_ref(
            q.flatten(0, 1),
            k.flatten(0, 1),
            v.flatten(0, 1),
            cu_q,
            cu_k,
            causal=causal,
            compute_dtype=torch.float64,
        )
        torch.testing.assert_close(out, dense.flatten(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(lse, dense_lse.permute(1, 0, 2).flatten(1), rtol=0, atol=0)


def test_varlen_ref_gradients_flow_to_every_input():
    q, k, v, cu_q, cu_k, used_q, used_k = packed(
        [(3, 4), (0, 2), (2, 0), (4, 4)], 2, 1, 8, seed=53, slack=[(1, 1)] * 4
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sinks = torch.tensor([0.1, 0.2], dtype=torch.float64, requires_grad=True)

    def fn(a, b, c, s):
        out, lse = ref.varlen_ref(
            a, b, c, cu_q, cu_k, seqused_q=used_q, seqused_k=used_k, causal=True, sinks=s,
            compute_dtype=torch.float64,
        )  # fmt: skip
        return out, lse

    assert torch.autograd.gradcheck(_finite_lse(fn), [*leaves, sinks])
    out, lse = _finite_lse(fn)(*leaves, sinks)
    (out.sum() + lse.sum()).backward()
    unused_q = ~ref.used_rows(cu_q, used_q, q.shape[0])
    unused_k = ~ref.used_rows(cu_k, used_k, k.shape[0])
    assert unused_q.any() and unused_k.any()
    assert (leaves[0].grad[unused_q] == 0).all()
    assert (leaves[1].grad[unused_k] == 0).all() and (leaves[2].grad[unused_k] == 0).all()


def test_sequences_and_their_errors():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    assert ref.sequences(cu) == [(0, 3), (3, 0), (3, 4)]
    assert ref.sequences(cu, torch.tensor([2, 0, 4], dtype=torch.int32)) == [(0, 2), (3, 0), (3, 4)]
    assert ref.used_rows(cu, torch.tensor([2, 0, 1], dtype=torch.int32), 8).tolist() == [
        True, True, False, True, False, False, False, False,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="non-decreasing"):
        ref.sequences(torch.tensor([0, 3, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="entries"):
        ref.sequences(cu, torch.tensor([1, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="within"):
        ref.sequences(cu, torch.tensor([4, 0, 1], dtype=torch.int32))
