"""The variant space: each validity rule fires with its own reason, and the default set is valid."""

from __future__ import annotations

import math

import pytest

from cutefa import space
from cutefa.spec import ARCHS, HEAD_DIMS, VariantSpec, parse_name

SM80 = VariantSpec("sm80", "fwd", "bf16", 64, 128, 64, 1, 4)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (
            SM80.replace(arch="sm90", direction="bwd", tile_n=96, warps=12, stages=2),
            "the sm90 backward runs warps=12 and tile_n=128",
        ),
        (
            SM80.replace(arch="sm90", direction="bwd", warps=12, stages=2),
            (
                "tile_n=64 with head_dim=64: the head-dim-split sm90 backward (two warpgroups sharing 64 keys) "
                "handles head_dim in (192, 256)"
            ),
        ),
        (
            SM80.replace(arch="sm90", direction="bwd", head_dim=256, tile_m=128, warps=12, stages=2),
            "tile_m=128: the head-dim-split sm90 backward takes 64 query rows per step",
        ),
        (
            SM80.replace(arch="sm90", direction="bwd", head_dim=256, tile_m=64, warps=12, stages=1),
            "the Q/dO TMA ring needs at least 2 stages",
        ),
        (
            SM80.replace(arch="sm90", direction="bwd", head_dim=192, tile_m=64, warps=12, stages=2, pingpong=True),
            "pingpong: the sm90 backward has no ping-pong schedule",
        ),
        (
            SM80.replace(arch="sm90", direction="bwd", head_dim=256, tile_m=64, warps=12, stages=3),
            "needs 291.0 KiB of shared memory, over the 227 KiB per-block opt-in limit of the H100/H200",
        ),
        (
            SM80.replace(arch="sm90", direction="bwd", tile_m=192, tile_n=128, warps=12, stages=2),
            "tile_m=192 must be 64 or 128 (the two consumers split dQ",
        ),
        (
            SM80.replace(arch="sm90", direction="bwd", head_dim=192, tile_n=128, warps=12, stages=2),
            "head_dim=192: the sm90 backward with tile_n=128 handles (64, 96, 128)",
        ),
        (
            SM80.replace(arch="sm90", direction="bwd", tile_m=64, tile_n=128, warps=12, stages=2),
            "tile_m=64 with head_dim=64: the two consumers cannot split dQ's columns at a swizzle-atom",
        ),
        (
            SM80.replace(arch="sm90", direction="bwd", tile_n=128, warps=12, stages=1),
            "the Q/dO TMA ring needs at least 2 stages",
        ),
        (
            SM80.replace(arch="sm90", direction="bwd", head_dim=128, tile_n=128, warps=12, stages=2),
            "would spill registers (estimated 296 > 240 per consumer thread",
        ),
        (
            SM80.replace(arch="sm90", direction="bwd", tile_n=128, warps=12, stages=4),
            "KiB of shared memory, over the 227 KiB per-block opt-in limit of the H100/H200",
        ),
        (
            SM80.replace(arch="sm100", dtype="e4m3", tile_m=128, tile_n=128, warps=16, stages=2, cta_pair=True),
            "cta_pair: the sm100 e4m3 forward is single-CTA only",
        ),
        (
            SM80.replace(arch="sm100", dtype="e4m3", tile_m=128, tile_n=80, warps=16, stages=2),
            "tile_n=80 is not a multiple of 32 (the k of an e4m3 UMMA",
        ),
        (
            SM80.replace(arch="sm100", dtype="e4m3", head_dim=256, tile_m=256, tile_n=128, warps=16, stages=2),
            "needs 768 TMEM columns",
        ),
        (
            SM80.replace(arch="sm90", direction="bwd", tile_n=128, warps=12, stages=2, pingpong=True),
            "pingpong: the sm90 backward has no ping-pong schedule",
        ),
        (
            SM80.replace(arch="sm90", direction="bwd", head_dim=96, tile_m=64, tile_n=128, warps=12, stages=2, overlap=True),
            "overlap with head_dim=96, tile_m=64: the consumers' dQ pieces differ in width (64 and 32 columns)",
        ),
        (SM80.replace(overlap=True), "overlap/pingpong are sm90 (FlashAttention-3) schedule flags, not sm80"),
        (SM80.replace(arch="sm90", tile_m=64, warps=8, stages=2, pingpong=True), "pingpong needs two or three"),
        (SM80.replace(persistent=True), "persistent is an sm90 forward scheduler flag, not a sm80 fwd one"),
        (SM80.replace(arch="sm90", warps=12, stages=2, cta_pair=True), "cta_pair (2-CTA UMMA) is an sm100 forward"),
        (SM80.replace(arch="sm90", warps=8, stages=2), "warps=8 must be 12: one producer warpgroup plus 2"),
        (SM80.replace(arch="sm90", warps=12, stages=1), "the K/V TMA pipelines need at least 2 stages"),
        (SM80.replace(arch="sm90", warps=12, stages=2, tile_n=72), "tile_n=72 must be a multiple of 16"),
        (SM80.replace(arch="sm90", head_dim=256, warps=12, stages=4, tile_n=128), "over the 227 KiB per-block"),
        (SM80.replace(arch="sm90", warps=12, stages=2, tile_n=256), "would spill registers (estimated 272"),
        (SM80.replace(arch="sm100", direction="bwd", warps=16, stages=2), "the sm100 backward runs tile_m=128"),
        (
            SM80.replace(arch="sm100", direction="bwd", head_dim=96, tile_m=128, tile_n=128),
            "head_dim=96: the sm100 backward reads Q, dO and K both K-major and MN-major",
        ),
        (
            SM80.replace(arch="sm100", direction="bwd", head_dim=256, tile_m=128, tile_n=128),
            "needs 768 TMEM columns (S^T + dP^T + dK + dV), over the 512",
        ),
        (
            SM80.replace(direction="bwd", tile_m=64, tile_n=128, warps=8, stages=3),
            "stages=3: the sm80 backward loads K and V once per CTA and has 1 or 2 buffers for Q",
        ),
        (
            SM80.replace(direction="bwd", head_dim=256, tile_m=64, tile_n=128, warps=8, stages=2),
            "needs 262.0 KiB of shared memory, over the 227 KiB per-block opt-in limit of the largest GPU",
        ),
        (SM80.replace(direction="bwd", tile_m=64, tile_n=32, warps=8), "tile_n=32 is not a multiple of 64"),
        (SM80.replace(dtype="e4m3"), "e4m3 is only for sm90/sm100 forward kernels, not sm80 fwd"),
        (SM80.replace(arch="sm90", direction="bwd", dtype="e4m3"), "e4m3 is only for sm90/sm100 forward"),
        (SM80.replace(head_dim=80), f"head_dim=80 is not one of {HEAD_DIMS}"),
        (
            SM80.replace(tile_m=64, warps=8),
            "tile_m=64 is not a multiple of 16*warps=128 (each of the 8 warps",
        ),
        (SM80.replace(tile_n=40), "tile_n=40 is not a multiple of 16"),
        (
            SM80.replace(head_dim=96, tile_n=32, warps=8),
            "the K/V tile (32x96) does not split into 128-bit copies over 256 threads",
        ),
        (
            SM80.replace(head_dim=256, stages=3, warps=8),
            "needs 257.0 KiB of shared memory, over the 227 KiB per-block opt-in limit of the largest GPU",
        ),
        (SM80.replace(tile_n=128), "would spill registers (estimated 320 > 255 per thread)"),
    ],
    ids=lambda x: x.name if isinstance(x, VariantSpec) else None,
)
def test_each_rule_names_itself(spec, reason):
    assert space.why_invalid(spec) == space.why_invalid(spec)  # pure
    assert reason in space.why_invalid(spec)


def test_head_dim_multiple_of_32(monkeypatch):
    monkeypatch.setattr(space, "HEAD_DIMS", (*HEAD_DIMS, 80))
    assert "head_dim=80 is not a multiple of 32" in space.why_invalid(SM80.replace(head_dim=80))


def test_fp8_waits_for_its_kernel(monkeypatch):
    monkeypatch.setattr(space, "IMPLEMENTED", {("sm90", "fwd"): ("fp16", "bf16")})
    hopper = SM80.replace(arch="sm90", warps=12, stages=2)
    assert space.why_invalid(hopper) is None
    assert space.why_invalid(hopper.replace(dtype="e4m3")) == "no e4m3 sm90 fwd kernel exists yet"
    assert space.why_invalid(SM80) == "no sm80 fwd kernel exists yet"


def test_budgets():
    assert space.smem_bytes(SM80) == (128 + 2 * 64) * 64 * 2 + space.SMEM_RESERVE
    assert space.smem_bytes(SM80.replace(stages=2)) == (128 + 4 * 64) * 64 * 2 + space.SMEM_RESERVE
    assert space.est_registers(SM80) == 64 + 64 + 32 + space.SM80_REG_OVERHEAD
    assert space.est_registers(SM80.replace(warps=8)) == 32 + 32 + 16 + space.SM80_REG_OVERHEAD
    assert space.est_registers(SM80.replace(arch="sm90", warps=12)) == 32 + 32 + 16 + space.SM90_REG_OVERHEAD


@pytest.mark.parametrize("arch", ARCHS)
def test_default_variants_are_valid_and_unique(arch):
    defaults = space.default_variants(arch)
    for spec in defaults:
        assert space.why_invalid(spec) is None, spec.name
    assert len(set(defaults)) == len(defaults)
    assert defaults == sorted(defaults)
    assert set(defaults) <= set(space.valid_variants(arch, "fwd") + space.valid_variants(arch, "bwd"))


def test_sm90_bwd_dq_pieces():
    """Each consumer's dQ piece: 64-row blocks for tile_m=128, atom-aligned column pieces for 64."""
    bwd = VariantSpec("sm90", "bwd", "bf16", 64, 128, 128, 2, 12)
    assert space.sm90_bwd_dq_pieces(bwd) == ((0, 0, 64), (1, 0, 64))
    assert space.sm90_bwd_dq_pieces(bwd.replace(head_dim=128, tile_m=64)) == ((0, 0, 64), (0, 64, 64))
    assert space.sm90_bwd_dq_pieces(bwd.replace(head_dim=96, tile_m=64)) == ((0, 0, 64), (0, 64, 32))
    assert space.sm90_bwd_dq_pieces(bwd.replace(tile_m=64)) is None  # one 64-column atom: no split


def test_sm90_bwd_head_split():
    """Head dims 192 and 256: tile_n=64 (the two consumers share the keys, each owns half of the
    head dim of dK, dV and dQ), tile_m=64; the budgets follow the split's own models."""
    split = VariantSpec("sm90", "bwd", "bf16", 256, 64, 64, 2, 12)
    assert space.sm90_bwd_head_split(split)
    assert not space.sm90_bwd_head_split(split.replace(head_dim=128, tile_n=128))
    assert not space.sm90_bwd_head_split(split.replace(arch="sm80", warps=8))
    assert space.DEFAULT_BWD_TILES["sm90"][256] == space.Tile(64, 64, 2, 12)
    assert space.DEFAULT_BWD_TILES["sm90"][192] == space.Tile(64, 96, 2, 12)  # the swapped partition
    for head_dim in (192, 256):
        spec = split.replace(head_dim=head_dim)
        assert space.why_invalid(spec) is None, spec.name
        half = head_dim // 2
        assert space.sm90_bwd_dq_pieces(spec) == ((0, 0, half), (0, half, half))
        # dK + dV (64 keys x d/2, fp32 over 128 threads) beside the larger of S^T/dP^T (+ 16-bit
        # copies, 64 x 32) and the fp32 dQ piece (64 x d/2)
        assert space.sm90_bwd_registers(spec) == half + max(48, half // 2) + space.SM90_BWD_REG_OVERHEAD
        assert space.est_registers(spec) == space.sm90_bwd_registers(spec) <= space.SM90_CONSUMER_REGS
        # K, V, the Q/dO ring, two dS and two P^T buffers, the LSE2/D rows and 6 mbarriers in a
        # struct rounded up to 1 KiB, plus 1 KiB of static shared memory
        elements = 2 * 64 * head_dim + 2 * 2 * 64 * head_dim + 4 * 64 * 64
        struct = elements * 2 + 2 * 2 * 64 * 4 + 6 * 8
        assert space.smem_bytes(spec) == math.ceil(struct / 1024) * 1024 + 1024
        assert space.smem_bytes(spec) <= space.SM90_SMEM_LIMIT
    assert space.sm90_bwd_registers(split) == 232
    assert space.smem_bytes(split) == space.SM90_SMEM_LIMIT  # hd256: the whole opt-in limit
    assert space.why_invalid(split.replace(head_dim=192, stages=3)) is None  # 3 stages fit at 192 only
    # the split's tiles are in the enumerated space: every valid one a 64x64 tile at 192 or 256
    valid = [s for s in space.valid_variants("sm90", "bwd") if space.sm90_bwd_head_split(s)]
    assert {(s.head_dim, s.tile_m, s.stages) for s in valid} == {(192, 64, 2), (192, 64, 3), (256, 64, 2)}
    assert {s.replace(overlap=False) for s in valid if s.overlap} == {s for s in valid if not s.overlap}
    # the overlap schedule without dq_bulk is committed beside the plain split (bf16)
    committed = [s for s in space.default_variants("sm90", "bwd") if space.sm90_bwd_head_split(s)]
    assert sorted((s.dtype, s.head_dim, s.causal) for s in committed if s.overlap and not s.dq_bulk) == [
        ("bf16", d, c) for d in (192, 256) for c in (False, True)
    ]
    # dq_bulk: plain and overlap (staging buffers of its own at hd192 s2, the Q/dO stage's columns
    # where those would not fit), bf16; hd256's default (every dtype) is the overlap one
    assert sorted((s.dtype, s.head_dim, s.causal, s.overlap) for s in committed if s.dq_bulk) == sorted(
        [("bf16", d, c, o) for d in (192, 256) for c in (False, True) for o in (False, True)]
        + [("fp16", 256, c, True) for c in (False, True)]
    )
    assert space.default_extras("sm90", "bwd", 256) == space.DEFAULT_BWD_SPLIT_FLAGS
    assert {(s.head_dim, s.stages, space.sm90_bwd_dq_bulk_aliases(s)) for s in valid if s.dq_bulk} == {
        (192, 2, False), (192, 3, True), (256, 2, True)
    }


def test_sm80_bwd_default_set():
    committed = space.default_variants("sm80", "bwd")
    # the default and tuning tiles, both dtypes and masks, with dq_tile (the accumulator tiled by
    # query blocks in fragment order, the family's default backward flag)
    defaults = [s for s in committed if s.dq_tile]
    # the larger-shared-memory tiles (sm_90a and newer), and every other tile within the A100's limit
    extra = space.BWD_TUNING_ALTERNATIVES["sm80"]
    large, small = space.LARGE_SMEM_BWD_ALTERNATIVES["sm80"], space.SMALL_SMEM_BWD_TILES["sm80"]
    assert space.default_extras("sm80", "bwd", 128) == {"dq_tile": True}
    # hd96, hd192 and hd256: the dQ reductions between the dQ MMAs (dq_pipe) on their single-buffered tiles only
    for hd in (96, 192, 256):
        assert space.default_extras("sm80", "bwd", hd) == {"dq_tile": True, "dq_pipe": True}
        assert space.default_extras("sm80", "bwd", hd, stages=2) == {"dq_tile": True}
        stages = {1, 2} if hd != 96 else {1}
        assert {(s.stages, s.dq_pipe) for s in defaults if s.head_dim == hd} == {(n, n == 1) for n in stages}
    assert not any(s.dq_pipe for s in committed if s.head_dim not in (96, 192, 256))
    tiles = len(HEAD_DIMS) + sum(len(tiles) for tiles in extra.values()) + len(large) + len(small)
    assert len(defaults) == 2 * 2 * tiles
    for spec in defaults:
        tile = (spec.tile_m, spec.tile_n, spec.stages, spec.warps)
        if tile == small.get(spec.head_dim):  # for the 99 KiB of sm_86/sm_89 GPUs
            assert space.why_not_on(spec, "sm_86") is None and space.why_not_on(spec, "sm_89") is None
            continue
        if tile == large.get(spec.head_dim):
            assert space.smem_bytes(spec) > space.SM80_SMEM_LIMIT
            assert [t for t in space.TARGET_SMEM_LIMITS if space.why_not_on(spec, t) is None] == [
                "sm_90a", "sm_100a", "sm_103a"
            ]
            continue
        assert tile == space.DEFAULT_BWD_TILES["sm80"][spec.head_dim] or tile in extra[spec.head_dim]
        assert space.smem_bytes(spec) <= space.SM80_SMEM_LIMIT
        assert space.why_not_on(spec, "sm_80") is None
    # The BWD_ALTERNATIVES, bf16, causal and not, on the best tile of each head dim: dq_quad (16-byte
    # dQ reductions into a column-permuted accumulator) and the accumulator's natural layout, each
    # the twin of a committed dq_tile variant
    others = [s for s in committed if not s.dq_tile]
    alts = space.BWD_ALTERNATIVES["sm80"]
    assert len(others) == 2 * sum(len(a) for a in alts.values())
    assert {s.dtype for s in others} == {"bf16"}
    assert all(
        s.replace(dq_quad=False, **space.default_extras("sm80", "bwd", s.head_dim, stages=s.stages)) in defaults
        and space.why_invalid(s) is None
        for s in others
    )
    assert sum(s.dq_quad for s in others) == len(others) // 2
    assert "dq_quad" in space.why_invalid(
        space.VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 2, 12, dq_quad=True)
    )
    assert space.default_variants("sm80") == sorted(committed + space.default_variants("sm80", "fwd"))


def test_sm80_default_set():
    defaults = space.default_variants("sm80", "fwd")
    for dtype in ("fp16", "bf16"):
        for head_dim, tile in space.DEFAULT_TILES["sm80"].items():
            for causal in (False, True):
                assert VariantSpec("sm80", "fwd", dtype, head_dim, *tile, causal=causal) in defaults
    alternatives = [
        s
        for s in defaults
        if (s.tile_m, s.tile_n, s.stages, s.warps) != space.DEFAULT_TILES["sm80"][s.head_dim]
    ]
    extra = space.TUNING_ALTERNATIVES["sm80"]
    assert {s.head_dim for s in alternatives} == set(extra)
    assert len(alternatives) == 2 * 2 * sum(len(tiles) for tiles in extra.values())
    assert len(defaults) == 2 * 2 * (len(HEAD_DIMS) + sum(len(tiles) for tiles in extra.values()))


def test_tuning_alternatives_restricted_to_some_dtypes(monkeypatch):
    """The sm90 hd256 128x80 tile is committed in fp16 and bf16, both masks, with the default
    schedule among its schedules; TUNING_ALTERNATIVE_DTYPES, when it names a tile, keeps only the
    dtypes it lists (every other tuning tile stays in both)."""
    tile = space.Tile(128, 80, 2, 12)
    fwd = space.default_variants("sm90", "fwd")
    found = [s for s in fwd if s.head_dim == 256 and (s.tile_m, s.tile_n, s.stages, s.warps) == tile]
    assert {s.dtype for s in found} == {"bf16", "fp16"}
    assert all(space.why_invalid(s) is None for s in found)
    plain = [s for s in found if s.pingpong and not (s.early_rescale or s.pair_cvt)]
    assert sorted((s.dtype, s.causal) for s in plain) == [(d, c) for d in ("bf16", "fp16") for c in (False, True)]
    assert all(s.overlap for s in plain)
    monkeypatch.setitem(space.TUNING_ALTERNATIVE_DTYPES, ("sm90", 256, tile), ("bf16",))
    restricted = [
        s for s in space.default_variants("sm90", "fwd")
        if s.head_dim == 256 and (s.tile_m, s.tile_n, s.stages, s.warps) == tile
    ]
    assert {s.dtype for s in restricted} == {"bf16"}
    assert len(restricted) == len(found) // 2
    hd64 = [s for s in space.default_variants("sm90", "fwd") if s.head_dim == 64 and s.tile_n == 192]
    assert {s.dtype for s in hd64} == {"bf16", "fp16"}


def test_other_archs_have_no_defaults_yet():
    sm90 = space.default_variants("sm90")
    assert {(s.overlap, s.pingpong) for s in sm90 if s.head_dim == 128} == {(a, b) for a in (0, 1) for b in (0, 1)}
    forwards = [s for s in sm90 if s.direction == "fwd"]
    assert all(s.overlap and s.pingpong for s in forwards if s.head_dim in (96, 192))  # the default schedule


def test_candidates():
    sm80 = space.candidates("sm80")
    assert len(sm80) == 2 * len(HEAD_DIMS) * (2 * 3 * 2 * 2) * 2
    assert {s.dtype for s in sm80} == {"fp16", "bf16"}
    assert {s.dtype for s in space.candidates("sm90")} == {"fp16", "bf16", "e4m3"}
    assert {s.dtype for s in space.candidates("sm90", "bwd")} == {"fp16", "bf16"}
    assert {s.warps for s in space.candidates("sm90") if s.tile_m == 192} == {16}
    assert {s.tile_n for s in space.candidates("sm90")} == set(range(64, 193, 16))


def test_valid_variants():
    valid = space.valid_variants("sm80")
    assert valid and all(space.why_invalid(s) is None for s in valid)
    assert len(valid) < len(space.candidates("sm80"))
    assert all(s.arch == "sm90" and s.direction == "fwd" for s in space.valid_variants("sm90"))


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: space.candidates("sm70"), "arch='sm70' is not one of"),
        (lambda: space.candidates("sm80", "both"), "direction='both' is not one of"),
        (lambda: space.default_variants("hopper"), "arch='hopper' is not one of"),
    ],
)
def test_bad_arguments(call, words):
    with pytest.raises(ValueError, match=words):
        call()


SM100_PAIR = VariantSpec("sm100", "fwd", "bf16", 128, 256, 128, 3, 16, cta_pair=True)
SM100_PAIR_EMU = SM100_PAIR.replace(exp_emu=25)
FP8 = VariantSpec("sm90", "fwd", "e4m3", 128, 128, 128, 2, 12, overlap=True, pingpong=True)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (SM100_PAIR.replace(direction="bwd", tile_m=128, stages=1, warps=4), "cta_pair (2-CTA UMMA) is an sm100 forward"),
        (SM100_PAIR.replace(head_dim=96), "head_dim=96: cta_pair is for head_dim >= 128: each CTA would load 48 columns"),
        (SM100_PAIR.replace(head_dim=64), "head_dim=64: cta_pair is for head_dim >= 128"),
        (SM100_PAIR.replace(head_dim=256, tile_n=64), "needs 640 TMEM columns (2 x (S 64 + O 256)), over the 512"),
        (SM100_PAIR, "tile_n=128 with exp_emu=0 spills registers in the pair's softmax/correction warps"),
        (SM100_PAIR.replace(head_dim=192, tile_m=128, stages=2), "at head_dim=192, tile_m=128"),
        (
            SM100_PAIR_EMU.replace(head_dim=256, tile_m=128, tile_n=128, stages=3),
            "needs 228.0 KiB of shared memory, over the 227 KiB of a B200 block",
        ),
    ],
    ids=lambda x: x.name if isinstance(x, VariantSpec) else None,
)
def test_sm100_pair_rules(spec, reason):
    assert reason in space.why_invalid(spec)


def test_sm100_pair_budgets_per_cta():
    """A CTA of a pair holds half of each K/V stage; its TMEM holds its own S and O, as one CTA does."""
    single = SM100_PAIR_EMU.replace(cta_pair=False)
    assert space.sm100_smem_bytes(single) - space.sm100_smem_bytes(SM100_PAIR_EMU) == 3 * 64 * 128 * 2
    assert space.sm100_tmem_columns(SM100_PAIR_EMU) == space.sm100_tmem_columns(single) == 512
    # The number the CLI prints is the family's own budget.
    assert space.smem_bytes(SM100_PAIR_EMU) == space.sm100_smem_bytes(SM100_PAIR_EMU)
    # Half a ring fits where a whole one does not: head dim 256 with 128-key blocks.
    wide = VariantSpec("sm100", "fwd", "bf16", 256, 128, 128, 2, 16, exp_emu=25)
    assert "shared memory" in space.why_invalid(wide)
    assert space.why_invalid(wide.replace(cta_pair=True)) is None
    assert space.why_invalid(SM100_PAIR_EMU) is None and space.why_invalid(SM100_PAIR_EMU.replace(causal=True)) is None
    # The spill rule spares the shape that compiles clean with every exp2 on MUFU.
    assert space.why_invalid(SM100_PAIR.replace(tile_m=128)) is None


def test_sm100_pair_candidates_and_defaults():
    assert {s.cta_pair for s in space.candidates("sm100")} == {False, True}
    assert {s.cta_pair for s in space.candidates("sm100", "bwd")} == {False}
    assert {s.head_dim for s in space.valid_variants("sm100") if s.cta_pair} == {128, 192, 256}
    defaults = space.default_variants("sm100", "fwd")
    pairs = [s for s in defaults if s.cta_pair]
    assert {s.head_dim for s in pairs} == set(space.PAIR_ALTERNATIVES["sm100"]) == {128, 192, 256}
    assert len(pairs) == 2 * 2 * 3  # dtypes x causal x head dims
    for spec in pairs:
        tile = (spec.tile_m, spec.tile_n, spec.stages, spec.warps)
        assert tile in space.PAIR_ALTERNATIVES["sm100"][spec.head_dim]
        assert spec.exp_emu == space.DEFAULT_EXP_EMU["sm100"][spec.head_dim]
        assert space.why_invalid(spec) is None
    # The defaults themselves stay single-CTA.
    for hd, tile in space.DEFAULT_TILES["sm100"].items():
        extras = space.default_extras("sm100", "fwd", hd)
        assert "cta_pair" not in extras
        assert VariantSpec("sm100", "fwd", "bf16", hd, *tile, **extras) in defaults


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (FP8.replace(tile_m=64, warps=8, pingpong=False), "tile_m=64: the sm90 fp8 forward runs two or three consumer"),
        (FP8.replace(tile_n=80), "tile_n=80 is not a multiple of 32 (the k of an fp8 WGMMA"),
        (FP8.replace(persistent=True, block_quant=True), "persistent with block_quant: the block-quantization path"),
        # Q 32 KiB + 2 stages x (K, V, Vt) of 32 KiB each = 224 KiB, with 3 stages over the limit.
        (FP8.replace(head_dim=256, stages=3), "needs 321.0 KiB of shared memory, over the 227 KiB"),
        # O 128 + S 64 + P 16 + 48 = 256 registers per consumer thread.
        (FP8.replace(head_dim=256), "would spill registers (estimated 256 > 232 per consumer thread"),
        # three consumer warpgroups (tile_m 192): hd128 only, no ping-pong, no causal mask
        (FP8.replace(tile_m=192, tile_n=96, warps=16, pingpong=True), "tile_m=192 with pingpong"),
        (FP8.replace(tile_m=192, tile_n=64, warps=16, pingpong=False, head_dim=256), "tile_m=192 at head_dim 256"),
    ],
    ids=lambda x: x.name if isinstance(x, VariantSpec) else None,
)
def test_fp8_rules_name_themselves(spec, reason):
    assert reason in space.why_invalid(spec)


def test_fp8_three_consumer_register_split():
    """tile_m 192 (512 threads): 128 registers per thread at launch, producer 32 and three
    consumers at 160 fill it exactly; the two-consumer splits stay 40 / 232 and 24 / 240."""
    three = VariantSpec("sm90", "fwd", "e4m3", 128, 192, 96, 2, 16, overlap=True, hoist_vt=True)
    assert three in space.fp8_alternative_specs() and space.why_invalid(three) is None
    assert (space.sm90_fp8_producer_regs(three), space.sm90_fp8_consumer_regs(three)) == (32, 160)
    assert 32 * 128 + 3 * 128 * 160 == 128 * 512
    assert (space.sm90_fp8_producer_regs(FP8), space.sm90_fp8_consumer_regs(FP8)) == (40, 232)
    wide_tile = VariantSpec("sm90", "fwd", "e4m3", 256, 128, 96, 2, 12, overlap=True, hoist_vt=True)
    assert (space.sm90_fp8_producer_regs(wide_tile), space.sm90_fp8_consumer_regs(wide_tile)) == (24, 240)


def test_fp8_budgets():
    # Q (128 x d) plus three rings (K, V as loaded, V transposed) of `stages` tiles, one byte each.
    assert space.smem_bytes(FP8) == (128 + 3 * 2 * 128) * 128 + space.SMEM_RESERVE
    # fp32 O (d/2) and S (tile_n/2) per consumer thread, P at one byte (tile_n/8).
    assert space.est_registers(FP8) == 64 + 64 + 16 + space.SM90_REG_OVERHEAD
    assert space.why_invalid(FP8) is None
    # the bf16 kernel's model is unchanged: P at two bytes
    assert space.est_registers(FP8.replace(dtype="bf16")) == 64 + 64 + 32 + space.SM90_REG_OVERHEAD


def test_fp8_defaults_are_the_default_schedule_plus_the_explicit_alternatives():
    committed = [s for s in space.default_variants("sm90") if s.dtype == "e4m3"]
    alternatives = space.fp8_alternative_specs("sm90")
    assert set(alternatives) <= set(committed)
    assert len(alternatives) <= 62  # a short list for one GPU run, not a sweep (hoist_vt, wide_vt, lazy_rescale, sum_mma, two_level, v_mean and persistent twins included)
    fp8 = [s for s in committed if s not in alternatives and not s.block_quant]
    assert {s.head_dim for s in fp8} == set(HEAD_DIMS)
    assert len(fp8) == 2 * len(HEAD_DIMS)  # causal and not, on the default tile and schedule
    assert all((s.tile_m, s.tile_n, s.stages, s.warps) == tuple(space.default_tile("sm90", s.head_dim, "e4m3")) for s in fp8)
    assert space.default_tile("sm90", 256, "e4m3") == space.Tile(128, 64, 3, 12)  # the e4m3 hd256 default: 3 stages
    assert space.default_tile("sm90", 256, "bf16") == space.default_tile("sm90", 256) == space.DEFAULT_TILES["sm90"][256]
    assert all(s.overlap and s.tile_n % 32 == 0 for s in fp8)
    # ping-pong everywhere but hd128, whose default runs the overlap schedule alone (DEFAULT_DTYPE_SCHEDULES)
    assert {s.head_dim for s in fp8 if not s.pingpong} == {128}
    assert space.default_extras("sm90", "fwd", 128, "e4m3") == {"overlap": True, "pingpong": False, "hoist_vt": True}
    # the e4m3 defaults (and the block-quantization ones) carry their dtype's flag: the hoisted transpose
    assert space.DEFAULT_DTYPE_FLAGS[("sm90", "e4m3")] == {"hoist_vt": True}
    assert all(s.hoist_vt for s in committed if s not in alternatives)
    # hd256's e4m3 default rescales O lazily (DEFAULT_DTYPE_SCHEDULES); no other default does
    assert space.default_extras("sm90", "fwd", 256, "e4m3") == {
        **space.default_extras("sm90", "fwd", 256), "lazy_rescale": True, "hoist_vt": True,
    }  # fmt: skip
    assert {s.head_dim for s in committed if s.lazy_rescale and s not in alternatives} == {256}
    assert space.default_extras("sm90", "fwd", 128, "bf16") == space.default_extras("sm90", "fwd", 128)
    assert not any(s.hoist_vt for s in space.default_variants("sm90") if s.dtype != "e4m3")


def test_fp8_alternatives_are_valid_and_differ_from_the_defaults():
    alternatives = space.fp8_alternative_specs("sm90")
    assert {s.causal for s in alternatives} == {False, True}
    for spec in alternatives:
        assert space.why_invalid(spec) is None, spec.name
        assert space.smem_bytes(spec) <= space.SM90_SMEM_LIMIT, spec.name
        assert spec.tile_n % space.SM90_FP8_MMA_K == 0 and spec.tile_m in (128, 192), spec.name
        assert spec.tile_m == 128 or (spec.head_dim, spec.warps, spec.pingpong) == (128, 16, False), spec.name
        default = space.default_tile("sm90", spec.head_dim, "e4m3")
        schedule = space.default_extras("sm90", "fwd", spec.head_dim, "e4m3")
        assert (
            spec.tile_n, spec.stages, spec.overlap, spec.pingpong, spec.exp_emu, spec.hoist_vt, spec.wide_vt,
            spec.lazy_rescale,
        ) != (
            default.tile_n, default.stages, schedule["overlap"], schedule["pingpong"], 0, True, False,
            schedule.get("lazy_rescale", False),
        ), spec.name  # fmt: skip
        if not spec.hoist_vt:  # the twins without the hoisted transpose: the default tile and schedule
            assert (spec.tile_n, spec.stages, spec.overlap, spec.pingpong) == (
                default.tile_n, default.stages, schedule["overlap"], schedule["pingpong"]
            )
    twins = [s for s in alternatives if not s.hoist_vt]
    assert {(s.head_dim, s.causal) for s in twins} == {(128, False), (128, True), (256, False), (256, True)}
    # the wide-transpose variants: the default tile and schedule plus wide_vt, hd128 and hd256
    wide_vt = [s for s in alternatives if s.wide_vt]
    committed = [s for s in space.default_variants("sm90") if s.dtype == "e4m3"]
    assert sorted(wide_vt) == sorted(
        s.replace(wide_vt=True, lazy_rescale=False)
        for s in committed
        if s not in alternatives and not s.block_quant and s.head_dim in (128, 256)
    )
    # only the explicit list bypasses the register estimate: a like tile outside it still fails it
    # (hd256 128x128 is committed with ping-pong; without it the estimate refuses it)
    wide = space.fp8_alternative_specs("sm90")[0].replace(head_dim=256, tile_n=128, stages=2, pingpong=False)
    assert wide not in alternatives
    assert "would spill registers" in space.why_invalid(wide)


def test_wide_vt_rule():
    """wide_vt (the 64-bit V transpose): sm90 e4m3 forward only, on top of hoist_vt, on tiles whose
    8x8-byte units split evenly over the producer warpgroup's 128 threads."""
    hd128 = VariantSpec("sm90", "fwd", "e4m3", 128, 128, 128, 2, 12, overlap=True, pingpong=True, hoist_vt=True)
    assert space.why_invalid(hd128.replace(wide_vt=True)) is None
    assert hd128.replace(wide_vt=True).name == "cutefa_sm90_fwd_e4m3_hd128_128x128_s2_w12_ov_pp_hvt_wvt"
    assert space.why_invalid(hd128.replace(head_dim=256, tile_n=64, stages=3, wide_vt=True)) is None
    assert space.why_invalid(hd128.replace(head_dim=64, wide_vt=True)) is None
    for bad, words in (
        (hd128.replace(wide_vt=True, hoist_vt=False), "wide_vt requires hoist_vt"),
        (hd128.replace(dtype="bf16", hoist_vt=False, wide_vt=True), "not a sm90 bf16 fwd one"),
        (VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 2, 12, wide_vt=True), "sm90 e4m3 forward flag"),
        (VariantSpec("sm100", "fwd", "e4m3", 128, 256, 128, 3, 16, wide_vt=True), "sm90 e4m3 forward flag"),
        # 12 x 16 = 192 units (hd96), 16 x 20 = 320 (tile_n 160), 24 x 12 = 288 (hd192 x 96)
        (hd128.replace(head_dim=96, wide_vt=True), "= 192 8x8-byte units"),
        (hd128.replace(tile_n=160, stages=3, overlap=False, wide_vt=True), "= 320 8x8-byte units"),
        (hd128.replace(head_dim=192, tile_n=96, wide_vt=True), "= 288 8x8-byte units"),
    ):
        assert words in (space.why_invalid(bad) or ""), bad.name
    assert not any(s.wide_vt for s in space.default_variants("sm90") if s not in space.fp8_alternative_specs("sm90"))


def test_sm100_fp8_defaults():
    """sm100 e4m3: the default tile of each head dim (what dispatch picks on a B200), causal and not;
    no CTA-pair or tuning alternatives; every e4m3 candidate that passes is single-CTA."""
    fp8 = [s for s in space.default_variants("sm100", "fwd") if s.dtype == "e4m3"]
    assert {s.head_dim for s in fp8} == set(HEAD_DIMS)
    assert len(fp8) == 2 * len(HEAD_DIMS)
    for s in fp8:
        assert (s.tile_m, s.tile_n, s.stages, s.warps) == tuple(space.DEFAULT_TILES["sm100"][s.head_dim])
        assert s.tile_n % space.SM100_FP8_MMA_K == 0 and not s.cta_pair
        assert space.why_invalid(s) is None
    valid = [s for s in space.valid_variants("sm100") if s.dtype == "e4m3"]
    assert valid and not any(s.cta_pair for s in valid)


def test_sm80_bwd_smem_counts_the_q_buffers():
    one = VariantSpec("sm80", "bwd", "bf16", 128, 64, 128, 1, 8)
    # Q, dO (64x128), K, V (128x128), P, dS (64x128), 16-bit, plus six 1 KiB alignment reserves.
    assert space.smem_bytes(one) == (2 * 64 * 128 + 2 * 128 * 128 + 2 * 64 * 128) * 2 + 6 * space.SMEM_RESERVE
    assert space.smem_bytes(one.replace(stages=2)) == space.smem_bytes(one) + 64 * 128 * 2
    assert space.why_invalid(one.replace(stages=2)) is None


def test_sm90_bwd_overlap_is_valid_where_the_dq_pieces_match():
    base = VariantSpec("sm90", "bwd", "bf16", 64, 128, 128, 2, 12)
    assert space.why_invalid(base.replace(overlap=True)) is None
    assert space.why_invalid(base.replace(head_dim=128, tile_m=64, overlap=True)) is None
    assert space.why_invalid(base.replace(head_dim=128, tile_m=64, stages=3, overlap=True)) is None
    assert base.replace(overlap=True).name == "cutefa_sm90_bwd_bf16_hd64_128x128_s2_w12_ov"
    # the backward's flag sets are enumerated: the overlap twin of every valid backward tile
    bwd = space.valid_variants("sm90", "bwd")
    assert {s.replace(overlap=False) for s in bwd if s.overlap} <= set(bwd)
    assert not any(s.pingpong for s in bwd)


def test_fp8_block_quant_variants():
    """block_quant (FP8 block quantization): one committed variant per e4m3 default (the tile and
    schedule dispatch runs), causal and not; the flag is refused off the sm90 e4m3 forward."""
    committed = [s for s in space.default_variants("sm90") if s.block_quant]
    defaults = [
        s for s in space.default_variants("sm90")
        if s.dtype == "e4m3" and not s.block_quant and s not in space.fp8_alternative_specs("sm90")
    ]  # fmt: skip
    assert sorted(committed) == space.fp8_block_specs("sm90")
    assert sorted(committed) == sorted(s.replace(block_quant=True) for s in defaults)
    assert all(space.why_invalid(s) is None for s in committed)
    assert not [s for s in space.default_variants("sm100") if s.block_quant]
    assert space.fp8_block_specs("sm100") == []
    # candidates: the sm90 e4m3 forward grid has both settings, nothing else has the flag
    assert {s.block_quant for s in space.candidates("sm90") if s.dtype == "e4m3"} == {False, True}
    assert not any(s.block_quant for s in space.candidates("sm90") if s.dtype != "e4m3")
    assert not any(s.block_quant for s in space.candidates("sm100"))
    fp8 = committed[0]
    for bad, words in (
        (
            fp8.replace(dtype="bf16", hoist_vt=False),
            "block_quant (FP8 block quantization) is an sm90 e4m3 forward flag, not a sm90 fwd bf16",
        ),
        (
            VariantSpec("sm100", "fwd", "e4m3", 128, 256, 128, 3, 16, block_quant=True),
            "not a sm100 fwd e4m3",
        ),
        (VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 2, 12, block_quant=True), "not a sm90 bwd"),
    ):
        assert words in space.why_invalid(bad), bad.name


def test_fa4_hd256_schedule_variants():
    """The hd256 128x80 variants of FlashAttention-4's sm90 forward configuration (overlap without
    ping-pong, P converted in pairs, O rescaled under S = Q K^T): committed in fp16 and bf16, both masks;
    early_rescale and pair_cvt refused wherever they have no meaning, each with its reason."""
    # (their lazy_rescale twins: tests/test_compile_sm90_fwd_lazy.py)
    fwd = [s for s in space.default_variants("sm90", "fwd") if not s.lazy_rescale]
    tile = space.Tile(128, 80, 2, 12)
    new = [
        s for s in fwd
        if s.head_dim == 256 and not s.lpt_grid
        and (s.early_rescale or s.pair_cvt or (s.tile_n == 80 and not s.pingpong))
    ]  # fmt: skip
    assert {s.name for s in new} == {
        f"cutefa_sm90_fwd_{dt}_hd256_128x80_s2_w12{c}{flags}"
        for dt in ("bf16", "fp16")
        for c in ("", "_causal")
        for flags in ("_ov", "_ov_pcvt", "_ov_pp_pcvt", "_ov_erescale_pcvt", "_ov_pp_erescale_pcvt")
    }
    for spec in new:
        assert space.why_invalid(spec) is None, spec.name
        flags = {k: v for k, v in (("overlap", spec.overlap), ("pingpong", spec.pingpong),
                                   ("early_rescale", spec.early_rescale), ("pair_cvt", spec.pair_cvt)) if v}
        assert (tile, flags) in space.TILE_SCHEDULE_ALTERNATIVES["sm90"][256], spec.name
    # early_rescale comes with pair_cvt in the committed set (its causal form without pair_cvt has
    # ptxas serialize the WGMMAs); the flag alone is still valid
    assert all(s.pair_cvt for s in new if s.early_rescale)
    # the table's causal schedules also on the longest-first 1-D grid (lpt_grid), both masks and dtypes
    lpt = [s for s in fwd if s.head_dim == 256 and s.lpt_grid]
    assert {s.name.split("_s2_w12")[1].removeprefix("_causal") for s in lpt} == {"_ov_pcvt_lpt", "_ov_pp_erescale_pcvt_lpt"}
    assert len(lpt) == 8 and all(s.replace(lpt_grid=False) in new for s in lpt)
    base = next(s for s in new if s.early_rescale and s.causal and not s.pingpong)
    assert space.why_invalid(base.replace(pair_cvt=False)) is None
    # candidates: early_rescale only with overlap, on sm90 forwards
    sm90 = space.candidates("sm90")
    assert {s.early_rescale for s in sm90} == {False, True}
    assert all(s.overlap for s in sm90 if s.early_rescale)
    assert not any(s.early_rescale or s.pair_cvt for arch in ("sm80", "sm100") for s in space.candidates(arch))
    assert not any(s.early_rescale or s.pair_cvt for s in space.candidates("sm90", "bwd"))
    for bad, words in (
        (base.replace(overlap=False), "early_rescale needs overlap"),
        (base.replace(head_dim=64, tile_m=192, tile_n=128, warps=16), "early_rescale needs two consumer warpgroups"),
        (base.replace(dtype="e4m3", tile_n=64, pair_cvt=False), "early_rescale: the sm90 e4m3 forward"),
        (base.replace(early_rescale=False, dtype="e4m3", tile_n=64), "pair_cvt: the sm90 e4m3 forward"),
        (
            VariantSpec("sm80", "fwd", "bf16", 128, 128, 64, 1, 4, early_rescale=True),
            "early_rescale (O rescaled under S = Q K^T) is an sm90 forward flag, not a sm80 fwd one",
        ),
        (VariantSpec("sm80", "fwd", "bf16", 128, 128, 64, 1, 4, pair_cvt=True), "not a sm80 fwd one"),
        (
            VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 2, 12, pair_cvt=True),
            "pair_cvt (P converted two scores per instruction) is an sm90 forward flag, not a sm90 bwd one",
        ),
    ):
        assert words in space.why_invalid(bad), bad.name


def test_pair_cvt_twins_and_long_hd128_tiles():
    """The paired-conversion overlap + ping-pong forwards outside hd256: hd128 with key tiles 128 to
    192 (128 and 160 also on the longest-first grid), the twins of the hd64 128x192, hd96 128x128 and
    hd192 128x96 tiles; fp16 and bf16, both masks. hd128 128x176 and 128x192 pass the register rule only in that compiled form
    (SM90_PCVT_NO_SPILL)."""
    # (their lazy_rescale twins: tests/test_compile_sm90_fwd_lazy.py)
    fwd = [s for s in space.default_variants("sm90", "fwd") if not s.lazy_rescale]
    new = {s.name for s in fwd if s.pair_cvt and s.head_dim != 256}
    tiles = [(128, n) for n in (128, 144, 160, 176, 192)] + [(64, 192), (96, 128), (192, 96)]
    lpt_tiles = [(128, 128), (128, 160)]  # the table's causal hd128 tiles on the longest-first grid
    assert new == {
        f"cutefa_sm90_fwd_{dt}_hd{hd}_128x{n}_s2_w12{c}_ov_pp_pcvt{lpt}"
        for dt in ("fp16", "bf16")
        for hd, n, lpt in [(hd, n, "") for hd, n in tiles] + [(hd, n, "_lpt") for hd, n in lpt_tiles]
        for c in ("", "_causal")
    }
    for hd, n in ((128, 176), (128, 192)):
        spec = VariantSpec("sm90", "fwd", "bf16", hd, 128, n, 2, 12, overlap=True, pingpong=True, pair_cvt=True)
        assert space.est_registers(spec) > space.SM90_CONSUMER_REGS
        assert space.why_invalid(spec) is None
        assert space.why_invalid(spec.replace(causal=True, dtype="fp16")) is None
        for other in (
            spec.replace(pair_cvt=False),
            spec.replace(pingpong=False),
            spec.replace(persistent=True),
            spec.replace(early_rescale=True),
            spec.replace(exp_emu=25),
            spec.replace(tile_n=208),
        ):
            assert "would spill registers" in (space.why_invalid(other) or "") or "shared memory" in (
                space.why_invalid(other) or ""
            ), other.name


def test_lpt_grid_variants():
    """The 1-D longest-first grid (lpt_grid): committed on the hd64 192x128 overlap tiles (with and
    without ping-pong), on hd256's 128x80 tuned schedules and hd128's causal table tiles (128x128,
    128x160 with paired conversion), both masks, fp16 and bf16; refused
    wherever it has no meaning."""
    # (their lazy_rescale twins: tests/test_compile_sm90_fwd_lazy.py)
    fwd = [s for s in space.default_variants("sm90", "fwd") if not s.lazy_rescale]
    new = [s for s in fwd if s.lpt_grid]
    assert {s.name for s in new} == {
        f"cutefa_sm90_fwd_{dtype}_{tile}{c}{flags}"
        for dtype in ("bf16", "fp16")
        for c in ("", "_causal")
        for tile, flags in (
            ("hd64_192x128_s2_w16", "_ov_lpt"), ("hd64_192x128_s2_w16", "_ov_pp_lpt"),
            ("hd256_128x80_s2_w12", "_ov_pcvt_lpt"), ("hd256_128x80_s2_w12", "_ov_pp_erescale_pcvt_lpt"),
            ("hd128_128x128_s2_w12", "_ov_pp_pcvt_lpt"), ("hd128_128x160_s2_w12", "_ov_pp_pcvt_lpt"),
        )
    }  # fmt: skip
    for spec in new:
        assert space.why_invalid(spec) is None, spec.name
        assert spec.name.endswith("_lpt") and parse_name(spec.name) == spec
    base = new[0]
    for bad, words in (
        (base.replace(persistent=True), "lpt_grid with persistent"),
        (base.replace(dtype="e4m3", tile_n=64, overlap=False, pingpong=False), "lpt_grid: the sm90 e4m3 forward"),
        (base.replace(direction="bwd", overlap=False, pingpong=False), "not a sm90 bwd one"),
        (VariantSpec("sm80", "fwd", "bf16", 128, 128, 64, 1, 4, lpt_grid=True), "not a sm80 fwd one"),
    ):
        reason = space.why_invalid(bad)
        assert reason is not None and words in reason, (bad.name, reason)


def test_sm90_fp8_consumer_registers():
    """The fp8 forward's consumers keep 232 registers (producer 40) on every default; a tile whose
    estimate exceeds that gets 240 (producer 24) when its transpose is the hoisted 32-bit one."""
    defaults = [s for s in space.default_variants("sm90", "fwd") if s.dtype == "e4m3" and s not in space.fp8_alternative_specs("sm90")]
    assert defaults and all(space.sm90_fp8_consumer_regs(s) == space.SM90_FP8_CONSUMER_REGS == 232 for s in defaults)
    long = VariantSpec("sm90", "fwd", "e4m3", 256, 128, 96, 2, 12, overlap=True, pingpong=True, hoist_vt=True)
    assert space.est_registers(long) > 232 and space.sm90_fp8_consumer_regs(long) == 240
    assert long in space.fp8_alternative_specs("sm90") and space.why_invalid(long) is None
    assert space.sm90_fp8_consumer_regs(long.replace(hoist_vt=False)) == 232  # the per-word transpose keeps 40
    assert space.sm90_fp8_producer_regs(long) == 24 and space.sm90_fp8_producer_regs(long.replace(hoist_vt=False)) == 40
    assert all(space.sm90_fp8_producer_regs(s) == 40 for s in defaults)
    assert "would spill registers" in space.why_invalid(long.replace(hoist_vt=False))
    # 256 > 240: refused unless committed (the 128x128 tile is, with ping-pong; it peaks at R231)
    assert "would spill registers" in space.why_invalid(long.replace(tile_n=128, pingpong=False))
    assert space.why_invalid(long.replace(tile_n=128)) is None and long.replace(tile_n=128) in space.fp8_alternative_specs()


TUNED_FP8 = VariantSpec(
    "sm90", "fwd", "e4m3", 128, 192, 96, 2, 16, overlap=True, hoist_vt=True, lazy_rescale=True
)  # the tuned hd128 e4m3 tile


@pytest.mark.parametrize("flag", ["sum_mma", "two_level"])
def test_sum_mma_and_two_level_rules(flag):
    """The row sums by WGMMA and the two-level accumulation of O: sm90 e4m3 forward flags of the
    overlap schedule, not with block quantization; two_level's fp32 copy of O counts in the shared
    memory (4 bytes per value of the CTA's tile: 96 KiB at hd128 192x96), so hd256's tiles cannot
    hold it."""
    spec = TUNED_FP8.replace(**{flag: True})
    assert space.why_invalid(spec) is None
    bf16 = space.why_invalid(spec.replace(dtype="bf16", hoist_vt=False))
    assert f"{flag} (" in bf16 and "is an sm90 e4m3 forward flag" in bf16
    assert f"{flag} needs overlap" in space.why_invalid(spec.replace(overlap=False))
    assert f"{flag} with block_quant" in space.why_invalid(spec.replace(block_quant=True))
    extra = 96 * 1024 if flag == "two_level" else 1024
    assert space.smem_bytes(spec) == space.smem_bytes(TUNED_FP8) + extra
    hd256 = VariantSpec("sm90", "fwd", "e4m3", 256, 128, 96, 2, 12, overlap=True, pingpong=True, hoist_vt=True)
    if flag == "two_level":
        assert "shared memory" in space.why_invalid(hd256.replace(two_level=True))
    else:
        assert space.smem_bytes(hd256.replace(sum_mma=True)) <= space.SM90_SMEM_LIMIT
