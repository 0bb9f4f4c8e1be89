"""Building blocks of the sm80-family (FlashAttention-2 design) backward kernels.

The backward runs three kernels: a preprocess over query rows (D = rowsum(dO * O) - dLSE, the LSE
in log2 units, the fp32 dQ accumulator cleared), the main kernel over key blocks (P recomputed from
Q, K and the LSE; dK and dV accumulated in registers; dQ added into the fp32 accumulator), and a
postprocess over query rows (dQ = softmax_scale * sum of the accumulator's splits, in the input
dtype). The row kernels use one warp per query row, each lane owning the columns lane + 32 * j.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector
from cutlass.cute.nvgpu import warp
from cutlass.cutlass_dsl import T, dsl_user_op

from cutefa.kernels.common.ptx import effect_asm
from cutefa.kernels.common.reduce import red_add_pairs
from cutefa.kernels.common.softmax import LOG2_E
from cutefa.kernels.common.target import sm90_or_newer


def tiled_mma(dtype, warps_m: int, warps_n: int):
    """mma.sync m16n8k16 with a (warps_m, warps_n) warp grid; every warp owns 16-row slabs and
    16-column pairs of n8 atoms, so that one ldmatrix.x4 feeds two n8 atoms of B."""
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)),
        (warps_m, warps_n, 1),
        permutation_mnk=(warps_m * 16, warps_n * 16, 16),
    )


def warp_grid(rows: int, cols: int, warps: int) -> tuple[int, int]:
    """Warp grid of a (rows, cols) GEMM output: (warps/2, 2), or (2, warps/2) where that is valid
    (16-row and 16-column slabs per warp) and each warp then reads fewer operand rows and columns
    from shared memory (rows / 2 + cols / (warps/2) < rows / (warps/2) + cols / 2): per k-step a
    warp loads its A rows and its B columns, so squarer warp tiles read less."""
    tall, wide = (warps // 2, 2), (2, warps // 2)
    if rows % (16 * wide[0]) or cols % (16 * wide[1]):
        return tall
    if rows // wide[0] + cols // wide[1] < rows // tall[0] + cols // tall[1]:
        return wide
    return tall


def ldmatrix_copies(dtype, mma):
    """ldmatrix tiled copies (A, A transposed, B, B transposed) for ``mma``.

    The transposed ones read operands whose M (or N) mode is the contiguous one in shared memory:
    P^T, dS^T as A of dV/dK; dO^T, Q^T, K^T as B of dV/dK/dQ."""
    ld = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    ld_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), dtype)
    return (
        cute.make_tiled_copy_A(ld, mma),
        cute.make_tiled_copy_A(ld_t, mma),
        cute.make_tiled_copy_B(ld, mma),
        cute.make_tiled_copy_B(ld_t, mma),
    )


def transposed(s: cute.Tensor, rows: int, cols: int) -> cute.Tensor:
    """A (cols, rows) view of a (rows, cols) shared-memory tensor."""
    return cute.composition(s, cute.make_layout((cols, rows), stride=(rows, 1)))


@cute.jit
def warp_allreduce_sum(val: Float32) -> Float32:
    for i in cutlass.range_constexpr(5):
        val = val + cute.arch.shuffle_sync_bfly(val, offset=16 >> i)
    return val


@cute.jit
def preprocess_row(
    mO: cute.Tensor,
    mdO: cute.Tensor,
    mLSE: cute.Tensor,
    mdLSE: cute.Tensor,
    mLSE2: cute.Tensor,
    mDpsum: cute.Tensor,
    mdQaccum: cute.Tensor,
    batch: Int32,
    head: Int32,
    row: Int32,
    lane: Int32,
    head_dim: cutlass.Constexpr,
    zero_accum: cutlass.Constexpr = True,
):
    """One query row, one warp: D = rowsum(dO * O) - dLSE, LSE * log2(e) (+inf for a row that
    attends no key, so that its probabilities recompute to 0), and the row of every dQ split zeroed
    (``zero_accum``; a workspace of another layout, zeroed by the caller, passes False)."""
    acc = Float32(0.0)
    for j in cutlass.range_constexpr(head_dim // 32):
        col = lane + 32 * j
        acc = acc + Float32(mdO[batch, row, head, col]) * Float32(mO[batch, row, head, col])
    if cutlass.const_expr(head_dim % 32):
        # a padded head dim (not a multiple of 32): the lanes of the last partial span
        col = lane + 32 * (head_dim // 32)
        if col < head_dim:
            acc = acc + Float32(mdO[batch, row, head, col]) * Float32(mO[batch, row, head, col])
    acc = warp_allreduce_sum(acc)
    if lane == 0:
        lse = mLSE[batch, head, row]
        mDpsum[batch, head, row] = acc - mdLSE[batch, head, row]
        mLSE2[batch, head, row] = Float32.inf if lse == -Float32.inf else lse * LOG2_E
    if cutlass.const_expr(zero_accum):
        zero_accum_row(mdQaccum, batch, head, row, lane, head_dim)


@cute.jit
def zero_accum_row(
    mdQaccum: cute.Tensor, batch: Int32, head: Int32, row: Int32, lane: Int32, head_dim: cutlass.Constexpr
):
    """One query row, one warp: the row of every split of the (splits, batch, seqlen_q, heads,
    head_dim) dQ accumulator zeroed."""
    for s in cutlass.range(cute.size(mdQaccum, mode=[0]), unroll=1):
        for j in cutlass.range_constexpr(head_dim // 32):
            mdQaccum[s, batch, row, head, lane + 32 * j] = Float32(0.0)


@cute.jit
def postprocess_row(
    mdQaccum: cute.Tensor,
    mdQ: cute.Tensor,
    scale: Float32,
    batch: Int32,
    head: Int32,
    row: Int32,
    lane: Int32,
    head_dim: cutlass.Constexpr,
    dtype: cutlass.Constexpr,
    quad_warps_n: cutlass.Constexpr = 0,
):
    """One query row, one warp: dQ = scale * (sum of the splits, in split order), in ``dtype``.
    ``quad_warps_n`` > 0: the accumulator's columns are permuted as :func:`quad_column` says for a
    dQ warp grid of that many warps along the columns."""
    for j in cutlass.range_constexpr(head_dim // 32):
        col = lane + 32 * j
        src = col
        if cutlass.const_expr(quad_warps_n > 0):
            src = quad_column(col, quad_warps_n)
        acc = Float32(0.0)
        for s in cutlass.range(cute.size(mdQaccum, mode=[0]), unroll=1):
            acc = acc + mdQaccum[s, batch, row, head, src]
        mdQ[batch, row, head, col] = dtype(acc * scale)


def quad_column(col, warps_n: int):
    """Where column ``col`` of dQ lives in the column-permuted (``dq_quad``) accumulator of a dQ
    GEMM whose warp grid has ``warps_n`` warps along the columns. :func:`tiled_mma` gives warp w
    the n8 atoms w and w + warps_n of each 16 * warps_n columns (span), and lane quad q of a warp
    columns 2q, 2q + 1 of each atom: the column span * blk + 8 * (warps_n * h + w) + 2q + e moves to
    span * blk + 16w + 4q + 2h + e, so that a thread's four values of one row in one span (two per
    atom) are adjacent and 16-byte aligned, and a warp's sixteen per row fill 64 contiguous bytes."""
    span = 16 * warps_n
    within = col % span
    atom = within // 8
    return (col - within) + 16 * (atom % warps_n) + 4 * ((within % 8) // 2) + 2 * (atom // warps_n) + col % 2


def quad_groups(coords0: cute.Tensor, warps_n: int) -> list[tuple[int, int, int, int]]:
    """Indices (a, b, c, d) of an mma.sync accumulator fragment of :func:`tiled_mma` (``warps_n``
    warps along the columns) at one row's columns x, x + 1 (first atom), x + 8 * warps_n,
    x + 8 * warps_n + 1 (second atom), from ``coords0``, thread 0's (static) tile coordinates:
    every thread's fragment has the same structure, offset by multiples of 8 rows and by its warp's
    and lane quad's 8w + 2q columns. Raises ValueError if the fragment is not so structured."""
    span = 16 * warps_n
    where = {}
    for i in range(cute.size(coords0)):
        r, c = coords0[i]
        where[(int(r), int(c))] = i
    groups = []
    for (r, c), i in sorted(where.items(), key=lambda kv: kv[1]):
        if c % span == 0:
            try:
                groups.append((i, where[(r, c + 1)], where[(r, c + span // 2)], where[(r, c + span // 2 + 1)]))
            except KeyError as e:
                raise ValueError(f"accumulator fragment without the column quad of ({r}, {c}): {sorted(where)}") from e
    if 4 * len(groups) != cute.size(coords0):
        raise ValueError(f"{4 * len(groups)} of {cute.size(coords0)} accumulator elements grouped in column quads")
    return groups


@cute.jit
def red_add_quads(
    acc: cute.Tensor,
    coords: cute.Tensor,
    groups: cutlass.Constexpr,
    span: cutlass.Constexpr,
    gdst: cute.Tensor,
    row_limit: Int32,
    tile_rows: cutlass.Constexpr,
):
    """gdst += acc for rows below ``row_limit`` into the column-permuted accumulator
    (:func:`quad_column`), four columns per 16-byte vector reduction (red.global.add.v4.f32,
    sm_90 and newer): a quarter of the element-wise reductions, and a warp's reduction covers 64
    contiguous bytes of each of its 8 rows.

    ``acc`` is an mma.sync accumulator fragment of :func:`tiled_mma`, ``coords`` its tile-local
    (row, col), ``groups`` its column quads (:func:`quad_groups`) and ``span`` 16 * warps_n;
    ``gdst`` the thread's partition of the fp32 destination in its natural layout (the permuted
    address of a quad is the natural address of its first element plus 8w + 2q, that element's
    column modulo ``span``), rows contiguous, 16-byte aligned base, strides multiples of 4.
    ``tile_rows``: all rows of the tile below ``row_limit`` sends every reduction unpredicated."""
    quad_type = ir.VectorType.get([4], Float32.mlir_type)
    # 8w + 2q: the permuted column of a quad is its first natural column plus this.
    shift = coords[groups[0][0]][1] % span
    # The shift moves the base once; each quad's address is then the base plus its natural offset.
    gq = cute.make_tensor(gdst.iterator + shift, gdst.layout)
    if row_limit >= tile_rows:
        for g in cutlass.range_constexpr(len(groups)):
            a, b, c, d = groups[g]
            quad = vector.from_elements(quad_type, [acc[a].ir_value(), acc[b].ir_value(), acc[c].ir_value(), acc[d].ir_value()])
            cute.arch.red(
                gq.iterator + cute.crd2idx(a, gq.layout), quad, op="add", dtype=Float32, sem="relaxed", scope="gpu",
            )  # fmt: skip
    else:
        for g in cutlass.range_constexpr(len(groups)):
            a, b, c, d = groups[g]
            if coords[a][0] < row_limit:
                quad = vector.from_elements(
                    quad_type, [acc[a].ir_value(), acc[b].ir_value(), acc[c].ir_value(), acc[d].ir_value()]
                )
                cute.arch.red(
                    gq.iterator + cute.crd2idx(a, gq.layout), quad, op="add", dtype=Float32, sem="relaxed",
                    scope="gpu",
                )  # fmt: skip


@cute.jit
def load_row_values(
    dst: cute.Tensor, src: cute.Tensor, c_mn: cute.Tensor, row0: Int32, seqlen_q: Int32, fill: Float32
):
    """dst[r] = src[row0 + row of r] for each accumulator row r of this thread (``c_mn`` holds the
    tile-local coordinates), ``fill`` for rows past ``seqlen_q``. ``src`` is one (batch, head)'s
    per-row vector."""
    for r in cutlass.range_constexpr(cute.size(dst)):
        row = row0 + c_mn[r, 0][0]
        dst[r] = fill
        if row < seqlen_q:
            dst[r] = src[row]


@cute.jit
def recompute_p(s_mn: cute.Tensor, lse2: cute.Tensor, scale_log2: Float32):
    """Scores -> probabilities in place: P = exp2(S * scale * log2(e) - LSE * log2(e))."""
    for r in cutlass.range_constexpr(cute.size(lse2)):
        row = s_mn[r, None].load()
        s_mn[r, None].store(cute.math.exp2(row * scale_log2 - lse2[r], fastmath=True))


@dsl_user_op
def _pinned_word(word: Int32, *, loc=None, ip=None) -> Int32:
    """``word`` through a ``mov.b32`` with side effects: computed before this point, once."""
    return Int32(effect_asm(T.i32(), [Int32(word).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r", loc=loc, ip=ip))


@cute.jit
def pin_words(t: cute.Tensor):
    """Every 32-bit word of the 16-bit register tensor ``t`` pinned where this is called, so that
    the conversion that filled ``t`` stays one packed conversion per word (F2FP) and every later
    reader uses these words. Without it the compiler converts again where a value is read in another
    branch (the sm90 backward's WGMMA register operand), or, where the 16-bit values are also read
    one by one (the sm80 backward's P, read back for dS), converts each value alone (F2F, on the
    same quarter-rate pipe as the exponentials) and packs the pairs with PRMT."""
    words = cute.make_tensor(cute.recast_ptr(t.iterator, dtype=Int32), cute.make_layout(cute.size(t) // 2))
    for i in cutlass.range_constexpr(cute.size(t) // 2):
        words[i] = _pinned_word(words[i])


@cute.jit
def compute_ds(p_mn: cute.Tensor, dp_mn: cute.Tensor, dpsum: cute.Tensor):
    """dP -> dS in place: dS = P * (dP - D), D per row (the softmax scale is applied later)."""
    for r in cutlass.range_constexpr(cute.size(dpsum)):
        dp_mn[r, None].store(p_mn[r, None].load().to(Float32) * (dp_mn[r, None].load() - dpsum[r]))


@cute.jit
def atomic_add_rows(acc: cute.Tensor, coords: cute.Tensor, gdst: cute.Tensor, row_limit: Int32):
    """gdst += acc with fp32 reductions (RED.ADD.F32), element by element, rows < ``row_limit``.

    ``gdst`` is the thread's partition of the destination tile (the same shape as ``acc``) and
    ``coords`` the tile-local (row, col) of each element."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        if coords[i][0] < row_limit:
            cute.arch.red(
                (gdst.iterator + cute.crd2idx(i, gdst.layout)),
                acc[i],
                op="add",
                dtype=Float32,
                sem="relaxed",
                scope="gpu",
            )


def vector_red_supported() -> bool:
    """Whether the target being compiled for has red.global.add.v2.f32 (sm_90 and newer; the sm80
    family also compiles for sm_80, sm_86 and sm_89, which have element-wise fp32 reductions only)."""
    return sm90_or_newer()


def quad_layout() -> bool:
    """Whether a ``dq_quad`` variant uses the column-permuted accumulator on the target being
    compiled for (sm_90 and newer: the 16-byte reductions); chosen while tracing, the same for the
    main kernel and the postprocess of one compile."""
    return vector_red_supported()


def add_rows(acc: cute.Tensor, coords: cute.Tensor, gdst: cute.Tensor, row_limit: Int32, tile_rows: int = 0):
    """gdst += acc (rows below ``row_limit``) with the widest fp32 reductions the target has:
    :func:`red_add_pairs` on sm_90 and newer (unpredicated when all ``tile_rows`` rows of the tile
    are in range), :func:`atomic_add_rows` before. Chosen while tracing."""
    if vector_red_supported():
        red_add_pairs(acc, coords, gdst, row_limit, tile_rows)
    else:
        atomic_add_rows(acc, coords, gdst, row_limit)


# CTAs per wave on an H100/H200 SXM (one per SM): the causal launch order's chunk (a hint only: the
# order is a bijection for any value).
WAVE_CTAS = 132


@cute.jit
def heavy_first(
    bx: Int32,
    head: Int32,
    batch: Int32,
    n_blocks: Int32,
    heads: Int32,
    batches: Int32,
    wave: cutlass.Constexpr,
):
    """Causal launch order (one key block per CTA): (n_block, head, batch) of the CTA with grid
    coordinates (bx, head, batch), grid (n_blocks, heads, batches), so that the CTAs, in launch
    order, go through chunks of g = max(wave // n_blocks, 1) (batch, head) pairs (about one wave of
    ``wave`` CTAs) and within a chunk by key block, all pairs' block 0 first: with the bottom-right
    diagonal key block n sees the fewest query blocks for the largest n, so each chunk starts its
    longest CTAs first and the grid ends on short ones (the grid's own order, key blocks fastest,
    leaves a long CTA of each pair for the last wave). A bijection of [0, n_blocks * heads * batches)."""
    pairs = heads * batches
    g = cutlass.max(Int32(wave) // n_blocks, Int32(1))
    linear = bx + n_blocks * (head + heads * batch)
    chunk = linear // (g * n_blocks)
    within = linear - chunk * g * n_blocks
    size = cutlass.min(g, pairs - chunk * g)
    n_block = within // size
    pair = chunk * g + within - n_block * size
    return n_block, pair % heads, pair // heads


@cute.jit
def causal_launch_coords(deterministic: Int32):
    """(key block, head, batch, grid_x) of this CTA in a causal backward's grid (key blocks, heads,
    batches). deterministic=0 (one key block per CTA): :func:`heavy_first`'s order, the longest CTAs
    (first key blocks) of a wave of (batch, head) pairs launch first and the grid ends on short ones;
    deterministic=1: the grid's own coordinates (CTA x walks the key blocks x, x + grid_x, ...)."""
    bx, head, batch = cute.arch.block_idx()
    grid_x, n_heads, n_batch = cute.arch.grid_dim()
    if deterministic == 0:
        bx, head, batch = heavy_first(bx, head, batch, grid_x, n_heads, n_batch, WAVE_CTAS)
    return bx, head, batch, grid_x
