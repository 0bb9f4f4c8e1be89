"""Decode policy of the sm80-family decode kernel (templates/decode_sm80.py.j2): its tile for a
problem, and how many splits the keys take (the split-KV heuristic), from shapes only.

A decode step reads the whole KV cache for a few query rows per kv head, so it is bound by memory
bandwidth and its time is that of the cache bytes over the GPU's bandwidth once every SM streams.
The tile packs a kv head's query rows (group x new tokens) into the fewest 16-row MMA slabs, one
warp each: every warp reads each K/V tile from shared memory once, so the fewer warps the less
shared-memory traffic per cache byte. The grid is (splits x row tiles, heads_kv, batch); with few
sequences or kv heads it cannot fill the GPU, so the keys are split across CTAs until there are
enough for about :data:`TARGET_WAVES` waves of resident CTAs, each split keeping at least
:data:`MIN_BLOCKS_PER_SPLIT` key blocks, and among the counts that do, the one whose last wave is
fullest. Only shapes are read (the cache's capacity stands for the lengths, which live on the GPU),
so the choice needs no host sync and is the same at graph capture and replay.
"""

from __future__ import annotations

from cutefa.model.budgets import TARGET_SMEM_LIMITS
from cutefa.model.budgets_sm80 import sm80_smem_bytes
from cutefa.model.options import CacheDtype, Mask, Sm80FwdOptions
from cutefa.model.spec import Features, VariantSpec

MMA_ROWS = 16  # rows of one mma.sync slab; one warp per slab
MAX_WARPS = 8  # the largest packed-row tile: 128 rows (longer chunks take several row tiles)
# Keys per mainloop step, by head dim: K and V tiles of 8-16 KiB each (2 stages: 32-64 KiB in flight
# per CTA), several CTAs per SM.
TILE_N = {64: 64, 96: 64, 128: 64, 192: 32, 256: 32}
STAGES = 2
COMBINE_WARPS = 4  # the combine kernel: a warp merges one output row
TARGET_WAVES = 2
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 128
FULL_LAST_WAVE = 0.95  # take the fewest splits whose last wave is within this of the fullest
MAX_THREADS_PER_SM = 2048
MAX_CTAS_PER_SM = 32
REGISTERS_PER_SM = 65536
# ptxas gives these kernels up to 255 registers a thread (seen in SASS, sm_90a: 220-252 for head dims
# 128 and 256), so residency is counted at 256 a thread.
REGISTERS_PER_THREAD = 256
SMEM_PER_CTA_RESERVE = 1024  # the driver's shared memory per resident CTA


def row_tile(rows: int) -> tuple[int, int]:
    """(tile_m, warps) for ``rows`` packed query rows of a kv head (group x new tokens): the fewest
    16-row slabs that hold them, up to 8 warps (128 rows; more rows take several row tiles)."""
    if rows < 1:
        raise ValueError(f"rows={rows} must be at least 1")
    warps = 1
    while warps < MAX_WARPS and warps * MMA_ROWS < rows:
        warps *= 2
    return warps * MMA_ROWS, warps


def decode_spec(
    dtype: str,
    head_dim: int,
    rows: int,
    *,
    mask: Mask = Mask.NONE,
    paged: bool = False,
    softcap: bool = False,
    cache_dtype: CacheDtype = CacheDtype.SAME,
) -> VariantSpec:
    """The decode variant for ``rows`` packed query rows per kv head (group x new tokens);
    ``cache_dtype``: the KV cache's element type (E4M3: an e4m3 cache read with descales)."""
    tile_m, warps = row_tile(rows)
    if head_dim not in TILE_N:
        raise ValueError(f"head_dim={head_dim} has no decode tile; known: {sorted(TILE_N)}")
    features = Features(paged_kv=paged, split_kv=True, softcap=softcap)
    return VariantSpec(
        "sm80", "fwd", dtype, head_dim, tile_m, TILE_N[head_dim], STAGES, warps, mask=mask, features=features,
        options=Sm80FwdOptions(cache_dtype=cache_dtype),
    )  # fmt: skip


def copy_threads_per_row(spec: VariantSpec) -> int:
    """Threads side by side on a row in the global->shared copies (decode_rows.g2s_tiled_copy): 2 (a
    32-byte sector a pair, the fewest rows a thread), more where the CTA's threads would otherwise
    span more rows than a K/V tile has."""
    return max(2, spec.threads // spec.tile_n)


def row_tiles(spec: VariantSpec, rows: int) -> int:
    """Row tiles per kv head: ceil(rows / tile_m)."""
    return -(-rows // spec.tile_m)


def ctas_per_sm(spec: VariantSpec, target: str) -> int:
    """Resident CTAs of ``spec`` per SM on ``target``'s GPUs, by shared memory, registers and threads."""
    smem = (TARGET_SMEM_LIMITS[target] + SMEM_PER_CTA_RESERVE) // (
        sm80_smem_bytes(spec) + SMEM_PER_CTA_RESERVE
    )
    registers = REGISTERS_PER_SM // (REGISTERS_PER_THREAD * spec.threads)
    return max(1, min(smem, registers, MAX_THREADS_PER_SM // spec.threads, MAX_CTAS_PER_SM))


def _last_wave_fill(ctas: int, slots: int) -> float:
    waves = ctas / slots
    return waves / -(-ctas // slots)


def num_splits(
    *, batch: int, heads_kv: int, row_tiles: int, seqlen_k: int, tile_n: int, sm_count: int, ctas_per_sm: int
) -> int:
    """How many splits the keys take (module docs). ``seqlen_k``: the longest a sequence can be
    (the cache's capacity, plus the new tokens). 1 when the grid already fills
    :data:`TARGET_WAVES` waves or the cache has too few blocks to split."""
    ctas = batch * heads_kv * row_tiles
    if ctas <= 0 or seqlen_k <= 0:
        return 1
    slots = max(1, sm_count * ctas_per_sm)
    if ctas >= TARGET_WAVES * slots:
        return 1
    blocks = -(-seqlen_k // tile_n)
    most = max(1, min(MAX_SPLITS, blocks // MIN_BLOCKS_PER_SPLIT))
    least = min(most, -(-TARGET_WAVES * slots // ctas))
    candidates = range(least, min(most, 2 * least) + 1)
    best = max(_last_wave_fill(ctas * s, slots) for s in candidates)
    return next(s for s in candidates if _last_wave_fill(ctas * s, slots) >= FULL_LAST_WAVE * best)
