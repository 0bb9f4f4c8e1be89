"""The attention API behind ``cutefa.flash_attn_func``: validation (:mod:`.validate`), the shared
launch (:mod:`.launch`), the 16-bit forward op (:mod:`.dense`), the backward op (:mod:`.backward`),
the e4m3 forward op (:mod:`.fp8`) and its descales (:mod:`.descales`), the call-plan memo
(:mod:`.plans`) and the user-facing functions (:mod:`.attention`).

Importing this package registers the custom ops (``cutefa::flash_fwd``, ``cutefa::flash_bwd``,
``cutefa::flash_fwd_fp8``).
"""

from cutefa.api.attention import explain, flash_attn_func
from cutefa.api.descales import fp8_block_sizes

__all__ = ["explain", "flash_attn_func", "fp8_block_sizes"]
