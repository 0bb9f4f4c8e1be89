"""The KEYS decode schedule on the CPU (cutefa.model.policy_decode.DecodeSchedule): its variants, rules
and rendering, its residency and split counts, and the switch (CUTEFA_DECODE_SCHEDULE) through the
host path (kernel emulated: the KEYS kernel computes what the ROWS kernel does, so the emulation of
test_kvcache_api stands for both)."""

from __future__ import annotations

import pytest
import torch
from test_kvcache_api import _inputs, emulated, reference  # noqa: F401 -- the fixture (usefixtures)

from cutefa import codegen
from cutefa.api import kvcache
from cutefa.model import policy_decode
from cutefa.model.options import CacheDtype, Mask
from cutefa.model.rules import why_invalid

KEYS, ROWS = policy_decode.DecodeSchedule.KEYS, policy_decode.DecodeSchedule.ROWS
SECTORS = policy_decode.DecodeCopy.SECTORS
with_kvcache = kvcache.flash_attn_with_kvcache


def _keys(head_dim=128, rows=4, **kw):
    return policy_decode.decode_spec("bf16", head_dim, rows, schedule=KEYS, **kw)


# ---------------------------------------------------------------------------------------------
# Variants, rules, rendering


@pytest.mark.parametrize("head_dim", [64, 128])
def test_keys_variants_are_valid_and_render(head_dim):
    for mask in Mask:
        for paged in (False, True):
            for softcap in (False, True):
                spec = _keys(head_dim, mask=mask, paged=paged, softcap=softcap)
                assert why_invalid(spec) is None, spec.name
                assert (spec.tile_m, spec.tile_n, spec.stages, spec.warps) == (16, 64, 3, 4), spec.name
                assert policy_decode.schedule_of(spec) is KEYS and policy_decode.warp_keys(spec) == 16
                source = codegen.render_source(spec)
                assert "decode_warps.merge_rows(" in source and "cute.arch.sync_warp()" in source
                assert "KEY_WARPS = 4" in source and "WARP_KEYS = 16" in source
                # the mainloop syncs each warp with itself only: CTA barriers after the Q load and
                # around the merge
                assert source.count("cute.arch.barrier()") == 2, spec.name


def test_rows_variants_keep_their_names_and_source():
    """ROWS stays the default and its modules do not change (no KEYS piece in them)."""
    spec = policy_decode.decode_spec("bf16", 128, 4, paged=True)
    assert spec == policy_decode.decode_spec("bf16", 128, 4, paged=True, schedule=ROWS)
    assert spec.name == "cutefa_sm80_fwd_bf16_hd128_16x64_s2_w1_paged_split_lcp"  # the default LINES copy
    assert policy_decode.schedule_of(spec) is ROWS and policy_decode.key_warps(spec) == 1
    source = codegen.render_source(spec)
    assert "decode_warps" not in source and "sync_warp" not in source and "KEY_WARPS" not in source


@pytest.mark.parametrize(
    ("head_dim", "rows", "cache_dtype"),
    [(128, 17, CacheDtype.SAME), (128, 64, CacheDtype.SAME), (96, 4, CacheDtype.SAME), (192, 4, CacheDtype.SAME),
     (256, 4, CacheDtype.SAME), (128, 4, CacheDtype.E4M3)],
)  # fmt: skip
def test_keys_falls_back_to_rows_where_it_does_not_apply(head_dim, rows, cache_dtype):
    spec = policy_decode.decode_spec("bf16", head_dim, rows, schedule=KEYS, cache_dtype=cache_dtype)
    assert spec == policy_decode.decode_spec("bf16", head_dim, rows, cache_dtype=cache_dtype)
    assert not policy_decode.keys_apply(rows, head_dim, cache_dtype)


def test_rules_refuse_what_the_keys_kernel_lacks():
    base = _keys()
    assert "16 each" in why_invalid(base.replace(tile_n=128))
    assert "16-row decode tiles only" in why_invalid(base.replace(tile_m=32, tile_n=64, warps=4))
    assert "16-row decode tiles only" in why_invalid(base.replace(warps=3, tile_n=48))
    assert "head dims 64 and 128" in why_invalid(policy_decode.decode_spec("bf16", 256, 4, copy=SECTORS).replace(
        tile_n=64, warps=4, stages=3))  # fmt: skip
    e4m3 = base.replace(options=base.options.replace(cache_dtype=CacheDtype.E4M3))
    assert "e4m3" in why_invalid(e4m3)
    # a prefill (not split_kv) spec with more warps than slabs stays refused as before
    prefill = base.replace(features=base.features.__class__())
    assert "16-row MMA slabs" in why_invalid(prefill)
    # the names parse back
    from cutefa.model.spec import parse_name

    assert parse_name(base.name) == base


def test_keys_residency_counts_registers_and_shared_memory():
    """hd128: Q 4 KiB + 3 stages of 64-key K and V (96 KiB): 2 CTAs (8 warps) an H100 SM, by shared
    memory and by registers (192 a thread, from SASS); the ROWS tile keeps 3 one-warp CTAs."""
    assert policy_decode.ctas_per_sm(_keys(128), "sm_90a") == 2
    assert policy_decode.ctas_per_sm(policy_decode.decode_spec("bf16", 128, 4), "sm_90a") == 3
    assert policy_decode.ctas_per_sm(_keys(64), "sm_90a") == 4  # 50 KiB, 128 registers a thread
    assert policy_decode.ctas_per_sm(_keys(128), "sm_80") == 1


# ---------------------------------------------------------------------------------------------
# The split heuristic


def _splits(spec, batch, heads_kv, seqlen_k, rows=4):
    return policy_decode.num_splits(
        batch=batch, heads_kv=heads_kv, row_tiles=policy_decode.row_tiles(spec, rows), seqlen_k=seqlen_k,
        tile_n=spec.tile_n, sm_count=132, ctas_per_sm=policy_decode.ctas_per_sm(spec, "sm_90a"),
        min_blocks=policy_decode.min_blocks_per_split(spec),
    )  # fmt: skip


@pytest.mark.parametrize("batch", [1, 2, 8, 64, 256])
@pytest.mark.parametrize("seqlen", [1024, 8192, 32768, 131072])
def test_keys_splits_fill_two_to_four_waves_of_splits_of_256_keys(batch, seqlen):
    spec = _keys()
    slots = 132 * policy_decode.ctas_per_sm(spec, "sm_90a")
    s = _splits(spec, batch, 8, seqlen)
    ctas = batch * 8 * s
    assert s == 1 or seqlen // s >= policy_decode.MIN_KEYS_PER_SPLIT, (s, seqlen)
    if batch * 8 >= policy_decode.TARGET_WAVES * slots:
        assert s == 1
    elif seqlen // policy_decode.MIN_KEYS_PER_SPLIT >= -(-policy_decode.TARGET_WAVES * slots // (batch * 8)):
        assert policy_decode.TARGET_WAVES * slots <= ctas <= 2 * policy_decode.TARGET_WAVES * slots, (s, ctas)
    else:  # too short to fill: as many splits as 256-key splits allow
        assert s == seqlen // policy_decode.MIN_KEYS_PER_SPLIT


def test_keys_split_counts_of_the_measured_cells():
    """b1 x 8 kv heads x 8k: 32 splits of 256 keys (256 CTAs, a wave on 264 slots); b64: 2 splits
    (1024 CTAs, 3.9 waves)."""
    assert _splits(_keys(), 1, 8, 8192) == 32
    assert _splits(_keys(), 64, 8, 8192) == 2
    assert _splits(_keys(paged=True), 1, 8, 8192) == 32


def test_rows_split_counts_do_not_change():
    rows = policy_decode.decode_spec("bf16", 256, 4)
    assert policy_decode.min_blocks_per_split(rows) == policy_decode.MIN_BLOCKS_PER_SPLIT
    assert _splits(rows, 1, 8, 8192) == policy_decode.num_splits(
        batch=1, heads_kv=8, row_tiles=1, seqlen_k=8192, tile_n=rows.tile_n, sm_count=132,
        ctas_per_sm=policy_decode.ctas_per_sm(rows, "sm_90a"),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The switch


@pytest.mark.parametrize(
    ("env", "read", "default", "asked", "chosen", "bad", "error"),
    [(kvcache.SCHEDULE_ENV, kvcache.decode_schedule, ROWS, " KEYS ", KEYS, "cols",
      "CUTEFA_DECODE_SCHEDULE='cols'.*rows, keys"),
     (kvcache.COPY_ENV, kvcache.decode_copy, None, " Sectors ",
      policy_decode.DecodeCopy.SECTORS, "words", "CUTEFA_DECODE_COPY='words'.*sectors, lines"),
     (kvcache.PAGES_ENV, kvcache.decode_pages, policy_decode.DecodePages.CHUNKS, "ROWS",
      policy_decode.DecodePages.ROWS, "pages", "CUTEFA_DECODE_PAGES='pages'.*rows, chunks")],
    ids=["schedule", "copy", "pages"],
)  # fmt: skip
def test_decode_switches_come_from_the_environment(
    monkeypatch, env, read, default, asked, chosen, bad, error
):
    """The decode schedule and the copy layout (tests/test_decode_copy.py): read at each call."""
    monkeypatch.delenv(env, raising=False)
    assert read() is default
    monkeypatch.setenv(env, asked)
    assert read() is chosen
    monkeypatch.setenv(env, bad)
    with pytest.raises(ValueError, match=error):
        read()


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize(("sq", "hq", "hkv"), [(1, 32, 8), (4, 4, 1), (16, 4, 1)])
def test_keys_host_path_matches_the_reference(emulated, monkeypatch, num_splits, sq, hq, hkv):  # noqa: F811 -- the fixture
    monkeypatch.setenv(kvcache.SCHEDULE_ENV, "keys")
    batch, cap = 3, 300
    q, k_cache, v_cache = _inputs(batch=batch, sq=sq, hq=hq, hkv=hkv, seqlen_cache=cap)
    lens = torch.tensor([0, 17, 257], dtype=torch.int32)
    out, lse = with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, causal=True, num_splits=num_splits, return_lse=True
    )
    spec, splits = emulated[-1]
    assert policy_decode.schedule_of(spec) is (KEYS if sq * hq // hkv <= 16 else ROWS), spec.name
    assert num_splits == 0 or splits == num_splits
    for b in range(batch):
        n = int(lens[b])
        o, l = reference(q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n], 1 / 8, causal=True)
        torch.testing.assert_close(out[b : b + 1].double(), o.double(), atol=2e-3, rtol=0)
        finite = torch.isfinite(l)
        torch.testing.assert_close(lse[b : b + 1][finite].double(), l[finite].double(), atol=1e-4, rtol=0)
