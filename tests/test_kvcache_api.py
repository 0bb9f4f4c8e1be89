"""flash_attn_with_kvcache on the CPU: argument checks that name the argument, the decode variants
and their rules, the split heuristic, the key blocks each split walks, the page allocator, the
fake implementations under torch.compile, and the whole host path (append, rotary, page tables,
splits and combine) against a float64 reference with the kernel replaced by an emulation of its
contract, CTA by CTA."""

from __future__ import annotations

import math

import pytest
import torch

from cutefa import codegen, dispatch
from cutefa.api import kvcache, kvcache_e4m3, kvcache_reference, validate
from cutefa.api.features import UNBOUNDED
from cutefa.kernels.sm80 import decode_rows
from cutefa.model import policy_decode
from cutefa.model.options import CacheDtype, Mask
from cutefa.model.rules import why_invalid, why_no_kernel, why_not_on
from cutefa.model.spec import HEAD_DIMS, Features, VariantSpec, parse_name
from cutefa.paged import OutOfPagesError, PagedKVCache

SECTORS = policy_decode.DecodeCopy.SECTORS

with_kvcache = kvcache.flash_attn_with_kvcache


# ---------------------------------------------------------------------------------------------
# The kernel's contract, emulated CTA by CTA on CPU tensors


def emulate_append(
    spec, q_in, q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens, cache_map, leftpad, inter, descales=None
):
    """What the append launch of templates/decode_sm80.py.j2 computes (kernels/sm80/decode_append.py):
    token t of sequence b into slot cache_seqlens[b] + t unless past the capacity, k rotated at
    cache_seqlens[b] - cache_leftpad[b] + t, q per token (causal, local) or at the first position,
    positions clamped to the rotary table; an e4m3 cache (``descales``: (k, v) (batch, heads_kv))
    takes each new token quantized with its sequence's descales."""
    seqlen_new, half, sq = k_new.shape[1], cos.shape[1], q.shape[1]
    if seqlen_new + half == 0:
        return
    paged = spec.features.paged_kv
    capacity = cache_map.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]

    def turned(x, pos):  # x (heads, d) at a clamped position, float32 and rounded once
        pos = torch.tensor([[max(min(pos, cos.shape[0] - 1), 0)]])
        return kvcache_reference.rotate(x[None, None], cos, sin, pos, bool(inter))[0, 0]

    for b in range(q.shape[0]):
        start = int(seqlens[b])
        first = start - (int(leftpad[b]) if leftpad is not None and leftpad.numel() else 0)
        for t in range(max(seqlen_new, sq)):
            slot = start + t
            if t < seqlen_new and slot < capacity:
                if paged:
                    row, slot = int(cache_map[b, slot // k_cache.shape[1]]), slot % k_cache.shape[1]
                else:
                    row = int(cache_map[b]) if cache_map.numel() else b
                k_row, v_row = turned(k_new[b, t], first + t), v_new[b, t]
                if descales is not None:
                    k_row = kvcache_e4m3.quantize(k_row[None, None], descales[0][b : b + 1])[0, 0]
                    v_row = kvcache_e4m3.quantize(v_row[None, None], descales[1][b : b + 1])[0, 0]
                k_cache[row, slot] = k_row
                v_cache[row, slot] = v_row
            if half and t < sq:
                q[b, t] = turned(q_in[b, t], first + t if spec.mask is not Mask.NONE else first)


def emulate_decode(spec, device, q_in, q, k_cache, v_cache, k_new, v_new, cos, sin, out, lse, o_part, lse_part,
                   seqlens, cache_map, *rest):  # fmt: skip
    """What templates/decode_sm80.py.j2 computes, from its arguments: the append, then per (batch,
    kv head, row tile, split) the key blocks of decode_rows.key_blocks / split_blocks, each packed
    row's band, a partial softmax per split, and the combine. float64."""
    rest = list(rest)
    leftpad = None if spec.features.paged_kv else rest.pop(0)
    descales = (rest.pop(0), rest.pop(0)) if spec.options.kv_e4m3 else None  # (batch, heads_kv)
    scale, inter = rest.pop(0), rest.pop(0)
    emulate_append(
        spec, q_in, q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens, cache_map, leftpad, inter, descales
    )
    seqlen_new = k_new.shape[1]
    if spec.mask is Mask.LOCAL:
        wl, wr = rest.pop(0), rest.pop(0)
    else:
        wl, wr = UNBOUNDED, 0 if spec.mask is Mask.CAUSAL else UNBOUNDED
    cap = rest.pop(0) if spec.features.softcap else 0.0
    assert not rest
    batch, sq, hq, d = q.shape
    hkv = k_cache.shape[2]
    group, rows = hq // hkv, (hq // hkv) * sq
    paged = spec.features.paged_kv
    capacity = cache_map.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    splits = lse_part.shape[0]
    tm, tn = spec.tile_m, spec.tile_n
    for b in range(batch):
        left = min(int(leftpad[b]), capacity) if leftpad is not None and leftpad.numel() else 0
        sk = max(min(int(seqlens[b]) + seqlen_new, capacity) - left, 0)
        if paged:
            ps = k_cache.shape[1]
            idx = [(int(cache_map[b, j // ps]), j % ps) for j in range(sk)]
            keys = torch.stack([k_cache[p, o] for p, o in idx]) if idx else k_cache.new_zeros(0, hkv, d)
            vals = torch.stack([v_cache[p, o] for p, o in idx]) if idx else k_cache.new_zeros(0, hkv, d)
        else:
            row = int(cache_map[b]) if cache_map.numel() else b
            keys, vals = k_cache[row, left : left + sk], v_cache[row, left : left + sk]
        if descales is not None:  # an e4m3 cache: sequence b's values are descale[b, h] * stored
            keys = keys.double() * descales[0][b].double()[None, :, None]
            vals = vals.double() * descales[1][b].double()[None, :, None]
        for h in range(hkv):
            for row0 in range(0, rows, tm):
                t_first, t_last = row0 // group, (min(row0 + tm, rows) - 1) // group
                nf, nl, uf, ul = decode_rows.key_blocks(t_first, t_last, tn, sq, sk, wl, wr)
                assert nf <= uf <= ul <= nl
                for r in range(row0, min(row0 + tm, rows)):
                    lo, hi = decode_rows.token_band(r // group, sq, sk, wl, wr)
                    if uf < ul:  # unmasked blocks: whole, inside every band
                        assert lo <= uf * tn and ul * tn <= hi and ul * tn <= sk
                    assert hi <= lo or nf * tn <= lo < hi <= nl * tn  # no key outside the blocks
                for s in range(splits):
                    first, last = decode_rows.split_blocks(nf, nl, s, splits)
                    for r in range(row0, min(row0 + tm, rows)):
                        t, g = divmod(r, group)
                        head = h * group + g
                        lo, hi = decode_rows.token_band(t, sq, sk, wl, wr)
                        js = [j for j in range(first * tn, min(last * tn, sk)) if lo <= j < hi]
                        if js:
                            sc = (keys[js, h].double() @ q[b, t, head].double()) * scale
                            if cap:
                                sc = cap * torch.tanh(sc / cap)
                            l = torch.logsumexp(sc, 0)
                            o = torch.softmax(sc, 0) @ vals[js, h].double()
                        else:
                            l, o = (
                                torch.tensor(-math.inf, dtype=torch.float64),
                                torch.zeros(d, dtype=torch.float64),
                            )
                        if splits == 1:
                            out[b, t, head], lse[b, head, t] = o.to(out.dtype), l
                        else:
                            o_part[s, b, t, head], lse_part[s, b, head, t] = o, l
    if splits > 1:  # the combine kernel
        total = torch.logsumexp(lse_part.double(), 0)
        w = torch.where(torch.isinf(total), 0.0, torch.exp(lse_part.double() - total))  # (s, b, hq, sq)
        out.copy_((w.permute(0, 1, 3, 2)[..., None] * o_part.double()).sum(0).to(out.dtype))
        lse.copy_(total)


@pytest.fixture
def emulated(monkeypatch):
    """CPU tensors accepted, an H100 pretended (132 SMs, sm_90a), the kernel the emulation; returns
    the list of (spec, splits) launched."""
    launched = []

    def launch(kernel, device, *args):
        launched.append((kernel, args[11].shape[0]))
        emulate_decode(kernel, device, *args)

    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kvcache, "get_kernel", lambda spec, target: spec)
    monkeypatch.setattr(kvcache, "_launch", launch)
    monkeypatch.setattr(dispatch, "device_target", lambda device=None: ("sm_90a", "NVIDIA H100"))
    monkeypatch.setattr(kvcache, "sm_count", lambda device: 132)
    return launched


def reference(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    """float64 attention of q (b, sq, hq, d) on dense k, v (b, sk, hkv, d) per sequence lengths
    given by k's rows (lists allowed: one tensor per sequence), bottom-right masks."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        kb, vb = k[b].double(), v[b].double()
        sq, sk, group = q.shape[1], kb.shape[0], q.shape[2] // kb.shape[1]
        kb, vb = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[b].double(), kb) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
        left, right = window
        allowed = torch.ones(sq, sk, dtype=torch.bool)
        if causal or right >= 0:
            allowed &= j <= i + (0 if causal else right)
        if left >= 0:
            allowed &= j >= i - left
        s = s.masked_fill(~allowed, -math.inf)
        l = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isinf(l), 0.0, l)[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", p, vb))
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


def rope_reference(x, cos, sin, pos, interleaved):
    """Rotary embedding by complex multiplication (interleaved) or by halves (GPT-NeoX), float64."""
    half = cos.shape[1]
    x = x.double()
    c, s = cos.double()[pos][:, :, None], sin.double()[pos][:, :, None]
    head, tail = x[..., : 2 * half], x[..., 2 * half :]
    if interleaved:
        z = torch.view_as_complex(head.reshape(*head.shape[:-1], half, 2).contiguous())
        turned = torch.view_as_real(z * torch.complex(c, s)).flatten(-2)
    else:
        x1, x2 = head[..., :half], head[..., half:]
        turned = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    return torch.cat((turned, tail), -1)


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _rand(*shape, seed=0, dtype=torch.float16):
    return torch.randn(*shape, generator=_g(seed)).to(dtype)


# ---------------------------------------------------------------------------------------------
# Argument checks


def _inputs(batch=2, sq=1, hq=4, hkv=2, d=64, seqlen_cache=40, dtype=torch.float16):
    q = _rand(batch, sq, hq, d, seed=1, dtype=dtype)
    k_cache = _rand(batch, seqlen_cache, hkv, d, seed=2, dtype=dtype)
    v_cache = _rand(batch, seqlen_cache, hkv, d, seed=3, dtype=dtype)
    return q, k_cache, v_cache


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            {"cache_leftpad": torch.zeros(2, dtype=torch.int64)},
            TypeError,
            "cache_leftpad must be torch.int32",
        ),
        ({"cache_leftpad": torch.zeros(3, dtype=torch.int32)}, ValueError, "cache_leftpad must have shape"),
        ({"alibi_slopes": torch.zeros(4)}, NotImplementedError, "alibi_slopes"),
        ({"num_splits": -1}, ValueError, "num_splits"),
        ({"num_splits": True}, TypeError, "num_splits"),
        ({"num_splits": 1000}, ValueError, "num_splits"),
        (
            {"cache_seqlens": torch.zeros(2, dtype=torch.int64)},
            TypeError,
            "cache_seqlens must be torch.int32",
        ),
        ({"cache_seqlens": torch.zeros(3, dtype=torch.int32)}, ValueError, "cache_seqlens must have shape"),
        ({"cache_batch_idx": torch.zeros(2)}, TypeError, "cache_batch_idx must be torch.int32"),
        ({"k": _rand(2, 1, 2, 64)}, ValueError, "k and v"),
        (
            {"rotary_cos": torch.ones(8, 16), "rotary_sin": torch.ones(8, 16)},
            ValueError,
            "rotary_cos/rotary_sin",
        ),
        ({"rotary_cos": torch.ones(8, 16)}, ValueError, "rotary_cos and rotary_sin"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"window_size": (-2, 0)}, ValueError, "window_size"),
        ({"softmax_scale": 0.0}, ValueError, "softmax_scale"),
        ({"rotary_interleaved": 1}, TypeError, "rotary_interleaved"),
    ],
)
def test_bad_arguments_are_named(emulated, change, error, match):
    q, k_cache, v_cache = _inputs()
    with pytest.raises(error, match=match):
        with_kvcache(q, k_cache, v_cache, **change)


def test_bad_tensors_are_named(emulated):
    q, k_cache, v_cache = _inputs()
    with pytest.raises(NotImplementedError, match="fp8"):
        with_kvcache(
            q.to(torch.float8_e4m3fn), k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        )
    with pytest.raises(TypeError, match="both torch.float8_e4m3fn"):
        with_kvcache(q, k_cache.to(torch.float8_e4m3fn), v_cache)
    with pytest.raises(TypeError, match="one dtype"):
        with_kvcache(q, k_cache.bfloat16(), v_cache.bfloat16())
    with pytest.raises(ValueError, match="one shape"):
        with_kvcache(q, k_cache, v_cache[:, :-1])
    with pytest.raises(ValueError, match="multiple of the cache's heads"):
        with_kvcache(_rand(2, 1, 3, 64), k_cache, v_cache)
    with pytest.raises(ValueError, match="head_dim=48"):
        with_kvcache(q[..., :48], k_cache[..., :48], v_cache[..., :48])
    with pytest.raises(ValueError, match="cache_batch_idx to map them"):
        with_kvcache(_rand(3, 1, 4, 64), k_cache, v_cache)
    wide = _rand(2, 40, 2, 68)[..., :64]  # rows of 136 bytes
    with pytest.raises(ValueError, match="k_cache must have a contiguous head_dim and strides"):
        with_kvcache(q, wide, wide)
    with pytest.raises(ValueError, match="cache_seqlens must be given with k and v"):
        with_kvcache(q, k_cache, v_cache, _rand(2, 1, 2, 64), _rand(2, 1, 2, 64))
    with pytest.raises(ValueError, match="k must have shape"):
        with_kvcache(q, k_cache, v_cache, _rand(2, 1, 4, 64), _rand(2, 1, 4, 64), cache_seqlens=3)


def test_paged_arguments_are_checked(emulated):
    q = _rand(2, 1, 4, 64)
    pool = _rand(6, 16, 2, 64)
    table = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="page_table must be torch.int32"):
        with_kvcache(q, pool, pool, page_table=table.long())
    with pytest.raises(ValueError, match="page_table must have shape"):
        with_kvcache(q, pool, pool, page_table=table[:1])
    with pytest.raises(ValueError, match="power of two"):
        with_kvcache(q, pool[:, :12], pool[:, :12], page_table=table)
    with pytest.raises(ValueError, match="one shape"):  # k and v of different page sizes
        with_kvcache(q, pool, pool[:, :8], page_table=table)
    with pytest.raises(ValueError, match="cache_batch_idx is for a dense cache"):
        with_kvcache(q, pool, pool, page_table=table, cache_batch_idx=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_leftpad is for a dense cache"):
        with_kvcache(q, pool, pool, page_table=table, cache_leftpad=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="pass the page table once"):
        with_kvcache(q, pool, pool, block_table=table, page_table=table.clone())
    with_kvcache(
        q, pool, pool, block_table=table, page_table=table, cache_seqlens=torch.zeros(2, dtype=torch.int32)
    )


# ---------------------------------------------------------------------------------------------
# Variants, rules, rendering


@pytest.mark.parametrize("rows", [1, 4, 16, 17, 32, 64, 65, 128, 512])
def test_row_tile_packs_rows_into_the_fewest_slabs(rows):
    tile_m, warps = policy_decode.row_tile(rows)
    assert tile_m == 16 * warps and warps in (1, 2, 4, 8)
    assert tile_m >= min(rows, 128) and (warps == 1 or tile_m // 2 < rows)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("rows", [4, 32, 64, 128])
def test_decode_specs_are_valid_and_render_from_the_decode_template(head_dim, rows):
    for mask in Mask:
        for paged in (False, True):
            for softcap in (False, True):
                spec = policy_decode.decode_spec(
                    "bf16", head_dim, rows, mask=mask, paged=paged, softcap=softcap
                )
                assert why_invalid(spec) is None, spec.name
                assert codegen.template_name(spec) == "decode_sm80.py.j2"
                lines = "_lcp" if policy_decode.lines_apply(head_dim) else ""  # default_copy: LINES
                assert spec.name.endswith("_split" + ("_softcap" if softcap else "") + lines), spec.name
                for target in ("sm_80", "sm_90a", "sm_100a"):
                    assert policy_decode.ctas_per_sm(spec, target) >= 1


def test_decode_rules_refuse_what_the_decode_kernel_lacks():
    base = policy_decode.decode_spec("fp16", 128, 4)
    for features, token in (
        (Features(split_kv=True, alibi=True), "alibi"), (Features(split_kv=True, sinks=True), "sinks"),
        (Features(split_kv=True, varlen=True), "varlen"),
    ):  # fmt: skip
        assert token in why_no_kernel(base.replace(features=features))
    assert "paged" in why_no_kernel(base.replace(features=Features(paged_kv=True)))  # no paged prefill
    assert "split" in why_no_kernel(
        VariantSpec("sm90", "fwd", "bf16", 128, 128, 128, 2, 12, features=Features(split_kv=True))
    )


def test_rendered_decode_module_names_its_arguments():
    spec = policy_decode.decode_spec("bf16", 128, 4, mask=Mask.LOCAL, paged=True, softcap=True)
    text = codegen.render_source(spec)
    assert codegen.render_source(spec) == text
    assert "def fake_arguments(spec, cutlass, cute)" in text and "class Kernel" in text
    assert "mPageTable: cute.Tensor" in text and "mBatchIdx" not in text and "mLeftpad" not in text
    assert "def append(" in text and "rotary_interleaved: Int32" in text and "ROTARY_PER_TOKEN = True" in text
    assert "window_left: Int32" in text and "softcap: Float32" in text
    assert "COPY_THREADS_PER_ROW = 8 " in text  # LINES, the default (policy_decode.default_copy)
    sectors = policy_decode.decode_spec("bf16", 128, 4, mask=Mask.LOCAL, paged=True, softcap=True, copy=SECTORS)
    assert "COPY_THREADS_PER_ROW = 2 " in codegen.render_source(sectors)
    dense = codegen.render_source(policy_decode.decode_spec("bf16", 128, 4))
    assert (
        "mBatchIdx: cute.Tensor" in dense
        and "mLeftpad: cute.Tensor" in dense
        and "ROTARY_PER_TOKEN = False" in dense
        and "window_left: Int32," not in dense
        and "decode_paged" not in dense
    )


@pytest.mark.parametrize(
    ("mask", "paged", "softcap", "e4m3"),
    [(Mask.NONE, False, False, False), (Mask.LOCAL, True, True, False), (Mask.NONE, False, False, True),
     (Mask.LOCAL, True, True, True)],
)  # fmt: skip
def test_kernel_args_follow_the_rendered_signature(mask, paged, softcap, e4m3):
    """kvcache.kernel_args gives exactly the parameters of the rendered Kernel.__call__ (less the
    stream), in its order: the tensors where the module takes tensors."""
    import ast

    cache_dtype = CacheDtype.E4M3 if e4m3 else CacheDtype.SAME
    spec = policy_decode.decode_spec(
        "bf16", 64, 4, mask=mask, paged=paged, softcap=softcap, cache_dtype=cache_dtype
    )
    tree = ast.parse(codegen.render_source(spec))
    (call,) = [
        f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "Kernel"
        for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__call__"
    ]  # fmt: skip
    params = [(a.arg, ast.unparse(a.annotation)) for a in call.args.args[1:]]
    assert params[-1][0] == "stream"
    q = torch.zeros(2, 1, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)
    lens = torch.zeros(2, dtype=torch.int32)
    table = torch.zeros(2, 1, dtype=torch.int32) if paged else None
    args = kvcache.kernel_args(
        spec, q, q, cache, cache, None, None, None, None, q, lens, q, lens, lens, None, None, table, 0.1, True,
        False, 3, 0, 5.0, (lens, lens) if e4m3 else (),
    )  # fmt: skip
    assert len(args) == len(params) - 1
    assert ("mKDescale" in [n for n, _ in params]) == e4m3
    for (name, kind), arg in zip(params, args):
        assert isinstance(arg, torch.Tensor) == (kind == "cute.Tensor"), (name, kind, type(arg))


# ---------------------------------------------------------------------------------------------
# The split heuristic


H100 = {"sm_count": 132}


def _splits(batch, heads_kv, seqlen_k, rows=4, hd=128, target="sm_90a"):
    spec = policy_decode.decode_spec("bf16", hd, rows)
    return policy_decode.num_splits(
        batch=batch, heads_kv=heads_kv, row_tiles=policy_decode.row_tiles(spec, rows), seqlen_k=seqlen_k,
        tile_n=spec.tile_n, ctas_per_sm=policy_decode.ctas_per_sm(spec, target), **H100,
    )  # fmt: skip


def test_split_heuristic_fills_the_gpu_with_few_long_sequences():
    spec = policy_decode.decode_spec("bf16", 128, 4)
    slots = 132 * policy_decode.ctas_per_sm(spec, "sm_90a")
    s = _splits(1, 8, 128 * 1024)
    assert 8 * s >= policy_decode.TARGET_WAVES * slots and s <= policy_decode.MAX_SPLITS
    assert _splits(8, 8, 32 * 1024) * 64 >= policy_decode.TARGET_WAVES * slots


def test_split_heuristic_keeps_a_few_blocks_per_split_and_leaves_full_grids_alone():
    for seqlen in (64, 256, 1024, 4096):
        s = _splits(1, 8, seqlen)
        blocks = -(-seqlen // 64)
        assert s == 1 or blocks // s >= policy_decode.MIN_BLOCKS_PER_SPLIT, (seqlen, s)
    assert _splits(256, 8, 8192) == 1
    assert _splits(64, 32, 8192) == 1
    assert 1 <= _splits(64, 8, 8192) <= 4
    assert _splits(0, 8, 8192) == 1 and _splits(4, 8, 0) == 1


def test_split_heuristic_reads_shapes_only(emulated):
    """The op's split count depends on shapes, not on the lengths inside cache_seqlens."""
    q, k_cache, v_cache = _inputs(batch=1, hq=8, hkv=2, seqlen_cache=4096)
    for lengths in ([0], [4096], [7]):
        with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths, dtype=torch.int32))
    assert len({splits for _, splits in emulated}) == 1 and emulated[0][1] > 1


# ---------------------------------------------------------------------------------------------
# The host path against the reference (kernel emulated)


def _assert_close(got, want, atol=2e-3):
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16])
@pytest.mark.parametrize(("sq", "hq", "hkv"), [(1, 32, 8), (4, 8, 8), (16, 4, 1), (3, 16, 1)])
def test_dense_decode_matches_the_reference(emulated, num_splits, sq, hq, hkv):
    batch, cap = 3, 300
    q, k_cache, v_cache = _inputs(batch=batch, sq=sq, hq=hq, hkv=hkv, seqlen_cache=cap)
    lens = torch.tensor([0, 1, 257], dtype=torch.int32)[:batch]
    out, lse = with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, causal=True, num_splits=num_splits, return_lse=True
    )
    for b in range(batch):
        n = int(lens[b])
        o, l = reference(q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n], 1 / 8, causal=True)
        _assert_close(out[b : b + 1], o)
        torch.testing.assert_close(lse[b : b + 1].double(), l, atol=1e-6, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16, 32, 64, 128, 256])
def test_paged_append_and_decode_match_the_dense_reference(emulated, page_size):
    """Sequences ending mid-page, an append crossing a page boundary, pages in scrambled order; the
    rest of the pool bit-for-bit unchanged."""
    batch, hq, hkv, d, new = 3, 8, 2, 64, 5
    lens = [0, max(page_size - 2, 1), 3 * page_size + 1]
    pages_per_seq = -(-(max(lens) + new) // page_size)
    order = torch.randperm(batch * pages_per_seq, generator=_g(5)).int()
    table = order.reshape(batch, pages_per_seq)
    pool_k = _rand(batch * pages_per_seq + 2, page_size, hkv, d, seed=6)
    pool_v = _rand(batch * pages_per_seq + 2, page_size, hkv, d, seed=7)
    before_k, before_v = pool_k.clone(), pool_v.clone()
    q, k, v = (
        _rand(batch, new, hq, d, seed=8),
        _rand(batch, new, hkv, d, seed=9),
        _rand(batch, new, hkv, d, seed=10),
    )
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out = with_kvcache(
        q, pool_k, pool_v, k, v, cache_seqlens=seqlens, page_table=table, causal=True, num_splits=3
    )
    written = torch.zeros(pool_k.shape[:2], dtype=torch.bool)
    for b in range(batch):
        for i in range(new):
            pos = lens[b] + i
            page, slot = int(table[b, pos // page_size]), pos % page_size
            assert torch.equal(pool_k[page, slot], k[b, i]) and torch.equal(pool_v[page, slot], v[b, i])
            written[page, slot] = True
    assert torch.equal(pool_k[~written], before_k[~written]) and torch.equal(
        pool_v[~written], before_v[~written]
    )
    for b in range(batch):
        n = lens[b] + new
        dense_k = pool_k[table[b].long()].flatten(0, 1)[:n]
        dense_v = pool_v[table[b].long()].flatten(0, 1)[:n]
        o, _ = reference(q[b : b + 1], dense_k[None], dense_v[None], 1 / 8, causal=True)
        _assert_close(out[b : b + 1], o)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary_on_q_and_the_new_keys(emulated, interleaved, causal):
    batch, sq, hq, hkv, d, cap, rd = 2, 3, 4, 2, 64, 50, 32
    q, k_cache, v_cache = _inputs(batch=batch, sq=sq, hq=hq, hkv=hkv, d=d, seqlen_cache=cap)
    k, v = _rand(batch, sq, hkv, d, seed=11), _rand(batch, sq, hkv, d, seed=12)
    angles = torch.rand(cap, rd // 2, generator=_g(13)) * 6
    cos, sin = angles.cos(), angles.sin()
    lens = torch.tensor([4, 17], dtype=torch.int32)
    cache = k_cache.clone()
    out = with_kvcache(
        q, cache, v_cache.clone(), k, v, cos, sin, lens, causal=causal, rotary_interleaved=interleaved
    )
    pos = lens.long()[:, None] + torch.arange(sq)
    k_rot = rope_reference(k, cos, sin, pos, interleaved)
    q_rot = rope_reference(q, cos, sin, pos if causal else lens.long()[:, None], interleaved)
    for b in range(batch):
        torch.testing.assert_close(cache[b, lens[b] : lens[b] + sq].double(), k_rot[b], atol=1e-3, rtol=2e-3)
        n = int(lens[b]) + sq
        keys = torch.cat([k_cache[b, : lens[b]].double(), k_rot[b]])[None]
        vals = torch.cat([v_cache[b, : lens[b]], v[b]]).double()[None]
        o, _ = reference(q_rot[b : b + 1], keys, vals, 1 / 8, causal=causal)
        _assert_close(out[b : b + 1], o, atol=4e-3)
        assert n == keys.shape[1]


def test_cache_batch_idx_window_and_softcap(emulated):
    batch, sq, hq, hkv, d = 3, 2, 4, 2, 128
    q = _rand(batch, sq, hq, d, seed=20)
    k_cache, v_cache = _rand(5, 200, hkv, d, seed=21), _rand(5, 200, hkv, d, seed=22)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    lens = torch.tensor([150, 3, 199], dtype=torch.int32)
    for window, causal, softcap in (((40, -1), True, 0.0), ((10, 5), False, 30.0), ((-1, -1), False, 5.0)):
        out, lse = with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens, cache_batch_idx=idx, causal=causal, window_size=window,
            softcap=softcap, num_splits=4, return_softmax_lse=True,
        )  # fmt: skip
        for b in range(batch):
            n, row = int(lens[b]), int(idx[b])
            o, l = reference(
                q[b : b + 1],
                k_cache[row : row + 1, :n],
                v_cache[row : row + 1, :n],
                d**-0.5,
                causal,
                window,
                softcap,
            )
            _assert_close(out[b : b + 1], o)
            torch.testing.assert_close(lse[b : b + 1].double(), l, atol=1e-6, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_cache_leftpad_starts_the_keys_and_the_rotary_positions_at_the_pad(emulated, causal):
    """flash-attn's cache_leftpad: sequence b's keys are cache rows [pad, cache_seqlens + new), the
    new tokens land at cache_seqlens[b] + i and are rotated at cache_seqlens[b] - pad + i."""
    batch, sq, hq, hkv, d, cap, rd = 3, 2, 4, 2, 64, 60, 16
    q, k_cache, v_cache = _inputs(batch=batch, sq=sq, hq=hq, hkv=hkv, d=d, seqlen_cache=cap)
    k, v = _rand(batch, sq, hkv, d, seed=50), _rand(batch, sq, hkv, d, seed=51)
    angles = torch.rand(cap, rd // 2, generator=_g(52)) * 6
    cos, sin = angles.cos().half(), angles.sin().half()
    lens, pads = torch.tensor([10, 3, 40], dtype=torch.int32), torch.tensor([4, 3, 0], dtype=torch.int32)
    cache, values = k_cache.clone(), v_cache.clone()
    out, lse = with_kvcache(
        q,
        cache,
        values,
        k,
        v,
        cos,
        sin,
        lens,
        cache_leftpad=pads,
        causal=causal,
        num_splits=2,
        return_lse=True,
    )
    start = kvcache_reference.rotary_start(lens, pads)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kvcache_reference.append_kv(want_k, want_v, k, v, lens, None, None, cos, sin, True, cache_leftpad=pads)
    assert torch.equal(values, want_v)
    torch.testing.assert_close(cache, want_k, atol=2e-3, rtol=0)
    q_rot = kvcache_reference.rotate(q, cos, sin, kvcache_reference.query_positions(start, sq, causal), True)
    for b in range(batch):
        p, n = int(pads[b]), int(lens[b]) + sq
        o, l = reference(
            q_rot[b : b + 1], want_k[b : b + 1, p:n], want_v[b : b + 1, p:n], 1 / 8, causal=causal
        )
        _assert_close(out[b : b + 1], o, atol=4e-3)
        torch.testing.assert_close(lse[b : b + 1].double(), l, atol=2e-3, rtol=0)


def test_an_append_past_the_capacity_writes_nothing_there(emulated):
    q, k_cache, v_cache = _inputs(batch=2, sq=3, seqlen_cache=40)
    k, v = _rand(2, 3, 2, 64, seed=60), _rand(2, 3, 2, 64, seed=61)
    cache, values = k_cache.clone(), v_cache.clone()
    with_kvcache(q, cache, values, k, v, cache_seqlens=torch.tensor([38, 5], dtype=torch.int32))
    assert torch.equal(cache[0, 38:], k[0, :2]) and torch.equal(values[0, :38], v_cache[0, :38])
    assert torch.equal(cache[1, 5:8], k[1]) and torch.equal(cache[1, 8:], k_cache[1, 8:])


def test_q_without_rows_refuses_new_tokens(emulated):
    q, k_cache, v_cache = _inputs()
    k = _rand(2, 1, 2, 64, seed=62)
    with pytest.raises(ValueError, match="q has no query rows"):
        with_kvcache(q[:, :0], k_cache, v_cache, k, k, cache_seqlens=1)


def test_the_custom_ops_give_what_the_direct_path_gives(emulated, monkeypatch):
    """A plain eager call runs the ops' implementations directly; through the ops (as under
    torch.compile or autograd) the results and the cache are the same."""
    q, k_cache, v_cache = _inputs(batch=2, sq=2, seqlen_cache=64)
    k, v = _rand(2, 2, 2, 64, seed=40), _rand(2, 2, 2, 64, seed=41)
    cos, sin = torch.rand(80, 8, generator=_g(42)).cos(), torch.rand(80, 8, generator=_g(43)).sin()
    lens = torch.tensor([3, 50], dtype=torch.int32)
    results = []
    for direct in (True, False):
        monkeypatch.setattr(kvcache, "plain_eager", lambda *tensors, direct=direct: direct)
        cache = k_cache.clone()
        out = with_kvcache(q, cache, v_cache.clone(), k, v, cos, sin, lens, causal=True, num_splits=2)
        results.append((out, cache))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_lengths_past_the_capacity_are_clamped(emulated):
    q, k_cache, v_cache = _inputs(batch=1, seqlen_cache=40)
    out = with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor([1000], dtype=torch.int32), num_splits=2
    )
    o, _ = reference(q, k_cache, v_cache, 1 / 8)
    _assert_close(out, o)


def test_empty_query_launches_nothing(emulated):
    q, k_cache, v_cache = _inputs()
    out, lse = with_kvcache(q[:, :0], k_cache, v_cache, return_lse=True)
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0) and not emulated


# ---------------------------------------------------------------------------------------------
# Fake implementations and torch.compile


def test_fake_ops_give_the_output_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
        pool = torch.empty(100, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
        table = torch.empty(3, 20, dtype=torch.int32, device="cuda")
        lens = torch.empty(3, dtype=torch.int32, device="cuda")
        k = torch.empty(3, 4, 8, 128, dtype=torch.bfloat16, device="cuda")
        cos = torch.empty(64, 32, dtype=torch.bfloat16, device="cuda")
        out, lse = kvcache.kvcache_attn(
            q, pool, pool, k, k, cos, cos, lens, None, None, table, 0.1, True, -1, -1, 0.0, True, 0
        )
        assert (
            out.shape == q.shape
            and out.dtype == q.dtype
            and lse.shape == (3, 32, 4)
            and lse.dtype == torch.float32
        )


def test_torch_compile_fullgraph_traces_append_and_attention():
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(fullgraph=True, backend=capture)
    def step(q, k_cache, v_cache, k, v, cos, sin, lens, table):
        out, lse = with_kvcache(
            q, k_cache, v_cache, k, v, cos, sin, lens, causal=True, page_table=table, return_lse=True
        )
        return out * 2, lse.exp()

    torch._dynamo.reset()
    with FakeTensorMode():
        q = torch.empty(2, 1, 8, 64, dtype=torch.float16, device="cuda")
        pool = torch.empty(10, 16, 2, 64, dtype=torch.float16, device="cuda")
        k = torch.empty(2, 1, 2, 64, dtype=torch.float16, device="cuda")
        cos = torch.empty(64, 16, device="cuda")
        lens = torch.empty(2, dtype=torch.int32, device="cuda")
        table = torch.empty(2, 5, dtype=torch.int32, device="cuda")
        out, lse = step(q, pool, pool.clone(), k, k, cos, cos, lens, table)
    assert out.shape == q.shape and lse.shape == (2, 8, 1)
    (graph,) = graphs
    called = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    # one op: the append and the attention in one host call (auto_functionalized: it mutates the caches)
    names = [str(getattr(c, "__name__", c)) + str(c) for c in called]
    assert sum("kvcache_attn" in n for n in names) == 1, called
    assert not any("kvcache_append" in n or "kvcache_rotary" in n for n in names), called


# ---------------------------------------------------------------------------------------------
# The page allocator


def _pool(**kw):
    args = {"num_pages": 8, "page_size": 16, "heads_kv": 2, "head_dim": 64, "max_seqs": 3, "device": "cpu"}
    return PagedKVCache(**{**args, **kw})


def test_allocator_grows_frees_and_reuses_pages():
    cache = _pool(max_pages_per_seq=4)
    a, b = cache.add(), cache.add()
    table, lens = cache.step([a, b], 20)
    assert lens.tolist() == [0, 0] and table.dtype == torch.int32 and table.shape == (2, 4)
    assert cache.pages(a) == [0, 1] and cache.pages(b) == [2, 3] and cache.num_free_pages == 4
    table, lens = cache.step([b, a], 12)  # 32 tokens: still two pages each
    assert lens.tolist() == [20, 20] and cache.num_free_pages == 4
    table, lens = cache.step([a], 1)
    assert cache.pages(a) == [0, 1, 4] and table[0, :3].tolist() == [0, 1, 4] and cache.length(a) == 33
    cache.free(a)
    assert cache.num_free_pages == 6
    c = cache.add()
    cache.step([c], 16)
    assert cache.pages(c) == [0] and c == a  # the freed id and pages come back first
    cache.check(cache.page_table([b, c]), cache.cache_seqlens([b, c]))


def test_allocator_refuses_without_changing_anything():
    cache = _pool(num_pages=4, max_pages_per_seq=3)
    a, b = cache.add(), cache.add()
    cache.step([a], 40)
    with pytest.raises(OutOfPagesError, match="capacity"):
        cache.step([a, b], 9)  # a would hold 49 > 48
    with pytest.raises(OutOfPagesError, match="more pages"):
        cache.step([b], 48)
    assert cache.length(b) == 0 and cache.pages(b) == [] and cache.num_free_pages == 1
    cache.add()
    with pytest.raises(OutOfPagesError, match="slots"):
        cache.add()
    with pytest.raises(KeyError):
        cache.free(7)
    with pytest.raises(ValueError, match="power of two"):
        _pool(page_size=24)
    with pytest.raises(ValueError, match="once"):
        cache.step([a, a], 1)


def test_allocator_append_and_gather_round_trip():
    cache = _pool(num_layers=2)
    seqs = [cache.add(), cache.add()]
    k, v = (
        _rand(2, 19, 2, 64, seed=30, dtype=torch.bfloat16),
        _rand(2, 19, 2, 64, seed=31, dtype=torch.bfloat16),
    )
    table, lens = cache.step(seqs, 19)
    cache.append(k, v, table, lens, layer=1)
    for i, s in enumerate(seqs):
        gk, gv = cache.gather(s, layer=1)
        assert torch.equal(gk, k[i].to(gk.dtype)) and torch.equal(gv, v[i].to(gv.dtype))
        assert not cache.gather(s, layer=0)[0].any()
    bad = table.clone()
    bad[1, 0] = table[0, 0]
    with pytest.raises(ValueError, match="used by sequences"):
        cache.check(bad, lens + 19)
    with pytest.raises(ValueError, match="outside"):
        cache.check(table, torch.tensor([19, 9999], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# The e4m3 cache


def _e4m3(spec):
    return spec.replace(options=spec.options.replace(cache_dtype=CacheDtype.E4M3))


def test_e4m3_cache_variants_are_named_and_ruled():
    base = policy_decode.decode_spec("bf16", 128, 4, paged=True, copy=SECTORS)  # (e4m3 copies its own bytes)
    e4m3 = policy_decode.decode_spec("bf16", 128, 4, paged=True, cache_dtype=CacheDtype.E4M3)
    assert e4m3 == _e4m3(base) and e4m3.options.kv_e4m3 and not base.options.kv_e4m3
    assert base.name == "cutefa_sm80_fwd_bf16_hd128_16x64_s2_w1_paged_split"  # no token by default
    assert e4m3.name == base.name + "_kve4m3" and parse_name(e4m3.name) == e4m3
    for hd, rows, mask, paged, softcap in ((64, 1, Mask.NONE, False, False), (128, 64, Mask.CAUSAL, True, False),
                                           (256, 4, Mask.LOCAL, True, True), (128, 128, Mask.NONE, False, True)):  # fmt: skip
        spec = _e4m3(policy_decode.decode_spec("fp16", hd, rows, mask=mask, paged=paged, softcap=softcap, copy=SECTORS))
        assert why_invalid(spec) is None, spec.name
        assert why_not_on(spec, "sm_90a") is None and why_not_on(spec, "sm_100a") is None
        assert "sm_90a or newer" in why_not_on(spec, "sm_80")
    prefill = _e4m3(VariantSpec("sm80", "fwd", "bf16", 128, 128, 64, 2, 4))
    assert "split_kv" in why_invalid(prefill)
    # 8 warps of a 64-key tile put 4 threads on a row: 96 columns are 6 copies of 16 bytes
    assert "16-byte copies" in why_invalid(_e4m3(policy_decode.decode_spec("bf16", 96, 128, copy=SECTORS)))


def test_e4m3_decode_module_widens_and_takes_descales():
    spec = policy_decode.decode_spec("bf16", 128, 4, cache_dtype=CacheDtype.E4M3)
    text = codegen.render_source(spec)
    assert "mKDescale: cute.Tensor" in text and "mVDescale: cute.Tensor" in text
    assert text.count("decode_fp8.widen(") == 4  # K and V, masked and unmasked steps
    assert "self.append(" in text and "cutlass.Float8E4M3FN" in text
    # the append quantizes the new keys and values with their sequence's descales
    assert "quantize_row_pairs(" in text and "rope_row_pairs(\n                    mKnew" not in text
    assert "mKDescale[batch, None]" in text and "mVDescale[batch, None]" in text
    assert "scale_log2 = scale_log2 * mKDescale[batch, head_kv]" in text
    assert "acc_O.load() * mVDescale[batch, head_kv]" in text
    capped = codegen.render_source(_e4m3(policy_decode.decode_spec("bf16", 128, 4, softcap=True, copy=SECTORS)))
    assert "cap_pre_scale = cap_pre_scale * mKDescale[batch, head_kv]" in capped
    plain = codegen.render_source(policy_decode.decode_spec("bf16", 128, 4))
    assert "Descale" not in plain and "decode_fp8" not in plain and "self.append(" in plain


def _quantized(x, descale):
    """x (rows, seqlen, heads, d) divided by descale (heads,) or (rows, heads) into e4m3."""
    d = descale if descale.dim() == 2 else descale[None].expand(x.shape[0], -1)
    return (x.float() / d[:, None, :, None]).to(torch.float8_e4m3fn)


def _e4m3_inputs(batch, sq, hq, hkv, d, cap, seed=40):
    q = _rand(batch, sq, hq, d, seed=seed, dtype=torch.bfloat16)
    k_descale = 0.02 + torch.rand(batch, hkv, generator=_g(seed + 1)) / 10
    v_descale = 0.02 + torch.rand(batch, hkv, generator=_g(seed + 2)) / 10
    k8 = _quantized(_rand(batch, cap, hkv, d, seed=seed + 3), k_descale)
    v8 = _quantized(_rand(batch, cap, hkv, d, seed=seed + 4), v_descale)
    return q, k8, v8, k_descale, v_descale


def _dequantized(x8, descale):
    return x8.double() * descale.double()[:, None, :, None]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_e4m3_dense_decode_matches_the_dequantized_reference(emulated, num_splits, causal):
    batch, sq, hq, hkv, d, cap = 3, 2, 8, 2, 64, 120
    q, k8, v8, kd, vd = _e4m3_inputs(batch, sq, hq, hkv, d, cap)
    lens = torch.tensor([0, 17, 120], dtype=torch.int32)
    out, lse = with_kvcache(
        q, k8, v8, cache_seqlens=lens, causal=causal, num_splits=num_splits, return_lse=True, k_descale=kd,
        v_descale=vd,
    )  # fmt: skip
    assert emulated[-1][0].options.kv_e4m3 and emulated[-1][1] == num_splits
    k_ref, v_ref = _dequantized(k8, kd), _dequantized(v8, vd)
    for b in range(batch):
        n = int(lens[b])
        o, l = reference(q[b : b + 1], k_ref[b : b + 1, :n], v_ref[b : b + 1, :n], d**-0.5, causal=causal)
        _assert_close(out[b : b + 1], o, atol=1e-2)
        torch.testing.assert_close(lse[b : b + 1].double(), l, atol=1e-6, rtol=0)


def test_e4m3_paged_decode_matches_the_dequantized_reference(emulated):
    batch, hq, hkv, d, ps = 2, 4, 1, 128, 16
    q = _rand(batch, 1, hq, d, seed=50, dtype=torch.float16)
    kd, vd = torch.tensor([[0.05], [0.1]]), torch.tensor([[0.2], [0.03]])
    pool_k = _rand(8, ps, hkv, d, seed=51).to(torch.float8_e4m3fn)
    pool_v = _rand(8, ps, hkv, d, seed=52).to(torch.float8_e4m3fn)
    table = torch.tensor([[5, 1, 7], [0, 2, 3]], dtype=torch.int32)
    lens = torch.tensor([40, 33], dtype=torch.int32)
    out = with_kvcache(q, pool_k, pool_v, cache_seqlens=lens, page_table=table, k_descale=kd, v_descale=vd)
    for b in range(batch):
        n = int(lens[b])
        keys = torch.cat([pool_k[p] for p in table[b].tolist()])[:n].double() * float(kd[b, 0])
        vals = torch.cat([pool_v[p] for p in table[b].tolist()])[:n].double() * float(vd[b, 0])
        o, _ = reference(q[b : b + 1], keys[None], vals[None], d**-0.5)
        _assert_close(out[b : b + 1], o, atol=1e-2)


def test_e4m3_descales_default_to_one(emulated):
    q, k8, v8, _, _ = _e4m3_inputs(2, 1, 4, 2, 64, 40)
    ones = torch.ones(2, 2)
    _assert_close(with_kvcache(q, k8, v8), with_kvcache(q, k8, v8, k_descale=ones, v_descale=ones), atol=0)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"k_descale": torch.ones(2, 2, dtype=torch.float64)}, TypeError, "k_descale must be torch.float32"),
        ({"v_descale": torch.ones(2, 3)}, ValueError, r"v_descale must have shape \(batch, heads_kv\)"),
        ({"k_descale": torch.ones(2)}, ValueError, "v_descale|k_descale"),
        ({"k_descale": [[1.0, 1.0]] * 2}, TypeError, "k_descale must be a torch.Tensor"),
        ({"k_descale": torch.tensor([[1.0, 0.0], [1.0, 1.0]])}, RuntimeError, "k_descale must be finite and positive"),
        ({"v_descale": torch.tensor([[1.0, math.inf], [1.0, 1.0]])}, RuntimeError, "v_descale must be finite"),
        ({"v_descale": torch.tensor([[1.0, math.nan], [1.0, 1.0]])}, RuntimeError, "v_descale must be finite"),
        ({"k": _rand(2, 1, 2, 64), "v": _rand(2, 1, 2, 64), "cache_seqlens": 3}, TypeError, "k must be torch.bfloat16"),
        ({"k": _rand(2, 1, 2, 64, dtype=torch.bfloat16), "v": _rand(2, 1, 2, 64).to(torch.float8_e4m3fn),
          "cache_seqlens": 3}, TypeError, "v must be torch.bfloat16 .* like q"),
    ],
)  # fmt: skip
def test_e4m3_bad_arguments_are_named(emulated, change, error, match):
    q, k8, v8, _, _ = _e4m3_inputs(2, 1, 4, 2, 64, 40)
    with pytest.raises(error, match=match):
        with_kvcache(q, k8, v8, **change)


def test_e4m3_refusals(emulated, monkeypatch):
    q, k_cache, v_cache = _inputs()
    with pytest.raises(ValueError, match="k_descale is for an e4m3 cache"):
        with_kvcache(q, k_cache, v_cache, k_descale=torch.ones(2, 2))
    with pytest.raises(NotImplementedError, match="fp8"):  # e5m2
        with_kvcache(q, k_cache.to(torch.float8_e5m2), v_cache.to(torch.float8_e5m2))
    q8, k8, v8, kd, vd = _e4m3_inputs(2, 1, 4, 2, 64, 40)
    monkeypatch.setattr(dispatch, "device_target", lambda device=None: ("sm_80", "NVIDIA A100"))
    with pytest.raises(NotImplementedError, match="sm_90a or newer"):
        with_kvcache(q8, k8, v8, k_descale=kd, v_descale=vd)


def test_e4m3_fake_op_gives_the_output_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
        pool = torch.empty(100, 16, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
        table = torch.empty(3, 20, dtype=torch.int32, device="cuda")
        lens = torch.empty(3, dtype=torch.int32, device="cuda")
        descale = torch.empty(3, 8, dtype=torch.float32, device="cuda")
        out, lse = kvcache.kvcache_attn_e4m3(
            q, pool, pool, None, None, None, None, lens, None, None, table, descale, descale, 0.1, True, -1, -1, 0.0,
            True, 0,
        )  # fmt: skip
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (3, 32, 4)


def test_torch_compile_fullgraph_traces_the_e4m3_cache_op():
    """The descale checks (an asynchronous assert) and the e4m3 op trace into one graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(fullgraph=True, backend=capture)
    def step(q, k_cache, v_cache, lens, table, kd, vd):
        return with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=lens,
            page_table=table,
            k_descale=kd,
            v_descale=vd,
            return_lse=True,
        )

    torch._dynamo.reset()
    with FakeTensorMode():
        q = torch.empty(2, 1, 8, 64, dtype=torch.bfloat16, device="cuda")
        pool = torch.empty(10, 16, 2, 64, dtype=torch.float8_e4m3fn, device="cuda")
        lens = torch.empty(2, dtype=torch.int32, device="cuda")
        table = torch.empty(2, 5, dtype=torch.int32, device="cuda")
        kd = torch.empty(2, 2, device="cuda")
        out, lse = step(q, pool, pool.clone(), lens, table, kd, kd.clone())
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 8, 1)
    (graph,) = graphs
    names = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert sum("kvcache_attn_e4m3" in n for n in names) == 1, names
    assert sum("_assert_async" in n for n in names) == 2, names
