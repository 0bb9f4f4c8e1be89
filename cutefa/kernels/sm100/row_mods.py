"""Score modifiers of the sm100-family forward, on one query row per thread.

The softmax warpgroups of the FlashAttention-4 design load S from TMEM with 32x32b loads: thread t
of a warpgroup holds all ``tile_n`` scores of query row t of its Q tile, in key order, so a score's
key is its register index (a compile-time constant) plus the block's first key. The pieces of the
local band, the softcap and ALiBi on that layout live here; the arithmetic every family shares (the
band's bounds and key-block range, tanh, the sink's finalize term) comes from
:mod:`cutefa.kernels.common.mask` and :mod:`cutefa.kernels.common.score_mods`, whose module notes
give the units: the softmax keeps raw values x and exponentiates ``2**(x * scale_log2 - offset)``;
with softcap c, x is tanh(softmax_scale * q.k / c) and scale_log2 is c * log2(e).

Compiled and SASS-checked for sm_100a; not run on hardware.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cutefa.kernels.common.mask import local_key_blocks
from cutefa.kernels.common.score_mods import tanh_approx
from cutefa.kernels.common.softmax import LOG2_E


@cute.jit
def band_blocks(
    first_row: Int32,
    last_row: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    tile_n: cutlass.Constexpr,
):
    """The key blocks query rows [first_row, last_row] visit under the local band, in the order
    the warp roles walk them: ``(n_end, n_blocks, n_top, n_bottom)``, the blocks [n_end - n_blocks,
    n_end) from the last to the first, of which the first ``n_top`` of the visit (the band's right
    edge and the key-length residue) and the last ``n_bottom`` (its left edge) need a per-element
    mask. Blocks outside every row's band are not in the range
    (:func:`cutefa.kernels.common.mask.local_key_blocks`). A tile whose rows see no key still gets
    one block, fully masked, so that every warp role runs the same schedule."""
    n_first, n_last, u_first, u_last = local_key_blocks(
        first_row, last_row, tile_n, seqlen_q, seqlen_k, window_left, window_right
    )
    n_end = cutlass.max(n_last, n_first + 1)
    return n_end, n_end - n_first, n_end - u_last, u_first - n_first


@cute.jit
def mask_band(s: cute.Tensor, key_start, key_limit):
    """-inf for every column of this thread's row outside [key_start, key_limit) (tile-local keys)."""
    for c in cutlass.range_constexpr(cute.size(s)):
        keep = (key_start <= c) & (key_limit > c)
        s[c] = Float32(cutlass.select_(keep, s[c], -Float32.inf))


@cute.jit
def softcap_row(s: cute.Tensor, pre_scale: Float32):
    """x = tanh(x * pre_scale) for every score of the row (pre_scale = softmax_scale / softcap)."""
    for c in cutlass.range_constexpr(cute.size(s)):
        s[c] = tanh_approx(s[c] * pre_scale)


@cute.jit
def alibi_row(s: cute.Tensor, slope_x: Float32, diagonal: Int32):
    """x += slope_x * |diagonal - c| for column c: ALiBi's -slope * |i + sk - sq - j| in the row's
    raw units (``slope_x`` from :func:`alibi_slope_x`; ``diagonal`` = i + sk - sq minus the block's
    first key). Distances are exact below 2**24."""
    d = Float32(diagonal)
    for c in cutlass.range_constexpr(cute.size(s)):
        s[c] = s[c] + slope_x * cute.math.abs(d - Float32(c))


@cute.jit
def alibi_slope_x(slope: Float32, scale_log2: Float32) -> Float32:
    """The factor of :func:`alibi_row` for a head's ``slope``: -slope in the raw units of x (a
    natural-log score is x * scale_log2 / log2(e))."""
    return -slope * LOG2_E * cute.arch.rcp_approx(scale_log2)
