"""The attention API behind ``cutefa.flash_attn_func``: validation (:mod:`.validate`), the shared
launch (:mod:`.launch`), the 16-bit forward op (:mod:`.dense`), the backward op (:mod:`.backward`),
the e4m3 forward op (:mod:`.fp8`) and its descales (:mod:`.descales`), the call-plan memo
(:mod:`.plans`), the user-facing functions (:mod:`.attention`, :mod:`.varlen`), and calls with
features (packed sequences, window, softcap, ALiBi, sinks): their runtime arguments
(:mod:`.features`), checks (:mod:`.validate_features`), ops (:mod:`.feature_ops`) and backward
(:mod:`.feature_bwd`).

Importing this package registers the dense custom ops (``cutefa::flash_fwd``, ``cutefa::flash_bwd``);
what a dense call does not need loads on first use: the e4m3 op (``cutefa::flash_fwd_fp8``, with
:mod:`.fp8`) on the first fp8 call, the feature ops (``cutefa::attn_fwd``, ``cutefa::attn_bwd``, with
:mod:`.feature_ops`) on the first call with packed sequences or a feature, and
:func:`flash_attn_varlen_func` and :func:`fp8_block_sizes` on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cutefa.api.attention import explain, flash_attn_func

if TYPE_CHECKING:
    from cutefa.api.descales import fp8_block_sizes
    from cutefa.api.varlen import flash_attn_varlen_func

__all__ = ["explain", "flash_attn_func", "flash_attn_varlen_func", "fp8_block_sizes"]


def __getattr__(name: str) -> Any:
    if name == "flash_attn_varlen_func":
        from cutefa.api.varlen import flash_attn_varlen_func

        globals()[name] = flash_attn_varlen_func
        return flash_attn_varlen_func
    if name == "fp8_block_sizes":
        from cutefa.api.descales import fp8_block_sizes

        globals()[name] = fp8_block_sizes
        return fp8_block_sizes
    # Anything else (a submodule not imported yet among them) is not an attribute: the import
    # system then loads the submodule for ``from cutefa.api import fp8``.
    raise AttributeError(f"module 'cutefa.api' has no attribute {name!r}")
