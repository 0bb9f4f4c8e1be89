"""Policy of the MLA decode kernel (templates/decode_mla_sm90.py.j2): DeepSeek's multi-head latent
attention in its absorbed form, q of head dim 576 (512 latent + 64 rope columns) against one paged
latent cache whose first 512 columns are also V, output of head dim 512.

The variant is an sm90 forward spec with ``head_dim=576``, ``head_dim_v=512`` and the ``split_kv``
and ``paged_kv`` axes (one kv head). Its tile: ``tile_m`` packed query rows (query heads x new
tokens, like the decode kernel's packed GQA rows) in :data:`MMA_ROWS`-row slabs, each slab shared by
:data:`WARP_COLS` warps that split the key columns of S = Q K^T and the 512 columns of O = P V
(a warp's O is 16 x 128 fp32: 64 registers a thread). One shared-memory stage holds a tile of
:data:`TILE_N` latent rows (576 x 2 B = 1152 B a row, 72 KiB a stage): QK^T reads all 576
columns of it, P V the first 512 of the same stage, so each cache byte is read from HBM once per
row tile. Two stages (144 KiB) and the Q tile (18 or 36 KiB) leave one CTA per SM; the split
heuristic fills the GPU with splits of the keys (:func:`num_splits`, the decode kernel's
heuristic at one CTA per SM).

Not yet: an e4m3 latent cache (design: the stage is loaded as e4m3 and widened to bf16 in shared
memory by the consumer warps before the MMAs; k_descale folds into the exp2 scale and v_descale into
the output, both exact), refused by :func:`why_invalid`. A WGMMA version (rows = heads as an M=64
tile, P V's N=512 split across two warpgroups) is its own variant
(:mod:`cutefa.model.policy_mla_wgmma`), compiled and SASS-checked, not yet run on a GPU: only an
explicit spec reaches it.
"""

from __future__ import annotations

from cutefa.model import policy_decode
from cutefa.model.options import Mask, Sm90FwdOptions
from cutefa.model.spec import Features, VariantSpec

HEAD_DIM = 576  # q and the latent cache: 512 latent + 64 rope columns
HEAD_DIM_V = 512  # V and the output: the cache's first 512 columns
DTYPES = ("bf16", "fp16")
FEATURES = Features(paged_kv=True, split_kv=True)  # exactly these axes
MMA_ROWS = 16  # rows of one mma.sync slab
WARP_COLS = 4  # warps side by side on a slab: S's keys and O's 512 columns split four ways
MAX_ROW_SLABS = 2  # 8 warps: 32 packed rows a tile (more rows take several row tiles)
TILE_N = 64  # latent rows a stage: 72 KiB
STAGES = 2
COPY_THREADS_PER_ROW = 8  # threads side by side on a latent row in the cp.async copies (128 bytes)
ELEM_BYTES = 2
FP32_BYTES = 4
SMEM_ALIGN = 1024  # each shared-memory buffer starts on a 1 KiB boundary (the Storage struct)


def is_mla(spec: VariantSpec) -> bool:
    """Whether ``spec`` is an MLA decode variant (head dims 576/512 with the split_kv axis)."""
    return spec.head_dim == HEAD_DIM and spec.head_dim_v == HEAD_DIM_V and spec.features.split_kv


def row_slabs(rows: int) -> int:
    """Row slabs of the tile for ``rows`` packed query rows (query heads x new tokens)."""
    if rows < 1:
        raise ValueError(f"rows={rows} must be at least 1")
    return 1 if rows <= MMA_ROWS else MAX_ROW_SLABS


def mla_spec(dtype: str, rows: int, *, causal: bool = False) -> VariantSpec:
    """The MLA decode variant for ``rows`` packed query rows (heads_q x seqlen_q)."""
    slabs = row_slabs(rows)
    return VariantSpec(
        "sm90", "fwd", dtype, HEAD_DIM, slabs * MMA_ROWS, TILE_N, STAGES, slabs * WARP_COLS,
        mask=Mask.CAUSAL if causal else Mask.NONE, features=FEATURES,
        head_dim_v=HEAD_DIM_V,
    )  # fmt: skip


def smem_aligned(n: int) -> int:
    """``n`` bytes rounded up to a shared-memory buffer's alignment."""
    return -(-n // SMEM_ALIGN) * SMEM_ALIGN


def tile_smem_bytes(spec: VariantSpec) -> int:
    """The Q tile, the latent stages and P of an MLA decode CTA, each buffer 1 KiB aligned (both MLA
    kernels hold these; each adds its own row exchange)."""
    q = spec.tile_m * spec.head_dim * ELEM_BYTES
    kv = spec.stages * spec.tile_n * spec.head_dim * ELEM_BYTES
    p = spec.tile_m * spec.tile_n * ELEM_BYTES
    return smem_aligned(q) + smem_aligned(kv) + smem_aligned(p)


def smem_bytes(spec: VariantSpec) -> int:
    """Shared memory of one CTA: the Q tile, the latent stages, P, and the two cross-warp row
    exchanges (row maxima, row sums), each buffer 1 KiB aligned."""
    exchange = spec.tile_m * WARP_COLS * FP32_BYTES
    return tile_smem_bytes(spec) + 2 * smem_aligned(exchange)


def why_invalid(spec: VariantSpec) -> str | None:
    """Why ``spec`` (an :func:`is_mla` one) has no MLA decode kernel, naming what has one; None
    when it has."""
    what = "the MLA decode kernel (templates/decode_mla_sm90.py.j2)"
    if (spec.arch, spec.direction) != ("sm90", "fwd"):
        return f"{what} is an sm90 forward kernel; got {spec.arch} {spec.direction}"
    if spec.dtype == "e4m3":
        return f"{what} takes a 16-bit latent cache; an e4m3 latent cache is not implemented yet"
    if spec.dtype not in DTYPES:
        return f"{what} takes dtype in {DTYPES}; got {spec.dtype}"
    if spec.features != FEATURES:
        return f"{what} implements the split_kv + paged_kv axes exactly; got {spec.features.tokens or 'none'}"
    if spec.mask not in (Mask.NONE, Mask.CAUSAL):
        return f"{what} takes no mask or the causal mask; got {spec.mask.name.lower()}"
    if spec.options != Sm90FwdOptions():
        return f"{what} takes the default sm90 forward options; got {spec.options}"
    slabs = spec.tile_m // MMA_ROWS
    if spec.tile_m % MMA_ROWS or not 1 <= slabs <= MAX_ROW_SLABS:
        return (
            f"{what} takes tile_m of {MMA_ROWS} or {MMA_ROWS * MAX_ROW_SLABS} packed rows; got {spec.tile_m}"
        )
    if spec.warps != slabs * WARP_COLS:
        return f"{what} runs {WARP_COLS} warps per {MMA_ROWS}-row slab: warps={slabs * WARP_COLS}; got {spec.warps}"
    if (spec.tile_n, spec.stages) != (TILE_N, STAGES):
        return f"{what} takes tile_n={TILE_N}, stages={STAGES}; got {spec.tile_n}, {spec.stages}"
    return None


def num_splits(*, batch: int, row_tiles: int, seqlen_k: int, sm_count: int) -> int:
    """How many splits the keys take: the decode kernel's heuristic at one CTA per SM (module docs)."""
    return policy_decode.num_splits(
        batch=batch, heads_kv=1, row_tiles=row_tiles, seqlen_k=seqlen_k, tile_n=TILE_N, sm_count=sm_count,
        ctas_per_sm=1,
    )  # fmt: skip


def row_tiles(spec: VariantSpec, rows: int) -> int:
    """Row tiles per sequence: ceil(rows / tile_m)."""
    return -(-rows // spec.tile_m)


def template_numbers(spec: VariantSpec) -> dict[str, object]:
    """What templates/decode_mla_sm90.py.j2 reads besides the spec and its switches."""
    return {
        "row_slabs": spec.tile_m // MMA_ROWS,
        "warp_cols": WARP_COLS,
        "combine_warps": policy_decode.COMBINE_WARPS,
        "copy_threads_per_row": COPY_THREADS_PER_ROW,
    }
