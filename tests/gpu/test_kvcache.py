"""flash_attn_with_kvcache on a CUDA GPU: the sm80-family decode kernel (templates/decode_sm80.py.j2)
against a float32 reference on the gathered dense cache.

Covered: every page size (16 to 256) with sequences ending mid-page, cache_seqlens 0 and 1, an
append that crosses a page boundary into a NaN-poisoned pool (the new slots hold exactly k and v,
every other byte is unchanged, and no poisoned byte reaches the output), rotary embedding in both
layouts against a reference RoPE, cache_batch_idx, windows and softcap, num_splits 1 to 16 giving
one answer, the lse, q of 1, 4 and 16 tokens with GQA 32/8 and MQA, every head dim, and a decode
step captured in a CUDA graph and replayed on new inputs.

Error bounds: the kernel rounds P to the input dtype before P V and the output once, so its
relative L2 error is a few units of the dtype's rounding (2^-9 bf16, 2^-12 fp16): held to 1e-2
(bf16) and 2e-3 (fp16), the largest element error to 4x the output's own rounding plus 2^-10; the
lse (float32 throughout) to 1e-3 + 1e-5 |lse|. Rows with no key must be exactly 0 with lse -inf.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from gpu_support import load_sibling as _load
from gpu_support import sm80_skip_reason as _skip_reason

import cutefa
from cutefa import dispatch
from cutefa.api import kvcache
from cutefa.compile import compile_variants
from cutefa.model import policy_decode
from cutefa.model.options import Mask
from cutefa.paged import PagedKVCache

ref = _load("reference")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

REL_L2 = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
with_kvcache = kvcache.flash_attn_with_kvcache

# The decode variants these tests run, (dtype, head_dim, packed rows, mask, paged, softcap),
# compiled together up front (tests that need another compile it on first use).
_NONE, _CAUSAL, _LOCAL = Mask.NONE, Mask.CAUSAL, Mask.LOCAL
USED = [
    ("bf16", 128, 4, _NONE, True, False),
    ("bf16", 128, 4, _CAUSAL, True, False),
    ("bf16", 128, 20, _CAUSAL, True, False),
    ("fp16", 64, 4, _CAUSAL, True, False),
    *[("bf16", 128, rows, mask, False, False) for rows in (4, 32, 64, 128) for mask in (_NONE, _CAUSAL)],
    ("fp16", 64, 16, _NONE, False, False),
    ("fp16", 64, 16, _CAUSAL, False, False),
    ("bf16", 128, 4, _LOCAL, False, False),
    ("bf16", 128, 4, _LOCAL, True, False),
    ("bf16", 128, 4, _NONE, True, True),
    ("bf16", 128, 4, _LOCAL, False, True),
    *[(dt, hd, 4, _NONE, False, False) for dt in ("fp16", "bf16") for hd in (64, 96, 128, 192, 256)],
]


@pytest.fixture(scope="module", autouse=True)
def _compiled_up_front():
    """Every variant of :data:`USED` compiled for this GPU in parallel processes (the JIT would
    compile them one by one on first use)."""
    target = dispatch.current_target()
    specs = list(dict.fromkeys(
        policy_decode.decode_spec(dt, hd, rows, mask=mask, paged=paged, softcap=cap)
        for dt, hd, rows, mask, paged, cap in USED
    ))  # fmt: skip
    results = compile_variants(specs, target=target, jobs=min(16, os.cpu_count() or 1), progress=False)
    failed = [f"{r.spec.name}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)


def randn(gen, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def dense_of(pool: torch.Tensor, table: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Keys 0..n-1 of sequence b of a paged pool, as a dense (n, heads_kv, head_dim) tensor."""
    return pool[table[b].long()].flatten(0, 1)[:n]


def cache_of(gen, batch, heads_kv, head_dim, lens, paged, page_size=None, capacity=None):
    """A cache holding sequences of ``lens`` keys: a paged pool of ``page_size`` (:func:`paged_pool`)
    or a dense cache of ``capacity`` rows. Returns (k_cache, v_cache, page_table or None, keys,
    values), keys and values as :func:`reference` takes them (each sequence's rows, dense)."""
    if paged:
        k_cache, v_cache, table = paged_pool(gen, batch, page_size, heads_kv, head_dim, lens, 0)
        keys = [dense_of(k_cache, table, b, n) for b, n in enumerate(lens)]
        values = [dense_of(v_cache, table, b, n) for b, n in enumerate(lens)]
        return k_cache, v_cache, table, keys, values
    k_cache = randn(gen, batch, capacity, heads_kv, head_dim)
    v_cache = randn(gen, batch, capacity, heads_kv, head_dim)
    return k_cache, v_cache, None, k_cache, v_cache


def reference(q, keys, values, lens, **kw):
    """float32 attention of each sequence b of q on keys[b][:lens[b]] (lists of dense tensors)."""
    outs, lses = [], []
    for b, n in enumerate(lens):
        o, l = ref.attention_ref(q[b : b + 1], keys[b][None, :n], values[b][None, :n], **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def assert_matches(out, lse, want_out, want_lse, dtype=None, lse_slack=None):
    """``lse_slack``: (b, hq, sq) float32, an extra lse tolerance per row (the spread that rounding an
    input the kernel computes itself, such as a rotated q, gives the reference)."""
    dtype = dtype or out.dtype
    assert torch.isfinite(out).all(), "NaN or inf in the output"
    empty = torch.isinf(want_lse)  # (b, hq, sq): rows with no key
    if empty.any():
        rows = empty.permute(0, 2, 1)
        assert (out[rows] == 0).all(), "a row with no key is not 0"
        assert torch.isneginf(lse[empty]).all(), "a row with no key has lse other than -inf"
    err = ref.rel_l2(out, want_out)
    assert err <= REL_L2[dtype], f"relative L2 error {err:.2e} > {REL_L2[dtype]:.0e}"
    worst = ref.max_abs(out, want_out)
    bound = 4 * ref.rounding_error(want_out, dtype) + 2.0**-10
    assert worst <= bound, f"largest error {worst:.3e} > {bound:.3e}"
    full = ~empty
    diff = (lse[full].double() - want_lse[full].double()).abs()
    tol = 1e-3 + 1e-5 * want_lse[full].double().abs()
    if lse_slack is not None:
        tol = tol + 2 * lse_slack[full].double()
    assert (diff <= tol).all(), f"lse off by up to {diff.max().item():.2e}"


def rotated_reference(q_rot, dtype, keys, values, lens, causal):
    """The reference on the rotated q rounded to ``dtype`` (what the kernel attends with), and the
    lse slack of that rounding: the kernel rotates q itself, and its rotation may round an element to
    the neighbouring 16-bit value (a fused multiply-add), which moves a row's lse by up to about
    the difference between the references on the rounded and the unrounded q."""
    want_out, want_lse = reference(q_rot.to(dtype), keys, values, lens, causal=causal)
    _, exact_lse = reference(q_rot.float(), keys, values, lens, causal=causal)
    slack = torch.nan_to_num((want_lse - exact_lse).abs(), nan=0.0, posinf=0.0)
    return want_out, want_lse, None, slack


def paged_pool(gen, batch, page_size, heads_kv, head_dim, lens, new, dtype=torch.bfloat16, poison=False):
    """A pool holding ``lens[b]`` random keys/values per sequence in scrambled pages, room for ``new``
    more, two spare pages, everything else NaN when ``poison``; returns (k_pool, v_pool, table)."""
    per_seq = max(1, -(-(max(lens) + new) // page_size))
    pages = batch * per_seq + 2
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(page_size)).int()
    table = order.reshape(batch, per_seq).cuda()
    fill = float("nan") if poison else 0.0
    rows = torch.cat([torch.full((n,), b) for b, n in enumerate(lens)]).cuda()
    keys = torch.cat([torch.arange(n) for n in lens]).cuda()
    pages_of, slots = table[rows, keys // page_size].long(), keys % page_size
    pools = []
    for _ in range(2):
        pool = torch.full((pages, page_size, heads_kv, head_dim), fill, dtype=dtype, device="cuda")
        pool[pages_of, slots] = randn(gen, len(keys), heads_kv, head_dim, dtype=dtype)
        pools.append(pool)
    return pools[0], pools[1], table


# ---------------------------------------------------------------------------------------------
# Paged caches


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_paged_every_page_size(gen, page_size, num_splits):
    batch, hq, hkv, d = 4, 32, 8, 128
    lens = [0, 1, page_size + page_size // 2 + 3, 5 * page_size - 1]  # empty, one key, mid-page
    k_pool, v_pool, table, keys, values = cache_of(gen, batch, hkv, d, lens, True, page_size)
    q = randn(gen, batch, 1, hq, d)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(
        q, k_pool, v_pool, cache_seqlens=seqlens, page_table=table, num_splits=num_splits, return_lse=True
    )
    assert_matches(out, lse, *reference(q, keys, values, lens))


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("new", [1, 5])
def test_paged_append_crosses_a_page_into_a_poisoned_pool(gen, page_size, new):
    """The append writes exactly the new slots (one step crosses a page boundary); every other byte
    of the NaN-poisoned pool is unchanged and no NaN reaches the output."""
    batch, hq, hkv, d = 3, 32, 8, 128
    lens = [page_size - 2, 2 * page_size - 1, 7]
    k_pool, v_pool, table = paged_pool(gen, batch, page_size, hkv, d, lens, new, poison=True)
    before = k_pool.clone(), v_pool.clone()
    q, k, v = randn(gen, batch, new, hq, d), randn(gen, batch, new, hkv, d), randn(gen, batch, new, hkv, d)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(
        q, k_pool, v_pool, k, v, cache_seqlens=seqlens, page_table=table, causal=True, return_lse=True
    )
    written = torch.zeros(k_pool.shape[:2], dtype=torch.bool, device="cuda")
    for b, n in enumerate(lens):
        for i in range(new):
            page, slot = table[b, (n + i) // page_size], (n + i) % page_size
            assert torch.equal(k_pool[page, slot], k[b, i]) and torch.equal(v_pool[page, slot], v[b, i])
            written[page, slot] = True
    for pool, old in zip((k_pool, v_pool), before):
        assert torch.equal(pool[~written].view(torch.int16), old[~written].view(torch.int16)), (
            "a slot changed"
        )
    total = [n + new for n in lens]
    keys = [dense_of(k_pool, table, b, n) for b, n in enumerate(total)]
    values = [dense_of(v_pool, table, b, n) for b, n in enumerate(total)]
    assert_matches(out, lse, *reference(q, keys, values, total, causal=True))


def test_paged_cache_helper_decodes_requests_step_by_step(gen):
    """PagedKVCache: a batch of requests of different prompt lengths, prefilled and then decoded
    token by token, each step checked against the reference on the gathered cache."""
    hq, hkv, d = 16, 4, 64
    cache = PagedKVCache(
        num_pages=64, page_size=16, heads_kv=hkv, head_dim=d, max_seqs=4, dtype=torch.float16
    )
    prompts = [5, 33, 16]
    seqs = [cache.add() for _ in prompts]
    for s, n in zip(seqs, prompts):  # prefill each prompt alone (different lengths)
        table, lens = cache.step([s], n)
        k, v = randn(gen, 1, n, hkv, d, dtype=torch.float16), randn(gen, 1, n, hkv, d, dtype=torch.float16)
        cache.append(k, v, table, lens)
    k_cache, v_cache = cache.layer(0)
    for _ in range(20):  # decode: every sequence one token a step, crossing page boundaries
        table, lens = cache.step(seqs, 1)
        q = randn(gen, len(seqs), 1, hq, d, dtype=torch.float16)
        k, v = (
            randn(gen, len(seqs), 1, hkv, d, dtype=torch.float16),
            randn(gen, len(seqs), 1, hkv, d, dtype=torch.float16),
        )
        out, lse = with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=lens, page_table=table, causal=True, return_lse=True
        )
        gathered = [cache.gather(s) for s in seqs]
        total = [cache.length(s) for s in seqs]
        assert_matches(
            out, lse, *reference(q, [g[0] for g in gathered], [g[1] for g in gathered], total, causal=True)
        )
    cache.check(cache.page_table(seqs), cache.cache_seqlens(seqs))


# ---------------------------------------------------------------------------------------------
# Dense caches


@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (32, 1)], ids=["gqa32_8", "mqa32"])
@pytest.mark.parametrize("seqlen_q", [1, 4, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_query_tokens_and_head_groups(gen, hq, hkv, seqlen_q, causal):
    batch, d, cap = 3, 128, 700
    q = randn(gen, batch, seqlen_q, hq, d)
    k_cache, v_cache = randn(gen, batch, cap, hkv, d), randn(gen, batch, cap, hkv, d)
    lens = [699, 3, 130]  # with 16 causal tokens, sequence 1's first rows see no key
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal, return_lse=True)
    assert_matches(out, lse, *reference(q, k_cache, v_cache, lens, causal=causal))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_many_splits_cross_the_combine_passes(gen, head_dim):
    """Split counts around and past the combine's 32-split passes and its groups of loads in flight
    (cutefa.kernels.sm80.decode_combine), with splits that see no key (the 37-key sequence)."""
    batch, hq, hkv = 3, 16, 4
    q = randn(gen, batch, 1, hq, head_dim)
    k_cache, v_cache = randn(gen, batch, 4096, hkv, head_dim), randn(gen, batch, 4096, hkv, head_dim)
    lens = [4096, 2999, 37]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    want = reference(q, k_cache, v_cache, lens)
    for splits in (15, 16, 17, 31, 32, 33, 47, 64, 100, 256):
        out, lse = with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits, return_lse=True
        )
        assert_matches(out, lse, *want)


def test_num_splits_one_to_sixteen_agree(gen):
    batch, hq, hkv, d = 2, 32, 8, 128
    q = randn(gen, batch, 1, hq, d)
    k_cache, v_cache = randn(gen, batch, 2048, hkv, d), randn(gen, batch, 2048, hkv, d)
    lens = [2048, 1111]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    want = reference(q, k_cache, v_cache, lens)
    first = None
    for splits in range(1, 17):
        out, lse = with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits, return_lse=True
        )
        assert_matches(out, lse, *want)
        if first is None:
            first = out, lse
        torch.testing.assert_close(out.float(), first[0].float(), atol=2e-2, rtol=0)
        torch.testing.assert_close(lse, first[1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_cache_seqlens_zero_and_one(gen, causal):
    batch, sq, hq, hkv, d = 4, 4, 8, 2, 64
    q = randn(gen, batch, sq, hq, d, dtype=torch.float16)
    k_cache, v_cache = (
        randn(gen, batch, 40, hkv, d, dtype=torch.float16),
        randn(gen, batch, 40, hkv, d, dtype=torch.float16),
    )
    lens = [0, 1, 0, 1]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for splits in (1, 4):
        out, lse = with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal, num_splits=splits, return_lse=True
        )
        assert_matches(out, lse, *reference(q, k_cache, v_cache, lens, causal=causal))
        assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()


def test_dense_append_into_a_poisoned_cache_and_cache_batch_idx(gen):
    """cache_batch_idx maps sequences to cache rows; the append writes exactly the new slots of the
    mapped rows and NaN past the lengths never reaches the output."""
    batch, sq, hq, hkv, d, cap = 3, 2, 8, 2, 64, 300
    k_cache = torch.full((5, cap, hkv, d), float("nan"), dtype=torch.float16, device="cuda")
    v_cache = k_cache.clone()
    lens = [150, 0, 297]
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    for b, n in enumerate(lens):
        k_cache[idx[b], :n] = randn(gen, n, hkv, d, dtype=torch.float16)
        v_cache[idx[b], :n] = randn(gen, n, hkv, d, dtype=torch.float16)
    before = k_cache.clone(), v_cache.clone()
    q, k, v = (randn(gen, batch, sq, h, d, dtype=torch.float16) for h in (hq, hkv, hkv))
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_batch_idx=idx, causal=True, return_lse=True
    )
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device="cuda")
    for b, n in enumerate(lens):
        assert torch.equal(k_cache[idx[b], n : n + sq], k[b]) and torch.equal(
            v_cache[idx[b], n : n + sq], v[b]
        )
        written[idx[b], n : n + sq] = True
    for cache, old in zip((k_cache, v_cache), before):
        assert torch.equal(cache[~written].view(torch.int16), old[~written].view(torch.int16))
    total = [n + sq for n in lens]
    keys = [k_cache[i] for i in idx.tolist()]
    values = [v_cache[i] for i in idx.tolist()]
    assert_matches(out, lse, *reference(q, keys, values, total, causal=True))


def rope_reference(x, cos, sin, positions, interleaved):
    """Rotary embedding in float32 with cos and sin rounded to x's dtype first, as the kernel takes
    them: pairs (2i, 2i + 1) as complex numbers, or the halves."""
    half = cos.shape[1]
    c, s = (t.to(x.dtype).float()[positions][:, :, None] for t in (cos, sin))
    x = x.float()
    head, tail = x[..., : 2 * half], x[..., 2 * half :]
    if interleaved:
        z = torch.view_as_complex(head.reshape(*head.shape[:-1], half, 2).contiguous())
        turned = torch.view_as_real(z * torch.complex(c, s)).flatten(-2)
    else:
        x1, x2 = head[..., :half], head[..., half:]
        turned = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    return torch.cat((turned, tail), -1)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("paged", [False, True])
def test_rotary_on_q_and_the_appended_keys(gen, interleaved, causal, paged):
    batch, sq, hq, hkv, d, rd, cap = 2, 3, 16, 4, 128, 64, 256
    angles = torch.rand(cap, rd // 2, generator=gen, device="cuda") * 2 * math.pi
    cos, sin = angles.cos(), angles.sin()
    lens = [37, 200]
    q, k, v = randn(gen, batch, sq, hq, d), randn(gen, batch, sq, hkv, d), randn(gen, batch, sq, hkv, d)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if paged:
        k_cache, v_cache, table = paged_pool(gen, batch, 16, hkv, d, lens, sq)
    else:
        k_cache, v_cache, table = randn(gen, batch, cap, hkv, d), randn(gen, batch, cap, hkv, d), None
    out, lse = with_kvcache(
        q, k_cache, v_cache, k, v, cos, sin, seqlens, page_table=table, causal=causal, rotary_interleaved=interleaved,
        return_lse=True,
    )  # fmt: skip
    positions = seqlens.long()[:, None] + torch.arange(sq, device="cuda")
    k_rot = rope_reference(k, cos, sin, positions, interleaved)
    q_rot = rope_reference(q, cos, sin, positions if causal else seqlens.long()[:, None], interleaved)
    total = [n + sq for n in lens]
    keys = [dense_of(k_cache, table, b, n) if paged else k_cache[b, :n] for b, n in enumerate(total)]
    values = [dense_of(v_cache, table, b, n) if paged else v_cache[b, :n] for b, n in enumerate(total)]
    for b, n in enumerate(lens):
        torch.testing.assert_close(keys[b][n:].float(), k_rot[b], atol=2e-2, rtol=1e-2)
    # the attention against the rotated q (the kernel sees q and k rounded to bf16 after rotation)
    assert_matches(out, lse, *rotated_reference(q_rot, q.dtype, keys, values, total, causal))


@pytest.mark.parametrize(
    ("window", "causal", "softcap", "paged"),
    [((64, -1), True, 0.0, False), ((100, 20), False, 0.0, True), ((-1, -1), False, 30.0, True),
     ((40, 0), False, 15.0, False), ((0, 0), False, 0.0, True)],
)  # fmt: skip
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_window_and_softcap(gen, window, causal, softcap, paged, seqlen_q):
    batch, hq, hkv, d = 3, 16, 4, 128
    lens = [500, 10, 257]
    q = randn(gen, batch, seqlen_q, hq, d)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    k_cache, v_cache, table, keys, values = cache_of(gen, batch, hkv, d, lens, paged, 32, 512)
    for splits in (1, 5):
        out, lse = with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table, causal=causal, window_size=window,
            softcap=softcap, num_splits=splits, return_lse=True,
        )  # fmt: skip
        want = reference(q, keys, values, lens, causal=causal, window_size=window, softcap=softcap)
        assert_matches(out, lse, *want)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_head_dim(gen, head_dim, dtype):
    batch, hq, hkv = 2, 8, 2
    lens = [333, 1000]
    q = randn(gen, batch, 1, hq, head_dim, dtype=dtype)
    k_cache, v_cache = (
        randn(gen, batch, 1000, hkv, head_dim, dtype=dtype),
        randn(gen, batch, 1000, hkv, head_dim, dtype=dtype),
    )
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=4, return_lse=True)
    assert_matches(out, lse, *reference(q, k_cache, v_cache, lens))


# ---------------------------------------------------------------------------------------------
# CUDA graphs


def test_a_decode_step_replays_in_a_cuda_graph(gen):
    """Append (with rotary) and attention captured once, replayed on new q/k/v and lengths written
    into the captured tensors: the same results as eager calls; nothing is read on the host."""
    batch, hq, hkv, d, page_size = 4, 32, 8, 128, 16
    lens0 = [17, 100, 1, 250]
    k_pool, v_pool, table = paged_pool(gen, batch, page_size, hkv, d, [n + 3 for n in lens0], 1)
    angles = torch.rand(512, 32, generator=gen, device="cuda") * 6
    cos, sin = angles.cos(), angles.sin()
    q, k, v = randn(gen, batch, 1, hq, d), randn(gen, batch, 1, hkv, d), randn(gen, batch, 1, hkv, d)
    seqlens = torch.tensor(lens0, dtype=torch.int32, device="cuda")

    def step():
        return with_kvcache(
            q, k_pool, v_pool, k, v, cos, sin, seqlens, page_table=table, causal=True, return_lse=True
        )

    step()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for shift in (1, 2, 3):
        q.copy_(randn(gen, batch, 1, hq, d))
        k.copy_(randn(gen, batch, 1, hkv, d))
        v.copy_(randn(gen, batch, 1, hkv, d))
        seqlens.copy_(torch.tensor([n + shift for n in lens0], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone(), lse.clone()
        eager = step()
        torch.testing.assert_close(replayed[0], eager[0], atol=0, rtol=0)
        torch.testing.assert_close(replayed[1], eager[1], atol=0, rtol=0)
        total = [n + shift + 1 for n in lens0]
        keys = [dense_of(k_pool, table, b, n) for b, n in enumerate(total)]
        values = [dense_of(v_pool, table, b, n) for b, n in enumerate(total)]
        q_rot = rope_reference(q, cos, sin, seqlens.long()[:, None], True)
        assert_matches(
            replayed[0], replayed[1], *rotated_reference(q_rot, q.dtype, keys, values, total, True)
        )


def test_public_export_matches_the_module():
    """The package exports the function (cutefa.flash_attn_with_kvcache) once the lead adds it."""
    exported = getattr(cutefa, "flash_attn_with_kvcache", None)
    assert exported is None or exported is kvcache.flash_attn_with_kvcache
