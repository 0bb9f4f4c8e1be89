"""The backward of a call with features (packed sequences, window, softcap, ALiBi; sinks need no
kernel of their own): the variant choice, the workspaces and the launch.

The backward variant is the family's tuned or default backward with the call's mask and feature
axes (a family whose backward template does not take them is passed over, so the sm80 family's
backward serves a Hopper GPU where the sm90 one lacks a feature). Packed calls index every
per-row workspace like the packed inputs: dQ accumulator (splits, total_q, heads_q, head_dim) (the
sm80 tiled layout: :func:`_varlen_dq_accum_shape`), lse_log2 and dpsum (heads_q, total_q). Grouped-query heads: the kernel writes dK and dV per query
head and the group is summed here in float32 (as the sm80 dense backward does).
"""

from __future__ import annotations

import dataclasses

import torch

from cutefa import dispatch
from cutefa.api.backward import dq_accum_workspace, dq_splits, sm80_tail_workspaces, sum_query_heads
from cutefa.api.features import FeatureArgs
from cutefa.api.launch import aligned, call_on
from cutefa.loader import get_kernel
from cutefa.model.defaults import default_spec
from cutefa.model.options import DqLayout, Mask
from cutefa.model.rules import fitting_variant, why_invalid, why_not_on
from cutefa.model.spec import TORCH_DTYPE_NAMES, Features, VariantSpec, families_for_target


def backward_features(f: FeatureArgs) -> Features:
    """The feature axes a backward kernel needs: sinks need none (module docstring)."""
    return dataclasses.replace(f.features(), sinks=False)


def choose_bwd(
    target: str, dtype: torch.dtype, head_dim: int, causal: bool, f: FeatureArgs, *, seqlen_k: int,
    gpu_name: str | None = None,
) -> VariantSpec:  # fmt: skip
    """The backward variant for a call with features on ``target`` (module docstring)."""
    token = TORCH_DTYPE_NAMES[str(dtype).removeprefix("torch.")]
    mask = f.mask(causal)
    features = backward_features(f)
    reasons = []
    for family in families_for_target(target):
        dense = []
        tuned = dispatch.tuned_backward(
            family, target=target, dtype=token, head_dim=head_dim, causal=mask is not Mask.NONE,
            seqlen_k=seqlen_k, gpu_name=gpu_name,
        )  # fmt: skip
        if tuned is not None and tuned[0] is not None:
            dense.append(tuned[0])
        default = default_spec(family, "bwd", token, head_dim, causal=mask is not Mask.NONE)
        if default is not None:
            dense.append(fitting_variant(default, target) or default)
        for spec in dense:
            spec = spec.replace(mask=mask, features=features)
            why = why_invalid(spec) or why_not_on(spec, target)
            if why is None:
                return spec
            reasons.append(f"{spec.name}: {why}")
        if not dense:
            reasons.append(f"{family}: no backward for head_dim={head_dim}")
    raise NotImplementedError(
        f"no cutefa backward kernel for {token} head_dim={head_dim} with mask {mask.name.lower()} and "
        f"features {features.tokens} on {target}: {reasons}"
    )


def _varlen_dq_accum_shape(
    spec: VariantSpec, splits: int, total_q: int, heads_q: int, n_seqs: int
) -> tuple[int, ...]:
    """The packed dQ accumulator: rows like the packed q, (splits, total_q, heads_q, head_dim); the
    sm80 fragment-order layout (DqLayout.TILE) one chunk per query block of each sequence, the
    sequences' blocks one after the other: (splits, heads_q, total_q // tile_m + sequences,
    tile_m * head_dim) (sequence b's block m is chunk cu_seqlens_q[b] // tile_m + b + m)."""
    if getattr(spec.options, "dq_layout", None) is DqLayout.TILE:
        return (splits, heads_q, total_q // spec.tile_m + n_seqs, spec.tile_m * spec.head_dim)
    return (splits, total_q, heads_q, spec.head_dim)


def _rows(q: torch.Tensor, f: FeatureArgs) -> tuple[int, int, int]:
    """(batch, seqlen_q, heads_q) of the workspaces' row index: packed, (1, total_q, heads_q)."""
    if f.varlen:
        return 1, q.shape[0], q.shape[1]
    return q.shape[0], q.shape[1], q.shape[2]


def gradients(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None, causal: bool, softmax_scale: float, deterministic: bool,
    f: FeatureArgs, spec: VariantSpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv) shaped like (q, k, v). Packed rows outside every sequence get zero gradients."""
    zeros = torch.zeros if f.varlen else torch.empty
    dq, dk, dv = (zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if dq.numel() == 0 or dk.numel() == 0 or (f.varlen and f.cu_seqlens_q.shape[0] == 1):
        return dq.zero_(), dk.zero_(), dv.zero_()
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    group = heads_q // heads_kv
    dk_heads, dv_heads = dk, dv
    if group > 1:
        shape = (*k.shape[:-2], heads_q, k.shape[-1])
        dk_heads = zeros(shape, dtype=q.dtype, device=q.device)
        dv_heads = zeros(shape, dtype=q.dtype, device=q.device)
    target, gpu_name = dispatch.device_target(q.device)
    seqlen_k = f.max_seqlen_k if f.varlen else k.shape[1]
    if spec is None:
        spec = choose_bwd(target, q.dtype, q.shape[-1], causal, f, seqlen_k=seqlen_k, gpu_name=gpu_name)
    kernel = get_kernel(spec, target)
    batch, rows, _ = _rows(q, f)
    n_seqs = f.cu_seqlens_q.shape[0] - 1 if f.varlen else batch
    props = torch.cuda.get_device_properties(q.device)
    splits = dq_splits(deterministic, n_seqs, heads_q, seqlen_k, spec.tile_n, props.multi_processor_count)
    if f.varlen:
        dq_accum = torch.empty(
            _varlen_dq_accum_shape(spec, splits, rows, heads_q, n_seqs), dtype=torch.float32, device=q.device
        )
    else:
        dq_accum = dq_accum_workspace(spec, splits, batch, rows, heads_q, q.device)
    f32 = {"dtype": torch.float32, "device": q.device}
    lse_log2 = torch.empty(lse.shape, **f32)
    dpsum = torch.empty(lse.shape, **f32)
    dlse = torch.zeros_like(lse_log2) if dlse is None else dlse.float().contiguous()
    args = (
        aligned(q), aligned(k), aligned(v), aligned(out), aligned(dout), lse.float().contiguous(), dlse,
        dq, dk_heads, dv_heads, dq_accum, lse_log2, dpsum,
    )  # fmt: skip
    if spec.arch == "sm80":  # the stream-K tail does not take features (slots 0)
        args += (*sm80_tail_workspaces(spec, 0, q.device), float(softmax_scale), int(deterministic), 0)
    else:
        args += (float(softmax_scale), int(deterministic))
    call_on(q.device, kernel, *args, *f.kernel_args(causal, "bwd"))
    dispatch.log_run(dispatch.Choice(spec, target, "backward"), q.shape, k.shape, causal)
    if group > 1:
        sum_query_heads(dk, dk_heads)
        sum_query_heads(dv, dv_heads)
    return dq, dk, dv
