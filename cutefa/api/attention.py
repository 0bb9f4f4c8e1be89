"""The user-facing functions: :func:`flash_attn_func` and :func:`explain` (packed sequences:
:func:`cutefa.api.varlen.flash_attn_varlen_func`).

Layout is (batch, seqlen, heads, head_dim) for q, k and v; k and v may have fewer heads than q
(grouped-query attention: query head ``h`` reads key/value head ``h // (heads_q // heads_kv)``).
v may have a head dim of its own, ``head_dim_v`` (a pair of :data:`cutefa.model.spec.HEAD_DIM_V_PAIRS`:
q and k of 192 against v of 128, DeepSeek's prefill); the output has v's head dim. The forward
only: its gradient raises ``NotImplementedError``.
Causal masking is aligned bottom-right: query ``i`` attends key ``j`` iff
``j <= i + seqlen_k - seqlen_q``.

Edge cases: an empty problem (batch, seqlen_q or heads_q of 0) returns empty results without a
launch. With ``seqlen_k == 0`` and ``seqlen_q > 0`` every query row attends no key: the output is
0 and the log-sum-exp is ``-inf``, again without a launch. Inputs whose strides (other than the
last) are not multiples of 16 bytes, or whose data pointer is not 16-byte aligned, are copied to a
contiguous tensor first; a last dim that is not contiguous (``stride(-1) != 1``) is an error.

``torch.compile``, autograd and dispatch modes go through the custom ops (``cutefa::flash_fwd``,
``cutefa::flash_fwd_fp8``). A plain eager call with nothing to differentiate skips the op
dispatcher (tens of microseconds) and, from its second call on, takes the *call plan* memoized for
its signature (:mod:`cutefa.api.plans`: shapes of q and k, dtype, device, causal, softmax_scale;
for fp8 also the kind of each descale). Kernels run on the current torch stream of the tensors'
device, and nothing on the call path synchronizes with the GPU, so calls can be captured in a
CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cutefa import dispatch
from cutefa.api import dense
from cutefa.api import plans as _plans
from cutefa.api.launch import shapes
from cutefa.api.plans import plain_eager
from cutefa.api.validate import (
    FP8_DTYPES,
    check_deterministic,
    check_options,
    check_tensors,
    default_scale,
    validate_fp8_inputs,
    validate_inputs,
)
from cutefa.model.spec import Features

# A dense call loads none of the feature, fp8 or mods modules: each is imported where its branch
# begins (its custom ops register then), so ``import cutefa.api`` stays short.

# window_size values that ask for no window (score_mod/mask_mod take no window)
WINDOWLESS = ((-1, -1), (None, None))


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    v_mean: torch.Tensor | None = None,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    block_mask: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on CUDA tensors of shape (batch, seqlen, heads, head_dim) (v of head dim
    ``head_dim_v``: q's, or its own in a pair of :data:`cutefa.model.spec.HEAD_DIM_V_PAIRS` for a
    16-bit call without user mods; the output then has v's head dim and no gradient yet: asking for
    one raises ``NotImplementedError``).

    The positional arguments are flash-attn's (``flash_attn_func(q, k, v, dropout_p,
    softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)``),
    so code written for it runs unchanged; cutefa's own options are keyword-only. ``dropout_p``
    other than 0 is a NotImplementedError.

    Masks and score modifiers (16-bit inputs), aligned bottom-right like the causal mask:
    ``window_size=(left, right)``: query ``i`` attends key ``j`` when ``i + sk - sq - left <= j <= i +
    sk - sq + right`` (-1 or None: unbounded; with ``causal`` right is 0; ``(-1, 0)`` is the causal
    mask); key blocks outside the band are skipped. ``softcap=c > 0``: scores become ``c *
    tanh(score / c)``. ``alibi_slopes`` float32 (heads_q,) or (batch, heads_q): ``- slope * |i + sk
    - sq - j|`` is added to each score. ``sinks`` (keyword) float (heads_q,): one extra logit per
    head in each row's softmax denominator that takes no value (gpt-oss's learned sinks), with its
    gradient. A row that attends no key has output 0 and lse ``-inf`` (with sinks: the sink).

    ``softmax_scale`` defaults to ``1/sqrt(head_dim)``. Returns ``out`` (like q), or ``(out, lse)``
    with ``return_lse``, or flash-attn's ``(out, lse, None)`` with ``return_attn_probs`` (no
    dropout, so no probabilities are returned): lse is float32 (batch, heads_q, seqlen_q), the
    natural-log sum of exp(scaled scores) per query row. See the module docstring for masking and
    edge cases. Differentiable (out and lse); ``deterministic=True`` makes the backward bitwise
    reproducible.

    fp8: q, k and v of dtype torch.float8_e4m3fn (see :func:`cutefa.quantize_fp8`) with float32
    ``q_descale``, ``k_descale``, ``v_descale`` of shape () or (batch, heads_kv) (None: 1) attend
    the dequantized inputs ``x * descale``; the output is ``out_dtype`` (None or torch.bfloat16)
    and the lse that of the dequantized scores. Forward only: its backward raises
    NotImplementedError. Runs on the sm90 (Hopper) family, and on the sm100 (Blackwell) family
    (compiled, not hardware-tested). Block quantization (sm90 family only): any descale may be
    (batch, heads_kv, blocks), one per block of rows along seqlen (``quantize_fp8(x, "block",
    block=...)``); q's blocks are the dispatched kernel's tile_m rows and k's and v's its tile_n
    rows, which :func:`cutefa.fp8_block_sizes` returns (another block count is a ValueError);
    every descale must be finite and positive (checked on the device without a host sync). ``v_mean`` (fp8 only): float32 (batch, heads_kv, head_dim),
    the mean over seqlen that v had taken out before quantization (:func:`cutefa.center_v`), added
    back to the output of every row that attends a key: on long rows this keeps the e4m3 tensor
    cores' accumulation from losing the part of the output that V's column means carry. Such calls
    dispatch among the variants tuned for centered v (a tuned table's ``v_centered`` entries: no
    two-level accumulation, which centered v does not need; the ``_vmean`` kernels take the mean and
    add it in their epilogue, after any other kernel it is added in one pass over the output).

    User mods (keywords, 16-bit inputs; the sm90 forward on sm_90a, the sm80 family otherwise and
    for every backward: :mod:`cutefa.mods`):
    ``score_mod(score, b, h, q_idx, kv_idx) -> score`` changes each scaled score, ``mask_mod(b, h,
    q_idx, kv_idx) -> bool`` keeps the pairs where it is true; both are traced into the kernel
    (arithmetic, comparisons, ``torch.where``/``exp``/``tanh``/``abs``/``minimum``/``maximum``, reads of
    captured tensors indexed by the indices). ``block_mask`` (:func:`cutefa.create_block_mask`) lets
    the kernel skip the key blocks the mask_mod empties and drop the mask on full ones; its
    mask_mod applies when none is given. Not combined with window_size, softcap, alibi_slopes,
    sinks or fp8 (a score_mod can write them). Differentiable in q, k and v (a captured tensor gets
    no gradient).
    """
    if score_mod is not None or mask_mod is not None or block_mask is not None:
        from cutefa.api.validate_features import check_dropout
        from cutefa.api.varlen import has_features

        if has_features(window_size, softcap, alibi_slopes, sinks) or window_size not in WINDOWLESS:
            raise NotImplementedError(
                "score_mod/mask_mod/block_mask with window_size, softcap, alibi_slopes or sinks is not "
                "implemented (write them into the score_mod/mask_mod)"
            )
        if q_descale is not None or k_descale is not None or v_descale is not None or v_mean is not None:
            raise NotImplementedError("score_mod/mask_mod/block_mask are not implemented for fp8 inputs")
        check_dropout(dropout_p)
        from cutefa.mods.api import attention_with_mods

        out, lse = attention_with_mods(
            q, k, v, softmax_scale, causal, score_mod, mask_mod, block_mask, deterministic
        )
        if return_attn_probs:
            return out, lse, None
        return (out, lse) if return_lse else out
    if window_size != (-1, -1) or softcap != 0.0 or alibi_slopes is not None or sinks is not None:
        from cutefa.api.varlen import has_features

        if has_features(window_size, softcap, alibi_slopes, sinks):
            from cutefa.api.validate_features import check_dropout
            from cutefa.api.varlen import dense_with_features

            check_dropout(dropout_p)
            if q_descale is not None or k_descale is not None or v_descale is not None or v_mean is not None:
                raise NotImplementedError(
                    "window_size, softcap, alibi_slopes and sinks are not implemented for fp8 inputs yet"
                )
            out, lse = dense_with_features(
                q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, sinks, deterministic
            )
            if return_attn_probs:
                return out, lse, None
            return (out, lse) if return_lse else out
        causal = flash_attn_options(dropout_p, causal, window_size)
    elif dropout_p != 0.0:
        from cutefa.api.validate_features import check_dropout

        check_dropout(dropout_p)
    if return_attn_probs:
        out, lse = flash_attn_func(
            q, k, v, softmax_scale=softmax_scale, causal=causal, deterministic=deterministic, return_lse=True,
            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype, v_mean=v_mean,
        )  # fmt: skip
        return out, lse, None
    if plain_eager(q, k, v):
        key = (q.shape, k.shape, q.dtype, q.is_cuda, q.get_device(), causal, softmax_scale)
        try:
            plan = _plans._PLANS.get(key)
        except TypeError:  # an unhashable softmax_scale: validation names it
            plan = key = None
        # fp8 inputs never have a plan here (the dtype is in the key): theirs are in _FP8_PLANS.
        if (
            plan is not None
            and _plan_options(causal, softmax_scale, deterministic)
            and q_descale is None
            and k_descale is None
            and v_descale is None
            and out_dtype is None
            and v_mean is None
        ):
            return plan(q, k, v, return_lse)
        if key is not None and q.dtype in FP8_DTYPES:
            kind = _plans.descale_kind
            kinds = (kind(q_descale), kind(k_descale), kind(v_descale), kind(v_mean))
            key = None if _plans.NO_PLAN in kinds else (key, *kinds[:3], out_dtype, kinds[3])
            try:
                plan = _plans._FP8_PLANS.get(key)
            except TypeError:  # an unhashable out_dtype: validation names it
                plan = key = None
            if plan is not None and _plan_options(causal, softmax_scale, deterministic):
                return plan(q, k, v, q_descale, k_descale, v_descale, v_mean, return_lse)
        return _eager(
            q, k, v, causal, softmax_scale, return_lse, deterministic, key, q_descale, k_descale, v_descale, out_dtype,
            v_mean,
        )  # fmt: skip
    check_tensors((q, k, v))  # the op validates the rest; these are needed to call it at all
    fp8_options = (q_descale, k_descale, v_descale, out_dtype, v_mean)
    if q.dtype in FP8_DTYPES or any(o is not None for o in fp8_options):
        from cutefa.api import fp8

        return fp8.call(q, k, v, causal, softmax_scale, return_lse, deterministic, *fp8_options)
    check_options(causal, softmax_scale)
    check_deterministic(deterministic)
    out, lse = dense.attention(q, k, v, causal, default_scale(softmax_scale, q.shape[-1]), deterministic)
    return (out, lse) if return_lse else out


def _eager(
    q: object, k: object, v: object, causal: object, softmax_scale: object, return_lse: bool,
    deterministic: object, key: tuple[object, ...] | None, *fp8_options: object,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A plain eager call without a plan yet: validate, run, and memoize the plan under ``key``.
    fp8 inputs or options (q_descale, k_descale, v_descale, out_dtype, v_mean) go to
    :func:`cutefa.api.fp8.call`."""
    q, k, v = check_tensors((q, k, v))
    if q.dtype in FP8_DTYPES or any(o is not None for o in fp8_options):
        from cutefa.api import fp8

        fp8_key = key if q.dtype in FP8_DTYPES else None  # (flash_attn_func made it the fp8 plan key)
        return fp8.call(q, k, v, causal, softmax_scale, return_lse, deterministic, *fp8_options, fp8_key)
    check_options(causal, softmax_scale)
    check_deterministic(deterministic)
    scale = default_scale(softmax_scale, q.shape[-1])  # type: ignore[arg-type]
    since = _plans.clears()
    out, lse, launched = dense.forward(q, k, v, causal, scale)  # type: ignore[arg-type]
    # No plan is made while a CUDA graph is being captured: its allocations would come from the
    # graph's private pool (warm up before capturing; then the plan exists already).
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if launched is not None and key is not None and not capturing:
        plan = dense.make_plan(*launched, q, k, causal, scale)  # type: ignore[arg-type]
        _plans.remember(_plans._PLANS, key, plan, since)
    return (out, lse) if return_lse else out


def flash_attn_options(dropout_p: object, causal: object, window_size: object) -> object:
    """flash-attn's options of a call without features (:func:`cutefa.api.varlen.has_features`):
    dropout refused by name; returns the mask's ``causal`` (``window_size=(-1, 0)`` is the causal
    mask, as in flash-attn)."""
    from cutefa.api.validate_features import check_dropout

    check_dropout(dropout_p)
    _, right = window_size  # type: ignore[misc]  # has_features let only (-1|None, -1|None|0) through
    return True if right == 0 and isinstance(causal, bool) else causal


def _plan_options(causal: object, softmax_scale: object, deterministic: object) -> bool:
    """Whether options that equal a plan key's are also of the types validation accepts (a key
    equal to a validated one can still hold causal=1 or softmax_scale=True, which no plan takes)."""
    return causal.__class__ is bool and softmax_scale.__class__ is not bool and deterministic.__class__ is bool


def explain(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, target: str | None = None,
    v_centered: bool = False, window_size: tuple[int | None, int | None] = (-1, -1), softcap: float = 0.0,
    alibi: bool = False, sinks: bool = False, varlen: bool = False, score_mod: Any = None, mask_mod: Any = None,
    block_mask: Any = None, total_q: int | None = None,
) -> str:  # fmt: skip
    """Which variant :func:`flash_attn_func` would run for these inputs, why, and what was rejected.

    ``target`` (e.g. 'sm_90a') explains for that compile target instead of the tensors' GPU, so
    the inputs may then be CPU or meta tensors. ``v_centered`` (fp8): for a call with ``v_mean=``,
    which dispatches among the variants tuned for centered v. ``window_size``, ``softcap``,
    ``alibi`` and ``sinks``: a call with those options (any slopes or sinks); ``varlen``: a
    :func:`cutefa.flash_attn_varlen_func` call whose sequences are q's batch (every one of q's and
    k's lengths at most, max_seqlen_q/k being q's and k's seqlen; ``total_q`` the packed query rows
    of all of them, None: every sequence full). v of a head dim of its own:
    the choice for it (the families' default variants with that ``head_dim_v``). ``score_mod``,
    ``mask_mod``, ``block_mask``: a call with user mods: the traced mods and the kernels they are
    fused into.
    """
    from cutefa.api.validate_features import check_softcap, mask_options

    q, k, v = check_tensors((q, k, v))
    device_types = None if target is None else (q.device.type,)
    if q.dtype in FP8_DTYPES:
        validate_fp8_inputs(q, k, v, causal=causal, device_types=device_types)
    else:
        validate_inputs(q, k, v, causal=causal, device_types=device_types, separate_v=True)
    causal, left, right = mask_options(causal, window_size)
    features = Features(varlen=varlen, softcap=check_softcap(softcap) != 0.0, alibi=alibi, sinks=sinks)
    gpu_name = None
    if target is None:
        target, gpu_name = dispatch.device_target(q.device)
    given = {"score_mod": score_mod, "mask_mod": mask_mod, "block_mask": block_mask}
    mods = {name: value for name, value in given.items() if value is not None}
    return dispatch.explain_problem(
        target=target, dtype=q.dtype, causal=causal, gpu_name=gpu_name, v_centered=v_centered,
        local=(left, right) != (-1, -1), features=features, **mods, **shapes(q, k, v),
        total_q=total_q if varlen else None,
    )  # fmt: skip
