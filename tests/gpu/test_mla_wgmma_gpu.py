"""The WGMMA MLA decode variant (templates/decode_mla_wgmma_sm90.py.j2, selected explicitly through
cutefa.api.mla.decode's ``spec``) on an sm90 GPU against a float32 reference on the gathered
latent cache.

Covered: 16, 64 and 128 query heads (one row tile of 64 packed rows, or two), 1 and 2 query tokens
(causal bottom-right and not), page size 64, ragged cache_seqlens including 1, a page edge (63, 64,
65), 0 (out exactly 0, lse -inf) and 8k; num_splits 1 to 8 and the heuristic giving one answer; a
NaN-poisoned pool outside the sequences' keys; fp16. Error bounds as tests/gpu/test_mla_gpu.py: P
is rounded to the input dtype before P V: relative L2 error of out held to 1e-2, lse to
1e-3 + 1e-5 |lse|.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import hopper_skip_reason as _skip_reason

from cutefa.api import mla
from cutefa.model import policy_mla_wgmma

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

SCALE = 1 / math.sqrt(192)  # DeepSeek's (q/k head dim 192 before absorption)
PAGE = 64


def _problem(seqlens, heads_q, seqlen_q=1, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(seqlens)
    max_pages = max(1, -(-max(seqlens) // PAGE))
    pages = batch * max_pages + 3
    q = torch.randn((batch, seqlen_q, heads_q, 576), generator=g, device="cuda").to(dtype)
    kv = torch.full((pages, PAGE, 1, 576), float("nan"), device="cuda", dtype=dtype)  # poisoned pool
    table = torch.randperm(pages, generator=g, device="cuda")[: batch * max_pages].reshape(batch, max_pages)
    table = table.to(torch.int32)
    for b, n in enumerate(seqlens):
        keys = torch.arange(n, device="cuda")
        kv[table[b, keys // PAGE].long(), keys % PAGE, 0] = torch.randn(
            (n, 576), generator=g, device="cuda"
        ).to(dtype)
    return q, kv, table, torch.tensor(seqlens, dtype=torch.int32, device="cuda")


def _reference(q, kv, table, seqlens, causal):
    batch, seqlen_q, heads_q, _ = q.shape
    out = torch.zeros((batch, seqlen_q, heads_q, 512), dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf, device=q.device)
    for b in range(batch):
        n = int(seqlens[b])
        if n == 0:
            continue
        keys = torch.arange(n, device=q.device)
        rows = kv[table[b, keys // PAGE].long(), keys % PAGE, 0].float()
        s = torch.einsum("thd,nd->htn", q[b].float(), rows) * SCALE
        if causal:
            allowed = keys[None, :] <= torch.arange(seqlen_q, device=q.device)[:, None] + n - seqlen_q
            s = s.masked_fill(~allowed[None], -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        out[b] = torch.einsum("htn,nd->thd", p, rows[:, :512])
        lse[b] = row_lse
    return out, lse


def _check(out, lse, ref_out, ref_lse):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    err = (out.float() - ref_out).norm() / ref_out.norm().clamp_min(1e-6)
    assert err < 1e-2, f"relative L2 error {err:.3g}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-5)
    assert torch.all(out.permute(0, 2, 1, 3)[~finite] == 0)  # rows with no key: exactly 0


def _run(q, kv, table, seqlens, causal=False, num_splits=0):
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[q.dtype]
    spec = policy_mla_wgmma.mla_spec(dtype, causal=causal)
    return mla.decode(q, kv, table, seqlens, SCALE, causal, num_splits, spec=spec)


RAGGED = [1, 63, 64, 65, 1000, 0, 8192]


@pytest.mark.parametrize("heads_q", [16, 64, 128])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8, 0])
def test_against_reference(heads_q, num_splits):
    q, kv, table, lens = _problem(RAGGED, heads_q)
    out, lse = _run(q, kv, table, lens, num_splits=num_splits)
    _check(out, lse, *_reference(q, kv, table, lens, False))


@pytest.mark.parametrize("heads_q", [16, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_two_tokens(heads_q, causal):
    q, kv, table, lens = _problem([1, 2, 130, 777], heads_q, seqlen_q=2)
    out, lse = _run(q, kv, table, lens, causal=causal, num_splits=4)
    _check(out, lse, *_reference(q, kv, table, lens, causal))


def test_splits_agree():
    q, kv, table, lens = _problem([5000, 1234, 1], 128)
    results = [_run(q, kv, table, lens, num_splits=n) for n in range(1, 9)]
    ref_out, ref_lse = _reference(q, kv, table, lens, False)
    for out, lse in results:
        _check(out, lse, ref_out, ref_lse)
        torch.testing.assert_close(out.float(), results[0][0].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, results[0][1], atol=1e-4, rtol=1e-5)


def test_fp16():
    q, kv, table, lens = _problem([300, 64, 1], 32, dtype=torch.float16)
    out, lse = _run(q, kv, table, lens, num_splits=2)
    _check(out, lse, *_reference(q, kv, table, lens, False))


def test_matches_default_kernel():
    q, kv, table, lens = _problem([2048, 77], 64)
    out, lse = _run(q, kv, table, lens)
    ref_out, ref_lse = mla.mla_decode(q, kv, table, lens, softmax_scale=SCALE)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-5)
