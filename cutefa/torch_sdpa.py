"""cutefa as the flash-attention provider of PyTorch's ``scaled_dot_product_attention`` (SDPA).

PyTorch keeps a registry of flash-attention providers (``torch.nn.attention``:
``register_flash_attention_impl``, ``activate_flash_attention_impl``; FA3 and FA4 register there
too). Activating a provider overrides, for CUDA tensors, the aten ops behind SDPA's flash backend
and ``torch.nn.attention.varlen.varlen_attn``:

- ``aten::_scaled_dot_product_flash_attention`` and ``..._backward``: SDPA's flash backend, on
  (batch, heads, seqlen, head_dim) tensors;
- ``aten::_flash_attention_forward`` and ``aten::_flash_attention_backward``: (batch, seqlen, heads,
  head_dim) tensors, or packed (total, heads, head_dim) ones with cumulative sequence lengths,
  which is what ``varlen_attn`` runs (its forward and its backward).

``import cutefa`` registers the name ``"cutefa"`` (:func:`register`) and never activates it.
:func:`activate` (or ``torch.nn.attention.activate_flash_attention_impl("cutefa")``) does;
:func:`deactivate` puts PyTorch's own kernels back.

What cutefa serves: fp16/bf16 inputs with a head dim cutefa has kernels for, no dropout, no
debug mask, any heads ratio (grouped-query attention: SDPA's ``enable_gqa``), causal or not, on a
GPU cutefa has kernels for; through ``_flash_attention_forward/_backward`` also sliding windows,
ALiBi slopes (forward) and packed sequences. Everything else, and any call cutefa refuses
(no kernel for the shape, inputs its checks do not accept), runs PyTorch's own kernel, which was
looked up before the override (``torch.library.get_kernel``). With ``CUTEFA_LOG=1`` every call
logs a line saying which way it went: served (and cutefa's own line names the kernel that ran), or
PyTorch's kernel and why. The attention mask other than ``is_causal`` never reaches these ops: SDPA
chooses another backend for it.

Layouts: SDPA hands (batch, heads, seqlen, head_dim) tensors; cutefa takes (batch, seqlen,
heads, head_dim) views of them (``transpose(1, 2)``, no copy), and its outputs are returned as
the transposed views. The outputs have the layout PyTorch's own kernel gives them (that of the
query, key and value: what ``torch.compile``'s graphs assume): the usual inputs, projections
viewed as heads, already have it; only for other input layouts is an output copied into it.

Priority: on Hopper and Blackwell with recent cuDNN, SDPA tries cuDNN attention before the flash
backend, so flash calls would never come. While active, the flash backend is put first in SDPA's
priority order (``activate(prefer_flash=False)`` keeps the order; ``sdpa_kernel`` contexts still
choose as they say); :func:`deactivate` restores it.

``torch.compile``: the overridden ops keep PyTorch's meta functions, so tracing is unchanged and
compiled graphs call the ops, which reach cutefa when they run. ``varlen_attn_out`` (writing into
a given tensor, ``aten::_flash_attention_forward_no_dropout_inplace``) keeps PyTorch's kernel.

Needs PyTorch's provider registry (torch 2.10 and later) and ``torch.library.get_kernel`` (2.9);
:func:`activate` on an older torch is a NotImplementedError that says so.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NAME = "cutefa"
_REGISTRY = "torch.nn.attention._registry"  # imported by `import torch` (2.10 and later)
_SDPA_FWD = "_scaled_dot_product_flash_attention"
_SDPA_BWD = "_scaled_dot_product_flash_attention_backward"
_FLASH_FWD = "_flash_attention_forward"
_FLASH_BWD = "_flash_attention_backward"
_HALF = ("float16", "bfloat16")  # torch dtype names cutefa's 16-bit kernels take

log = logging.getLogger("cutefa")


# ---------------------------------------------------------------------------------------------
# Registration and activation


def register() -> None:
    """Register ``"cutefa"`` in PyTorch's flash-attention registry; never activates it.

    Idempotent and cheap: it never imports torch. When torch is not imported yet, the registration
    happens as soon as its registry module is (an import hook that then leaves ``sys.meta_path``);
    a torch without the registry gets nothing (:func:`activate` explains)."""
    registry = sys.modules.get(_REGISTRY)
    if registry is not None:
        registry.register_flash_attention_impl(NAME, register_fn=_install)
    elif "torch" not in sys.modules:
        _start_watching()


class _Watch(importlib.abc.MetaPathFinder):
    """Registers cutefa right after PyTorch's registry module has run, then leaves sys.meta_path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _REGISTRY:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return None
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            module.register_flash_attention_impl(NAME, register_fn=_install)
            _stop_watching()  # not from find_spec: importlib is iterating sys.meta_path there

        spec.loader.exec_module = exec_module
        return spec


_watch: _Watch | None = None  # the import hook while it waits for torch
_watch_lock = threading.Lock()


def _start_watching() -> None:
    global _watch
    with _watch_lock:
        if _watch is None:
            _watch = _Watch()
            sys.meta_path.insert(0, _watch)


def _stop_watching() -> None:
    global _watch
    with _watch_lock:
        if _watch is not None and _watch in sys.meta_path:
            sys.meta_path.remove(_watch)
        _watch = None


def _registry() -> Any:
    """PyTorch's flash-attention registry module, or a NotImplementedError naming what is missing."""
    import torch

    registry = sys.modules.get(_REGISTRY)
    if registry is None:
        try:
            import torch.nn.attention._registry as registry
        except ImportError:
            registry = None
    if registry is None or not hasattr(torch.library, "get_kernel"):
        raise NotImplementedError(
            f"torch {torch.__version__} has no flash-attention provider registry "
            "(torch.nn.attention.register_flash_attention_impl, torch 2.10 and later) or no "
            "torch.library.get_kernel (2.9 and later): cutefa cannot serve SDPA there; call "
            "cutefa.flash_attn_func directly, or upgrade torch"
        )
    return registry


def activate(*, prefer_flash: bool = True) -> None:
    """Route SDPA's flash backend (and ``varlen_attn``) to cutefa, as
    ``torch.nn.attention.activate_flash_attention_impl("cutefa")`` does. ``prefer_flash`` puts the
    flash backend first in SDPA's priority order while active (see the module docstring)."""
    registry = _registry()
    registry.register_flash_attention_impl(
        NAME, register_fn=functools.partial(_install, prefer_flash=prefer_flash)
    )
    try:
        registry.activate_flash_attention_impl(NAME)
    finally:
        registry.register_flash_attention_impl(NAME, register_fn=_install)


def deactivate() -> None:
    """Put PyTorch's own kernels (and SDPA's priority order) back; nothing when cutefa is not active."""
    registry = sys.modules.get(_REGISTRY)
    current = registry.current_flash_attention_impl() if registry is not None else None
    restore = getattr(registry, "restore_flash_attention_impl", None)
    if current == NAME and restore is not None:
        restore()  # removes our handle
    elif _installed is not None:
        _installed.remove()
        if current == NAME:  # a registry without restore_flash_attention_impl keeps its own marks
            registry._FLASH_ATTENTION_ACTIVE = None
            getattr(registry, "_FLASH_ATTENTION_HANDLES", {}).pop(NAME, None)


def is_active() -> bool:
    """Whether cutefa's kernels are installed behind SDPA's flash backend."""
    return _installed is not None


@dataclass
class _Handle:
    """What activation installed: the override library, PyTorch's kernels it covers (None where
    there is none for the dispatch key), and the SDPA priority orders (before, ours) to restore."""

    library: Any
    originals: dict[str, Any]
    priority: tuple[list[int], list[int]] | None

    def remove(self) -> None:
        global _installed

        if self.library is not None:
            self.library._destroy()
            self.library = None
        if self.priority is not None:
            import torch

            before, ours = self.priority
            if list(torch._C._get_sdp_priority_order()) == ours:  # unless someone changed it since
                torch._C._set_sdp_priority_order(before)
            self.priority = None
        if _installed is self:
            _installed = None


_installed: _Handle | None = None  # what activation installed, until removed


def _install(prefer_flash: bool = True, dispatch_key: str = "CUDA") -> _Handle:
    """The registry's ``register_fn``: override the ops for ``dispatch_key``, keeping PyTorch's
    kernels for what cutefa does not serve. (The CPU tests install on the CPU key.)"""
    global _installed
    import torch

    _registry()  # the version checks
    if _installed is not None:
        _installed.remove()
    impls = {
        _SDPA_FWD: _sdpa_forward,
        _SDPA_BWD: _sdpa_backward,
        _FLASH_FWD: _flash_forward,
        _FLASH_BWD: _flash_backward,
    }
    originals = {op: _original_kernel(op, dispatch_key) for op in impls}
    library = torch.library.Library("aten", "IMPL", dispatch_key)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        for op, impl in impls.items():
            library.impl(op, impl, dispatch_key, with_keyset=True)
    _installed = _Handle(library, originals, _prefer_flash() if prefer_flash else None)
    return _installed


def _original_kernel(op: str, dispatch_key: str) -> Any:
    import torch

    try:
        return torch.library.get_kernel(f"aten::{op}", dispatch_key)
    except RuntimeError:  # no kernel for this key (a CPU-only build has no CUDA kernels)
        return None


def _prefer_flash() -> tuple[list[int], list[int]] | None:
    """Put the flash backend first in SDPA's priority order; (the order before, ours)."""
    import torch

    get = getattr(torch._C, "_get_sdp_priority_order", None)
    put = getattr(torch._C, "_set_sdp_priority_order", None)
    if get is None or put is None:
        return None
    before = [int(b) for b in get()]
    flash = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    ours = [flash, *(b for b in before if b != flash)]
    put(ours)
    return before, ours


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
    head_dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    if len(head_dims) != 1 or not accepted_head_dim(int(query.shape[-1])):
        return f"head dims {sorted(head_dims)}: cutefa takes one head dim for q, k and v, {ACCEPTED_HEAD_DIMS}"
    if default_spec("sm80", "bwd", "bf16", int(query.shape[-1])) is None:  # SDPA's caller may ask for gradients
        return f"head dims {sorted(head_dims)}: cutefa's backward takes multiples of 32 (its forward every multiple of 8)"
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


def _sdpa_forward(keyset: Any, query: Any, key: Any, value: Any, dropout_p: float = 0.0, is_causal: bool = False,
                  return_debug_mask: bool = False, *, scale: float | None = None) -> Any:  # fmt: skip
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
    return _fallback(_SDPA_FWD, why)(
        keyset, query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale
    )


def _sdpa_backward(keyset: Any, grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any,
                   cum_seq_q: Any, cum_seq_k: Any, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                   philox_seed: Any, philox_offset: Any, *, scale: float | None = None) -> Any:  # fmt: skip
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
    return _fallback(_SDPA_BWD, why)(keyset, *args, scale=scale)


def _flash_forward(keyset: Any, query: Any, key: Any, value: Any, cum_seq_q: Any, cum_seq_k: Any, max_q: int,
                   max_k: int, dropout_p: float, is_causal: bool, return_debug_mask: bool, **options: Any) -> Any:  # fmt: skip
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
    return _fallback(_FLASH_FWD, why)(keyset, *args, **options)


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


def _flash_backward(keyset: Any, grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any,
                    cum_seq_q: Any, cum_seq_k: Any, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                    rng_state: Any, unused: Any, *, scale: float | None = None, window_size_left: int | None = None,
                    window_size_right: int | None = None) -> Any:  # fmt: skip
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
    return _fallback(_FLASH_BWD, why)(
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


def _fallback(op: str, why: str | None) -> Callable[..., Any]:
    """PyTorch's kernel for ``op`` (as ``kernel(keyset, *args, **kwargs)``), after logging why."""
    from cutefa import dispatch

    if dispatch._LOG_RUNS:
        log.info("cutefa sdpa: aten.%s runs PyTorch's kernel: %s", op, why)
    original = _installed.originals.get(op) if _installed is not None else None
    if original is None:
        raise NotImplementedError(
            f"aten.{op}: cutefa does not serve this call ({why}) and PyTorch has no kernel of its own for it here"
        )
    return original.call_boxed
