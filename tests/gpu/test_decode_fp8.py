"""flash_attn_with_kvcache on an e4m3 KV cache (k_cache/v_cache torch.float8_e4m3fn, q 16-bit,
k_descale/v_descale per (batch, kv head)) on a Hopper GPU: the decode kernel with the kv_e4m3 option
(templates/decode_sm80.py.j2, kernels/sm80/decode_fp8.py) against a float32 reference on the
dequantized cache (stored * descale).

Covered: dense and paged caches (page sizes 16 and 64, scrambled pages, NaN-poisoned slots past each
sequence and spare pages), GQA 32/8 and MQA, 1 and 4 query tokens, lengths 1, 17, 1000 and 8192 in
one batch, cache_seqlens 0, num_splits 1 to 8 giving one answer, causal, a window with softcap, fp16
and bf16 q, head dims 64 and 128, and outputs and split workspaces allocated from NaN-poisoned
memory (every element must be written).

Appends (k/v given): new tokens quantized into dense and paged caches (page sizes 16 and 64, an
append crossing a page boundary, cache_seqlens 0), with and without rotary embedding (both
layouts): every new slot holds torch's quantization of the reference (rotated) token bit for bit
(cutefa.api.kvcache_e4m3.quantize of cutefa.api.kvcache_reference.rotate), every other byte of the
NaN-poisoned cache is unchanged, tokens past 448 * descale saturate and NaN stays NaN, and the
attention over the appended cache matches a float32 reference on the dequantized cache; a step
replays in a CUDA graph.

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
from cutefa.api import kvcache, kvcache_e4m3, kvcache_reference
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
    ("bf16", 128, 12, Mask.CAUSAL, False, False),  # appends of 3 tokens, GQA 32/8
    ("bf16", 128, 12, Mask.CAUSAL, True, False),
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


# ---------------------------------------------------------------------------------------------
# Appends into an e4m3 cache

APPEND_LENS = [0, 14, 62, 1000]  # 14 + 3 crosses a 16-key page, 62 + 3 a 64-key page
NEW = 3


def rotary_tables(gen, rows, rotary_dim, dtype=torch.bfloat16):
    angles = torch.rand(rows, rotary_dim // 2, generator=gen, device="cuda") * 6.3
    return angles.cos().to(dtype), angles.sin().to(dtype)


def slots_of(lens, page_size, table):
    """(cache row index, slot index) int64 tensors (batch, NEW) of each new token's slot."""
    pos = torch.tensor(lens, device="cuda")[:, None] + torch.arange(NEW, device="cuda")
    if page_size is None:
        return torch.arange(len(lens), device="cuda")[:, None].expand_as(pos), pos
    return table.long().gather(1, pos // page_size), pos % page_size


def gathered(cache8, lens, page_size, table):
    """A dense (batch, max(lens) + NEW, heads, d) copy of the cache's sequences (e4m3; gathered as
    bytes)."""
    if page_size is None:
        return cache8
    n = max(lens) + NEW
    return cache8.view(torch.uint8)[table.long()].flatten(1, 2)[:, :n].view(torch.float8_e4m3fn)


def assert_attention(out, lse, want_out, want_lse):
    """q is rotated by the kernel (its products may be fused: one rounding from the reference's):
    relative L2 and lse only."""
    assert torch.isfinite(out).all(), "NaN or inf in the output"
    err = ref.rel_l2(out, want_out)
    assert err <= REL_L2[out.dtype], f"relative L2 error {err:.2e}"
    diff = (lse.double() - want_lse.double()).abs()
    assert (diff <= 2e-3 + 1e-5 * want_lse.double().abs()).all(), f"lse off by {diff.max().item():.2e}"


@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
@pytest.mark.parametrize("page_size", [None, 16, 64], ids=["dense", "page16", "page64"])
def test_append_into_e4m3_cache(gen, page_size, rotary):
    hq, hkv, d = 32, 8, 128
    lens = APPEND_LENS
    cap = max(lens) + NEW + 13
    q = randn(gen, len(lens), NEW, hq, d)
    k8, kd = quantize(randn(gen, len(lens), cap, hkv, d) * 3, lens)  # NaN past each sequence's keys
    v8, vd = quantize(randn(gen, len(lens), cap, hkv, d), lens)
    k, v = randn(gen, len(lens), NEW, hkv, d) * 3, randn(gen, len(lens), NEW, hkv, d)
    k[1, 2, 3, 7] = 1e4  # far past 448 * descale: saturates
    v[3, 0, 5, 1] = -1e4
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kw, table = {}, None
    if rotary is not None:
        kw["rotary_cos"], kw["rotary_sin"] = rotary_tables(gen, cap, 64)  # rotary_dim 64 < head_dim
        kw["rotary_interleaved"] = rotary == "interleaved"
    if page_size is not None:
        (k8, table), (v8, _) = paged(k8, page_size, 4), paged(v8, page_size, 4)
        kw["page_table"] = table
    before_k, before_v = k8.clone(), v8.clone()
    poison_the_allocator()
    out, lse = with_kvcache(
        q, k8, v8, k, v, cache_seqlens=seqlens, causal=True, return_lse=True, k_descale=kd, v_descale=vd, **kw
    )  # fmt: skip
    torch.cuda.synchronize()
    # the new slots: torch's quantization of the reference (rotated) tokens, bit for bit
    k_new, q_ref = k, q
    if rotary is not None:
        start = kvcache_reference.rotary_start(seqlens, None)
        pos = kvcache_reference.query_positions(start, NEW, True)
        k_new = kvcache_reference.rotate(k, kw["rotary_cos"], kw["rotary_sin"], pos, kw["rotary_interleaved"])
        q_ref = kvcache_reference.rotate(q, kw["rotary_cos"], kw["rotary_sin"], pos, kw["rotary_interleaved"])
    want_k, want_v = kvcache_e4m3.quantize(k_new, kd), kvcache_e4m3.quantize(v, vd)
    assert want_k.float()[1, 2, 3].abs().max() == E4M3_MAX and want_v.float()[3, 0, 5, 1] == -E4M3_MAX
    rows, slots = slots_of(lens, page_size, table)
    for got, want, was in ((k8, want_k, before_k), (v8, want_v, before_v)):
        new_bytes = got.view(torch.uint8)[rows, slots]
        assert torch.equal(new_bytes, want.view(torch.uint8)), (
            f"{(new_bytes != want.view(torch.uint8)).sum().item()} new bytes differ from torch's quantization"
        )
        # every other byte unchanged: put the new slots back to what they were and compare all
        restored = got.view(torch.uint8).clone()
        restored[rows, slots] = was.view(torch.uint8)[rows, slots]
        assert torch.equal(restored, was.view(torch.uint8)), "a byte outside the new slots changed"
    # the attention reads the appended tokens (float32 reference on the dequantized cache)
    keys = dequantized(gathered(k8, lens, page_size, table), kd)
    values = dequantized(gathered(v8, lens, page_size, table), vd)
    want = reference(q_ref, keys, values, [n + NEW for n in lens], causal=True)
    assert_attention(out, lse, *want)


def test_append_saturates_and_keeps_nan(gen):
    """Values past 448 * descale (inf included) store +-448; NaN stores a NaN byte."""
    lens = [5, 0]
    q = randn(gen, 2, NEW, 32, 128)
    k8, kd = quantize(randn(gen, 2, 20, 8, 128), [5, 1])
    v8, vd = quantize(randn(gen, 2, 20, 8, 128), [5, 1])
    k, v = randn(gen, 2, NEW, 8, 128), randn(gen, 2, NEW, 8, 128)
    k[0, 0, 0, :4] = torch.tensor([1e30, -1e30, float("inf"), float("-inf")], dtype=k.dtype)
    k[1, 1, 2, 9] = float("nan")
    v[0, 2, 7, 100] = float("nan")
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    with_kvcache(q, k8, v8, k, v, cache_seqlens=seqlens, causal=True, k_descale=kd, v_descale=vd)
    torch.cuda.synchronize()
    assert k8[0, 5, 0, :4].float().tolist() == [E4M3_MAX, -E4M3_MAX, E4M3_MAX, -E4M3_MAX]
    rows, slots = slots_of(lens, None, None)
    for got, new, descale in ((k8, k, kd), (v8, v, vd)):
        stored = got.view(torch.uint8)[rows, slots].view(torch.float8_e4m3fn)
        want = kvcache_e4m3.quantize(new, descale)
        nan = want.float().isnan()
        assert nan.sum().item() == 1 and torch.equal(stored.float().isnan(), nan), "a NaN was not kept"
        assert torch.equal(stored.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])


def test_an_e4m3_append_step_replays_in_a_cuda_graph(gen):
    lens = [20, 300, 0]
    q = randn(gen, 3, NEW, 32, 128)
    k8, kd = quantize(randn(gen, 3, 400, 8, 128), [400, 400, 400])
    v8, vd = quantize(randn(gen, 3, 400, 8, 128), [400, 400, 400])
    k, v = randn(gen, 3, NEW, 8, 128), randn(gen, 3, NEW, 8, 128)
    cos, sin = rotary_tables(gen, 400, 128)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def step(kc, vc):
        return with_kvcache(
            q, kc, vc, k, v, cos, sin, seqlens, causal=True, return_lse=True, k_descale=kd, v_descale=vd
        )

    step(k8.clone(), v8.clone())
    torch.cuda.synchronize()
    kc, vc = k8.clone(), v8.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step(kc, vc)
    for shift in (0, 9):
        kc.copy_(k8)
        vc.copy_(v8)
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32, device="cuda") + shift)
        graph.replay()
        torch.cuda.synchronize()
        now = [n + shift for n in lens]
        start = kvcache_reference.rotary_start(seqlens, None)
        pos = kvcache_reference.query_positions(start, NEW, True)
        want_k = kvcache_e4m3.quantize(kvcache_reference.rotate(k, cos, sin, pos, True), kd)
        rows, slots = slots_of(now, None, None)
        assert torch.equal(kc.view(torch.uint8)[rows, slots], want_k.view(torch.uint8)), f"shift {shift}"
        assert torch.equal(vc.view(torch.uint8)[rows, slots], kvcache_e4m3.quantize(v, vd).view(torch.uint8))
        keys, values = dequantized(kc, kd), dequantized(vc, vd)
        q_ref = kvcache_reference.rotate(q, cos, sin, pos, True)
        want = reference(q_ref, keys, values, [n + NEW for n in now], causal=True)
        assert_attention(out, lse, *want)
