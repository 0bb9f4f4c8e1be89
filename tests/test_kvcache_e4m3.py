"""Appending new tokens into an e4m3 KV cache on the CPU: the quantization's contract
(cutefa.api.kvcache_e4m3.quantize: x / descale saturated to +-448, round to nearest even, NaN kept),
the host path of flash_attn_with_kvcache (dense and paged caches, rotary embedding, cache_batch_idx,
cache_leftpad) with the kernel replaced by the emulation of its contract (tests/test_kvcache_api.py),
the argument checks, the op under torch.compile, and the append kernel's compile for sm_90a."""

from __future__ import annotations

import math

import pytest
import torch
from test_kvcache_api import _g, _rand, emulated, reference, rope_reference  # noqa: F401 -- the fixture (usefixtures)

from cutefa import sass
from cutefa.api import kvcache, kvcache_e4m3
from cutefa.model import policy_decode
from cutefa.model.options import CacheDtype, Mask

with_kvcache = kvcache.flash_attn_with_kvcache
BF16 = torch.bfloat16


def test_quantize_saturates_rounds_to_nearest_even_and_keeps_nan():
    x = torch.tensor([1000.0, -1000.0, math.inf, -math.inf, math.nan, 0.0, -0.0, 8.5, 9.5, 1e-9, 460.0])
    got = kvcache_e4m3.quantize(x.reshape(1, 1, 1, -1), torch.ones(1, 1))
    assert got.dtype == torch.float8_e4m3fn
    f = got.float().flatten()
    assert f[:4].tolist() == [448.0, -448.0, 448.0, -448.0]  # saturated, never NaN
    assert math.isnan(f[4])
    assert got.view(torch.uint8).flatten()[5:7].tolist() == [0x00, 0x80]  # signed zeros kept
    # 3 mantissa bits: in [8, 16) the step is 1; the ties 8.5 and 9.5 go to the even mantissas 8 and 10
    assert f[7].item() == 8.0 and f[8].item() == 10.0
    assert f[9].item() == 0.0 and f[10].item() == 448.0
    # the descale divides, per (batch, kv head)
    y = torch.full((2, 1, 3, 4), 6.0)
    d = torch.tensor([[1.0, 2.0, 4.0], [0.5, 8.0, 1000.0]])
    want = torch.tensor([[6.0, 3.0, 1.5], [12.0, 0.75, 0.005859375]])  # 0.006 -> the nearest e4m3
    assert torch.equal(kvcache_e4m3.quantize(y, d).float()[:, 0, :, 0], want)


def _descales(batch, hkv, seed):
    return 0.01 + torch.rand(batch, hkv, generator=_g(seed)) / 20


def _tables(rows, rotary_dim, seed):
    angles = torch.rand(rows, rotary_dim // 2, generator=_g(seed)) * 6.3
    return angles.cos().to(BF16), angles.sin().to(BF16)


def _poisoned(*shape):
    """An e4m3 cache of NaN bytes (0x7F): an unwritten slot that the attention reads shows."""
    return torch.full(shape, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)


def _fill(cache, rows, seed):
    """Random finite e4m3 values (magnitudes up to 1.875) into the cache rows ``rows`` (an index)."""
    shape = cache[rows].shape
    sign = torch.randint(0, 2, shape, generator=_g(seed), dtype=torch.uint8) << 7
    cache.view(torch.uint8)[rows] = (
        torch.randint(0, 0x40, shape, generator=_g(seed + 1), dtype=torch.uint8) | sign
    )


@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
@pytest.mark.parametrize("page_size", [None, 16, 64], ids=["dense", "page16", "page64"])
@pytest.mark.usefixtures("emulated")
def test_append_quantizes_the_new_tokens_into_their_slots(rotary, page_size):
    """Every new slot holds quantize(rotated token) bit for bit, every other byte is unchanged
    (a poisoned cache), and the attention reads the appended tokens."""
    batch, new, hq, hkv, d, rd = 3, 5, 8, 2, 64, 32
    lens = [0, 14, 61]  # 14 + 5 crosses the 16-page boundary, 61 + 5 the 64-page one
    kd, vd = _descales(batch, hkv, 1), _descales(batch, hkv, 2)
    q, k, v = _rand(batch, new, hq, d, seed=4, dtype=BF16), _rand(batch, new, hkv, d, seed=5, dtype=BF16), _rand(
        batch, new, hkv, d, seed=6, dtype=BF16
    )  # fmt: skip
    k[1, 2, 0, 5] = 1000.0  # far past 448 * descale: saturates
    seqlens = torch.tensor(lens, dtype=torch.int32)
    kw = {}
    if rotary is not None:
        kw = dict(zip(("rotary_cos", "rotary_sin"), _tables(100, rd, 7)))
        kw["rotary_interleaved"] = rotary == "interleaved"
    if page_size is None:
        k_cache, v_cache = _poisoned(batch, 80, hkv, d), _poisoned(batch, 80, hkv, d)
    else:
        per_seq = 80 // page_size + 1
        k_cache, v_cache = (
            _poisoned(batch * per_seq + 2, page_size, hkv, d),
            _poisoned(batch * per_seq + 2, page_size, hkv, d),
        )
        kw["page_table"] = torch.randperm(batch * per_seq, generator=_g(8)).int().reshape(batch, per_seq)
    for b, n in enumerate(lens):  # the keys a sequence has: finite; every other slot NaN
        for j in range(n):
            row = (b, j) if page_size is None else (int(kw["page_table"][b, j // page_size]), j % page_size)
            _fill(k_cache, row, 20 + b), _fill(v_cache, row, 30 + b)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out = with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True, k_descale=kd, v_descale=vd, num_splits=2, **kw
    )  # fmt: skip
    pos = seqlens.long()[:, None] + torch.arange(new)
    k_rot = (
        k
        if rotary is None
        else rope_reference(k, kw["rotary_cos"], kw["rotary_sin"], pos, rotary == "interleaved")
    )
    k_rot = k_rot.to(BF16)  # the rotated keys rounded once to q's dtype
    want_k, want_v = kvcache_e4m3.quantize(k_rot, kd), kvcache_e4m3.quantize(v, vd)
    assert want_k.float()[1, 2, 0, 5] == 448.0
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b in range(batch):
        for i in range(new):
            slot = lens[b] + i
            if page_size is None:
                row = (b, slot)
            else:
                row = (int(kw["page_table"][b, slot // page_size]), slot % page_size)
            assert torch.equal(k_cache[row].view(torch.uint8), want_k[b, i].view(torch.uint8)), (b, i)
            assert torch.equal(v_cache[row].view(torch.uint8), want_v[b, i].view(torch.uint8)), (b, i)
            written[row] = True
    for got, was in ((k_cache, before_k), (v_cache, before_v)):
        assert torch.equal(got[~written].view(torch.uint8), was[~written].view(torch.uint8))
    q_rot = (
        q
        if rotary is None
        else rope_reference(q, kw["rotary_cos"], kw["rotary_sin"], pos, rotary == "interleaved")
    )
    for b in range(batch):
        n = lens[b] + new
        if page_size is None:
            keys, vals = k_cache[b, :n], v_cache[b, :n]
        else:
            keys = k_cache[kw["page_table"][b].long()].flatten(0, 1)[:n]
            vals = v_cache[kw["page_table"][b].long()].flatten(0, 1)[:n]
        keys = keys.double() * kd[b].double()[None, :, None]
        vals = vals.double() * vd[b].double()[None, :, None]
        o, _ = reference(q_rot[b : b + 1], keys[None], vals[None], d**-0.5, causal=True)
        torch.testing.assert_close(out[b : b + 1].double(), o, atol=1e-2, rtol=0)


@pytest.mark.usefixtures("emulated")
def test_append_with_cache_batch_idx_and_leftpad():
    batch, new, hq, hkv, d = 2, 3, 4, 2, 64
    kd, vd = _descales(batch, hkv, 11), _descales(batch, hkv, 12)
    q, k, v = (_rand(batch, new, hq, d, seed=s, dtype=BF16) for s in (13, 14, 15))
    k, v = k[:, :, :hkv], v[:, :, :hkv]
    k_cache, v_cache = _poisoned(3, 40, hkv, d), _poisoned(3, 40, hkv, d)
    _fill(k_cache, (slice(None), slice(0, 37)), 17), _fill(v_cache, (slice(None), slice(0, 37)), 18)
    before = k_cache.clone()
    cos, sin = _tables(64, d, 16)
    idx, lens, pad = (torch.tensor(x, dtype=torch.int32) for x in ([2, 0], [10, 37], [4, 0]))
    with_kvcache(
        q,
        k_cache,
        v_cache,
        k.contiguous(),
        v.contiguous(),
        cos,
        sin,
        lens,
        idx,
        pad,
        k_descale=kd,
        v_descale=vd,
    )
    pos = (lens - pad).long()[:, None] + torch.arange(new)  # rotary positions start at the pad
    want_k = kvcache_e4m3.quantize(rope_reference(k, cos, sin, pos, True).to(BF16), kd)
    assert torch.equal(k_cache[2, 10:13].view(torch.uint8), want_k[0].view(torch.uint8))
    assert torch.equal(k_cache[0, 37:40].view(torch.uint8), want_k[1].view(torch.uint8))
    assert torch.equal(v_cache[0, 37:40].view(torch.uint8), kvcache_e4m3.quantize(v, vd)[1].view(torch.uint8))
    assert torch.equal(k_cache[1].view(torch.uint8), before[1].view(torch.uint8))  # no sequence's row


@pytest.mark.parametrize(
    ("k_dtype", "v_dtype", "match"),
    [
        (torch.float16, torch.bfloat16, "k must be torch.bfloat16"),
        (torch.bfloat16, torch.float8_e4m3fn, "v must be torch.bfloat16"),
        (torch.float32, torch.float32, "k must be torch.bfloat16"),
    ],
)
@pytest.mark.usefixtures("emulated")
def test_new_tokens_must_have_q_dtype(k_dtype, v_dtype, match):
    q = _rand(2, 1, 4, 64, dtype=BF16)
    cache = _poisoned(2, 40, 2, 64)
    k, v = _rand(2, 1, 2, 64).to(k_dtype), _rand(2, 1, 2, 64).to(v_dtype)
    with pytest.raises(TypeError, match=match):
        with_kvcache(q, cache, cache.clone(), k, v, cache_seqlens=3)


@pytest.mark.usefixtures("emulated")
def test_descales_are_checked_with_new_tokens():
    q, k = _rand(2, 1, 4, 64, dtype=BF16), _rand(2, 1, 2, 64, dtype=BF16)
    cache = _poisoned(2, 40, 2, 64)
    with pytest.raises(ValueError, match=r"k_descale must have shape \(batch, heads_kv\)"):
        with_kvcache(q, cache, cache.clone(), k, k, cache_seqlens=3, k_descale=torch.ones(2, 1))
    with pytest.raises(TypeError, match="v_descale must be torch.float32"):
        with_kvcache(q, cache, cache.clone(), k, k, cache_seqlens=3, v_descale=torch.ones(2, 2, dtype=BF16))


def test_torch_compile_fullgraph_traces_the_e4m3_append():
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(fullgraph=True, backend=capture)
    def step(q, k_cache, v_cache, k, v, cos, sin, lens, table, kd, vd):
        return with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cos,
            sin,
            lens,
            page_table=table,
            causal=True,
            k_descale=kd,
            v_descale=vd,
        )

    torch._dynamo.reset()
    with FakeTensorMode():
        q = torch.empty(2, 1, 8, 64, dtype=BF16, device="cuda")
        pool = torch.empty(10, 16, 2, 64, dtype=torch.float8_e4m3fn, device="cuda")
        k = torch.empty(2, 1, 2, 64, dtype=BF16, device="cuda")
        cos = torch.empty(64, 16, device="cuda")
        lens = torch.empty(2, dtype=torch.int32, device="cuda")
        table = torch.empty(2, 5, dtype=torch.int32, device="cuda")
        kd = torch.empty(2, 2, device="cuda")
        out = step(q, pool, pool.clone(), k, k.clone(), cos, cos, lens, table, kd, kd.clone())
        assert out.shape == q.shape and out.dtype == q.dtype
    (graph,) = graphs
    names = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert sum("kvcache_attn_e4m3" in n for n in names) == 1, names


# The append kernel of an e4m3 cache, compiled for sm_90a: one launch beside the decode and the
# combine kernels, the IEEE division by the descale, the saturating e4m3 conversion, byte stores
E4M3_APPEND = [
    policy_decode.decode_spec("bf16", 128, 4, mask=Mask.CAUSAL, cache_dtype=CacheDtype.E4M3),
    policy_decode.decode_spec("fp16", 64, 8, paged=True, cache_dtype=CacheDtype.E4M3),
]


@pytest.mark.compile
def test_e4m3_append_kernel_sass_sm90a(tmp_path):
    cubins = sass.dump_cubins(E4M3_APPEND, "sm_90a", tmp_path)
    for spec in E4M3_APPEND:
        text = sass.disassemble(cubins[spec.name])
        assert len(sass.kernel_sections(text)) == 3, spec.name  # append, decode, combine
        forms = sass.opcode_forms(sass.kernel_text(text, "append"))
        assert not any(f.startswith(("LDL", "STL")) for f in forms), forms
        # the keys and the values each quantized at one site, a pair of values at a time
        assert forms.get("F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C", 0) == 2, forms
        assert forms.get("FCHK", 0) >= 2, forms  # div.rn.f32: the full-range check of the division
        assert forms.get("STG.E.U8", 0) == 4, forms
