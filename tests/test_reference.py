"""CPU checks of the reference attention that the GPU tests trust (tests/gpu/reference.py)."""

from __future__ import annotations

import importlib.util
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


def naive(q, k, v, *, causal, scale=None):
    """Textbook attention in float64 with Python loops over (batch, head, query row)."""
    q, k, v = q.double(), k.double(), v.double()
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(batch, sq, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((batch, hq, sq), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(hq):
            hk = h * hkv // hq
            for i in range(sq):
                keys = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not keys:
                    continue
                s = torch.stack([(q[b, i, h] * k[b, j, hk]).sum() * scale for j in keys])
                m = s.max()
                p = torch.exp(s - m)
                out[b, i, h] = (p[:, None] * v[b, keys, hk]).sum(0) / p.sum()
                lse[b, h, i] = m + torch.log(p.sum())
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
