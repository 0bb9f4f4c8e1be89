"""User-written score and mask modifications fused into the generated kernels.

``score_mod(score, b, h, q_idx, kv_idx) -> score`` and ``mask_mod(b, h, q_idx, kv_idx) -> bool``
(FlexAttention's signatures) are traced on symbolic values (:mod:`~cutefa.mods.trace`,
:mod:`~cutefa.mods.expr`) into an expression, written out as CuTe DSL
(:mod:`~cutefa.mods.kernel_source`) inside the sm80 forward template, and keyed by that
expression (:mod:`~cutefa.mods.traced`, :mod:`~cutefa.mods.variant`). Tensors the mods read become
kernel arguments (after the feature arguments, before the stream: :mod:`~cutefa.mods.variant`).
:mod:`~cutefa.mods.block_mask` computes which key blocks each query block needs;
:mod:`~cutefa.mods.derivative` differentiates a score_mod for the backward.

Importing this package does not import the DSL.
"""

from cutefa.mods.block_mask import BlockMask, create_block_mask
from cutefa.mods.expr import ModTraceError
from cutefa.mods.traced import TracedMods, trace_mods

__all__ = ["BlockMask", "ModTraceError", "TracedMods", "create_block_mask", "trace_mods"]
