"""The kernels behind cutefa's SDPA provider: what :func:`cutefa.torch_sdpa.activate` installs
over the aten ops of SDPA's flash backend and ``varlen_attn``, and how each call is routed.

Loaded when the provider is installed (``cutefa.torch_sdpa._install`` takes :func:`overrides`) or
``cutefa.torch_sdpa.why_not`` is first read, never by ``import cutefa``. :mod:`cutefa.torch_sdpa`
holds the registration and activation; this module imports nothing of it.

Routing: :func:`why_not` decides from the tensors' metadata (cached per shapes, dtypes, devices and
layout) whether cutefa serves a call; a served call that cutefa's API still refuses (no kernel for
the shape, inputs its checks do not accept: a NotImplementedError, ValueError or TypeError raised
before any launch) goes the same way as one it does not serve, to PyTorch's own kernel, which was
looked up before the override (``torch.library.get_kernel``). With ``CUTEFA_LOG=1`` every call logs
a line saying which way it went: served (and cutefa's own line names the kernel that ran), or
PyTorch's kernel and why.

Layouts: SDPA hands (batch, heads, seqlen, head_dim) tensors; cutefa takes (batch, seqlen,
heads, head_dim) views of them (``transpose(1, 2)``, no copy), and its outputs are returned as
the transposed views. The outputs have the layout PyTorch's own kernel gives them (that of the
query, key and value: what ``torch.compile``'s graphs assume): the usual inputs, projections
viewed as heads, already have it; only for other input layouts is an output copied into it.
``_flash_attention_forward/_backward`` take (batch, seqlen, heads, head_dim) or packed (total,
heads, head_dim) tensors as they are.

The outputs cutefa does not compute (rng state, debug mask) are left unset: they are never read
without dropout, which cutefa does not serve.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

_SDPA_FWD = "_scaled_dot_product_flash_attention"
_SDPA_BWD = "_scaled_dot_product_flash_attention_backward"
_FLASH_FWD = "_flash_attention_forward"
_FLASH_BWD = "_flash_attention_backward"
OPS = (_SDPA_FWD, _SDPA_BWD, _FLASH_FWD, _FLASH_BWD)  # the aten ops the provider overrides
_HALF = ("float16", "bfloat16")  # torch dtype names cutefa's 16-bit kernels take

log = logging.getLogger("cutefa")


# ---------------------------------------------------------------------------------------------
# The routing decision


_REASONS: dict[tuple[Any, ...], str | None] = {}
_MAX_REASONS = 4096


def _device_target(device: Any) -> tuple[str, str]:
    from cutefa import dispatch

    return dispatch.device_target(device)


def why_not(
    query: Any,
    key: Any,
    value: Any,
    *,
    dropout_p: float = 0.0,
    debug_mask: bool = False,
    layout: str = "bshd",
) -> str | None:
    """Why cutefa does not serve this call (None: it does), from the tensors' metadata only.

    ``layout`` is ``"bhsd"`` (SDPA's ops), ``"bshd"`` or ``"thd"`` (packed). Cheap checks here;
    what only a kernel choice can say (no variant for a shape or a feature) comes as the
    NotImplementedError of the call, which then also goes to PyTorch's kernel."""
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p}: cutefa has no attention dropout"
    if debug_mask:
        return "return_debug_mask=True: cutefa does not return the attention probabilities"
    fields = (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, query.device, layout)
    key_ = (*fields, key.device, value.device)
    why = _REASONS.get(key_, False)
    if why is False:
        why = _why_not_shapes(query, key, value, layout)
        if len(_REASONS) >= _MAX_REASONS:
            _REASONS.clear()
        _REASONS[key_] = why
    return why


def _why_not_shapes(query: Any, key: Any, value: Any, layout: str) -> str | None:
    from cutefa import dispatch
    from cutefa.model.defaults import default_spec
    from cutefa.model.spec import ACCEPTED_HEAD_DIMS, accepted_head_dim

    dims = 3 if layout == "thd" else 4
    if any(t.dim() != dims for t in (query, key, value)):
        return f"{layout} inputs must be {dims}-D; got q {tuple(query.shape)}, k {tuple(key.shape)}"
    dtypes = {str(t.dtype).removeprefix("torch.") for t in (query, key, value)}
    if len(dtypes) != 1 or not dtypes <= set(_HALF):
        return f"dtypes {sorted(dtypes)}: cutefa takes float16 or bfloat16 q, k and v of one dtype"
    devices = {t.device for t in (query, key, value)}
    if len(devices) != 1:
        return f"q, k and v are on {sorted(map(str, devices))}: cutefa takes one device"
    head_axis = {"bhsd": 1, "bshd": 2, "thd": 1}[layout]
    head_dims = sorted({query.shape[-1], key.shape[-1], value.shape[-1]})
    if len(head_dims) != 1 or not accepted_head_dim(int(head_dims[0])):
        return f"head dims {head_dims}: cutefa takes one head dim for q, k and v, {ACCEPTED_HEAD_DIMS}"
    # SDPA's caller may ask for gradients: the head dim must have a backward too
    if default_spec("sm80", "bwd", "bf16", int(head_dims[0])) is None:
        return f"head dims {head_dims}: cutefa's backward takes multiples of 32 (its forward every multiple of 8)"
    heads_q, heads_kv = query.shape[head_axis], key.shape[head_axis]
    if heads_kv == 0 or heads_q % heads_kv or key.shape != value.shape:
        return f"heads: q has {heads_q}, k/v {heads_kv} (k {tuple(key.shape)}, v {tuple(value.shape)})"
    if query.device.type not in _device_types():
        return f"inputs on {query.device}: cutefa runs on CUDA tensors"
    try:
        target, gpu_name = _device_target(query.device)
        dispatch.check_target(target, gpu_name)
    except (NotImplementedError, ValueError, RuntimeError) as exc:
        return str(exc)
    return None


def _device_types() -> tuple[str, ...]:
    from cutefa.api import validate

    return validate.DEVICE_TYPES


def _mask(is_causal: bool, left: Any, right: Any) -> tuple[bool, tuple[int, int]]:
    """(causal, window) of aten's causal flag and window sides (None or negative: unbounded), as
    cutefa takes them: causal caps the right side at 0, and a window of (unbounded, 0) is the causal
    mask; (-1, -1) is no window."""
    left = -1 if left is None or left < 0 else int(left)
    right = -1 if right is None or right < 0 else int(right)
    if is_causal:
        right = 0
    if (left, right) == (-1, 0):
        return True, (-1, -1)
    return bool(is_causal), (left, right)


# ---------------------------------------------------------------------------------------------
# The kernel calls (bshd or packed tensors in, cutefa's outputs out)


def _dense_forward(q: Any, k: Any, v: Any, causal: bool, scale: float | None, window: tuple[int, int],
                   alibi: Any) -> tuple[Any, Any]:  # fmt: skip
    import torch

    from cutefa.api import flash_attn_func

    with torch.no_grad():
        if window == (-1, -1) and alibi is None:
            return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
        return flash_attn_func(
            q,
            k,
            v,
            softmax_scale=scale,
            causal=causal,
            window_size=window,
            alibi_slopes=alibi,
            return_lse=True,
        )


def _varlen_forward(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, causal: bool,
                    scale: float | None, window: tuple[int, int], alibi: Any, seqused_k: Any) -> tuple[Any, Any]:  # fmt: skip
    import torch

    import cutefa

    with torch.no_grad():
        return cutefa.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, int(max_q), int(max_k), softmax_scale=scale, causal=causal, window_size=window,
            alibi_slopes=alibi, seqused_k=seqused_k, return_lse=True,
        )  # fmt: skip


def _backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: bool, scale: float | None,
              window: tuple[int, int], packed: tuple[Any, Any, int, int] | None) -> tuple[Any, Any, Any]:  # fmt: skip
    """(dq, dk, dv): ``cutefa::flash_bwd`` for dense attention, ``cutefa::attn_bwd`` with a window
    or packed sequences (``packed``: cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    import torch

    from cutefa.api.validate import default_scale

    softmax_scale = default_scale(scale, q.shape[-1])
    deterministic = torch.are_deterministic_algorithms_enabled()
    if packed is None and window == (-1, -1):
        from cutefa.api import plans

        if plans.plain_eager(q, k, v, dout, out, lse):  # the op's implementation, minus its dispatch
            from cutefa.api.backward import planned_gradients

            return planned_gradients(dout, q, k, v, out, lse, None, causal, softmax_scale, deterministic)
        return torch.ops.cutefa.flash_bwd(dout, q, k, v, out, lse, None, causal, softmax_scale, deterministic)
    import cutefa.api.feature_ops  # noqa: F401 -- registers cutefa::attn_bwd (loaded on first use)

    cu_q, cu_k, max_q, max_k = packed if packed is not None else (None, None, q.shape[1], k.shape[1])
    dq, dk, dv, _ = torch.ops.cutefa.attn_bwd(
        dout, q, k, v, out, lse, None, cu_q, cu_k, None, None, int(max_q), int(max_k), causal, softmax_scale,
        window[0], window[1], 0.0, None, None, deterministic,
    )  # fmt: skip
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# The overriding kernels (registered with with_keyset=True: the keyset comes first)


_REFUSED = (NotImplementedError, ValueError, TypeError)  # raised before any launch: PyTorch's kernel runs


def overrides(originals: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """The kernel that overrides each of :data:`OPS`. A call cutefa does not serve goes to
    ``originals[op]``, PyTorch's kernel (None where there is none: then a NotImplementedError);
    ``originals`` is kept, not copied (the installation's handle holds the same dict)."""

    def bound(serve: Callable[..., Any]) -> Callable[..., Any]:
        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            return serve(originals, keyset, *args, **kwargs)

        return kernel

    served = {_SDPA_FWD: _sdpa_forward, _SDPA_BWD: _sdpa_backward, _FLASH_FWD: _flash_forward,
              _FLASH_BWD: _flash_backward}  # fmt: skip
    return {op: bound(serve) for op, serve in served.items()}


def _sdpa_forward(originals: dict[str, Any], keyset: Any, query: Any, key: Any, value: Any,
                  dropout_p: float = 0.0, is_causal: bool = False, return_debug_mask: bool = False, *,
                  scale: float | None = None) -> Any:  # fmt: skip
    why = why_not(query, key, value, dropout_p=dropout_p, debug_mask=return_debug_mask, layout="bhsd")
    if why is None:
        try:
            out, lse = _dense_forward(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), is_causal, scale, (-1, -1), None
            )  # fmt: skip
        except _REFUSED as exc:
            why = _reason(exc)
        else:
            _served(_SDPA_FWD, query, key, is_causal)
            rng, unused, debug = _aux(query)
            return (
                _like(out.transpose(1, 2), query),
                lse,
                None,
                None,
                query.shape[2],
                key.shape[2],
                rng,
                unused,
                debug,
            )
    return _fallback(originals, _SDPA_FWD, why)(
        keyset, query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale
    )


def _sdpa_backward(originals: dict[str, Any], keyset: Any, grad_out: Any, query: Any, key: Any, value: Any,
                   out: Any, logsumexp: Any, cum_seq_q: Any, cum_seq_k: Any, max_q: int, max_k: int,
                   dropout_p: float, is_causal: bool, philox_seed: Any, philox_offset: Any, *,
                   scale: float | None = None) -> Any:  # fmt: skip
    why = why_not(query, key, value, dropout_p=dropout_p, layout="bhsd")
    if why is None:
        why = _why_not_lse(logsumexp, (query.shape[0], query.shape[1], query.shape[2]))
    if why is None:
        try:
            dq, dk, dv = _backward(
                *(t.transpose(1, 2) for t in (grad_out, query, key, value, out)), logsumexp, is_causal, scale,
                (-1, -1), None,
            )  # fmt: skip
        except _REFUSED as exc:
            why = _reason(exc)
        else:
            _served(_SDPA_BWD, query, key, is_causal)
            pairs = ((dq, query), (dk, key), (dv, value))
            return tuple(_like(g.transpose(1, 2), like) for g, like in pairs)
    args = (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
            philox_seed, philox_offset)  # fmt: skip
    return _fallback(originals, _SDPA_BWD, why)(keyset, *args, scale=scale)


def _flash_forward(originals: dict[str, Any], keyset: Any, query: Any, key: Any, value: Any, cum_seq_q: Any,
                   cum_seq_k: Any, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                   return_debug_mask: bool, **options: Any) -> Any:  # fmt: skip
    packed = cum_seq_q is not None
    why = why_not(query, key, value, dropout_p=dropout_p, debug_mask=return_debug_mask,
                  layout="thd" if packed else "bshd")  # fmt: skip
    if why is None:
        why = _why_not_options(options, packed, cum_seq_k)
    if why is None:
        causal, window = _mask(is_causal, options.get("window_size_left"), options.get("window_size_right"))
        scale, alibi = options.get("scale"), options.get("alibi_slopes")
        try:
            if packed:
                out, lse = _varlen_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, causal, scale,
                                           window, alibi, options.get("seqused_k"))  # fmt: skip
            else:
                out, lse = _dense_forward(query, key, value, causal, scale, window, alibi)
        except _REFUSED as exc:
            why = _reason(exc)
        else:
            _served(_FLASH_FWD, query, key, causal, window)
            rng, unused, debug = _aux(query)
            return _like(out, query), lse, rng, unused, debug
    args = (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask)
    return _fallback(originals, _FLASH_FWD, why)(keyset, *args, **options)


def _why_not_options(options: dict[str, Any], packed: bool, cum_seq_k: Any) -> str | None:
    if options.get("block_table") is not None:
        return "block_table (paged KV): cutefa's varlen call takes no page table"
    if options.get("seqused_k") is not None and not packed:
        return "seqused_k without packed sequences: cutefa takes it with cu_seqlens only"
    if packed and cum_seq_k is None:
        return "cum_seq_k is None: cutefa's varlen call needs the keys' cumulative lengths"
    unknown = set(options) - {"scale", "window_size_left", "window_size_right", "seqused_k", "alibi_slopes",
                              "block_table", "num_splits"}  # fmt: skip
    if unknown:
        return f"options cutefa does not know: {sorted(unknown)}"
    return None  # num_splits: a hint; cutefa never splits the keys, so any result is batch-invariant


def _flash_backward(originals: dict[str, Any], keyset: Any, grad_out: Any, query: Any, key: Any, value: Any,
                    out: Any, logsumexp: Any, cum_seq_q: Any, cum_seq_k: Any, max_q: int, max_k: int,
                    dropout_p: float, is_causal: bool, rng_state: Any, unused: Any, *, scale: float | None = None,
                    window_size_left: int | None = None, window_size_right: int | None = None) -> Any:  # fmt: skip
    packed = cum_seq_q is not None
    why = why_not(query, key, value, dropout_p=dropout_p, layout="thd" if packed else "bshd")
    if why is None and packed and cum_seq_k is None:
        why = "cum_seq_k is None: cutefa's varlen backward needs the keys' cumulative lengths"
    if why is None:
        want = (
            (query.shape[1], query.shape[0]) if packed else (query.shape[0], query.shape[2], query.shape[1])
        )
        why = _why_not_lse(logsumexp, want)
    if why is None:
        causal, window = _mask(is_causal, window_size_left, window_size_right)
        lengths = (cum_seq_q, cum_seq_k, max_q, max_k) if packed else None
        try:
            dq, dk, dv = _backward(
                grad_out, query, key, value, out, logsumexp, causal, scale, window, lengths
            )
        except _REFUSED as exc:
            why = _reason(exc)
        else:
            _served(_FLASH_BWD, query, key, causal, window)
            return _like(dq, query), _like(dk, key), _like(dv, value)
    args = (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
            rng_state, unused)  # fmt: skip
    return _fallback(originals, _FLASH_BWD, why)(
        keyset, *args, scale=scale, window_size_left=window_size_left, window_size_right=window_size_right
    )


# ---------------------------------------------------------------------------------------------
# Helpers of the overriding kernels


def _why_not_lse(lse: Any, shape: tuple[int, ...]) -> str | None:
    """The forward's log-sum-exp must be cutefa's: float32 of ``shape`` (whoever computed it)."""
    if str(lse.dtype) != "torch.float32" or tuple(lse.shape) != tuple(shape):
        return f"logsumexp {lse.dtype} {tuple(lse.shape)}: cutefa's backward takes float32 {tuple(shape)}"
    return None


def _reason(exc: BaseException) -> str:
    return f"cutefa refused it: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _aux(query: Any) -> tuple[Any, Any, Any]:
    """The (rng state, unused, debug mask) outputs: never read without dropout, so left unset."""
    import torch

    device = query.device
    return (
        torch.empty((2,), dtype=torch.uint64, device=device),
        torch.empty((), dtype=torch.uint64, device=device),
        torch.empty((0,), dtype=query.dtype, device=device),
    )


def _like(t: Any, ref: Any) -> Any:
    """``t`` when its layout is what PyTorch's kernel gives an output like ``ref`` (``empty_like(ref)``),
    else a copy of it in that layout. Strides of size-1 dims do not count."""
    if t.stride() == ref.stride():
        return t
    import torch

    want = torch.empty_like(ref, device="meta").stride()
    if all(a == b or n == 1 for a, b, n in zip(t.stride(), want, t.shape)):
        return t
    return torch.empty_like(ref).copy_(t)


def _served(op: str, query: Any, key: Any, causal: bool, window: tuple[int, int] = (-1, -1)) -> None:
    from cutefa import dispatch

    if dispatch._LOG_RUNS:
        extra = "" if window == (-1, -1) else f" window_size={window}"
        log.info(
            "cutefa sdpa: aten.%s served by cutefa: q=%s k=%s causal=%s%s",
            op, tuple(query.shape), tuple(key.shape), causal, extra,
        )  # fmt: skip


def _fallback(originals: dict[str, Any], op: str, why: str | None) -> Callable[..., Any]:
    """PyTorch's kernel for ``op`` among ``originals`` (as ``kernel(keyset, *args, **kwargs)``),
    after logging why."""
    from cutefa import dispatch

    if dispatch._LOG_RUNS:
        log.info("cutefa sdpa: aten.%s runs PyTorch's kernel: %s", op, why)
    original = originals.get(op)
    if original is None:
        raise NotImplementedError(
            f"aten.{op}: cutefa does not serve this call ({why}) and PyTorch has no kernel of its own for it here"
        )
    return original.call_boxed
