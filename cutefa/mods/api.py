"""Attention with a user's ``score_mod`` / ``mask_mod`` / ``block_mask`` (``cutefa.flash_attn_func``'s
keywords): trace, pick the kernel, launch.

The forward is the default forward of the target's family that fuses mods (:func:`cutefa.mods.base.mod_arch`:
the sm90 family's on sm_90a, else the sm80 family's, which runs on every GPU from sm_80 on) for the
dtype and head dim, with the mods fused (:class:`cutefa.mods.variant.ModVariantSpec`): its name, and so
its rendered module, compile-cache entry and process memo, are keyed by the traced expression, so a
second call with the same mods (the same function or another that traces the same) reuses the
kernel. Tracing runs on every call (tens of microseconds), which picks up a captured tensor that
was rebound since the last call. Scores are ``softmax_scale * q.k`` before the score_mod; the lse is
the natural-log sum of exp of the modified scores. The backward runs the sm80 family's backward
with the same mods (:class:`_ModAttention`), d score_mod / d score derived symbolically
(:mod:`cutefa.mods.derivative`); with a block mask it visits, per key block, the query blocks from the
first to the last that attend it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cutefa import dispatch
from cutefa.api.features import FeatureArgs
from cutefa.api.launch import aligned, call_on, outputs
from cutefa.api.validate import default_scale, validate_inputs
from cutefa.loader import get_kernel
from cutefa.mods.base import mod_arch, mod_base
from cutefa.mods.block_mask import BlockMask
from cutefa.mods.traced import TracedMods, trace_mods
from cutefa.mods.variant import ModVariantSpec


def mod_spec(
    q: torch.Tensor, causal: bool, mods: TracedMods, block_sparse: bool, target: str, direction: str = "fwd"
) -> ModVariantSpec:  # fmt: skip
    """The ``direction`` kernel of a call on ``target``: its family's default kernel for q's dtype
    and head dim (:func:`cutefa.mods.base.mod_base`), with ``mods``."""
    dtype = {torch.float16: "fp16", torch.bfloat16: "bf16"}[q.dtype]
    base = mod_base(target, dtype, q.shape[-1], causal, direction, reads_per_score=mods.reads_per_score())
    if base is None:
        raise NotImplementedError(
            f"score_mod/mask_mod: no {mod_arch(target, direction)} {'forward' if direction == 'fwd' else 'backward'} "
            f"kernel for {dtype} head_dim {q.shape[-1]}"
        )
    return ModVariantSpec(base, mods, block_sparse)


def _check_block_mask(block_mask: BlockMask, q: torch.Tensor, k: torch.Tensor) -> None:
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must come from cutefa.create_block_mask, got {type(block_mask).__name__}"
        )
    batch, seqlen_q, heads, _ = q.shape
    if (block_mask.Q_LEN, block_mask.KV_LEN) != (seqlen_q, k.shape[1]):
        raise ValueError(
            f"block_mask was made for Q_LEN={block_mask.Q_LEN}, KV_LEN={block_mask.KV_LEN}; this call has "
            f"seqlen_q={seqlen_q}, seqlen_k={k.shape[1]}"
        )
    if block_mask.B not in (1, batch) or block_mask.H not in (1, heads):
        raise ValueError(
            f"block_mask was made for B={block_mask.B}, H={block_mask.H}; this call has batch={batch}, "
            f"heads_q={heads} (a block mask of B or H 1 serves any)"
        )
    if block_mask.kinds.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.kinds.device}, q on {q.device}")


@dataclass(frozen=True)
class _ModArgs(FeatureArgs):
    """No feature, and the mods' captured tensors as the kernel's trailing arguments (the backward's
    calling convention: :mod:`cutefa.mods.variant`)."""

    mod_tensors: tuple[torch.Tensor, ...] = ()

    def kernel_args(self, causal: bool, direction: str = "fwd") -> tuple[Any, ...]:
        return (*super().kernel_args(causal, direction), *self.mod_tensors)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, mods: TracedMods,
    tensors: list[torch.Tensor], block_mask: BlockMask | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    target, _ = dispatch.device_target(q.device)
    spec = mod_spec(q, causal, mods, block_mask is not None, target)
    out, lse, done = outputs(q, k)
    if done:
        return out, lse
    kernel = get_kernel(spec, target)
    extra: list[Any] = []
    if block_mask is not None:
        extra.append(block_mask.ranges(spec.tile_m, spec.tile_n, causal, q.shape[0], q.shape[2]))
    call_on(q.device, kernel, aligned(q), aligned(k), aligned(v), out, lse, scale, *extra, *tensors)
    return out, lse


class _ModAttention(torch.autograd.Function):
    """Autograd of attention with mods: the sm80 backward (on every target, after either family's
    forward) with the same mods and d score_mod / d score (the captured tensors get no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, deterministic, mods, tensors, block_mask):
        out, lse = _forward(q, k, v, scale, causal, mods, tensors, block_mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, deterministic, mods, tuple(tensors), block_mask)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from cutefa.api import feature_bwd

        q, k, v, out, lse = ctx.saved_tensors
        scale, causal, deterministic, mods, tensors, block_mask = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        target, _ = dispatch.device_target(q.device)
        spec = mod_spec(q, causal, mods, block_mask is not None, target, "bwd")
        if block_mask is not None:
            ranges = block_mask.query_ranges(spec.tile_m, spec.tile_n, causal, q.shape[0], q.shape[2])
            tensors = (ranges, *tensors)
        f = _ModArgs(mod_tensors=tensors)
        dq, dk, dv = feature_bwd.gradients(
            dout, q, k, v, out, lse, dlse, causal, scale, deterministic, f, spec=spec
        )
        return dq, dk, dv, None, None, None, None, None, None


def attention_with_mods(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None, causal: bool,
    score_mod: Callable[..., Any] | None, mask_mod: Callable[..., Any] | None, block_mask: BlockMask | None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out like q, lse float32 (batch, heads_q, seqlen_q)) of attention with the mods, differentiable
    in q, k and v (out and lse). A mask_mod not given is the block mask's."""
    validate_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale)
    if block_mask is not None:
        _check_block_mask(block_mask, q, k)
        if mask_mod is None:
            mask_mod = block_mask.mask_mod
    mods = trace_mods(score_mod, mask_mod)
    scale = default_scale(softmax_scale, q.shape[-1])
    tensors = [t.to(q.device) for t in mods.kernel_tensors()]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if torch.is_grad_enabled() and any(t.requires_grad for t in mods.tensors):
        raise NotImplementedError(
            "score_mod/mask_mod: a captured tensor that requires grad (its gradient is not implemented; "
            "pass it detached)"
        )
    if not grad:
        return _forward(q, k, v, scale, causal, mods, tensors, block_mask)
    return _ModAttention.apply(q, k, v, scale, causal, bool(deterministic), mods, tensors, block_mask)
