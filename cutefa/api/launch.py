"""What every kernel launch of the API shares: the dispatch choice for the tensors, their 16-byte
alignment, the output allocation, and the device-guarded call of a kernel.

Kernels run on the current torch stream of their device, and nothing here synchronizes with the
GPU, so launches can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from cutefa import dispatch
from cutefa import profile as _profile

_ALIGN_BYTES = 16


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the kernels' layout holds (a contiguous last dim, 16-byte aligned data
    pointer and row strides), else a contiguous copy."""
    step = _ALIGN_BYTES // t.element_size()
    if t.stride(-1) == 1 and t.data_ptr() % _ALIGN_BYTES == 0 and all(s % step == 0 for s in t.stride()[:-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> dict[str, int]:
    """The shape facts of a problem that dispatch reads (:class:`cutefa.dispatch.Problem`); with
    ``v`` of a head dim of its own, also ``head_dim_v``."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    facts = {
        "head_dim": head_dim, "seqlen_q": seqlen_q, "seqlen_k": k.shape[1], "batch": batch, "heads_q": heads_q,
        "heads_kv": k.shape[2],
    }  # fmt: skip
    if v is not None and v.shape[-1] != head_dim:
        facts["head_dim_v"] = v.shape[-1]
    return facts


def choose(
    q: torch.Tensor, k: torch.Tensor, causal: bool, v_centered: bool = False, v: torch.Tensor | None = None
) -> dispatch.Choice:  # fmt: skip
    """The forward variant dispatch picks for q and k (and v's head dim, where ``v`` is given) on
    q's device (``v_centered``: an fp8 call whose v was centered,
    :attr:`cutefa.dispatch.Problem.v_centered`)."""
    with _profile.phase("device query"):
        target, gpu_name = dispatch.device_target(q.device)
    with _profile.phase("dispatch (tuned tables)"):
        return dispatch.choose(
            target=target, dtype=q.dtype, causal=causal, gpu_name=gpu_name, v_centered=v_centered,
            **shapes(q, k, v),
        )  # fmt: skip


def out_shape(q: torch.Tensor, head_dim_v: int | None = None) -> tuple[int, ...]:
    """The output's shape: q's, with the last dim ``head_dim_v`` where given (v's head dim)."""
    return tuple(q.shape) if head_dim_v is None else (*q.shape[:-1], head_dim_v)


def empty_outputs(
    q: torch.Tensor, dtype: torch.dtype | None = None, head_dim_v: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Uninitialized (out like q, of ``dtype`` if given and of head dim ``head_dim_v`` if given; lse
    float32 (batch, heads_q, seqlen_q))."""
    batch, seqlen_q, heads_q, _ = q.shape
    shape = q.shape if head_dim_v is None else out_shape(q, head_dim_v)
    out = torch.empty(shape, dtype=q.dtype if dtype is None else dtype, device=q.device)
    return out, torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)


def outputs(
    q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype | None = None, head_dim_v: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """:func:`empty_outputs`, and whether they are already the result, with no launch: an empty
    problem (batch, seqlen_q or heads_q of 0), or no keys (every row attends nothing: output 0,
    log-sum-exp ``-inf``)."""
    out, lse = empty_outputs(q, dtype, head_dim_v)
    if out.numel() == 0:
        return out, lse, True
    if k.shape[1] == 0:
        return out.zero_(), lse.fill_(-math.inf), True
    return out, lse, False


def call_on(device: torch.device, kernel: Callable[..., Any], *args: Any) -> None:
    """``kernel(*args)`` with ``device`` the current CUDA device (a kernel launches on the current
    stream of the current device); no device switch when it already is. With profiling on, the
    kernel's first call is a phase of its own."""
    with _first_call_phase(kernel):
        if device.index == torch.cuda.current_device():
            kernel(*args)
        else:
            with torch.cuda.device(device):
                kernel(*args)


# Kernels (by id; they are memoized for the process) whose first call was profiled.
_PROFILED_KERNELS: set[int] = set()


def _first_call_phase(kernel: Callable[..., Any]) -> Any:
    """With profiling on, a phase around the first call of ``kernel`` (where the CUDA module of
    its cubin is loaded); else a no-op context."""
    if not _profile.ENABLED or id(kernel) in _PROFILED_KERNELS:
        return _profile.OFF
    _PROFILED_KERNELS.add(id(kernel))
    return _profile.phase("first kernel call (module load, launch)")
