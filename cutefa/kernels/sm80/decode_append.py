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

An e4m3 cache (the ``kv_e4m3`` option, sm_89 and newer: :func:`quantize_row_pairs`): each new key
(rotated as above, then rounded to its 16-bit dtype) and value is divided by its (batch, kv head)
descale and rounded to nearest even e4m3, saturating to +-448 (NaN stays NaN): the bytes torch's
``(x.float() / descale).clamp(-448, 448).to(torch.float8_e4m3fn)`` gives. The rotation's products
and sums are rounded one by one (never fused into an fma), in torch's order, so that the bytes are
those of the torch reference bit for bit. The descales are fixed: a token outside their range
saturates.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cutlass_dsl import T, dsl_user_op

from cutefa.kernels.common.ptx import pure_asm

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


@dsl_user_op
def _products(a: Float32, b: Float32, c: Float32, d: Float32, add: bool, *, loc=None, ip=None) -> Float32:
    """``a * b - c * d`` (or ``+`` with ``add``), each product and the sum rounded on its own
    (``mul.rn``/``sub.rn`` are never contracted into an fma): torch's float32 result bit for bit."""
    op = "add" if add else "sub"
    return Float32(
        pure_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
            f"{{\n.reg .f32 p, q;\nmul.rn.f32 p, $1, $2;\nmul.rn.f32 q, $3, $4;\n{op}.rn.f32 $0, p, q;\n}}",
            "=f,f,f,f,f",
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def _e4m3_pair(x1: Float32, x2: Float32, descale: Float32, *, loc=None, ip=None) -> Int32:
    """``x1 / descale`` and ``x2 / descale`` (IEEE division) as e4m3 bytes, rounded to nearest even
    and saturated to +-448, NaN kept (``cvt.rn.satfinite.e4m3x2.f32``, sm_89 and newer): ``x1`` in
    the lowest byte, ``x2`` in the next, 0 above."""
    return Int32(
        pure_asm(
            T.i32(),
            [Float32(x).ir_value(loc=loc, ip=ip) for x in (x1, x2, descale)],
            "{\n.reg .f32 a, b;\n.reg .b16 h;\ndiv.rn.f32 a, $1, $3;\ndiv.rn.f32 b, $2, $3;\n"
            "cvt.rn.satfinite.e4m3x2.f32 h, b, a;\ncvt.u32.u16 $0, h;\n}",
            "=r,f,f,f",
            loc=loc,
            ip=ip,
        )
    )


@cute.jit
def quantize_row_pairs(
    src: cute.Tensor,
    dst: cute.Tensor,
    cos: cute.Tensor,
    sin: cute.Tensor,
    descale: cute.Tensor,
    rows: Int32,
    position: Int32,
    half: Int32,
    interleaved: Int32,
    tidx: Int32,
    head_dim: cutlass.Constexpr,
    threads: cutlass.Constexpr,
):
    """As :func:`rope_row_pairs` into an e4m3 ``dst`` (heads, head_dim): a rotated pair rounded to
    ``src``'s dtype first, then every value divided by ``descale[h]`` (``descale``: (heads,)
    float32) and stored as e4m3 (:func:`_e4m3_pair`)."""
    dst8 = cute.make_tensor(cute.recast_ptr(dst.iterator, dtype=cutlass.Uint8), dst.layout)
    pairs = head_dim // 2
    for i in cutlass.range(tidx, rows * pairs, threads, unroll=1):
        h = i // pairs
        p = i - h * pairs
        c1, c2 = pair_columns(p, half, interleaved)
        x1 = Float32(src[h, c1])
        x2 = Float32(src[h, c2])
        if p < half:
            c = Float32(cos[position, p])
            s = Float32(sin[position, p])
            y1 = _products(x1, c, x2, s, False)
            y2 = _products(x1, s, x2, c, True)
            x1 = Float32(src.element_type(y1))
            x2 = Float32(src.element_type(y2))
        word = _e4m3_pair(x1, x2, Float32(descale[h]))
        dst8[h, c1] = cutlass.Uint8(word & 0xFF)
        dst8[h, c2] = cutlass.Uint8(word >> 8)
