"""Score modifiers on accumulator fragments: softcap, the ALiBi bias, and attention sinks in the
softmax's finalize (every family: any fp32 accumulator fragment viewed as (rows, cols), with its
coordinates from a partitioned identity tensor in the same view).

Units. The online softmax (:mod:`cutefa.kernels.common.softmax`) takes exp2 of ``s * scale_log2``:
a fragment holds scores in units of ``score / unit``. Without softcap the fragment holds the raw
q.k and the unit is ``softmax_scale`` (scale_log2 = softmax_scale * log2(e)); after
:func:`apply_softcap` it holds t = tanh(softmax_scale * q.k / c) and the unit is the cap ``c``
(scale_log2 = :func:`softcap_scale_log2`\\ (c)). A bias in natural-log units (ALiBi) is added to
the fragment divided by its unit. The order is softcap, then ALiBi, then the mask (tanh of a masked
-inf would be -1).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32
from cutlass.cutlass_dsl import T, dsl_user_op

from cutefa.kernels.common.ptx import pure_asm
from cutefa.kernels.common.softmax import LN_2, LOG2_E, quad_allreduce_sum

# ---------------------------------------------------------------------------------------------
# Softcap: score = c * tanh(softmax_scale * q.k / c)


@dsl_user_op
def tanh_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """``tanh.approx.f32`` (MUFU.TANH, sm_75 and newer): relative error about 2**-11; tanh of +-inf
    is +-1."""
    return Float32(
        pure_asm(
            T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "tanh.approx.f32 $0, $1;", "=f,f", loc=loc, ip=ip
        )
    )


def softcap_pre_scale(softmax_scale, softcap):
    """What :func:`apply_softcap` multiplies the raw q.k by before the tanh: softmax_scale / c."""
    return softmax_scale / softcap


def softcap_scale_log2(softcap):
    """The online softmax's exp2 scale once the fragment holds t = tanh(...): c * log2(e) (the
    natural-log score is c * t)."""
    return softcap * LOG2_E


@cute.jit
def apply_softcap(s_mn: cute.Tensor, pre_scale: Float32, dtanh: cute.Tensor = None):
    """Raw scores -> t = tanh(s * ``pre_scale``) in place (``pre_scale`` from
    :func:`softcap_pre_scale`; the fragment's unit becomes the cap c, see the module docs).

    ``s_mn``: any (rows, cols) view of an fp32 accumulator fragment. ``dtanh`` (backward, optional):
    an fp32 register tensor of the same (rows, cols) shape that receives 1 - t**2, the factor
    :func:`softcap_grad` applies to dS. Call it before the ALiBi bias and the mask."""
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            t = tanh_approx(s_mn[r, c] * pre_scale)
            s_mn[r, c] = t
            if cutlass.const_expr(dtanh is not None):
                dtanh[r, c] = 1.0 - t * t


@cute.jit
def softcap_dtanh(t_frag: cute.Tensor, dtype: cutlass.Constexpr = Float16) -> cute.Tensor:
    """A new register tensor like ``t_frag`` (any fp32 accumulator fragment holding t, after
    :func:`apply_softcap`) of ``dtype`` holding 1 - t**2, element by element in the fragment's own
    order (packed conversions). fp16 (the default) halves the registers of an fp32 copy; its
    rounding (2**-11 relative) is below that of the 16-bit dS it scales."""
    dtanh = cute.make_fragment_like(t_frag, dtype)
    t = t_frag.load()
    dtanh.store((1.0 - t * t).to(dtype))
    return dtanh


@cute.jit
def softcap_p_dtanh(p: cute.Tensor, dtanh: cute.Tensor, dtype: cutlass.Constexpr) -> cute.Tensor:
    """A new register tensor like ``p`` (fp32 probabilities of an accumulator fragment) of
    ``dtype`` holding P * (1 - t**2) (``dtanh`` from :func:`softcap_dtanh`, the same fragment): the
    backward's dS = P (dP - D) then comes out with the softcap's factor, dS = that (dP - D), with no
    1 - t**2 live across the dP GEMM (only this 16-bit tensor, in place of the 16-bit P)."""
    out = cute.make_fragment_like(p, dtype)
    out.store((p.load() * dtanh.load().to(Float32)).to(dtype))
    return out


@cute.jit
def softcap_grad(ds: cute.Tensor, dtanh: cute.Tensor):
    """dS of the capped score -> dS of the scaled score, in place: ``ds *= dtanh`` (1 - t**2, from
    :func:`apply_softcap` or :func:`softcap_dtanh`); ``softmax_scale`` is applied where the kernel
    applies it without softcap. ``ds`` fp32, ``dtanh`` fp32 or 16-bit, both the same fragment (or
    the same view of it)."""
    ds.store(ds.load() * dtanh.load().to(Float32))


# ---------------------------------------------------------------------------------------------
# ALiBi: score += -slope * |i + seqlen_k - seqlen_q - j|


@cute.jit
def apply_alibi(
    s_mn: cute.Tensor,
    c_mn: cute.Tensor,
    row_base: Int32,
    col_base: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    slope: Float32,
    c0_mn: cute.Tensor = None,
):
    """Add -``slope`` * |i + seqlen_k - seqlen_q - j| to every score (query row i, key j, both
    within the sequence; the bottom-right alignment).

    ``s_mn``: a (rows, cols) view of an fp32 accumulator fragment; ``c_mn`` the same view of its
    tile-local (row, col) coordinates (a row coordinate depends on the row index only and a column
    coordinate on the column index only); ``row_base``/``col_base``: the sequence coordinates of the
    tile origin. ``slope``: the head's slope divided by the fragment's unit (softmax_scale for raw
    q.k, the cap c after :func:`apply_softcap`; see the module docs). ``c0_mn`` (optional): the same
    view for thread 0 of the MMA (compile-time constants): the distances are then one float per row
    minus a constant per column. Distances are exact below 2**24. Call it before the mask (masked
    scores stay -inf)."""
    rows = cute.size(s_mn, mode=[0])
    cols = cute.size(s_mn, mode=[1])
    diag = row_base + seqlen_k - seqlen_q - col_base  # a row's distance from tile column 0, less its row
    if cutlass.const_expr(c0_mn is None):
        for r in cutlass.range_constexpr(rows):
            d_row = diag + c_mn[r, 0][0]
            for c in cutlass.range_constexpr(cols):
                dist = Float32(d_row - c_mn[0, c][1])
                s_mn[r, c] = s_mn[r, c] - slope * cute.math.absf(dist)
    else:
        d0 = alibi_distance0(c_mn, c0_mn, row_base, seqlen_q, seqlen_k) - Float32(col_base)
        apply_alibi_from(s_mn, c0_mn, d0, slope)


def alibi_distance0(c_mn, c0_mn, row_base, seqlen_q, seqlen_k):
    """What :func:`apply_alibi_from` takes for the tile of query rows at ``row_base`` and keys from
    column 0 (subtract a block's first key for that block): i + seqlen_k - seqlen_q - j of this
    thread's first row i and thread 0's column 0 j, shifted by this thread's column offset, as a
    float (``c_mn``/``c0_mn`` as in :func:`apply_alibi`). Loop-invariant over the key blocks."""
    col_shift = c_mn[0, 0][1] - c0_mn[0, 0][1]
    return Float32(row_base + c_mn[0, 0][0] + seqlen_k - seqlen_q - col_shift)


@cute.jit
def apply_alibi_from(s_mn: cute.Tensor, c0_mn: cute.Tensor, d0: Float32, slope: Float32):
    """:func:`apply_alibi` from a precomputed distance (:func:`alibi_distance0`, less the block's
    first key): the score of row r, column c loses ``slope`` * |d0 + dr - c0|, dr the row's offset
    from the thread's first row and c0 thread 0's column (both compile-time constants)."""
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        d_row = d0 + Float32(c0_mn[r, 0][0] - c0_mn[0, 0][0])
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            dist = d_row - Float32(c0_mn[0, c][1])
            s_mn[r, c] = s_mn[r, c] - slope * cute.math.absf(dist)


# ---------------------------------------------------------------------------------------------
# Sinks: one extra logit per head in each row's softmax denominator


@cute.jit
def sink_row_terms(total: Float32, max_log2: Float32, sink: Float32):
    """A row's output factor and natural-log LSE with the sink's logit in the denominator.

    ``total``: the row's (quad-reduced) sum of exp2(s * scale_log2 - max_log2); ``max_log2``: its
    running max times scale_log2 (-inf for a row that saw no key); ``sink``: the head's sink logit
    (natural-log units, as the scores). Returns (factor, lse): O (accumulated against max_log2) times
    factor is the normalised output, lse = log(exp(sink) + sum exp(s)). A row with no key gets
    factor 0 and lse = sink; a sink of -inf is no sink (a row with neither: 0 and -inf)."""
    sink_log2 = sink * LOG2_E
    top = cute.arch.fmax(max_log2, sink_log2)
    factor = Float32(0.0)
    lse = -Float32.inf
    if top != -Float32.inf:
        kept = cute.math.exp2(max_log2 - top, fastmath=True)  # 0 for a row with no key
        denom = total * kept + cute.math.exp2(sink_log2 - top, fastmath=True)
        factor = kept * cute.arch.rcp_approx(denom)
        lse = (top + cute.math.log2(denom, fastmath=True)) * LN_2
    return factor, lse


@cute.jit
def softmax_finalize_sinks(
    o_mn: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    scale_log2: Float32,
    lse: cute.Tensor,
    sink: Float32,
):
    """:func:`cutefa.kernels.common.softmax.softmax_finalize` with the head's sink logit ``sink``
    (natural-log units) in every row's denominator: normalise ``o_mn`` (rows x head_dim view) and
    write each row's natural-log LSE to ``lse``. ``row_sum`` holds each thread's partial sums (the
    quad reduction happens here), ``row_max`` the running max in score units (times ``scale_log2``
    in exp2 units). A row with no key gets O = 0 and LSE = ``sink``."""
    for r in cutlass.range_constexpr(cute.size(row_max)):
        total = quad_allreduce_sum(row_sum[r])
        max_log2 = row_max[r] * scale_log2
        if row_max[r] == -Float32.inf:
            max_log2 = -Float32.inf
        factor, row_lse = sink_row_terms(total, max_log2, sink)
        o_mn[r, None].store(o_mn[r, None].load() * factor)
        lse[r] = row_lse
