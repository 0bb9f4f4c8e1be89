"""The default kernel of each family: one ``*_config`` function per (family, direction) giving the
tile and the option record for a dtype and head dim (in the manner of FlashAttention-4's
``_tile_size_fwd_sm90``), with the measurements that chose them; the fallback tiles for GPUs with
less shared memory; and the candidate grid that ``cutefa list`` enumerates.

The committed set (what ``generated/`` holds, :func:`cutefa.model.committed.default_variants`) is
built from these configs, and dispatch's heuristic runs them where no tuned table has an entry.
Measurements quoted here are on the H200 (docs/log/perf-notes.md has each run).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from cutefa.model.budgets_sm80 import sm80_tile_head_dim
from cutefa.model.budgets_sm90 import SM90_BWD_OWN_HEAD_DIMS, sm90_fwd_own_tile_n
from cutefa.model.budgets_sm100 import SM100_BWD_TILE
from cutefa.model.options import (
    DqLayout,
    DqPath,
    Mask,
    Options,
    Quant,
    Schedule,
    Scheduler,
    Sm80BwdOptions,
    Sm80FwdOptions,
    Sm90BwdOptions,
    Sm90Fp8FwdOptions,
    Sm90FwdOptions,
    Sm100BwdOptions,
    Sm100FwdOptions,
    VTranspose,
)
from cutefa.model.spec import ARCHS, DIRECTIONS, DTYPES, HEAD_DIMS, VariantSpec, accepted_head_dim

# Families whose tensor cores take fp8 operands; e4m3 is a forward-only dtype there.
FP8_FAMILIES = ("sm90", "sm100")


class Tile(NamedTuple):
    """The tiling part of a spec."""

    tile_m: int
    tile_n: int
    stages: int
    warps: int


@dataclasses.dataclass(frozen=True)
class Config:
    """A kernel configuration: its tile and its family's option record."""

    tile: Tile
    options: Options

    def spec(
        self, arch: str, direction: str, dtype: str, head_dim: int, *, mask: Mask = Mask.NONE,
        head_dim_v: int | None = None,
    ) -> VariantSpec:  # fmt: skip
        return VariantSpec(
            arch,
            direction,
            dtype,
            head_dim,
            *self.tile,
            mask=mask,
            head_dim_v=head_dim_v,
            options=self.options,
        )


# ---------------------------------------------------------------------------------------------
# sm80 (FlashAttention-2 design)


def _sm80_nearest(tiles: dict[int, Tile], head_dim: int) -> Tile | None:
    """``head_dim``'s own tile, else that of the smallest head dim of ``tiles`` at or above its
    padded tile head dim (:func:`~cutefa.model.budgets_sm80.sm80_tile_head_dim`): that tile holds
    the padded columns within the budgets it was chosen under. None above every head dim."""
    if head_dim in tiles:
        return tiles[head_dim]
    padded = sm80_tile_head_dim(head_dim)
    return next((tiles[d] for d in sorted(tiles) if d >= padded), None)


def sm80_fwd_config(head_dim: int) -> Config | None:
    """FlashAttention-2's forward tiles on the A100 (flash_fwd_launch_template.h). Head dims 80
    and 112 (tile head dims 96 and 128) take 128x128 with 8 warps, hd128's tile: by the budget
    model it holds their registers (estimate 176 and 208 of 255) and shared memory (73 and 97 KiB,
    within the 99 KiB of sm_86/sm_89), and it halves the key steps of hd96's 128x64 (not yet timed).
    Any other head dim takes the tile of the nearest head dim above it (:func:`_sm80_nearest`),
    except those padded to 256 columns (232-248), whose copies' column predicates spill beside
    hd256's 128x64 (budgets_sm80.SM80_PAD_REG_OVERHEAD): they take 128x32."""
    if head_dim != 256 and sm80_tile_head_dim(head_dim) == 256:
        return Config(Tile(128, 32, 1, 8), Sm80FwdOptions())
    tile = _sm80_nearest(
        {
            64: Tile(128, 64, 1, 4),
            80: Tile(128, 128, 1, 8),
            96: Tile(128, 64, 1, 8),
            112: Tile(128, 128, 1, 8),
            128: Tile(128, 128, 1, 8),
            192: Tile(128, 64, 1, 8),
            256: Tile(128, 64, 1, 8),
        },
        head_dim,
    )
    return None if tile is None else Config(tile, Sm80FwdOptions())


def sm80_bwd_options(head_dim: int, stages: int) -> Sm80BwdOptions:
    """The sm80 backward's options on a tile with ``stages`` Q buffers. The dQ accumulator in the
    MMA's fragment order (DqLayout.TILE, FlashAttention-2's fp32 dQ workspace, the layout it uses
    on every sm8x GPU: +5-9% over the column-permuted QUAD and +11-21% over ROWS, "sm80 backward:
    the dQ accumulator in fragment order"). On single-buffered tiles at hd96, hd192 and hd256 the
    dQ GEMM by column chunks, each chunk's reductions between the next chunk's MMAs (dq_pipe:
    against TILE alone hd192 +8-11%, hd256 +9-11%, hd96 +2.5-4% at every length and mask; hd128
    +3-7% non-causal but -1 to -3% causal, so not there; "sm80 backward: the dQ reductions between
    the dQ MMAs")."""
    return Sm80BwdOptions(dq_layout=DqLayout.TILE, dq_pipe=stages == 1 and head_dim in (96, 192, 256))


# The backward families that take a V head dim of its own (spec.HEAD_DIM_V_PAIRS: (192, 128)), newest
# first, each with the default tile of its Q/K head dim: the sm90 one on Hopper (its swapped-dK/dV
# partition, :func:`sm90_bwd_config`), the sm80 one on every other target and for the calls the
# sm90 template does not take there (a packed batch, a window, softcap, ALiBi:
# :func:`sm80_bwd_config`); the sm100 backward takes one head dim for q, k and v. The committed set
# holds their defaults of each pair (cutefa.model.committed).
SEPARATE_V_BWD_FAMILIES = ("sm90", "sm80")


def sm80_bwd_config(head_dim: int) -> Config | None:
    """FlashAttention-2's backward tiles on the A100 (flash_bwd_launch_template.h): query rows x
    keys per CTA, 8 warps; hd64 its 128x128 tile with a double-buffered Q (150 KiB; +10% over
    64x128 single-buffered).

    A head dim that is not a multiple of 32 computes on its padded tile head dim
    (:func:`~cutefa.model.budgets_sm80.sm80_tile_head_dim`; predicated loads, stores of the real
    columns) and takes the tile of the nearest head dim at or above that (:func:`_sm80_nearest`),
    with the tiled dQ accumulator and no dq_pipe (:func:`sm80_bwd_options`). Head dims 80 and 112
    (tile head dims 96 and 128) take 64x128 with 8 warps, as hd96 and hd128 do: by the budget model
    their fp32 dK and dV accumulators and S/dP take an estimated 208 and 240 registers of 255
    (sm80_registers), and 110 and 134 KiB of shared memory (the A100's 163 KiB holds them; 128x128
    double-buffered, hd64's tile, would need 190 KiB at 96 columns, and 64x64 halves the work per K
    and V load). Not yet timed against FA2 or FA4.

    (192, 128) (v of head dim 128, :data:`SEPARATE_V_BWD_FAMILIES`; on Hopper the sm90 backward's,
    :func:`sm90_bwd_config`) takes hd192's 64x64 tile with 8
    warps, single-buffered Q and dq_pipe (FlashAttention-2's hd192 tile): 102 KiB of shared memory
    by the budget model (hd192's 118), and on compiled SASS (DSL 4.8.1) 222-248 registers, no
    spill, sm_80 and sm_90a, causal and not, dense and packed. 64x128 would spill (estimate 272);
    128x64 (158 KiB, estimate 224) and a double-buffered 64x64 (126 KiB) fit but are not timed."""
    tile = _sm80_nearest(
        {
            32: Tile(128, 128, 1, 8),  # single-buffered Q: hd64's double buffer interleaves dQ's
            # reductions with dK's k-blocks, which a 32-column dQ has too few of (rules._sm80_bwd_head_dims)
            64: Tile(128, 128, 2, 8),
            80: Tile(64, 128, 1, 8),
            96: Tile(64, 128, 1, 8),
            112: Tile(64, 128, 1, 8),
            128: Tile(64, 128, 1, 8),
            192: Tile(64, 64, 1, 8),
            256: Tile(64, 64, 1, 8),
        },
        head_dim,
    )
    return None if tile is None else Config(tile, sm80_bwd_options(head_dim, tile.stages))


def sm80_small_smem_configs(direction: str, head_dim: int) -> tuple[Config, ...]:
    """Tiles for the GPUs whose per-block shared memory (99 KiB: sm_86, sm_89) does not hold the
    default (FlashAttention-2's rule there: the largest tile that fits; found by
    :func:`cutefa.model.rules.fitting_variant`). Forward hd256: 64x64 with 4 warps (97 KiB).
    Backward hd64: 64x128 double-buffered (94 KiB); hd96 and hd128: 64 keys per CTA (70 / 86 KiB).
    hd192 and hd256 have no backward tile within 99 KiB (64x64 needs 118 / 150 KiB;
    FlashAttention-2 keeps V in registers there, which the sm80 template does not), so their
    backward raises NotImplementedError on those GPUs. Tested on the H200 like every committed
    variant; not timed on an sm_86/sm_89 GPU."""
    if direction == "fwd":
        tile = {256: Tile(64, 64, 1, 4)}.get(head_dim)
        return () if tile is None else (Config(tile, Sm80FwdOptions()),)
    tile = {64: Tile(64, 128, 2, 8), 96: Tile(64, 64, 1, 8), 128: Tile(64, 64, 1, 8)}.get(head_dim)
    return () if tile is None else (Config(tile, sm80_bwd_options(head_dim, tile.stages)),)


# ---------------------------------------------------------------------------------------------
# sm90 (FlashAttention-3 design)


def sm90_fwd_config(dtype: str, head_dim: int) -> Config | None:
    """Two consumer warpgroups x 64 rows; tile_n shrinks with head_dim so that S, P and O fit the
    240 registers a consumer thread gets, and the K/V stages fit 227 KiB. 16-bit: FlashAttention-3's
    schedule, intra-warpgroup overlap + ping-pong. e4m3: :func:`sm90_fp8_fwd_config`."""
    if dtype == "e4m3":
        return sm90_fp8_fwd_config(head_dim)
    tile_n = {64: 128, 96: 128, 128: 128, 192: 96, 256: 64}.get(head_dim)
    if tile_n is None and accepted_head_dim(head_dim):
        # a head dim of its own: the padded tile (budgets_sm90.sm90_fwd_tile_head_dims) with the
        # widest key tile the budget model accepts (hd80 and hd112: 128, as FlashAttention-3's)
        tile_n = sm90_fwd_own_tile_n(dtype, head_dim)
    if tile_n is None:
        return None
    return Config(Tile(128, tile_n, 2, 12), Sm90FwdOptions(schedule=Schedule.OVERLAP_PINGPONG))


def sm90_fp8_fwd_config(head_dim: int) -> Config | None:
    """The 16-bit tiles and schedule, with the V transpose's addresses hoisted out of the key loop
    (VTranspose.HOISTED: +8-21%, "The hoisted transpose as the fp8 default"), and per head dim:
    hd128 and hd256 a third stage of the K, V and Vt rings (161 / 177 KiB) once the hoisted
    transpose is fast enough that the Vt ring's window binds (hd256 +3-8%, same section); hd128
    the overlap schedule without ping-pong (+1-9% over overlap + ping-pong in three runs: with
    QGMMA at twice the 16-bit rate the forced alternation costs more than it hides); hd256 O
    rescaled only when a warp's row max moves (lazy_rescale: -2 to +12%, +3% typical, in two runs;
    at hd128 within 1%, "fp8: O rescaled only when a warp's row max moves")."""
    tile = {
        64: Tile(128, 128, 2, 12),
        96: Tile(128, 128, 2, 12),
        128: Tile(128, 128, 3, 12),
        192: Tile(128, 96, 2, 12),
        256: Tile(128, 64, 3, 12),
    }.get(head_dim)
    if tile is None:
        return None
    schedule = Schedule.OVERLAP if head_dim == 128 else Schedule.OVERLAP_PINGPONG
    options = Sm90Fp8FwdOptions(
        schedule=schedule, v_transpose=VTranspose.HOISTED, lazy_rescale=head_dim == 256
    )
    return Config(tile, options)


def sm90_bwd_config(head_dim: int) -> Config | None:
    """hd64 128 query rows per step, hd96 and hd128 64 (dK and dV of 64 keys in registers beside
    S^T and dP^T), each with the dQ pieces staged in shared memory and added by one bulk
    reduce-add per consumer and query block (DqPath.BULK, FlashAttention-3's dQ path: +9-19% over
    per-thread reductions at hd64/hd128, "dq_bulk ... measured"). hd192: the swapped-dK/dV
    partition on FlashAttention-4's shared-memory budget (64x96, DqPath.BULK_STAGED: +6-10% over
    the in-stage bulk path and ~1.6x the plain head-dim split in bf16, "hd192 on FA4's budget
    measured"). hd256: the head-dim split (64x64) with the bulk path staged in the consumer's own
    columns of the Q/dO stage and the overlap schedule, the variant the tuner picks for bf16 at
    every length of both masks (+9-14% over per-thread reductions without the overlap, "dq_bulk
    everywhere measured"), so fp16 runs it too.

    (192, 128) (DeepSeek's prefill: v of head dim 128, :data:`SEPARATE_V_BWD_FAMILIES`) takes hd192's
    tile, 64x96 on the swapped-dK/dV partition with DqPath.BULK_STAGED (FlashAttention-3's and -4's
    Hopper tile for head dims up to 192 with a V head dim up to 128), V, dO and dV^T 128 columns
    wide; the 32 KiB that the narrower V and dO free go to a second dO stage
    (budgets_sm90.sm90_bwd_swap_do_stages: 215 KiB of the 227, as FlashAttention-3/4 double-buffer dO
    for this pair). The key tile stays 96 although dV^T shrinks to 128 rows: 128 keys (64 per
    consumer) would hold fp32 dK^T + dV^T of 320 x 64, 160 registers a thread, beside S and dP (an
    estimate of 264 against 240); 112 keys (56 per consumer, an estimate of 236) leave 112-byte key
    rows in P and dS, which no 32-, 64- or 128-byte swizzle atom divides (interleaved layouts, bank
    conflicts on the P/dS stores and the WGMMA reads of P^T and dS^T), for 17% more keys per CTA.
    Compiled for sm_90a the 96-key variant's consumers peak at 193-197 of their 240 registers with no
    spill (tests/test_compile_sm90_bwd_dv.py). Not yet timed: the sm80 backward it replaces on
    Hopper ran 252 / 249 TFLOP/s (non-causal / causal, H100, batch 2 x 8192, 10 heads; FA4 461 / 435)."""
    if head_dim in (64, 96, 128):
        tile = Tile(128, 128, 2, 12) if head_dim == 64 else Tile(64, 128, 2, 12)
        return Config(tile, Sm90BwdOptions(dq_path=DqPath.BULK))
    if head_dim in SM90_BWD_OWN_HEAD_DIMS:
        # a head dim of its own (multiples of 16 up to 128: hd80 and hd112 for Phi-2, StableLM and
        # InternViT), unpadded on the same partition: the tile of the standard head dim at or above
        # it (hd32 and hd48 128 query rows per step, as hd64; hd80 and hd112 64, as hd96 and hd128),
        # the bulk dQ path. Not yet timed against FlashAttention-4's Hopper backward.
        tile = Tile(128, 128, 2, 12) if head_dim <= 64 else Tile(64, 128, 2, 12)
        return Config(tile, Sm90BwdOptions(dq_path=DqPath.BULK))
    if head_dim == 192:
        return Config(Tile(64, 96, 2, 12), Sm90BwdOptions(dq_path=DqPath.BULK_STAGED))
    if head_dim == 256:
        return Config(Tile(64, 64, 2, 12), Sm90BwdOptions(overlap=True, dq_path=DqPath.BULK))
    return None


# ---------------------------------------------------------------------------------------------
# sm100 (FlashAttention-4 design): compiled and SASS-checked for sm_100a, not hardware-tested.


def sm100_fwd_config(head_dim: int) -> Config | None:
    """Two Q tiles of 128 rows in flight (tile_m 256) where S and O of both fit the 512 TMEM
    columns; head dim 256 keeps one Q tile. exp_emu (percent of exp2 on the FMA units) follows
    tools/roofline.py: exp is co-critical with the MMAs up to head dim 128, MMA-bound beyond.
    Single-CTA: the CTA pair waits for a measurement (docs/design/sm100.md). 16-bit and e4m3 alike."""
    if head_dim not in HEAD_DIMS:
        return None
    tile = {192: Tile(256, 64, 3, 16), 256: Tile(128, 64, 2, 16)}.get(head_dim, Tile(256, 128, 3, 16))
    return Config(tile, Sm100FwdOptions(exp_emu=25 if head_dim <= 128 else 0))


def sm100_bwd_config(head_dim: int) -> Config | None:
    """One warpgroup, 128 keys per CTA, 128 query rows per step, every product a 128-row UMMA with
    its accumulator in TMEM; head dims 64 and 128 (S^T + dP^T + dK + dV fit 512 TMEM columns)."""
    return Config(Tile(*SM100_BWD_TILE), Sm100BwdOptions()) if head_dim in (64, 128) else None


# ---------------------------------------------------------------------------------------------
# One entry point


def default_config(arch: str, direction: str, dtype: str, head_dim: int) -> Config | None:
    """The default tile and options of ``arch``'s ``direction`` kernel for ``dtype`` at ``head_dim``;
    None where the family has no default there (a dtype it does not take, a head dim without a
    tile)."""
    if dtype == "e4m3" and (direction != "fwd" or arch not in FP8_FAMILIES):
        return None
    if arch == "sm80":
        return sm80_fwd_config(head_dim) if direction == "fwd" else sm80_bwd_config(head_dim)
    if arch == "sm90":
        return sm90_fwd_config(dtype, head_dim) if direction == "fwd" else sm90_bwd_config(head_dim)
    if arch == "sm100":
        return sm100_fwd_config(head_dim) if direction == "fwd" else sm100_bwd_config(head_dim)
    raise ValueError(f"arch={arch!r} is not one of {ARCHS}")


def default_spec(
    arch: str,
    direction: str,
    dtype: str,
    head_dim: int,
    *,
    causal: bool = False,
    head_dim_v: int | None = None,
) -> VariantSpec | None:
    """The default variant of ``arch``'s ``direction`` kernel for a problem (q and k of ``head_dim``,
    v of ``head_dim_v``, equal unless given: the tile of ``head_dim``), or None."""
    config = default_config(arch, direction, dtype, head_dim)
    if head_dim_v is not None and head_dim_v != head_dim:
        config = separate_v_config(arch, direction, dtype, head_dim, head_dim_v) or config
    mask = Mask.CAUSAL if causal else Mask.NONE
    if config is None:
        return None
    return config.spec(arch, direction, dtype, head_dim, mask=mask, head_dim_v=head_dim_v)


def separate_v_config(arch: str, direction: str, dtype: str, head_dim: int, head_dim_v: int) -> Config | None:
    """The default of a (head_dim, head_dim_v) pair where it is not ``head_dim``'s tile; None where
    it is. sm90's 16-bit forward of (192, 128): 128 keys a tile, as FlashAttention-3's tile for head
    dims up to 192 with a V head dim up to 128 (V, O and P V's accumulator take 128 columns, not
    192, which leaves the registers and the shared memory of hd192's 96 keys a tile to 128). H100,
    batch 2 x 8192, 16 heads, bf16, each variant called directly beside FA4, TFLOP/s non-causal /
    causal: 128x96 629 / 594, 128x112 646 / 610, 128x128 702 / 649, 128x128 without ping-pong
    680 / 638, 128x128 with paired conversions 614 / 617; FA4 696 / 663."""
    if (arch, direction, head_dim, head_dim_v) == ("sm90", "fwd", 192, 128) and dtype in ("fp16", "bf16"):
        return Config(Tile(128, 128, 2, 12), Sm90FwdOptions(schedule=Schedule.OVERLAP_PINGPONG))
    return None


def small_smem_configs(arch: str, direction: str, dtype: str, head_dim: int) -> tuple[Config, ...]:
    """The tiles committed for GPUs whose shared memory does not hold the default (only the sm80
    family runs on such GPUs: :func:`sm80_small_smem_configs`)."""
    if arch != "sm80" or dtype == "e4m3":
        return ()
    return sm80_small_smem_configs(direction, head_dim)


def default_tile(arch: str, head_dim: int, dtype: str | None = None) -> Tile | None:
    """The forward default tile of ``arch`` at ``head_dim`` for ``dtype`` (a 16-bit dtype when
    None); None without a default."""
    config = default_config(arch, "fwd", dtype or "fp16", head_dim)
    return None if config is None else config.tile


# Read-only views of the default tiles per family and head dim (16-bit forward; backward).
DEFAULT_TILES: dict[str, dict[int, Tile]] = {
    arch: {hd: c.tile for hd in HEAD_DIMS if (c := default_config(arch, "fwd", "fp16", hd)) is not None}
    for arch in ARCHS
}
DEFAULT_BWD_TILES: dict[str, dict[int, Tile]] = {
    arch: {hd: c.tile for hd in HEAD_DIMS if (c := default_config(arch, "bwd", "fp16", hd)) is not None}
    for arch in ARCHS
}


# ---------------------------------------------------------------------------------------------
# The candidate grid: the tiles and options ``cutefa list --all`` enumerates (the rules sort them)


def _sm90_fwd_grid_options() -> tuple[Sm90FwdOptions, ...]:
    """The sm90 16-bit forward's schedules: every schedule on a grid of one CTA per tile or
    persistent; the overlap schedules with O rescaled under S = Q K^T and/or P converted in pairs,
    on either; the overlap schedules on the longest-first 1-D grid; ping-pong with the lazy O
    rescale. Each with every exp2 on MUFU and with a quarter emulated."""
    grid = (Scheduler.GRID, Scheduler.PERSISTENT)
    both = (Schedule.OVERLAP, Schedule.OVERLAP_PINGPONG)
    records = [Sm90FwdOptions(schedule=s, scheduler=g) for s in Schedule for g in grid]
    records += [
        Sm90FwdOptions(schedule=s, scheduler=g, early_rescale=early, pair_cvt=pair)
        for s in both for g in grid for early, pair in ((True, False), (False, True), (True, True))
    ]  # fmt: skip
    records += [
        Sm90FwdOptions(schedule=s, scheduler=Scheduler.LPT, early_rescale=early, pair_cvt=pair)
        for s in both for early, pair in ((False, False), (False, True), (True, True))
    ]  # fmt: skip
    lazy = Sm90FwdOptions(schedule=Schedule.OVERLAP_PINGPONG, pair_cvt=True, lazy_rescale=True)
    records += [
        lazy,
        lazy.replace(early_rescale=True),
        lazy.replace(early_rescale=True, scheduler=Scheduler.LPT),
    ]
    records.append(Sm90FwdOptions(schedule=Schedule.OVERLAP_PINGPONG, lazy_rescale=True))
    return tuple(r.replace(exp_emu=emu) for r in records for emu in (0, 25))


def _sm90_fp8_fwd_grid_options() -> tuple[Sm90Fp8FwdOptions, ...]:
    """The sm90 e4m3 forward's schedules on either scheduler (and ping-pong with the lazy
    rescale), with the hoisted transpose, per-tensor and block descales, each exp2 share."""
    hoisted = VTranspose.HOISTED
    records = [
        Sm90Fp8FwdOptions(schedule=s, scheduler=g, v_transpose=hoisted)
        for s in Schedule for g in (Scheduler.GRID, Scheduler.PERSISTENT)
    ]  # fmt: skip
    records.append(
        Sm90Fp8FwdOptions(schedule=Schedule.OVERLAP_PINGPONG, v_transpose=hoisted, lazy_rescale=True)
    )
    return tuple(r.replace(quant=q, exp_emu=emu) for r in records for q in Quant for emu in (0, 25))


@functools.cache
def _grid() -> tuple[
    dict[tuple[str, str], tuple[Tile, ...]], dict[tuple[str, str, bool], tuple[Options, ...]]
]:
    """(tiles per (family, direction), option records per (family, direction, e4m3)) of the candidate
    grid; built on first use (a dense call never enumerates the grid)."""
    sm80_tiles = tuple(
        Tile(m, n, s, w) for m in (64, 128) for n in (32, 64, 128) for s in (1, 2) for w in (4, 8)
    )
    # FA3: one producer warpgroup plus one consumer warpgroup per 64 query rows.
    sm90_fwd_tiles = tuple(
        Tile(m, n, 2, 4 * (m // 64 + 1)) for m in (64, 128, 192) for n in range(64, 193, 16)
    )
    sm90_bwd_tiles = (
        *(Tile(m, 128, s, 12) for m in (64, 128) for s in (2, 3)),
        *(Tile(64, 64, s, 12) for s in (2, 3)),
        Tile(64, 96, 2, 12),  # the swapped-dK/dV partition (hd192)
        Tile(80, 128, 2, 12),  # hd128 with dQ transposed
    )
    # FA4: 16 warps (two softmax warpgroups, correction, MMA, load, epilogue).
    sm100_fwd_tiles = tuple(Tile(m, n, s, 16) for m in (128, 256) for n in (64, 128) for s in (2, 3))

    tiles: dict[tuple[str, str], tuple[Tile, ...]] = {
        ("sm80", "fwd"): sm80_tiles,
        ("sm80", "bwd"): sm80_tiles,
        ("sm90", "fwd"): sm90_fwd_tiles,
        ("sm90", "bwd"): sm90_bwd_tiles,
        ("sm100", "fwd"): sm100_fwd_tiles,
        ("sm100", "bwd"): (Tile(*SM100_BWD_TILE),),
    }
    options: dict[tuple[str, str, bool], tuple[Options, ...]] = {
        ("sm80", "fwd", False): (Sm80FwdOptions(),),
        ("sm80", "bwd", False): (
            Sm80BwdOptions(),
            Sm80BwdOptions(dq_layout=DqLayout.QUAD),
            Sm80BwdOptions(dq_layout=DqLayout.TILE),
            Sm80BwdOptions(dq_layout=DqLayout.TILE, dq_pipe=True),
        ),
        ("sm90", "fwd", False): _sm90_fwd_grid_options(),
        ("sm90", "fwd", True): _sm90_fp8_fwd_grid_options(),
        # the default schedule and overlap (a query block's dQ WGMMA stays in flight behind the next
        # block's S^T/dP^T WGMMAs), each on every dQ path; the dQ-writer warp's with LSE2/D read ahead
        ("sm90", "bwd", False): (
            *(
                Sm90BwdOptions(overlap=ov, dq_path=p)
                for p in (DqPath.RED, DqPath.BULK, DqPath.BULK_WARP)
                for ov in (False, True)
            ),
            *(
                Sm90BwdOptions(overlap=ov, dq_path=DqPath.BULK_WARP, row_prefetch=True)
                for ov in (False, True)
            ),
            Sm90BwdOptions(dq_path=DqPath.BULK_STAGED),
        ),
        ("sm100", "fwd", False): tuple(
            Sm100FwdOptions(cta_pair=p, exp_emu=e) for p in (False, True) for e in (0, 25)
        ),
        ("sm100", "fwd", True): tuple(
            Sm100FwdOptions(cta_pair=p, exp_emu=e) for p in (False, True) for e in (0, 25)
        ),
        ("sm100", "bwd", False): (Sm100BwdOptions(),),
    }
    return tiles, options


def candidate_dtypes(arch: str, direction: str) -> tuple[str, ...]:
    """The dtypes a family's ``direction`` kernel may take (e4m3: forward of the fp8 families)."""
    return DTYPES if direction == "fwd" and arch in FP8_FAMILIES else ("fp16", "bf16")


def candidate_grid(arch: str, direction: str = "fwd") -> list[VariantSpec]:
    """Every spec of the raw product (dtypes x head dims x tiles x masks x option records) of
    ``arch``'s ``direction`` kernel, valid or not; the forward's tiles include each dtype's default
    tiles where the grid lacks them."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not one of {ARCHS}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} is not one of {DIRECTIONS}")
    grid_tiles, grid_options = _grid()
    grid = grid_tiles[(arch, direction)]
    specs = []
    for dtype in candidate_dtypes(arch, direction):
        own = {c.tile for hd in HEAD_DIMS if (c := default_config(arch, direction, dtype, hd)) is not None}
        tiles = grid + tuple(sorted(own - set(grid)))
        specs += [
            VariantSpec(arch, direction, dtype, head_dim, *tile, mask=mask, options=options)
            for head_dim in HEAD_DIMS
            for tile in tiles
            for mask in (Mask.NONE, Mask.CAUSAL)
            for options in grid_options[(arch, direction, dtype == "e4m3")]
        ]
    return specs
