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

Two schedules (:class:`DecodeSchedule`). ROWS, the one above: a warp per 16-row slab, so a tile of up to
16 rows is a one-warp CTA. That CTA holds 68 KiB of shared memory at head dim 128 (Q plus 2 stages
of 64-key K and V tiles), so an H100 SM keeps 3 of them: 3 warps on its 4 schedulers, each alone
on its scheduler to hide the latency of its own ldmatrix, mma.sync, softmax and cp.async issue
chain, and a batch-1 split walks its key blocks one after the other through that chain. KEYS, for
tiles of 16 rows: :data:`KEY_WARPS` warps share the tile's rows and split each key block among them
(16 keys a warp); each warp copies, multiplies and softmaxes its own slice of every stage (no CTA
barrier in the mainloop), keeps Q in registers, and the warps' partial rows merge through shared
memory at the end (kernels/sm80/decode_warps.py). Then an SM keeps 2 CTAs (8 warps) with 3 stages
each (80 KiB in flight per CTA), a block's latency is a quarter of ROWS', and the grid's splits
stay as few as ROWS' (the same 64-key block per CTA step).
"""

from __future__ import annotations

import enum

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
LINE_THREADS = 8  # DecodeCopy.LINES: 8 threads of 16 bytes on a 128-byte line
COMBINE_WARPS = 4  # the combine kernel: warps a CTA (decode_combine.warps_per_row of them merge a row)
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

# The KEYS schedule: warps splitting each key block, 16 keys a warp (the k-step of O += P V).
WARP_KEYS = 16
# tile_n = 16 * warps: TILE_N's 64-key blocks. Head dims 64 and 128 only: at 192 and 256 Q (kept in
# registers) and O do not fit 255 registers (hd256 spills), and hd96's 16x96 Q tile does not split
# into one warp's 16-byte copies.
KEY_WARPS = {64: 4, 128: 4}
KEY_STAGES = 3
# Registers a thread of a KEYS CTA (S of 16 keys, Q and O in registers): the most its SASS shows
# (sm_90a, DSL 4.8.1: hd64 128; hd128 192 dense, 168 paged), for the residency count.
KEY_REGISTERS_PER_THREAD = {64: 128, 128: 192}
# Splits of at least this many keys (MIN_BLOCKS_PER_SPLIT blocks of 64 keys).
MIN_KEYS_PER_SPLIT = 256


class DecodeCopy(enum.Enum):
    """How the ROWS tile's threads copy K/V rows into shared memory (16 bytes a thread and cp.async).
    SECTORS: 2 threads side by side on a row, a 32-byte sector a pair, so a warp instruction touches
    16 rows and a 256-byte row takes 8 instructions (few row addresses a thread). LINES: 8 threads
    on a row, a 128-byte line an instruction's 8 threads, so each line is asked of the L2 once
    (4 times as many row addresses a thread). :func:`default_copy` picks one per call."""

    SECTORS = "sectors"
    LINES = "lines"


# A paged cache of fewer K/V bytes than this keeps SECTORS (:func:`default_copy`).
PAGED_LINES_MIN_BYTES = 16 << 20


def default_copy(paged: bool, kv_bytes: int | None = None) -> DecodeCopy:
    """The copy layout a call takes (where :func:`lines_apply`; ``kv_bytes``: the K and V bytes its
    cache holds, batch x capacity x kv heads x head dim x 2 x element size; None: large). LINES: on an
    H100 (bf16 hd128, 32/8 heads, one token, CUDA graphs) every cell of the decode grid from 32 MiB
    of K/V on ran 3-8% faster (batch 64 x 8k dense 754.9 -> 704.1 us, at 101% of the copy rate;
    ncu: L2 hit rate 50% -> 2%, DRAM throughput 86% -> 93%: with 2 threads a sector a line was
    fetched into the L2 by one instruction and read again by the next). SECTORS for a paged cache
    under :data:`PAGED_LINES_MIN_BYTES`: batch 1 x 1k paged (4 MiB, 32 one-warp CTAs) ran 14.4 ->
    18.8 us with LINES at page sizes 16 and 64 (the dense cache of that cell: equal), LINES' four
    times as many page-table reads a thread sitting on the path of a latency-bound CTA."""
    if paged and kv_bytes is not None and kv_bytes < PAGED_LINES_MIN_BYTES:
        return DecodeCopy.SECTORS
    return DecodeCopy.LINES


class DecodePages(enum.Enum):
    """How the paged ROWS tile with line copies finds its K/V rows' pages. ROWS: a page-table read
    and a 64-bit address for every row of a thread (16 a 64-key block, one warp). CHUNKS: one read
    and one address for each aligned chunk of :data:`PAGE_CHUNK_KEYS` keys, its rows at constant
    offsets (pages of at least that many keys; sm_90a SASS at hd128: 4,120 instructions instead of
    5,768, 29 LDG instead of 113, 168 registers instead of 245). CHUNKS is the default where
    :func:`chunks_apply`: on an H100 (bf16 hd128, 32/8 heads, one token, CUDA graphs, pages of 16
    and 64) it ran every cell as fast as ROWS or faster, batch 256 x 8k pages of 16 2948.5 ->
    2829.3 us (0.94x -> 0.98x of FA4's paged decode), batch 1 x 1k 18.9 -> 15.9 us."""

    ROWS = "rows"
    CHUNKS = "chunks"


# Keys of a chunk (DecodePages.CHUNKS): pages of at least this many keys (a power of two) never
# split an aligned chunk of them (cutefa.kernels.sm80.decode_paged.load_page_rows).
PAGE_CHUNK_KEYS = 16


class DecodeSchedule(enum.Enum):
    """How a decode CTA's warps share its work (module docs)."""

    ROWS = "rows"  # a warp per 16-row slab, each walking every key
    KEYS = "keys"  # 16 rows, the warps splitting each key block, merged in shared memory


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
    schedule: DecodeSchedule = DecodeSchedule.ROWS,
    copy: DecodeCopy | None = None,
    kv_bytes: int | None = None,
    pages: DecodePages = DecodePages.CHUNKS,
    page_size: int | None = None,
) -> VariantSpec:
    """The decode variant for ``rows`` packed query rows per kv head (group x new tokens);
    ``cache_dtype``: the KV cache's element type (E4M3: an e4m3 cache read with descales);
    ``schedule``: KEYS where the tile is 16 rows and the cache is 16-bit (:func:`keys_apply`),
    else ROWS; ``copy``: the ROWS tile's copy layout where it takes LINES (:func:`lines_apply`),
    else SECTORS; None: :func:`default_copy` of ``paged`` and ``kv_bytes``; ``pages``: CHUNKS where
    the paged line-copy tile of pages of ``page_size`` keys takes it (:func:`chunks_apply`)."""
    if copy is None:
        copy = default_copy(paged, kv_bytes)
    tile_m, warps = row_tile(rows)
    if head_dim not in TILE_N:
        raise ValueError(f"head_dim={head_dim} has no decode tile; known: {sorted(TILE_N)}")
    features = Features(paged_kv=paged, split_kv=True, softcap=softcap)
    if schedule is DecodeSchedule.KEYS and keys_apply(rows, head_dim, cache_dtype):
        warps = KEY_WARPS[head_dim]
        return VariantSpec(
            "sm80", "fwd", dtype, head_dim, tile_m, WARP_KEYS * warps, KEY_STAGES, warps, mask=mask,
            features=features, options=Sm80FwdOptions(cache_dtype=cache_dtype),
        )  # fmt: skip
    line_copy = copy is DecodeCopy.LINES and lines_apply(head_dim, cache_dtype)
    chunks = pages is DecodePages.CHUNKS and line_copy and chunks_apply(paged, page_size, warps)
    return VariantSpec(
        "sm80", "fwd", dtype, head_dim, tile_m, TILE_N[head_dim], STAGES, warps, mask=mask, features=features,
        options=Sm80FwdOptions(cache_dtype=cache_dtype, line_copy=line_copy, page_chunks=chunks),
    )  # fmt: skip


def chunks_apply(paged: bool, page_size: int | None, warps: int) -> bool:
    """Whether the line-copy ROWS tile of ``warps`` warps takes page reads per chunk: a paged cache
    of pages of at least :data:`PAGE_CHUNK_KEYS` keys, and copy instructions (``warps`` x 4 rows)
    that divide a chunk."""
    rows_a_copy = warps * 32 // LINE_THREADS
    big_pages = page_size is not None and page_size >= PAGE_CHUNK_KEYS
    return paged and big_pages and PAGE_CHUNK_KEYS % rows_a_copy == 0


def chunk_row_step(spec: VariantSpec) -> int:
    """Rows between a thread's consecutive K/V rows in the copies (the rows of one copy instruction)."""
    return spec.threads // copy_threads_per_row(spec)


def lines_apply(head_dim: int, cache_dtype: CacheDtype = CacheDtype.SAME) -> bool:
    """Whether the ROWS tile takes line-wide copies: a 16-bit cache whose rows are whole 128-byte
    lines (head dims that are multiples of 64)."""
    return cache_dtype is CacheDtype.SAME and head_dim % 64 == 0


def keys_apply(rows: int, head_dim: int, cache_dtype: CacheDtype = CacheDtype.SAME) -> bool:
    """Whether the KEYS schedule takes a problem of ``rows`` packed rows: one 16-row slab, a head
    dim of :data:`KEY_WARPS`, a 16-bit cache."""
    return rows <= MMA_ROWS and head_dim in KEY_WARPS and cache_dtype is CacheDtype.SAME


def key_warps(spec: VariantSpec) -> int:
    """Warps that split each key block of a decode ``spec`` (1: the ROWS schedule): its warps
    beyond one per 16-row slab."""
    return spec.warps // max(1, spec.tile_m // MMA_ROWS)


def schedule_of(spec: VariantSpec) -> DecodeSchedule:
    return DecodeSchedule.KEYS if key_warps(spec) > 1 else DecodeSchedule.ROWS


def warp_keys(spec: VariantSpec) -> int:
    """Keys of a key block each warp takes (tile_n for the ROWS schedule)."""
    return spec.tile_n // key_warps(spec)


def min_blocks_per_split(spec: VariantSpec) -> int:
    """The fewest key blocks of a split: :data:`MIN_BLOCKS_PER_SPLIT` (ROWS, as measured), at least
    :data:`MIN_KEYS_PER_SPLIT` keys (KEYS)."""
    if schedule_of(spec) is DecodeSchedule.KEYS:
        return max(1, MIN_KEYS_PER_SPLIT // spec.tile_n)
    return MIN_BLOCKS_PER_SPLIT


def copy_threads_per_row(spec: VariantSpec) -> int:
    """Threads side by side on a row in the global->shared copies (decode_rows.g2s_tiled_copy): 2 (a
    32-byte sector a pair, the fewest rows a thread), more where the CTA's threads would otherwise
    span more rows than a K/V tile has; :data:`LINE_THREADS` with ``line_copy`` (:class:`DecodeCopy`)."""
    if schedule_of(spec) is DecodeSchedule.KEYS:
        return 2  # a warp copies its own 16-key slice: 16 rows of 2 threads
    if spec.options.line_copy:
        return LINE_THREADS
    return max(2, spec.threads // spec.tile_n)


def row_tiles(spec: VariantSpec, rows: int) -> int:
    """Row tiles per kv head: ceil(rows / tile_m)."""
    return -(-rows // spec.tile_m)


def ctas_per_sm(spec: VariantSpec, target: str) -> int:
    """Resident CTAs of ``spec`` per SM on ``target``'s GPUs, by shared memory, registers and threads."""
    smem = (TARGET_SMEM_LIMITS[target] + SMEM_PER_CTA_RESERVE) // (
        sm80_smem_bytes(spec) + SMEM_PER_CTA_RESERVE
    )
    per_thread = (
        KEY_REGISTERS_PER_THREAD[spec.head_dim]
        if schedule_of(spec) is DecodeSchedule.KEYS
        else REGISTERS_PER_THREAD
    )
    registers = REGISTERS_PER_SM // (per_thread * spec.threads)
    return max(1, min(smem, registers, MAX_THREADS_PER_SM // spec.threads, MAX_CTAS_PER_SM))


def _last_wave_fill(ctas: int, slots: int) -> float:
    waves = ctas / slots
    return waves / -(-ctas // slots)


def num_splits(
    *,
    batch: int,
    heads_kv: int,
    row_tiles: int,
    seqlen_k: int,
    tile_n: int,
    sm_count: int,
    ctas_per_sm: int,
    min_blocks: int = MIN_BLOCKS_PER_SPLIT,
) -> int:
    """How many splits the keys take (module docs). ``seqlen_k``: the longest a sequence can be
    (the cache's capacity, plus the new tokens); ``min_blocks``: the fewest key blocks of a split
    (:func:`min_blocks_per_split`). 1 when the grid already fills :data:`TARGET_WAVES` waves or
    the cache has too few blocks to split."""
    ctas = batch * heads_kv * row_tiles
    if ctas <= 0 or seqlen_k <= 0:
        return 1
    slots = max(1, sm_count * ctas_per_sm)
    if ctas >= TARGET_WAVES * slots:
        return 1
    blocks = -(-seqlen_k // tile_n)
    most = max(1, min(MAX_SPLITS, blocks // min_blocks))
    least = min(most, -(-TARGET_WAVES * slots // ctas))
    candidates = range(least, min(most, 2 * least) + 1)
    best = max(_last_wave_fill(ctas * s, slots) for s in candidates)
    return next(s for s in candidates if _last_wave_fill(ctas * s, slots) >= FULL_LAST_WAVE * best)
