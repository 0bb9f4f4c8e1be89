"""Head dims of their own in the sm90 16-bit forward: any multiple of 8 up to 256, and a V head dim
apart from the Q/K one.

The kernel computes on *tile* head dims, the real ones padded to WGMMA's k step (16 elements of a
16-bit operand; :func:`cutefa.model.policy_sm90.fwd_tile_head_dims`). The TMA boxes take the tile
head dims while the descriptors keep the tensors' real extents, so the columns past the real head
dim are zero-filled when Q, K and V land in shared memory (a zero column adds nothing to Q K^T, and
a zero V column gives an O column that is never stored) and the O store is clipped at the real V
head dim: the pad columns of the output are never written, and the inputs are never copied.

The shared-memory layouts take the swizzle that the padded row's bytes allow (the DSL's
``get_smem_layout_atom``: 128, 64 or 32 bytes); Q and K are K-major with the Q/K tile head dim, V is
N-major with the V tile head dim, and O is staged with the V tile head dim.
"""

import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils

from cutefa.kernels.sm90.parts import WG_ROWS


def smem_layouts(dtype, tile_n: int, tile_d: int, tile_dv: int, q_slabs: int, stages: int):
    """Swizzled staged layouts: Q (64, tile_d, q_slabs), K (tile_n, tile_d, stages), V (tile_dv,
    tile_n, stages)."""
    sq = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (WG_ROWS, tile_n, tile_d), dtype, q_slabs)
    sk = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, (WG_ROWS, tile_n, tile_d), dtype, stages)
    sv = sm90_utils.make_smem_layout_b(utils.LayoutEnum.COL_MAJOR, (WG_ROWS, tile_dv, tile_n), dtype, stages)
    return sq, sk, sv


def o_staging_layout(dtype, tile_dv: int, slabs: int, slab_stride: int):
    """The swizzled layout (64, tile_dv, slabs) that stages each consumer's O for its TMA store,
    slab ``c`` ``c * slab_stride`` elements from the start: the Q slab's size where O is staged in
    the consumer's own Q slab (each slab's start stays 1024-byte aligned: 64 rows of a multiple of
    16 columns), the O slab's own size where O has a buffer of its own."""
    one = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (WG_ROWS, 16, tile_dv), dtype, 1)
    rows_cols = cute.select(one.outer, mode=[0, 1])
    outer = cute.append(rows_cols, cute.make_layout(slabs, stride=slab_stride))
    return cute.make_composed_layout(one.inner, 0, outer)
