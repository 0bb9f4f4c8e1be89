"""The KEYS decode schedule on a CUDA GPU (cutefa.model.policy_decode.DecodeSchedule: the warps of a
16-row tile split each key block and merge their rows in shared memory), picked through
``CUTEFA_DECODE_SCHEDULE=keys``, against the float32 reference on the gathered dense cache.

Covered: every page size (16 to 256) with sequences ending mid-page, num_splits 1 to 16 giving one
answer, ragged cache_seqlens with 0 and 1 and lengths that leave some warps of a block without a key
(1, 15, 16, 17, 33, 63, 65), GQA 32/8 and MQA with q of 1, 4 and 16 tokens (the head groups that
pack into 16 rows), windows and softcap, head dims 64 and 128 in fp16 and bf16, and the ROWS
schedule's answer on the same inputs. Every test checks that the call really takes the KEYS variant.
Tolerances: tests/gpu/test_kvcache.py's.
"""

from __future__ import annotations

import os

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm80_skip_reason as _skip_reason

from cutefa import dispatch
from cutefa.api import kvcache
from cutefa.compile import compile_variants
from cutefa.model import policy_decode
from cutefa.model.options import Mask

kv = _load("test_kvcache")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

KEYS = policy_decode.DecodeSchedule.KEYS
with_kvcache = kvcache.flash_attn_with_kvcache
_NONE, _CAUSAL, _LOCAL = Mask.NONE, Mask.CAUSAL, Mask.LOCAL
# (dtype, head_dim, mask, paged, softcap) of the KEYS variants these tests run, compiled up front
USED = [
    (dt, hd, mask, paged, False)
    for dt in ("bf16", "fp16") for hd in (64, 128) for mask in (_NONE, _CAUSAL) for paged in (False, True)
] + [("bf16", 128, _LOCAL, False, False), ("bf16", 128, _LOCAL, True, False), ("bf16", 128, _NONE, True, True),
     ("bf16", 128, _LOCAL, False, True)]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _compiled_up_front():
    specs = list(dict.fromkeys(
        policy_decode.decode_spec(dt, hd, 4, mask=mask, paged=paged, softcap=cap, schedule=KEYS)
        for dt, hd, mask, paged, cap in USED
    ))  # fmt: skip
    assert all(policy_decode.schedule_of(s) is KEYS for s in specs)
    results = compile_variants(specs, target=dispatch.current_target(), jobs=min(16, os.cpu_count() or 1))
    failed = [f"{r.spec.name}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)


@pytest.fixture(autouse=True)
def _keys_schedule(monkeypatch):
    monkeypatch.setenv(kvcache.SCHEDULE_ENV, "keys")


def _takes_keys(q, k_cache, paged=False, causal=False, window=(-1, -1), softcap=0.0):
    spec = kvcache.decode_spec(q, k_cache, paged, causal, tuple(window) != (-1, -1), softcap)
    assert policy_decode.schedule_of(spec) is KEYS, spec.name


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_paged_every_page_size(gen, page_size, num_splits):
    batch, hq, hkv, d = 5, 32, 8, 128
    lens = [0, 1, page_size + page_size // 2 + 3, 5 * page_size - 1, 17]
    k_pool, v_pool, table = kv.paged_pool(gen, batch, page_size, hkv, d, lens, 0)
    q = kv.randn(gen, batch, 1, hq, d)
    _takes_keys(q, k_pool, paged=True)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(
        q, k_pool, v_pool, cache_seqlens=seqlens, page_table=table, num_splits=num_splits, return_lse=True
    )
    keys = [kv.dense_of(k_pool, table, b, n) for b, n in enumerate(lens)]
    values = [kv.dense_of(v_pool, table, b, n) for b, n in enumerate(lens)]
    kv.assert_matches(out, lse, *kv.reference(q, keys, values, lens))


@pytest.mark.parametrize("paged", [False, True])
def test_num_splits_one_to_sixteen_agree(gen, paged):
    batch, hq, hkv, d = 3, 32, 8, 128
    lens = [2048, 1111, 65]
    q = kv.randn(gen, batch, 1, hq, d)
    if paged:
        k_cache, v_cache, table = kv.paged_pool(gen, batch, 16, hkv, d, lens, 0)
        keys = [kv.dense_of(k_cache, table, b, n) for b, n in enumerate(lens)]
        values = [kv.dense_of(v_cache, table, b, n) for b, n in enumerate(lens)]
    else:
        k_cache, v_cache, table = kv.randn(gen, batch, 2048, hkv, d), kv.randn(gen, batch, 2048, hkv, d), None
        keys, values = k_cache, v_cache
    _takes_keys(q, k_cache, paged=paged)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    want = kv.reference(q, keys, values, lens)
    first = None
    for splits in range(1, 17):
        out, lse = with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table, num_splits=splits, return_lse=True
        )
        kv.assert_matches(out, lse, *want)
        if first is None:
            first = out, lse
        torch.testing.assert_close(out.float(), first[0].float(), atol=2e-2, rtol=0)
        torch.testing.assert_close(lse, first[1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_ragged_lengths_with_empty_warps(gen, causal, num_splits):
    """Lengths 0, 1 and ones that leave warps of the last block (16 keys each) without a key."""
    lens = [0, 1, 15, 16, 17, 33, 63, 65, 130, 300]
    batch, sq, hq, hkv, d = len(lens), 2, 16, 2, 64
    q = kv.randn(gen, batch, sq, hq, d, dtype=torch.float16)
    k_cache = kv.randn(gen, batch, 320, hkv, d, dtype=torch.float16)
    v_cache = kv.randn(gen, batch, 320, hkv, d, dtype=torch.float16)
    _takes_keys(q, k_cache, causal=causal)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal, num_splits=num_splits, return_lse=True
    )
    kv.assert_matches(out, lse, *kv.reference(q, k_cache, v_cache, lens, causal=causal))
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()


@pytest.mark.parametrize(
    ("hq", "hkv", "seqlen_q"),
    [(32, 8, 1), (32, 8, 4), (32, 8, 2), (8, 8, 16), (16, 1, 1), (4, 1, 4), (2, 1, 8)],
    ids=["gqa32_8-q1", "gqa32_8-q4", "gqa32_8-q2", "mha8-q16", "mqa16-q1", "mqa4-q4", "mqa2-q8"],
)  # fmt: skip
@pytest.mark.parametrize("causal", [True, False])
def test_query_tokens_and_head_groups(gen, hq, hkv, seqlen_q, causal):
    batch, d, cap = 3, 128, 700
    q = kv.randn(gen, batch, seqlen_q, hq, d)
    k_cache, v_cache = kv.randn(gen, batch, cap, hkv, d), kv.randn(gen, batch, cap, hkv, d)
    _takes_keys(q, k_cache, causal=causal)
    lens = [699, 3, 130]  # with 16 causal tokens, sequence 1's first rows see no key
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal, return_lse=True)
    kv.assert_matches(out, lse, *kv.reference(q, k_cache, v_cache, lens, causal=causal))


@pytest.mark.parametrize(
    ("window", "causal", "softcap", "paged"),
    [((64, -1), True, 0.0, False), ((100, 20), False, 0.0, True), ((-1, -1), False, 30.0, True),
     ((40, 0), False, 15.0, False), ((0, 0), False, 0.0, True)],
)  # fmt: skip
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_window_and_softcap(gen, window, causal, softcap, paged, seqlen_q):
    batch, hq, hkv, d = 3, 16, 4, 128
    lens = [500, 10, 257]
    q = kv.randn(gen, batch, seqlen_q, hq, d)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if paged:
        k_cache, v_cache, table = kv.paged_pool(gen, batch, 32, hkv, d, lens, 0)
        keys = [kv.dense_of(k_cache, table, b, n) for b, n in enumerate(lens)]
        values = [kv.dense_of(v_cache, table, b, n) for b, n in enumerate(lens)]
    else:
        k_cache, v_cache, table = kv.randn(gen, batch, 512, hkv, d), kv.randn(gen, batch, 512, hkv, d), None
        keys, values = k_cache, v_cache
    _takes_keys(q, k_cache, paged=paged, causal=causal, window=window, softcap=softcap)
    for splits in (1, 5):
        out, lse = with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table, causal=causal, window_size=window,
            softcap=softcap, num_splits=splits, return_lse=True,
        )  # fmt: skip
        want = kv.reference(q, keys, values, lens, causal=causal, window_size=window, softcap=softcap)
        kv.assert_matches(out, lse, *want)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_head_dims_and_the_rows_schedule_agree(gen, head_dim, dtype, monkeypatch):
    batch, hq, hkv = 2, 8, 2
    lens = [333, 1000]
    q = kv.randn(gen, batch, 1, hq, head_dim, dtype=dtype)
    k_cache = kv.randn(gen, batch, 1000, hkv, head_dim, dtype=dtype)
    v_cache = kv.randn(gen, batch, 1000, hkv, head_dim, dtype=dtype)
    _takes_keys(q, k_cache)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=4, return_lse=True)
    kv.assert_matches(out, lse, *kv.reference(q, k_cache, v_cache, lens))
    monkeypatch.setenv(kvcache.SCHEDULE_ENV, "rows")
    rows_out, rows_lse = with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=4, return_lse=True
    )
    torch.testing.assert_close(out.float(), rows_out.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, rows_lse, atol=1e-4, rtol=0)
