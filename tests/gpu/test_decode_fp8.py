"""flash_attn_with_kvcache on an e4m3 KV cache (k_cache/v_cache torch.float8_e4m3fn, q 16-bit,
k_descale/v_descale per (batch, kv head)) on a Hopper GPU: the decode kernel with the kv_e4m3 option
(templates/decode_sm80.py.j2, kernels/sm80/decode_fp8.py) against a float32 reference on the
dequantized cache (stored * descale).

Covered: dense and paged caches (page sizes 16 and 64, scrambled pages, NaN-poisoned slots past each
sequence and spare pages), GQA 32/8 and MQA, 1 and 4 query tokens, lengths 1, 17, 1000 and 8192 in
one batch, cache_seqlens 0, num_splits 1 to 8 giving one answer, causal, a window with softcap, fp16
and bf16 q, head dims 64 and 128, and outputs and split workspaces allocated from NaN-poisoned
memory (every element must be written).

Error bounds: widening e4m3 to q's dtype is exact, so against the dequantized cache the kernel's
error is that of the 16-bit path (P rounded to q's dtype before P V, the output rounded once):
relative L2 1e-2 (bf16) / 2e-3 (fp16), the largest element error 4x the output's rounding plus
2^-10; lse to 1e-3 + 1e-5 |lse|.
"""

from __future__ import annotations

import os

import pytest
import torch
from gpu_support import load_sibling as _load

from cutefa import dispatch
from cutefa.api import kvcache
from cutefa.compile import compile_variants
from cutefa.model import policy_decode
from cutefa.model.options import CacheDtype, Mask


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False"
    if torch.cuda.get_device_capability() < (9, 0):
        return f"an e4m3 KV cache needs compute capability >= 9.0, this GPU is {torch.cuda.get_device_capability()}"
    return None


ref = _load("reference")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

REL_L2 = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
E4M3_MAX = 448.0
NAN_BYTE = 0x7F
with_kvcache = kvcache.flash_attn_with_kvcache

# (dtype, head_dim, packed rows, mask, paged, softcap) of the variants these tests run
USED = [
    ("bf16", 128, 4, Mask.NONE, False, False),
    ("bf16", 128, 4, Mask.NONE, True, False),
    ("bf16", 128, 16, Mask.CAUSAL, True, False),
    ("bf16", 128, 4, Mask.CAUSAL, False, False),
    ("bf16", 128, 128, Mask.CAUSAL, False, False),
    ("fp16", 64, 32, Mask.NONE, True, False),
    ("bf16", 128, 4, Mask.LOCAL, True, True),
]


@pytest.fixture(scope="module", autouse=True)
def _compiled_up_front():
    target = dispatch.current_target()
    specs = list(dict.fromkeys(
        policy_decode.decode_spec(dt, hd, rows, mask=mask, paged=paged, softcap=cap, cache_dtype=CacheDtype.E4M3)
        for dt, hd, rows, mask, paged, cap in USED
    ))  # fmt: skip
    results = compile_variants(specs, target=target, jobs=min(16, os.cpu_count() or 1), progress=False)
    failed = [f"{r.spec.name}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)


def randn(gen, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def quantize(x: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x (batch, seqlen, heads_kv, d) float to (e4m3 cache, descale (batch, heads_kv)): each (sequence,
    kv head)'s amax over its first lens[b] keys maps to 448; the slots past lens[b] are NaN."""
    batch, _, heads, _ = x.shape
    descale = torch.empty(batch, heads, device="cuda")
    for b, n in enumerate(lens):
        amax = x[b, :n].float().abs().amax(dim=(0, 2)) if n else torch.ones(heads, device="cuda")
        descale[b] = amax.clamp_min(1e-6) / E4M3_MAX
    scaled = x.float() / descale[:, None, :, None]
    for b, n in enumerate(lens):
        scaled[b, n:] = float("nan")
    return scaled.to(torch.float8_e4m3fn), descale


def dequantized(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    return x8.float() * descale[:, None, :, None]


def paged(x8: torch.Tensor, page_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense e4m3 cache (batch, seqlen, heads, d) as scrambled pages plus two NaN spare pages;
    returns (pool, page_table)."""
    batch, seqlen, heads, d = x8.shape
    per_seq = -(-seqlen // page_size)
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(seed)).int().cuda()
    table = order.reshape(batch, per_seq)
    # bytes: indexing works on uint8 everywhere (0x7F is e4m3's NaN)
    pool = torch.full((batch * per_seq + 2, page_size, heads, d), NAN_BYTE, dtype=torch.uint8, device="cuda")
    padded = torch.full((batch, per_seq * page_size, heads, d), NAN_BYTE, dtype=torch.uint8, device="cuda")
    padded[:, :seqlen] = x8.view(torch.uint8)
    pool[table.long().flatten()] = padded.reshape(batch * per_seq, page_size, heads, d)
    return pool.view(torch.float8_e4m3fn), table


def reference(q, keys, values, lens, **kw):
    outs, lses = [], []
    for b, n in enumerate(lens):
        o, l = ref.attention_ref(q[b : b + 1], keys[b : b + 1, :n], values[b : b + 1, :n], **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def poison_the_allocator(nbytes: int = 1 << 28) -> None:
    """Fill a large block with NaN and free it: the next allocations (out, lse, the split
    workspaces) reuse NaN bytes, so an element the kernel does not write shows."""
    block = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del block


def assert_matches(out, lse, want_out, want_lse):
    dtype = out.dtype
    assert torch.isfinite(out).all(), "NaN or inf in the output"
    empty = torch.isinf(want_lse)
    if empty.any():
        assert (out[empty.permute(0, 2, 1)] == 0).all(), "a row with no key is not 0"
        assert torch.isneginf(lse[empty]).all(), "a row with no key has lse other than -inf"
    err = ref.rel_l2(out, want_out)
    assert err <= REL_L2[dtype], f"relative L2 error {err:.2e} > {REL_L2[dtype]:.0e}"
    worst = ref.max_abs(out, want_out)
    bound = 4 * ref.rounding_error(want_out, dtype) + 2.0**-10
    assert worst <= bound, f"largest error {worst:.3e} > {bound:.3e}"
    full = ~empty
    diff = (lse[full].double() - want_lse[full].double()).abs()
    assert (diff <= 1e-3 + 1e-5 * want_lse[full].double().abs()).all(), f"lse off by {diff.max().item():.2e}"


def inputs(gen, lens, hq, hkv, d, sq=1, dtype=torch.bfloat16):
    batch, cap = len(lens), max(max(lens), 1)
    q = randn(gen, batch, sq, hq, d, dtype=dtype)
    k8, kd = quantize(randn(gen, batch, cap, hkv, d) * 3, lens)
    v8, vd = quantize(randn(gen, batch, cap, hkv, d), lens)
    return q, k8, v8, kd, vd


LENS = [1, 17, 1000, 8192]


@pytest.mark.parametrize("page_size", [None, 16, 64], ids=["dense", "page16", "page64"])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_gqa_lengths_dense_and_paged(gen, page_size, num_splits):
    hq, hkv, d = 32, 8, 128
    q, k8, v8, kd, vd = inputs(gen, LENS, hq, hkv, d)
    want = reference(q, dequantized(k8, kd), dequantized(v8, vd), LENS)
    seqlens = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    kw = {}
    if page_size is not None:
        (k8, table), (v8, _) = paged(k8, page_size, 1), paged(v8, page_size, 1)
        kw["page_table"] = table
    poison_the_allocator()
    out, lse = with_kvcache(
        q,
        k8,
        v8,
        cache_seqlens=seqlens,
        num_splits=num_splits,
        return_lse=True,
        k_descale=kd,
        v_descale=vd,
        **kw,
    )
    assert_matches(out, lse, *want)


def test_num_splits_one_to_eight_agree(gen):
    lens = [8192, 4321]
    q, k8, v8, kd, vd = inputs(gen, lens, 32, 8, 128)
    want = reference(q, dequantized(k8, kd), dequantized(v8, vd), lens)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    first = None
    for splits in range(1, 9):
        poison_the_allocator()
        out, lse = with_kvcache(
            q, k8, v8, cache_seqlens=seqlens, num_splits=splits, return_lse=True, k_descale=kd, v_descale=vd
        )
        assert_matches(out, lse, *want)
        first = first or (out, lse)
        torch.testing.assert_close(out.float(), first[0].float(), atol=2e-2, rtol=0)
        torch.testing.assert_close(lse, first[1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_mqa_query_tokens_and_fp16(gen, causal):
    """MQA 32/1 with 4 new tokens (bf16, causal: 128 packed rows), and fp16 q at head dim 64 (paged,
    GQA 8/1 of 4 tokens: 32 rows)."""
    lens = [1000, 17, 8192]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if causal:
        q, k8, v8, kd, vd = inputs(gen, lens, 32, 1, 128, sq=4)
        want = reference(q, dequantized(k8, kd), dequantized(v8, vd), lens, causal=True)
        out, lse = with_kvcache(
            q, k8, v8, cache_seqlens=seqlens, causal=True, return_lse=True, k_descale=kd, v_descale=vd
        )
        assert_matches(out, lse, *want)
    q, k8, v8, kd, vd = inputs(gen, lens, 8, 1, 64, sq=4, dtype=torch.float16)
    want = reference(q, dequantized(k8, kd), dequantized(v8, vd), lens)
    (kp, table), (vp, _) = paged(k8, 16, 2), paged(v8, 16, 2)
    out, lse = with_kvcache(
        q, kp, vp, cache_seqlens=seqlens, page_table=table, return_lse=True, k_descale=kd, v_descale=vd
    )
    assert_matches(out, lse, *want)


def test_cache_seqlens_zero_gives_zero_rows(gen):
    lens = [0, 17]
    q, k8, v8, kd, vd = inputs(gen, [1, 17], 32, 8, 128)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    poison_the_allocator()
    out, lse = with_kvcache(
        q, k8, v8, cache_seqlens=seqlens, return_lse=True, k_descale=kd, v_descale=vd, num_splits=3
    )
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    want = reference(q[1:], dequantized(k8, kd)[1:], dequantized(v8, vd)[1:], lens[1:])
    assert_matches(out[1:], lse[1:], *want)


def test_window_and_softcap_paged(gen):
    lens = [1000, 8192]
    q, k8, v8, kd, vd = inputs(gen, lens, 32, 8, 128)
    want = reference(
        q, dequantized(k8, kd), dequantized(v8, vd), lens, causal=True, window_size=(300, 0), softcap=20.0
    )
    (kp, table), (vp, _) = paged(k8, 64, 3), paged(v8, 64, 3)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(
        q, kp, vp, cache_seqlens=seqlens, page_table=table, causal=True, window_size=(300, -1), softcap=20.0,
        return_lse=True, k_descale=kd, v_descale=vd,
    )  # fmt: skip
    assert_matches(out, lse, *want)
