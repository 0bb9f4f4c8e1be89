"""MLA decode on an sm90 GPU (templates/decode_mla_sm90.py.j2 through cutefa.api.mla) against a
float32 reference on the gathered latent cache.

Covered: 16, 64 and 128 query heads on the one latent head; cache lengths 1, 17, 1000 and 8k with
sequences ending mid-page and cache_seqlens 0; 1, 2 and 4 query tokens, causal (bottom-right) and
not; page sizes 16, 64 and 256; a NaN-poisoned output and a poisoned pool outside the sequences'
keys (no poisoned byte may reach the output); num_splits 1 to 8 giving one answer; the
flash_attn_with_kvcache spelling (v_cache=None); a decode step captured in a CUDA graph.

Error bounds: P is rounded to the input dtype before P V and the output once: relative L2 error
held to 1e-2 (bf16), the lse (float32 throughout) to 1e-3 + 1e-5 |lse|. Rows with no key must be
exactly 0 with lse -inf.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import hopper_skip_reason as _skip_reason

import cutefa
from cutefa.api import mla

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

SCALE = 1 / math.sqrt(192)  # DeepSeek's (q/k head dim 192 before absorption)


def _problem(batch, seqlens, heads_q, seqlen_q=1, page_size=64, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    max_pages = max(1, -(-max(seqlens) // page_size))
    pages = batch * max_pages + 5
    q = torch.randn((batch, seqlen_q, heads_q, 576), generator=g, device="cuda").to(dtype)
    # the pool poisoned: only the sequences' keys are written below
    kv = torch.full((pages, page_size, 1, 576), float("nan"), device="cuda", dtype=dtype)
    perm = torch.randperm(pages, generator=g, device="cuda")[: batch * max_pages]
    table = perm.reshape(batch, max_pages).to(torch.int32)
    for b, n in enumerate(seqlens):
        keys = torch.arange(n, device="cuda")
        kv[table[b, keys // page_size].long(), keys % page_size, 0] = torch.randn(
            (n, 576), generator=g, device="cuda"
        ).to(dtype)
    return q, kv, table, torch.tensor(seqlens, dtype=torch.int32, device="cuda")


def reference(q, kv, table, seqlens, scale, causal):
    batch, seqlen_q, heads_q, _ = q.shape
    page_size = kv.shape[1]
    out = torch.zeros((batch, seqlen_q, heads_q, 512), dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf, device=q.device)
    for b in range(batch):
        n = int(seqlens[b])
        if n == 0:
            continue
        keys = torch.arange(n, device=q.device)
        rows = kv[table[b, keys // page_size].long(), keys % page_size, 0].float()
        s = torch.einsum("thd,nd->htn", q[b].float(), rows) * scale
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
    empty = ~finite  # (b, h, t) rows with no key: out exactly 0
    assert torch.all(out.permute(0, 2, 1, 3)[empty] == 0)


def _run(q, kv, table, seqlens, causal=False, num_splits=0):
    return mla.mla_decode(q, kv, table, seqlens, softmax_scale=SCALE, causal=causal, num_splits=num_splits)


@pytest.mark.parametrize("heads_q", [16, 64, 128])
@pytest.mark.parametrize(
    "seqlens", [[1, 17], [1000, 0], [8192, 4095]], ids=["short", "mid_page_and_empty", "8k"]
)
def test_against_reference(heads_q, seqlens):
    q, kv, table, lens = _problem(len(seqlens), seqlens, heads_q)
    out, lse = _run(q, kv, table, lens)
    _check(out, lse, *reference(q, kv, table, lens, SCALE, False))


@pytest.mark.parametrize("seqlen_q", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_tokens_and_causal(seqlen_q, causal):
    q, kv, table, lens = _problem(3, [3, 130, 777], 64, seqlen_q=seqlen_q)
    out, lse = _run(q, kv, table, lens, causal=causal)
    _check(out, lse, *reference(q, kv, table, lens, SCALE, causal))


@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_page_sizes(page_size):
    q, kv, table, lens = _problem(2, [513, 70], 16, page_size=page_size)
    out, lse = _run(q, kv, table, lens)
    _check(out, lse, *reference(q, kv, table, lens, SCALE, False))


def test_fp16():
    q, kv, table, lens = _problem(2, [300, 64], 32, dtype=torch.float16)
    out, lse = _run(q, kv, table, lens)
    _check(out, lse, *reference(q, kv, table, lens, SCALE, False))


def test_num_splits_agree():
    q, kv, table, lens = _problem(2, [5000, 1234], 128, seqlen_q=2)
    results = [_run(q, kv, table, lens, causal=True, num_splits=n) for n in range(1, 9)]
    ref_out, ref_lse = reference(q, kv, table, lens, SCALE, True)
    for out, lse in results:
        _check(out, lse, ref_out, ref_lse)
        torch.testing.assert_close(out.float(), results[0][0].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, results[0][1], atol=1e-4, rtol=1e-5)


def test_flash_attn_with_kvcache_spelling_and_graph():
    q, kv, table, lens = _problem(4, [100, 2000, 64, 1], 64)
    out, lse = cutefa.flash_attn_with_kvcache(
        q, kv, None, cache_seqlens=lens, page_table=table, softmax_scale=SCALE, return_softmax_lse=True
    )
    _check(out, lse, *reference(q, kv, table, lens, SCALE, False))
    # a decode step captured in a CUDA graph, replayed on new q and lengths
    static_q, static_lens = q.clone(), lens.clone()
    _run(static_q, kv, table, static_lens)  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = _run(static_q, kv, table, static_lens)
    q2, _, _, _ = _problem(4, [100, 2000, 64, 1], 64, seed=7)
    static_q.copy_(q2)
    static_lens.copy_(torch.tensor([99, 1500, 64, 0], dtype=torch.int32, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    _check(g_out, g_lse, *reference(static_q, kv, table, static_lens, SCALE, False))
