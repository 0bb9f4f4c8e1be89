"""The backward's call plans: one per call signature.

The ``cutefa::flash_bwd`` op (autograd of the custom op, compiled graphs at run time, the SDPA
provider) and an eager training call (:func:`cutefa.api.dense.attention`) take their gradients
from :func:`cutefa.api.backward.planned_gradients`: the first call of a signature validates,
chooses the variant and launches (:func:`cutefa.api.backward.gradients`), and leaves a *plan*
(:func:`make_bwd_plan`) that the next calls take: the variant, its kernel and the workspace shapes
decided once (:class:`cutefa.api.backward.BwdSetup`), allocation from prototypes, a shared zero
buffer for an absent lse gradient, and where the kernel binds (an sm90 kernel loaded from a file,
CUDA tensors) a launcher that writes only the data pointers (:meth:`cutefa.ffi.Function.bind`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cutefa import dispatch
from cutefa.api import plans as _plans

_F32 = torch.float32
# Whether a plan pre-binds the sm90 backward's launcher (:func:`bind`): off until a GPU run has held
# the bound launch to the full call (tests/gpu/test_host_train_gpu.py turns it on and compares them
# bit for bit); the plan's other savings (no variant choice, prototypes, the shared zero lse
# gradient) stand without it.
BIND = False


def bind(
    setup: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
    deterministic: bool,
) -> Callable[..., bool] | None:  # fmt: skip
    """The sm90 kernel of ``setup`` (a :class:`cutefa.api.backward.BwdSetup`) bound for contiguous
    tensors of these shapes on q's CUDA device, every argument in its order (q, k, v, out, dout,
    lse, dlse, dq, dk, dv, dq_accum, dkv_accum, lse_log2, dpsum; then the scale and the mode), or
    None (another family, not on a GPU, or a kernel that cannot bind)."""
    binder = getattr(setup.kernel, "bind", None)
    if binder is None or not q.is_cuda or setup.spec.arch != "sm90":
        return None
    from cutefa.ffi import TensorLayout

    device = q.get_device()
    out_shape = (*q.shape[:-1], v.shape[-1])
    dkv = setup.dkv_accum_shape or setup.dq_accum_shape
    shapes = [
        (q.shape, q.dtype), (k.shape, q.dtype), (v.shape, q.dtype), (out_shape, q.dtype),
        (out_shape, q.dtype),
        (setup.lse_shape, _F32), (setup.lse_shape, _F32), (q.shape, q.dtype), (k.shape, q.dtype),
        (v.shape, q.dtype), (setup.dq_accum_shape, _F32), (dkv, _F32), (setup.lse_shape, _F32),
        (setup.lse_shape, _F32),
    ]  # fmt: skip
    layouts = [TensorLayout(shape, dtype, device) for shape, dtype in shapes]
    try:
        return binder([*layouts, float(softmax_scale), int(deterministic)], tuple(range(len(layouts))))
    except AttributeError:
        return None


def make_bwd_plan(
    setup: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, deterministic: bool,
    run: Callable[..., None],
) -> Callable[..., Any]:  # fmt: skip
    """The backward of one call signature (the shapes of q, k and v, q's dtype and device, the mask,
    the scale and the mode) as a closure ``plan(dout, q, k, v, out, lse, dlse) -> (dq, dk, dv)`` that
    allocates from prototypes (:func:`cutefa.api.plans.proto`) and launches ``setup``'s kernel,
    with no variant choice. ``setup``: a :class:`cutefa.api.backward.BwdSetup`; ``run``:
    :func:`cutefa.api.backward.run_bwd`, which takes the calls the bound launcher does not.

    Safe without per-call validation because every call that reaches a plan has the key's shapes
    (so its head dims have a backward, its grid fits and the problem is not empty), q's dtype and
    device, and saved tensors that the forward validated (k and v of q's dtype and device) or made
    (out and lse). The bound launcher takes only what it was bound for: dout and dlse of out's and
    lse's shape, dtype and device, and every tensor contiguous (checked here, since a bound call
    reads none of those fields); anything else, or a launch the kernel's entry refuses (a
    misaligned pointer: nothing is launched), goes through ``run``,
    which aligns and converts."""
    device, index, dtype = q.device, q.get_device(), q.dtype
    grads = tuple(_plans.proto(device, t.dtype, tuple(t.shape)) for t in (q, k, v))
    shapes = {"dq_accum": (setup.dq_accum_shape, _F32), "lse_log2": (setup.lse_shape, _F32)}
    shapes["dpsum"] = (setup.lse_shape, _F32)
    if setup.dkv_accum_shape is not None:
        shapes["dkv_accum"] = (setup.dkv_accum_shape, _F32)
    if setup.spec.arch != "sm90" and setup.group > 1:
        heads = (*k.shape[:2], q.shape[2])
        shapes["dk_heads"] = ((*heads, k.shape[-1]), dtype)
        shapes["dv_heads"] = ((*heads, v.shape[-1]), dtype)
    protos = {name: _plans.proto(device, dt, shape) for name, (shape, dt) in shapes.items()}
    empty_like = torch.empty_like

    def empty(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return empty_like(protos[name])  # the shape and dtype run_bwd asks for: the setup's

    dq_proto, dk_proto, dv_proto = grads
    accum_proto, log2_proto, dpsum_proto = protos["dq_accum"], protos["lse_log2"], protos["dpsum"]
    dkv_proto = protos.get("dkv_accum")
    zeros = _plans.zero_lse(device, setup.lse_shape)  # kept for good: a view of it stays valid
    fast = bind(setup, q, k, v, softmax_scale, deterministic) if BIND else None
    out_shape, lse_shape = (*q.shape[:-1], v.shape[-1]), setup.lse_shape
    choice = dispatch.Choice(setup.spec, setup.target, "backward")

    def plan(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, dlse: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        dq, dk, dv = empty_like(dq_proto), empty_like(dk_proto), empty_like(dv_proto)
        if dlse is None:
            dlse = zeros
        if (
            fast is not None
            and dlse is not None
            and dout.dtype is dtype
            and dout.shape == out_shape
            and dout.get_device() == index
            and dlse.dtype is _F32
            and dlse.shape == lse_shape
            and dlse.get_device() == index
            and dout.is_contiguous()
            and dlse.is_contiguous()
            and q.is_contiguous()
            and k.is_contiguous()
            and v.is_contiguous()
            and out.is_contiguous()
            and lse.is_contiguous()
            and lse.dtype is _F32
            and lse.shape == lse_shape
            and k.dtype is dtype
            and v.dtype is dtype
            and out.dtype is dtype
        ):
            accum = empty_like(accum_proto)
            dkv = accum if dkv_proto is None else empty_like(dkv_proto)
            try:
                launched = fast(
                    q, k, v, out, dout, lse, dlse, dq, dk, dv, accum, dkv, empty_like(log2_proto),
                    empty_like(dpsum_proto),
                )  # fmt: skip
            except (ValueError, TypeError):  # refused before launching: the full call aligns
                launched = False
            if launched:
                if dispatch._LOG_RUNS:
                    dispatch.log_run(choice, q.shape, k.shape, setup.spec.causal)
                return dq, dk, dv
        run(setup, dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, deterministic, empty)
        return dq, dk, dv

    return plan
