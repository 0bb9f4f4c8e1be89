"""The attention API behind ``cutefa.flash_attn_func``: validation (:mod:`.validate`), the shared
launch (:mod:`.launch`), the 16-bit forward op (:mod:`.dense`), the backward op (:mod:`.backward`),
the e4m3 forward op (:mod:`.fp8`) and its descales (:mod:`.descales`), the call-plan memo
(:mod:`.plans`), the user-facing functions (:mod:`.attention`, :mod:`.varlen`), and calls with
features (packed sequences, window, softcap, ALiBi, sinks): their runtime arguments
(:mod:`.features`), checks (:mod:`.validate_features`), ops (:mod:`.feature_ops`) and backward
(:mod:`.feature_bwd`).

Importing this package registers the custom ops (``cutefa::flash_fwd``, ``cutefa::flash_bwd``,
``cutefa::flash_fwd_fp8``, ``cutefa::attn_fwd``, ``cutefa::attn_bwd``).
"""

from cutefa.api.attention import explain, flash_attn_func
from cutefa.api.descales import fp8_block_sizes
from cutefa.api.varlen import flash_attn_varlen_func

__all__ = ["explain", "flash_attn_func", "flash_attn_varlen_func", "fp8_block_sizes"]
