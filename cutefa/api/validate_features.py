"""What the API accepts for a call's features (window, softcap, ALiBi, sinks, packed sequences), with
errors that name the argument.

Only metadata is read, so the checks also run on fake tensors while ``torch.compile`` traces. The
values inside ``cu_seqlens_*``/``seqused_*`` live on the GPU and cannot be read without a host
sync: :func:`cutefa.api.check_lengths.assert_lengths_async` checks them on the device instead (a
failing check is a device assert, which ends the CUDA context like the out-of-bounds reads it
prevents).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from cutefa.api.validate import (
    GRID_YZ_LIMIT,
    SUPPORTED_DTYPES,
    check_deterministic,
    check_devices,
    check_heads,
    check_options,
    check_strides,
)

NAMES = ("q", "k", "v")


def normalize_window(window_size: object) -> tuple[int, int]:
    """flash-attn's ``window_size``: a pair (left, right) of ints >= -1 (-1 or None: unbounded)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right); got {window_size!r}")
    sides = []
    for side, value in zip(("left", "right"), window_size):
        if value is None:
            value = -1
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < -1:
            raise ValueError(f"window_size's {side} must be an int >= -1 (-1: unbounded) or None; got {value!r}")
        sides.append(int(value))
    return sides[0], sides[1]


def check_softcap(softcap: object) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float (0: no cap); got {softcap!r}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0: no cap); got {softcap!r}")
    return float(softcap)


def check_head_tensor(name: str, t: object, q: torch.Tensor, batch: int, heads_q: int, per_batch: bool) -> None:
    """``t`` is a float tensor of shape (heads_q,) (or (batch, heads_q) where ``per_batch``) on q's device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None; got {type(t).__name__}")
    shapes = [(heads_q,)] + ([(batch, heads_q)] if per_batch else [])
    if tuple(t.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {want}; got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor (float32 preferred); got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def _check_qkv(tensors: Sequence[object], dims: int, layout: str) -> tuple[torch.Tensor, ...]:
    for name, t in zip(NAMES, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D {layout}; got {t.dim()}-D shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; cutefa's windowed, capped, ALiBi, sink and varlen calls take "
                "torch.float16 or torch.bfloat16"
            )
    if len({t.dtype for t in tensors}) > 1:  # type: ignore[union-attr]
        got = ", ".join(f"{n} {t.dtype}" for n, t in zip(NAMES, tensors))  # type: ignore[union-attr]
        raise TypeError(f"q, k and v must have one dtype; got {got}")
    return tuple(tensors)  # type: ignore[arg-type]


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """:func:`~cutefa.api.validate.check_heads`, v of a head dim of its own accepted (the feature
    forwards take the pairs of :data:`~cutefa.model.spec.HEAD_DIM_V_PAIRS`)."""
    check_heads(q, k, v, separate_v=True)
    if q.shape[-2] > GRID_YZ_LIMIT:
        raise ValueError(f"heads_q={q.shape[-2]} is over cutefa's limit of {GRID_YZ_LIMIT} (the launch grid's y)")


def validate_dense(q: object, k: object, v: object, causal: object, softmax_scale: object) -> None:
    """q, k, v of (batch, seqlen, heads, head_dim) for a call with features (v's head dim may be
    its own: :func:`_check_heads`)."""
    tensors = _check_qkv((q, k, v), 4, "(batch, seqlen, heads, head_dim)")
    check_devices(tensors)
    q_, k_, v_ = tensors
    if not q_.shape[0] == k_.shape[0] == v_.shape[0]:
        raise ValueError(f"batch sizes differ: q has {q_.shape[0]}, k has {k_.shape[0]}, v has {v_.shape[0]}")
    if q_.shape[0] > GRID_YZ_LIMIT:
        raise ValueError(f"batch={q_.shape[0]} is over cutefa's limit of {GRID_YZ_LIMIT} (the launch grid's z)")
    _check_heads(q_, k_, v_)
    check_strides(tensors)
    check_options(causal, softmax_scale)


def _check_lengths(name: str, t: object, q: torch.Tensor, length: int | None) -> int:
    """An int32 1-D tensor on q's device; returns its length (checked against ``length`` if given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor; got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32; got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D; got shape {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}); got {t.device}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries; got {t.shape[0]}")
    return t.shape[0]


def _check_max_seqlen(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}")
    return value  # type: ignore[return-value]


def validate_varlen(
    q: object, k: object, v: object, cu_seqlens_q: object, cu_seqlens_k: object, max_seqlen_q: object,
    max_seqlen_k: object, seqused_q: object, seqused_k: object, causal: object, softmax_scale: object,
    deterministic: object,
) -> int:  # fmt: skip
    """Packed q (total_q, heads_q, head_dim), k (total_k, heads_kv, head_dim) and v (total_k,
    heads_kv, head_dim_v) and their sequences' metadata; returns the number of sequences."""
    tensors = _check_qkv((q, k, v), 3, "(total, heads, head_dim)")
    check_devices(tensors)
    q_, k_, v_ = tensors
    _check_heads(q_, k_, v_)
    check_strides(tensors)
    check_options(causal, softmax_scale)
    check_deterministic(deterministic)
    return check_sequences(q_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)


def check_sequences(
    q: torch.Tensor, cu_seqlens_q: object, cu_seqlens_k: object, max_seqlen_q: object, max_seqlen_k: object,
    seqused_q: object, seqused_k: object,
) -> int:  # fmt: skip
    """The sequences' metadata of a packed call (int32 1-D tensors on q's device of matching
    lengths, max lengths ints >= 0), checked without reading GPU values; returns the number of
    sequences."""
    entries = _check_lengths("cu_seqlens_q", cu_seqlens_q, q, None)
    if entries < 1:
        raise ValueError("cu_seqlens_q must have batch + 1 >= 1 entries; got 0")
    _check_lengths("cu_seqlens_k", cu_seqlens_k, q, entries)
    batch = entries - 1
    if batch > GRID_YZ_LIMIT:
        raise ValueError(f"batch={batch} sequences is over cutefa's limit of {GRID_YZ_LIMIT} (the launch grid's z)")
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            _check_lengths(name, t, q, batch)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    return batch


def mask_options(causal: object, window_size: object) -> tuple[bool, int, int]:
    """(causal, window_left, window_right) of flash-attn's ``causal`` and ``window_size``: causal caps
    the right side at 0; ``(-1, 0)`` is the causal mask; a window with both sides unbounded is none,
    given as ``(-1, -1)``."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    left, right = normalize_window(window_size)
    if causal and right != 0:
        right = 0
    if right == 0 and left == -1:
        return True, -1, -1
    if (left, right) == (-1, -1):
        return causal, -1, -1
    return causal, left, right


def check_dropout(dropout_p: object) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"dropout_p={dropout_p!r}: cutefa has no attention dropout yet (pass 0.0, as at inference)"
        )


def check_features(
    q: torch.Tensor, batch: int, softcap: object, alibi_slopes: object, sinks: object
) -> float:
    """softcap, alibi_slopes ((heads_q,) or (batch, heads_q)) and sinks ((heads_q,)); returns softcap."""
    heads_q = q.shape[-2]
    if alibi_slopes is not None:
        check_head_tensor("alibi_slopes", alibi_slopes, q, batch, heads_q, per_batch=True)
    if sinks is not None:
        check_head_tensor("sinks", sinks, q, batch, heads_q, per_batch=False)
    return check_softcap(softcap)
