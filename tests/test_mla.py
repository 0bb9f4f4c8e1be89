"""MLA decode on the CPU: the variant (its name, template, rules, shared memory), the policy, the
API's checks and refusals, and the call path through an emulation of the kernel's arguments
(templates/decode_mla_sm90.py.j2): the split workspaces, the combine's merge, both spellings."""

from __future__ import annotations

import math

import pytest
import torch

from cutefa import codegen, dispatch
from cutefa.api import kvcache, mla, validate
from cutefa.model import policy_mla, rules
from cutefa.model.options import Mask
from cutefa.model.spec import Features, VariantSpec, parse_name

# ---------------------------------------------------------------------------------------------
# The variant


@pytest.mark.parametrize(
    "rows, tile_m, warps", [(1, 16, 4), (16, 16, 4), (17, 32, 8), (128, 32, 8), (512, 32, 8)]
)
def test_spec_tiles(rows, tile_m, warps):
    spec = policy_mla.mla_spec("bf16", rows)
    assert (spec.arch, spec.direction, spec.head_dim, spec.head_dim_v) == ("sm90", "fwd", 576, 512)
    assert (spec.tile_m, spec.warps, spec.tile_n, spec.stages) == (tile_m, warps, 64, 2)
    assert spec.features == Features(paged_kv=True, split_kv=True)
    assert policy_mla.is_mla(spec)
    assert rules.why_invalid(spec) is None
    assert codegen.template_name(spec) == "decode_mla_sm90.py.j2"
    assert parse_name(spec.name) == spec


def test_names():
    assert policy_mla.mla_spec("bf16", 16).name == "cutefa_sm90_fwd_bf16_hd576v512_16x64_s2_w4_paged_split"
    causal = policy_mla.mla_spec("fp16", 64, causal=True)
    assert causal.name == "cutefa_sm90_fwd_fp16_hd576v512_32x64_s2_w8_causal_paged_split"
    assert causal.mask is Mask.CAUSAL


def test_shared_memory_fits_sm90():
    for rows in (16, 128):
        spec = policy_mla.mla_spec("bf16", rows)
        expected = spec.tile_m * 576 * 2 + 2 * 64 * 576 * 2 + spec.tile_m * 64 * 2
        assert expected <= rules.smem_bytes(spec) <= expected + 5 * 1024
        assert rules.why_not_on(spec, "sm_90a") is None


def _mla(**changes) -> VariantSpec:
    return policy_mla.mla_spec("bf16", 64).replace(**changes)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"tile_n": 32}, "tile_n=64"),
        ({"stages": 3}, "stages=2"),
        ({"warps": 4}, "warps=8"),
        ({"tile_m": 64, "warps": 16}, "tile_m of 16 or 32"),
        ({"mask": Mask.LOCAL}, "causal mask"),
        ({"features": Features(split_kv=True)}, "split_kv + paged_kv"),
        ({"features": Features(split_kv=True, paged_kv=True, softcap=True)}, "split_kv + paged_kv"),
        ({"arch": "sm80"}, "sm90 forward"),
    ],
)
def test_refused_shapes(changes, words):
    reason = rules.why_invalid(_mla(**changes))
    assert reason is not None and words in reason, reason


def test_e4m3_latent_cache_is_refused():
    spec = VariantSpec(
        "sm90",
        "fwd",
        "e4m3",
        576,
        32,
        64,
        2,
        8,
        features=Features(paged_kv=True, split_kv=True),
        head_dim_v=512,
    )
    assert "e4m3 latent cache is not implemented" in rules.why_invalid(spec)


def test_other_sm90_decode_specs_are_refused():
    spec = VariantSpec(
        "sm90", "fwd", "bf16", 128, 16, 64, 2, 4, features=Features(paged_kv=True, split_kv=True)
    )
    reason = rules.why_invalid(spec)
    assert "no bf16 sm90 fwd kernel implements the paged + split feature(s) yet" in reason
    # the dense forward of head dim 576 is no variant either
    dense = VariantSpec("sm90", "fwd", "bf16", 576, 64, 64, 2, 8, head_dim_v=512)
    assert rules.why_invalid(dense) is not None


def test_render_has_the_switches():
    source = codegen.render_source(policy_mla.mla_spec("bf16", 64, causal=True))
    assert "HEAD_DIM = 576" in source and "HEAD_DIM_V = 512" in source
    assert "ROW_SLABS = 2" in source and "WARP_COLS = 4" in source
    assert "window_right = Int32(0)" in source
    assert "min_blocks_per_mp=1" in source
    plain = codegen.render_source(policy_mla.mla_spec("bf16", 16))
    assert "window_right = Int32(UNBOUNDED)" in plain and "ROW_SLABS = 1" in plain


def test_split_heuristic():
    # one CTA an SM: 300 sequences fill an H100's 132 SMs twice over with one split
    assert policy_mla.num_splits(batch=300, row_tiles=1, seqlen_k=8192, sm_count=132) == 1
    # batch 64 x 8k: split to at least two waves
    splits = policy_mla.num_splits(batch=64, row_tiles=1, seqlen_k=8192, sm_count=132)
    assert 64 * splits >= 2 * 132 and 8192 // 64 // splits >= 4
    # one sequence of 32k: as many splits as allowed, each at least 4 blocks of 64 keys
    splits = policy_mla.num_splits(batch=1, row_tiles=1, seqlen_k=32768, sm_count=132)
    assert splits == 128 and 32768 // 64 // splits >= 4  # capped by the decode heuristic's MAX_SPLITS
    assert policy_mla.num_splits(batch=1, row_tiles=1, seqlen_k=64, sm_count=132) == 1


# ---------------------------------------------------------------------------------------------
# The call path, with the kernel emulated on the CPU


def reference(q, kv_cache, page_table, seqlens, scale, causal):
    """float32 (out, lse) of MLA decode on the gathered cache."""
    batch, seqlen_q, heads_q, _ = q.shape
    page_size = kv_cache.shape[1]
    out = torch.zeros((batch, seqlen_q, heads_q, 512), dtype=torch.float32)
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf)
    for b in range(batch):
        n = min(int(seqlens[b]), page_table.shape[1] * page_size)
        keys = torch.arange(n)
        rows = kv_cache[page_table[b, keys // page_size].long(), keys % page_size, 0].float()  # (n, 576)
        s = torch.einsum("thd,nd->htn", q[b].float(), rows) * scale
        if causal:
            allowed = keys[None, :] <= (torch.arange(seqlen_q)[:, None] + n - seqlen_q)
            s = s.masked_fill(~allowed[None], -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)  # (h, t)
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        out[b] = torch.einsum("htn,nd->thd", p, rows[:, :512])
        lse[b] = row_lse
    return out, lse


def emulate(q, kv_cache, out, lse, o_part, lse_part, seqlens, page_table, scale, causal, calls):
    """What the kernel writes: one split, out and lse; more, each split's rows over its share of
    the keys into the workspaces, then the combine."""
    calls.append(
        {"splits": lse_part.shape[0], "o_part": tuple(o_part.shape), "lse_part": tuple(lse_part.shape)}
    )
    splits = lse_part.shape[0]
    if splits == 1:
        o, l = reference(q, kv_cache, page_table, seqlens, scale, causal)
        out.copy_(o.to(out.dtype))
        lse.copy_(l)
        return
    # splits over the keys: the reference on each share (every split sees the full causal band)
    page_size = kv_cache.shape[1]
    for s in range(splits):
        for b in range(q.shape[0]):
            n = min(int(seqlens[b]), page_table.shape[1] * page_size)
            lo, hi = s * n // splits, (s + 1) * n // splits
            keys = torch.arange(lo, hi)
            rows = kv_cache[page_table[b, keys // page_size].long(), keys % page_size, 0].float()
            sc = torch.einsum("thd,nd->htn", q[b].float(), rows) * scale
            if causal:
                allowed = keys[None, :] <= (torch.arange(q.shape[1])[:, None] + n - q.shape[1])
                sc = sc.masked_fill(~allowed[None], -math.inf)
            row_lse = torch.logsumexp(sc, dim=-1)
            p = torch.exp(sc - row_lse[..., None]).nan_to_num(0.0)
            o_part[s, b] = torch.einsum("htn,nd->thd", p, rows[:, :512])
            lse_part[s, b] = row_lse
    top = lse_part.amax(0)
    offset = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    total = torch.exp(lse_part - offset).sum(0)
    merged = torch.where(total > 0, offset + torch.log(total), torch.full_like(total, -math.inf))
    w = torch.exp(
        lse_part - torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
    )  # (s, b, h, t)
    out.copy_(torch.einsum("sbht,sbthd->bthd", w, o_part).to(out.dtype))
    lse.copy_(merged)


@pytest.fixture
def emulated(monkeypatch):
    calls: list[dict] = []

    def launch(spec, device, *args):
        assert policy_mla.is_mla(spec) and rules.why_invalid(spec) is None
        emulate(*args, spec.mask is Mask.CAUSAL, calls)

    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(mla, "get_kernel", lambda spec, target: spec)
    monkeypatch.setattr(mla, "_launch", launch)
    monkeypatch.setattr(dispatch, "device_target", lambda device=None: ("sm_90a", "NVIDIA H100"))
    monkeypatch.setattr(mla, "sm_count", lambda device: 132)
    return calls


def _problem(batch=2, seqlen_q=1, heads_q=16, page_size=64, max_pages=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = batch * max_pages + 3
    q = torch.randn((batch, seqlen_q, heads_q, 576), generator=g).to(torch.bfloat16)
    kv = torch.randn((pages, page_size, 1, 576), generator=g).to(torch.bfloat16)
    table = torch.randperm(pages, generator=g)[: batch * max_pages].reshape(batch, max_pages).to(torch.int32)
    return q, kv, table


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_call_path_matches_the_reference(emulated, splits, causal):
    q, kv, table = _problem(seqlen_q=2)
    seqlens = torch.tensor([200, 17], dtype=torch.int32)
    out, lse = mla.mla_decode(q, kv, table, seqlens, causal=causal, num_splits=splits, softmax_scale=0.1)
    ref_out, ref_lse = reference(q, kv, table, seqlens, 0.1, causal)
    assert out.shape == (2, 2, 16, 512) and out.dtype == torch.bfloat16 and lse.shape == (2, 16, 2)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    assert emulated[-1]["splits"] == splits
    if splits > 1:
        assert emulated[-1]["o_part"] == (splits, 2, 2, 16, 512) and emulated[-1]["lse_part"] == (
            splits,
            2,
            16,
            2,
        )


def test_flash_attn_with_kvcache_spelling(emulated):
    q, kv, table = _problem()
    seqlens = torch.tensor([100, 256], dtype=torch.int32)
    out, lse = kvcache.flash_attn_with_kvcache(
        q, kv, None, cache_seqlens=seqlens, page_table=table, return_lse=True
    )
    ref_out, ref_lse = reference(q, kv, table, seqlens, 1 / math.sqrt(576), False)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    # FA2's block_table spelling, out only
    alone = kvcache.flash_attn_with_kvcache(q, kv, None, cache_seqlens=seqlens, block_table=table)
    torch.testing.assert_close(alone, out)


def test_empty_sequences_get_zero_and_minus_inf(emulated):
    q, kv, table = _problem()
    out, lse = mla.mla_decode(q, kv, table, torch.tensor([0, 5], dtype=torch.int32), num_splits=1)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf) and torch.all(torch.isfinite(lse[1]))


def test_heuristic_splits_from_shapes(emulated):
    q, kv, table = _problem(batch=1, max_pages=64)  # capacity 4096 keys: 64 blocks
    mla.mla_decode(q, kv, table, None)
    assert (
        emulated[-1]["splits"] == policy_mla.num_splits(batch=1, row_tiles=1, seqlen_k=4096, sm_count=132) > 1
    )


def test_fake_impl_shapes():
    q = torch.empty((3, 2, 128, 576), dtype=torch.bfloat16, device="meta")
    kv = torch.empty((10, 64, 1, 576), dtype=torch.bfloat16, device="meta")
    out, lse = mla._op_fake(q, kv, None, None, 0.1, True, 0)
    assert out.shape == (3, 2, 128, 512) and lse.shape == (3, 128, 2) and lse.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Checks and refusals


@pytest.fixture
def cpu_ok(monkeypatch):
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))


def _call(q=None, kv=None, table=None, seqlens=None, **kw):
    dq, dkv, dtable = _problem()
    return mla.mla_decode(
        dq if q is None else q, dkv if kv is None else kv, dtable if table is None else table, seqlens, **kw
    )


@pytest.mark.parametrize(
    "kw, error, words",
    [
        ({"q": torch.zeros((2, 1, 16, 512), dtype=torch.bfloat16)}, ValueError, "head dim 576"),
        ({"kv": torch.zeros((8, 64, 2, 576), dtype=torch.bfloat16)}, ValueError, "one latent head"),
        ({"kv": torch.zeros((8, 48, 1, 576), dtype=torch.bfloat16)}, ValueError, "power of two"),
        ({"kv": torch.zeros((8, 64, 1, 576), dtype=torch.float16)}, TypeError, "one dtype"),
        ({"q": torch.zeros((2, 1, 16, 576), dtype=torch.float32)}, TypeError, "float16 or torch.bfloat16"),
        ({"kv": torch.zeros((8, 64, 1, 576), dtype=torch.float8_e4m3fn)}, NotImplementedError, "e4m3 latent"),
        ({"table": torch.zeros((2, 4), dtype=torch.int64)}, TypeError, "page_table must be torch.int32"),
        ({"table": torch.zeros((3, 4), dtype=torch.int32)}, ValueError, "page_table must have shape"),
        ({"seqlens": torch.zeros((2,), dtype=torch.int64)}, TypeError, "cache_seqlens must be torch.int32"),
        ({"seqlens": -1}, TypeError, "cache_seqlens"),
        ({"num_splits": -1}, ValueError, "num_splits"),
        ({"num_splits": 1.5}, TypeError, "num_splits"),
        ({"softmax_scale": 0.0}, ValueError, "softmax_scale"),
        ({"head_dim_v": 576}, ValueError, "head_dim_v=512"),
        ({"causal": 1}, TypeError, "causal"),
    ],
)
def test_bad_arguments(cpu_ok, kw, error, words):
    with pytest.raises(error, match=words):
        _call(**kw)


def test_unaligned_cache_strides(cpu_ok):
    kv = torch.zeros((8, 64, 1, 580), dtype=torch.bfloat16)[..., :576]
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        _call(kv=kv)


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"k": torch.zeros(1)}, "k: MLA decode"),
        ({"rotary_cos": torch.zeros(1)}, "rotary_cos"),
        ({"cache_batch_idx": torch.zeros(1)}, "cache_batch_idx"),
        ({"alibi_slopes": torch.zeros(1)}, "alibi_slopes"),
        ({"window_size": (8, 0)}, "sliding window"),
        ({"softcap": 5.0}, "softcap"),
    ],
)
def test_kvcache_spelling_refuses_what_mla_lacks(cpu_ok, kw, words):
    q, kv, table = _problem()
    if "k" in kw:
        kw["v"] = torch.zeros(1)
    with pytest.raises(NotImplementedError, match=words):
        kvcache.flash_attn_with_kvcache(q, kv, None, page_table=table, **kw)


def test_dense_latent_cache_is_refused(cpu_ok):
    q, _, _ = _problem()
    with pytest.raises(NotImplementedError, match="paged latent cache"):
        kvcache.flash_attn_with_kvcache(q, torch.zeros((2, 64, 1, 576), dtype=torch.bfloat16), None)


def test_other_gpus_are_refused(cpu_ok, monkeypatch):
    monkeypatch.setattr(dispatch, "device_target", lambda device=None: ("sm_100a", "NVIDIA B200"))
    with pytest.raises(NotImplementedError, match="sm90 GPUs"):
        _call(num_splits=1)
