"""The backward pass: the ``cutefa::flash_bwd`` custom op, its variant choice, workspaces and autograd.

``flash_bwd(dout, q, k, v, out, lse, dlse, causal, softmax_scale, deterministic) -> (dq, dk, dv)``
runs one generated backward variant (templates/bwd_sm80.py.j2: preprocess, main and postprocess
kernels in one call) on the current stream. ``dlse`` is the gradient flowing into the forward's
log-sum-exp (None when it has none): the kernel folds it into D = rowsum(dO * O) - dLSE, so
``return_lse=True`` outputs are differentiable too.

Grouped-query attention: the sm90 family's kernels sum the dK and dV of a KV head over its query
heads in float32 themselves (a float32 workspace, :func:`sm90_dkv_workspace`) and write dK and dV
once; the other families write them once per query head (in the input dtype), and the heads that
share a KV head are summed here in float32. ``deterministic=True`` gives each CTA its own float32
dQ accumulator split (summed in a fixed order) instead of sharing one through atomic adds, and the
sm90 dK/dV workspace one slot per query head of a group (summed in order):
bitwise-reproducible gradients, at the cost of fewer CTAs in flight.
"""

from __future__ import annotations

import math

import torch

from cutefa import dispatch
from cutefa.api.launch import aligned, call_on
from cutefa.api.validate import check_backward_head_dims, check_grid_limits
from cutefa.loader import get_kernel
from cutefa.model.budgets import bwd_dq_accum_shape
from cutefa.model.budgets_sm90 import sm90_bwd_dkv_accum_shape
from cutefa.model.defaults import SEPARATE_V_BWD_FAMILIES, default_spec
from cutefa.model.rules import fitting_variant, smem_bytes, tile_head_dims, why_invalid, why_not_on
from cutefa.model.spec import TORCH_DTYPE_NAMES, VariantSpec, families_for_target


def separate_v_families(target: str, head_dim: int, head_dim_v: int) -> tuple[list[str], list[str]]:
    """The families whose backward may serve q/k of ``head_dim`` and v of ``head_dim_v`` on
    ``target``, newest first, and why each other one is passed over: every family where the head
    dims are equal; for a V head dim of its own only
    :data:`~cutefa.model.defaults.SEPARATE_V_BWD_FAMILIES` (the sm80 backward, on Hopper too)."""
    families = families_for_target(target)
    if head_dim_v == head_dim:
        return list(families), []
    taken = [f for f in families if f in SEPARATE_V_BWD_FAMILIES]
    passed = [
        f"{f}: its backward takes one head dim for q, k and v (head_dim_v={head_dim_v} with "
        f"head_dim={head_dim} runs the {'/'.join(SEPARATE_V_BWD_FAMILIES)} backward)"
        for f in families if f not in SEPARATE_V_BWD_FAMILIES
    ]  # fmt: skip
    return taken, passed


def choose_bwd(
    target: str, dtype: torch.dtype, head_dim: int, causal: bool, *, seqlen_k: int | None = None,
    gpu_name: str | None = None, head_dim_v: int | None = None,
) -> VariantSpec:  # fmt: skip
    """The backward variant for a problem on compile target ``target``: per family, newest first,
    the entry of a tuned backward table measured for it (``cutefa tune --direction bwd``; needs
    ``seqlen_k``), else the family's default backward (:func:`cutefa.model.defaults.default_config`;
    where the target's GPUs do not hold its shared memory, the largest committed tile that they
    hold, :func:`cutefa.model.rules.fitting_variant`); a variant whose shared memory the target's
    GPUs do not hold is passed over. v of ``head_dim_v`` (None: ``head_dim``) apart from q's: the
    default of the families that take it (:func:`separate_v_families`; no tuned table measures
    such a pair yet)."""
    token = TORCH_DTYPE_NAMES[str(dtype).removeprefix("torch.")]
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    families, reasons = separate_v_families(target, head_dim, head_dim_v)
    for family in families:
        if seqlen_k is not None and head_dim_v == head_dim:
            tuned = dispatch.tuned_backward(
                family, target=target, dtype=token, head_dim=head_dim, causal=causal, seqlen_k=seqlen_k,
                gpu_name=gpu_name,
            )  # fmt: skip
            if tuned is not None:
                spec, how = tuned
                why = how if spec is None else why_invalid(spec) or why_not_on(spec, target)
                if why is None:
                    return spec
                reasons.append(f"{family} tuned backward entry: {why}")
        spec = default_spec(family, "bwd", token, head_dim, causal=causal, head_dim_v=head_dim_v)
        if spec is None:
            reasons.append(f"{family}: no default backward tile for head_dim={head_dim}")
            continue
        spec = fitting_variant(spec, target) or spec  # where the default needs more shared memory
        reason = why_invalid(spec) or why_not_on(spec, target)
        if reason is None:
            return spec
        reasons.append(f"{spec.name}: {reason}")
    v = f" head_dim_v={head_dim_v}" if head_dim_v != head_dim else ""
    raise NotImplementedError(
        f"no cutefa backward kernel for {token} head_dim={head_dim}{v} on {target}: {reasons}"
    )


def dq_splits(
    deterministic: bool, batch: int, heads_q: int, seqlen_k: int, tile_n: int, sm_count: int
) -> int:
    """Number of float32 dQ accumulator splits (= CTAs per (batch, head) in deterministic mode):
    enough CTAs to fill the GPU, never more than there are key blocks; 1 when not deterministic."""
    if not deterministic:
        return 1
    n_blocks = max(1, math.ceil(seqlen_k / tile_n))
    return max(1, min(n_blocks, math.ceil(sm_count / max(1, batch * heads_q))))


# The stream-K tail of the sm80 non-causal backward (cutefa/kernels/sm80/tail.py) spreads the
# grid's last wave over this many CTA slots; None: the GPU's own (SMs x CTAs per SM). Tests and
# benchmarks set a number to exercise or compare it (0: off).
TAIL_SLOTS: int | None = None

# Registers per thread the sm80 backward kernels compile to (253-255 on sm_80 and sm_90a): with
# the register file of 64K words, an SM holds one 256-thread CTA.
_SM80_BWD_REGISTERS = 255


def _sm80_ctas_per_sm(spec: VariantSpec, props) -> int:
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (spec.threads * _SM80_BWD_REGISTERS)
    smem = getattr(props, "shared_memory_per_multiprocessor", 0)
    by_smem = smem // max(1, smem_bytes(spec)) if smem else by_regs
    return max(1, min(by_regs, by_smem))


def tail_slots(
    spec: VariantSpec, deterministic: bool, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int,
    slots: int,
) -> int:  # fmt: skip
    """The stream-K tail's slot count for a launch of ``spec`` on a GPU with ``slots`` resident CTA
    slots (:data:`TAIL_SLOTS` instead where set), or 0 where the tail does not apply: other than
    an sm80 non-causal backward, deterministic mode (its CTAs own fixed key blocks), no query rows,
    a grid of whole waves (nothing to spread) or of less than one wave and a part (no full wave to
    take into the region), or a region whose step arithmetic would leave 32 bits; and a padded head
    dim or a V head dim of its own (their kernels walk their own key blocks only)."""
    if spec.arch != "sm80" or spec.direction != "bwd" or spec.causal or deterministic:
        return 0
    if tile_head_dims(spec) != (spec.head_dim, spec.head_dim):
        return 0
    slots = TAIL_SLOTS if TAIL_SLOTS is not None else slots
    if slots <= 0:
        return 0
    m_blocks = math.ceil(seqlen_q / spec.tile_m)
    units = math.ceil(seqlen_k / spec.tile_n) * heads_q * batch
    rem = units % slots
    if m_blocks == 0 or rem == 0 or units < rem + slots or (rem + slots) * m_blocks * slots >= 2**31:
        return 0
    return slots


def device_tail_slots(
    spec: VariantSpec, device: torch.device, deterministic: bool, batch: int, heads_q: int, seqlen_q: int,
    seqlen_k: int,
) -> int:  # fmt: skip
    """:func:`tail_slots` with the resident CTA slots of ``device`` (SMs x CTAs per SM)."""
    props = torch.cuda.get_device_properties(device)
    slots = props.multi_processor_count * _sm80_ctas_per_sm(spec, props)
    return tail_slots(spec, deterministic, batch, heads_q, seqlen_q, seqlen_k, slots)


def sm80_tail_workspaces(spec: VariantSpec, slots: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(dkv_part, tail_count): the sm80 backward's stream-K workspaces for ``slots`` (0: the
    smallest, unused), left uninitialized (the preprocess zeroes the counters)."""
    part = torch.empty((max(slots, 1), 2, 2, spec.tile_n * spec.head_dim), dtype=torch.float32, device=device)
    return part, torch.empty((max(2 * slots, 1),), dtype=torch.int32, device=device)


def dq_accum_workspace(
    spec: VariantSpec, splits: int, batch: int, seqlen_q: int, heads_q: int, device: torch.device
) -> torch.Tensor:
    """The float32 dQ workspace of backward variant ``spec``, left uninitialized: the variant's
    preprocess kernel zeroes it. Default layout (splits, batch, seqlen_q, heads_q, head_dim); the
    sm90 bulk dQ paths (DqPath.BULK*) and sm80 DqLayout.TILE: the tiled layout of
    :func:`cutefa.model.budgets.bwd_dq_accum_shape` (whole chunks zeroed, the padding rows of the last
    query block too)."""
    shape = bwd_dq_accum_shape(spec, splits, batch, seqlen_q, heads_q)
    return torch.empty(shape, dtype=torch.float32, device=device)


def sm90_dkv_workspace(
    spec: VariantSpec, deterministic: bool, batch: int, seqlen_k: int, heads_q: int, heads_kv: int,
    placeholder: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The float32 grouped-query dK/dV workspace of sm90 backward variant ``spec``
    (:func:`cutefa.model.budgets_sm90.sm90_bwd_dkv_accum_shape`), left uninitialized: the variant's
    own kernel zeroes it. One slot, or in deterministic mode one per query head of a group. Where
    every query head has its own KV head the kernel does not touch it: ``placeholder`` (a 16-byte
    aligned 5-D float32 tensor, the dQ workspace) goes in its place, so nothing is allocated."""
    group = heads_q // heads_kv
    if group == 1:
        return placeholder
    shape = sm90_bwd_dkv_accum_shape(spec, group if deterministic else 1, batch, seqlen_k, heads_kv)
    return torch.empty(shape, dtype=torch.float32, device=placeholder.device)


def _empty_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _flash_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, causal: bool, softmax_scale: float, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients (dq, dk, dv) of attention, shaped and typed like (q, k, v)."""
    return gradients(dout, q, k, v, out, lse, dlse, causal, softmax_scale, deterministic)


def gradients(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None, causal: bool, softmax_scale: float, deterministic: bool,
    spec: VariantSpec | None = None, dpsum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`_flash_bwd`'s work, with the backward variant ``spec`` instead of the dispatched one
    when given (tuning and benchmarks time each variant this way). ValueError, before anything is
    allocated, where q's batch or heads are over the launch grid's limits (the forward's
    validation refuses them too). ``dpsum``: a float32 tensor of lse's shape that receives the
    kernel's D = rowsum(dO * O) - dLSE per row (the sinks' gradient reads it), else a workspace."""
    check_backward_head_dims(q.shape[-1], v.shape[-1])
    check_grid_limits(q)
    dq, dk, dv = _empty_grads(q, k, v)
    if dq.numel() == 0 or dk.numel() == 0:  # nothing attends anything: every gradient is 0
        return dq.zero_(), dk.zero_(), dv.zero_()
    args = (dout, q, k, v, out, lse, dlse, dq, dk, dv, causal, softmax_scale, deterministic)
    _launch_bwd(*args, spec=spec, dpsum=dpsum)
    return dq, dk, dv


def _launch_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
    causal: bool, softmax_scale: float, deterministic: bool, spec: VariantSpec | None = None,
    dpsum: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Choose the variant (unless ``spec`` names one), allocate the workspaces and run the kernel on
    the current stream of q's device, writing dq, dk and dv (a KV head's query heads summed: by the
    sm90 family's kernels in float32, for the other families here, in float32, from per-query-head
    dK and dV)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    target, gpu_name = dispatch.device_target(q.device)
    if spec is None:
        spec = choose_bwd(
            target, q.dtype, head_dim, causal, seqlen_k=seqlen_k, gpu_name=gpu_name, head_dim_v=v.shape[-1]
        )
    kernel = get_kernel(spec, target)
    props = torch.cuda.get_device_properties(q.device)
    splits = dq_splits(deterministic, batch, heads_q, seqlen_k, spec.tile_n, props.multi_processor_count)
    f32 = {"dtype": torch.float32, "device": q.device}
    dq_accum = dq_accum_workspace(spec, splits, batch, seqlen_q, heads_q, q.device)
    lse_log2 = torch.empty((batch, heads_q, seqlen_q), **f32)
    dpsum = torch.empty((batch, heads_q, seqlen_q), **f32) if dpsum is None else dpsum
    dlse = torch.zeros_like(lse_log2) if dlse is None else dlse.float().contiguous()
    inputs = (aligned(q), aligned(k), aligned(v), aligned(out), aligned(dout), lse.float().contiguous(), dlse)
    if spec.arch == "sm90":  # a KV head's group summed in the kernel
        dkv_accum = sm90_dkv_workspace(spec, deterministic, batch, seqlen_k, heads_q, heads_kv, dq_accum)
        args = (*inputs, dq, dk, dv, dq_accum, dkv_accum, lse_log2, dpsum, float(softmax_scale), int(deterministic))
        call_on(q.device, kernel, *args)
    else:  # per query head, the group summed here
        dk_heads, dv_heads = dk, dv
        if group > 1:
            shape = (batch, seqlen_k, heads_q)
            dk_heads = torch.empty((*shape, head_dim), dtype=q.dtype, device=q.device)
            dv_heads = torch.empty((*shape, v.shape[-1]), dtype=q.dtype, device=q.device)
        args = (*inputs, dq, dk_heads, dv_heads, dq_accum, lse_log2, dpsum)
        if spec.arch == "sm80":
            slots = device_tail_slots(spec, q.device, deterministic, batch, heads_q, seqlen_q, seqlen_k)
            args += (*sm80_tail_workspaces(spec, slots, q.device), float(softmax_scale), int(deterministic), slots)
        else:
            args += (float(softmax_scale), int(deterministic))
        call_on(q.device, kernel, *args)
        if group > 1:
            sum_query_heads(dk, dk_heads)
            sum_query_heads(dv, dv_heads)
    dispatch.log_run(dispatch.Choice(spec, target, "backward"), q.shape, k.shape, causal)


def sum_query_heads(out: torch.Tensor, per_query_head: torch.Tensor) -> None:
    """``out`` (..., heads_kv, head_dim) = the sum in float32 of ``per_query_head`` (..., heads_q,
    head_dim) over each kv head's group of query heads (the per-query-head dK/dV of a family
    without grouped-query accumulation in its kernel)."""
    heads_kv, head_dim = out.shape[-2:]
    grouped = (*out.shape[:-2], heads_kv, per_query_head.shape[-2] // heads_kv, head_dim)
    out.copy_(per_query_head.view(grouped).sum(-2, dtype=torch.float32))


flash_bwd = torch.library.custom_op("cutefa::flash_bwd", _flash_bwd, mutates_args=())


@flash_bwd.register_fake
def _flash_bwd_fake(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, causal: bool, softmax_scale: float, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _empty_grads(q, k, v)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Autograd of cutefa::flash_fwd(q, k, v, causal, softmax_scale[, deterministic]) -> (out, lse)


def setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, softmax_scale, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.deterministic = bool(rest[0]) if rest else False
    ctx.extra_inputs = len(rest)


def backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = flash_bwd(
        grad_out, q, k, v, out, lse, grad_lse, ctx.causal, ctx.softmax_scale, ctx.deterministic
    )
    return (dq, dk, dv, None, None) + (None,) * ctx.extra_inputs
