"""The sm80 backward variants (defaults and the stages=2 tuning alternatives; a sample,
cpu_support.compile_sample, every one with CUTEFA_FULL_COMPILE_TESTS=1) compile on this CPU, and their
SASS shows the FlashAttention-2 backward design: mma.sync (HMMA), ldmatrix (LDSM),
cp.async (LDGSTS), MUFU.EX2 for the recomputed probabilities and fp32 reductions for the dQ
accumulator: 8-byte vector ones (REDG ... ADD.F32x2) on sm_90a, element-wise ones (REDG ... ADD.F32)
on sm_80, which has no vector reduction; no local-memory spills.

One cubin holds the preprocess, main and postprocess kernels; counts are summed over the three and
registers are the largest of them (the main kernel).
"""

from __future__ import annotations

import re

import cutlass
import cutlass.cute as cute
import pytest
from cpu_support import all_variants, compile_sample

from cutefa import sass
from cutefa.kernels.sm80 import bwd_parts
from cutefa.model.budgets import bwd_dq_accum_shape
from cutefa.model.options import DqLayout
from cutefa.model.rules import tile_head_dims, why_invalid, why_not_on
from cutefa.model.spec import VariantSpec

pytestmark = pytest.mark.compile

# One head dim for q, k and v: the committed (192, 128) pair has its own counts
# (tests/test_compile_sm80_bwd_dv.py).
DEFAULTS = [s for s in all_variants("sm80", "bwd") if s.head_dim_v == s.head_dim]
CHECKED = compile_sample(DEFAULTS)
# fp16 causal (DqLayout.TILE, the family's default: element-wise reductions in fragment order on sm_80):
# the default tiles at hd96, hd128, hd192 and hd256 (all but hd128 with dq_pipe), the
# double-buffered Q tiles at hd128 and hd192, and hd64's 128x128 double-buffered tile (255
# registers on sm_80); and the bf16 causal alternatives at hd64 and hd128 (DqLayout.QUAD, which
# keeps the natural layout on sm_80, and the natural layout itself).
A100_SUBSET = [
    s
    for s in DEFAULTS
    if s.dtype == "fp16"
    and s.causal
    and (s.head_dim, s.tile_m, s.tile_n, s.stages)
    in ((128, 64, 128, 1), (256, 64, 64, 1), (128, 64, 128, 2), (192, 64, 64, 1), (192, 64, 64, 2), (64, 128, 128, 2), (96, 64, 128, 1))
] + [s for s in DEFAULTS if s.options.dq_layout is not DqLayout.TILE and s.causal and s.head_dim in (64, 128)]


def test_alternatives_are_committed():
    assert {(s.head_dim, s.stages) for s in DEFAULTS if s.stages == 2} == {(64, 2), (128, 2), (192, 2), (256, 2)}
    # hd256's double-buffered tile runs where the shared memory holds it (sm_90a and newer), not on the A100
    assert all(why_not_on(s, "sm_80") is None for s in A100_SUBSET)
    assert all(why_not_on(s, "sm_90a") is None for s in DEFAULTS)
    assert {s.name for s in A100_SUBSET} >= {
        "cutefa_sm80_bwd_fp16_hd128_64x128_s2_w8_causal_dqtile",
        "cutefa_sm80_bwd_fp16_hd192_64x64_s2_w8_causal_dqtile",
        "cutefa_sm80_bwd_fp16_hd64_128x128_s2_w8_causal_dqtile",
        "cutefa_sm80_bwd_bf16_hd128_64x128_s1_w8_causal",
        "cutefa_sm80_bwd_bf16_hd128_64x128_s1_w8_causal_dqquad",
    }


@pytest.fixture(scope="module")
def cubins_sm90a(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("bwd_sm_90a"))


@pytest.fixture(scope="module")
def cubins_sm80(tmp_path_factory):
    return sass.dump_cubins(A100_SUBSET, "sm_80", tmp_path_factory.mktemp("bwd_sm_80"))


def _tile_d(spec) -> int:
    """The head dim the kernel's tiles compute on (a padded head dim's next multiple of 32)."""
    return tile_head_dims(spec)[0]


def _reductions(text: str) -> tuple[int, int, int]:
    """(element-wise, 8-byte vector, 16-byte vector) fp32 reductions in the SASS ``text``."""
    pairs = len(re.findall(r"\bREDG?\.E\.ADD\.F32x2\b", text))
    quads = len(re.findall(r"\bREDG?\.E\.ADD\.F32x4\b", text))
    return len(re.findall(r"\bREDG?\.E\.ADD\.F32\b(?!x)", text)), pairs, quads


def _grid(rows: int, cols: int, spec, gemm: str) -> tuple[int, int]:
    """The warp grid the template uses for the ``gemm`` ('dv', 'dk' or 'dq') output of (rows, cols):
    (w/2, 2), or (2, w/2) where valid and squarer per warp, except at head_dim 256 (where DqLayout.TILE's
    dQ and dV grids are the squarer one again, dK keeps the tall one)."""
    tall, wide = (spec.warps // 2, 2), (2, spec.warps // 2)
    squarer_at_256 = spec.options.dq_layout is DqLayout.TILE and gemm in ("dq", "dv")
    if (_tile_d(spec) == 256 and not squarer_at_256) or rows % (16 * wide[0]) or cols % (16 * wide[1]):
        return tall
    return wide if rows // wide[0] + cols // wide[1] < rows // tall[0] + cols // tall[1] else tall


def _ldmatrix_per_warp(spec) -> int:
    """ldmatrix.x4 per warp and step: per 16-deep k-block, one per 16 rows of the warp's A tile
    and one per 16 columns of its B tile, over the five GEMMs (S and dP: (tile_m, tile_n) by
    head_dim; dV and dK: (tile_n, head_dim) by tile_m; dQ: (tile_m, head_dim) by tile_n)."""

    def gemm(rows, cols, depth, grid):
        return depth // 16 * (rows // grid[0] // 16 + cols // grid[1] // 16)

    m, n, d = spec.tile_m, spec.tile_n, _tile_d(spec)
    sdp = gemm(m, n, d, (2, spec.warps // 2))
    dkv = gemm(n, d, m, _grid(n, d, spec, "dv")) + gemm(n, d, m, _grid(n, d, spec, "dk"))
    return 2 * sdp + dkv + gemm(m, d, n, _grid(m, d, spec, "dq"))


def _check(cubin, spec, vector_red: bool) -> None:
    report = sass.analyze(cubin)
    text = sass.disassemble(cubin)
    assert report.missing("sm80") == [], f"{spec.name}: {report.summary()}"
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    assert 0 < report.registers <= 255, f"{spec.name}: {report.summary()}"
    # A non-causal kernel has the key-block loop twice: for its own key blocks and for the stream-K
    # tail's segments (cutefa/kernels/sm80/tail.py); the counts below are per copy. A padded head
    # dim has no tail (it runs its own blocks only). Counts are over the tile's (padded) head dim.
    d = _tile_d(spec)
    copies = 1 if spec.causal or d != spec.head_dim else 2
    # Five GEMMs per query block (S, dP, dV, dK, dQ), each tile_m * tile_n * head_dim MACs per CTA.
    per_warp = spec.tile_m * spec.tile_n * d // (16 * 8 * 16) // spec.warps
    assert report.counts["HMMA"] == 5 * per_warp * copies, f"{spec.name}: {report.summary()}"
    # The warp grids the template chose: ldmatrix traffic as the model says (hd128 64x128: 144;
    # hd256 _dqtile: 180).
    assert report.counts["LDSM"] == _ldmatrix_per_warp(spec) * copies, f"{spec.name}: {report.summary()}"
    # One fp32 reduction per dQ element a thread holds, or one per pair of adjacent columns, or
    # (DqLayout.QUAD) one per quad of permuted columns; the vector ones twice in the code: unpredicated
    # for full query blocks, guarded for the last one. DqLayout.TILE: one per quad of the fragment
    # order, unpredicated only (the padding rows add zeros).
    per_thread = spec.tile_m * d // spec.threads
    layout, dq_pipe = spec.options.dq_layout, spec.options.dq_pipe
    if not vector_red:
        expected = (per_thread, 0, 0)
    elif layout is DqLayout.TILE:
        expected = (0, 0, per_thread // 4)
    elif layout is DqLayout.QUAD:
        expected = (0, 0, 2 * (per_thread // 4))
    else:
        expected = (0, 2 * (per_thread // 2), 0)
    if dq_pipe:
        # the last chunk's reductions twice in the code: in the next step (after its S MMAs) and
        # after the loop for the last step
        chunks = d // (16 * _grid(spec.tile_m, d, spec, "dq")[1])
        per_chunk = sum(expected) // chunks
        expected = tuple(n + n // chunks for n in expected)
    assert _reductions(text) == tuple(n * copies for n in expected), spec.name
    if dq_pipe:
        # dQ by column chunks, each chunk's reductions between the next chunk's MMAs: no run of
        # reductions without an MMA between them is longer than one chunk's (_dqtile without
        # _dqpipe: 9-12 of a thread's 12 in one burst after the last MMA of the step, sm_90a).
        main = sass.kernel_text(text, "kernel")
        red = r"\bREDG?\.E\.ADD\.F32(?:x4)?\b"
        runs = [len(re.findall(red, run)) for run in re.split(r"\bHMMA\b", main)]
        assert max(runs) <= per_chunk, f"{spec.name}: runs of {sorted(runs)[-4:]} dQ reductions"
    # The stream-K tail (non-causal): one counter increment per part, and the parts of dK and dV read
    # back through L2 (ld.global.cg), 16 bytes per load.
    main_text = sass.kernel_text(text, "kernel")
    assert len(re.findall(r"\bATOMG\.E\.ADD\b", main_text)) == copies - 1, spec.name
    part_loads = len(re.findall(r"\bLDG\.E\.128\.STRONG\.GPU\b", main_text))
    assert part_loads == (copies - 1) * 2 * spec.tile_n * spec.head_dim // spec.threads // 4, spec.name
    # P and dS leave fp32 by packed conversions, two values per F2FP: P is read back for dS from
    # its 16-bit words (bwd_parts.pin_words), so no value is converted alone (F2F, on the pipe of
    # the exponentials).
    main = sass.kernel_text(text, "kernel")
    assert not re.search(r"\bF2F\.B?F16\.F32\b", main), f"{spec.name}: a 16-bit value converted alone"
    packed = len(re.findall(r"\bF2FP(\.BF16)?(\.F16)?(\.F32)?\.PACK_AB\b", main))  # sm_80: F2FP[.BF16].PACK_AB
    assert packed >= spec.tile_m * spec.tile_n // spec.threads, f"{spec.name}: {packed} F2FP"


@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass_sm90a(cubins_sm90a, spec):
    _check(cubins_sm90a[spec.name], spec, vector_red=True)


@pytest.mark.parametrize("spec", A100_SUBSET, ids=lambda s: s.name)
def test_sass_sm80(cubins_sm80, spec):
    _check(cubins_sm80[spec.name], spec, vector_red=False)


def test_dq_quad_committed():
    quads = {s.name for s in DEFAULTS if s.options.dq_layout is DqLayout.QUAD}
    assert {
        "cutefa_sm80_bwd_bf16_hd64_128x128_s2_w8_dqquad",
        "cutefa_sm80_bwd_bf16_hd128_64x128_s1_w8_dqquad",
        "cutefa_sm80_bwd_bf16_hd128_64x128_s1_w8_causal_dqquad",
        "cutefa_sm80_bwd_bf16_hd256_64x64_s1_w8_dqquad",
    } <= quads
    assert all(why_invalid(s) is None for s in DEFAULTS if s.options.dq_layout is DqLayout.QUAD)


def test_dq_tile_committed():
    """DqLayout.TILE is the family's default backward layout: every default and tuning tile carries
    it, both dtypes and masks; the natural layout stays as the bf16 twin of the QUAD tiles; the
    workspace is tiled by query blocks; only the sm80 backward's record has a dQ layout."""
    tiles = {s for s in DEFAULTS if s.options.dq_layout is DqLayout.TILE}
    assert {s.dtype for s in tiles} == {"fp16", "bf16"}
    plain = {s for s in DEFAULTS if s.options.dq_layout is DqLayout.ROWS}
    quads = {s for s in DEFAULTS if s.options.dq_layout is DqLayout.QUAD}
    assert plain == {s.replace(dq_layout=DqLayout.ROWS) for s in quads}
    assert {s.replace(dq_layout=DqLayout.TILE) for s in plain} <= {s.replace(dq_pipe=False) for s in tiles}
    assert all(why_invalid(s) is None for s in tiles)
    spec = next(s for s in tiles if s.head_dim == 128 and s.tile_m == 64 and s.stages == 1 and not s.causal)
    assert bwd_dq_accum_shape(spec, 2, 3, 1000, 5) == (2, 3, 5, -(-1000 // 64), 64 * 128)
    with pytest.raises(TypeError, match="dq_layout"):
        VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 2, 12, dq_layout=DqLayout.TILE)


@cute.jit
def _trace_chunks(
    tile_m: cutlass.Constexpr, head_dim: cutlass.Constexpr, wm: cutlass.Constexpr, wn: cutlass.Constexpr, out: cutlass.Constexpr
):
    """Trace time only: for every thread of a (wm, wn) dQ tiled MMA, the coordinates of its values of
    each _dqpipe column chunk (one tile of the MMA, 16 * wn columns, partitioned on its own) against
    its values c * n ... (c + 1) * n - 1 of the whole tile, where red_add_fragment's ``value0`` puts
    them; the (row, column) of every chunk value into ``out``."""
    mma = bwd_parts.tiled_mma(cutlass.BFloat16, wm, wn)
    whole = cute.make_identity_tensor((tile_m, head_dim))
    cols = 16 * wn
    chunks = head_dim // cols
    for t in cutlass.range_constexpr(32 * wm * wn):
        full = mma.get_slice(t).partition_C(whole)
        n = cute.size(full) // chunks
        for c in cutlass.range_constexpr(chunks):
            part = mma.get_slice(t).partition_C(cute.local_tile(whole, (tile_m, cols), (0, c)))
            assert cute.size(part) == n, f"thread {t}: chunk of {cute.size(part)} values, not {n}"
            for i in cutlass.range_constexpr(n):
                got = tuple(int(x) for x in part[i])
                assert got == tuple(int(x) for x in full[c * n + i]), f"thread {t}: chunk {c} value {i} at {got}"
                out.append(got)


@pytest.mark.parametrize("tile_m, head_dim, warps_m, warps_n", [(64, 192, 2, 4), (64, 128, 2, 4), (64, 256, 4, 2)])
def test_dq_pipe_chunks(tile_m, head_dim, warps_m, warps_n):
    """_dqpipe's column chunks are a partition of the dQ fragment in its own order: chunk c of every
    thread holds the whole fragment's values c * n on (so DqLayout.TILE's fragment-order words take them
    unchanged), and the chunks of all threads cover the tile once."""
    out: list[tuple[int, int]] = []
    cute.compile(_trace_chunks, tile_m, head_dim, warps_m, warps_n, out)
    assert len(out) == tile_m * head_dim
    assert set(out) == {(r, x) for r in range(tile_m) for x in range(head_dim)}


def test_dq_pipe_committed():
    """dq_pipe on the single-buffered tiles of hd96 (the default and the 99 KiB one), hd192 and
    hd256 (the defaults), both dtypes and masks; refused without DqLayout.TILE and on
    double-buffered tiles."""
    pipes = {s for s in DEFAULTS if s.options.dq_pipe}
    tiles = {(96, 64, 128, 1), (96, 64, 64, 1), (192, 64, 64, 1), (256, 64, 64, 1)}
    assert {(s.head_dim, s.tile_m, s.tile_n, s.stages) for s in pipes} == tiles
    assert {(s.dtype, s.causal) for s in pipes} == {(d, c) for d in ("fp16", "bf16") for c in (False, True)}
    assert len(pipes) == 4 * len(tiles)
    spec = next(iter(pipes))
    assert "dq_layout=TILE" in why_invalid(spec.replace(dq_layout=DqLayout.ROWS))
    assert "dq_layout=TILE" in why_invalid(spec.replace(dq_layout=DqLayout.QUAD))
    assert "stages > 1" in why_invalid(spec.replace(stages=2))


@cute.jit
def _trace_quads(
    tile_m: cutlass.Constexpr, head_dim: cutlass.Constexpr, wm: cutlass.Constexpr, wn: cutlass.Constexpr, out: cutlass.Constexpr
):
    """Trace time only: for every thread of a (wm, wn) dQ tiled MMA, where red_add_quads sends each
    accumulator element, checked against quad_column; the (row, permuted column) set into ``out``."""
    mma = bwd_parts.tiled_mma(cutlass.BFloat16, wm, wn)
    ident = cute.make_identity_tensor((tile_m, head_dim))
    groups = bwd_parts.quad_groups(mma.get_slice(0).partition_C(ident), wn)
    span = 16 * wn
    for t in cutlass.range_constexpr(32 * wm * wn):
        c = mma.get_slice(t).partition_C(ident)
        shift = int(c[groups[0][0]][1]) % span  # as red_add_quads: the first quad's column mod span
        for g in groups:
            r0, c0 = (int(x) for x in c[g[0]])
            for k, i in enumerate(g):
                r, col = (int(x) for x in c[i])
                assert r == r0, f"thread {t}: quad {g} spans rows {r0} and {r}"
                assert c0 + shift + k == bwd_parts.quad_column(col, wn), f"thread {t}: ({r}, {col})"
                out.append((r, c0 + shift + k))


@pytest.mark.parametrize(
    "tile_m, head_dim, warps_m, warps_n",
    [(64, 128, 2, 4), (128, 64, 4, 2), (64, 64, 4, 2), (64, 192, 2, 4), (64, 256, 4, 2), (64, 96, 4, 2)],
)
def test_dq_quad_permutation(tile_m, head_dim, warps_m, warps_n):
    """For every thread of the dQ GEMM's tiled MMA, the 16-byte reductions of red_add_quads put each
    accumulator element (row, col) at (row, quad_column(col)), where the postprocess reads it, and
    the threads together cover every (row, permuted column) of the tile once: the column
    permutation is a bijection that matches the fragment, traced from the MMA's own layouts."""
    out: list[tuple[int, int]] = []
    cute.compile(_trace_quads, tile_m, head_dim, warps_m, warps_n, out)
    assert len(out) == tile_m * head_dim
    assert set(out) == {(r, x) for r in range(tile_m) for x in range(head_dim)}
    assert sorted(bwd_parts.quad_column(x, warps_n) for x in range(head_dim)) == list(range(head_dim))
