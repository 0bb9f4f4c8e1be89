"""The 16-bit forward: the ``cutefa::flash_fwd`` custom op, its fake implementation and autograd,
and the call plan of a plain eager call.

``flash_fwd(q, k, v, causal, softmax_scale[, deterministic]) -> (out, lse)`` validates, allocates
and runs the dispatched kernel; an empty problem (batch, seqlen_q or heads_q of 0) returns empty
results and one without keys a zero output and a ``-inf`` log-sum-exp, neither with a launch.
Gradients of out and lse come from ``cutefa::flash_bwd`` (:mod:`cutefa.api.backward`).

v may have a head dim of its own (a pair of :data:`cutefa.model.spec.HEAD_DIM_V_PAIRS`, e.g.
DeepSeek's q/k of 192 against v of 128): out then has v's head dim. Its gradient comes from the
backward that takes the pair (:func:`cutefa.api.validate.check_backward_head_dims`: (192, 128) in the
sm80 family); a pair no backward takes raises ``NotImplementedError`` when a gradient is asked for
(a forward under ``torch.no_grad()``/``torch.inference_mode()`` runs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cutefa import dispatch
from cutefa.api import backward as _backward
from cutefa.api import plans as _plans
from cutefa.api.launch import aligned, call_on, choose, empty_outputs, out_shape, outputs
from cutefa.api.validate import check_backward_head_dims, validate_inputs
from cutefa.loader import get_kernel


def _launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, softmax_scale: float,
) -> tuple[dispatch.Choice, Callable[..., Any]]:  # fmt: skip
    """Dispatch and run the kernel on the current stream of q's device, writing ``out`` and ``lse``.

    Returns what ran: (the dispatch choice, the kernel)."""
    choice = choose(q, k, causal, v=v)
    kernel = get_kernel(choice.spec, choice.target)
    q, k, v = aligned(q), aligned(k), aligned(v)
    call_on(q.device, kernel, q, k, v, out, lse, softmax_scale)
    dispatch.log_run(choice, q.shape, k.shape, causal)
    return choice, kernel


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor, tuple[dispatch.Choice, Callable[..., Any]] | None]:
    """Validate, allocate and launch: (out, lse, what ran or None when nothing was launched)."""
    validate_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale, separate_v=True)
    out, lse, final = outputs(q, k, head_dim_v=v.shape[-1])
    return out, lse, None if final else _launch(q, k, v, out, lse, causal, softmax_scale)


def _flash_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention forward: returns (out like q but of v's head dim, lse float32 (batch, heads_q,
    seqlen_q)). ``deterministic`` only selects the backward's mode (saved for autograd)."""
    out, lse, _ = forward(q, k, v, causal, softmax_scale)
    return out, lse


flash_fwd = torch.library.custom_op("cutefa::flash_fwd", _flash_fwd, mutates_args=())


@flash_fwd.register_fake
def _flash_fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    validate_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale, separate_v=True)
    return empty_outputs(q, head_dim_v=v.shape[-1])


def _setup_context(ctx, inputs, output) -> None:
    """:func:`cutefa.api.backward.setup_context`, and the head dims the backward checks."""
    _backward.setup_context(ctx, inputs, output)
    ctx.head_dims = (inputs[0].shape[-1], inputs[2].shape[-1])


def _autograd_backward(ctx, grad_out, grad_lse):
    """:func:`cutefa.api.backward.backward`; ``NotImplementedError`` for v of a head dim of its own
    that no backward takes (:func:`cutefa.api.validate.check_backward_head_dims`), raised here, where
    a gradient is asked for."""
    check_backward_head_dims(*ctx.head_dims)
    return _backward.backward(ctx, grad_out, grad_lse)


torch.library.register_autograd("cutefa::flash_fwd", _autograd_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# Eager training calls

# Whether eager training calls take :class:`_Attention` (False: the custom op, as under tracing;
# benchmarks and tests compare the two).
FAST_TRAINING = True

_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float, deterministic: bool
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``cutefa::flash_fwd`` of validated options, differentiable: an eager training call (plain
    tensors of which one requires a gradient, grad mode on, no tracing, no dispatch mode, no
    functorch transform) goes through :class:`_Attention`, which runs the same kernels as the
    custom op and its autograd without the op dispatcher's and ``torch.library``'s host cost, from
    the call plans of the forward (:data:`cutefa.api.plans._TRAIN_PLANS`) and of the backward
    (:func:`cutefa.api.backward.planned_gradients`); every other call (``torch.compile``, dispatch
    modes, ``torch.func``) is the custom op itself."""
    if (
        FAST_TRAINING
        and type(q) is type(k) is type(v) is _Tensor
        and _grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
        and not _plans._is_compiling()
        and not _plans._dispatch_modes()
        and not _functorch_active()
    ):
        return _Attention.apply(q, k, v, causal, softmax_scale, deterministic)
    return flash_fwd(q, k, v, causal, softmax_scale, deterministic)


def planned_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, lse) of validated options through the call plan of the signature (made by the first
    call that launched, outside CUDA graph capture), as a plain eager call with ``return_lse``."""
    key = (q.shape, k.shape, q.dtype, q.is_cuda, q.get_device(), causal, softmax_scale)
    plan = _plans._TRAIN_PLANS.get(key)
    if plan is not None:
        return plan(q, k, v, True)
    since = _plans.clears()
    out, lse, launched = forward(q, k, v, causal, softmax_scale)
    if launched is not None and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        _plans.remember(_plans._TRAIN_PLANS, key, make_plan(*launched, q, k, causal, softmax_scale), since)
    return out, lse


class _Attention(torch.autograd.Function):
    """``cutefa::flash_fwd`` and its autograd (:func:`_setup_context`, :func:`_autograd_backward`)
    for eager training calls: the same kernels, outputs and gradients, called directly."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, deterministic):
        out, lse = planned_forward(q, k, v, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (causal, softmax_scale, deterministic)
        ctx.set_materialize_grads(False)  # an unused out or lse gets no zeros tensor
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None and grad_lse is None:
            return None, None, None, None, None, None
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        causal, softmax_scale, deterministic = ctx.options
        dq, dk, dv = _backward.planned_gradients(
            grad_out, q, k, v, out, lse, grad_lse, causal, softmax_scale, deterministic
        )
        return dq, dk, dv, None, None, None


# ---------------------------------------------------------------------------------------------
# The call plan


def make_plan(
    choice: dispatch.Choice, kernel: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, causal: bool,
    softmax_scale: float,
) -> Callable[..., Any]:  # fmt: skip
    """The call path of one validated call signature: allocate, launch, return.

    Safe without per-call validation because every call that reaches the plan has the key's
    shapes of q and k (so its head counts divide and head_dim is supported), dtype of q, device of
    q, causal and scale, and plain tensors with nothing to differentiate; everything else the
    kernel's TVM-FFI entry checks before it launches anything: v's shape against k's, the dtypes
    of k and v, that all tensors are on q's device (it switches to that device itself), 16-byte
    aligned data pointers and row strides, contiguous last dims. When it refuses, the call goes the
    validating way, which names the problem or copies misaligned inputs.

    Contiguous q, k, v take the kernel's bound launcher (:meth:`cutefa.ffi.Function.bind`): the
    argument buffer is laid out once for the key's shapes and each call writes only the five data
    pointers, after the checks the kernel would make on the fields it no longer reads (v's shape,
    the dtypes and devices of k and v). Other strides go through the kernel's full call.

    The key does not hold v's shape: v and out have the head dim of the choice's spec (v's own,
    :attr:`~cutefa.model.spec.VariantSpec.head_dim_v`), and a call whose v has another one goes
    the validating way, which dispatches for it.
    """
    batch, seqlen_q, heads_q, _ = q.shape
    lse_shape = (batch, heads_q, seqlen_q)
    head_dim_v = choice.spec.head_dim_v
    out_proto = _plans.proto(q.device, q.dtype, out_shape(q, head_dim_v))
    lse_proto = _plans.proto(q.device, torch.float32, lse_shape)
    scratch = _plans.scratch_lse(q.device, lse_shape)
    q_shape, k_shape = tuple(q.shape), tuple(k.shape)
    v_shape = (*k_shape[:-1], head_dim_v)
    empty_like = torch.empty_like
    fast = bind(kernel, q, k, lse_shape, softmax_scale, head_dim_v)
    dtype, device = q.dtype, q.get_device()

    def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool) -> Any:
        out = empty_like(out_proto)
        lse = scratch if scratch is not None and not return_lse else empty_like(lse_proto)
        try:
            # The bound launcher takes contiguous q/k/v of the key's layout (v like k but for its
            # head dim) on q's device.
            if not (
                fast is not None
                and q.is_contiguous()
                and k.is_contiguous()
                and v.is_contiguous()
                and k.dtype is dtype
                and v.dtype is dtype
                and v.shape == v_shape
                and k.get_device() == device
                and v.get_device() == device
                and fast(q, k, v, out, lse)
            ):
                if v.shape[-1] != head_dim_v:  # another V head dim: another kernel, the validating way's
                    raise ValueError("v's head dim is not the plan's")
                kernel(q, k, v, out, lse, softmax_scale)
        except (ValueError, TypeError):  # refused before launching: see above
            out, lse, _ = forward(q, k, v, causal, softmax_scale)
        else:
            if dispatch._LOG_RUNS:
                dispatch.log_run(choice, q_shape, k_shape, causal)
        return (out, lse) if return_lse else out

    return plan


def bind(
    kernel: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, lse_shape: tuple[int, int, int],
    softmax_scale: float, head_dim_v: int | None = None,
) -> Callable[..., bool] | None:  # fmt: skip
    """The kernel's launcher for contiguous q, k, v, out, lse of these shapes (v and out of head dim
    ``head_dim_v`` where given, else of q's) on q's CUDA device (:meth:`cutefa.ffi.Function.bind`),
    or None when the kernel cannot bind (kept in memory)."""
    binder = getattr(kernel, "bind", None)
    if binder is None or not q.is_cuda:
        return None
    from cutefa.ffi import TensorLayout

    device = q.get_device()
    v_shape = k.shape if head_dim_v is None else (*k.shape[:-1], head_dim_v)
    layouts = [
        TensorLayout(q.shape, q.dtype, device),
        TensorLayout(k.shape, q.dtype, device),
        TensorLayout(v_shape, q.dtype, device),
        TensorLayout(out_shape(q, head_dim_v), q.dtype, device),
        TensorLayout(lse_shape, torch.float32, device),
    ]
    try:
        return binder([*layouts, softmax_scale], (0, 1, 2, 3, 4))
    except AttributeError:
        return None
