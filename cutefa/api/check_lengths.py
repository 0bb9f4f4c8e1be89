"""The device-side check of a packed batch's lengths, once per lengths tensor.

``cu_seqlens_*`` and ``seqused_*`` live on the GPU; reading them would sync the host, so
:func:`assert_lengths_async` checks them with a few small kernels that end in a device assert. A
training step passes the same lengths tensors to every layer's forward and backward, and a
benchmark or server loop passes them again and again: the check runs once per tensor and
version (``Tensor._version`` counts torch's in-place writes, through any view), and again after the
tensor is written to, replaced by another object, or given with another ``total`` or
``max_seqlen``. (A write that bypasses torch, such as a foreign kernel handed its pointer, is not
seen: give such buffers as new tensors, or bump their version with an in-place no-op.) The tensors are
held by weak references (a freed tensor whose id comes back is not taken for checked). While a
CUDA graph is captured the check always runs, so that it is part of the graph and of every replay.
"""

from __future__ import annotations

import weakref

import torch

CHECKED_KEPT = 16  # (cu_seqlens, seqused) pairs remembered; the oldest is forgotten first
_CHECKED: dict[tuple[int, int | None, int, int], tuple] = {}


def assert_lengths_async(
    cu_seqlens: torch.Tensor, seqused: torch.Tensor | None, total: int, max_seqlen: int, side: str
) -> None:
    """On the device, no host sync: ``cu_seqlens`` non-decreasing from >= 0, its last entry within the
    packed tensor's ``total`` rows, every used length (``seqused`` or the span) within
    ``max_seqlen`` and, with ``seqused``, within its span. Skipped where the same tensors, unchanged
    since (their version counters), passed with the same ``total`` and ``max_seqlen`` (module docs);
    never skipped while a CUDA graph is being captured."""
    capturing = _capturing(cu_seqlens)
    key = (id(cu_seqlens), None if seqused is None else id(seqused), total, max_seqlen)
    state = (cu_seqlens._version, None if seqused is None else seqused._version)
    if not capturing and _seen(key, cu_seqlens, seqused, state):
        return
    spans = cu_seqlens[1:] - cu_seqlens[:-1]
    lengths = spans if seqused is None else seqused
    ok = (cu_seqlens[0] >= 0) & (cu_seqlens[-1] <= total)
    if spans.numel():
        ok = ok & (spans >= 0).all() & (lengths >= 0).all() & (lengths <= max_seqlen).all()
        if seqused is not None:
            ok = ok & (seqused <= spans).all()
    torch._assert_async(
        ok,
        f"cu_seqlens_{side}/seqused_{side} are not valid: cu_seqlens_{side} must be non-decreasing from 0 "
        f"to at most the packed rows ({total}), every length at most max_seqlen_{side} ({max_seqlen}) and "
        f"seqused_{side} within its span",
    )
    if not capturing:
        _remember(key, cu_seqlens, seqused, state)


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s device is capturing a CUDA graph on the current stream."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _seen(key: tuple, cu_seqlens: torch.Tensor, seqused: torch.Tensor | None, state: tuple) -> bool:
    entry = _CHECKED.get(key)
    if entry is None:
        return False
    cu_ref, used_ref, checked = entry
    return cu_ref() is cu_seqlens and (used_ref is None or used_ref() is seqused) and checked == state


def _remember(key: tuple, cu_seqlens: torch.Tensor, seqused: torch.Tensor | None, state: tuple) -> None:
    if len(_CHECKED) >= CHECKED_KEPT:
        _CHECKED.pop(next(iter(_CHECKED)))
    _CHECKED[key] = (weakref.ref(cu_seqlens), None if seqused is None else weakref.ref(seqused), state)
