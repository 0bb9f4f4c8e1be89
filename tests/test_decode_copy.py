"""The decode kernel's line-wide K/V copies on the CPU (cutefa.model.policy_decode.DecodeCopy): the
variants, their rules and rendering, and the host path under CUTEFA_DECODE_COPY=lines (kernel
emulated as in test_kvcache_api: the copy layout changes how rows reach shared memory, not what the
kernel computes). The switch itself: test_kvcache_keys.py; the SASS: test_compile_decode.py; the
GPU: tests/gpu/test_decode_variants_gpu.py."""

from __future__ import annotations

import pytest
import torch
from test_kvcache_api import _inputs, emulated, reference  # noqa: F401 -- the fixture (usefixtures)

from cutefa import codegen
from cutefa.api import kvcache
from cutefa.model import policy_decode
from cutefa.model.options import CacheDtype, Mask
from cutefa.model.rules import why_invalid
from cutefa.model.spec import Features, parse_name

LINES, SECTORS = policy_decode.DecodeCopy.LINES, policy_decode.DecodeCopy.SECTORS
KEYS = policy_decode.DecodeSchedule.KEYS


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("rows", [1, 4, 32, 128])
def test_line_copy_variants_are_valid_and_render(head_dim, rows):
    for mask in Mask:
        for paged in (False, True):
            spec = policy_decode.decode_spec("bf16", head_dim, rows, mask=mask, paged=paged, copy=LINES)
            assert spec.options.line_copy and spec.name.endswith("_lcp"), spec.name
            assert parse_name(spec.name) == spec
            assert why_invalid(spec) is None, spec.name
            assert policy_decode.copy_threads_per_row(spec) == policy_decode.LINE_THREADS == 8
            assert "COPY_THREADS_PER_ROW = 8 " in codegen.render_source(spec)
            # the same tile as the sector copies: only the copy layout differs
            sectors = policy_decode.decode_spec("bf16", head_dim, rows, mask=mask, paged=paged, copy=SECTORS)
            assert spec.replace(line_copy=False) == sectors and not sectors.options.line_copy
            assert policy_decode.copy_threads_per_row(sectors) < 8 or sectors.threads // sectors.tile_n >= 8


@pytest.mark.parametrize(
    ("head_dim", "rows", "cache_dtype", "schedule"),
    [(96, 4, CacheDtype.SAME, None), (128, 4, CacheDtype.E4M3, None),
     (128, 4, CacheDtype.SAME, KEYS)],
)  # fmt: skip
def test_line_copy_falls_back_to_sectors_where_it_does_not_apply(head_dim, rows, cache_dtype, schedule):
    extra = {} if schedule is None else {"schedule": schedule}
    spec = policy_decode.decode_spec("bf16", head_dim, rows, cache_dtype=cache_dtype, copy=LINES, **extra)
    assert not spec.options.line_copy, spec.name
    assert why_invalid(spec) is None, spec.name


def test_rules_refuse_line_copy_outside_the_16_bit_rows_tile():
    rows = policy_decode.decode_spec("bf16", 128, 4, copy=LINES)
    assert "head_dim a multiple of 64" in why_invalid(rows.replace(head_dim=96))
    assert "e4m3" in why_invalid(rows.replace(cache_dtype=CacheDtype.E4M3))
    keys = policy_decode.decode_spec("bf16", 128, 4, schedule=KEYS)
    assert "splitting the keys" in why_invalid(keys.replace(line_copy=True))
    prefill = parse_name("cutefa_sm80_fwd_bf16_hd128_128x64_s2_w4")
    assert "decode kernel" in why_invalid(prefill.replace(line_copy=True))


@pytest.mark.parametrize("num_splits", [0, 3])
def test_line_copy_host_path_matches_the_reference(emulated, monkeypatch, num_splits):  # noqa: F811 -- the fixture
    monkeypatch.setenv(kvcache.COPY_ENV, "lines")
    batch, cap = 3, 300
    q, k_cache, v_cache = _inputs(batch=batch, sq=1, hq=32, hkv=8, seqlen_cache=cap)
    lens = torch.tensor([0, 17, 257], dtype=torch.int32)
    out, lse = kvcache.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, num_splits=num_splits, return_lse=True
    )
    spec, splits = emulated[-1]
    assert spec.options.line_copy, spec.name
    assert num_splits == 0 or splits == num_splits
    for b in range(batch):
        n = int(lens[b])
        o, l = reference(q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n], 1 / 8)
        torch.testing.assert_close(out[b : b + 1].double(), o.double(), atol=2e-3, rtol=0)
        finite = torch.isfinite(l)
        assert torch.equal(finite, torch.isfinite(lse[b : b + 1]))  # -inf where no key (n = 0)
        torch.testing.assert_close(lse[b : b + 1][finite].double(), l[finite].double(), atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# The default: LINES, but SECTORS for a small paged cache (policy_decode.default_copy)


def test_default_copy_is_lines_but_for_small_paged_caches():
    limit = policy_decode.PAGED_LINES_MIN_BYTES
    assert policy_decode.default_copy(False) is LINES and policy_decode.default_copy(True) is LINES
    assert policy_decode.default_copy(False, 1) is LINES  # a dense cache: LINES at any size
    assert policy_decode.default_copy(True, limit - 1) is SECTORS
    assert policy_decode.default_copy(True, limit) is LINES
    # decode_spec without a copy asks the default; one it names wins
    assert policy_decode.decode_spec("bf16", 128, 4, paged=True, kv_bytes=limit - 1) == policy_decode.decode_spec(
        "bf16", 128, 4, paged=True, copy=SECTORS
    )
    assert policy_decode.decode_spec("bf16", 128, 4, paged=True, kv_bytes=limit - 1, copy=LINES).options.line_copy
    assert policy_decode.decode_spec("bf16", 128, 4).options.line_copy


@pytest.mark.parametrize(("pages", "env", "lines"), [(64, "", False), (1024, "", True), (64, "lines", True),
                                                     (1024, "sectors", False), (1024, " ", True)])  # fmt: skip
def test_the_call_takes_the_copy_by_its_cache_size(monkeypatch, pages, env, lines):
    """batch 1, 8 kv heads, hd128 bf16, pages of 16: 64 pages (1k tokens, 4 MiB of K/V) stay on
    SECTORS, 1024 (16k, 64 MiB) take LINES; CUTEFA_DECODE_COPY overrides either (blank: unset)."""
    monkeypatch.setenv(kvcache.COPY_ENV, env)
    q = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
    pool = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)  # the capacity is the table's, not the pool's
    table = torch.zeros(1, pages, dtype=torch.int32)
    assert kvcache.cache_bytes(1, pool, table) == 2 * pages * 16 * 8 * 128 * 2
    spec = kvcache.decode_spec(q, pool, table, False, False, 0.0)
    assert spec.options.line_copy is lines, spec.name
    # a dense cache of the same size: LINES unless asked otherwise
    dense = kvcache.decode_spec(q, torch.zeros(1, pages * 16, 8, 128, dtype=torch.bfloat16), None, False, False, 0.0)
    assert dense.options.line_copy is (env.strip() != "sectors")


# ---------------------------------------------------------------------------------------------
# Page reads per chunk of 16 keys (policy_decode.DecodePages.CHUNKS, the default where it applies)

CHUNKS, ROWS_PAGES = policy_decode.DecodePages.CHUNKS, policy_decode.DecodePages.ROWS


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("rows", [1, 4, 32, 64])
def test_page_chunk_variants_are_valid_and_render(head_dim, rows):
    for mask in Mask:
        spec = policy_decode.decode_spec(
            "bf16", head_dim, rows, mask=mask, paged=True, copy=LINES, pages=CHUNKS, page_size=16
        )
        assert spec.options.page_chunks and spec.name.endswith("_lcp_pch"), spec.name
        assert parse_name(spec.name) == spec and why_invalid(spec) is None, spec.name
        step = policy_decode.chunk_row_step(spec)
        assert step == spec.warps * 4 and 16 % step == 0
        text = codegen.render_source(spec)
        assert text.count("decode_paged.load_page_rows(") == text.count(f"seqlen_k, shift, {step})") > 0
        assert f"seqlen_k, shift, {step})" in text
        # only the page lookups differ from the per-row form
        assert spec.replace(page_chunks=False) == policy_decode.decode_spec(
            "bf16", head_dim, rows, mask=mask, paged=True, copy=LINES, page_size=16, pages=ROWS_PAGES
        )
        assert policy_decode.decode_spec(
            "bf16", head_dim, rows, mask=mask, paged=True, copy=LINES, page_size=16
        ) == spec  # the default


@pytest.mark.parametrize(
    ("paged", "page_size", "copy", "rows"),
    [(False, None, LINES, 4), (True, 8, LINES, 4), (True, 16, SECTORS, 4), (True, None, LINES, 4),
     (True, 16, LINES, 128)],
)  # fmt: skip
def test_page_chunks_fall_back_where_they_do_not_apply(paged, page_size, copy, rows):
    """A dense cache, pages under 16 keys (or not known), sector copies, and 8 warps (a copy
    instruction spans 32 rows: two chunks) keep the per-row page reads."""
    spec = policy_decode.decode_spec(
        "bf16", 128, rows, paged=paged, copy=copy, pages=CHUNKS, page_size=page_size
    )  # fmt: skip
    assert not spec.options.page_chunks and why_invalid(spec) is None, spec.name


def test_rules_refuse_page_chunks_outside_the_paged_line_copy():
    chunks = policy_decode.decode_spec("bf16", 128, 4, paged=True, copy=LINES, pages=CHUNKS, page_size=16)
    dense = Features(split_kv=True)
    assert "paged_kv" in why_invalid(chunks.replace(features=dense))
    assert "needs line_copy" in why_invalid(chunks.replace(line_copy=False))
    eight = policy_decode.decode_spec("bf16", 128, 128, paged=True, copy=LINES, page_size=16)
    assert "32 rows do not divide 16" in why_invalid(eight.replace(page_chunks=True))


@pytest.mark.parametrize(("page_size", "env", "chunks"), [(16, "chunks", True), (8, "chunks", False),
                                                          (64, "", True), (8, "", False), (64, "rows", False)])  # fmt: skip
def test_the_call_takes_page_chunks_unless_asked_not_to_where_the_pages_allow(monkeypatch, page_size, env, chunks):
    monkeypatch.setenv(kvcache.PAGES_ENV, env)
    monkeypatch.setenv(kvcache.COPY_ENV, "lines")
    q = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
    pool = torch.zeros(4, page_size, 8, 128, dtype=torch.bfloat16)
    spec = kvcache.decode_spec(q, pool, torch.zeros(1, 8, dtype=torch.int32), False, False, 0.0)
    assert spec.options.page_chunks is chunks, spec.name
    dense = kvcache.decode_spec(q, torch.zeros(1, 64, 8, 128, dtype=torch.bfloat16), None, False, False, 0.0)
    assert not dense.options.page_chunks
