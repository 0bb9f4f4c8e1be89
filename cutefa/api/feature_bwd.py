"""The backward of a call with features (packed sequences, window, softcap, ALiBi; sinks need no
kernel of their own): the variant choice, the workspaces and the launch.

The backward variant is the family's tuned or default backward with the call's mask and feature
axes (a family whose backward template does not take them is passed over, so the sm80 family's
backward serves a Hopper GPU where the sm90 one lacks a feature). Packed calls index every
per-row workspace like the packed inputs: dQ accumulator (splits, total_q, heads_q, head_dim) (the
sm80 tiled layout and the sm90 bulk dQ paths: :func:`_varlen_dq_accum_shape`), lse_log2 and dpsum
(heads_q, total_q). Grouped-query heads: the sm80 kernel writes dK and dV per query head and the
group is summed here in float32 (as the sm80 dense backward does); the sm90 kernel sums a kv head's
group in float32 itself (its dK/dV workspace: :func:`_dkv_accum`, packed by key-block chunks like
its dQ accumulator) and writes dK and dV once.

On a Hopper GPU the sm90 family's default backward (templates/bwd_sm90.py.j2) serves every feature
it takes; its head-dim split and swapped-partition templates (head dims 192 and 256) take none, so
the sm80 family's backward serves those.
"""

from __future__ import annotations

import dataclasses

import torch

from cutefa import dispatch
from cutefa.api.backward import (
    dq_accum_workspace,
    dq_splits,
    separate_v_families,
    sm80_tail_workspaces,
    sm90_dkv_workspace,
    sum_query_heads,
)
from cutefa.api.features import FeatureArgs
from cutefa.api.launch import aligned, call_on
from cutefa.api.validate import check_backward_head_dims
from cutefa.codegen import template_name
from cutefa.loader import get_kernel
from cutefa.model.budgets import bwd_dq_chunk_words
from cutefa.model.defaults import default_spec
from cutefa.model.options import DqLayout, DqPath, Mask
from cutefa.model.rules import fitting_variant, why_invalid, why_not_on
from cutefa.model.spec import TORCH_DTYPE_NAMES, Features, VariantSpec

# The sm90 backward template that takes the feature axes (the head-dim split and swapped-partition
# templates take none).
SM90_FEATURE_TEMPLATE = "bwd_sm90.py.j2"


def backward_features(f: FeatureArgs) -> Features:
    """The feature axes a backward kernel needs: sinks need none (module docstring)."""
    return dataclasses.replace(f.features(), sinks=False)


def choose_bwd(
    target: str, dtype: torch.dtype, head_dim: int, causal: bool, f: FeatureArgs, *, seqlen_k: int,
    gpu_name: str | None = None, head_dim_v: int | None = None,
) -> VariantSpec:  # fmt: skip
    """The backward variant for a call with features on ``target`` (module docstring); v of
    ``head_dim_v`` apart from q's: the default of the families that take it
    (:func:`cutefa.api.backward.separate_v_families`)."""
    token = TORCH_DTYPE_NAMES[str(dtype).removeprefix("torch.")]
    mask = f.mask(causal)
    features = backward_features(f)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    families, reasons = separate_v_families(target, head_dim, head_dim_v)
    for family in families:
        dense = []
        tuned = None
        if head_dim_v == head_dim:  # (no tuned table measures a V head dim of its own)
            tuned = dispatch.tuned_backward(
                family, target=target, dtype=token, head_dim=head_dim, causal=mask is not Mask.NONE,
                seqlen_k=seqlen_k, gpu_name=gpu_name,
            )  # fmt: skip
        if tuned is not None and tuned[0] is not None:
            dense.append(tuned[0])
        causal_mask = mask is not Mask.NONE
        default = default_spec(family, "bwd", token, head_dim, causal=causal_mask, head_dim_v=head_dim_v)
        if default is not None:
            dense.append(fitting_variant(default, target) or default)
        for spec in dense:
            spec = spec.replace(mask=mask, features=features)
            why = why_invalid(spec) or why_not_on(spec, target) or _why_no_features(spec)
            if why is None:
                return spec
            reasons.append(f"{spec.name}: {why}")
        if not dense:
            reasons.append(f"{family}: no backward for head_dim={head_dim}")
    v = f" head_dim_v={head_dim_v}" if head_dim_v != head_dim else ""
    raise NotImplementedError(
        f"no cutefa backward kernel for {token} head_dim={head_dim}{v} with mask {mask.name.lower()} and "
        f"features {features.tokens} on {target}: {reasons}"
    )


def _why_no_features(spec: VariantSpec) -> str | None:
    """Why ``spec``'s template cannot take its mask and feature axes (module docstring), or None."""
    if spec.arch == "sm90" and (spec.features.any or spec.mask is Mask.LOCAL):
        name = template_name(spec)
        if name != SM90_FEATURE_TEMPLATE:
            return f"templates/{name} takes no feature axes or local mask (only templates/{SM90_FEATURE_TEMPLATE})"
    return None


def _chunked_dq(spec: VariantSpec) -> bool:
    """Whether ``spec``'s dQ accumulator is tiled by query-block chunks (sm80 DqLayout.TILE, the sm90
    bulk dQ paths)."""
    if spec.arch == "sm90":
        return spec.options.dq_path is not DqPath.RED
    return getattr(spec.options, "dq_layout", None) is DqLayout.TILE


def _varlen_dq_accum_shape(
    spec: VariantSpec, splits: int, total_q: int, heads_q: int, n_seqs: int
) -> tuple[int, ...]:
    """The packed dQ accumulator: rows like the packed q, (splits, total_q, heads_q, head_dim); the
    sm80 fragment-order layout (DqLayout.TILE) one chunk per query block of each sequence, the
    sequences' blocks one after the other: (splits, heads_q, total_q // tile_m + sequences,
    tile_m * head_dim) (sequence b's block m is chunk cu_seqlens_q[b] // tile_m + b + m); the sm90
    bulk dQ paths the same chunks."""
    if _chunked_dq(spec):
        return (splits, heads_q, total_q // spec.tile_m + n_seqs, bwd_dq_chunk_words(spec))
    return (splits, total_q, heads_q, spec.head_dim)


def _dkv_accum(
    spec: VariantSpec, deterministic: bool, q: torch.Tensor, k: torch.Tensor, f: FeatureArgs, n_seqs: int,
    placeholder: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The sm90 backward's float32 grouped-query dK/dV workspace (left uninitialized: the kernel
    zeroes it), ``placeholder`` where every query head has its own kv head. Packed:
    (slots, heads_kv, total_k // tile_n + sequences, 2 * tile_n * head_dim), sequence b's key block
    n at chunk cu_seqlens_k[b] // tile_n + b + n (cutefa/kernels/sm90/bwd_features.py)."""
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    group = heads_q // heads_kv
    if not f.varlen:
        return sm90_dkv_workspace(spec, deterministic, k.shape[0], k.shape[1], heads_q, heads_kv, placeholder)
    if group == 1:
        return placeholder
    shape = (
        group if deterministic else 1,
        heads_kv,
        k.shape[0] // spec.tile_n + n_seqs,
        2 * spec.tile_n * spec.head_dim,
    )
    return torch.empty(shape, dtype=torch.float32, device=q.device)


def _rows(q: torch.Tensor, f: FeatureArgs) -> tuple[int, int, int]:
    """(batch, seqlen_q, heads_q) of the workspaces' row index: packed, (1, total_q, heads_q)."""
    if f.varlen:
        return 1, q.shape[0], q.shape[1]
    return q.shape[0], q.shape[1], q.shape[2]


def gradients(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None, causal: bool, softmax_scale: float, deterministic: bool,
    f: FeatureArgs, spec: VariantSpec | None = None, dpsum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv) shaped like (q, k, v). Packed rows outside every sequence get zero gradients.
    ``dpsum``: as :func:`cutefa.api.backward.gradients`'s (rows outside every sequence untouched)."""
    check_backward_head_dims(q.shape[-1], v.shape[-1])
    # no memset: a packed batch's rows of no sequence are zeroed by the kernel's module (its fill)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if dq.numel() == 0 or dk.numel() == 0 or (f.varlen and f.cu_seqlens_q.shape[0] == 1):
        return dq.zero_(), dk.zero_(), dv.zero_()
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    group = heads_q // heads_kv
    target, gpu_name = dispatch.device_target(q.device)
    seqlen_k = f.max_seqlen_k if f.varlen else k.shape[1]
    if spec is None:
        spec = choose_bwd(
            target, q.dtype, q.shape[-1], causal, f, seqlen_k=seqlen_k, gpu_name=gpu_name,
            head_dim_v=v.shape[-1],
        )  # fmt: skip
    kernel = get_kernel(spec, target)
    per_query_head = group > 1 and spec.arch != "sm90"  # sm90: the group summed in the kernel
    dk_heads, dv_heads = dk, dv
    if per_query_head:
        shape = (*k.shape[:-2], heads_q)
        dk_heads = torch.empty((*shape, k.shape[-1]), dtype=q.dtype, device=q.device)
        dv_heads = torch.empty((*shape, v.shape[-1]), dtype=q.dtype, device=q.device)
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
    dpsum = torch.empty(lse.shape, **f32) if dpsum is None else dpsum
    dlse = torch.zeros_like(lse_log2) if dlse is None else dlse.float().contiguous()
    args = (
        aligned(q), aligned(k), aligned(v), aligned(out), aligned(dout), lse.float().contiguous(), dlse,
        dq, dk_heads, dv_heads, dq_accum,
    )  # fmt: skip
    if spec.arch == "sm90":
        args += (_dkv_accum(spec, deterministic, q, k, f, n_seqs, dq_accum), lse_log2, dpsum)
        args += (float(softmax_scale), int(deterministic))
    elif spec.arch == "sm80":  # the stream-K tail does not take features (slots 0)
        args += (
            lse_log2,
            dpsum,
            *sm80_tail_workspaces(spec, 0, q.device),
            float(softmax_scale),
            int(deterministic),
            0,
        )
    else:
        args += (lse_log2, dpsum, float(softmax_scale), int(deterministic))
    call_on(q.device, kernel, *args, *f.kernel_args(causal, "bwd"))
    dispatch.log_run(dispatch.Choice(spec, target, "backward"), q.shape, k.shape, causal)
    if per_query_head:
        sum_query_heads(dk, dk_heads)
        sum_query_heads(dv, dv_heads)
    return dq, dk, dv
