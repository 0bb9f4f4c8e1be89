"""What the attention API accepts: checks that name the argument, the value and what is accepted.

Only metadata is read, so the checks also run on fake tensors while ``torch.compile`` traces.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from cutefa.fp8 import FP8_DTYPES
from cutefa.model.spec import ACCEPTED_HEAD_DIMS, HEAD_DIM_V_PAIRS, HEAD_DIMS, why_not_head_dims

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
FP8_INPUT_DTYPE = torch.float8_e4m3fn  # the fp8 format of the sm90 and sm100 fp8 forwards
FP8_OUT_DTYPES = (torch.bfloat16,)  # the fp8 forward's output dtypes (the kernel writes bf16)
# Device types the kernels run on; the validation tests widen it.
DEVICE_TYPES: tuple[str, ...] = ("cuda",)
NAMES = ("q", "k", "v")
# The launch grids (templates/*.j2): the sm80 and sm100 forwards, the sm90 forwards other than the
# persistent and longest-first (1-D) ones, and every kernel of every backward (preprocess, main,
# postprocess) launch (tiles, heads_q, batch): heads_q in grid y and batch in grid z, each at most
# 65535. Grid x (at most 2^31 - 1) takes the tiles, which no problem that fits in GPU memory
# fills. The persistent and 1-D forwards would take more, but the backward cannot and tuned tables
# decide which forward runs, so one limit holds for every call; lifting it means folding batch and
# heads into grid x (or a loop over grid slices) in the kernels.
GRID_YZ_LIMIT = 65535


def default_scale(softmax_scale: float | None, head_dim: int) -> float:
    """``softmax_scale`` as a float, or ``1 / sqrt(head_dim)`` when it is None."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def check_tensors(tensors: Sequence[object]) -> tuple[torch.Tensor, ...]:
    for name, t in zip(NAMES, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seqlen, heads, head_dim); got {t.dim()}-D shape {tuple(t.shape)}"
            )
    return tuple(tensors)  # type: ignore[arg-type]  # each was checked above


def check_dtypes(tensors: Sequence[torch.Tensor], fp8: bool = False) -> None:
    """16-bit inputs, or with ``fp8`` float8_e4m3fn inputs (the only fp8 format with a kernel)."""
    for name, t in zip(NAMES, tensors):
        if fp8:
            if t.dtype in FP8_DTYPES and t.dtype != FP8_INPUT_DTYPE:
                raise NotImplementedError(
                    f"{name} has dtype {t.dtype}: cutefa's fp8 forward takes torch.float8_e4m3fn only"
                )
            if t.dtype != FP8_INPUT_DTYPE:
                raise TypeError(
                    f"{name} has dtype {t.dtype}; an fp8 call needs q, k and v all torch.float8_e4m3fn"
                )
            continue
        if t.dtype in FP8_DTYPES:
            raise NotImplementedError(
                f"{name} has dtype {t.dtype}: fp8 inputs go through the fp8 forward (float8_e4m3fn with "
                "q_descale/k_descale/v_descale); this path takes torch.float16 or torch.bfloat16"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; cutefa accepts torch.float16 or torch.bfloat16")
    if len({t.dtype for t in tensors}) > 1:
        got = ", ".join(f"{n} {t.dtype}" for n, t in zip(NAMES, tensors))
        raise TypeError(f"q, k and v must have one dtype; got {got}")


def check_devices(tensors: Sequence[torch.Tensor], device_types: Sequence[str] | None = None) -> None:
    """On one device of ``device_types`` (default :data:`DEVICE_TYPES`)."""
    allowed = DEVICE_TYPES if device_types is None else device_types
    for name, t in zip(NAMES, tensors):
        if t.device.type not in allowed:
            raise ValueError(f"cutefa runs on CUDA tensors; got {name} on {t.device}")
    if len({t.device for t in tensors}) > 1:
        got = ", ".join(f"{n} on {t.device}" for n, t in zip(NAMES, tensors))
        raise ValueError(f"q, k and v must be on one device; got {got}")


def check_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, standard_only: bool = False,
    separate_v: bool = False,
) -> None:  # fmt: skip
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"batch sizes differ: q has {q.shape[0]}, k has {k.shape[0]}, v has {v.shape[0]}")
    check_heads(q, k, v, standard_only=standard_only, separate_v=separate_v)
    check_grid_limits(q)


def head_dim_v_pairs() -> str:
    """The (head_dim, head_dim_v) pairs with a V head dim of its own, as text for messages."""
    return ", ".join(f"({d}, {dv})" for d, dv in HEAD_DIM_V_PAIRS)


def check_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, standard_only: bool = False,
    separate_v: bool = False,
) -> None:  # fmt: skip
    """The last two dims of q, k, v (heads, head_dim) of either layout, dense or packed: q and k of
    one head dim, :data:`~cutefa.model.spec.ACCEPTED_HEAD_DIMS`; v of the same one, or with
    ``separate_v`` (the 16-bit forwards of flash_attn_func and flash_attn_varlen_func) of a pair
    of :data:`~cutefa.model.spec.HEAD_DIM_V_PAIRS`; k like v but for the head dim, and q's heads a
    multiple of k's. ``standard_only``: the head dim is one of :data:`~cutefa.model.spec.HEAD_DIMS`
    and v's is q's (the fp8 forward's)."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"head_dim differs: q has {q.shape[-1]}, k has {k.shape[-1]}; q and k must have one head dim"
        )
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"k and v must have the same shape (but for v's head dim); got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"q's heads ({heads_q}) must be a multiple of k/v's heads ({heads_kv}) (grouped-query attention)"
        )
    head_dim, head_dim_v = int(q.shape[-1]), int(v.shape[-1])  # (a traced call guards on them)
    reason = why_not_head_dims(head_dim, head_dim_v)
    if reason is not None:
        if head_dim_v == head_dim:
            raise ValueError(
                f"head_dim={head_dim} is not supported (q.shape[-1]): cutefa takes {ACCEPTED_HEAD_DIMS}"
            )
        raise ValueError(
            f"head_dim_v={head_dim_v} (v.shape[-1]) with head_dim={head_dim} (q.shape[-1]): {reason}"
        )
    if head_dim_v != head_dim and (standard_only or not separate_v):
        which = "the fp8 forward takes" if standard_only else "this call takes"
        raise NotImplementedError(
            f"head_dim_v={head_dim_v} (v.shape[-1]) apart from head_dim={head_dim} (q.shape[-1]): "
            f"{which} v of q's head dim only; a V head dim of its own, (head_dim, head_dim_v) in "
            f"{head_dim_v_pairs()}, is taken by the 16-bit forward of flash_attn_func and "
            "flash_attn_varlen_func (without score_mod, mask_mod or block_mask)"
        )
    if standard_only and head_dim not in HEAD_DIMS:
        raise ValueError(
            f"head_dim={head_dim} is not supported by the fp8 forward (q.shape[-1]): it takes head_dim in {HEAD_DIMS}"
        )


def tensor_of_dims(name: str, t: object, dims: int, what: str) -> torch.Tensor:
    """``t`` itself: TypeError unless a tensor, ValueError unless ``dims``-D (``what``: the layout's words)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {what}; got {t.dim()}-D shape {tuple(t.shape)}")
    return t


def int32_tensor(name: str, t: object, shape: tuple[int, ...], q: torch.Tensor, what: str) -> None:
    """``t`` is an int32 tensor of ``shape`` on q's device (index and length tensors of a call)."""
    tensor_of_dims(name, t, len(shape), what)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32; got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} {what}; got {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def check_cache_seqlens(cache_seqlens: object, batch: int, q: torch.Tensor) -> None:
    """A KV-cache call's ``cache_seqlens``: an int32 tensor (batch,) on q's device, an int >= 0 (every
    sequence that long) or None (the whole cache)."""
    if isinstance(cache_seqlens, torch.Tensor):
        int32_tensor("cache_seqlens", cache_seqlens, (batch,), q, "(batch,)")
    elif cache_seqlens is not None and (
        isinstance(cache_seqlens, bool)
        or not isinstance(cache_seqlens, numbers.Integral)
        or cache_seqlens < 0
    ):
        raise TypeError(
            f"cache_seqlens must be an int32 tensor (batch,), an int >= 0 or None; got {cache_seqlens!r}"
        )


def check_backward_head_dims(head_dim: int, head_dim_v: int) -> None:
    """``NotImplementedError`` for the gradients of a forward whose (q/k, v) head dims no backward
    kernel takes, naming what is supported: v of q's head dim, or a pair of
    :data:`~cutefa.model.spec.HEAD_DIM_V_PAIRS` ((192, 128): the sm90 backward on Hopper for dense calls,
    the sm80 one elsewhere and for packed calls)."""
    if head_dim_v != head_dim and (head_dim, head_dim_v) not in HEAD_DIM_V_PAIRS:
        raise NotImplementedError(
            f"the backward of attention with head_dim_v={head_dim_v} (v.shape[-1]) apart from head_dim={head_dim} "
            f"(q.shape[-1]) is not implemented: the backward takes v of q's head dim, or "
            f"(head_dim, head_dim_v) in {head_dim_v_pairs()}"
        )


def check_grid_limits(q: torch.Tensor) -> None:
    """q's batch and heads fit the kernels' launch grids (:data:`GRID_YZ_LIMIT`)."""
    batch, _, heads_q, _ = q.shape
    limited = (("heads_q", heads_q, "q's heads", "y"), ("batch", batch, "the batch", "z"))
    for name, value, what, axis in limited:
        if value > GRID_YZ_LIMIT:
            raise ValueError(
                f"{name}={value} is over cutefa's limit of {GRID_YZ_LIMIT}: its kernels take {what} as "
                f"the launch grid's {axis} dimension, which holds at most {GRID_YZ_LIMIT}; split the call "
                f"along {what}"
            )


def check_strides(tensors: Sequence[torch.Tensor]) -> None:
    for name, t in zip(NAMES, tensors):
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name}.stride(-1) must be 1 (contiguous head_dim); got {t.stride(-1)}; pass {name}.contiguous()"
            )


def check_options(causal: object, softmax_scale: object) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a positive finite float or None; got {softmax_scale!r}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float or None; got {softmax_scale!r}")


MAX_SPLITS = 256  # num_splits a decode call may ask for: the fp32 workspace grows with it


def check_split_options(num_splits: object, softmax_scale: object) -> None:
    """A decode call's ``num_splits`` (an int in [0, MAX_SPLITS], 0: the heuristic's choice) and
    ``softmax_scale`` (a positive finite float or None)."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int (0: chosen by the heuristic); got {num_splits!r}")
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(
            f"num_splits must be in [0, {MAX_SPLITS}] (0: chosen by the heuristic); got {num_splits}"
        )
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, numbers.Real)
        or not (math.isfinite(softmax_scale) and softmax_scale > 0)
    ):
        raise ValueError(f"softmax_scale must be a positive finite float or None; got {softmax_scale!r}")


def check_deterministic(deterministic: object) -> None:
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool; got {deterministic!r}")


def validate_inputs(
    q: object,
    k: object,
    v: object,
    *,
    causal: object = False,
    softmax_scale: object = None,
    device_types: Sequence[str] | None = None,
    separate_v: bool = False,
) -> None:
    """Raise ``TypeError``/``ValueError``/``NotImplementedError`` naming what is wrong with the inputs.

    ``device_types`` defaults to :data:`DEVICE_TYPES` (CUDA). ``separate_v``: v may have a head dim
    of its own (:func:`check_heads`). Only metadata is read.
    """
    _validate(q, k, v, False, causal, softmax_scale, device_types, separate_v)


def validate_fp8_inputs(
    q: object, k: object, v: object, *, causal: object = False, softmax_scale: object = None,
    device_types: Sequence[str] | None = None,
) -> None:  # fmt: skip
    """:func:`validate_inputs` for an fp8 call: q, k and v all float8_e4m3fn."""
    _validate(q, k, v, True, causal, softmax_scale, device_types)


def _validate(
    q: object, k: object, v: object, fp8: bool, causal: object, softmax_scale: object,
    device_types: Sequence[str] | None, separate_v: bool = False,
) -> None:  # fmt: skip
    tensors = check_tensors((q, k, v))
    check_dtypes(tensors, fp8=fp8)
    check_devices(tensors, device_types)
    check_shapes(*tensors, standard_only=fp8, separate_v=separate_v)
    check_strides(tensors)
    check_options(causal, softmax_scale)


def check_v_mean(v_mean: object, q: object, k: object, v: object) -> None:
    """``v_mean`` fits an fp8 call: a float32 tensor (batch, heads_kv, head_dim) on v's device."""
    check_tensors((q, k, v))
    if q.dtype not in FP8_DTYPES:  # type: ignore[attr-defined]
        raise ValueError(
            f"v_mean applies to fp8 (torch.float8_e4m3fn) inputs only; got q with dtype {q.dtype}"  # type: ignore[attr-defined]
        )
    if not isinstance(v_mean, torch.Tensor):
        raise TypeError(f"v_mean must be a torch.Tensor or None; got {type(v_mean).__name__}")
    batch, _, heads_kv, head_dim = v.shape  # type: ignore[attr-defined]
    if v_mean.dtype != torch.float32 or tuple(v_mean.shape) != (batch, heads_kv, head_dim):
        raise ValueError(
            f"v_mean must be float32 of shape (batch, heads_kv, head_dim) = {(batch, heads_kv, head_dim)}; "
            f"got {v_mean.dtype} {tuple(v_mean.shape)} (cutefa.center_v returns it)"
        )
    if v_mean.device != v.device:  # type: ignore[attr-defined]
        raise ValueError(f"v_mean is on {v_mean.device}, v on {v.device}")  # type: ignore[attr-defined]
