"""The call-plan memo: one plan per eager call signature, and the allocation helpers plans share.

A plain eager call (plain tensors, nothing to differentiate, no tracing, no dispatch mode) that
launched a kernel leaves a *plan* under its signature: a closure that allocates, launches and
returns with no validation beyond what the key and the kernel's own argument checks guarantee
(:func:`cutefa.api.dense.make_plan`, :func:`cutefa.api.fp8.make_plan`). The next call with that
signature takes it.

Every change to the memo (a new plan, dropping the oldest, :func:`clear_plans`) holds
:data:`_LOCK`, so calls from several threads and a concurrent clear never see a table change
under them; looking a plan up is one ``dict.get`` and needs no lock. A plan made by a call that a
clear overtook (its dispatch choice may predate the clear) is not kept.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

# (q.shape, k.shape, q.dtype, q.is_cuda, q.get_device(), causal, softmax_scale) -> plan(q, k, v,
# return_lse). The device is keyed by (is_cuda, index): hashing and comparing a torch.device costs
# several times more. Only CUDA tensors get plans outside tests; a tensor of another device type
# with a colliding key gets its outputs on the plan's device, which the kernel refuses, so it
# takes the validating way like any refused call. v's shape is not in the key: a plan's output
# template has the head dim of its kernel's v (cutefa.api.dense.make_plan), and a call whose v has
# another one takes the validating way too.
_PLANS: dict[tuple[Any, ...], Callable[..., Any]] = {}
# fp8 calls: (the 16-bit key, the kind of each descale (descale_kind), out_dtype, the kind of
# v_mean) -> plan(q, k, v, q_descale, k_descale, v_descale, v_mean, return_lse). Calls with block
# descales (3-D) have no plan.
_FP8_PLANS: dict[tuple[Any, ...], Callable[..., Any]] = {}
# Training calls (eager autograd, cutefa.api.dense.attention): their forwards' plans, keyed like
# _PLANS (kept apart: a call with gradients never takes or leaves a plan of _PLANS), and (q.shape,
# k.shape, v.shape, q.dtype, q.is_cuda, q.get_device(), causal, softmax_scale, deterministic,
# backward.choose_bwd, backward.TAIL_SLOTS) -> the backward's plan
# (cutefa.api.backward_plan.make_bwd_plan).
_TRAIN_PLANS: dict[tuple[Any, ...], Callable[..., Any]] = {}
_BWD_PLANS: dict[tuple[Any, ...], Callable[..., Any]] = {}
MAX_PLANS = 1024  # the oldest plan is dropped beyond this (e.g. a new seqlen on every call)
# Per device: float32 buffers the kernel writes an unwanted lse into (return_lse=False). Never
# freed, so a kernel still writing one on any stream never writes memory handed out again.
_SCRATCH: dict[torch.device, list[torch.Tensor]] = {}
MAX_SCRATCH_ELEMENTS = 1 << 22  # 16 MiB of lse; larger problems allocate their lse per call
# Per device: float32 zeros that stand for an absent gradient of the lse (the backward kernels
# read dLSE and never write it). Never freed, like _SCRATCH.
_ZEROS: dict[torch.device, torch.Tensor] = {}
# Per (device, dtype): a one-element tensor; expanded views of it are allocation templates.
_PROTOS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_LOCK = threading.Lock()
_CLEARS = 0  # how many times the memo was cleared (see remember)

NO_PLAN = ("no plan",)  # a descale kind that no plan takes (descale_kind)

_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
# Non-zero while a dispatch mode is active: the length of the stack whose top
# _get_current_dispatch_mode returns (one C call instead of a Python one around it).
_dispatch_modes: Callable[[], Any] = getattr(torch._C, "_len_torch_dispatch_stack", None) or (
    lambda: _get_current_dispatch_mode() is not None
)


def clear_plans() -> None:
    """Forget the memoized call plans (:func:`cutefa.dispatch.clear_caches` does it too)."""
    global _CLEARS
    with _LOCK:
        _CLEARS += 1
        _PLANS.clear()
        _FP8_PLANS.clear()
        _TRAIN_PLANS.clear()
        _BWD_PLANS.clear()


def clears() -> int:
    """How many times the memo was cleared so far: a call reads it before it dispatches and gives
    it to :func:`remember` with its plan."""
    return _CLEARS


def remember(
    plans: dict[tuple[Any, ...], Callable[..., Any]], key: tuple[Any, ...], plan: Callable[..., Any], since: int
) -> None:
    """``plans[key] = plan``, dropping the oldest plans beyond :data:`MAX_PLANS`; nothing when the
    memo was cleared after the call that made ``plan`` read :func:`clears` (``since``)."""
    with _LOCK:
        if since != _CLEARS:
            return
        while plans and len(plans) >= MAX_PLANS:
            del plans[next(iter(plans))]
        plans[key] = plan


def descale_kind(d: object) -> tuple[Any, ...] | None:
    """What an fp8 plan's key records of a descale (or of v_mean): None, or a plain tensor's
    shape, dtype, device and contiguity. Anything else (not a tensor, or a tensor subclass) gives
    :data:`NO_PLAN`: such a call goes the validating way and leaves no plan."""
    if d is None:
        return None
    if d.__class__ is not _Tensor:
        return NO_PLAN
    return (d.shape, d.dtype, d.is_cuda, d.get_device(), d.is_contiguous())


def proto(device: torch.device, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A zero-stride view of ``shape``: ``torch.empty_like`` of it allocates a fresh contiguous
    tensor of that shape, dtype and device at less host cost than ``torch.empty(shape, ...)``."""
    one = _PROTOS.get((device, dtype))
    if one is None:
        one = _PROTOS.setdefault((device, dtype), torch.empty((), dtype=dtype, device=device))
    return one.expand(*shape)


def scratch_lse(device: torch.device, shape: tuple[int, int, int]) -> torch.Tensor | None:
    """A (batch, heads_q, seqlen_q) float32 view of the device's scratch buffer, or None when too big."""
    n = math.prod(shape)
    if n > MAX_SCRATCH_ELEMENTS:
        return None
    with _LOCK:
        buffers = _SCRATCH.setdefault(device, [])
        if not buffers or buffers[-1].numel() < n:
            size = min(MAX_SCRATCH_ELEMENTS, max(n, 2 * buffers[-1].numel() if buffers else 4096))
            buffers.append(torch.empty(size, dtype=torch.float32, device=device))
        return buffers[-1][:n].view(shape)


def zero_lse(device: torch.device, shape: tuple[int, int, int]) -> torch.Tensor | None:
    """A (batch, heads_q, seqlen_q) float32 view of zeros on ``device`` that kernels only read (an
    absent dLSE), or None when too big (over :data:`MAX_SCRATCH_ELEMENTS`) or while the current
    stream is being captured into a CUDA graph (a buffer made then would be zeroed only when the
    graph replays). A new buffer is zeroed and waited for before any stream reads it."""
    n = math.prod(shape)
    zeros = _ZEROS.get(device)
    if zeros is None or zeros.numel() < n:
        if n > MAX_SCRATCH_ELEMENTS or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return None
        with _LOCK:
            zeros = _ZEROS.get(device)
            if zeros is None or zeros.numel() < n:
                size = min(MAX_SCRATCH_ELEMENTS, max(n, 2 * zeros.numel() if zeros is not None else 4096))
                zeros = torch.zeros(size, dtype=torch.float32, device=device)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()  # every stream may read it from now on
                old = _ZEROS.get(device)
                if old is not None:
                    _RETIRED.append(old)  # a kernel may still read it: never freed
                _ZEROS[device] = zeros
    return zeros[:n].view(shape)


_RETIRED: list[torch.Tensor] = []  # zero buffers replaced by larger ones


def plain_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *more: torch.Tensor) -> bool:
    """Whether calling an op's implementation directly on q, k, v (and ``more``) is the same as
    calling the op, minus the op's dispatch overhead: plain tensors, no gradient to track, no
    tracing and no dispatch mode. Only such calls take or leave plans."""
    if not (type(q) is type(k) is type(v) is _Tensor):
        return False
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    if more and not all(type(t) is _Tensor and not (t.requires_grad and _grad_enabled()) for t in more):
        return False
    return not _is_compiling() and not _dispatch_modes()
