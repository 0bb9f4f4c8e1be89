"""Attention with features: the ``cutefa::attn_fwd`` / ``cutefa::attn_bwd`` custom ops, their fake
implementations and autograd.

One op pair serves every call that asks for more than dense attention: packed sequences
(``cu_seqlens_*``, :mod:`cutefa.api.varlen`), a sliding window, a softcap, ALiBi slopes and
attention sinks, alone or together. The kernel is the dispatched variant of the dense problem
with the call's mask and feature axes (:meth:`cutefa.dispatch.Problem.with_features`); the values
are kernel arguments (:mod:`cutefa.api.features`), so nothing here reads a GPU value or
allocates by one: calls can be captured in CUDA graphs once warm.

Packed rows that belong to no sequence (past ``cu_seqlens_q[-1]``, or past a sequence's
``seqused_q``) get output 0 and lse ``-inf``, written by a small kernel the forward kernel's module
launches before it (:mod:`cutefa.kernels.common.varlen_fill`: only those rows, found on the device,
so no memset of the whole output and no host read of the lengths), and zero gradients (the
backward's gradients start from zeros; its kernels never touch those rows).
The gradient of ``sinks`` is computed here from the lse and the backward kernel's own
``D_i = rowsum(dO * O)_i - dlse_i`` (its preprocess writes it for every row):
``dsink_h = -sum_i exp(sink_h - lse_i) * D_i`` over the rows of head ``h`` (one pass over
(heads, rows) float32 numbers, not over dO and O again).

v may have a head dim of its own (:data:`cutefa.model.spec.HEAD_DIM_V_PAIRS`): out has v's. Its
gradient raises ``NotImplementedError`` when asked for (no backward kernel takes one yet).
"""

from __future__ import annotations

import math

import torch

from cutefa import dispatch
from cutefa.api import launch
from cutefa.api.features import FeatureArgs
from cutefa.api.launch import aligned, call_on
from cutefa.api.validate import check_backward_head_dims
from cutefa.loader import get_kernel


def feature_args(
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None,
    seqused_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, window_left: int, window_right: int,
    softcap: float, alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None, batch: int,
) -> FeatureArgs:  # fmt: skip
    """The kernel-ready values of an op's arguments: seqused from the spans where not given, the
    slopes as (batch, heads_q) float32, sinks float32."""
    if cu_seqlens_q is not None:
        if seqused_q is None:
            seqused_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        if seqused_k is None:
            seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    if alibi_slopes is not None:
        heads = alibi_slopes.shape[-1]
        alibi_slopes = alibi_slopes.float().expand(batch, heads).contiguous()
    window = None if (window_left, window_right) == (-1, -1) else (window_left, window_right)
    return FeatureArgs(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=None if sinks is None else sinks.float().contiguous(),
    )  # fmt: skip


def _problem(
    q: torch.Tensor, k: torch.Tensor, f: FeatureArgs, v: torch.Tensor | None = None
) -> dict[str, int]:  # fmt: skip
    if f.varlen:
        facts = {
            "head_dim": q.shape[-1], "seqlen_q": f.max_seqlen_q, "seqlen_k": f.max_seqlen_k,
            "batch": f.cu_seqlens_q.shape[0] - 1, "heads_q": q.shape[-2], "heads_kv": k.shape[-2],
            "total_q": q.shape[0],
        }  # fmt: skip
    else:
        batch, seqlen_q, heads_q, head_dim = q.shape
        facts = {
            "head_dim": head_dim, "seqlen_q": seqlen_q, "seqlen_k": k.shape[1], "batch": batch,
            "heads_q": heads_q, "heads_kv": k.shape[2],
        }  # fmt: skip
    if v is not None and v.shape[-1] != q.shape[-1]:
        facts["head_dim_v"] = v.shape[-1]
    return facts


def choose(
    q: torch.Tensor, k: torch.Tensor, causal: bool, f: FeatureArgs, v: torch.Tensor | None = None
) -> dispatch.Choice:  # fmt: skip
    """The variant for the call (v's head dim where ``v`` is given)."""
    target, gpu_name = dispatch.device_target(q.device)
    return dispatch.choose(
        target=target, dtype=q.dtype, causal=causal, gpu_name=gpu_name, local=f.window is not None,
        features=f.features(), **_problem(q, k, f, v),
    )  # fmt: skip


def describe(f: FeatureArgs) -> str:
    """What the CUTEFA_LOG line adds for a call with features."""
    parts = []
    if f.varlen:
        parts.append(f"varlen: {f.cu_seqlens_q.shape[0] - 1} sequences, max_seqlen_q={f.max_seqlen_q} "
                     f"max_seqlen_k={f.max_seqlen_k}")  # fmt: skip
    if f.window is not None:
        parts.append(f"window={f.window}")
    if f.softcap:
        parts.append(f"softcap={f.softcap}")
    if f.alibi_slopes is not None:
        parts.append("alibi")
    if f.sinks is not None:
        parts.append("sinks")
    return " ".join(parts)


def empty_outputs(
    q: torch.Tensor, varlen: bool, head_dim_v: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out like q but of head dim ``head_dim_v`` where given, lse float32: (heads_q, total_q)
    packed, else the dense call's (batch, heads_q, seqlen_q), :func:`cutefa.api.launch.empty_outputs`)."""
    if not varlen:
        return launch.empty_outputs(q, head_dim_v=head_dim_v)
    out = torch.empty(launch.out_shape(q, head_dim_v), dtype=q.dtype, device=q.device)
    return out, torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)


def _no_key_lse(lse: torch.Tensor, f: FeatureArgs, varlen: bool) -> torch.Tensor:
    """Fill ``lse`` for rows that attend no key: -inf, or the head's sink."""
    if f.sinks is None:
        return lse.fill_(-math.inf)
    sinks = f.sinks.view(-1, 1) if varlen else f.sinks.view(1, -1, 1)
    return lse.copy_(sinks.expand_as(lse))


def _attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float, window_left: int,
    window_right: int, softcap: float, alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention forward with features: (out like q but of v's head dim, lse). Inputs were validated
    by the caller (:func:`cutefa.flash_attn_func`, :func:`cutefa.flash_attn_varlen_func`)."""
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    f = feature_args(
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, window_left,
        window_right, softcap, alibi_slopes, sinks, batch,
    )  # fmt: skip
    out, lse = empty_outputs(q, varlen, v.shape[-1])
    if out.numel() == 0:
        return out, lse
    if k.numel() == 0 or batch == 0:  # no keys anywhere
        return out.zero_(), _no_key_lse(lse, f, varlen)
    # packed: the kernel's module writes the rows of no sequence too (out 0, lse -inf), on the device
    choice = choose(q, k, causal, f, v)
    kernel = get_kernel(choice.spec, choice.target)
    q, k, v = aligned(q), aligned(k), aligned(v)
    call_on(q.device, kernel, q, k, v, out, lse, softmax_scale, *f.kernel_args(causal))
    dispatch.log_run(choice, q.shape, k.shape, causal, describe(f))
    return out, lse


attn_fwd = torch.library.custom_op("cutefa::attn_fwd", _attn_fwd, mutates_args=())
attn_fwd_impl = _attn_fwd  # what the op runs: plain eager calls with no gradient take it directly


@attn_fwd.register_fake
def _attn_fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float, window_left: int,
    window_right: int, softcap: float, alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return empty_outputs(q, cu_seqlens_q is not None, v.shape[-1])


# ---------------------------------------------------------------------------------------------
# Backward


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, dpsum: torch.Tensor, varlen: bool) -> torch.Tensor:
    """d loss / d sinks (heads_q,) float32 (module docstring) from the lse and the backward
    kernel's D (``dpsum``, lse's shape); rows with lse -inf (no sequence's) take no part."""
    sink = sinks.float().view(-1, 1) if varlen else sinks.float().view(1, -1, 1)
    live = torch.isfinite(lse)
    g = torch.where(live, torch.exp(sink - lse) * dpsum, torch.zeros_like(dpsum))
    return -(g.sum(dim=1) if varlen else g.sum(dim=(0, 2)))


def _attn_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
    seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
    causal: bool, softmax_scale: float, window_left: int, window_right: int, softcap: float,
    alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients (dq, dk, dv, dsinks) of :func:`_attn_fwd`; dsinks is empty without sinks."""
    from cutefa.api import backward, feature_bwd

    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    f = feature_args(
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, window_left,
        window_right, softcap, alibi_slopes, sinks, batch,
    )  # fmt: skip
    # with sinks the kernel's D per row is kept for their gradient (zeros: rows of no sequence
    # are never written)
    dpsum = None if sinks is None else torch.zeros(lse.shape, dtype=torch.float32, device=q.device)
    if feature_bwd.backward_features(f).any or f.window is not None:
        dq, dk, dv = feature_bwd.gradients(
            dout, q, k, v, out, lse, dlse, causal, softmax_scale, deterministic, f, dpsum=dpsum
        )
    else:  # sinks alone: the dense backward (the lse carries them)
        dq, dk, dv = backward.gradients(
            dout, q, k, v, out, lse, dlse, causal, softmax_scale, deterministic, dpsum=dpsum
        )
    if sinks is None:
        dsinks = torch.zeros((0,), dtype=torch.float32, device=q.device)
    elif dq.numel() == 0 or dk.numel() == 0:  # no kernel ran: D is rowsum(0 * O) - dlse
        dsinks = sink_grad(sinks, lse, -(dlse.float() if dlse is not None else torch.zeros_like(dpsum)), varlen)
    else:
        dsinks = sink_grad(sinks, lse, dpsum, varlen)
    return dq, dk, dv, dsinks


attn_bwd = torch.library.custom_op("cutefa::attn_bwd", _attn_bwd, mutates_args=())


@attn_bwd.register_fake
def _attn_bwd_fake(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
    seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
    causal: bool, softmax_scale: float, window_left: int, window_right: int, softcap: float,
    alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    heads = 0 if sinks is None else sinks.shape[0]
    dsinks = torch.empty((heads,), dtype=torch.float32, device=q.device)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


# Inputs of cutefa::attn_fwd, in order (setup_context names them).
_FWD_INPUTS = (
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k",
    "causal", "softmax_scale", "window_left", "window_right", "softcap", "alibi_slopes", "sinks", "deterministic",
)  # fmt: skip


def _setup_context(ctx, inputs, output) -> None:
    named = dict(zip(_FWD_INPUTS, inputs))
    out, lse = output
    tensors = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "alibi_slopes", "sinks")
    ctx.tensor_names = tensors
    ctx.save_for_backward(*(named[n] for n in tensors), out, lse)
    ctx.scalars = {n: named[n] for n in _FWD_INPUTS if n not in tensors}
    ctx.head_dims = (named["q"].shape[-1], named["v"].shape[-1])


def _backward(ctx, grad_out, grad_lse):
    check_backward_head_dims(*ctx.head_dims)  # v of a head dim of its own that no backward takes
    *saved, out, lse = ctx.saved_tensors
    named = dict(zip(ctx.tensor_names, saved))
    s = ctx.scalars
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dsinks = attn_bwd(
        grad_out, named["q"], named["k"], named["v"], out, lse, grad_lse, named["cu_seqlens_q"],
        named["cu_seqlens_k"], named["seqused_q"], named["seqused_k"], s["max_seqlen_q"], s["max_seqlen_k"],
        s["causal"], s["softmax_scale"], s["window_left"], s["window_right"], s["softcap"], named["alibi_slopes"],
        named["sinks"], s["deterministic"],
    )  # fmt: skip
    grads = {"q": dq, "k": dk, "v": dv, "sinks": dsinks if named["sinks"] is not None else None}
    return tuple(grads.get(n) for n in _FWD_INPUTS)


torch.library.register_autograd("cutefa::attn_fwd", _backward, setup_context=_setup_context)
