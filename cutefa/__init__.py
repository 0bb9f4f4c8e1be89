"""cutefa: FlashAttention kernels generated in NVIDIA's CuTe DSL.

``import cutefa`` is light: torch and the kernels' modules load on first use of the API, and the
CuTe DSL compiler only when a kernel is first compiled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cutefa.api import explain, flash_attn_func, flash_attn_varlen_func, fp8_block_sizes
    from cutefa.api.kvcache import flash_attn_with_kvcache
    from cutefa.api.padding import pad_input, unpad_input
    from cutefa.fp8 import center_v, quantize_fp8
    from cutefa.mods import BlockMask, create_block_mask
    from cutefa.paged import PagedKVCache

__all__ = [
    "BlockMask", "PagedKVCache", "__version__", "center_v", "create_block_mask", "explain", "flash_attn_func", "flash_attn_varlen_func",
    "flash_attn_with_kvcache", "fp8_block_sizes", "pad_input", "quantize_fp8", "unpad_input",
]

__version__ = "0.1.0"  # keep equal to pyproject.toml's version (a test checks)

_LAZY = {"flash_attn_func", "flash_attn_varlen_func", "explain", "fp8_block_sizes"}


def __getattr__(name: str) -> Any:
    if name in ("quantize_fp8", "center_v"):
        from cutefa import fp8

        value = getattr(fp8, name)
        globals()[name] = value
        return value
    if name == "flash_attn_with_kvcache":
        from cutefa.api import kvcache

        globals()[name] = kvcache.flash_attn_with_kvcache
        return kvcache.flash_attn_with_kvcache
    if name in ("create_block_mask", "BlockMask"):
        from cutefa.mods import block_mask

        value = getattr(block_mask, name)
        globals()[name] = value
        return value
    if name == "PagedKVCache":
        from cutefa import paged

        globals()[name] = paged.PagedKVCache
        return paged.PagedKVCache
    if name in ("unpad_input", "pad_input"):
        from cutefa.api import padding

        value = getattr(padding, name)
        globals()[name] = value
        return value
    if name in _LAZY:
        import sys

        if "cutefa.api" not in sys.modules:
            from cutefa import profile

            with profile.phase("import cutefa.api"):
                from cutefa import api
        from cutefa import api

        value = getattr(api, name)
        globals()[name] = value  # later look-ups (one per call of cutefa.flash_attn_func) skip this
        return value
    raise AttributeError(f"module 'cutefa' has no attribute {name!r}")


def _register_sdpa_provider() -> None:
    """Make "cutefa" known to PyTorch's flash-attention provider registry (never activated here:
    :func:`cutefa.torch_sdpa.activate` does that); cheap, and torch is not imported for it."""
    from cutefa.torch_sdpa import register

    register()


_register_sdpa_provider()
