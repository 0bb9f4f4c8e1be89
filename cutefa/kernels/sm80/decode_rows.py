"""The packed query rows of the sm80 decode kernel (templates/decode_sm80.py.j2): grouped-query
heads and new tokens in one tile, so that each K/V byte of a kv head is read once.

A CTA of kv head ``h`` owns rows of the packed problem of that head: packed row ``r`` is query token
``t = r // group`` of query head ``h * group + r % group`` (``group = heads_q // heads_kv``), so
``group * seqlen_q`` rows in all. Q is gathered into shared memory row by row, and the output rows
are scattered back the same way; the band of keys a row attends depends on its token only.

Key bands (bottom-right aligned, ``sq``/``sk`` the sequence's query and key lengths): token ``t``
attends keys ``lo <= j < hi`` with ``lo = max(0, t + sk - sq - window_left)`` and
``hi = min(sk, t + sk - sq + window_right + 1)``; no mask is ``window_left = window_right =``
UNBOUNDED, causal is ``window_right = 0``. Both bounds grow with ``t``, so a CTA's first and last
tokens bound the key blocks it visits.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector
from cutlass.cute.nvgpu import cpasync

COPY_BITS = 128


def g2s_tiled_copy(dtype, threads: int, threads_per_row: int):
    """cp.async (bypassing L1) tiled copy of 16 bytes per thread and step, ``threads_per_row``
    threads side by side on a row (cutefa.model.policy_decode.copy_threads_per_row): with 2, a pair
    reads one full 32-byte sector and a thread's chunks of a row are one address plus constants, so
    a small CTA keeps few row addresses live (the prefill's 8 threads per 128 bytes would give a
    one-warp CTA 16 rows a thread)."""
    atom = cute.make_copy_atom(
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype, num_bits_per_copy=COPY_BITS
    )
    thr = cute.make_layout((threads // threads_per_row, threads_per_row), stride=(threads_per_row, 1))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, COPY_BITS // dtype.width)))


def token_band(t: Int32, seqlen_q: Int32, seqlen_k: Int32, window_left: Int32, window_right: Int32):
    """(lo, hi): token ``t`` attends keys ``lo <= j < hi`` (``hi <= lo``: none), clipped to
    [0, seqlen_k]. Int32 arithmetic: window bounds up to 1 << 30 with lengths below 2**29."""
    shift = t + seqlen_k - seqlen_q
    lo = cutlass.max(shift - window_left, 0)
    hi = cutlass.min(shift + window_right + 1, seqlen_k)
    return lo, hi


def key_blocks(t_first, t_last, tile_n: int, seqlen_q, seqlen_k, window_left, window_right):
    """The key blocks of ``tile_n`` keys that tokens [t_first, t_last] visit: (n_first, n_last,
    u_first, u_last) with n_first <= u_first <= u_last <= n_last; blocks [n_first, n_last) hold a key
    of some token's band, [u_first, u_last) lie inside every token's band (no per-element mask)."""
    lo_first, hi_first = token_band(t_first, seqlen_q, seqlen_k, window_left, window_right)
    lo_last, hi_last = token_band(t_last, seqlen_q, seqlen_k, window_left, window_right)
    n_last = cutlass.max(hi_last + tile_n - 1, 0) // tile_n
    n_first = cutlass.min(lo_first // tile_n, n_last)
    u_first = cutlass.min(cutlass.max((lo_last + tile_n - 1) // tile_n, n_first), n_last)
    u_last = cutlass.max(cutlass.min(cutlass.max(hi_first, 0) // tile_n, n_last), u_first)
    return n_first, n_last, u_first, u_last


def split_blocks(n_first, n_last, split, num_splits):
    """Split ``split`` of ``num_splits`` takes blocks [lo, hi) of [n_first, n_last): contiguous ranges
    whose sizes differ by at most one, in order."""
    total = n_last - n_first
    return n_first + split * total // num_splits, n_first + (split + 1) * total // num_splits


@cute.jit
def row_bands(
    c_mn: cute.Tensor,
    row0: Int32,
    group: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    lo: cute.Tensor,
    hi: cute.Tensor,
):
    """Each of this thread's fragment rows (``c_mn``: the (rows, cols) view of the accumulator's
    tile coordinates): its token's band into ``lo[r]``, ``hi[r]`` (Int32 register tensors)."""
    for r in cutlass.range_constexpr(cute.size(lo)):
        t = (row0 + c_mn[r, 0][0]) // group
        row_lo, row_hi = token_band(t, seqlen_q, seqlen_k, window_left, window_right)
        lo[r] = row_lo
        hi[r] = row_hi


@cute.jit
def apply_band_mask(s_mn: cute.Tensor, c_mn: cute.Tensor, c0_mn: cute.Tensor, col_base: Int32, lo, hi):
    """Set to -inf every score of ``s_mn`` (the (rows, cols) view of an fp32 accumulator) whose key
    lies outside its row's band [lo[r], hi[r]) (from :func:`row_bands`). ``c_mn``/``c0_mn``: the same
    view of this thread's and thread 0's tile coordinates (thread 0's are compile-time constants, so
    each row's bounds move by the thread's column offset once); ``col_base``: the block's first key."""
    shift = col_base + (c_mn[0, 0][1] - c0_mn[0, 0][1])
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        row_lo = lo[r] - shift
        row_hi = hi[r] - shift
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            col = c0_mn[0, c][1]
            s_mn[r, c] = Float32(cutlass.select_((col >= row_lo) & (col < row_hi), s_mn[r, c], -Float32.inf))


def _chunk(row: cute.Tensor, col: Int32, layout) -> cute.Tensor:
    """The 16 bytes of global row ``row`` (a 1-D tensor, 16-byte aligned rows) at column ``col`` (a
    multiple of 8 elements), as a tensor of ``layout``."""
    ptr = cute.make_ptr(
        row.element_type, (row.iterator + col).toint(), cute.AddressSpace.gmem, assumed_align=16
    )
    return cute.make_tensor(ptr, layout)


@cute.jit
def copy_row(
    g2s: cute.TiledCopy, row: cute.Tensor, dst: cute.Tensor, coords: cute.Tensor, m: cutlass.Constexpr
):
    """cp.async this thread's chunks of global row ``row`` (1-D, contiguous) into row ``m`` of its
    (CPY, ROWS, COLS) shared-memory partition ``dst``; ``coords``: the partition's tile coordinates."""
    for k in cutlass.range_constexpr(cute.size(dst, mode=[2])):
        piece = dst[None, m, k]
        cute.copy(g2s, _chunk(row, coords[0, m, k][1], piece.layout), piece)


@cute.jit
def load_q_rows(
    g2s: cute.TiledCopy,
    mQ: cute.Tensor,
    dst: cute.Tensor,
    coords: cute.Tensor,
    batch: Int32,
    head_kv: Int32,
    group: Int32,
    row0: Int32,
    rows: Int32,
):
    """Gather the CTA's packed Q rows (``mQ``: (batch, seqlen_q, heads_q, head_dim)) into this
    thread's (CPY, ROWS, COLS) partition ``dst`` of the Q tile; rows at or past ``rows`` (the packed
    problem's) are zero-filled."""
    for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
        r = row0 + coords[0, m, 0][0]
        if r < rows:
            t = r // group
            copy_row(g2s, mQ[batch, t, head_kv * group + r - t * group, None], dst, coords, m)
        else:
            dst[None, m, None].fill(0)


@cute.jit
def _store_pairs(row: cute.Tensor, o_mn: cute.Tensor, r: cutlass.Constexpr, c_mn: cute.Tensor):
    """row[col], row[col + 1] = the fragment's adjacent pair of columns (even, odd) of row ``r``, one
    vector store each (``row``: a contiguous global row of the output's dtype)."""
    dtype = row.element_type
    pair_type = ir.VectorType.get([2], dtype.mlir_type)
    for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1]) // 2):
        col = c_mn[r, 2 * c][1]
        ptr = cute.make_ptr(
            dtype, (row.iterator + col).toint(), cute.AddressSpace.gmem, assumed_align=2 * dtype.width // 8
        )
        pair = vector.from_elements(
            pair_type, [dtype(o_mn[r, 2 * c]).ir_value(), dtype(o_mn[r, 2 * c + 1]).ir_value()]
        )
        cute.arch.store(ptr, pair)


@cute.jit
def store_rows(
    mO: cute.Tensor,
    mLSE: cute.Tensor,
    o_mn: cute.Tensor,
    lse: cute.Tensor,
    c_mn: cute.Tensor,
    tidx: Int32,
    batch: Int32,
    head_kv: Int32,
    group: Int32,
    row0: Int32,
    rows: Int32,
):
    """Scatter the thread's rows of the (normalised) output fragment ``o_mn`` ((rows, head_dim) view;
    ``c_mn`` its tile coordinates) to ``mO`` (batch, seqlen_q, heads_q, head_dim) in ``mO``'s dtype,
    and each row's ``lse`` to ``mLSE`` (batch, heads_q, seqlen_q) from the first thread of its quad.
    Rows at or past ``rows`` are not written."""
    for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
        pr = row0 + c_mn[r, 0][0]
        if pr < rows:
            t = pr // group
            head = head_kv * group + pr - t * group
            _store_pairs(mO[batch, t, head, None], o_mn, r, c_mn)
            if tidx % 4 == 0:
                mLSE[batch, head, t] = lse[r]
