"""WGMMA shared-memory descriptors computed once per kernel, not at every GEMM issue of a loop.

A WGMMA operand fragment made from a shared-memory tensor (``make_fragment_A/B``) is a view whose
iterator is a 64-bit matrix descriptor (start address >> 4, leading/stride byte offsets, swizzle).
The DSL lowers every GEMM issue on such a view by rebuilding the descriptor from the shared-memory
base address at the issue site, and no later pass moves that work out of the loop: in the 16-bit
forward's key loop it is ~20 uniform-datapath instructions per block (add the buffer's offset to
the base, shift, mask, OR the layout bits), on every consumer's path between the K wait and the
S = Q K^T issue.

:func:`hoisted` takes the descriptor value out of the fragment where the fragment is made, passes
it through one inline-PTX ``mov`` that the compiler may neither move nor merge (so the descriptor
is computed there, before the loop), and rebuilds the same view on the moved value. Stage and
k-block slices of the result add their constant or ring-index offsets to it as before, so each
issue in the loop costs one add (or one shift-add for the ring stage). The values are the same:
only where they are computed moves. The sm90 forward and backward templates and
``bwd_parts``' dQ operands use it; the 16-bit forward leaves it out on the causal two-consumer
tiles where holding the descriptors across the loop makes ptxas give up its uniform datapath
(templates/fwd_sm90.py.j2).
"""

import cutlass
import cutlass._mlir.dialects.cute_nvgpu as _nvgpu_ir
import cutlass.cute as cute
from cutlass._mlir.dialects import builtin
from cutlass.cutlass_dsl import dsl_user_op

from cutefa.kernels.common.ptx import effect_asm


@dsl_user_op
def _materialized(desc, *, loc=None, ip=None):
    """``desc`` (an MLIR smem-descriptor value) through a ``mov.b64`` with side effects: computed
    here, where this is called."""
    as_int = builtin.unrealized_conversion_cast([cutlass.Int64.mlir_type], [desc], loc=loc, ip=ip)
    moved = effect_asm(cutlass.Int64.mlir_type, [as_int], "mov.b64 $0, $1;", "=l,l", loc=loc, ip=ip)
    return builtin.unrealized_conversion_cast([_nvgpu_ir.SmemDescType.get()], [moved], loc=loc, ip=ip)


def hoisted(fragment: cute.Tensor) -> cute.Tensor:
    """The WGMMA shared-memory operand ``fragment`` (from ``make_fragment_A/B``) with its descriptor
    computed at this point of the kernel (call it before the loop that issues the GEMMs)."""
    return cute.make_tensor(_materialized(fragment.iterator), fragment.layout)
