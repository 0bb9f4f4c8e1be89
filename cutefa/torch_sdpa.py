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
(no kernel for the shape, inputs its checks do not accept), runs PyTorch's own kernel.
:func:`why_not` says why a call is not served, and with ``CUTEFA_LOG=1`` every call logs a line
saying which way it went. The attention mask other than ``is_causal`` never reaches these ops:
SDPA chooses another backend for it. Outputs have the layout PyTorch's own kernel gives them.

This module holds the registration and activation; the overriding kernels, the routing decision
and the layouts are in :mod:`cutefa.sdpa_serve`, loaded only when the provider is installed (or
:func:`why_not` is first called), so ``import cutefa`` stays cheap.

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
import sys
import threading
import warnings
from typing import Any

NAME = "cutefa"
_REGISTRY = "torch.nn.attention._registry"  # imported by `import torch` (2.10 and later)


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


class _Handle:
    """What activation installed: the override library, PyTorch's kernels it covers (None where
    there is none for the dispatch key), and the SDPA priority orders (before, ours) to restore.
    (A plain class: a dataclass would cost ``import cutefa`` half a millisecond.)"""

    def __init__(
        self, library: Any, originals: dict[str, Any], priority: tuple[list[int], list[int]] | None
    ) -> None:
        self.library = library
        self.originals = originals
        self.priority = priority

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

    from cutefa import sdpa_serve

    _registry()  # the version checks
    if _installed is not None:
        _installed.remove()
    originals = {op: _original_kernel(op, dispatch_key) for op in sdpa_serve.OPS}
    impls = sdpa_serve.overrides(originals)
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


def __getattr__(name: str) -> Any:
    """``why_not`` (:func:`cutefa.sdpa_serve.why_not`) loads the serving module on first access."""
    if name == "why_not":
        from cutefa.sdpa_serve import why_not

        globals()[name] = why_not
        return why_not
    raise AttributeError(f"module 'cutefa.torch_sdpa' has no attribute {name!r}")
