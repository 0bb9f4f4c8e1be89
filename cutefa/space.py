"""The variant space: enumeration per arch, the one validity predicate, the committed default set.

:func:`why_invalid` is the only place that decides whether a spec can be built. Enumeration, the
CLI, code generation and dispatch all ask it. Each resource budget is its own function
(:func:`smem_bytes`, :func:`est_registers`) so callers can print the numbers behind a verdict.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

from cutefa.spec import ARCHS, DIRECTIONS, DTYPES, HEAD_DIMS, TARGETS, VariantSpec

# Kernel templates that exist, (arch, direction) -> dtypes they handle. Mirrors templates/.
IMPLEMENTED: dict[tuple[str, str], tuple[str, ...]] = {
    ("sm80", "fwd"): ("fp16", "bf16"),
    ("sm80", "bwd"): ("fp16", "bf16"),
    ("sm90", "fwd"): ("fp16", "bf16", "e4m3"),
}

# Families whose tensor cores take fp8 operands; e4m3 is a forward-only dtype there.
FP8_FAMILIES = ("sm90", "sm100")
# Dtypes whose committed variants are the default tile and schedule only (no alternatives).
DEFAULT_ONLY_DTYPES = ("e4m3",)

SM80_SMEM_LIMIT = 163 * 1024  # A100 per-block opt-in limit: the sm80 family's defaults fit the A100
SMEM_RESERVE = 1024  # alignment slack of the shared-storage struct (1 KiB swizzle atoms)
MAX_REGISTERS = 255  # per thread, on every family
SM80_REG_OVERHEAD = 64  # row max/sum, Q/K/V operand fragments in flight, addresses, counters
SM80_BWD_REG_OVERHEAD = 48  # backward: LSE/D rows, operand fragments in flight, addresses
SM90_SMEM_LIMIT = 227 * 1024  # H100/H200 per-block opt-in limit
# Per-block opt-in shared memory (cudaDevAttrMaxSharedMemoryPerBlockOptin) of the GPUs of each
# compile target: a variant runs on a target only if its shared memory fits (:func:`why_not_on`).
# The sm80 family runs on all of them, so its rule admits the largest (H100/H200/B200); tiles above
# the A100's 163 KiB run on sm_90a and newer only, as FlashAttention-2 picks its hd256 backward
# tile by the device's limit.
TARGET_SMEM_LIMITS = {
    "sm_80": SM80_SMEM_LIMIT,  # A100
    "sm_86": 99 * 1024,  # RTX 30xx / A40 / A10
    "sm_89": 99 * 1024,  # RTX 40xx / L40 / L4
    "sm_90a": SM90_SMEM_LIMIT,  # H100 / H200
    "sm_100a": 227 * 1024,  # B200
    "sm_103a": 227 * 1024,  # B300
}
assert set(TARGET_SMEM_LIMITS) == set(TARGETS)
SM80_FAMILY_SMEM_LIMIT = max(TARGET_SMEM_LIMITS.values())
SM90_CONSUMER_REGS = 240  # setmaxnreg budget of a consumer warpgroup (producer keeps 24)
SM90_CONSUMER_REGS_3WG = 160  # with three consumer warpgroups: 24 x 128 + 160 x 384 <= 64K registers
SM90_REG_OVERHEAD = 48  # row max/sum, descriptors, pipeline state, addresses
# With three consumer warpgroups (160 registers each) the same overhead held on compiled SASS
# (sm_90a, DSL 4.8.1) while a masked block's scores were selected through a branch per element:
# hd64 192x112 overlap (estimate 164) spilled 1-5 registers in fp16 (none in bf16), 192x128 (176)
# spilled 9 in bf16. The model stays as it is for the tiles nobody has compiled; the entries below
# have been, and stand in for it (see SM90_3WG_NO_SPILL).
# Three-consumer forwards (tile_m 192, 160 registers per consumer thread) that compile for sm_90a
# with no spill and keep the uniform datapath, fp16 and bf16, causal or not, with or without
# ping-pong: (head_dim, tile_n) of the overlap schedule, exp_emu 0, one CTA per tile. The
# overhead above is what ptxas spends with a 240-register budget (it schedules more freely when it
# may); held to 160, hd64 192x128 peaks at 151-152 registers (S 64 + P 32 + O 32 fp32/packed
# registers and ~24 of state), with the mask a select per element (kernels/common/mask.py) and the
# mask's row taken from the thread index (templates/fwd_sm90.py.j2). Checked by
# tests/test_compile_sm90_fwd_hd64_192.py.
SM90_3WG_NO_SPILL: frozenset[tuple[int, int]] = frozenset({(64, 128)})
# Two-consumer forwards whose key tile the estimate above rejects but which compile for sm_90a with
# no spill, six WGMMA arrives and waits and the uniform datapath kept, fp16 and bf16, causal or not:
# (head_dim, tile_n) of the overlap + ping-pong schedule with P converted two scores per instruction
# (pair_cvt), exp_emu 0, one CTA per tile. hd128 128x176 (FlashAttention-3's non-causal hd128 tile)
# peaks at R230-R236 of 240 and 128x192 at R234-R236; without pair_cvt 128x176 spills (182 local
# loads and stores) and ptxas issues P V one k-step at a time (36 arrives). Checked by
# tests/test_compile_sm90_fwd_pcvt.py.
SM90_PCVT_NO_SPILL: frozenset[tuple[int, int]] = frozenset({(128, 176), (128, 192)})
# The sm90 fp8 forward: the producer warpgroup keeps 40 registers for the on-chip V transpose, so
# the two consumer warpgroups get 232 (40 * 128 + 232 * 256 = 168 * 384, what the CTA holds at launch).
SM90_FP8_CONSUMER_REGS = 232
# With the hoisted 32-bit transpose (hoist_vt without wide_vt) the producer fits 24 registers (it
# peaks at R17-R27 on sm_90a with 40 to spare, at R21 when held to 24), so a tile that needs it can
# give the consumers 240 (24 * 128 + 240 * 256 = 168 * 384, as in the 16-bit kernels); the wide
# transpose's producer peaks at R35 and keeps 40. setmaxnreg only moves registers inside the CTA's
# launch allocation: a split that adds up to more than 168 * 384 (e.g. 32 * 128 + 240 * 256) makes
# the consumers' increase wait forever (tests/test_register_pool.py).
SM90_FP8_CONSUMER_REGS_HOISTED = 240


def sm90_fp8_consumer_regs(spec: VariantSpec) -> int:
    """The consumers' setmaxnreg budget of an sm90 fp8 forward (the producer gets the rest of the
    CTA's launch allocation): with two consumers (168 x 384) 240 where the tile's estimate exceeds
    232 and the hoisted 32-bit transpose lets the producer give up 16 more registers (24 left), 232
    otherwise (every default); with three (tile_m 192, 128 x 512 at launch) the 16-bit kernels'
    three-consumer budget, 160 (the producer keeps 32: 32 * 128 + 160 * 384 = 128 * 512). 160 holds
    O and S at hd128 with up to 96 keys (192x96 peaks at R157 on sm_90a, 192x128 spills)."""
    if spec.tile_m == 192:
        return sm90_consumer_regs(spec)
    if spec.hoist_vt and not spec.wide_vt and _sm90_registers(spec) > SM90_FP8_CONSUMER_REGS:
        return SM90_FP8_CONSUMER_REGS_HOISTED
    return SM90_FP8_CONSUMER_REGS


def sm90_fp8_producer_regs(spec: VariantSpec) -> int:
    """The producer warpgroup's setmaxnreg budget of an sm90 fp8 forward: what the CTA's launch
    allocation (65536 / threads rounded down to 8 registers, times threads) leaves beside the
    consumer warpgroups' :func:`sm90_fp8_consumer_regs` (40 beside two at 232, 24 beside two at 240,
    32 beside three at 160)."""
    launch = 65536 // spec.threads // 8 * 8
    consumers = spec.tile_m // 64
    return (launch * spec.threads - consumers * 128 * sm90_fp8_consumer_regs(spec)) // 128


SM90_FP8_MMA_K = 32  # k of an fp8 WGMMA: P V steps over keys 32 at a time
SM90_FP8_TRANSPOSE_THREADS = 128  # the producer warpgroup that transposes V (fp8.WG_THREADS)


class Tile(NamedTuple):
    """The tiling part of a spec."""

    tile_m: int
    tile_n: int
    stages: int
    warps: int


# FlashAttention-2's forward tiles on the A100, per head dim (flash_fwd_launch_template.h).
DEFAULT_TILES: dict[str, dict[int, Tile]] = {
    "sm80": {
        64: Tile(128, 64, 1, 4),
        96: Tile(128, 64, 1, 8),
        128: Tile(128, 128, 1, 8),
        192: Tile(128, 64, 1, 8),
        256: Tile(128, 64, 1, 8),
    },
}

# sm90 (FlashAttention-3 design): 2 consumer warpgroups x 64 rows; tile_n shrinks with head_dim so
# that S, P and O fit the 240 registers a consumer thread gets, and K/V stages fit 227 KiB.
DEFAULT_TILES["sm90"] = {
    64: Tile(128, 128, 2, 12),
    96: Tile(128, 128, 2, 12),
    128: Tile(128, 128, 2, 12),
    192: Tile(128, 96, 2, 12),
    256: Tile(128, 64, 2, 12),
}

# Schedule flags of the sm90 default (FlashAttention-3: intra-warpgroup overlap + ping-pong), and
# the other schedules committed on the default tile so the benchmark shows what each one buys.
DEFAULT_FLAGS: dict[str, dict[str, bool]] = {"sm90": {"overlap": True, "pingpong": True}}
SCHEDULE_ALTERNATIVES: dict[str, dict[int, tuple[dict[str, bool | int], ...]]] = {
    "sm90": {hd: ({}, {"overlap": True}, {"pingpong": True}) for hd in (64, 128, 256)},
}
# The persistent longest-first scheduler on the default schedule, where O's own staging buffer
# fits shared memory (hd256's 128x64 tile would need 257 KiB).
for _hd in (64, 128):
    SCHEDULE_ALTERNATIVES["sm90"][_hd] += ({"overlap": True, "pingpong": True, "persistent": True},)
# A quarter of the exp2 on the FMA units (as the sm100 family does): at hd64 MUFU.EX2 (16 per clock
# per SM) takes as long as the two MMAs of a block.
SCHEDULE_ALTERNATIVES["sm90"][64] += (
    {"overlap": True, "pingpong": True, "exp_emu": 25},
    {"overlap": True, "exp_emu": 25},
)
SCHEDULE_ALTERNATIVES["sm90"][128] += ({"overlap": True, "pingpong": True, "exp_emu": 25},)

# Forward flags a dtype's default variants set on top of the family's default extras. sm90 e4m3:
# the V transpose with its addresses hoisted out of the key loop (hoist_vt; +8-21% on the H200,
# docs/perf-notes.md, "The hoisted transpose as the fp8 default").
DEFAULT_DTYPE_FLAGS: dict[tuple[str, str], dict[str, object]] = {
    ("sm90", "e4m3"): {"hoist_vt": True},
}
# Forward default tiles of a dtype where they differ from DEFAULT_TILES. sm90 e4m3 hd128 and
# hd256: a third stage of the K, V and Vt rings (161 / 177 KiB) once the hoisted transpose is fast
# enough that the Vt ring's window binds (hd256 +3-8% on the H200, docs/perf-notes.md, "The
# hoisted transpose as the fp8 default").
DEFAULT_DTYPE_TILES: dict[tuple[str, str], dict[int, Tile]] = {
    ("sm90", "e4m3"): {128: Tile(128, 128, 3, 12), 256: Tile(128, 64, 3, 12)},
}
# Schedule and softmax flags of a dtype's default forward at a head dim, over DEFAULT_FLAGS. sm90
# e4m3 hd128: the overlap schedule without ping-pong on the 3-stage tile (+1-9% over overlap +
# ping-pong in three runs on the H200: with QGMMA at twice the 16-bit rate the forced alternation
# costs more than it hides); hd256: O rescaled only when a warp's row max moves (lazy_rescale: -2
# to +12%, +3% typical, in two runs on the H200; at hd128 within 1%, docs/perf-notes.md, "fp8: O
# rescaled only when a warp's row max moves").
DEFAULT_DTYPE_SCHEDULES: dict[tuple[str, str], dict[int, dict[str, bool]]] = {
    ("sm90", "e4m3"): {128: {"overlap": True, "pingpong": False}, 256: {"lazy_rescale": True}},
}


def default_tile(arch: str, head_dim: int, dtype: str | None = None) -> Tile | None:
    """The forward default tile of ``arch`` at ``head_dim``: DEFAULT_TILES, or the dtype's own
    (:data:`DEFAULT_DTYPE_TILES`) when ``dtype`` is given and has one; None without a default."""
    own = DEFAULT_DTYPE_TILES.get((arch, dtype), {}).get(head_dim) if dtype else None
    return own if own is not None else DEFAULT_TILES.get(arch, {}).get(head_dim)

# sm90 fp8 (e4m3) forward alternatives, committed next to the e4m3 defaults (the default tile and
# schedule, DEFAULT_ONLY_DTYPES, with the dtype's own overrides above) so that one GPU run can test
# and time them side by side
# (tools/bench_fp8.py --all-variants; predictions in docs/perf-notes.md, "sm90 fp8 forward"). Each
# entry is (tile, schedule/exp_emu fields) and gives a causal and a non-causal variant. Deeper rings
# (3-4 stages) give the V transpose and the K/V loads more than half a key block of slack; hd128's
# tile_n 160 amortizes each block's fixed costs but spills with the overlap schedule at 232
# registers, so it runs ping-pong only. Every entry compiles for sm_90a with no spill
# (tests/test_compile_sm90_fp8.py), which stands in for the register estimate (:func:`_sm90_regs`).
# Like the defaults, each carries hoist_vt, except the twins without it of hd128's default (128x128
# 3 stages, overlap) and of hd256's 128x64 3-stage tile (overlap + ping-pong), and those two carry
# wide_vt too (the 64-bit transpose) beside them.
FP8_ALTERNATIVES: dict[str, dict[int, tuple[tuple[Tile, dict[str, bool | int]], ...]]] = {
    "sm90": {
        128: (
            (Tile(128, 128, 2, 12), {"overlap": True, "pingpong": True, "hoist_vt": True}),
            (Tile(128, 128, 3, 12), {"overlap": True, "pingpong": True, "hoist_vt": True}),
            (Tile(128, 128, 3, 12), {"overlap": True, "pingpong": True, "exp_emu": 25, "hoist_vt": True}),
            (Tile(128, 160, 3, 12), {"pingpong": True, "hoist_vt": True}),
            # The default tile and schedule with the V transpose of before hoist_vt (per-word
            # swizzled addresses): the twin that shows what the hoisted transpose buys
            # (docs/perf-notes.md, "fp8 forward: where the instructions go").
            (Tile(128, 128, 3, 12), {"overlap": True}),
            # The default tile and schedule with the wide transpose (64-bit LDS/STS, 8x8-byte units:
            # half the producer's shared-memory instructions; docs/perf-notes.md, "fp8 wide
            # transpose").
            (Tile(128, 128, 3, 12), {"overlap": True, "hoist_vt": True, "wide_vt": True}),
            # The default with O rescaled only when a warp's row max moves (lazy_rescale; the
            # default rescales 64 accumulators per thread every key block).
            (Tile(128, 128, 3, 12), {"overlap": True, "hoist_vt": True, "lazy_rescale": True}),
            # Three consumer warpgroups of 64 rows over 96 keys (512 threads, consumers at 160
            # registers: R157, no spill): three softmax chains per SM instead of two
            # (docs/perf-notes.md, "fp8 hd128 with three consumer warpgroups"), with and without
            # lazy_rescale; causal too since the causal mask is one select per score (R147, no
            # spill; docs/perf-notes.md, "fp8 causal: the select mask").
            (Tile(192, 96, 2, 16), {"overlap": True, "hoist_vt": True}),
            (Tile(192, 96, 2, 16), {"overlap": True, "hoist_vt": True, "lazy_rescale": True}),
            # The tuned tiles (this one and hd256's 128x96 `_lres`) on the persistent scheduler: one
            # CTA per SM walks the tiles longest-first, and the producer loads the next tile's first
            # K/V block and Q while the consumers finish the last P V and store O
            # (docs/perf-notes.md, "fp8: where the fixed cost goes; ... the persistent scheduler").
            (Tile(192, 96, 2, 16), {"overlap": True, "hoist_vt": True, "lazy_rescale": True, "persistent": True}),
            # The tuned tile with the row sums by a WGMMA against ones (sum_mma): one P x ones
            # product per key block instead of a floating-point add per probability (-44 of 383
            # instructions per key block and consumer warp; docs/perf-notes.md, "fp8: the row sums
            # on the tensor cores"). On the persistent scheduler it measured no gain: not committed.
            (Tile(192, 96, 2, 16), {"overlap": True, "hoist_vt": True, "lazy_rescale": True, "sum_mma": True}),
            # The tuned tile with O accumulated in two levels (two_level: the tensor cores sum
            # fp8.PROMOTE_BLOCKS key blocks, then fp32 in shared memory, 96 KiB more), with and
            # without sum_mma (docs/perf-notes.md, "fp8: O accumulated in two levels").
            (Tile(192, 96, 2, 16), {"overlap": True, "hoist_vt": True, "lazy_rescale": True, "two_level": True}),
            (
                Tile(192, 96, 2, 16),
                {"overlap": True, "hoist_vt": True, "lazy_rescale": True, "persistent": True, "two_level": True},
            ),
            (
                Tile(192, 96, 2, 16),
                {"overlap": True, "hoist_vt": True, "lazy_rescale": True, "sum_mma": True, "two_level": True},
            ),
            # The tuned tile (and its persistent twin) taking v's column means for centered v
            # (flash_attn_func(v_mean=)): the means added in the epilogue instead of by a pass
            # over O after the kernel (docs/perf-notes.md, "fp8: centered v through dispatch").
            (Tile(192, 96, 2, 16), {"overlap": True, "hoist_vt": True, "lazy_rescale": True, "v_mean": True}),
            (
                Tile(192, 96, 2, 16),
                {"overlap": True, "hoist_vt": True, "lazy_rescale": True, "persistent": True, "v_mean": True},
            ),
        ),
        256: (
            # The default tile and schedule without lazy_rescale (the default before it), with 2
            # and 4 stages, without the hoisted transpose and with the wide one.
            (Tile(128, 64, 3, 12), {"overlap": True, "pingpong": True, "hoist_vt": True}),
            (Tile(128, 64, 2, 12), {"overlap": True, "pingpong": True, "hoist_vt": True}),
            (Tile(128, 64, 3, 12), {"overlap": True, "pingpong": True}),
            (Tile(128, 64, 4, 12), {"overlap": True, "pingpong": True, "hoist_vt": True}),
            (Tile(128, 64, 3, 12), {"overlap": True, "pingpong": True, "hoist_vt": True, "wide_vt": True}),
            # 1.5x longer key blocks in the 240 registers the hoisted transpose can leave the
            # consumers (sm90_fp8_consumer_regs): 128x96 with the overlap schedule (R231-R233, no
            # spill; 177 KiB, so 2 stages), with and without ping-pong, and with lazy_rescale.
            # Measured -6 to +2% against the 3-stage 128x64 tile without lazy_rescale
            # (docs/perf-notes.md, "fp8 240/24 measured"); with lazy_rescale -3 to +7% against
            # the default (+6-7% at 16k).
            (Tile(128, 96, 2, 12), {"overlap": True, "pingpong": True, "hoist_vt": True}),
            (Tile(128, 96, 2, 12), {"overlap": True, "hoist_vt": True}),
            (Tile(128, 96, 2, 12), {"overlap": True, "pingpong": True, "hoist_vt": True, "lazy_rescale": True}),
            (
                Tile(128, 96, 2, 12),
                {"overlap": True, "pingpong": True, "hoist_vt": True, "lazy_rescale": True, "persistent": True},
            ),
            # hd256's 128x96 tile with sum_mma (-42 of 464 instructions per key block; measured -3
            # to +3% against it, kept as the measured alternative).
            (
                Tile(128, 96, 2, 12),
                {"overlap": True, "pingpong": True, "hoist_vt": True, "lazy_rescale": True, "sum_mma": True},
            ),
            # FlashAttention-3's fp8 hd256 tile, 128 keys per block (R231 of 240, no spill; 225 KiB
            # with 2 stages; the register estimate says 256): overlap + ping-pong with lazy_rescale,
            # its persistent twin, and its twin without lazy_rescale. Measured -1 to +5% against the
            # 128x96 tile (+3% at 4k non-causal); the tuned table takes it above 4k
            # (docs/perf-notes.md, "fp8: FlashAttention-3's longer key blocks").
            (Tile(128, 128, 2, 12), {"overlap": True, "pingpong": True, "hoist_vt": True, "lazy_rescale": True}),
            (
                Tile(128, 128, 2, 12),
                {"overlap": True, "pingpong": True, "hoist_vt": True, "lazy_rescale": True, "persistent": True},
            ),
            (Tile(128, 128, 2, 12), {"overlap": True, "pingpong": True, "hoist_vt": True}),
            # The tuned tile and its persistent twin taking v's column means (v_mean), as hd128's.
            (
                Tile(128, 96, 2, 12),
                {"overlap": True, "pingpong": True, "hoist_vt": True, "lazy_rescale": True, "v_mean": True},
            ),
            (
                Tile(128, 96, 2, 12),
                {
                    "overlap": True, "pingpong": True, "hoist_vt": True, "lazy_rescale": True, "persistent": True,
                    "v_mean": True,
                },
            ),
        ),
    },
}


# Families with an FP8 block-quantization forward (spec flag block_quant: one descale per query
# tile of q and per key tile of k and v). Committed on the e4m3 default tile and schedule of each
# head dim, the variant dispatch runs for block descales (:func:`fp8_block_specs`).
BLOCK_QUANT_FAMILIES = ("sm90",)


def fp8_block_specs(arch: str = "sm90") -> list[VariantSpec]:
    """The committed e4m3 block-quantization forwards of ``arch``: the e4m3 default tile and
    schedule of each head dim with ``block_quant``, causal and not."""
    if arch not in BLOCK_QUANT_FAMILIES:
        return []
    return sorted(
        VariantSpec(
            arch, "fwd", "e4m3", hd, *default_tile(arch, hd, "e4m3"), causal=causal, block_quant=True,
            **default_extras(arch, "fwd", hd, "e4m3"),
        )
        for hd in DEFAULT_TILES.get(arch, {})
        for causal in (False, True)
    )


def fp8_alternative_specs(arch: str = "sm90") -> list[VariantSpec]:
    """The committed e4m3 forward alternatives of ``arch`` (:data:`FP8_ALTERNATIVES`), causal and not
    where the family's rules allow both."""
    specs = (
        VariantSpec(arch, "fwd", "e4m3", hd, *tile, causal=causal, **extras)
        for hd, alts in FP8_ALTERNATIVES.get(arch, {}).items()
        for tile, extras in alts
        for causal in (False, True)
    )
    # less any mask twin the family's own rules refuse (_sm90_fp8)
    return sorted(s for s in specs if arch != "sm90" or _sm90_fp8(s) is None)


# Backward tiles per head dim (filled as each family's backward kernel lands). sm80: FlashAttention-2's
# backward tiles on the A100 (flash_bwd_launch_template.h): query rows x keys per CTA, 8 warps; hd64
# its 128x128 tile with a double-buffered Q (150 KiB; +10% over 64x128 single-buffered with dq_tile
# on the H200, docs/perf-notes.md "sm80 backward: the dQ accumulator in fragment order").
DEFAULT_BWD_TILES: dict[str, dict[int, Tile]] = {
    "sm80": {
        64: Tile(128, 128, 2, 8),
        96: Tile(64, 128, 1, 8),
        128: Tile(64, 128, 1, 8),
        192: Tile(64, 64, 1, 8),
        256: Tile(64, 64, 1, 8),
    },
}

# Backward tiles committed as alternatives that need more shared memory than the A100's 163 KiB
# (they run on sm_90a and newer). sm80 hd256: Q double-buffered (182 KiB), FlashAttention-2's tile
# on the H100; the default there until the single-buffered tile with dq_pipe measured 3-6% ahead
# of it on the H200 (docs/perf-notes.md, "sm80 backward: the dQ reductions between the dQ MMAs").
LARGE_SMEM_BWD_ALTERNATIVES: dict[str, dict[int, Tile]] = {"sm80": {256: Tile(64, 64, 2, 8)}}


# Backward tiles committed for GPUs whose per-block shared memory holds none of the defaults (the
# sm_86/sm_89 targets, 99 KiB), found by :func:`fitting_variant`. sm80 hd96 and hd128: 64 keys per
# CTA (70 / 86 KiB; hd64 takes its 64x128 double-buffered alternative, 94 KiB). hd192 and hd256 have no sm80 tile
# within 99 KiB (64x64 needs 118 / 150 KiB; FlashAttention-2 keeps V in registers there, which the
# sm80 template does not), so their backward raises NotImplementedError on those GPUs. Tested on
# the H200 like every committed variant; not timed on an sm_86/sm_89 GPU.
SMALL_SMEM_BWD_TILES: dict[str, dict[int, Tile]] = {"sm80": {96: Tile(64, 64, 1, 8), 128: Tile(64, 64, 1, 8)}}

# Backward tiles committed next to the default one so benchmarks can compare (dispatch runs the
# default). sm80: a double-buffered Q tile (stages=2, FlashAttention-2's design): the next query
# block's Q loads during a whole step, dO during the dQ and dK GEMMs (hd256's is in
# LARGE_SMEM_BWD_ALTERNATIVES). hd64's default has 128 query rows per step (FA2's "slightly faster" hd64
# tile: 0.45 ldmatrix per mma.sync instead of 0.55 and half the barriers per FLOP; 255 registers, no spill on
# sm_80 and sm_90a); 64 rows, single- and double-buffered, and 128 rows single-buffered stay beside it.
BWD_TUNING_ALTERNATIVES: dict[str, dict[int, tuple[Tile, ...]]] = {
    "sm80": {
        64: (Tile(64, 128, 1, 8), Tile(64, 128, 2, 8), Tile(128, 128, 1, 8)),
        128: (Tile(64, 128, 2, 8),),
        192: (Tile(64, 64, 2, 8),),
    },
}

# Extra tiles committed next to the default one so dispatch and benchmarks can compare.
TUNING_ALTERNATIVES: dict[str, dict[int, tuple[Tile, ...]]] = {
    "sm80": {
        64: (Tile(128, 128, 1, 8),),
        128: (Tile(128, 64, 1, 8), Tile(128, 64, 2, 8), Tile(64, 64, 1, 4)),
        256: (Tile(64, 64, 1, 4),),
    },
    # Longer key steps amortize each step's fixed costs (row reductions, barriers, pipeline
    # waits): hd64 192 keys (estimate 224 registers) compiles with no spill (sm_90a, DSL 4.8.1);
    # hd256 80 keys (236; FlashAttention-3's hd256 tile) too, fp16 and bf16 (fp16 causal had
    # spilled one register with the conditional O rescale, since reverted).
    "sm90": {64: (Tile(128, 192, 2, 12),), 256: (Tile(128, 80, 2, 12),)},
}
# Tiles committed with their own schedules (not the default's), per head dim: (tile, flags); each
# gives fp16 and bf16, causal and not. hd64 192x128: three consumer warpgroups of 64 rows
# (FlashAttention-4's sm90 hd64 tile), with the overlap schedule, alone and with the consumers
# taking turns issuing their MMAs (ping-pong in order 0, 1, 2).
_PCVT_OV_PP: dict[str, bool] = {"overlap": True, "pingpong": True, "pair_cvt": True}
TILE_SCHEDULE_ALTERNATIVES: dict[str, dict[int, tuple[tuple[Tile, dict[str, bool]], ...]]] = {
    "sm90": {
        64: (
            (Tile(192, 128, 2, 16), {"overlap": True}),
            (Tile(192, 128, 2, 16), {"overlap": True, "pingpong": True}),
            # the 128x192 tuning tile converts P one score per instruction in bf16 (240 of 280 F2FP
            # element-wise, P V issued in 39 groups): its pair_cvt twin
            (Tile(128, 192, 2, 12), _PCVT_OV_PP),
            # a longest-first 1-D grid in L2 sections of (head, batch) pairs (lpt_grid)
            (Tile(192, 128, 2, 16), {"overlap": True, "lpt_grid": True}),
            (Tile(192, 128, 2, 16), {"overlap": True, "pingpong": True, "lpt_grid": True}),
            # the table's three-consumer tile with the lazy O rescale (lazy_rescale)
            (Tile(192, 128, 2, 16), {"overlap": True, "pingpong": True, "lazy_rescale": True}),
        ),
        # hd256 128x80 closer to FlashAttention-4's
        # sm90 forward: overlap without ping-pong (its scheduler barrier is off above head dim 128),
        # P converted two scores per instruction (pair_cvt), O rescaled under S = Q K^T
        # (early_rescale; without pair_cvt its causal form makes ptxas serialize every WGMMA, C7520).
        256: (
            (Tile(128, 80, 2, 12), {"overlap": True}),
            (Tile(128, 80, 2, 12), {"overlap": True, "pair_cvt": True}),
            (Tile(128, 80, 2, 12), {"overlap": True, "pingpong": True, "pair_cvt": True}),
            (Tile(128, 80, 2, 12), {"overlap": True, "early_rescale": True, "pair_cvt": True}),
            (Tile(128, 80, 2, 12), {"overlap": True, "pingpong": True, "early_rescale": True, "pair_cvt": True}),
            # the table's causal schedules on the longest-first 1-D grid (lpt_grid)
            # (with the DSL's conversion, 128x80 causal overlap on that grid spills 31 registers and
            # serializes its WGMMAs: pair_cvt there)
            (Tile(128, 80, 2, 12), {"overlap": True, "pair_cvt": True, "lpt_grid": True}),
            (Tile(128, 80, 2, 12), {"overlap": True, "pingpong": True, "early_rescale": True, "pair_cvt": True, "lpt_grid": True}),
            # the table's schedules with O rescaled only when a warp's row max moves by more than
            # 2^8 (lazy_rescale; hd256 rescales 128 accumulators per thread every key block)
            (Tile(128, 80, 2, 12), {"overlap": True, "pingpong": True, "early_rescale": True, "pair_cvt": True, "lazy_rescale": True}),
            (Tile(128, 80, 2, 12), {"overlap": True, "pingpong": True, "early_rescale": True, "pair_cvt": True, "lpt_grid": True, "lazy_rescale": True}),
        ),
        # hd128 with longer key tiles (FlashAttention-3's non-causal hd128 tile is 128x176): half the
        # per-block fixed costs (barriers, row reductions, the O rescale, pipeline waits) per FLOP.
        # With the DSL's conversion 128x176 spills; with pair_cvt every tile_n up to 192 fits 240
        # registers (SM90_PCVT_NO_SPILL). pair_cvt also shortens the 128x128 table tile's loops
        # (unmasked 494 -> 457 instructions per block, R223 -> R190) though it converts in pairs already.
        # hd96's default tile converts in pairs already; with pair_cvt its unmasked loop is 434
        # instructions per block instead of 467 (fewer uniform-datapath ones), R219 -> R184.
        96: ((Tile(128, 128, 2, 12), _PCVT_OV_PP),),
        # and the table's causal tiles (128x128, 128x160) on the longest-first 1-D grid (lpt_grid)
        128: tuple((Tile(128, n, 2, 12), _PCVT_OV_PP) for n in (128, 144, 160, 176, 192))
        + tuple((Tile(128, n, 2, 12), {**_PCVT_OV_PP, "lpt_grid": True}) for n in (128, 160))
        # the table's long tiles with the lazy O rescale (lazy_rescale)
        + tuple((Tile(128, n, 2, 12), {**_PCVT_OV_PP, "lazy_rescale": True}) for n in (160, 176)),
        # The default hd192 128x96 tile converts P one score per instruction in bf16 (120 of 180 F2FP
        # element-wise, P V issued in 21 groups): its pair_cvt twin.
        192: ((Tile(128, 96, 2, 12), _PCVT_OV_PP),),
    },
}
# Tuning alternatives committed in some dtypes only: (arch, head_dim, tile) -> dtypes.
TUNING_ALTERNATIVE_DTYPES: dict[tuple[str, int, Tile], tuple[str, ...]] = {}

_TILE_GRID: dict[str, tuple[Tile, ...]] = {
    "sm80": tuple(itertools.starmap(Tile, itertools.product((64, 128), (32, 64, 128), (1, 2), (4, 8)))),
    # FA3: one producer warpgroup plus one consumer warpgroup per 64 query rows.
    "sm90": tuple(Tile(m, n, 2, 4 * (m // 64 + 1)) for m in (64, 128, 192) for n in range(64, 193, 16)),
    # FA4: 16 warps (two softmax warpgroups, correction, MMA, load, epilogue).
    "sm100": tuple(Tile(m, n, s, 16) for m in (128, 256) for n in (64, 128) for s in (2, 3)),
}


# The sm90 forward schedules: plain, intra-warpgroup overlap, ping-pong, both; each on a grid of
# one CTA per tile or persistent.
_SM90_SCHEDULES: tuple[dict[str, bool], ...] = tuple(
    {"overlap": ov, "pingpong": pp, "persistent": persist}
    for ov in (False, True)
    for pp in (False, True)
    for persist in (False, True)
) + tuple(  # the overlap schedule with O rescaled under S = Q K^T and/or P converted in pairs
    {"overlap": True, "pingpong": pp, "persistent": persist, "early_rescale": early, "pair_cvt": pair}
    for pp in (False, True)
    for persist in (False, True)
    for early, pair in ((True, False), (False, True), (True, True))
) + tuple(  # the overlap schedule on a 1-D longest-first grid of one CTA per tile
    {"overlap": True, "pingpong": pp, "lpt_grid": True, **extra}
    for pp in (False, True)
    for extra in ({}, {"pair_cvt": True}, {"early_rescale": True, "pair_cvt": True})
) + tuple(  # ping-pong (and paired conversion) with the lazy O rescale, on either grid
    {"overlap": True, "pingpong": True, "pair_cvt": True, "lazy_rescale": True, **extra}
    for extra in ({}, {"early_rescale": True}, {"early_rescale": True, "lpt_grid": True})
) + ({"overlap": True, "pingpong": True, "lazy_rescale": True},)


# sm100 forward: one CTA per UMMA, or a CTA pair (2-SM UMMAs).
_SM100_FWD_SCHEDULES: tuple[dict[str, bool], ...] = ({}, {"cta_pair": True})
_FLAG_SETS: dict[tuple[str, str], tuple[dict[str, bool], ...]] = {
    ("sm90", "fwd"): _SM90_SCHEDULES,
    ("sm100", "fwd"): _SM100_FWD_SCHEDULES,
}


def _require(argument: str, value: str, accepted: Sequence[str]) -> None:
    if value not in accepted:
        raise ValueError(f"{argument}={value!r} is not one of {tuple(accepted)}")


def _candidate_dtypes(arch: str, direction: str) -> tuple[str, ...]:
    if direction == "fwd" and arch in FP8_FAMILIES:
        return DTYPES
    return ("fp16", "bf16")


def _block_quant_options(arch: str, direction: str, dtype: str) -> tuple[bool, ...]:
    if direction == "fwd" and dtype == "e4m3" and arch in BLOCK_QUANT_FAMILIES:
        return (False, True)
    return (False,)


def _grid_tiles(arch: str, direction: str, dtype: str) -> list[Tile]:
    """The tile grid of ``arch`` plus, for the forward, the dtype's own default tiles
    (:data:`DEFAULT_DTYPE_TILES`) where the grid lacks them."""
    own = DEFAULT_DTYPE_TILES.get((arch, dtype), {}).values() if direction == "fwd" else ()
    return list(_TILE_GRID[arch]) + [t for t in dict.fromkeys(own) if t not in _TILE_GRID[arch]]


def candidates(arch: str, direction: str = "fwd") -> list[VariantSpec]:
    """Every spec of the raw tile product for ``arch``, valid or not (a dtype's forward flags,
    :data:`DEFAULT_DTYPE_FLAGS`, on each), plus the committed e4m3 alternatives
    (:data:`FP8_ALTERNATIVES`: deeper rings than the grid's, and the twins without those flags)."""
    _require("arch", arch, ARCHS)
    _require("direction", direction, DIRECTIONS)
    grid = [
        VariantSpec(
            arch, direction, dtype, head_dim, *tile, causal=causal, exp_emu=exp_emu, block_quant=block_quant,
            **_with_dtype_flags(arch, direction, dtype, flags),
        )
        for dtype in _candidate_dtypes(arch, direction)
        for head_dim in HEAD_DIMS
        for tile in _grid_tiles(arch, direction, dtype)
        for causal in (False, True)
        for exp_emu in ((0, 25) if arch in ("sm90", "sm100") and direction == "fwd" else (0,))
        for flags in _FLAG_SETS.get((arch, direction), ({},))
        for block_quant in _block_quant_options(arch, direction, dtype)
    ]
    if direction == "fwd" and "e4m3" in _candidate_dtypes(arch, direction):
        # the committed e4m3 variants off the grid: the alternatives, and defaults (and their block
        # twins) with flags the grid does not vary (lazy_rescale)
        known = set(grid)
        grid += [s for s in default_variants(arch, "fwd") if s.dtype == "e4m3" and s not in known]
    return grid


def smem_bytes(spec: VariantSpec) -> int:
    """Shared memory of one CTA: the Q tile plus ``stages`` buffers each of K and V (sm90 fp8:
    and of the transposed V that the P V WGMMA reads)."""
    if (spec.arch, spec.direction, spec.dtype) == ("sm90", "fwd", "e4m3"):
        elements = (spec.tile_m + 3 * spec.stages * spec.tile_n) * spec.head_dim
        if spec.sum_mma:  # the ones operand of the row-sum WGMMA (8 x tile_n), 1 KiB-aligned
            elements += -(-8 * spec.tile_n // 1024) * 1024
        if spec.two_level:  # the fp32 copy of O (4 bytes per value)
            elements += 4 * spec.tile_m * spec.head_dim
        return elements * spec.elem_bytes + SMEM_RESERVE
    if spec.direction == "bwd" and spec.arch == "sm80":
        return _sm80_bwd_smem_bytes(spec)
    if spec.direction == "bwd" and spec.arch == "sm100":
        return sm100_bwd_smem_bytes(spec)
    if spec.direction == "bwd" and spec.arch == "sm90":
        return sm90_bwd_smem_bytes(spec)
    if spec.arch == "sm100":  # one K/V ring, an O staging tile; half a ring per CTA of a pair
        return sm100_smem_bytes(spec)
    elements = (spec.tile_m + 2 * spec.stages * spec.tile_n) * spec.head_dim
    if spec.persistent:  # O staged apart from Q (the next tile's Q loads during the epilogue)
        elements += spec.tile_m * spec.head_dim
    return elements * spec.elem_bytes + SMEM_RESERVE


def _sm80_bwd_smem_bytes(spec: VariantSpec) -> int:
    # Q (``stages`` buffers) and dO (tile_m x d), K and V (tile_n x d), P and dS (tile_m x tile_n),
    # 1 KiB-aligned each.
    elements = (spec.stages + 1) * spec.tile_m * spec.head_dim + 2 * spec.tile_n * spec.head_dim
    elements += 2 * spec.tile_m * spec.tile_n
    return elements * spec.elem_bytes + 6 * SMEM_RESERVE


def _sm80_bwd_registers(spec: VariantSpec) -> int:
    # fp32 dK and dV accumulators (tile_n x d) live throughout; at the peak beside them either S
    # and dP (tile_m x tile_n each) or the dQ accumulator (tile_m x d). Calibrated on compiled SASS
    # (sm_90a, DSL 4.8.1): the default tiles (estimates 192-240) compile with no spill.
    acc_dkv = 2 * spec.tile_n * spec.head_dim // spec.threads
    acc_sdp = 2 * spec.tile_m * spec.tile_n // spec.threads
    acc_dq = spec.tile_m * spec.head_dim // spec.threads
    return acc_dkv + max(acc_sdp, acc_dq) + SM80_BWD_REG_OVERHEAD


def _sm80_registers(spec: VariantSpec) -> int:
    if spec.direction == "bwd":
        return _sm80_bwd_registers(spec)
    # fp32 O and S accumulators plus P (S packed to 16 bit), which ptxas keeps live beside S
    # while it hoists the V ldmatrix loads. Calibrated on compiled SASS (sm_90a, DSL 4.8.1):
    # hd128 128x64 w4 (estimate 288) and hd96 128x64 w4 (256) spill; hd64 128x64 w4 (224),
    # hd128 128x128 w8 (224) and hd256 128x64 w8 (240) compile to <= 255 registers, no spill.
    acc_o = spec.tile_m * spec.head_dim // spec.threads
    acc_s = spec.tile_m * spec.tile_n // spec.threads
    return acc_o + acc_s + acc_s // 2 + SM80_REG_OVERHEAD


def _sm90_registers(spec: VariantSpec) -> int:
    if spec.direction == "bwd":
        return sm90_bwd_registers(spec)
    # Per consumer thread (a warpgroup owns 64 query rows): fp32 O (64 x d) and S (64 x tile_n)
    # accumulators, P packed to 16 bit (fp8: 8 bit) for the register-A WGMMA, and the softmax state.
    acc_o = 64 * spec.head_dim // 128
    acc_s = 64 * spec.tile_n // 128
    p_regs = acc_s // 4 if spec.dtype == "e4m3" else acc_s // 2
    return acc_o + acc_s + p_regs + SM90_REG_OVERHEAD


_REGISTER_MODELS: dict[str, Callable[[VariantSpec], int]] = {"sm80": _sm80_registers, "sm90": _sm90_registers}


def est_registers(spec: VariantSpec) -> int | None:
    """Estimated registers per thread at the peak, or None where the family has no model."""
    model = _REGISTER_MODELS.get(spec.arch)
    return model(spec) if model else None


def _fp8_rule(spec: VariantSpec) -> str | None:
    if spec.dtype == "e4m3" and (spec.arch not in FP8_FAMILIES or spec.direction != "fwd"):
        return f"e4m3 is only for sm90/sm100 forward kernels, not {spec.arch} {spec.direction}"
    return None


def _sm90_flags_rule(spec: VariantSpec) -> str | None:
    if (spec.overlap or spec.pingpong) and spec.arch != "sm90":
        return f"overlap/pingpong are sm90 (FlashAttention-3) schedule flags, not {spec.arch} ones"
    return None


def _persistent_rule(spec: VariantSpec) -> str | None:
    if spec.persistent and (spec.arch, spec.direction) != ("sm90", "fwd"):
        return f"persistent is an sm90 forward scheduler flag, not a {spec.arch} {spec.direction} one"
    return None


def _early_rescale_rule(spec: VariantSpec) -> str | None:
    if not spec.early_rescale:
        return None
    if (spec.arch, spec.direction) != ("sm90", "fwd"):
        return (
            f"early_rescale (O rescaled under S = Q K^T) is an sm90 forward flag, "
            f"not a {spec.arch} {spec.direction} one"
        )
    if spec.dtype not in ("fp16", "bf16"):
        return f"early_rescale: the sm90 {spec.dtype} forward has no early rescale"
    if not spec.overlap:
        return (
            "early_rescale needs overlap: without it O is rescaled inside the softmax step, before its "
            "P V is issued, already"
        )
    if spec.tile_m != 128:
        return (
            f"early_rescale needs two consumer warpgroups (tile_m=128), not tile_m={spec.tile_m}: "
            "not compiled within the three-consumer 160-register budget"
        )
    return None


def _pair_cvt_rule(spec: VariantSpec) -> str | None:
    if not spec.pair_cvt:
        return None
    if (spec.arch, spec.direction) != ("sm90", "fwd"):
        return f"pair_cvt (P converted two scores per instruction) is an sm90 forward flag, not a {spec.arch} {spec.direction} one"
    if spec.dtype not in ("fp16", "bf16"):
        return f"pair_cvt: the sm90 {spec.dtype} forward converts P with its own byte permutes"
    return None


def _sm90_e4m3_forward_flag(spec: VariantSpec, flag: str, what: str) -> str | None:
    """Why ``spec`` may not set ``flag`` (a flag of the sm90 e4m3 forward, described by ``what``):
    None where it is unset or ``spec`` is that forward."""
    if not getattr(spec, flag) or (spec.arch, spec.direction, spec.dtype) == ("sm90", "fwd", "e4m3"):
        return None
    return f"{flag} ({what}) is an sm90 e4m3 forward flag, not a {spec.arch} {spec.dtype} {spec.direction} one"


def _hoist_vt_rule(spec: VariantSpec) -> str | None:
    return _sm90_e4m3_forward_flag(spec, "hoist_vt", "the V transpose's addresses hoisted")


def _wide_vt_rule(spec: VariantSpec) -> str | None:
    if not spec.wide_vt:
        return None
    wrong_family = _sm90_e4m3_forward_flag(spec, "wide_vt", "the V transpose with 64-bit shared-memory accesses")
    if wrong_family:
        return wrong_family
    if not spec.hoist_vt:
        return "wide_vt requires hoist_vt (the wide transpose's addresses are hoisted like the _hvt transpose's)"
    if spec.tile_n % SM90_FP8_MMA_K:
        return (
            f"wide_vt: tile_n={spec.tile_n} is not a multiple of {SM90_FP8_MMA_K} (the 32-key blocks in "
            "which V is transposed and permuted; a wide unit spans 8 keys of one block)"
        )
    units = (spec.head_dim // 8) * (spec.tile_n // 8)
    if units % SM90_FP8_TRANSPOSE_THREADS:
        return (
            f"wide_vt: (head_dim / 8) x (tile_n / 8) = {units} 8x8-byte units (head_dim={spec.head_dim}, "
            f"tile_n={spec.tile_n}) is not a multiple of the producer warpgroup's {SM90_FP8_TRANSPOSE_THREADS} threads"
        )
    return None


def _lazy_rescale_rule(spec: VariantSpec) -> str | None:
    if not spec.lazy_rescale or spec.dtype == "e4m3":
        return _sm90_e4m3_forward_flag(spec, "lazy_rescale", "O rescaled only when a warp's row max moves")
    if (spec.arch, spec.direction) != ("sm90", "fwd"):
        return (
            "lazy_rescale (O rescaled only when a warp's row max moves) is an sm90 forward flag, not a "
            f"{spec.arch} {spec.direction} one"
        )
    if not spec.overlap:
        return "lazy_rescale: the sm90 16-bit forward rescales lazily in the overlap schedule only (its deferred softmax step)"
    if spec.exp_emu:
        return "lazy_rescale with exp_emu: the lazy softmax step keeps every exp2 on MUFU"
    return None


def _overlap_e4m3_flag(spec: VariantSpec, flag: str, what: str, why_overlap: str, why_not_block: str) -> str | None:
    """Why ``spec`` may not set ``flag``, a flag of the sm90 e4m3 forward's overlap schedule that
    the block-quantization path does not take (``what`` names it; ``why_overlap`` and
    ``why_not_block`` say why): None where it is unset or allowed."""
    if not getattr(spec, flag):
        return None
    wrong_family = _sm90_e4m3_forward_flag(spec, flag, what)
    if wrong_family:
        return wrong_family
    if not spec.overlap:
        return f"{flag} needs overlap: {why_overlap}"
    if spec.block_quant:
        return f"{flag} with block_quant: {why_not_block}"
    return None


def _sum_mma_rule(spec: VariantSpec) -> str | None:
    return _overlap_e4m3_flag(
        spec, "sum_mma", "row sums by a WGMMA against ones",
        "the block sums are added with the rescale after each step's P V wait",
        "the block path's row sums undo each key tile's V ratio, which P carries",
    )  # fmt: skip


def _two_level_rule(spec: VariantSpec) -> str | None:
    return _overlap_e4m3_flag(
        spec, "two_level", "O accumulated in two levels",
        "O is promoted after each step's P V wait", "not built for the block path",
    )  # fmt: skip


def _v_mean_rule(spec: VariantSpec) -> str | None:
    if not spec.v_mean:
        return None
    wrong_family = _sm90_e4m3_forward_flag(spec, "v_mean", "v's column means added in the epilogue")
    if wrong_family:
        return wrong_family
    if spec.two_level:
        return "v_mean with two_level: centered v needs no two-level accumulation"
    if spec.block_quant:
        return "v_mean with block_quant: not built for the block path"
    return None


def _lpt_grid_rule(spec: VariantSpec) -> str | None:
    if not spec.lpt_grid:
        return None
    if (spec.arch, spec.direction) != ("sm90", "fwd"):
        return f"lpt_grid (a longest-first 1-D grid) is an sm90 forward flag, not a {spec.arch} {spec.direction} one"
    if spec.dtype not in ("fp16", "bf16"):
        return f"lpt_grid: the sm90 {spec.dtype} forward has its own grid"
    if spec.persistent:
        return "lpt_grid with persistent: the persistent scheduler walks the tiles longest-first already"
    return None


def _cta_pair_rule(spec: VariantSpec) -> str | None:
    if spec.cta_pair and (spec.arch, spec.direction) != ("sm100", "fwd"):
        return f"cta_pair (2-CTA UMMA) is an sm100 forward flag, not a {spec.arch} {spec.direction} one"
    return None


def _block_quant_rule(spec: VariantSpec) -> str | None:
    if spec.block_quant and (
        spec.arch not in BLOCK_QUANT_FAMILIES or spec.direction != "fwd" or spec.dtype != "e4m3"
    ):
        return (
            f"block_quant (FP8 block quantization) is an sm90 e4m3 forward flag, not a "
            f"{spec.arch} {spec.direction} {spec.dtype} one"
        )
    return None


def _dq_bulk_rule(spec: VariantSpec) -> str | None:
    if spec.dq_bulk and (spec.arch, spec.direction) != ("sm90", "bwd"):
        return f"dq_bulk (bulk reduce-add of dQ) is an sm90 backward flag, not a {spec.arch} {spec.direction} one"
    return None


def _dq_warp_rule(spec: VariantSpec) -> str | None:
    if not spec.dq_warp:
        return None
    if (spec.arch, spec.direction) != ("sm90", "bwd"):
        return f"dq_warp (a dQ-writer warp) is an sm90 backward flag, not a {spec.arch} {spec.direction} one"
    if not spec.dq_bulk:
        return "dq_warp without dq_bulk: the dQ-writer warp issues the bulk reduce-adds of dq_bulk's staged pieces"
    return _sm90_bwd_main_only(spec, "dq_warp (the dQ-writer warp)")


def _sm90_bwd_main_only(spec: VariantSpec, what: str) -> str | None:
    """Why ``what`` (a flag of templates/bwd_sm90.py.j2) cannot be built for ``spec``, or None."""
    if sm90_bwd_head_split(spec) or sm90_bwd_swapped(spec) or sm90_bwd_dq_swapped(spec):
        return (
            f"{what} with tile_m={spec.tile_m}, tile_n={spec.tile_n}, head_dim={spec.head_dim}: built for the "
            "tile_n=128 backward with tile_m 64 or 128 (templates/bwd_sm90.py.j2) only"
        )
    return None


def _row_prefetch_rule(spec: VariantSpec) -> str | None:
    if not spec.row_prefetch:
        return None
    if (spec.arch, spec.direction) != ("sm90", "bwd"):
        return f"row_prefetch (LSE2/D read ahead of the WGMMA waits) is an sm90 backward flag, not a {spec.arch} {spec.direction} one"
    return _sm90_bwd_main_only(spec, "row_prefetch")


def _dq_stage_rule(spec: VariantSpec) -> str | None:
    if not spec.dq_stage:
        return None
    if (spec.arch, spec.direction) != ("sm90", "bwd"):
        return (
            f"dq_stage (FlashAttention-4's shared-memory budget: dO single-buffered, a dQ staging buffer) "
            f"is an sm90 backward flag, not a {spec.arch} {spec.direction} one"
        )
    if not sm90_bwd_swapped(spec):
        return (
            f"dq_stage with tile_m={spec.tile_m}, tile_n={spec.tile_n}, head_dim={spec.head_dim}: built for the "
            "swapped-dK/dV backward (tile_n=96, head dim 192, templates/bwd_sm90_swapkv.py.j2) only"
        )
    if not spec.dq_bulk:
        return "dq_stage without dq_bulk: the dedicated staging buffer holds dq_bulk's fp32 dQ pieces for the bulk reduce-add"
    if spec.dq_warp:
        return "dq_stage with dq_warp: the swapped backward has no dQ-writer warp (each consumer issues its own bulk reduce-add)"
    return None


def _dq_quad_rule(spec: VariantSpec) -> str | None:
    if spec.dq_quad and (spec.arch, spec.direction) != ("sm80", "bwd"):
        return (
            f"dq_quad (16-byte dQ reductions into a column-permuted accumulator) is an sm80 backward "
            f"flag, not a {spec.arch} {spec.direction} one"
        )
    return None


def _dq_tile_rule(spec: VariantSpec) -> str | None:
    if not spec.dq_tile:
        return None
    if (spec.arch, spec.direction) != ("sm80", "bwd"):
        return (
            f"dq_tile (the dQ accumulator tiled by query blocks in fragment order) is an sm80 backward "
            f"flag, not a {spec.arch} {spec.direction} one"
        )
    if spec.dq_quad:
        return "dq_tile with dq_quad: the two are different layouts of the same dQ accumulator"
    if spec.tile_m * spec.head_dim % (4 * spec.threads):
        return (
            f"dq_tile needs tile_m * head_dim ({spec.tile_m * spec.head_dim}) to be a multiple of 4 x the "
            f"{spec.threads} threads (whole 16-byte vectors per thread)"
        )
    return None


def _dq_pipe_rule(spec: VariantSpec) -> str | None:
    if not spec.dq_pipe:
        return None
    if not spec.dq_tile:
        return "dq_pipe without dq_tile: the dQ chunks add into dq_tile's fragment-order accumulator"
    if spec.stages != 1:
        return (
            "dq_pipe with stages > 1: the double-buffered order already spreads its dQ reductions "
            "between the dK MMAs"
        )
    return None


def _head_dim_rule(spec: VariantSpec) -> str | None:
    if spec.head_dim not in HEAD_DIMS:
        return f"head_dim={spec.head_dim} is not one of {HEAD_DIMS}"
    return None


def why_no_kernel(spec: VariantSpec) -> str | None:
    """Why no template exists yet for this spec's (arch, direction, dtype), or None."""
    dtypes = IMPLEMENTED.get((spec.arch, spec.direction))
    if dtypes is None:
        return f"no {spec.arch} {spec.direction} kernel exists yet"
    if spec.dtype not in dtypes:
        return f"no {spec.dtype} {spec.arch} {spec.direction} kernel exists yet"
    return None


def _sm80_bwd_warps(spec: VariantSpec) -> str | None:
    # Warp grids (2, warps/2) over (tile_m, tile_n) for S and dP, (warps/2, 2) over (tile_n, d)
    # for dK/dV and over (tile_m, d) for dQ, or (2, warps/2) there where it is valid and reads
    # less (bwd_parts.warp_grid); each warp owns 16-row by 16-column pieces.
    if spec.warps not in (4, 8):
        return f"warps={spec.warps}: the sm80 backward runs 4 or 8 warps"
    if spec.stages not in (1, 2):
        return (
            f"stages={spec.stages}: the sm80 backward loads K and V once per CTA and has 1 or 2 "
            "buffers for Q (stages=1 or 2)"
        )
    for what, value in (("tile_m", spec.tile_m), ("tile_n", spec.tile_n)):
        if value % (8 * spec.warps) or value % 32:
            return (
                f"{what}={value} is not a multiple of {max(32, 8 * spec.warps)} "
                f"(the backward's warp grids of {spec.warps} warps)"
            )
    return None


def _sm80_warp_rows(spec: VariantSpec) -> str | None:
    if spec.direction == "bwd":
        return _sm80_bwd_warps(spec)
    rows = 16 * spec.warps
    if spec.tile_m % rows:
        return (
            f"tile_m={spec.tile_m} is not a multiple of 16*warps={rows} "
            f"(each of the {spec.warps} warps owns 16-row MMA slabs)"
        )
    return None


def _sm80_tile_n(spec: VariantSpec) -> str | None:
    if spec.tile_n % 16:
        return f"tile_n={spec.tile_n} is not a multiple of 16 (the k-step of the P@V MMA)"
    return None


def _sm80_head_dim(spec: VariantSpec) -> str | None:
    if spec.head_dim % 32:
        return f"head_dim={spec.head_dim} is not a multiple of 32 (the narrowest swizzled smem atom)"
    return None


def _sm80_copy(spec: VariantSpec) -> str | None:
    per_round = spec.threads * (16 // spec.elem_bytes)  # one 128-bit copy per thread
    for operand, rows in (("Q", spec.tile_m), ("K/V", spec.tile_n)):
        if rows * spec.head_dim % per_round:
            return (
                f"the {operand} tile ({rows}x{spec.head_dim}) does not split into 128-bit copies "
                f"over {spec.threads} threads ({per_round} elements per round)"
            )
    return None


def _smem_limit(limit: int, where: str) -> Callable[[VariantSpec], str | None]:
    """A rule: smem_bytes(spec) within ``limit``, the per-block opt-in limit of ``where``."""

    def rule(spec: VariantSpec) -> str | None:
        needed = smem_bytes(spec)
        if needed > limit:
            return (
                f"needs {needed / 1024:.1f} KiB of shared memory, over the "
                f"{limit // 1024} KiB per-block opt-in limit of {where}"
            )
        return None

    return rule


def why_not_on(spec: VariantSpec, target: str) -> str | None:
    """Why a valid ``spec`` cannot run on compile target ``target`` (its family does not run there,
    or its shared memory is over the per-block opt-in limit of the target's GPUs,
    :data:`TARGET_SMEM_LIMITS`), or None when it can."""
    if not spec.runs_on(target):
        return f"family {spec.arch} does not run on {target}"
    needed, limit = smem_bytes(spec), TARGET_SMEM_LIMITS[target]
    if needed > limit:
        return (
            f"needs {needed / 1024:.1f} KiB of shared memory, over the {limit // 1024} KiB "
            f"per-block opt-in limit of {target} GPUs"
        )
    return None


def fitting_variant(spec: VariantSpec, target: str) -> VariantSpec | None:
    """``spec`` where it runs on ``target`` (:func:`why_not_on`); else the committed variant like it
    (same family, direction, dtype, head dim, mask and flags, another tile) with the most shared
    memory among those that run there: the largest tile the target's GPUs hold (FlashAttention-2's
    rule on GPUs with less shared memory). None when no committed variant like it runs there."""
    if why_not_on(spec, target) is None:
        return spec
    tile = {"tile_m": spec.tile_m, "tile_n": spec.tile_n, "stages": spec.stages, "warps": spec.warps}
    alike = [
        s for s in default_variants(spec.arch, spec.direction)
        if s.replace(**tile) == spec and why_not_on(s, target) is None
    ]  # fmt: skip
    return max(alike, key=smem_bytes, default=None)


_sm80_smem = _smem_limit(SM80_FAMILY_SMEM_LIMIT, "the largest GPU that runs the sm80 family (H100/H200/B200)")
_sm90_smem = _smem_limit(SM90_SMEM_LIMIT, "the H100/H200")


def _sm80_regs(spec: VariantSpec) -> str | None:
    estimate = _sm80_registers(spec)
    if estimate > MAX_REGISTERS:
        return f"would spill registers (estimated {estimate} > {MAX_REGISTERS} per thread)"
    return None


def _sm90_roles(spec: VariantSpec) -> str | None:
    if spec.tile_m % 64 or spec.tile_m // 64 not in (1, 2, 3):
        return f"tile_m={spec.tile_m} must be 64, 128 or 192 (one consumer warpgroup per 64 query rows)"
    if spec.pingpong and spec.tile_m not in (128, 192):
        return f"pingpong needs two or three consumer warpgroups (tile_m=128 or 192), not tile_m={spec.tile_m}"
    if spec.warps != 4 * (spec.tile_m // 64 + 1):
        return (
            f"warps={spec.warps} must be {4 * (spec.tile_m // 64 + 1)}: one producer warpgroup plus "
            f"{spec.tile_m // 64} consumer warpgroup(s) of 4 warps"
        )
    return None


def _sm90_tile_n(spec: VariantSpec) -> str | None:
    if spec.tile_n % 16 or not 16 <= spec.tile_n <= 256:
        return f"tile_n={spec.tile_n} must be a multiple of 16 in [16, 256] (WGMMA N, and the k16 steps of P@V)"
    if spec.stages < 2:
        return f"stages={spec.stages}: the K/V TMA pipelines need at least 2 stages to overlap loads with MMAs"
    return None


def sm90_consumer_regs(spec: VariantSpec) -> int:
    """setmaxnreg budget of one consumer thread: 240 with up to two consumer warpgroups, 160 with three."""
    return SM90_CONSUMER_REGS_3WG if spec.tile_m // 64 == 3 else SM90_CONSUMER_REGS


def sm90_3wg_compiled(spec: VariantSpec) -> bool:
    """Whether ``spec`` is a three-consumer forward of :data:`SM90_3WG_NO_SPILL`."""
    return (
        spec.arch == "sm90"
        and spec.direction == "fwd"
        and spec.dtype in ("fp16", "bf16")
        and spec.tile_m == 192
        and (spec.head_dim, spec.tile_n) in SM90_3WG_NO_SPILL
        and spec.overlap
        and not spec.persistent
        and spec.exp_emu == 0
    )


def sm90_pcvt_compiled(spec: VariantSpec) -> bool:
    """Whether ``spec`` is a two-consumer paired-conversion forward of :data:`SM90_PCVT_NO_SPILL`."""
    return (
        spec.arch == "sm90"
        and spec.direction == "fwd"
        and spec.dtype in ("fp16", "bf16")
        and spec.tile_m == 128
        and (spec.head_dim, spec.tile_n) in SM90_PCVT_NO_SPILL
        and spec.overlap
        and spec.pingpong
        and spec.pair_cvt
        and not spec.early_rescale
        and not spec.persistent
        and spec.exp_emu == 0
    )


def _sm90_regs(spec: VariantSpec) -> str | None:
    if spec.dtype == "e4m3" and spec.direction == "fwd" and spec in fp8_alternative_specs(spec.arch):
        return None  # compiled with no spill on sm_90a (tests/test_compile_sm90_fp8.py checks)
    if sm90_3wg_compiled(spec):
        return None  # compiled with no spill on sm_90a (tests/test_compile_sm90_fwd_hd64_192.py checks)
    if sm90_pcvt_compiled(spec):
        return None  # compiled with no spill on sm_90a (tests/test_compile_sm90_fwd_pcvt.py checks)
    estimate = _sm90_registers(spec)
    budget = sm90_fp8_consumer_regs(spec) if spec.dtype == "e4m3" else sm90_consumer_regs(spec)
    if estimate > budget:
        return f"would spill registers (estimated {estimate} > {budget} per consumer thread after setmaxnreg)"
    return None


def sm90_fp8_ptxas_options(spec: VariantSpec) -> str:
    """Extra ptxas options of an sm90 e4m3 forward (templates/fwd_sm90_fp8.py.j2 renders them as
    PTXAS_OPTIONS): ``-regUsageLevel 3`` for the tiles on which ptxas, at its default level, gives
    up the uniform datapath since P is converted a register at a time (fp8.convert_p): WGMMA
    descriptors and pipeline state in regular registers, 150-290 R2UR, ~450 more instructions,
    and spills in some (hd256 128x64 causal, hd192 causal with block quantization, hd128 128x128
    non-causal with 3 stages without the hoisted or with the wide transpose). Level 3 keeps them
    uniform; on the other tiles it costs instructions (hd256 128x96: +10 per key block), so it is
    not the rule. tests/test_compile_sm90_fp8.py bounds every variant's R2UR count."""
    narrow_causal = spec.causal and spec.head_dim == 256 and spec.tile_n == 64
    block_causal = spec.causal and spec.block_quant and spec.head_dim == 192
    wide_s3 = (
        not spec.causal and spec.head_dim == 128 and (spec.tile_m, spec.tile_n, spec.stages) == (128, 128, 3)
        and (spec.wide_vt or not spec.hoist_vt)
    )  # fmt: skip
    return "-regUsageLevel 3" if narrow_causal or block_causal or wide_s3 else ""


def _sm90_fp8(spec: VariantSpec) -> str | None:
    """The fp8 forward's own limits (templates/fwd_sm90_fp8.py.j2)."""
    if spec.dtype != "e4m3":
        return None
    if spec.tile_m not in (128, 192):
        return (
            f"tile_m={spec.tile_m}: the sm90 fp8 forward runs two or three consumer warpgroups of 64 "
            "query rows (tile_m 128 or 192); its register splits are laid out for those"
        )
    if spec.tile_m == 192 and spec.pingpong:
        return "tile_m=192 with pingpong: the fp8 ping-pong hands the tensor core between two consumers"
    if spec.tile_m == 192 and spec.head_dim != 128:
        return (
            f"tile_m=192 at head_dim {spec.head_dim}: three consumers get 160 registers each, which "
            "holds O and S at head_dim 128 only (space.sm90_fp8_consumer_regs)"
        )
    if spec.tile_n % SM90_FP8_MMA_K:
        return (
            f"tile_n={spec.tile_n} is not a multiple of {SM90_FP8_MMA_K} (the k of an fp8 WGMMA, and the "
            "32-key blocks in which V is transposed and permuted)"
        )
    if spec.persistent and spec.block_quant:
        return "persistent with block_quant: the block-quantization path has no persistent scheduler"
    return None


Rule = Callable[[VariantSpec], str | None]

_COMMON_RULES: tuple[Rule, ...] = (
    _fp8_rule,
    _sm90_flags_rule,
    _persistent_rule,
    _early_rescale_rule,
    _pair_cvt_rule,
    _hoist_vt_rule,
    _wide_vt_rule,
    _lazy_rescale_rule,
    _sum_mma_rule,
    _two_level_rule,
    _v_mean_rule,
    _lpt_grid_rule,
    _cta_pair_rule,
    _block_quant_rule,
    _dq_bulk_rule,
    _dq_warp_rule,
    _row_prefetch_rule,
    _dq_stage_rule,
    _dq_quad_rule,
    _dq_tile_rule,
    _dq_pipe_rule,
    _head_dim_rule,
    why_no_kernel,
)
_ARCH_RULES: dict[str, tuple[Rule, ...]] = {
    "sm80": (_sm80_warp_rows, _sm80_tile_n, _sm80_head_dim, _sm80_copy, _sm80_smem, _sm80_regs),
    "sm90": (_sm90_roles, _sm90_tile_n, _sm90_fp8, _sm90_smem, _sm90_regs),
    "sm100": (),
}


# ---------------------------------------------------------------------------------------------
# sm100 (FlashAttention-4 design): compiled and SASS-checked for sm_100a, not hardware-tested.

IMPLEMENTED[("sm100", "fwd")] = ("fp16", "bf16", "e4m3")
SM100_SMEM_LIMIT = 227 * 1024  # B200 per-block opt-in limit (232448 B; the DSL's capacity for sm_100)
SM100_TMEM_COLUMNS = 512  # 128 lanes x 512 columns x 32 bit per SM
SM100_WARPS = 16  # softmax 0 and 1, correction, MMA / load / epilogue / spare: 4 warpgroups
SM100_SOFTMAX_REGS = 184  # setmaxnreg of a softmax thread (a whole row of S lives in registers)
SM100_SOFTMAX_OVERHEAD = 48  # row max/sum, coordinates, pipeline state, TMEM addresses

# Two Q tiles of 128 rows in flight (tile_m 256) where S and O of both fit the 512 TMEM columns;
# head dim 256 keeps one Q tile. exp_emu (percent of exp2 on the FMA units) follows
# tools/roofline.py: exp is co-critical with the MMAs up to head dim 128, MMA-bound beyond.
DEFAULT_TILES["sm100"] = {
    64: Tile(256, 128, 3, 16),
    96: Tile(256, 128, 3, 16),
    128: Tile(256, 128, 3, 16),
    192: Tile(256, 64, 3, 16),
    256: Tile(128, 64, 2, 16),
}
DEFAULT_EXP_EMU: dict[str, dict[int, int]] = {"sm100": {64: 25, 96: 25, 128: 25, 192: 0, 256: 0}}

# CTA-pair (2-SM UMMA, cta_pair) variants committed next to the defaults, on the default tile of
# each head dim >= 128, so that a Blackwell run can compare them; the defaults stay single-CTA
# until a measurement says otherwise (docs/sm100-model.md gives the predicted effect).
PAIR_ALTERNATIVES: dict[str, dict[int, tuple[Tile, ...]]] = {
    "sm100": {hd: (DEFAULT_TILES["sm100"][hd],) for hd in (128, 192, 256)},
}


def sm100_tmem_columns(spec: VariantSpec) -> int:
    """TMEM columns one CTA uses: per Q tile of 128 rows, S (tile_n fp32 columns, P and the row
    statistics live inside it) and O (head_dim fp32 columns)."""
    return spec.tile_m // 128 * (spec.tile_n + spec.head_dim)


def sm100_smem_bytes(spec: VariantSpec) -> int:
    """Q tiles, the K/V ring (K and V share its stages) and one 128-row O staging tile, plus
    mbarriers and 1 KiB alignment of each buffer. A CTA of a pair (cta_pair) holds half of each
    K/V stage: tile_n / 2 keys of K or head_dim / 2 columns of V. e4m3: Q, K and V take one byte
    per element, the staged O (bf16 output) two."""
    ring_rows = spec.tile_n // 2 if spec.cta_pair else spec.tile_n
    operands = (spec.tile_m + spec.stages * ring_rows) * spec.head_dim * spec.elem_bytes
    out_bytes = 2  # fp16/bf16 output; e4m3 inputs give bf16 output
    return operands + 128 * spec.head_dim * out_bytes + 4 * SMEM_RESERVE


SM100_BWD_REGISTERS = 128  # one warpgroup, no setmaxnreg: up to 255 per thread


def _sm100_registers(spec: VariantSpec) -> int:
    if spec.direction == "bwd":
        # Calibrated on compiled SASS (sm_100a, DSL 4.8.1): 105-128 registers, no spill; the
        # 32-column S^T and dP^T chunks (64) plus their 16-bit copies dominate.
        return SM100_BWD_REGISTERS
    # A softmax thread owns one query row: tile_n fp32 scores, P converted 32 scores at a time.
    return spec.tile_n + SM100_SOFTMAX_OVERHEAD


_REGISTER_MODELS["sm100"] = _sm100_registers


def _sm100_roles(spec: VariantSpec) -> str | None:
    if spec.warps != SM100_WARPS:
        return f"warps={spec.warps} must be {SM100_WARPS} (softmax x2, correction, MMA/load/epilogue warpgroups)"
    if spec.tile_m not in (128, 256):
        return f"tile_m={spec.tile_m} must be 128 or 256 (one or two 128-row Q tiles in flight)"
    return None


def _sm100_tile_n(spec: VariantSpec) -> str | None:
    if spec.tile_n not in (64, 128):
        return f"tile_n={spec.tile_n} must be 64 or 128 (UMMA N of S = Q K^T, a multiple of the 32-score P chunk)"
    if spec.stages < 2:
        return f"stages={spec.stages}: the K/V TMA ring needs at least 2 stages"
    return None


def _sm100_tmem(spec: VariantSpec) -> str | None:
    cols = sm100_tmem_columns(spec)
    if cols > SM100_TMEM_COLUMNS:
        return (
            f"needs {cols} TMEM columns ({spec.tile_m // 128} x (S {spec.tile_n} + O {spec.head_dim})), "
            f"over the {SM100_TMEM_COLUMNS} of an SM"
        )
    return None


SM100_PAIR_MIN_HEAD_DIM = 128


def _sm100_pair(spec: VariantSpec) -> str | None:
    """The CTA pair (tcgen05 cta_group::2) splits every V tile by head-dim columns between its
    two CTAs and every K tile by keys; the UMMAs are M = 256 (128 rows per CTA)."""
    if not spec.cta_pair:
        return None
    if spec.head_dim < SM100_PAIR_MIN_HEAD_DIM:
        return (
            f"head_dim={spec.head_dim}: cta_pair is for head_dim >= {SM100_PAIR_MIN_HEAD_DIM}: each CTA would load "
            f"{spec.head_dim // 2} columns of V, under one 128-byte swizzle row (64 elements), and at this head dim "
            "the K/V traffic the pair halves is small beside its Q and O traffic"
        )
    if spec.tile_n == 128 and spec.exp_emu == 0 and (spec.tile_m, spec.head_dim) != (128, 128):
        # Calibrated on compiled SASS (sm_100a, DSL 4.8.1), causal or not: hd128 256x128, hd192 and
        # hd256 128x128 spill 8-48 B (second softmax and correction warpgroups) with every exp2 on
        # MUFU, none with exp_emu=25; hd128 128x128 compiles clean either way. The single-CTA
        # twins spill the same.
        return (
            f"tile_n=128 with exp_emu=0 spills registers in the pair's softmax/correction warps at "
            f"head_dim={spec.head_dim}, tile_m={spec.tile_m} (compiled SASS); exp_emu=25 does not"
        )
    return None


SM100_FP8_MMA_K = 32  # k of a tcgen05 kind::f8f6f4 UMMA: O += P V steps over keys 32 at a time
SM100_FP8_V_MN_STEP = 16  # UMMA N step with an 8-bit MN-major B (V as TMA lands it), cta_group::1


def _sm100_fp8(spec: VariantSpec) -> str | None:
    """The e4m3 forward's own limits (tcgen05 kind::f8f6f4, P as four e4m3 per TMEM column)."""
    if spec.dtype != "e4m3":
        return None
    if spec.cta_pair:
        return (
            "cta_pair: the sm100 e4m3 forward is single-CTA only (no CTA-pair, 2-SM e4m3 UMMA variant "
            "is built)"
        )
    if spec.tile_n % SM100_FP8_MMA_K:
        return (
            f"tile_n={spec.tile_n} is not a multiple of {SM100_FP8_MMA_K} (the k of an e4m3 UMMA: P V "
            "steps over keys 32 at a time, and each 32-score chunk of P fills 8 TMEM columns)"
        )
    if spec.head_dim % SM100_FP8_V_MN_STEP:
        return (
            f"head_dim={spec.head_dim} is not a multiple of {SM100_FP8_V_MN_STEP} (the N step of an e4m3 "
            "UMMA whose B operand, V, is MN-major)"
        )
    return None


def _sm100_smem(spec: VariantSpec) -> str | None:
    needed = sm100_smem_bytes(spec)
    if needed > SM100_SMEM_LIMIT:
        return f"needs {needed / 1024:.1f} KiB of shared memory, over the {SM100_SMEM_LIMIT // 1024} KiB of a B200 block"
    return None


def _sm100_regs(spec: VariantSpec) -> str | None:
    estimate = _sm100_registers(spec)
    if estimate > SM100_SOFTMAX_REGS:
        return f"a softmax thread would need ~{estimate} registers, over its {SM100_SOFTMAX_REGS}"
    return None


def _exp_emu_share(spec: VariantSpec) -> str | None:
    if spec.exp_emu * 16 % 100:
        return f"exp_emu={spec.exp_emu} must be a multiple of 6.25% (whole scores of every 16): 0, 25, 50, 75 or 100"
    return None


def _exp_emu_family(spec: VariantSpec) -> str | None:
    if spec.exp_emu and (spec.arch not in ("sm90", "sm100") or spec.direction != "fwd"):
        return f"exp_emu={spec.exp_emu}: emulated exp2 is an sm90/sm100 forward option only"
    return None


# The sm100 backward (templates/bwd_sm100.py.j2): one warpgroup, 128 keys per CTA, 128 query rows
# per step, every product a 128-row UMMA with its accumulator in TMEM. Compiled and SASS-checked
# for sm_100a, not run.
IMPLEMENTED[("sm100", "bwd")] = ("fp16", "bf16")
SM100_BWD_TILE = Tile(128, 128, 1, 4)
_TILE_GRID["sm100"] = (*_TILE_GRID["sm100"], SM100_BWD_TILE)
DEFAULT_BWD_TILES["sm100"] = {64: SM100_BWD_TILE, 128: SM100_BWD_TILE}


def sm100_bwd_tmem_columns(spec: VariantSpec) -> int:
    """TMEM columns of the sm100 backward: S^T and dP^T (tile_m each; dQ reuses them) + dK + dV."""
    return 2 * spec.tile_m + 2 * spec.head_dim


def sm100_bwd_smem_bytes(spec: VariantSpec) -> int:
    """K, V (tile_n x d), Q, dO (tile_m x d), P^T and dS^T (tile_n x tile_m), 1 KiB-aligned each,
    plus mbarriers and the LSE/D rows of a step."""
    elements = 2 * (spec.tile_n + spec.tile_m) * spec.head_dim + 2 * spec.tile_n * spec.tile_m
    return elements * spec.elem_bytes + 7 * SMEM_RESERVE


def _sm100_bwd(spec: VariantSpec) -> str | None:
    if (spec.tile_m, spec.tile_n, spec.stages, spec.warps) != tuple(SM100_BWD_TILE):
        return (
            f"the sm100 backward runs tile_m={SM100_BWD_TILE.tile_m} tile_n={SM100_BWD_TILE.tile_n} "
            f"stages={SM100_BWD_TILE.stages} warps={SM100_BWD_TILE.warps} (128-row UMMAs, one TMEM lane per thread)"
        )
    if spec.head_dim % 64:
        return (
            f"head_dim={spec.head_dim}: the sm100 backward reads Q, dO and K both K-major and MN-major "
            "from one 128-byte-swizzled buffer, which needs a multiple of 64"
        )
    cols = sm100_bwd_tmem_columns(spec)
    if cols > SM100_TMEM_COLUMNS:
        return f"needs {cols} TMEM columns (S^T + dP^T + dK + dV), over the {SM100_TMEM_COLUMNS} of an SM"
    needed = sm100_bwd_smem_bytes(spec)
    if needed > SM100_SMEM_LIMIT:
        return f"needs {needed / 1024:.1f} KiB of shared memory, over the {SM100_SMEM_LIMIT // 1024} KiB of a B200 block"
    return None


# The sm90 backward (templates/bwd_sm90.py.j2, FlashAttention-3 design): one producer warpgroup
# (TMA of K/V once per key block, of Q/dO through a `stages`-deep ring) and two consumer warpgroups
# of 64 keys each, so tile_n = 128 and warps = 12; tile_m query rows per step. dK and dV (64 x d
# fp32 per warpgroup) live in registers through the whole query loop, beside S^T and dP^T (64 x
# tile_m) and the 16-bit P^T/dS^T operands: hd64 takes 128 query rows per step, hd96 and hd128 64.
IMPLEMENTED[("sm90", "bwd")] = ("fp16", "bf16")
SM90_BWD_TILE_N = 128
SM90_BWD_WARPS = 12
SM90_BWD_HEAD_DIMS = (64, 96, 128)
SM90_BWD_SWAP_REG_OVERHEAD = 40  # as SM90_BWD_REG_OVERHEAD (sm90_bwd_swap_registers: SASS 226 vs 232)
SM90_BWD_REG_OVERHEAD = 40  # descriptors, pipeline state, coordinates, LSE/D reads, addresses
# FlashAttention-4's non-causal hd128 tile: 80 query rows per step (tile_m not a multiple of 64, so
# dQ is computed transposed, dQ^T = K^T dS^T: each consumer 64 head-dim columns x tile_m queries on
# WGMMA's M x N; dq_bulk only). Its register model: S^T + dP^T (64 x 80 fp32) beside dK + dV.
SM90_BWD_DQ_SWAP_TILE_M = 80
SM90_BWD_DQ_SWAP_HEAD_DIMS = (128,)
# Calibrated on SASS (sm_90a, DSL 4.8.1): estimate 128 + 80 + 28 = 236; the consumers use 236
# (non-causal, R235) and 234 (causal) of their 240 registers, no spill, six WGMMA waits.
SM90_BWD_DQ_SWAP_REG_OVERHEAD = 28
# Head dims 192 and 256 (templates/bwd_sm90_hsplit.py.j2): fp32 dK + dV of 64 keys would take d
# registers per thread, so the two consumer warpgroups share the CTA's 64 keys instead and split the
# head dim of dK, dV and dQ between them (d/2 columns each); S^T and dP^T (64 keys x 64 queries) are
# split by queries (32 each), and P^T, dS^T go through shared memory so that each warpgroup reads
# all 64 queries of them as the K of its dV and dK WGMMAs. tile_n = 64, tile_m = 64.
SM90_BWD_SPLIT_TILE_N = 64
SM90_BWD_SPLIT_HEAD_DIMS = (192, 256)
# Head dim 192 with dK/dV on WGMMA's M axis (templates/bwd_sm90_swapkv.py.j2, FlashAttention-3's
# hd192 partition): a CTA owns 96 keys, each consumer warpgroup 48 of them for S, dP, dK and dV
# (computed as dK^T, dV^T: head_dim x 48, so no M = 64 key slab is needed); dQ split by head-dim
# columns (96 each) over all 96 keys. tile_n = 96, tile_m = 64, P and dS through shared memory.
SM90_BWD_SWAP_TILE_N = 96
SM90_BWD_SWAP_HEAD_DIMS = (192,)
# Head dim 192's default is the swapped partition on FlashAttention-4's shared-memory budget
# (dq_bulk + dq_stage, DEFAULT_BWD_SWAP_FLAGS: +6-10% over the in-stage dq_bulk and ~1.6x the plain
# head-dim split in bf16 on the H200, docs/perf-notes.md "hd192 on FA4's budget measured"); head
# dim 256 keeps the head-dim split.
DEFAULT_BWD_TILES["sm90"] = {
    64: Tile(128, 128, 2, 12),
    96: Tile(64, 128, 2, 12),
    128: Tile(64, 128, 2, 12),
    192: Tile(64, SM90_BWD_SWAP_TILE_N, 2, 12),
    256: Tile(64, 64, 2, 12),
}
_TILE_GRID["sm90"] = (
    *_TILE_GRID["sm90"],
    *(Tile(m, 128, s, 12) for m in (64, 128) for s in (2, 3) if (m, s) != (128, 2)),
    *(Tile(64, 64, s, 12) for s in (2, 3)),
    Tile(64, 96, 2, 12),
    Tile(SM90_BWD_DQ_SWAP_TILE_M, 128, 2, 12),  # hd128 with dQ transposed (sm90_bwd_dq_swapped)
)
# Backward schedules: the default, and overlap (a query block's dQ WGMMA stays in flight and its
# reductions into dq_accum are issued behind the next block's S^T/dP^T WGMMAs); each with dQ added
# by per-thread reductions or by one bulk reduce-add per consumer and query block (dq_bulk), the
# bulk reduce-adds issued by the consumers or by a dQ-writer warp of the producer warpgroup (dq_warp),
# with LSE2/D read ahead of the WGMMA waits (row_prefetch).
_FLAG_SETS[("sm90", "bwd")] = (
    {},
    {"overlap": True},
    {"dq_bulk": True},
    {"overlap": True, "dq_bulk": True},
    {"dq_bulk": True, "dq_warp": True},
    {"overlap": True, "dq_bulk": True, "dq_warp": True},
    {"dq_bulk": True, "dq_warp": True, "row_prefetch": True},
    {"overlap": True, "dq_bulk": True, "dq_warp": True, "row_prefetch": True},
    {"dq_bulk": True, "dq_stage": True},
)
# sm80 backward: dQ reductions in the accumulator's natural layout, or 16-byte ones into a
# column-permuted one (dq_quad), or into one tiled by query blocks in fragment order (dq_tile), that
# one also with the dQ GEMM by column chunks, each chunk's reductions between the next one's MMAs
# (dq_pipe).
_FLAG_SETS[("sm80", "bwd")] = ({}, {"dq_quad": True}, {"dq_tile": True}, {"dq_tile": True, "dq_pipe": True})

# Flags of the sm90 backward default where the default tile is not the head-dim split (head dims
# 64, 96, 128): dq_bulk, FlashAttention-3's dQ path (measured +9-19% over per-thread reductions at
# hd64/hd128 on the H200, docs/perf-notes.md "dq_bulk ... measured").
# sm80: dq_tile, FlashAttention-2's fp32 dQ workspace (each query block's dQ in the MMA's fragment
# order; +5-9% over dq_quad and +11-21% over the natural layout on the H200, docs/perf-notes.md
# "sm80 backward: the dQ accumulator in fragment order"), the layout FlashAttention-2 itself uses on
# every sm8x GPU.
DEFAULT_BWD_FLAGS: dict[str, dict[str, bool]] = {"sm90": {"dq_bulk": True}, "sm80": {"dq_tile": True}}
# Flags a family's default backward adds at one head dim, on single-buffered tiles (the default
# tile and any other one-stage tile of that head dim). sm80 hd96, hd192 and hd256: dq_pipe, the dQ
# GEMM by column chunks with each chunk's reductions issued between the next chunk's MMAs and the
# last chunk's during the next step's S GEMM (on the H200, against dq_tile alone: hd192 +8-11%,
# hd256 +9-11% (+3-6% over its double-buffered tile), hd96 +2.5-4%, at every length and mask;
# hd128 +3-7% non-causal but -1 to -3% causal, so not there; docs/perf-notes.md "sm80 backward:
# the dQ reductions between the dQ MMAs").
DEFAULT_BWD_HEAD_DIM_FLAGS: dict[str, dict[int, dict[str, bool]]] = {
    "sm80": {96: {"dq_pipe": True}, 192: {"dq_pipe": True}, 256: {"dq_pipe": True}}
}
# Flags of the sm90 backward default where the default tile is the swapped partition (head dim 192).
DEFAULT_BWD_SWAP_FLAGS: dict[str, bool] = {"dq_bulk": True, "dq_stage": True}
# Flags of the sm90 backward default where the default tile is the head-dim split (head dim 256):
# dq_bulk (staged in the consumer's own columns of the Q/dO stage) with the overlap schedule, the
# variant the tuner picks for bf16 at every length of both masks (+9-14% over per-thread reductions
# without the overlap, docs/perf-notes.md "dq_bulk everywhere measured"), so fp16 runs it too.
DEFAULT_BWD_SPLIT_FLAGS: dict[str, bool] = {"dq_bulk": True, "overlap": True}

# Backward alternatives committed next to the defaults (tile, extras), bf16 only (the dtype the
# benchmark measures), so that one GPU run can time each beside the default; dispatch keeps the
# defaults until a tuned table says otherwise. docs/perf-notes.md has the predictions. At hd64 and
# hd128: the per-thread dQ reductions (the default before dq_bulk) on the default tile and with a
# 3-stage ring, each with and without the overlap schedule, and dq_bulk with the overlap schedule
# (the 32 KiB of dQ staging fit beside the 2-stage ring (202 and 200 KiB), not beside a 3-stage one).
BWD_ALTERNATIVE_DTYPES = ("bf16",)
BWD_ALTERNATIVES: dict[str, dict[int, tuple[tuple[Tile, dict[str, bool]], ...]]] = {
    "sm90": {
        64: (
            (Tile(128, 128, 2, 12), {}),
            (Tile(128, 128, 3, 12), {}),
            (Tile(128, 128, 2, 12), {"overlap": True}),
            (Tile(128, 128, 3, 12), {"overlap": True}),
            (Tile(128, 128, 2, 12), {"overlap": True, "dq_bulk": True}),
            # the dQ-writer warp on the tuned table's tile (docs/perf-notes.md "A dQ-writer warp")
            (Tile(128, 128, 2, 12), {"dq_bulk": True, "dq_warp": True}),
            # and with LSE2/D read ahead of the WGMMA waits (docs/perf-notes.md "LSE2 and D read
            # ahead of the waits")
            (Tile(128, 128, 2, 12), {"dq_bulk": True, "dq_warp": True, "row_prefetch": True}),
            # FlashAttention-4's issue order (dV before the barrier, dK under dQ) with the dQ-writer
            # warp, and with LSE2/D read ahead
            (Tile(128, 128, 2, 12), {"overlap": True, "dq_bulk": True, "dq_warp": True}),
            (Tile(128, 128, 2, 12), {"overlap": True, "dq_bulk": True, "dq_warp": True, "row_prefetch": True}),
        ),
        128: (
            (Tile(64, 128, 2, 12), {}),
            (Tile(64, 128, 3, 12), {}),
            (Tile(64, 128, 2, 12), {"overlap": True}),
            (Tile(64, 128, 3, 12), {"overlap": True}),
            (Tile(64, 128, 2, 12), {"overlap": True, "dq_bulk": True}),
            # FlashAttention-4's non-causal hd128 tile: 80 query rows per step, dQ transposed
            # (sm90_bwd_dq_swapped); docs/perf-notes.md "hd128 backward beside FA4's configuration".
            (Tile(80, 128, 2, 12), {"dq_bulk": True}),
            # the dQ-writer warp on the tuned table's tile, with and without the overlap schedule
            (Tile(64, 128, 2, 12), {"dq_bulk": True, "dq_warp": True}),
            (Tile(64, 128, 2, 12), {"overlap": True, "dq_bulk": True, "dq_warp": True}),
            (Tile(64, 128, 2, 12), {"dq_bulk": True, "dq_warp": True, "row_prefetch": True}),
            (Tile(64, 128, 2, 12), {"overlap": True, "dq_bulk": True, "dq_warp": True, "row_prefetch": True}),
        ),
        # The head-dim split's overlap: each consumer issues dV and dK over its own 32 queries with
        # P^T, dS^T as register operands before the per-block barrier, the other consumer's 32
        # after it from shared memory (the first half of those WGMMAs fills the barrier's idle phase).
        # dq_bulk on the head split: the 48 KiB of hd192's dQ staging fill the 2-stage struct up to
        # the opt-in limit exactly; hd256's 64 KiB do not fit beside its (already full) 2-stage
        # ring, so there each consumer stages dQ in its own columns of the Q/dO stage.
        # The swapped-dK/dV partition (64x96, FlashAttention-3's hd192 tile), with per-thread dQ
        # reductions and with dq_bulk (its 48 KiB of dQ staging do not fit beside the 2-stage Q/dO
        # ring: each consumer stages its piece in the current Q/dO stage once both consumers' dV^T
        # and dK^T, which read all of Q and dO, are done; no extra shared memory).
        192: (
            (Tile(64, 64, 2, 12), {}),  # the head-dim split, head dim 192's default before the swapped partition
            (Tile(64, 64, 2, 12), {"overlap": True}),
            (Tile(64, 64, 2, 12), {"dq_bulk": True}),
            (Tile(64, 64, 2, 12), {"overlap": True, "dq_bulk": True}),
            (Tile(64, 96, 2, 12), {}),
            (Tile(64, 96, 2, 12), {"dq_bulk": True}),
            # (the default, DEFAULT_BWD_SWAP_FLAGS: FlashAttention-4's shared-memory budget for this
            # tile, dq_stage: a 2-stage Q ring, a 1-stage dO pipeline, one dS buffer and a 48 KiB
            # fp32 dQ staging buffer of its own; docs/perf-notes.md "hd192 backward on FA4's
            # shared-memory budget")
        ),
        256: (
            (Tile(64, 64, 2, 12), {}),  # the head-dim split as head dim 256's default was before dq_bulk
            (Tile(64, 64, 2, 12), {"overlap": True}),
            (Tile(64, 64, 2, 12), {"dq_bulk": True}),
            # (the default, DEFAULT_BWD_SPLIT_FLAGS: dq_bulk with the overlap schedule)
        ),
    },
    # dq_quad: 16-byte dQ reductions into a column-permuted accumulator (FlashAttention-2 adds dQ
    # with one warp-wide reduction per contiguous 128-byte line of its permuted workspace); on the
    # best tile of each head dim; docs/perf-notes.md "sm80 backward beside FlashAttention-2's
    # configuration". Beside them the same tiles in the accumulator's natural layout (the sm80
    # default before dq_tile, docs/perf-notes.md "sm80 backward: the dQ accumulator in fragment
    # order"), the twins the GPU tests compare both layouts with, bitwise.
    "sm80": {
        64: ((Tile(128, 128, 2, 8), {"dq_quad": True}), (Tile(128, 128, 2, 8), {})),
        128: ((Tile(64, 128, 1, 8), {"dq_quad": True}), (Tile(64, 128, 1, 8), {})),
        192: ((Tile(64, 64, 1, 8), {"dq_quad": True}), (Tile(64, 64, 1, 8), {})),
        256: ((Tile(64, 64, 1, 8), {"dq_quad": True}), (Tile(64, 64, 1, 8), {})),
    },
}

# Backward alternatives of other dtypes than BWD_ALTERNATIVE_DTYPES, per (arch, dtype): fp16 gets the
# dQ-writer warp (dq_warp) on the tiles where bf16's tuned table runs it (hd64 and hd128, +1-4% in
# bf16, docs/perf-notes.md "The dQ-writer warp measured"), the overlap schedule with and
# without it, and LSE2/D read ahead (row_prefetch) on the writer-warp tiles, so that fp16's table
# can pick them too.
_FP16_BWD_SCHEDULES: tuple[dict[str, bool], ...] = (
    {"dq_bulk": True, "dq_warp": True},
    {"overlap": True, "dq_bulk": True},
    {"overlap": True, "dq_bulk": True, "dq_warp": True},
    {"dq_bulk": True, "dq_warp": True, "row_prefetch": True},
    {"overlap": True, "dq_bulk": True, "dq_warp": True, "row_prefetch": True},
)
BWD_DTYPE_ALTERNATIVES: dict[tuple[str, str], dict[int, tuple[tuple[Tile, dict[str, bool]], ...]]] = {
    ("sm90", "fp16"): {
        hd: tuple((tile, flags) for flags in _FP16_BWD_SCHEDULES)
        for hd, tile in ((64, Tile(128, 128, 2, 12)), (128, Tile(64, 128, 2, 12)))
    },
}


def sm90_bwd_dq_pieces(spec: VariantSpec) -> tuple[tuple[int, int, int], ...] | None:
    """The dQ piece of each consumer warpgroup, (64-row block, first column, columns), or None
    where none fits. tile_m=128: one 64-row block each, all columns. tile_m=64: a column split at a
    swizzle-atom boundary of K (64 columns when head_dim is a multiple of 64, else 32): halves for
    head_dim 128, 64 + 32 for head_dim 96; the second piece must tile the columns from its start.
    The head-dim split and the swapped-dK/dV partition: each consumer half the columns, all 64 rows."""
    if sm90_bwd_head_split(spec) or sm90_bwd_swapped(spec):  # each consumer half the head dim, all 64 rows
        half = spec.head_dim // 2
        return ((0, 0, half), (0, half, half))
    if spec.tile_m == 128:
        return ((0, 0, spec.head_dim), (1, 0, spec.head_dim))
    if sm90_bwd_dq_swapped(spec):  # dQ^T: each consumer 64 head-dim columns of all tile_m rows
        return ((0, 0, 64), (0, 64, 64))
    atom = 64 if spec.head_dim % 64 == 0 else 32
    first = -(-spec.head_dim // 2 // atom) * atom
    second = spec.head_dim - first
    if spec.tile_m != 64 or second <= 0 or first % second:
        return None
    return ((0, 0, first), (0, first, second))


def sm90_bwd_dq_swapped(spec: VariantSpec) -> bool:
    """Whether ``spec`` is the sm90 backward (templates/bwd_sm90.py.j2, tile_n = 128) with a query
    block that is not a multiple of WGMMA's 64-row M (tile_m = 80, FlashAttention-4's non-causal
    hd128 tile): dQ is computed transposed, dQ^T = K^T dS^T, consumer c owning head-dim columns
    [64 c, 64 c + 64) of all tile_m rows (WGMMA M = 64 columns, N = tile_m queries, K = the 128 keys;
    A = K^T and B = dS^T both MN-major in shared memory, the same bytes as the other tiles' dQ
    operands). Its dQ piece is the transposed fragment, so it goes out by dq_bulk only."""
    return (
        (spec.arch, spec.direction, spec.tile_n) == ("sm90", "bwd", SM90_BWD_TILE_N)
        and spec.tile_m == SM90_BWD_DQ_SWAP_TILE_M
    )


def sm90_bwd_head_split(spec: VariantSpec) -> bool:
    """Whether ``spec`` is the head-dim-split sm90 backward (templates/bwd_sm90_hsplit.py.j2): the
    two consumer warpgroups share tile_n = 64 keys and each owns half of the head dim."""
    return (spec.arch, spec.direction, spec.tile_n) == ("sm90", "bwd", SM90_BWD_SPLIT_TILE_N)


def sm90_bwd_swapped(spec: VariantSpec) -> bool:
    """Whether ``spec`` is the swapped-dK/dV sm90 backward (templates/bwd_sm90_swapkv.py.j2): 96
    keys per CTA, 48 per consumer warpgroup, dK^T and dV^T with the head dim on WGMMA's M axis."""
    return (spec.arch, spec.direction, spec.tile_n) == ("sm90", "bwd", SM90_BWD_SWAP_TILE_N)


def sm90_bwd_swap_smem_bytes(spec: VariantSpec) -> int:
    """The swapped backward's struct: K and V (tile_n x d), the Q and dO ring (stages x tile_m x d
    each), one P buffer and two dS buffers (tile_m x tile_n), 1 KiB-aligned each, the LSE2/D rows
    and mbarriers, rounded up to 1 KiB, plus the kernel's 1 KiB of static shared memory. dq_bulk
    adds nothing: each consumer stages its fp32 dQ piece (64 x d/2) in its 16-bit tile of the current
    Q/dO stage (consumer 0 dO's, consumer 1 Q's: the same bytes).
    dq_stage (FlashAttention-4's budget): a Q ring of ``stages`` and a dO pipeline of one stage, one
    P and one dS buffer, and the fp32 dQ staging of its own (tile_m x d: each consumer's 64 x d/2
    piece); hd192 s2: 72 + 48 + 24 + 12 + 12 + 48 KiB of buffers, 219 KiB in all."""
    if spec.dq_stage:
        elements = 2 * spec.tile_n * spec.head_dim + (spec.stages + 1) * spec.tile_m * spec.head_dim
        elements += 2 * spec.tile_m * spec.tile_n
        staging = 4 * spec.tile_m * spec.head_dim
        barriers = (2 + 2 * spec.stages + 2) * 8
    else:
        elements = 2 * spec.tile_n * spec.head_dim + 2 * spec.stages * spec.tile_m * spec.head_dim
        elements += 3 * spec.tile_m * spec.tile_n
        staging = 0
        barriers = (2 + 2 * spec.stages) * 8
    rows = 2 * 2 * spec.tile_m * 4
    struct = elements * spec.elem_bytes + staging + rows + barriers
    return -(-struct // SMEM_RESERVE) * SMEM_RESERVE + SMEM_RESERVE


def sm90_bwd_swap_registers(spec: VariantSpec) -> int:
    """The swapped backward's consumer thread at the peak: fp32 dK^T and dV^T (d x tile_n/2 each)
    for the whole query loop, beside the larger of S + dP (tile_m x tile_n/2 each, fp32) and the
    fp32 dQ piece (64 queries x d/2 columns, after P and dS have gone to shared memory).
    Calibrated on compiled SASS (sm_90a, DSL 4.8.1): estimate 232; the consumers use 226 (non-causal)
    and 222-224 (causal) of their 240 registers, no spill, with and without dq_bulk."""
    keys = spec.tile_n // 2
    acc_dkv = 2 * spec.head_dim * keys // 128
    acc_sdp = 2 * spec.tile_m * keys // 128
    acc_dq = 64 * (spec.head_dim // 2) // 128
    return acc_dkv + max(acc_sdp, acc_dq) + SM90_BWD_SWAP_REG_OVERHEAD


def _sm90_bwd_swap(spec: VariantSpec) -> str | None:
    """The swapped-dK/dV partition (tile_n = 96, head dim 192): 64 query rows per step, 2 stages."""
    if spec.tile_m != 64:
        return f"tile_m={spec.tile_m}: the swapped-dK/dV sm90 backward takes 64 query rows per step (WGMMA M of S and dP)"
    if spec.stages < 2:
        return f"stages={spec.stages}: the Q/dO TMA ring needs at least 2 stages to overlap loads with MMAs"
    if spec.pingpong:
        return "pingpong: the sm90 backward has no ping-pong schedule (its consumers meet at a barrier per query block)"
    if spec.overlap:
        return "overlap: the swapped-dK/dV sm90 backward has no overlap schedule (dV and dK read P and dS from shared memory)"
    estimate = sm90_bwd_swap_registers(spec)
    if estimate > SM90_CONSUMER_REGS:
        return f"would spill registers (estimated {estimate} > {SM90_CONSUMER_REGS} per consumer thread after setmaxnreg)"
    needed = sm90_bwd_swap_smem_bytes(spec)
    if needed > SM90_SMEM_LIMIT:
        return (
            f"needs {needed / 1024:.1f} KiB of shared memory, over the {SM90_SMEM_LIMIT // 1024} KiB "
            "per-block opt-in limit of the H100/H200"
        )
    return None


def sm90_bwd_smem_bytes(spec: VariantSpec) -> int:
    """K and V (tile_n x d), the Q and dO ring (stages x tile_m x d each), two dS buffers
    (tile_m x tile_n), 1 KiB-aligned each, plus the LSE2/D rows (two buffers) and mbarriers.
    The head-dim split (:func:`sm90_bwd_head_split`) also keeps two P^T buffers (tile_n x tile_m);
    its struct (the 1 KiB-aligned buffers, then the rows and mbarriers) is counted exactly, rounded
    up to its 1 KiB alignment as the DSL sizes it, plus the kernel's 1 KiB of static shared memory
    (every compiled sm_90a backward cubin has it): hd256 s2 and hd192 s3 need exactly the 232,448
    bytes of the opt-in limit (a 231,424-byte struct, Storage.size_in_bytes()). dq_bulk adds its
    1 KiB-aligned staging buffers (:func:`sm90_bwd_dq_bulk_bytes`) to that struct: hd192 s2 then
    needs exactly the limit too (48 KiB more); hd256 s2 and hd192 s3 stage dQ in the Q/dO stage
    instead (:func:`sm90_bwd_dq_bulk_aliases`, no extra bytes)."""
    if sm90_bwd_head_split(spec):
        return _sm90_bwd_split_smem_bytes(spec, sm90_bwd_dq_bulk_bytes(spec))
    if sm90_bwd_swapped(spec):
        return sm90_bwd_swap_smem_bytes(spec)
    if sm90_bwd_dq_swapped(spec):
        return sm90_bwd_dq_swap_smem_bytes(spec)
    elements = 2 * spec.tile_n * spec.head_dim + 2 * spec.stages * spec.tile_m * spec.head_dim
    elements += 2 * spec.tile_m * spec.tile_n
    staged_dq = sm90_bwd_dq_bulk_bytes(spec)
    return elements * spec.elem_bytes + staged_dq + 4 * 2 * spec.tile_m * 4 + 6 * SMEM_RESERVE


def sm90_bwd_dq_swap_smem_bytes(spec: VariantSpec) -> int:
    """The tile_m = 80 struct (:func:`sm90_bwd_dq_swapped`) counted exactly as the template lays it
    out: mbarriers and the LSE2/D rows (two buffers each) first, then K, V, the Q and dO ring, two dS
    buffers and the fp32 dQ staging (tile_m x d), each 1 KiB-aligned, rounded up to 1 KiB, plus the
    kernel's 1 KiB of static shared memory. hd128 s2: a 2,048-byte head + 229,376 bytes of buffers =
    231,424, + 1 KiB = 232,448, exactly the opt-in limit (FlashAttention-4's budget for this tile:
    the same buffers)."""
    head = (2 + 2 * spec.stages) * 8
    head = -(-head // 16) * 16 + 2 * spec.tile_m * 4  # sLSE, 16-byte aligned
    head = -(-head // 16) * 16 + 2 * spec.tile_m * 4  # sD
    buffers = (2 * spec.tile_n * spec.head_dim + 2 * spec.stages * spec.tile_m * spec.head_dim) * spec.elem_bytes
    buffers += 2 * spec.tile_m * spec.tile_n * spec.elem_bytes + sm90_bwd_dq_bulk_bytes(spec)
    struct = -(-head // SMEM_RESERVE) * SMEM_RESERVE + buffers
    return -(-struct // SMEM_RESERVE) * SMEM_RESERVE + SMEM_RESERVE


def _sm90_bwd_split_smem_bytes(spec: VariantSpec, staging: int) -> int:
    """The head-dim split's struct with ``staging`` bytes of 1 KiB-aligned dQ staging, rounded up to
    1 KiB, plus the kernel's 1 KiB of static shared memory (:func:`sm90_bwd_smem_bytes`)."""
    elements = 2 * spec.tile_n * spec.head_dim + 2 * spec.stages * spec.tile_m * spec.head_dim
    elements += 4 * spec.tile_m * spec.tile_n
    rows = 2 * 2 * spec.tile_m * 4  # LSE2 and D, two buffers each, fp32
    barriers = (2 + 2 * spec.stages) * 8
    struct = elements * spec.elem_bytes + staging + rows + barriers
    return -(-struct // SMEM_RESERVE) * SMEM_RESERVE + SMEM_RESERVE


def sm90_bwd_dq_bulk_aliases(spec: VariantSpec) -> bool:
    """Whether the dq_bulk path of the head-dim split stages dQ in the current Q/dO stage instead of
    buffers of its own (which would not fit: hd256 s2, hd192 s3). After the consumers' barrier a
    warpgroup's own head-dim columns of that stage (64 x d/2 of Q and of dO, 16-bit: exactly the
    bytes of its fp32 64 x d/2 dQ piece, each a run of whole swizzle-atom panels) are read only by
    its own dV and dK WGMMAs, and refilled only after it releases the stage: the piece goes out in
    two halves (dO's columns once dV is done, Q's once dK is), and the stage is released after the
    bulk copies have read them."""
    if not (spec.dq_bulk and sm90_bwd_head_split(spec)):
        return False
    return _sm90_bwd_split_smem_bytes(spec, 4 * spec.tile_m * spec.head_dim) > SM90_SMEM_LIMIT


def sm90_bwd_dq_bulk_bytes(spec: VariantSpec) -> int:
    """Shared memory of the dq_bulk path: the fp32 dQ of one query block (tile_m x head_dim), each
    consumer's piece staged in its own buffer for the bulk reduce-add; 0 without dq_bulk and where
    the head-dim split stages it in the Q/dO stage (:func:`sm90_bwd_dq_bulk_aliases`)."""
    if not spec.dq_bulk or sm90_bwd_dq_bulk_aliases(spec):
        return 0
    return 4 * spec.tile_m * spec.head_dim


def bwd_dq_accum_shape(
    spec: VariantSpec, splits: int, batch: int, seqlen_q: int, heads_q: int
) -> tuple[int, ...]:
    """Shape of the fp32 dQ workspace of a backward variant. Default layout (splits, batch,
    seqlen_q, heads_q, head_dim). sm90 dq_bulk and sm80 dq_tile: (splits, batch, heads_q, query
    blocks, tile_m * head_dim), seqlen_q rounded up to whole query blocks; each block one contiguous
    chunk in the dQ MMA's fragment order: dq_bulk the consumers' pieces one after the other, each in
    its WGMMA fragment's order (cutefa/kernels/sm90/bwd_parts.py,
    :func:`~cutefa.kernels.sm90.bwd_parts.bulk_dq_coords`); dq_tile every thread's mma.sync fragment
    (cutefa/kernels/sm80/dq_tile.py)."""
    if not (spec.dq_bulk or spec.dq_tile):
        return (splits, batch, seqlen_q, heads_q, spec.head_dim)
    blocks = -(-seqlen_q // spec.tile_m)
    return (splits, batch, heads_q, blocks, spec.tile_m * spec.head_dim)


def sm90_bwd_registers(spec: VariantSpec) -> int:
    """Registers of a consumer thread at the peak (one warpgroup: 64 keys, 128 threads): fp32 dK
    and dV (64 x d each) for the whole query loop, beside fp32 S^T and dP^T (64 x tile_m each;
    the 16-bit P^T/dS^T replace them as they are formed, the dQ piece comes after them).
    Calibrated on compiled SASS (sm_90a, DSL 4.8.1): the defaults (estimates 232) compile within
    the 240 registers of setmaxnreg with no spill."""
    if sm90_bwd_head_split(spec):
        return sm90_bwd_split_registers(spec)
    if sm90_bwd_swapped(spec):
        return sm90_bwd_swap_registers(spec)
    acc_dkv = 2 * 64 * spec.head_dim // 128
    acc_sdp = 2 * 64 * spec.tile_m // 128
    if sm90_bwd_dq_swapped(spec):
        return acc_dkv + acc_sdp + SM90_BWD_DQ_SWAP_REG_OVERHEAD
    return acc_dkv + acc_sdp + SM90_BWD_REG_OVERHEAD


def sm90_bwd_split_registers(spec: VariantSpec) -> int:
    """The head-dim split's consumer thread at the peak: fp32 dK and dV of 64 keys x d/2 columns
    for the whole query loop, beside the larger of S^T + dP^T (64 keys x tile_m/2 queries each,
    with their 16-bit copies) and the fp32 dQ piece (64 queries x d/2 columns, formed after P^T and
    dS^T have gone to shared memory). Calibrated on compiled SASS (sm_90a, DSL 4.8.1): the
    defaults' consumers use 216 (hd256, estimate 232) and 168 (hd192, estimate 184) of their 240
    registers, no spill; the estimate stays 16 high (the 16-bit copies are short-lived)."""
    acc_dkv = 2 * 64 * (spec.head_dim // 2) // 128
    acc_sdp = 3 * 64 * (spec.tile_m // 2) // 128
    acc_dq = 64 * (spec.head_dim // 2) // 128
    return acc_dkv + max(acc_sdp, acc_dq) + SM90_BWD_REG_OVERHEAD


def _sm90_bwd_split(spec: VariantSpec) -> str | None:
    """The head-dim split (tile_n = 64): head dims 192 and 256, 64 query rows per step."""
    if spec.head_dim not in SM90_BWD_SPLIT_HEAD_DIMS:
        return (
            f"tile_n={spec.tile_n} with head_dim={spec.head_dim}: the head-dim-split sm90 backward "
            f"(two warpgroups sharing 64 keys) handles head_dim in {SM90_BWD_SPLIT_HEAD_DIMS}; "
            f"head dims {SM90_BWD_HEAD_DIMS} run tile_n={SM90_BWD_TILE_N}"
        )
    if spec.tile_m != 64:
        return (
            f"tile_m={spec.tile_m}: the head-dim-split sm90 backward takes 64 query rows per step "
            "(32 per warpgroup for S^T and dP^T; the Q/dO ring of 128 rows would not fit in shared memory)"
        )
    if spec.stages < 2:
        return f"stages={spec.stages}: the Q/dO TMA ring needs at least 2 stages to overlap loads with MMAs"
    if spec.pingpong:
        return "pingpong: the sm90 backward has no ping-pong schedule (its consumers meet at a barrier per query block)"
    return None


def _sm90_bwd(spec: VariantSpec) -> str | None:
    if spec.warps == SM90_BWD_WARPS and sm90_bwd_swapped(spec) and spec.head_dim in SM90_BWD_SWAP_HEAD_DIMS:
        return _sm90_bwd_swap(spec)
    if spec.warps != SM90_BWD_WARPS or spec.tile_n not in (SM90_BWD_TILE_N, SM90_BWD_SPLIT_TILE_N):
        return (
            f"the sm90 backward runs warps={SM90_BWD_WARPS} and tile_n={SM90_BWD_TILE_N} (a producer "
            "warpgroup and two consumer warpgroups of 64 keys each) or tile_n="
            f"{SM90_BWD_SPLIT_TILE_N} (head dims {SM90_BWD_SPLIT_HEAD_DIMS}: the two consumers share "
            f"64 keys and split the head dim) or tile_n={SM90_BWD_SWAP_TILE_N} (head dims "
            f"{SM90_BWD_SWAP_HEAD_DIMS}: 48 keys per consumer, dK^T/dV^T on WGMMA's M axis)"
        )
    if sm90_bwd_head_split(spec):
        reason = _sm90_bwd_split(spec)
        if reason is not None:
            return reason
        return _sm90_bwd_budgets(spec)
    if sm90_bwd_dq_swapped(spec):
        reason = _sm90_bwd_dq_swap(spec)
        if reason is not None:
            return reason
        return _sm90_bwd_budgets(spec)
    if spec.tile_m not in (64, 128):
        return (
            f"tile_m={spec.tile_m} must be 64 or 128 (the two consumers split dQ into 64-row blocks), "
            f"or {SM90_BWD_DQ_SWAP_TILE_M} with head_dim in {SM90_BWD_DQ_SWAP_HEAD_DIMS} and dq_bulk (dQ transposed)"
        )
    if spec.head_dim not in SM90_BWD_HEAD_DIMS:
        return (
            f"head_dim={spec.head_dim}: the sm90 backward with tile_n={SM90_BWD_TILE_N} handles "
            f"{SM90_BWD_HEAD_DIMS} (fp32 dK + dV of 64 keys, head_dim registers per thread, must fit "
            f"beside S^T and dP^T); head dims {SM90_BWD_SPLIT_HEAD_DIMS} run tile_n={SM90_BWD_SPLIT_TILE_N} "
            "(the head-dim split)"
        )
    if sm90_bwd_dq_pieces(spec) is None:
        return (
            f"tile_m=64 with head_dim={spec.head_dim}: the two consumers cannot split dQ's columns at a "
            "swizzle-atom boundary of K into two pieces (tile_m=128 splits dQ by rows)"
        )
    if spec.stages < 2:
        return f"stages={spec.stages}: the Q/dO TMA ring needs at least 2 stages to overlap loads with MMAs"
    if spec.pingpong:
        return "pingpong: the sm90 backward has no ping-pong schedule (its consumers meet at a barrier per query block)"
    if spec.overlap:
        pieces = sm90_bwd_dq_pieces(spec)
        if pieces[0][2] != pieces[1][2]:
            return (
                f"overlap with head_dim={spec.head_dim}, tile_m={spec.tile_m}: the consumers' dQ pieces differ "
                f"in width ({pieces[0][2]} and {pieces[1][2]} columns) and overlap carries one accumulator shape"
            )
    return _sm90_bwd_budgets(spec)


def _sm90_bwd_dq_swap(spec: VariantSpec) -> str | None:
    """tile_m = 80 (:func:`sm90_bwd_dq_swapped`): head dim 128, dq_bulk, 2 stages, no overlap."""
    if spec.head_dim not in SM90_BWD_DQ_SWAP_HEAD_DIMS:
        return (
            f"tile_m={spec.tile_m} with head_dim={spec.head_dim}: the transposed-dQ sm90 backward handles "
            f"head_dim in {SM90_BWD_DQ_SWAP_HEAD_DIMS} (each consumer 64 of the head dim's columns)"
        )
    if not spec.dq_bulk:
        return (
            f"tile_m={spec.tile_m} without dq_bulk: the transposed dQ piece (head-dim columns x queries) "
            "goes out by the bulk reduce-add only (the per-thread reductions take 64-row pieces)"
        )
    if spec.stages != 2:
        return f"stages={spec.stages}: tile_m={spec.tile_m} fits the shared memory with a 2-stage Q/dO ring only"
    if spec.pingpong:
        return "pingpong: the sm90 backward has no ping-pong schedule (its consumers meet at a barrier per query block)"
    if spec.overlap:
        return f"overlap: tile_m={spec.tile_m} has the default schedule only (its registers are full)"
    return None


def _sm90_bwd_budgets(spec: VariantSpec) -> str | None:
    estimate = sm90_bwd_registers(spec)
    if estimate > SM90_CONSUMER_REGS:
        return (
            f"would spill registers (estimated {estimate} > {SM90_CONSUMER_REGS} per consumer thread "
            "after setmaxnreg)"
        )
    needed = sm90_bwd_smem_bytes(spec)
    if needed > SM90_SMEM_LIMIT:
        return (
            f"needs {needed / 1024:.1f} KiB of shared memory, over the {SM90_SMEM_LIMIT // 1024} KiB "
            "per-block opt-in limit of the H100/H200"
        )
    return None


def _forward_only(rule: Rule) -> Rule:
    def check(spec: VariantSpec) -> str | None:
        return rule(spec) if spec.direction == "fwd" else None

    check.__name__ = rule.__name__
    return check


def _backward_only(rule: Rule) -> Rule:
    def check(spec: VariantSpec) -> str | None:
        return rule(spec) if spec.direction == "bwd" else None

    check.__name__ = rule.__name__
    return check


_COMMON_RULES = (*_COMMON_RULES, _exp_emu_family)
_ARCH_RULES["sm90"] = (
    *(_forward_only(r) for r in (*_ARCH_RULES["sm90"], _exp_emu_share)),
    _backward_only(_sm90_bwd),
)
_ARCH_RULES["sm100"] = (
    *(
        _forward_only(r)
        for r in (
            _sm100_roles,
            _sm100_fp8,
            _sm100_tile_n,
            _exp_emu_share,
            _sm100_pair,
            _sm100_tmem,
            _sm100_smem,
            _sm100_regs,
        )
    ),
    _backward_only(_sm100_bwd),
)


def why_invalid(spec: VariantSpec) -> str | None:
    """The first rule ``spec`` breaks, as a sentence naming it; None when the spec can be built."""
    for rule in _COMMON_RULES + _ARCH_RULES[spec.arch]:
        reason = rule(spec)
        if reason is not None:
            return reason
    return None


def valid_variants(arch: str, direction: str = "fwd") -> list[VariantSpec]:
    """The candidates of ``arch`` that pass :func:`why_invalid`."""
    return [spec for spec in candidates(arch, direction) if why_invalid(spec) is None]


def default_extras(
    arch: str, direction: str, head_dim: int, dtype: str | None = None, stages: int = 1
) -> dict[str, object]:
    """Spec fields beyond the tile that a family's default variant sets: schedule flags (sm90)
    and the exp2 emulation share (sm100) of the forward, plus, when ``dtype`` is given, its own
    forward flags and schedule (:data:`DEFAULT_DTYPE_FLAGS`, :data:`DEFAULT_DTYPE_SCHEDULES`); the sm90 backward's flags (dq_bulk; dq_stage
    on the swapped partition, overlap on the head-dim split) and the sm80 backward's (dq_tile, and
    where ``stages`` (the backward tile's) is 1 the head dim's :data:`DEFAULT_BWD_HEAD_DIM_FLAGS`).
    Dispatch's heuristics use the same."""
    if direction != "fwd":
        tile = DEFAULT_BWD_TILES.get(arch, {}).get(head_dim)
        if tile is None:
            return {}
        default = VariantSpec(arch, direction, "bf16", head_dim, *tile)
        if sm90_bwd_head_split(default):
            return dict(DEFAULT_BWD_SPLIT_FLAGS)
        if sm90_bwd_swapped(default):
            return dict(DEFAULT_BWD_SWAP_FLAGS)
        flags = dict(DEFAULT_BWD_FLAGS.get(arch, {}))
        if stages == 1:
            flags.update(DEFAULT_BWD_HEAD_DIM_FLAGS.get(arch, {}).get(head_dim, {}))
        return flags
    extras: dict[str, object] = dict(DEFAULT_FLAGS.get(arch, {}))
    emu = DEFAULT_EXP_EMU.get(arch, {}).get(head_dim, 0)
    if emu:
        extras["exp_emu"] = emu
    if not dtype:
        return extras
    schedule = DEFAULT_DTYPE_SCHEDULES.get((arch, dtype), {}).get(head_dim, {})
    return {**extras, **schedule, **DEFAULT_DTYPE_FLAGS.get((arch, dtype), {})}


def _with_dtype_flags(arch: str, direction: str, dtype: str, flags: dict[str, object]) -> dict[str, object]:
    """Grid flags plus a dtype's own forward flags (:data:`DEFAULT_DTYPE_FLAGS`)."""
    if direction != "fwd":
        return flags
    return {**flags, **DEFAULT_DTYPE_FLAGS.get((arch, dtype), {})}


def default_variants(arch: str, direction: str | None = None) -> list[VariantSpec]:
    """The variants committed to generated/ for ``arch`` (both directions unless one is named), sorted.

    Forward: the DEFAULT_TILES tile with the default extras, the TUNING_ALTERNATIVES tiles, the
    SCHEDULE_ALTERNATIVES schedules on the default tile, the TILE_SCHEDULE_ALTERNATIVES (tile,
    schedule) pairs, and the PAIR_ALTERNATIVES tiles as CTA
    pairs (cta_pair, with the default extras); backward: DEFAULT_BWD_TILES, the
    BWD_TUNING_ALTERNATIVES tiles, and the BWD_ALTERNATIVES (tile, flags) in the
    BWD_ALTERNATIVE_DTYPES, plus a dtype's own BWD_DTYPE_ALTERNATIVES. A direction contributes only once its kernel exists (IMPLEMENTED).
    e4m3 (fp8) gets the default tile and schedule (:data:`DEFAULT_ONLY_DTYPES`) plus its own
    explicit list, :data:`FP8_ALTERNATIVES`, and the block-quantization forwards
    (:func:`fp8_block_specs`).
    """
    _require("arch", arch, ARCHS)
    # (direction, head_dim, tile, extras, is the default)
    entries: list[tuple[str, int, Tile, dict[str, object], bool]] = []
    for hd, tile in DEFAULT_TILES.get(arch, {}).items():
        entries.append(("fwd", hd, tile, default_extras(arch, "fwd", hd), True))
        alternatives = SCHEDULE_ALTERNATIVES.get(arch, {}).get(hd, ())
        entries += [("fwd", hd, tile, extras, False) for extras in alternatives]
    for hd, alts in TUNING_ALTERNATIVES.get(arch, {}).items():
        entries += [("fwd", hd, tile, default_extras(arch, "fwd", hd), False) for tile in alts]
    for hd, alts in TILE_SCHEDULE_ALTERNATIVES.get(arch, {}).items():
        entries += [("fwd", hd, tile, extras, False) for tile, extras in alts]
    for hd, alts in PAIR_ALTERNATIVES.get(arch, {}).items():
        entries += [("fwd", hd, tile, {**default_extras(arch, "fwd", hd), "cta_pair": True}, False) for tile in alts]
    entries += [
        ("bwd", hd, tile, default_extras(arch, "bwd", hd, stages=tile.stages), True)
        for hd, tile in DEFAULT_BWD_TILES.get(arch, {}).items()
    ]
    for hd, alts in BWD_TUNING_ALTERNATIVES.get(arch, {}).items():
        entries += [("bwd", hd, tile, default_extras(arch, "bwd", hd, stages=tile.stages), False) for tile in alts]
    entries += [
        ("bwd", hd, tile, default_extras(arch, "bwd", hd, stages=tile.stages), False)
        for tiles in (LARGE_SMEM_BWD_ALTERNATIVES, SMALL_SMEM_BWD_TILES)
        for hd, tile in tiles.get(arch, {}).items()
    ]
    bwd_alternatives = [
        ("bwd", hd, tile, extras, False) for hd, alts in BWD_ALTERNATIVES.get(arch, {}).items() for tile, extras in alts
    ]
    directions = DIRECTIONS if direction is None else (direction,)
    fp8_alternatives = (
        fp8_alternative_specs(arch) if "fwd" in directions and "e4m3" in IMPLEMENTED.get((arch, "fwd"), ()) else []
    )
    fp8_blocks = (
        fp8_block_specs(arch) if "fwd" in directions and "e4m3" in IMPLEMENTED.get((arch, "fwd"), ()) else []
    )
    return sorted(
        set(fp8_alternatives)
        | set(fp8_blocks)
        | {
            VariantSpec(
                arch, d, dtype, head_dim, *(default_tile(arch, head_dim, dtype) if is_default and d == "fwd" else tile),
                causal=causal, **(default_extras(arch, d, head_dim, dtype) if is_default and d == "fwd" else extras),
            )
            for d, head_dim, tile, extras, is_default in entries
            if d in directions
            for dtype in IMPLEMENTED.get((arch, d), ())
            if is_default or dtype not in DEFAULT_ONLY_DTYPES
            if is_default or dtype in TUNING_ALTERNATIVE_DTYPES.get((arch, head_dim, tile), (dtype,))
            for causal in (False, True)
        }
        | {
            VariantSpec(arch, d, dtype, head_dim, *tile, causal=causal, **extras)
            for d, head_dim, tile, extras, _ in bwd_alternatives
            if d in directions
            for dtype in BWD_ALTERNATIVE_DTYPES
            if dtype in IMPLEMENTED.get((arch, d), ())
            for causal in (False, True)
        }
        | {
            VariantSpec(arch, "bwd", dtype, head_dim, *tile, causal=causal, **extras)
            for (family, dtype), alts in BWD_DTYPE_ALTERNATIVES.items()
            if family == arch and "bwd" in directions and dtype in IMPLEMENTED.get((arch, "bwd"), ())
            for head_dim, entries_ in alts.items()
            for tile, extras in entries_
            for causal in (False, True)
        }
    )
