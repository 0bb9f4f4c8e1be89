"""The user-facing calls with features: :func:`flash_attn_varlen_func` (packed sequences) and
:func:`dense_with_features` (what :func:`cutefa.flash_attn_func` runs for a window, softcap,
ALiBi or sinks). Both validate, then call the ``cutefa::attn_fwd`` op (:mod:`cutefa.api.feature_ops`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cutefa.api import feature_ops
from cutefa.api.check_lengths import assert_lengths_async
from cutefa.api.plans import plain_eager
from cutefa.api.validate import default_scale
from cutefa.api.validate_features import (
    check_dropout,
    check_features,
    mask_options,
    validate_dense,
    validate_varlen,
)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Attention over packed sequences, as flash-attn's ``flash_attn_varlen_func``.

    q (total_q, heads_q, head_dim), k (total_k, heads_kv, head_dim) and v (total_k, heads_kv,
    head_dim_v), fp16/bf16 CUDA tensors (``head_dim_v``: q's, or its own in a pair of
    :data:`cutefa.model.spec.HEAD_DIM_V_PAIRS`, forward only: its gradient raises
    ``NotImplementedError``); sequence ``b`` holds rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q
    (and likewise of k, v):
    ``cu_seqlens_*`` int32 (batch + 1,) on q's device. ``max_seqlen_q``/``max_seqlen_k`` (ints) bound
    every sequence's length (the launch grid is sized by them; a longer sequence is an error).
    ``seqused_q``/``seqused_k`` int32 (batch,): how many rows of each span are used (buffers with
    slack); the rest of the span is ignored. Causal masking and windows are aligned bottom-right
    per sequence, with its own lengths. ``window_size``, ``softcap``, ``alibi_slopes`` and
    ``sinks`` as in :func:`cutefa.flash_attn_func`. e4m3 q, k, v (Hopper) with ``q_descale``,
    ``k_descale``, ``v_descale`` float32 (batch, heads_kv) or None: the e4m3 forward
    (:func:`cutefa.api.fp8.fp8_varlen_forward`: bf16 output, no window/softcap/ALiBi/sinks, no
    backward).

    Returns ``out`` (like q, of v's head dim), or ``(out, lse)`` with ``return_lse`` (lse float32
    (heads_q, total_q)), or flash-attn's ``(out, lse, None)`` with ``return_attn_probs``. Packed rows of no
    sequence (past ``cu_seqlens_q[-1]`` or a sequence's ``seqused_q``) are 0 with lse ``-inf`` and
    get zero gradients. Differentiable in q, k, v and sinks.

    The lengths are GPU values and are never read on the host: their consistency (non-decreasing,
    within the packed rows and ``max_seqlen_*``, seqused within the span) is checked on the device
    without a sync, as a device-side assert that ends the CUDA context when it fails (what reading
    out of bounds would do, reported instead of happening). So calls can be captured in CUDA graphs.
    """
    check_dropout(dropout_p)
    if q.dtype == torch.float8_e4m3fn or any(d is not None for d in (q_descale, k_descale, v_descale)):
        return _fp8_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
            softcap, alibi_slopes, sinks, deterministic, seqused_q, seqused_k, q_descale, k_descale, v_descale,
            return_lse, return_attn_probs,
        )  # fmt: skip
    batch = validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, causal,
        softmax_scale, deterministic,
    )  # fmt: skip
    causal, left, right = mask_options(causal, window_size)
    softcap = check_features(q, batch, softcap, alibi_slopes, sinks)
    if not torch.compiler.is_compiling() and q.is_cuda:
        assert_lengths_async(cu_seqlens_q, seqused_q, q.shape[0], max_seqlen_q, "q")
        assert_lengths_async(cu_seqlens_k, seqused_k, k.shape[0], max_seqlen_k, "k")
    out, lse = _attn_fwd(q, k, v, alibi_slopes, sinks)(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, int(max_seqlen_q), int(max_seqlen_k), causal,
        default_scale(softmax_scale, q.shape[-1]), left, right, softcap, alibi_slopes,
        None if sinks is None else sinks.float(), deterministic,
    )  # fmt: skip
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


def _fp8_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap,
    alibi_slopes, sinks, deterministic, seqused_q, seqused_k, q_descale, k_descale, v_descale, return_lse,
    return_attn_probs,
):  # fmt: skip
    """The e4m3 varlen forward; the options it lacks refused by name."""
    from cutefa.api.fp8 import fp8_varlen_forward

    lacking = [
        name for name, given in (
            ("window_size", tuple(window_size) != (-1, -1)), ("softcap", bool(softcap)),
            ("alibi_slopes", alibi_slopes is not None), ("sinks", sinks is not None),
            ("deterministic", bool(deterministic)),
        ) if given
    ]  # fmt: skip
    if lacking:
        raise NotImplementedError(
            f"{', '.join(lacking)} with e4m3 inputs in flash_attn_varlen_func: the e4m3 varlen forward takes "
            "causal, softmax_scale, seqused_q/k and the descales only"
        )
    out = fp8_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        softmax_scale=softmax_scale, seqused_q=seqused_q, seqused_k=seqused_k, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, return_lse=return_lse or return_attn_probs,
    )  # fmt: skip
    if return_attn_probs:
        return (*out, None)
    return out


def dense_with_features(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None, causal: bool,
    window_size: object, softcap: object, alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, lse) of a (batch, seqlen, heads, head_dim) call with a window, softcap, ALiBi or sinks."""
    causal, left, right = mask_options(causal, window_size)
    validate_dense(q, k, v, causal, softmax_scale)
    softcap = check_features(q, q.shape[0], softcap, alibi_slopes, sinks)
    return _attn_fwd(q, k, v, alibi_slopes, sinks)(
        q, k, v, None, None, None, None, q.shape[1], k.shape[1], causal, default_scale(softmax_scale, q.shape[-1]),
        left, right, softcap, alibi_slopes, None if sinks is None else sinks.float(), deterministic,
    )  # fmt: skip


def _attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """The ``cutefa::attn_fwd`` op, or its implementation itself for a plain eager call with nothing
    to differentiate (the same work without the op dispatcher's host cost)."""
    tensors = [t for t in (alibi_slopes, sinks) if t is not None]
    return feature_ops.attn_fwd_impl if plain_eager(q, k, v, *tensors) else feature_ops.attn_fwd


def has_features(window_size: object, softcap: object, alibi_slopes: object, sinks: object) -> bool:
    """Whether a flash_attn_func call needs the feature path (anything but (-1, -1)/(-1, 0) windows,
    or a softcap, slopes or sinks)."""
    if softcap != 0.0 or alibi_slopes is not None or sinks is not None:
        return True
    try:
        left, right = window_size  # type: ignore[misc]
    except (TypeError, ValueError):
        return True  # validation names it
    return not (left in (-1, None) and right in (-1, None, 0))
