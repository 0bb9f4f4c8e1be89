"""The decode kernel's fused append (cutefa/kernels/sm80/decode_append.py, launched by
templates/decode_sm80.py.j2 before the attention) and cache_leftpad, on a CUDA GPU.

The append is checked against the torch reference (cutefa.api.kvcache_reference) into a
NaN-poisoned cache: the new slots hold what the reference writes (v and the unrotated columns
bit for bit, the rotated columns within one rounding of the dtype: the kernel may fuse a
multiply-add the reference rounds twice), and every other byte of the cache is unchanged. Every
page size 16..256 with appends crossing a page, cache_seqlens 0 and 1, both rotary layouts with
rotary_dim below head_dim, cache_batch_idx permutations, cache_leftpad (keys and rotary positions
start at the pad), num_splits 1..16 agreeing, and a CUDA-graph replay of a left-padded step.
"""

from __future__ import annotations

import os

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm80_skip_reason as _skip_reason

from cutefa import dispatch
from cutefa.api import kvcache, kvcache_reference
from cutefa.compile import compile_variants
from cutefa.model import policy_decode
from cutefa.model.options import Mask

ref = _load("reference")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

with_kvcache = kvcache.flash_attn_with_kvcache
REL_L2 = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
USED = [  # (dtype, head_dim, packed rows, mask, paged): the variants the tests below run
    ("bf16", 128, 20, Mask.CAUSAL, True),
    ("bf16", 128, 128, Mask.CAUSAL, True),
    ("bf16", 128, 4, Mask.NONE, False),
    ("bf16", 128, 16, Mask.CAUSAL, False),
    ("fp16", 64, 12, Mask.CAUSAL, False),
    ("fp16", 64, 12, Mask.NONE, False),
]


@pytest.fixture(scope="module", autouse=True)
def _compiled_up_front():
    target = dispatch.current_target()
    specs = list(dict.fromkeys(
        policy_decode.decode_spec(dt, hd, rows, mask=mask, paged=paged) for dt, hd, rows, mask, paged in USED
    ))  # fmt: skip
    results = compile_variants(specs, target=target, jobs=min(16, os.cpu_count() or 1), progress=False)
    failed = [f"{r.spec.name}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)


def randn(gen, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def rotary_tables(gen, rows, rotary_dim, dtype):
    angles = torch.rand(rows, rotary_dim // 2, generator=gen, device="cuda") * 6.3
    return angles.cos().to(dtype), angles.sin().to(dtype)


def assert_same_cache(got, want, rotated_cols):
    """Bit for bit outside the rotated columns of the keys; those within one rounding."""
    assert torch.equal(got[..., rotated_cols:].view(torch.int16), want[..., rotated_cols:].view(torch.int16))
    a, b = got[..., :rotated_cols].float(), want[..., :rotated_cols].float()
    assert torch.equal(a.isnan(), b.isnan()), "a NaN moved"
    ulp = torch.finfo(got.dtype).eps
    ok = a.isnan() | ((a - b).abs() <= ulp * b.abs().clamp_min(1.0))
    assert ok.all(), f"rotated keys off by {(a - b).abs().nan_to_num().max().item():.3e}"


def assert_matches(out, lse, want_out, want_lse):
    assert torch.isfinite(out).all(), "NaN or inf in the output"
    err = ref.rel_l2(out, want_out)
    assert err <= REL_L2[out.dtype], f"relative L2 error {err:.2e}"
    full = ~torch.isinf(want_lse)
    diff = (lse[full].double() - want_lse[full].double()).abs()
    assert (diff <= 1e-3 + 1e-5 * want_lse[full].double().abs()).all(), f"lse off by {diff.max().item():.2e}"


def reference(q, keys, values, **kw):
    outs, lses = zip(
        *(ref.attention_ref(q[b : b + 1], keys[b][None], values[b][None], **kw) for b in range(len(keys)))
    )
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_paged_append_matches_the_reference_in_a_poisoned_pool(gen, page_size, interleaved):
    batch, new, hq, hkv, d, rd = 4, 5, 16, 4, 128, 64
    lens = [0, 1, page_size - 2, 3 * page_size - 1]  # the last two appends cross a page
    per_seq = -(-(max(lens) + new) // page_size)
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(page_size)).int()
    table = order.reshape(batch, per_seq).cuda()
    k_pool = torch.full(
        (batch * per_seq + 2, page_size, hkv, d), float("nan"), dtype=torch.bfloat16, device="cuda"
    )
    v_pool = k_pool.clone()
    for b, n in enumerate(lens):  # the existing keys
        j = torch.arange(n, device="cuda")
        rows, slots = table[b, j // page_size].long(), j % page_size
        k_pool[rows, slots], v_pool[rows, slots] = randn(gen, n, hkv, d), randn(gen, n, hkv, d)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    q, k, v = randn(gen, batch, new, hq, d), randn(gen, batch, new, hkv, d), randn(gen, batch, new, hkv, d)
    cos, sin = rotary_tables(gen, max(lens) + new, rd, torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(
        q, k_pool, v_pool, k, v, cos, sin, seqlens, block_table=table, causal=True, rotary_interleaved=interleaved,
        return_softmax_lse=True,
    )  # fmt: skip
    kvcache_reference.append_kv(want_k, want_v, k, v, seqlens, None, table, cos, sin, interleaved)
    assert_same_cache(k_pool, want_k, rd)
    assert_same_cache(v_pool, want_v, 0)
    start = seqlens.long()
    q_rot = kvcache_reference.rotate(
        q, cos, sin, kvcache_reference.query_positions(start, new, True), interleaved
    )
    total = [n + new for n in lens]
    keys = [want_k[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(total)]
    values = [want_v[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(total)]
    assert_matches(out, lse, *reference(q_rot, keys, values, causal=True))


@pytest.mark.parametrize("causal", [True, False])
def test_dense_append_with_batch_idx_and_leftpad(gen, causal):
    """cache_batch_idx a permutation, cache_leftpad per sequence: new tokens at cache_seqlens[b],
    rotated at cache_seqlens[b] - cache_leftpad[b] (+ i), keys from the pad on."""
    batch, new, hq, hkv, d, rd, cap = 4, 3, 8, 2, 64, 32, 200
    k_cache = torch.full((batch, cap, hkv, d), float("nan"), dtype=torch.float16, device="cuda")
    v_cache = k_cache.clone()
    lens, pads = [10, 1, 150, 190], [3, 1, 0, 100]
    idx = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device="cuda")
    for b, (n, p) in enumerate(zip(lens, pads)):
        k_cache[idx[b], p:n], v_cache[idx[b], p:n] = (
            randn(gen, n - p, hkv, d, dtype=torch.float16) for _ in range(2)
        )
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q, k, v = (randn(gen, batch, new, h, d, dtype=torch.float16) for h in (hq, hkv, hkv))
    cos, sin = rotary_tables(gen, cap, rd, torch.float16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    leftpad = torch.tensor(pads, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(
        q, k_cache, v_cache, k, v, cos, sin, seqlens, cache_batch_idx=idx, cache_leftpad=leftpad, causal=causal,
        rotary_interleaved=False, return_lse=True,
    )  # fmt: skip
    kvcache_reference.append_kv(
        want_k, want_v, k, v, seqlens, idx, None, cos, sin, False, cache_leftpad=leftpad
    )
    assert_same_cache(k_cache, want_k, rd)
    assert_same_cache(v_cache, want_v, 0)
    start = kvcache_reference.rotary_start(seqlens, leftpad)
    q_rot = kvcache_reference.rotate(
        q, cos, sin, kvcache_reference.query_positions(start, new, causal), False
    )
    keys = [want_k[idx[b], p : n + new] for b, (n, p) in enumerate(zip(lens, pads))]
    values = [want_v[idx[b], p : n + new] for b, (n, p) in enumerate(zip(lens, pads))]
    assert_matches(out, lse, *reference(q_rot, keys, values, causal=causal))


def test_leftpad_num_splits_one_to_sixteen_agree(gen):
    batch, hq, hkv, d, cap = 3, 32, 8, 128, 4096
    k_cache, v_cache = randn(gen, batch, cap, hkv, d), randn(gen, batch, cap, hkv, d)
    q = randn(gen, batch, 1, hq, d)
    seqlens = torch.tensor([4000, 700, 5], dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([1000, 699, 5], dtype=torch.int32, device="cuda")  # 3000, 1 and 0 keys
    results = [
        with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, cache_leftpad=leftpad, num_splits=s, return_lse=True
        )
        for s in (1, 2, 3, 5, 8, 16)
    ]
    keys = [k_cache[b, p:n] for b, (n, p) in enumerate(zip(seqlens.tolist(), leftpad.tolist()))]
    values = [v_cache[b, p:n] for b, (n, p) in enumerate(zip(seqlens.tolist(), leftpad.tolist()))]
    want = reference(q[:2], keys[:2], values[:2])
    for out, lse in results:
        assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()  # no key: out 0, lse -inf
        assert_matches(out[:2], lse[:2], want[0][:2], want[1][:2])
        torch.testing.assert_close(out, results[0][0], atol=2e-2, rtol=0)


def test_rotary_of_q_without_new_tokens_reaches_the_attention(gen):
    """k and v with 0 tokens: nothing written, q still rotated (flash-attn's rule)."""
    batch, hq, hkv, d, cap = 2, 8, 2, 128, 64
    k_cache, v_cache = randn(gen, batch, cap, hkv, d), randn(gen, batch, cap, hkv, d)
    before = k_cache.clone(), v_cache.clone()
    q = randn(gen, batch, 1, hq, d)
    empty = randn(gen, batch, 0, hkv, d)
    cos, sin = rotary_tables(gen, cap, d, torch.bfloat16)
    seqlens = torch.tensor([30, 64], dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(q, k_cache, v_cache, empty, empty, cos, sin, seqlens, return_lse=True)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    q_rot = kvcache_reference.rotate(q, cos, sin, seqlens.long()[:, None].clamp_max(cap - 1), True)
    keys = [k_cache[b, :n] for b, n in enumerate(seqlens.tolist())]
    values = [v_cache[b, :n] for b, n in enumerate(seqlens.tolist())]
    assert_matches(out, lse, *reference(q_rot, keys, values))


@pytest.mark.parametrize("num_splits", [0, 1, 4])
def test_chunked_prefill_appends_and_attends_a_long_chunk(gen, num_splits):
    """A 300-token chunk (GQA 4: 1200 packed rows, ten 128-row tiles) appended with rotary into a
    paged cache of 16-key pages holding ~5000 keys, causal bottom-right."""
    batch, new, hq, hkv, d, page_size, rd = 2, 300, 16, 4, 128, 16, 128
    lens = [4900, 1234]
    per_seq = -(-(max(lens) + new) // page_size)
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(3)).int()
    table = order.reshape(batch, per_seq).cuda()
    k_pool = randn(gen, batch * per_seq, page_size, hkv, d)
    v_pool = randn(gen, batch * per_seq, page_size, hkv, d)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    q, k, v = randn(gen, batch, new, hq, d), randn(gen, batch, new, hkv, d), randn(gen, batch, new, hkv, d)
    cos, sin = rotary_tables(gen, max(lens) + new, rd, torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(
        q, k_pool, v_pool, k, v, cos, sin, seqlens, page_table=table, causal=True, num_splits=num_splits,
        return_lse=True,
    )  # fmt: skip
    kvcache_reference.append_kv(want_k, want_v, k, v, seqlens, None, table, cos, sin, True)
    assert_same_cache(k_pool, want_k, rd)
    assert_same_cache(v_pool, want_v, 0)
    q_rot = kvcache_reference.rotate(
        q, cos, sin, kvcache_reference.query_positions(seqlens.long(), new, True), True
    )
    total = [n + new for n in lens]
    keys = [want_k[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(total)]
    values = [want_v[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(total)]
    assert_matches(out, lse, *reference(q_rot, keys, values, causal=True))


def test_a_left_padded_step_replays_in_a_cuda_graph(gen):
    batch, hq, hkv, d, cap = 4, 16, 4, 128, 512
    k_cache, v_cache = randn(gen, batch, cap, hkv, d), randn(gen, batch, cap, hkv, d)
    cos, sin = rotary_tables(gen, cap, 64, torch.bfloat16)
    q, k, v = randn(gen, batch, 4, hq, d), randn(gen, batch, 4, hkv, d), randn(gen, batch, 4, hkv, d)
    seqlens = torch.tensor([20, 100, 4, 400], dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([5, 0, 4, 300], dtype=torch.int32, device="cuda")

    def step(kc, vc):
        return with_kvcache(
            q, kc, vc, k, v, cos, sin, seqlens, cache_leftpad=leftpad, causal=True, return_lse=True
        )

    step(k_cache.clone(), v_cache.clone())
    torch.cuda.synchronize()
    kc, vc = k_cache.clone(), v_cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step(kc, vc)
    for shift in (1, 7):
        kc.copy_(k_cache)
        vc.copy_(v_cache)
        q.copy_(randn(gen, batch, 4, hq, d))
        seqlens.copy_(torch.tensor([20 + shift, 100 + shift, 4 + shift, 400 + shift], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ek, ev = k_cache.clone(), v_cache.clone()
        eager = step(ek, ev)
        assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
        assert torch.equal(kc, ek) and torch.equal(vc, ev)
