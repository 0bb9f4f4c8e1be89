"""The in-place append of the sm80 decode kernel (templates/decode_sm80.py.j2): one launch, before
the attention, writes the new keys and values into the cache and rotates q and the new keys.

A CTA owns token ``t`` of sequence ``b`` (grid (max(seqlen_new, seqlen_q), batch)); its threads
walk the token's rows pair by pair: q's heads (only with rotary embedding: q rotated into a new
tensor, the rest of each row copied), the new keys (rotated on their first ``rotary_dim`` columns)
and the new values (copied). A pair is two columns of one row: interleaved ``(2p, 2p + 1)``, or the
GPT-NeoX halves ``(p, p + rotary_dim / 2)`` for ``p < rotary_dim / 2``; the columns past
``rotary_dim`` go as ``(2p, 2p + 1)`` in both layouts. A rotated pair is computed in float32 from
``cos``/``sin`` row ``position`` column ``p`` and rounded once; a copied pair keeps its bits.

Positions (flash-attn's): the new token ``t`` lands at cache index ``cache_seqlens[b] + t`` (its
page through the page table); its rotary position is ``cache_seqlens[b] - cache_leftpad[b] + t``
(a left-padded sequence starts at position 0), q's the same per token under a causal or local mask
and ``cache_seqlens[b] - cache_leftpad[b]`` for every token otherwise. A slot at or past the
cache's capacity is not written; a rotary position is clamped to the rows of ``cos``/``sin``. No
other byte of the cache is touched.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

APPEND_THREADS = 128


@cute.jit
def pair_columns(p: Int32, half: Int32, interleaved: Int32):
    """The two columns of pair ``p`` of a row: (2p, 2p + 1), or (p, p + half) for a rotated pair of
    the GPT-NeoX layout (``interleaved`` 0)."""
    c1 = 2 * p
    c2 = 2 * p + 1
    if (p < half) & (interleaved == 0):
        c1 = p
        c2 = p + half
    return c1, c2


@cute.jit
def rope_row_pairs(
    src: cute.Tensor,
    dst: cute.Tensor,
    cos: cute.Tensor,
    sin: cute.Tensor,
    rows: Int32,
    position: Int32,
    half: Int32,
    interleaved: Int32,
    tidx: Int32,
    head_dim: cutlass.Constexpr,
    threads: cutlass.Constexpr,
):
    """``dst[h, :]`` = ``src[h, :]`` rotated at ``position`` on its first 2 * ``half`` columns, for
    rows h < ``rows`` (``src``, ``dst``: (heads, head_dim) views; ``cos``, ``sin``: (seqlen_ro,
    half)); ``half`` 0 copies. The CTA's threads take the (row, pair) items in turn."""
    pairs = head_dim // 2
    for i in cutlass.range(tidx, rows * pairs, threads, unroll=1):
        h = i // pairs
        p = i - h * pairs
        c1, c2 = pair_columns(p, half, interleaved)
        if p < half:
            x1 = Float32(src[h, c1])
            x2 = Float32(src[h, c2])
            c = Float32(cos[position, p])
            s = Float32(sin[position, p])
            dst[h, c1] = dst.element_type(x1 * c - x2 * s)
            dst[h, c2] = dst.element_type(x1 * s + x2 * c)
        else:
            dst[h, c1] = src[h, c1]
            dst[h, c2] = src[h, c2]


@cute.jit
def clamp_position(position: Int32, seqlen_ro: Int32) -> Int32:
    """A rotary position inside [0, seqlen_ro) (0 when there is no table)."""
    return cutlass.max(cutlass.min(position, seqlen_ro - 1), 0)
