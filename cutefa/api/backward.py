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
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from cutefa import dispatch
from cutefa.api import backward_plan as _backward_plan
from cutefa.api import plans as _plans
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
    :data:`~cutefa.model.defaults.SEPARATE_V_BWD_FAMILIES` (the sm90 backward on Hopper, the sm80
    one elsewhere and where the sm90 template lacks a feature the call needs)."""
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
    """Gradients (dq, dk, dv) of attention, shaped and typed like (q, k, v): :func:`gradients`
    through the backward plan of the call's signature (:func:`planned_gradients`; the op
    runs on real tensors only, its fake implementation under tracing)."""
    return planned_gradients(dout, q, k, v, out, lse, dlse, causal, softmax_scale, deterministic)


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
) -> BwdSetup:  # fmt: skip
    """Choose the variant (unless ``spec`` names one), allocate the workspaces and run the kernel on
    the current stream of q's device, writing dq, dk and dv (a KV head's query heads summed: by the
    sm90 family's kernels in float32, for the other families here, in float32, from per-query-head
    dK and dV), and ``dpsum`` where given. Returns what it decided (:func:`bwd_setup`)."""
    setup = bwd_setup(q, k, v, causal, deterministic, spec)
    run_bwd(setup, dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, deterministic, dpsum=dpsum)
    return setup


class BwdSetup(NamedTuple):
    """What a backward launch decides from the shapes, dtype, device, mask and mode alone (the
    variant, its kernel and the workspaces' shapes): :func:`bwd_setup` makes it and a backward
    plan (:func:`cutefa.api.backward_plan.make_bwd_plan`) keeps it, so repeated calls decide nothing
    again."""

    spec: VariantSpec
    target: str
    kernel: Any
    splits: int  # dQ accumulator splits (deterministic mode)
    slots: int  # the sm80 stream-K tail's slots (0: none)
    group: int  # query heads per KV head
    dq_accum_shape: tuple[int, ...]
    dkv_accum_shape: tuple[int, ...] | None  # sm90 with group > 1; None: the dQ workspace stands in
    lse_shape: tuple[int, int, int]  # (batch, heads_q, seqlen_q)


def bwd_setup(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, deterministic: bool,
    spec: VariantSpec | None = None,
) -> BwdSetup:  # fmt: skip
    """The variant (``spec``, else dispatch's choice for q's device), its kernel and the workspace
    shapes of a backward of q, k, v."""
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
    slots = 0
    if spec.arch == "sm80":
        slots = device_tail_slots(spec, q.device, deterministic, batch, heads_q, seqlen_q, seqlen_k)
    dkv_shape = None
    if spec.arch == "sm90" and group > 1:
        slots_dkv = group if deterministic else 1
        dkv_shape = tuple(sm90_bwd_dkv_accum_shape(spec, slots_dkv, batch, seqlen_k, heads_kv))
    dq_shape = tuple(bwd_dq_accum_shape(spec, splits, batch, seqlen_q, heads_q))
    lse_shape = (batch, heads_q, seqlen_q)
    return BwdSetup(spec, target, kernel, splits, slots, group, dq_shape, dkv_shape, lse_shape)


def run_bwd(
    setup: BwdSetup, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
    softmax_scale: float, deterministic: bool, empty: Callable[..., torch.Tensor] | None = None,
    dpsum: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Allocate the workspaces of ``setup`` and run its kernel on the current stream of q's device,
    writing dq, dk and dv. ``empty(name, shape, dtype)``: how a workspace is allocated (a plan's
    prototypes; default ``torch.empty``); ``dlse`` None: zeros (a plan's shared zero buffer where
    it has one, :func:`cutefa.api.plans.zero_lse`); ``dpsum`` None: a workspace, else it receives D
    (:func:`gradients`)."""
    if empty is None:
        device = q.device

        def empty(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

    spec, kernel = setup.spec, setup.kernel
    f32 = torch.float32
    dq_accum = empty("dq_accum", setup.dq_accum_shape, f32)
    lse_log2 = empty("lse_log2", setup.lse_shape, f32)
    if dpsum is None:
        dpsum = empty("dpsum", setup.lse_shape, f32)
    if dlse is None:
        dlse = _plans.zero_lse(q.device, setup.lse_shape)
        if dlse is None:
            dlse = torch.zeros_like(lse_log2)
    elif dlse.dtype is not f32 or not dlse.is_contiguous():
        dlse = dlse.float().contiguous()
    if lse.dtype is not f32 or not lse.is_contiguous():
        lse = lse.float().contiguous()
    inputs = (aligned(q), aligned(k), aligned(v), aligned(out), aligned(dout), lse, dlse)
    scale = float(softmax_scale)
    if spec.arch == "sm90":  # a KV head's group summed in the kernel
        dkv_accum = dq_accum
        if setup.dkv_accum_shape is not None:
            dkv_accum = empty("dkv_accum", setup.dkv_accum_shape, f32)
        args = (*inputs, dq, dk, dv, dq_accum, dkv_accum, lse_log2, dpsum, scale, int(deterministic))
        call_on(q.device, kernel, *args)
    else:  # per query head, the group summed here
        dk_heads, dv_heads = dk, dv
        if setup.group > 1:
            shape = (*dk.shape[:2], q.shape[2])
            dk_heads = empty("dk_heads", (*shape, dk.shape[-1]), q.dtype)
            dv_heads = empty("dv_heads", (*shape, dv.shape[-1]), q.dtype)
        args = (*inputs, dq, dk_heads, dv_heads, dq_accum, lse_log2, dpsum)
        if spec.arch == "sm80":
            tail = sm80_tail_workspaces(spec, setup.slots, q.device)
            args += (*tail, scale, int(deterministic), setup.slots)
        else:
            args += (scale, int(deterministic))
        call_on(q.device, kernel, *args)
        if setup.group > 1:
            sum_query_heads(dk, dk_heads)
            sum_query_heads(dv, dv_heads)
    if dispatch._LOG_RUNS:
        dispatch.log_run(dispatch.Choice(spec, setup.target, "backward"), q.shape, k.shape, spec.causal)


def planned_gradients(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None, causal: bool, softmax_scale: float, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`gradients` of real tensors (the op's implementation, or an eager training call:
    :func:`cutefa.api.dense.attention`), through the backward plan memoized for its signature
    (:func:`cutefa.api.backward_plan.make_bwd_plan`; made by the first call that launched, unless a
    CUDA graph was being captured). ``dlse`` None: no gradient flows into the lse (zeros stand for
    it). The key also holds :func:`choose_bwd` and :data:`TAIL_SLOTS` as they are at the call:
    benchmarks and tests that replace the choice (tools' forced backward variants) or set the tail
    get plans of their own and leave the others alone."""
    key = (
        q.shape, k.shape, v.shape, q.dtype, q.is_cuda, q.get_device(), causal, softmax_scale, deterministic,
        choose_bwd, TAIL_SLOTS,
    )  # fmt: skip
    plan = _plans._BWD_PLANS.get(key)
    if plan is not None:
        return plan(dout, q, k, v, out, lse, dlse)
    check_backward_head_dims(q.shape[-1], v.shape[-1])
    check_grid_limits(q)
    dq, dk, dv = _empty_grads(q, k, v)
    if dq.numel() == 0 or dk.numel() == 0:  # nothing attends anything: every gradient is 0
        return dq.zero_(), dk.zero_(), dv.zero_()
    since = _plans.clears()
    setup = _launch_bwd(
        dout, q, k, v, out, lse, dlse, dq, dk, dv, causal, softmax_scale, deterministic
    )
    if isinstance(setup, BwdSetup) and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        plan = _backward_plan.make_bwd_plan(setup, q, k, v, softmax_scale, deterministic, run_bwd)
        _plans.remember(_plans._BWD_PLANS, key, plan, since)
    return dq, dk, dv


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
