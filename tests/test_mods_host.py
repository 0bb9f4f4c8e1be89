"""User mods on the CPU: the tracer (operators, captured tensors, refusals naming the user's line),
the derivative of a score_mod against autograd, keys and variant names, the rendered kernel source,
and block masks against the dense mask."""

from __future__ import annotations

import inspect

import pytest
import torch
from test_mods_examples import document_mask, grids, prefix_lm, random_docs, relative_bias, softcap_mod

import cutefa
from cutefa.codegen import render_source
from cutefa.model.defaults import default_spec
from cutefa.mods import ModTraceError, create_block_mask, trace_mods
from cutefa.mods.base import mod_tile_n
from cutefa.mods.block_mask import EMPTY, FULL, PARTIAL, block_kinds, kinds_to_ranges
from cutefa.mods.evaluate import evaluate
from cutefa.mods.variant import ModVariantSpec

BASE = default_spec("sm80", "fwd", "bf16", 128)


def _line_of(fn, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


# ---------------------------------------------------------------------------------------------
# Tracing


def test_operators_trace_to_what_torch_computes():
    table = torch.randn(4, 9)

    def score_mod(score, b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        s = torch.where(d >= 0, score * 2.0 - 1, score / 3) + abs(d) * 0.5
        s = torch.minimum(s, torch.exp(score * 0.1)) + torch.maximum(-s, torch.tanh(score))
        s = torch.clamp(s, min=-5.0, max=5.0) + table[h, torch.clamp(d + 4, min=0, max=8)]
        keep = ~((q_idx == 3) | (kv_idx != 2)) & (h < 2)
        return torch.where(keep, s**2, -s) + b

    traced = trace_mods(score_mod, None)
    g = grids(2, 4, 6, 7)
    score = torch.randn(2, 4, 6, 7)
    got = evaluate(traced.score, {**g, "score": score}, traced.tensors)
    want = score_mod(score, g["b"], g["h"], g["q_idx"], g["kv_idx"])
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    assert len(traced.tensors) == 1 and traced.tensors[0] is table


def test_captured_tensors_are_merged_in_first_read_order():
    doc = torch.zeros(2, 8, dtype=torch.int64)
    bias = torch.zeros(3, 15)
    traced = trace_mods(relative_bias(bias, 8), document_mask(doc))
    assert traced.tensors == (bias, doc)
    assert traced.kinds == (("f", 2), ("i", 2))
    same = trace_mods(relative_bias(bias, 8), lambda b, h, q, k: bias[h, q - k + 7] > 0)
    assert same.tensors == (bias,)


@pytest.mark.parametrize(
    ("source", "needle", "message"),
    [
        ("if_on_value", "if q_idx > kv_idx", "Python control flow"),
        ("python_and", "return (q_idx > 0) and", "Python control flow"),
        ("unsupported_method", "score.sin()", "AttributeError"),
        ("math_exp", "math.exp(score)", "float()/math.*"),
        ("whole_tensor", "score + TABLE", "used as a whole"),
        ("partial_index", "TABLE[h]", "index every dimension"),
        ("float_index", "TABLE[h, score]", "int expressions"),
        ("unsupported_torch", "torch.sin(score)", "torch.sin is not supported"),
        ("floordiv", "q_idx // 2", "// is not supported"),
    ],
)
def test_untraceable_mods_name_the_line(source, needle, message):
    fn = BAD[source]
    with pytest.raises(ModTraceError) as info:
        if source == "python_and":
            trace_mods(None, fn)
        else:
            trace_mods(fn, None)
    text = str(info.value)
    assert f"{__file__}:{_line_of(fn, needle)}:" in text, text
    assert message in text, text


TABLE = torch.zeros(4, 8)


def _if_on_value(score, b, h, q_idx, kv_idx):
    if q_idx > kv_idx:
        return score
    return -score


def _python_and(b, h, q_idx, kv_idx):
    return (q_idx > 0) and (kv_idx > 0)


def _unsupported_method(score, b, h, q_idx, kv_idx):
    return score.sin()


def _math_exp(score, b, h, q_idx, kv_idx):
    import math

    return math.exp(score)


def _whole_tensor(score, b, h, q_idx, kv_idx):
    return score + TABLE


def _partial_index(score, b, h, q_idx, kv_idx):
    return score + TABLE[h]


def _float_index(score, b, h, q_idx, kv_idx):
    return TABLE[h, score]


def _unsupported_torch(score, b, h, q_idx, kv_idx):
    return torch.sin(score)


def _floordiv(score, b, h, q_idx, kv_idx):
    return score + q_idx // 2


BAD = {
    "if_on_value": _if_on_value, "python_and": _python_and, "unsupported_method": _unsupported_method,
    "math_exp": _math_exp, "whole_tensor": _whole_tensor, "partial_index": _partial_index,
    "float_index": _float_index, "unsupported_torch": _unsupported_torch, "floordiv": _floordiv,
}  # fmt: skip


def test_wrong_result_kinds_are_refused():
    with pytest.raises(ModTraceError, match="returned a bool"):
        trace_mods(lambda score, b, h, q, k: q > k, None)
    with pytest.raises(ModTraceError, match="must return a bool"):
        trace_mods(None, lambda b, h, q, k: q - k)
    with pytest.raises(ValueError, match="give a score_mod"):
        trace_mods(None, None)
    with pytest.raises(TypeError, match="must be a function"):
        trace_mods(3, None)


# ---------------------------------------------------------------------------------------------
# Derivative


@pytest.mark.parametrize(
    "mod",
    [
        softcap_mod(),
        relative_bias(torch.randn(3, 13), 7),
        lambda s, b, h, q, k: (
            torch.where(s > 0.2, s * s * 0.5, torch.exp(s) / (1.0 + abs(s))) - s / (2.0 + s * s)
        ),
        lambda s, b, h, q, k: torch.maximum(torch.tanh(s) * q, torch.minimum(s, -s * 0.25 + k)),
        lambda s, b, h, q, k: (q - k) * 0.1,  # no score: derivative 0
    ],
)
def test_derivative_matches_autograd(mod):
    traced = trace_mods(mod, None)
    g = grids(2, 3, 5, 7)
    score = (torch.randn(2, 3, 5, 7) * 2).requires_grad_()
    out = mod(score, g["b"], g["h"], g["q_idx"], g["kv_idx"])
    (want,) = torch.autograd.grad(out.sum(), score, allow_unused=True) if out.requires_grad else (None,)
    want = torch.zeros_like(score) if want is None else want
    got = evaluate(traced.d_score(), {**g, "score": score.detach()}, traced.tensors)
    torch.testing.assert_close(got.expand_as(want), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Keys, names, rendering


def test_keys_follow_the_expression_not_the_values():
    doc_a = torch.zeros(2, 16, dtype=torch.int32)
    doc_b = torch.ones(3, 99, dtype=torch.int32)  # other values and sizes: same kernel
    key = trace_mods(None, document_mask(doc_a)).key
    assert trace_mods(None, document_mask(doc_b)).key == key
    assert trace_mods(None, document_mask(doc_a.long())).key == key  # read as int32 either way
    assert trace_mods(None, document_mask(doc_a.float())).key != key  # read as float32
    assert trace_mods(None, document_mask(doc_a, causal=True)).key != key
    assert trace_mods(None, prefix_lm(3)).key != trace_mods(None, prefix_lm(4)).key  # constants
    assert trace_mods(softcap_mod(30.0), None).key != trace_mods(softcap_mod(50.0), None).key
    assert (
        trace_mods(softcap_mod(30.0), None).key
        == trace_mods(lambda s, b, h, q, k: 30.0 * torch.tanh(s / 30.0), None).key
    )
    one = trace_mods(None, lambda b, h, q, k: doc_a[b, q] == doc_a[b, k])
    assert (
        trace_mods(
            None, lambda b, h, q, k: doc_a[b, q, None] == 0 if False else doc_a[b, q] == doc_a[b, k]
        ).key
        == one.key
    )


def test_mod_variants_are_named_by_key_and_block_mask():
    traced = trace_mods(softcap_mod(), None)
    spec = ModVariantSpec(BASE, traced)
    sparse = ModVariantSpec(BASE, traced, block_sparse=True)
    assert spec.name == f"{BASE.name}_mod{traced.short_key}"
    assert sparse.name == f"{BASE.name}_mod{traced.short_key}_bsparse"
    assert spec.base == BASE and spec != BASE and spec != sparse
    assert spec == ModVariantSpec(BASE, trace_mods(softcap_mod(), None))
    assert hash(spec) == hash(ModVariantSpec(BASE, trace_mods(softcap_mod(), None)))
    assert spec.replace(causal=True).name == f"{BASE.replace(causal=True).name}_mod{traced.short_key}"


def test_mod_kernels_render_with_their_arguments():
    doc = torch.zeros(1, 8, dtype=torch.int32)
    table = torch.zeros(2, 15)
    traced = trace_mods(relative_bias(table, 8), document_mask(doc))
    for sparse in (False, True):
        spec = ModVariantSpec(BASE.replace(causal=True), traced, block_sparse=sparse)
        source = render_source(spec)
        assert f'SPEC_NAME = "{spec.name}"' in source
        assert f'FAKE_SPEC_NAME = "{spec.base.name}"' in source
        assert (
            "def mod_scores(" in source
            and "mod_t0: cute.Tensor" in source
            and "mod_t1: cute.Tensor" in source
        )
        assert ("mBlockRanges" in source) == sparse
        assert source.count("mod_scores(\n") == (4 if sparse else 3)  # the definition and each kv step
        assert "Float32(LOG2_E)" in source and "softmax_scale * LOG2_E" not in source
    softcap_source = render_source(ModVariantSpec(BASE, trace_mods(softcap_mod(), None)))
    assert "tanh_approx(" in softcap_source


def test_dense_sources_have_no_mods():
    sm90 = default_spec("sm90", "fwd", "bf16", 128)
    for spec in (BASE, BASE.replace(causal=True), sm90, sm90.replace(causal=True)):
        source = render_source(spec)
        assert "mod_scores" not in source and "FAKE_SPEC_NAME" not in source and "mBlockRanges" not in source


def test_families_without_mods_refuse():
    traced = trace_mods(softcap_mod(), None)
    for spec in (
        default_spec("sm90", "bwd", "bf16", 128), default_spec("sm100", "fwd", "bf16", 128),
        default_spec("sm100", "bwd", "bf16", 128),
    ):  # fmt: skip
        with pytest.raises(NotImplementedError, match="does not fuse score_mod/mask_mod yet"):
            ModVariantSpec(spec, traced)
    with pytest.raises(NotImplementedError, match="16-bit inputs only"):
        ModVariantSpec(default_spec("sm90", "fwd", "e4m3", 128), traced)


def test_api_refuses_what_mods_do_not_combine_with():
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="softcap"):
        cutefa.flash_attn_func(q, q, q, softcap=5.0, score_mod=softcap_mod())
    with pytest.raises(NotImplementedError, match="window_size"):
        cutefa.flash_attn_func(q, q, q, window_size=(4, 0), mask_mod=prefix_lm(2))
    with pytest.raises(NotImplementedError, match="dropout"):
        cutefa.flash_attn_func(q, q, q, 0.1, mask_mod=prefix_lm(2))


# ---------------------------------------------------------------------------------------------
# Block masks


def _dense_kinds(
    dense: torch.Tensor, bq: int, bk: int, kv_len: int, ragged_partial: bool = False
) -> torch.Tensor:
    batch, heads, sq, sk = dense.shape
    out = torch.empty(batch, heads, -(-sq // bq), -(-sk // bk), dtype=torch.int8)
    for m in range(out.shape[2]):
        for n in range(out.shape[3]):
            tile = dense[:, :, m * bq : (m + 1) * bq, n * bk : (n + 1) * bk]
            count = tile.sum(dim=(2, 3))
            full = count == tile.shape[2] * tile.shape[3]
            if ragged_partial and (n + 1) * bk > kv_len:
                full[:] = False
            out[:, :, m, n] = torch.where(count == 0, EMPTY, torch.where(full, FULL, PARTIAL))
    return out


@pytest.mark.parametrize(("sq", "sk", "block"), [(256, 256, 64), (200, 330, 64), (77, 50, (32, 16))])
def test_block_kinds_match_the_dense_mask(sq, sk, block):
    doc = random_docs(2, max(sq, sk), 3, seed=sq)
    for mask_mod in (document_mask(doc), document_mask(doc, causal=True), prefix_lm(40)):
        bm = create_block_mask(mask_mod, 2, None, sq, sk, device="cpu", BLOCK_SIZE=block)
        dense = bm.to_dense()
        want_dense = mask_mod(*grids(2, 1, sq, sk).values()).expand(2, 1, sq, sk)
        assert torch.equal(dense, want_dense)
        bq, bk = (block, block) if isinstance(block, int) else block
        assert torch.equal(bm.kinds, _dense_kinds(dense, bq, bk, sk))
        assert torch.equal(bm.kv_num_blocks, (bm.kinds != EMPTY).sum(-1).int())
        assert 0.0 <= bm.sparsity() <= 1.0


def test_ranges_cover_every_attended_key_and_leave_unmasked_only_full_blocks():
    sq, sk, tile_m, tile_n = 300, 260, 64, 32
    doc = random_docs(2, 300, 4, seed=3)
    for mask_mod in (
        document_mask(doc),
        prefix_lm(50),
        lambda b, h, q, k: (k % 3) == 0 if False else (k < 90) | (k > 200),
    ):
        for causal in (False, True):
            bm = create_block_mask(mask_mod, 2, 1, sq, sk, device="cpu")
            ranges = bm.ranges(tile_m, tile_n, causal, 2, 3)
            assert ranges.shape == (2, 3, -(-sq // tile_m), 4) and ranges.dtype == torch.int32
            dense = bm.to_dense()
            if causal:
                dense = dense & (torch.arange(sk).view(1, -1) <= torch.arange(sq).view(-1, 1) + sk - sq)
            kinds = _dense_kinds(dense, tile_m, tile_n, sk, ragged_partial=True)
            for b in range(2):
                for m in range(ranges.shape[2]):
                    n_first, n_last, u_first, u_last = ranges[b, 1, m].tolist()
                    assert n_first <= u_first <= u_last <= n_last <= -(-sk // tile_n)
                    needed = [n for n in range(kinds.shape[3]) if kinds[b, 0, m, n] != EMPTY]
                    assert all(n_first <= n < n_last for n in needed)
                    assert all(kinds[b, 0, m, n] == FULL for n in range(u_first, u_last))


def test_query_ranges_cover_every_query_block_of_a_key_block():
    sq, sk, tile_m, tile_n = 260, 300, 64, 64
    doc = random_docs(1, 300, 3, seed=5)
    for mask_mod in (document_mask(doc), prefix_lm(70)):
        for causal in (False, True):
            bm = create_block_mask(mask_mod, 1, 1, sq, sk, device="cpu")
            ranges = bm.query_ranges(tile_m, tile_n, causal, 2, 2)
            assert ranges.shape == (2, 2, -(-sk // tile_n), 4)
            dense = bm.to_dense()
            if causal:
                dense = dense & (torch.arange(sk).view(1, -1) <= torch.arange(sq).view(-1, 1) + sk - sq)
            kinds = _dense_kinds(dense, tile_m, tile_n, sk, ragged_partial=True)
            for n in range(ranges.shape[2]):
                m_first, m_last = ranges[1, 1, n, :2].tolist()
                needed = [m for m in range(kinds.shape[2]) if kinds[0, 0, m, n] != EMPTY]
                assert all(m_first <= m < m_last for m in needed) and m_last <= kinds.shape[2]


def test_kinds_to_ranges_of_rows_without_keys():
    kinds = torch.tensor(
        [[EMPTY, EMPTY, EMPTY], [PARTIAL, EMPTY, PARTIAL], [EMPTY, FULL, FULL]], dtype=torch.int8
    )
    assert kinds_to_ranges(kinds).tolist() == [[0, 0, 0, 0], [0, 3, 3, 3], [1, 3, 1, 3]]


def test_block_kinds_stripe_like_one_pass(monkeypatch):
    import cutefa.mods.block_mask as bm_module

    mask_mod = prefix_lm(33)
    whole = block_kinds(mask_mod, 1, 2, 190, 170, 16, 16, "cpu")
    monkeypatch.setattr(bm_module, "_STRIPE_ELEMENTS", 1)  # one query block at a time
    assert torch.equal(bm_module.block_kinds(mask_mod, 1, 2, 190, 170, 16, 16, "cpu"), whole)


def test_create_block_mask_checks_its_arguments():
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        create_block_mask(None, 1, 1, 8, 8, device="cpu")
    with pytest.raises(ValueError, match="Q_LEN=0"):
        create_block_mask(prefix_lm(1), 1, 1, 0, 8, device="cpu")
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        create_block_mask(prefix_lm(1), 1, 1, 8, 8, device="cpu", BLOCK_SIZE=(0, 4))
    assert cutefa.create_block_mask is create_block_mask


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_mod_kernels_render_for_every_default_head_dim(head_dim, dtype):
    from cutefa.mods.base import mod_base

    traced = trace_mods(softcap_mod(), prefix_lm(5))
    for causal in (False, True):
        base = mod_base("sm_80", dtype, head_dim, causal)
        assert base.tile_n <= mod_tile_n("sm80") and (base.mask.value == "causal") == causal
        for sparse in (False, True):
            source = render_source(ModVariantSpec(base, traced, block_sparse=sparse))
            compile(source, "mod kernel", "exec")
        for sparse in (False, True):
            bwd = ModVariantSpec(
                mod_base("sm_80", dtype, head_dim, causal, "bwd"), traced, block_sparse=sparse
            )
            source = render_source(bwd)
            compile(source, "mod backward kernel", "exec")
            assert ("mBlockRanges[batch, head, n_block, 0]" in source) == sparse
            # a block mask's full query blocks run without the mask_mod
            assert ("m_full_first = mBlockRanges[batch, head, n_block, 2]" in source) == sparse
            assert (", False, False," in source) == sparse
        # the backward scales P by d score_mod / d score (softcap's 1 - t^2 here)
        assert "d_mn=parts.acc_mn_view(dmod)" in source and "rPd = mod_p_grad(" in source


def test_a_mask_alone_needs_no_derivative_in_the_backward():
    bwd = ModVariantSpec(default_spec("sm80", "bwd", "bf16", 64), trace_mods(None, prefix_lm(5)))
    source = render_source(bwd)
    assert "mod_scores(" in source and "d_mn" not in source and "mod_p_grad" not in source
    shifted = trace_mods(lambda s, b, h, q, k: s + (q - k) * 0.5, None)  # derivative 1
    assert not shifted.needs_grad and trace_mods(softcap_mod(), None).needs_grad


def test_the_api_passes_the_documented_kernel_arguments(monkeypatch):
    """The forward's kernel takes (q, k, v, out, lse, softmax_scale, block_ranges, mod_t0, mod_t1)
    and the backward's trailing arguments are (query ranges, mod_t0, mod_t1) (cutefa.mods.variant)."""
    import cutefa.mods.api as api

    calls = []
    monkeypatch.setattr(api, "validate_inputs", lambda *a, **kw: None)
    monkeypatch.setattr(api.dispatch, "device_target", lambda device: ("sm_80", "test"))
    monkeypatch.setattr(
        api, "get_kernel", lambda spec, target: lambda *args: calls.append((spec, target, args))
    )
    monkeypatch.setattr(api, "call_on", lambda device, kernel, *args: kernel(*args))
    q = torch.zeros(2, 100, 4, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(2, 120, 2, 64, dtype=torch.bfloat16)
    doc = random_docs(2, 128, 3).long()
    table = torch.zeros(4, 255, dtype=torch.float16)
    bm = create_block_mask(document_mask(doc), 2, None, 100, 120, device="cpu")
    out, lse = api.attention_with_mods(q, k, v, None, True, relative_bias(table, 128), None, bm)
    assert out.shape == q.shape and lse.shape == (2, 4, 100)
    ((spec, target, args),) = calls
    assert isinstance(spec, ModVariantSpec) and spec.block_sparse and spec.causal and target == "sm_80"
    assert spec.direction == "fwd" and spec.tile_n == mod_tile_n("sm80") and spec.head_dim == 64
    assert args[:5] == (q, k, v, out, lse) and args[5] == pytest.approx(64**-0.5)
    ranges, t0, t1 = args[6:]
    assert torch.equal(ranges, bm.ranges(spec.tile_m, spec.tile_n, True, 2, 4))
    assert ranges.shape[:3] == (2, 4, 1)
    assert t0.dtype == torch.float32 and t0.shape == table.shape  # score_mod's table first
    assert t1.dtype == torch.int32 and torch.equal(t1, doc.int())  # then the block mask's mask_mod's ids
    assert api._ModArgs(mod_tensors=(t0, t1)).kernel_args(True, "bwd") == (t0, t1)
