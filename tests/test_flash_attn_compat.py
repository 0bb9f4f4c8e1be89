"""flash-attn's calling convention: ``flash_attn_func(q, k, v, dropout_p, softmax_scale, causal,
window_size, softcap, alibi_slopes, deterministic, return_attn_probs)`` runs unchanged, cutefa's
own options are keyword-only, the masks and score modifiers take the feature op, and what cutefa
does not implement (dropout) is refused by name."""

from __future__ import annotations

import inspect

import pytest
import torch
from test_call_path import fake_gpu, qkv  # noqa: F401 -- the fixture: kernels replaced on the CPU

import cutefa

# flash-attn 2's flash_attn_func, in order, with its defaults.
FLASH_ATTN_POSITIONAL = (
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
    ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
    ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False),
)  # fmt: skip


def test_the_positional_parameters_are_flash_attns():
    params = list(inspect.signature(cutefa.flash_attn_func).parameters.values())
    positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == list(FLASH_ATTN_POSITIONAL)
    extras = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert {"return_lse", "q_descale", "k_descale", "v_descale", "out_dtype", "v_mean"} <= set(extras)


def test_dropout_is_refused_by_name():
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
        cutefa.flash_attn_func(q, k, v, dropout_p=0.1)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"softcap": 30.0}, (False, -1, -1, 30.0, False, False)),
        ({"alibi_slopes": torch.ones(4)}, (False, -1, -1, 0.0, True, False)),
        ({"sinks": torch.ones(4)}, (False, -1, -1, 0.0, False, True)),
        ({"window_size": (128, 0)}, (False, 128, 0, 0.0, False, False)),
        ({"window_size": (-1, 64)}, (False, -1, 64, 0.0, False, False)),
        ({"window_size": (256, 256), "causal": True}, (True, 256, 0, 0.0, False, False)),
    ],
)
def test_windows_softcap_alibi_and_sinks_take_the_feature_op(monkeypatch, options, expected):
    from cutefa.api import feature_ops, validate

    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    seen = []

    def fake_attn_fwd(q, k, v, cu_q, cu_k, su_q, su_k, max_q, max_k, causal, scale, left, right, cap, alibi, sinks, det):
        seen.append((causal, left, right, cap, alibi is not None, sinks is not None))
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(feature_ops, "attn_fwd", fake_attn_fwd)
    monkeypatch.setattr(feature_ops, "attn_fwd_impl", fake_attn_fwd)  # plain eager calls skip the op
    q, k, v = qkv()
    cutefa.flash_attn_func(q, k, v, **options)
    assert seen == [expected]


def test_a_window_size_that_is_not_a_pair_is_a_type_error():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="window_size must be a pair"):
        cutefa.flash_attn_func(q, k, v, window_size=5)


def test_positional_calls_and_flash_attn_defaults(fake_gpu):  # noqa: F811
    """Positional flash-attn calls take the same kernel (a causal one) as cutefa's keywords; the
    stand-in kernel computes unmasked attention, so the mask shows in the kernel's name."""
    kernels, _ = fake_gpu
    q, k, v = qkv(sq=8, sk=11)
    by_keyword = cutefa.flash_attn_func(q, k, v, softmax_scale=0.2, causal=True)
    assert torch.equal(cutefa.flash_attn_func(q, k, v, 0.0, 0.2, True), by_keyword)
    assert torch.equal(cutefa.flash_attn_func(q, k, v, 0.0, 0.2, True, (-1, -1), 0.0, None, False), by_keyword)
    assert torch.equal(cutefa.flash_attn_func(q, k, v, softmax_scale=0.2, window_size=(None, None), causal=True), by_keyword)
    # flash-attn: window_size=(-1, 0) is the causal mask (bottom-right aligned), with or without causal=True
    assert torch.equal(cutefa.flash_attn_func(q, k, v, softmax_scale=0.2, window_size=(-1, 0)), by_keyword)
    assert torch.equal(cutefa.flash_attn_func(q, k, v, softmax_scale=0.2, window_size=[-1, 0]), by_keyword)
    assert len(kernels) == 1 and all("_causal" in name for name in kernels)
    cutefa.flash_attn_func(q, k, v, 0.0, 0.2, False, (-1, -1))
    assert len(kernels) == 2 and sum("_causal" in name for name in kernels) == 1


def test_return_attn_probs_gives_out_lse_and_no_probabilities(fake_gpu):  # noqa: F811
    q, k, v = qkv()
    out, lse = cutefa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    result = cutefa.flash_attn_func(q, k, v, 0.0, None, True, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 3 and result[2] is None
    assert torch.equal(result[0], out) and torch.equal(result[1], lse)
