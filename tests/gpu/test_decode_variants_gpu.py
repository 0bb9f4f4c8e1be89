"""The decode variants on a CUDA GPU, each against the float32 reference on the gathered dense
cache and against the other variant's answer on the same inputs:

- ``keys``: the KEYS schedule (cutefa.model.policy_decode.DecodeSchedule: the warps of a 16-row tile
  split each key block and merge their rows in shared memory), through ``CUTEFA_DECODE_SCHEDULE=keys``;
- ``lines``: the line-wide K/V copies (DecodeCopy.LINES: 8 threads of 16 bytes on a 128-byte line of
  a row instead of 2 on a 32-byte sector; the default but on small paged caches,
  policy_decode.default_copy), through ``CUTEFA_DECODE_COPY=lines``, against ``sectors``;
- ``chunks``: with line copies, a paged cache's page table read once per 16 keys a thread
  (DecodePages.CHUNKS, the default where it applies), through ``CUTEFA_DECODE_PAGES=chunks``,
  against the per-row reads (its tests of dense caches skip: the option is the paged kernel's).

Covered for each: every page size (16 to 256) with sequences ending mid-page, num_splits 1 to 16
giving one answer, ragged cache_seqlens with 0 and 1 and lengths that leave some warps of a block
without a key (1, 15, 16, 17, 33, 63, 65), GQA 32/8 and MQA with q of 1, 4 and 16 tokens (the head
groups that pack into 16 rows), windows and softcap, head dims 64 and 128 in fp16 and bf16. Every
test checks that the call really takes the variant. Tolerances: tests/gpu/test_kvcache.py's.
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

KEYS, LINES = policy_decode.DecodeSchedule.KEYS, policy_decode.DecodeCopy.LINES
CHUNKS = policy_decode.DecodePages.CHUNKS
with_kvcache = kvcache.flash_attn_with_kvcache
_NONE, _CAUSAL, _LOCAL = Mask.NONE, Mask.CAUSAL, Mask.LOCAL
# Each variant: the environment that picks it, the one that picks the default, its decode_spec keyword
VARIANTS = {
    "keys": ({kvcache.SCHEDULE_ENV: "keys"}, {kvcache.SCHEDULE_ENV: "rows"}, {"schedule": KEYS}),
    "lines": ({kvcache.COPY_ENV: "lines"}, {kvcache.COPY_ENV: "sectors"}, {"copy": LINES}),
    "chunks": (
        {kvcache.COPY_ENV: "lines", kvcache.PAGES_ENV: "chunks"},
        {kvcache.COPY_ENV: "lines", kvcache.PAGES_ENV: "rows"},
        {"copy": LINES, "pages": CHUNKS, "page_size": 16},
    ),
}
BITWISE = ("lines", "chunks")  # the same products in the same order: only how rows reach shared memory differs
# (dtype, head_dim, mask, paged, softcap) of the variants these tests run, compiled up front
USED = [
    (dt, hd, mask, paged, False)
    for dt in ("bf16", "fp16") for hd in (64, 128) for mask in (_NONE, _CAUSAL) for paged in (False, True)
] + [("bf16", 128, _LOCAL, False, False), ("bf16", 128, _LOCAL, True, False), ("bf16", 128, _NONE, True, True),
     ("bf16", 128, _LOCAL, False, True)]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _compiled_up_front():
    specs = []
    for name, (_, _, pick) in VARIANTS.items():
        for dt, hd, mask, paged, cap in USED:
            spec = policy_decode.decode_spec(dt, hd, 4, mask=mask, paged=paged, softcap=cap, **pick)
            assert _is_variant(spec, name) or (name == "chunks" and not paged), spec.name
            specs.append(spec)
    results = compile_variants(specs, target=dispatch.current_target(), jobs=min(16, os.cpu_count() or 1))
    failed = [f"{r.spec.name}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)


@pytest.fixture(params=sorted(VARIANTS), autouse=True)
def variant(request, monkeypatch):
    """The variant under test, picked by its environment for the test's calls."""
    for key, value in VARIANTS[request.param][0].items():
        monkeypatch.setenv(key, value)
    return request.param


def _is_variant(spec, name: str) -> bool:
    if name == "keys":
        return policy_decode.schedule_of(spec) is KEYS
    return spec.options.page_chunks if name == "chunks" else spec.options.line_copy


@pytest.fixture
def takes(variant):
    """Assert that a call's decode variant is the one under test."""

    def check(q, k_cache, page_table=None, causal=False, window=(-1, -1), softcap=0.0):
        if variant == "chunks" and page_table is None:
            pytest.skip("page reads per chunk: paged caches only")
        spec = kvcache.decode_spec(q, k_cache, page_table, causal, tuple(window) != (-1, -1), softcap)
        assert _is_variant(spec, variant), spec.name

    return check


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_paged_every_page_size(gen, takes, page_size, num_splits):
    batch, hq, hkv, d = 5, 32, 8, 128
    lens = [0, 1, page_size + page_size // 2 + 3, 5 * page_size - 1, 17]
    k_pool, v_pool, table, keys, values = kv.cache_of(gen, batch, hkv, d, lens, True, page_size)
    q = kv.randn(gen, batch, 1, hq, d)
    takes(q, k_pool, table)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(
        q, k_pool, v_pool, cache_seqlens=seqlens, page_table=table, num_splits=num_splits, return_lse=True
    )
    kv.assert_matches(out, lse, *kv.reference(q, keys, values, lens))


@pytest.mark.parametrize("paged", [False, True])
def test_num_splits_one_to_sixteen_agree(gen, takes, paged):
    batch, hq, hkv, d = 3, 32, 8, 128
    lens = [2048, 1111, 65]
    q = kv.randn(gen, batch, 1, hq, d)
    k_cache, v_cache, table, keys, values = kv.cache_of(gen, batch, hkv, d, lens, paged, 16, 2048)
    takes(q, k_cache, table)
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
def test_ragged_lengths_with_empty_warps(gen, takes, causal, num_splits):
    """Lengths 0, 1 and ones that leave warps of the last block (16 keys each) without a key."""
    lens = [0, 1, 15, 16, 17, 33, 63, 65, 130, 300]
    batch, sq, hq, hkv, d = len(lens), 2, 16, 2, 64
    q = kv.randn(gen, batch, sq, hq, d, dtype=torch.float16)
    k_cache = kv.randn(gen, batch, 320, hkv, d, dtype=torch.float16)
    v_cache = kv.randn(gen, batch, 320, hkv, d, dtype=torch.float16)
    takes(q, k_cache, causal=causal)
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
def test_query_tokens_and_head_groups(gen, takes, hq, hkv, seqlen_q, causal):
    batch, d, cap = 3, 128, 700
    q = kv.randn(gen, batch, seqlen_q, hq, d)
    k_cache, v_cache = kv.randn(gen, batch, cap, hkv, d), kv.randn(gen, batch, cap, hkv, d)
    takes(q, k_cache, causal=causal)
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
def test_window_and_softcap(gen, takes, window, causal, softcap, paged, seqlen_q):
    batch, hq, hkv, d = 3, 16, 4, 128
    lens = [500, 10, 257]
    q = kv.randn(gen, batch, seqlen_q, hq, d)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    k_cache, v_cache, table, keys, values = kv.cache_of(gen, batch, hkv, d, lens, paged, 32, 512)
    takes(q, k_cache, table, causal=causal, window=window, softcap=softcap)
    for splits in (1, 5):
        out, lse = with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table, causal=causal, window_size=window,
            softcap=softcap, num_splits=splits, return_lse=True,
        )  # fmt: skip
        want = kv.reference(q, keys, values, lens, causal=causal, window_size=window, softcap=softcap)
        kv.assert_matches(out, lse, *want)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_head_dims_and_the_default_agree(gen, takes, variant, head_dim, dtype, monkeypatch):
    batch, hq, hkv = 2, 8, 2
    lens = [333, 1000]
    q = kv.randn(gen, batch, 1, hq, head_dim, dtype=dtype)
    k_cache = kv.randn(gen, batch, 1000, hkv, head_dim, dtype=dtype)
    v_cache = kv.randn(gen, batch, 1000, hkv, head_dim, dtype=dtype)
    takes(q, k_cache)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=4, return_lse=True)
    kv.assert_matches(out, lse, *kv.reference(q, k_cache, v_cache, lens))
    for key, value in VARIANTS[variant][1].items():
        monkeypatch.setenv(key, value)
    default_out, default_lse = with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=4, return_lse=True
    )
    torch.testing.assert_close(out.float(), default_out.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, default_lse, atol=1e-4, rtol=0)
    if variant in BITWISE:
        assert torch.equal(out, default_out) and torch.equal(lse, default_lse)


@pytest.mark.parametrize("page_size", [16, 32, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_and_the_default_agree(gen, takes, variant, page_size, causal, monkeypatch):
    """A paged cache with sequences ending mid-page and mid-chunk, 4 new tokens: the variant's answer
    against the reference and against the other variant's (bit for bit where only the copies differ)."""
    batch, hq, hkv, d = 3, 16, 4, 128
    lens = [page_size * 3 + 5, 17, 2 * page_size - 1]
    k_cache, v_cache, table, keys, values = kv.cache_of(gen, batch, hkv, d, lens, True, page_size)
    q = kv.randn(gen, batch, 4, hq, d)
    takes(q, k_cache, table, causal=causal)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table, causal=causal, num_splits=3, return_lse=True
    )
    kv.assert_matches(out, lse, *kv.reference(q, keys, values, lens, causal=causal))
    for key, value in VARIANTS[variant][1].items():
        monkeypatch.setenv(key, value)
    default_out, default_lse = with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table, causal=causal, num_splits=3, return_lse=True
    )
    if variant in BITWISE:
        assert torch.equal(out, default_out) and torch.equal(lse, default_lse)
    else:
        torch.testing.assert_close(out.float(), default_out.float(), atol=2e-2, rtol=0)
