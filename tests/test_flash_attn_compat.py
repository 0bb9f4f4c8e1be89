"""flash-attn's calling convention: ``flash_attn_func(q, k, v, dropout_p, softmax_scale, causal,
window_size, softcap, alibi_slopes, deterministic, return_attn_probs)`` runs unchanged, cutefa's
own options are keyword-only, and what cutefa does not implement yet is refused by name."""

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


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"dropout_p": 0.1}, "dropout_p=0.1"),
        ({"softcap": 30.0}, "softcap=30.0"),
        ({"alibi_slopes": torch.ones(4)}, "alibi_slopes"),
        ({"window_size": (128, 0)}, "window_size=(128, 0)"),
        ({"window_size": (-1, 64)}, "window_size=(-1, 64)"),
        ({"window_size": (256, 256), "causal": True}, "window_size=(256, 256)"),
    ],
)
def test_what_is_not_implemented_yet_is_refused_by_name(options, named):
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match=named.replace("(", r"\(").replace(")", r"\)")):
        cutefa.flash_attn_func(q, k, v, **options)


def test_a_window_size_that_is_not_a_pair_is_a_type_error():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="window_size=5 must be a pair"):
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
