"""The measured alternatives: variants that benchmarks and tuning time beside the committed set, and
that dispatch never runs unless a tuned table names one (then it is committed).

They are not in generated/: they render on demand into the compile cache, and

    python3 tools/alternatives.py --out DIR      # every committed variant and alternative, rendered
    python3 tools/alternatives.py --list          # their names

renders them for review. :func:`all_variants` (the committed set plus these) is what the side-by-side
tools (tools/bench.py, tools/bench_fp8.py --all-variants, tools/bench_bwd_variants.py) and the
compile tests choose from. Each entry is (tile, option record) and gives a causal and a non-causal
variant; the comments carry what was measured (docs/log/perf-notes.md has each run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cutefa.model.committed import default_variants
from cutefa.model.defaults import Config, Tile, default_config, sm80_bwd_options
from cutefa.model.options import (
    DqLayout,
    DqPath,
    Mask,
    OAccum,
    Options,
    RowSum,
    Schedule,
    Scheduler,
    Sm80BwdOptions,
    Sm90BwdOptions,
    Sm90Fp8FwdOptions,
    Sm90FwdOptions,
    VTranspose,
)
from cutefa.model.rules import why_invalid
from cutefa.model.spec import ARCHS, DIRECTIONS, VariantSpec

SERIAL, OV, PP, OV_PP = Schedule.SERIAL, Schedule.OVERLAP, Schedule.PINGPONG, Schedule.OVERLAP_PINGPONG
PERSIST, LPT = Scheduler.PERSISTENT, Scheduler.LPT
HOISTED, WIDE = VTranspose.HOISTED, VTranspose.WIDE
BULK, BULK_WARP = DqPath.BULK, DqPath.BULK_WARP
Alternative = tuple[Tile, Options]


def fwd16(schedule: Schedule = OV_PP, **fields: object) -> Sm90FwdOptions:
    return Sm90FwdOptions(schedule=schedule, **fields)


def fp8(schedule: Schedule, v_transpose: VTranspose = HOISTED, **fields: object) -> Sm90Fp8FwdOptions:
    return Sm90Fp8FwdOptions(schedule=schedule, v_transpose=v_transpose, **fields)


# ---------------------------------------------------------------------------------------------
# sm90 16-bit forward (fp16 and bf16)

# Schedules on the default tile, so the benchmark shows what each one buys; the persistent
# longest-first scheduler where O's own staging buffer fits shared memory (hd256's 128x64 tile
# would need 257 KiB); a quarter of the exp2 on the FMA units (as the sm100 family does): at hd64
# MUFU.EX2 (16 per clock per SM) takes as long as the two MMAs of a block.
SCHEDULE_ALTERNATIVES: dict[int, tuple[Sm90FwdOptions, ...]] = {
    64: (
        fwd16(SERIAL),
        fwd16(OV),
        fwd16(PP),
        fwd16(scheduler=PERSIST),
        fwd16(exp_emu=25),
        fwd16(OV, exp_emu=25),
    ),
    128: (fwd16(SERIAL), fwd16(OV), fwd16(PP), fwd16(scheduler=PERSIST), fwd16(exp_emu=25)),
    256: (fwd16(SERIAL), fwd16(OV), fwd16(PP)),
}
# Longer key steps with the default schedule amortize each step's fixed costs (row reductions,
# barriers, pipeline waits): hd64 192 keys (estimate 224 registers) compiles with no spill (sm_90a,
# DSL 4.8.1); hd256 80 keys (236; FlashAttention-3's hd256 tile) too, fp16 and bf16.
_PCVT = fwd16(pair_cvt=True)
TILE_SCHEDULE_ALTERNATIVES: dict[int, tuple[Alternative, ...]] = {
    64: (
        (Tile(128, 192, 2, 12), fwd16()),
        # three consumer warpgroups of 64 rows (FlashAttention-4's sm90 hd64 tile), with the
        # overlap schedule, alone and with the consumers taking turns issuing their MMAs
        (Tile(192, 128, 2, 16), fwd16(OV)),
        (Tile(192, 128, 2, 16), fwd16()),
        # the 128x192 tile converts P one score per instruction in bf16 (240 of 280 F2FP
        # element-wise, P V issued in 39 groups): its pair_cvt twin
        (Tile(128, 192, 2, 12), _PCVT),
        # a longest-first 1-D grid in L2 sections of (head, batch) pairs
        (Tile(192, 128, 2, 16), fwd16(OV, scheduler=LPT)),
        (Tile(192, 128, 2, 16), fwd16(scheduler=LPT)),
        # the table's three-consumer tile with the lazy O rescale
        (Tile(192, 128, 2, 16), fwd16(lazy_rescale=True)),
    ),
    # hd96's default tile converts in pairs already; with pair_cvt its unmasked loop is 434
    # instructions per block instead of 467 (fewer uniform-datapath ones), R219 -> R184.
    96: ((Tile(128, 128, 2, 12), _PCVT),),
    # hd128 with longer key tiles (FlashAttention-3's non-causal hd128 tile is 128x176): half the
    # per-block fixed costs per FLOP. With the DSL's conversion 128x176 spills; with pair_cvt every
    # tile_n up to 192 fits 240 registers (budgets_sm90.SM90_PCVT_NO_SPILL). pair_cvt also shortens
    # the 128x128 tile's loops (unmasked 494 -> 457 instructions per block, R223 -> R190). The
    # table's causal tiles (128x128, 128x160) also on the longest-first 1-D grid, and its long tiles
    # with the lazy O rescale.
    128: (
        *((Tile(128, n, 2, 12), _PCVT) for n in (128, 144, 160, 176, 192)),
        *((Tile(128, n, 2, 12), _PCVT.replace(scheduler=LPT)) for n in (128, 160)),
        *((Tile(128, n, 2, 12), _PCVT.replace(lazy_rescale=True)) for n in (160, 176)),
    ),
    # The default hd192 128x96 tile converts P one score per instruction in bf16 (120 of 180 F2FP
    # element-wise, P V issued in 21 groups): its pair_cvt twin.
    192: ((Tile(128, 96, 2, 12), _PCVT),),
    # hd256 128x80 closer to FlashAttention-4's sm90 forward: overlap without ping-pong (its
    # scheduler barrier is off above head dim 128), P converted two scores per instruction, O
    # rescaled under S = Q K^T (early_rescale; without pair_cvt its causal form makes ptxas
    # serialize every WGMMA, C7520); the table's causal schedules on the longest-first 1-D grid
    # (with the DSL's conversion, 128x80 causal overlap on that grid spills 31 registers and
    # serializes its WGMMAs: pair_cvt there); the table's schedules with O rescaled only when a
    # warp's row max moves by more than 2^8 (hd256 rescales 128 accumulators per thread every block).
    256: tuple(
        (Tile(128, 80, 2, 12), options)
        for options in (
            fwd16(),
            fwd16(OV),
            fwd16(OV, pair_cvt=True),
            _PCVT,
            fwd16(OV, early_rescale=True, pair_cvt=True),
            fwd16(early_rescale=True, pair_cvt=True),
            fwd16(OV, pair_cvt=True, scheduler=LPT),
            fwd16(early_rescale=True, pair_cvt=True, scheduler=LPT),
            fwd16(early_rescale=True, pair_cvt=True, lazy_rescale=True),
            fwd16(early_rescale=True, pair_cvt=True, scheduler=LPT, lazy_rescale=True),
        )
    ),
}

# ---------------------------------------------------------------------------------------------
# sm90 e4m3 forward (tools/bench_fp8.py --all-variants)

# Deeper rings (3-4 stages) give the V transpose and the K/V loads more than half a key block of
# slack; hd128's tile_n 160 amortizes each block's fixed costs but spills with the overlap schedule
# at 232 registers, so it runs ping-pong only. Every entry compiles for sm_90a with no spill
# (tests/test_compile_sm90_fp8.py); those over the register estimate are
# budgets_sm90.SM90_FP8_NO_SPILL.
_LAZY = {"lazy_rescale": True}
FP8_ALTERNATIVES: dict[int, tuple[Alternative, ...]] = {
    128: (
        (Tile(128, 128, 2, 12), fp8(OV_PP)),
        (Tile(128, 128, 3, 12), fp8(OV_PP)),
        (Tile(128, 128, 3, 12), fp8(OV_PP, exp_emu=25)),
        (Tile(128, 160, 3, 12), fp8(PP)),
        # the default tile and schedule with the indexed V transpose (per-word swizzled addresses):
        # what the hoisted transpose buys ("fp8 forward: where the instructions go")
        (Tile(128, 128, 3, 12), fp8(OV, VTranspose.INDEXED)),
        # and with the wide transpose (64-bit LDS/STS, 8x8-byte units: half the producer's
        # shared-memory instructions; "fp8 wide transpose")
        (Tile(128, 128, 3, 12), fp8(OV, WIDE)),
        # O rescaled only when a warp's row max moves (the default rescales 64 accumulators per
        # thread every key block)
        (Tile(128, 128, 3, 12), fp8(OV, **_LAZY)),
        # three consumer warpgroups of 64 rows over 96 keys (512 threads, consumers at 160
        # registers: R157, no spill): three softmax chains per SM instead of two ("fp8 hd128 with
        # three consumer warpgroups"), with and without lazy_rescale; causal too since the causal
        # mask is one select per score (R147, no spill; "fp8 causal: the select mask")
        (Tile(192, 96, 2, 16), fp8(OV)),
        (Tile(192, 96, 2, 16), fp8(OV, **_LAZY)),
        # on the persistent scheduler: the producer loads the next tile's first K/V block and Q
        # while the consumers finish the last P V and store O ("fp8: where the fixed cost goes")
        (Tile(192, 96, 2, 16), fp8(OV, scheduler=PERSIST, **_LAZY)),
        # the row sums by a WGMMA against ones: one P x ones product per key block instead of a
        # floating-point add per probability (-44 of 383 instructions per key block and consumer
        # warp; "fp8: the row sums on the tensor cores"); on the persistent scheduler no gain
        (Tile(192, 96, 2, 16), fp8(OV, row_sum=RowSum.MMA, **_LAZY)),
        # O accumulated in two levels (the tensor cores sum fp8_two_level.PROMOTE_BLOCKS key blocks, then
        # fp32 in shared memory, 96 KiB more), with the persistent scheduler and with the row sums
        # by WGMMA ("fp8: O accumulated in two levels")
        (Tile(192, 96, 2, 16), fp8(OV, o_accum=OAccum.TWO_LEVEL, **_LAZY)),
        (Tile(192, 96, 2, 16), fp8(OV, scheduler=PERSIST, o_accum=OAccum.TWO_LEVEL, **_LAZY)),
        (Tile(192, 96, 2, 16), fp8(OV, row_sum=RowSum.MMA, o_accum=OAccum.TWO_LEVEL, **_LAZY)),
        # taking v's column means for centered v (flash_attn_func(v_mean=)): the means added in
        # the epilogue instead of by a pass over O after the kernel ("fp8: centered v through
        # dispatch")
        (Tile(192, 96, 2, 16), fp8(OV, v_mean=True, **_LAZY)),
        (Tile(192, 96, 2, 16), fp8(OV, scheduler=PERSIST, v_mean=True, **_LAZY)),
    ),
    256: (
        # the default tile and schedule without lazy_rescale (the default before it), with 2 and
        # 4 stages, with the indexed and with the wide transpose
        (Tile(128, 64, 3, 12), fp8(OV_PP)),
        (Tile(128, 64, 2, 12), fp8(OV_PP)),
        (Tile(128, 64, 3, 12), fp8(OV_PP, VTranspose.INDEXED)),
        (Tile(128, 64, 4, 12), fp8(OV_PP)),
        (Tile(128, 64, 3, 12), fp8(OV_PP, WIDE)),
        # 1.5x longer key blocks in the 240 registers the hoisted transpose can leave the consumers
        # (budgets_sm90.sm90_fp8_consumer_regs): 128x96 (R231-R233, no spill; 177 KiB, so 2
        # stages), with and without ping-pong, with lazy_rescale and its persistent twin: -6 to +2%
        # against the 3-stage 128x64 tile without lazy_rescale ("fp8 240/24 measured"); with
        # lazy_rescale -3 to +7% against the default (+6-7% at 16k)
        (Tile(128, 96, 2, 12), fp8(OV_PP)),
        (Tile(128, 96, 2, 12), fp8(OV)),
        (Tile(128, 96, 2, 12), fp8(OV_PP, **_LAZY)),
        (Tile(128, 96, 2, 12), fp8(OV_PP, scheduler=PERSIST, **_LAZY)),
        # with the row sums by WGMMA (-42 of 464 instructions per key block; -3 to +3%)
        (Tile(128, 96, 2, 12), fp8(OV_PP, row_sum=RowSum.MMA, **_LAZY)),
        # FlashAttention-3's fp8 hd256 tile, 128 keys per block (R231 of 240, no spill; 225 KiB
        # with 2 stages; the register estimate says 256): with lazy_rescale, its persistent twin,
        # and its twin without lazy_rescale; -1 to +5% against 128x96 (+3% at 4k non-causal), the
        # tuned table takes it above 4k ("fp8: FlashAttention-3's longer key blocks")
        (Tile(128, 128, 2, 12), fp8(OV_PP, **_LAZY)),
        (Tile(128, 128, 2, 12), fp8(OV_PP, scheduler=PERSIST, **_LAZY)),
        (Tile(128, 128, 2, 12), fp8(OV_PP)),
        # the tuned tile and its persistent twin taking v's column means, as hd128's
        (Tile(128, 96, 2, 12), fp8(OV_PP, v_mean=True, **_LAZY)),
        (Tile(128, 96, 2, 12), fp8(OV_PP, scheduler=PERSIST, v_mean=True, **_LAZY)),
    ),
}

# ---------------------------------------------------------------------------------------------
# sm80 forward (fp16 and bf16): tiles with the default options

SM80_TUNING_ALTERNATIVES: dict[int, tuple[Tile, ...]] = {
    64: (Tile(128, 128, 1, 8),),
    128: (Tile(128, 64, 1, 8), Tile(128, 64, 2, 8), Tile(64, 64, 1, 4)),
    256: (Tile(64, 64, 1, 4),),
}

# ---------------------------------------------------------------------------------------------
# sm100 forward (fp16 and bf16): the CTA pair (2-SM UMMA) on the default tile of each head dim >=
# 128, so that a Blackwell run can compare them; the defaults stay single-CTA until a measurement
# says otherwise (docs/design/sm100.md gives the predicted effect).

PAIR_ALTERNATIVES: tuple[int, ...] = (128, 192, 256)

# ---------------------------------------------------------------------------------------------
# Backward

# sm80 (fp16 and bf16, each tile with the default options for its stages): a double-buffered Q
# tile (stages=2, FlashAttention-2's design): the next query block's Q loads during a whole step,
# dO during the dQ and dK GEMMs. hd64's default has 128 query rows per step (FA2's "slightly
# faster" hd64 tile: 0.45 ldmatrix per mma.sync instead of 0.55 and half the barriers per FLOP; 255
# registers, no spill on sm_80 and sm_90a); 64 rows, single- and double-buffered, and 128 rows
# single-buffered stay beside it. hd256 double-buffered (182 KiB, over the A100's 163: it runs on
# sm_90a and newer) is FlashAttention-2's tile on the H100; the default there until the
# single-buffered tile with dq_pipe measured 3-6% ahead of it ("sm80 backward: the dQ reductions
# between the dQ MMAs").
SM80_BWD_TUNING_ALTERNATIVES: dict[int, tuple[Tile, ...]] = {
    64: (Tile(64, 128, 1, 8), Tile(64, 128, 2, 8), Tile(128, 128, 1, 8)),
    128: (Tile(64, 128, 2, 8),),
    192: (Tile(64, 64, 2, 8),),
    256: (Tile(64, 64, 2, 8),),
}

# Backward alternatives in bf16 (the dtype the benchmark measures), so that one GPU run can time
# each beside the default. sm90 hd64 and hd128: the per-thread dQ reductions (the default before the
# bulk path) on the default tile and with a 3-stage ring, each with and without the overlap
# schedule, and the bulk path with the overlap schedule (the 32 KiB of dQ staging fit beside the
# 2-stage ring (202 and 200 KiB), not beside a 3-stage one); the dQ-writer warp on the tuned
# table's tile ("A dQ-writer warp"), with LSE2/D read ahead of the WGMMA waits ("LSE2 and D read
# ahead of the waits") and with FlashAttention-4's issue order (dV before the barrier, dK under dQ).
_RED = Sm90BwdOptions()
_OV = Sm90BwdOptions(overlap=True)


def _bwd(
    *, overlap: bool = False, dq_path: DqPath = DqPath.RED, row_prefetch: bool = False
) -> Sm90BwdOptions:
    return Sm90BwdOptions(overlap=overlap, dq_path=dq_path, row_prefetch=row_prefetch)


_WRITER_WARP = (
    _bwd(dq_path=BULK_WARP), _bwd(dq_path=BULK_WARP, row_prefetch=True),
    _bwd(overlap=True, dq_path=BULK_WARP), _bwd(overlap=True, dq_path=BULK_WARP, row_prefetch=True),
)  # fmt: skip
SM90_BWD_ALTERNATIVES: dict[int, tuple[Alternative, ...]] = {
    64: (
        *((Tile(128, 128, s, 12), o) for o in (_RED, _OV) for s in (2, 3)),
        (Tile(128, 128, 2, 12), _bwd(overlap=True, dq_path=BULK)),
        *((Tile(128, 128, 2, 12), o) for o in _WRITER_WARP),
    ),
    128: (
        *((Tile(64, 128, s, 12), o) for o in (_RED, _OV) for s in (2, 3)),
        (Tile(64, 128, 2, 12), _bwd(overlap=True, dq_path=BULK)),
        # FlashAttention-4's non-causal hd128 tile: 80 query rows per step, dQ transposed
        # (budgets_sm90.sm90_bwd_dq_swapped; "hd128 backward beside FA4's configuration")
        (Tile(80, 128, 2, 12), _bwd(dq_path=BULK)),
        *((Tile(64, 128, 2, 12), o) for o in _WRITER_WARP),
    ),
    # The head-dim split (head dim 192's default before the swapped partition) with per-thread dQ
    # reductions and the bulk path (its 48 KiB of dQ staging fill the 2-stage struct up to the
    # opt-in limit exactly), each with and without the overlap (each consumer issues dV and dK over
    # its own 32 queries with P^T, dS^T as register operands before the per-block barrier); the
    # swapped partition (64x96, FlashAttention-3's hd192 tile) with per-thread reductions and with
    # the bulk path staged in the current Q/dO stage (no extra shared memory).
    192: (
        (Tile(64, 64, 2, 12), _RED),
        (Tile(64, 64, 2, 12), _OV),
        (Tile(64, 64, 2, 12), _bwd(dq_path=BULK)),
        (Tile(64, 64, 2, 12), _bwd(overlap=True, dq_path=BULK)),
        (Tile(64, 96, 2, 12), _RED),
        (Tile(64, 96, 2, 12), _bwd(dq_path=BULK)),
    ),
    # the head-dim split as head dim 256's default was before the bulk path (hd256 stages dQ in
    # each consumer's own columns of the Q/dO stage)
    256: ((Tile(64, 64, 2, 12), _RED), (Tile(64, 64, 2, 12), _OV), (Tile(64, 64, 2, 12), _bwd(dq_path=BULK))),
}
# sm80, bf16: 16-byte dQ reductions into a column-permuted accumulator (DqLayout.QUAD:
# FlashAttention-2 adds dQ with one warp-wide reduction per contiguous 128-byte line of its permuted
# workspace) on the best tile of each head dim ("sm80 backward beside FlashAttention-2's
# configuration"), and beside them the same tiles in the accumulator's natural layout (the default
# before DqLayout.TILE), the twins the GPU tests compare both layouts with, bitwise.
SM80_BWD_ALTERNATIVES: dict[int, tuple[Alternative, ...]] = {
    hd: tuple((tile, Sm80BwdOptions(dq_layout=layout)) for layout in (DqLayout.QUAD, DqLayout.ROWS))
    for hd, tile in (
        (64, Tile(128, 128, 2, 8)),
        (128, Tile(64, 128, 1, 8)),
        (192, Tile(64, 64, 1, 8)),
        (256, Tile(64, 64, 1, 8)),
    )
}
# sm90 in fp16: the dQ-writer warp on the tiles where bf16's tuned table runs it (hd64 and hd128,
# +1-4% in bf16, "The dQ-writer warp measured"), the overlap schedule with and without it, and
# LSE2/D read ahead on the writer-warp tiles, so that fp16's table can pick them too.
SM90_FP16_BWD_ALTERNATIVES: dict[int, tuple[Alternative, ...]] = {
    hd: tuple((tile, o) for o in (_bwd(overlap=True, dq_path=BULK), *_WRITER_WARP))
    for hd, tile in ((64, Tile(128, 128, 2, 12)), (128, Tile(64, 128, 2, 12)))
}


# ---------------------------------------------------------------------------------------------
# Assembly


def _pairs() -> list[tuple[str, str, tuple[str, ...], int, Alternative]]:
    """(arch, direction, dtypes, head_dim, (tile, options)) of every alternative."""
    out: list[tuple[str, str, tuple[str, ...], int, Alternative]] = []
    sixteen = ("fp16", "bf16")
    for hd, records in SCHEDULE_ALTERNATIVES.items():
        tile = default_config("sm90", "fwd", "fp16", hd).tile
        out += [("sm90", "fwd", sixteen, hd, (tile, o)) for o in records]
    out += [
        ("sm90", "fwd", sixteen, hd, alt) for hd, alts in TILE_SCHEDULE_ALTERNATIVES.items() for alt in alts
    ]
    out += [("sm90", "fwd", ("e4m3",), hd, alt) for hd, alts in FP8_ALTERNATIVES.items() for alt in alts]
    out += [
        ("sm80", "fwd", sixteen, hd, (tile, default_config("sm80", "fwd", "fp16", hd).options))
        for hd, tiles in SM80_TUNING_ALTERNATIVES.items() for tile in tiles
    ]  # fmt: skip
    for hd in PAIR_ALTERNATIVES:
        config: Config = default_config("sm100", "fwd", "fp16", hd)
        out.append(("sm100", "fwd", sixteen, hd, (config.tile, config.options.replace(cta_pair=True))))
    out += [
        ("sm80", "bwd", sixteen, hd, (tile, sm80_bwd_options(hd, tile.stages)))
        for hd, tiles in SM80_BWD_TUNING_ALTERNATIVES.items() for tile in tiles
    ]  # fmt: skip
    out += [("sm90", "bwd", ("bf16",), hd, alt) for hd, alts in SM90_BWD_ALTERNATIVES.items() for alt in alts]
    out += [("sm80", "bwd", ("bf16",), hd, alt) for hd, alts in SM80_BWD_ALTERNATIVES.items() for alt in alts]
    out += [
        ("sm90", "bwd", ("fp16",), hd, alt) for hd, alts in SM90_FP16_BWD_ALTERNATIVES.items() for alt in alts
    ]
    return out


def alternative_variants(arch: str | None = None, direction: str | None = None) -> list[VariantSpec]:
    """Every measured alternative (of ``arch`` and ``direction`` when given), causal and not where
    the family's rules allow both, sorted; some are committed too (where a tuned table names them)."""
    specs = {
        VariantSpec(a, d, dtype, hd, *tile, mask=mask, options=options)
        for a, d, dtypes, hd, (tile, options) in _pairs()
        if arch in (None, a) and direction in (None, d)
        for dtype in dtypes
        for mask in (Mask.NONE, Mask.CAUSAL)
    }
    return sorted(s for s in specs if why_invalid(s) is None)


def fp8_alternative_specs(arch: str = "sm90") -> list[VariantSpec]:
    """The e4m3 forward alternatives of ``arch`` (:data:`FP8_ALTERNATIVES`)."""
    return [s for s in alternative_variants(arch, "fwd") if s.dtype == "e4m3"]


def all_variants(arch: str | None = None, direction: str | None = None) -> list[VariantSpec]:
    """The committed set plus the measured alternatives (of ``arch`` and ``direction`` when given), sorted."""
    archs = ARCHS if arch is None else (arch,)
    committed = {s for a in archs for s in default_variants(a, direction)}
    return sorted(committed | set(alternative_variants(arch, direction)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHS)
    parser.add_argument("--direction", choices=DIRECTIONS)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="render every committed variant and alternative into DIR")
    group.add_argument(
        "--list", action="store_true", help="print the alternatives' names (committed ones marked)"
    )
    args = parser.parse_args(argv)
    if args.list:
        committed = {
            s for a in ((args.arch,) if args.arch else ARCHS) for s in default_variants(a, args.direction)
        }
        for spec in alternative_variants(args.arch, args.direction):
            print(spec.name + ("  (committed)" if spec in committed else ""))
        return 0
    from cutefa import codegen

    specs = all_variants(args.arch, args.direction)
    codegen.generate(specs, args.out, complete=args.arch is None and args.direction is None)
    print(f"rendered {len(specs)} variants into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
