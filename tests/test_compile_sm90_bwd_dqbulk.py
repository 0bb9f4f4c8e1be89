"""The sm90 backward's bulk dQ path (DqPath.BULK, name token _dqbulk; FlashAttention-3's dQ path) on
this CPU.

Each consumer warpgroup stages its fp32 dQ piece in shared memory in the WGMMA fragment's order and
one thread adds the whole piece into the tiled dq_accum with one bulk reduce-add
(cp.reduce.async.bulk, SASS ``UBLKRED``). Checked here: it is the default at head dims 64/96/128
(its per-thread-reduction twins committed beside it in bf16) and dispatch picks it; the head-dim
split's _dqbulk variants (hd192/hd256; hd256's default is the one with the overlap schedule) sit
beside the plain split; the predicate counts the staging
buffers (the head split's fill the opt-in limit exactly at hd192; at hd256 they would not fit and dQ
is staged in the Q/dO stage); variants compile for sm_90a with the bulk reduce-add
16-byte shared-memory stores and no per-thread fp32 reduction (no REDG) or local-memory spill; and
the pre/postprocess move 16-byte vectors (the preprocess zeroes the workspace, the postprocess
writes dQ rows from a shared-memory tile); and the fragment order that the main kernel writes and
the postprocess reads back (bwd_dq_bulk.
bulk_dq_coords, traced with the DSL) maps a query block's chunk one-to-one onto its tile_m x
head_dim elements.

Correctness on hardware: tests/gpu/test_bwd_dqbulk_gpu.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_support import all_variants, assert_sm90_bwd_stores

from cutefa import sass
from cutefa.model.budgets import bwd_dq_accum_shape
from cutefa.model.budgets_sm90 import (
    SM90_SMEM_LIMIT,
    sm90_bwd_dq_bulk_aliases,
    sm90_bwd_dq_pieces,
    sm90_bwd_dq_swapped,
    sm90_bwd_head_split,
    sm90_bwd_smem_bytes,
    sm90_bwd_swapped,
)
from cutefa.model.defaults import DEFAULT_BWD_TILES
from cutefa.model.options import DqPath, Sm90BwdOptions
from cutefa.model.rules import why_invalid
from cutefa.model.spec import HEAD_DIMS, VariantSpec

# (the swapped-dK/dV partition at head dim 192 has its own checks: test_compile_sm90_bwd_swapkv.py)
# (the tile_m=80 tile, dQ transposed: test_compile_sm90_bwd_dqswap.py; head dims of their own, 80
# and 112: test_compile_sm90_bwd_head_dims.py)
BULK = [
    s
    for s in all_variants("sm90", "bwd")
    if s.options.dq_path is DqPath.BULK and not (sm90_bwd_swapped(s) or sm90_bwd_dq_swapped(s))
    and s.head_dim in HEAD_DIMS
]
# hd128 64x128 (a column split of dQ) non-causal, hd64 128x128 (a row split) causal; and the overlap
# schedule's bulk path (its dQ staging runs while dK's WGMMA does) at hd128; the head-dim split at
# hd192, plain non-causal and causal with the overlap schedule; hd256 (staged in the Q/dO stage)
# plain non-causal and its default (the overlap schedule) causal in fp16.
CHECKED = [
    s
    for s in BULK
    if s.head_dim <= 128 and s.causal == (s.head_dim == 64) and (not s.options.overlap or s.head_dim == 128)
]
CHECKED += [s for s in BULK if s.head_dim == 192 and s.causal == s.options.overlap]
CHECKED += [s for s in BULK if s.head_dim == 256 and not s.causal and not s.options.overlap]
# the default
CHECKED += [s for s in BULK if s.head_dim == 256 and s.causal and s.options.overlap and s.dtype == "fp16"]


def _twin(spec: VariantSpec) -> VariantSpec:
    """``spec`` with per-thread dQ reductions."""
    return spec.replace(dq_path=DqPath.RED)


def test_bulk_is_the_default_where_the_tile_is_not_the_head_split():
    """DqPath.BULK is the sm90 backward default at head dims 64, 96, 128 (every dtype, both masks) and
    with the overlap schedule a bf16 and an fp16 alternative at 64 and 128; on the head-dim split hd256's default
    with the overlap schedule (every dtype) and a bf16 alternative without it, at hd192 bf16
    alternatives, plain and overlap; each has its per-thread-reduction twin committed (bf16) to be
    timed beside it; dispatch picks the default without a tuned table's entry."""
    import torch

    from cutefa.api import backward

    default_specs = [s for s in BULK if not s.options.overlap and s.head_dim <= 128]
    assert sorted((s.dtype, s.head_dim, s.causal) for s in default_specs) == [
        (dt, hd, causal) for dt in ("bf16", "fp16") for hd in (64, 96, 128) for causal in (False, True)
    ]
    assert sorted(
        (s.dtype, s.head_dim, s.causal, s.options.overlap)
        for s in BULK
        if s.options.overlap or s.head_dim > 128
    ) == sorted(
        [("bf16", hd, causal, True) for hd in (64, 128) for causal in (False, True)]
        + [("bf16", hd, causal, ov) for hd in (192, 256) for causal in (False, True) for ov in (False, True)]
        + [("fp16", 256, causal, True) for causal in (False, True)]  # hd256's default, the overlap schedule
        # tools/alternatives.py SM90_FP16_BWD_ALTERNATIVES
        + [("fp16", hd, causal, True) for hd in (64, 128) for causal in (False, True)]
    )
    variants = set(all_variants("sm90", "bwd"))
    for spec in BULK:
        assert spec.name.endswith("_dqbulk")
        assert why_invalid(spec) is None, spec.name
        # the default tile, or at head dims 192 and 256 the head-dim split's (192's default is the
        # swapped partition, tests/test_compile_sm90_bwd_swapkv.py)
        tile = (64, 64, 2, 12) if sm90_bwd_head_split(spec) else DEFAULT_BWD_TILES["sm90"][spec.head_dim]
        assert (spec.tile_m, spec.tile_n, spec.stages, spec.warps) == tile
        if spec.dtype == "bf16" and spec.head_dim != 96:
            assert _twin(spec) in variants  # timed beside the variant it changes
    for spec in default_specs:  # no seqlen_k: the default, not a tuned table's entry
        assert spec.options == Sm90BwdOptions(dq_path=DqPath.BULK)
        dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[spec.dtype])
        assert backward.choose_bwd("sm_90a", dtype, spec.head_dim, spec.causal) == spec
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            # the head-dim split: the bulk path with the overlap schedule, dispatched for both dtypes
            spec = backward.choose_bwd("sm_90a", dtype, 256, causal)
            assert spec in BULK and sm90_bwd_head_split(spec), spec.name
            assert spec.options == Sm90BwdOptions(overlap=True, dq_path=DqPath.BULK), spec.name
            # the swapped partition: the bulk path through a staging buffer of its own
            spec = backward.choose_bwd("sm_90a", dtype, 192, causal)
            assert sm90_bwd_swapped(spec), spec.name
            assert spec.options == Sm90BwdOptions(dq_path=DqPath.BULK_STAGED), spec.name


def test_predicate_counts_the_staging_buffers():
    for spec in BULK:
        extra = sm90_bwd_smem_bytes(spec) - sm90_bwd_smem_bytes(_twin(spec))
        if sm90_bwd_dq_bulk_aliases(spec):  # hd256: staged in the Q/dO stage
            assert spec.head_dim == 256 and extra == 0
        else:
            assert extra == 4 * spec.tile_m * spec.head_dim  # the fp32 dQ of one query block
    # a 3-stage ring plus the buffers is over the 227 KiB
    deep = VariantSpec("sm90", "bwd", "bf16", 128, 64, 128, 3, 12, dq_path=DqPath.BULK)
    assert "shared memory" in why_invalid(deep)
    assert why_invalid(_twin(deep)) is None
    # the head-dim split: hd192 s2 with its 48 KiB of staging needs the opt-in limit exactly (the
    # struct the DSL sizes plus the kernel's 1 KiB of static shared memory); hd256 s2 (already at the
    # limit without them) and hd192 s3 stage dQ in the Q/dO stage instead: no extra bytes
    split192 = VariantSpec("sm90", "bwd", "bf16", 192, 64, 64, 2, 12, dq_path=DqPath.BULK)
    assert sm90_bwd_smem_bytes(split192) == SM90_SMEM_LIMIT == 232448
    assert not sm90_bwd_dq_bulk_aliases(split192)
    split256 = split192.replace(head_dim=256)
    for spec in (split256, split192.replace(stages=3)):
        assert sm90_bwd_dq_bulk_aliases(spec), spec.name
        assert sm90_bwd_smem_bytes(spec) == sm90_bwd_smem_bytes(_twin(spec)) == SM90_SMEM_LIMIT
    for spec in (split192, split256, split192.replace(stages=3)):
        assert why_invalid(spec) is None and why_invalid(spec.replace(overlap=True)) is None
    assert not sm90_bwd_dq_bulk_aliases(_twin(split256))
    assert not sm90_bwd_dq_bulk_aliases(deep)
    # the dQ path is an option of the sm90 backward's record only
    for arch, direction, tile in (("sm80", "bwd", (64, 128, 1, 8)), ("sm90", "fwd", (128, 128, 2, 12))):
        with pytest.raises(TypeError, match="dq_path"):
            VariantSpec(arch, direction, "bf16", 128, *tile, dq_path=DqPath.BULK)


def test_workspace_shapes():
    spec = next(s for s in BULK if s.head_dim == 128)
    assert bwd_dq_accum_shape(spec, 3, 2, 1000, 5) == (3, 2, 5, -(-1000 // 64), 64 * 128)
    assert bwd_dq_accum_shape(spec, 1, 1, 1, 1) == (1, 1, 1, 1, 64 * 128)
    assert bwd_dq_accum_shape(_twin(spec), 3, 2, 1000, 5) == (3, 2, 1000, 5, 128)


def test_host_allocates_the_variant_layout():
    """backward.py's workspace: tiled for the bulk path, the (splits, batch, seqlen_q, heads_q, head_dim)
    layout for every other variant (uninitialized either way: the preprocess kernels zero it)."""
    import torch

    from cutefa.api.backward import dq_accum_workspace

    spec = next(s for s in BULK if s.head_dim == 64)
    ws = dq_accum_workspace(spec, 2, 3, 130, 4, torch.device("cpu"))
    assert ws.shape == (2, 3, 4, 2, 128 * 64) and ws.dtype == torch.float32 and ws.is_contiguous()
    assert dq_accum_workspace(_twin(spec), 2, 3, 130, 4, torch.device("cpu")).shape == (2, 3, 130, 4, 64)
    sm80 = VariantSpec("sm80", "bwd", "bf16", 128, 64, 128, 1, 8)
    assert dq_accum_workspace(sm80, 1, 1, 17, 2, torch.device("cpu")).shape == (1, 1, 17, 2, 128)


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    return sass.dump_cubins(CHECKED, "sm_90a", tmp_path_factory.mktemp("bwd_dqbulk_sm_90a"))


def _check_ds_stmatrix(report, spec, text):
    """dS^T and the dK/dV staging go to shared memory by stmatrix and dK/dV out by TMA store
    (cpu_support.assert_sm90_bwd_stores), and the only 32-bit shared stores left in the main kernel
    are the two of the LSE2/D staging (before the loop and in it, one predicated store each; the
    postprocess has its own, counted in test_sass_pre_postprocess)."""
    main = sass.opcode_forms(sass.kernel_text(text, "kernel"))
    assert_sm90_bwd_stores(report, main, spec)
    assert main.get("STS", 0) == 2, {f: n for f, n in main.items() if f.startswith("STS")}


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass_bulk_reduce(cubins, spec):
    report = sass.analyze(cubins[spec.name])
    text = sass.disassemble(cubins[spec.name])
    for op in ("HGMMA", "UTMALDG", "USETMAXREG", "SYNCS", "MUFU.EX2"):
        assert report.counts.get(op, 0) > 0, f"{spec.name}: no {op}: {report.summary()}"
    if sm90_bwd_head_split(spec):  # S^T, dP^T over d; dQ over the 64 keys; dV, dK over 64 queries
        expected = 2 * spec.head_dim // 16 + spec.tile_n // 16 + 2 * spec.tile_m // 16
    else:
        expected = 2 * spec.head_dim // 16 + 2 * spec.tile_m // 16 + 2 * spec.tile_n // 16
    if spec.options.overlap and not sm90_bwd_head_split(spec):  # dK after dQ, in each consumer's branch
        expected += spec.tile_m // 16
    assert report.counts["HGMMA"] == expected, report.summary()
    # one bulk reduce-add per consumer code path (two, one per half, where the piece is staged in
    # the Q/dO stage), fp32 add, and no per-thread reduction left
    copies = 2 if sm90_bwd_dq_bulk_aliases(spec) else 1
    assert report.forms_of("UBLKRED") == {"UBLKRED.G.S.ADD.F32.RN": 2 * copies}, report.forms
    # per-thread reductions: only the grouped-query dK/dV sums (16-byte fp32 adds), none for dQ
    assert not [r for r in re.findall(r"\bREDG?\.\S+", text) if not r.startswith("REDG.E.ADD.F32x4")], (
        f"{spec.name}: per-thread reductions remain"
    )
    # the piece goes to shared memory 16 bytes at a time: cols / 8 stores per thread and consumer
    stores = len(re.findall(r"\bSTS\.128\b", text))
    assert stores >= sum(cols // 8 for _, _, cols in sm90_bwd_dq_pieces(spec)), stores
    if not sm90_bwd_head_split(spec):
        _check_ds_stmatrix(report, spec, text)
    assert report.spills == 0, f"{spec.name} spills: {report.summary()}"
    for budget, used in sass.setmaxnreg_regions(text):
        assert used < budget, f"{spec.name}: R{used} under setmaxnreg {budget}"
    waits = re.findall(r"WARPGROUP\.DEPBAR", text)
    assert len(waits) <= 8, f"{spec.name}: {len(waits)} WGMMA waits (serialized?)"


def _memory_forms(text: str, role: str) -> dict[str, int]:
    forms = sass.opcode_forms(sass.kernel_text(text, role))
    return {f: n for f, n in forms.items() if f.split(".")[0] in ("LDG", "STG", "LDS", "STS", "LDL", "STL")}


@pytest.mark.compile
@pytest.mark.parametrize("spec", CHECKED, ids=lambda s: s.name)
def test_sass_pre_postprocess(cubins, spec):
    """The side kernels move whole 16-byte vectors. Preprocess: reads the 4 rows of O and dO of its
    warp with one LDG.E.128 per row, tensor and lane (no narrower load but the LSE's and dLSE's
    32-bit ones), and zeroes its 16 x head_dim words of a dq_accum chunk, per split, with
    head_dim / 32 STG.E.128 per thread (the loop over splits is not unrolled). Postprocess: reads each piece's fragment with LDG.E.128 (cols / 8 per piece and
    thread), stages the converted tile in shared memory (32-bit stores of bf16 pairs, then LDS.128)
    and writes dQ with STG.E.128 only (tile_m * head_dim / 8 / 128 per thread, each guarded by its
    row): no 16- or 32-bit global store, no local memory."""
    text = sass.disassemble(cubins[spec.name])
    pre = _memory_forms(text, "preprocess")
    assert pre.get("STG.E.128", 0) == spec.head_dim // 32, pre
    assert {f: n for f, n in pre.items() if f.startswith("LDG")} == {"LDG.E.128": 2 * 4, "LDG.E": 2}, pre
    post = _memory_forms(text, "postprocess")
    pieces = sm90_bwd_dq_pieces(spec)
    assert post.get("LDG.E.128", 0) >= sum(cols // 8 for _, _, cols in pieces), post
    assert not {f for f in post if f.startswith("LDG") and f != "LDG.E.128"}, post
    assert {f: n for f, n in post.items() if f.startswith("STG")} == {"STG.E.128": spec.tile_m * spec.head_dim // 1024}, post
    assert post.get("LDS.128", 0) == spec.tile_m * spec.head_dim // 1024, post
    assert post.get("STS", 0) == spec.tile_m * spec.head_dim // 2 // 128, post  # one per bf16 pair
    for forms in (pre, post):
        assert not {f for f in forms if f.startswith(("LDL", "STL"))}, forms


_COORDS = """
import json, sys
import cutlass, cutlass.cute as cute
from cutefa.kernels.sm90 import bwd_dq_bulk, bwd_parts

result = {}

@cute.jit
def coords(cols: cutlass.Constexpr):
    mma = bwd_parts.dq_tiled_mma(cutlass.BFloat16, cols)
    slices = [bwd_dq_bulk.bulk_dq_coords(mma, t, cols) for t in range(128)]
    result["coords"] = [[[int(c[i][0]), int(c[i][1])] for i in range(cute.size(c))] for c in slices]

coords(int(sys.argv[1]))
print(json.dumps(result))
"""


def _trace_coords(tmp_path, cols: int) -> list[list[list[int]]]:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": str(root)}
    script = tmp_path / f"coords{cols}.py"  # a file: the DSL reads the traced function's source
    script.write_text(_COORDS)
    proc = subprocess.run(
        [sys.executable, str(script), str(cols)], env=env, capture_output=True, text=True, check=False, cwd=root
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["coords"]


@pytest.mark.compile  # traces the tiled-MMA partition with the DSL in a child process
@pytest.mark.parametrize(
    ("tile_m", "tile_n", "head_dim"),
    [(128, 128, 64), (64, 128, 128), (64, 128, 96), (64, 64, 192), (64, 64, 256), (64, 128, 80), (64, 128, 112)],
)
def test_chunk_order_is_a_bijection(tmp_path, tile_m, tile_n, head_dim):
    """Word w = offset(piece) + 4 (128 j + t) + e of a query block's chunk holds value 4 j + e of
    thread t's fragment of that piece; through bulk_dq_coords (the tiled-MMA partition the kernel's
    accumulator has) every word lands on its own element of the tile_m x head_dim block, and every
    element is covered. The fragment order is the WGMMA accumulator's: thread t of warp w holds rows
    16 w + (t % 32) / 4 (+ 8) and columns 8 k + 2 (t % 4) (+ 1). tile_n=64: the head-dim split,
    each consumer all 64 rows and its half of the columns (at 256 staged in two halves, words
    [0, 64 d/4) and [64 d/4, 64 d/2) of the piece: the same chunk order)."""
    from cutefa.kernels.sm90.bwd_dq_bulk import BULK_VEC, bulk_piece_offsets

    spec = VariantSpec("sm90", "bwd", "bf16", head_dim, tile_m, tile_n, 2, 12, dq_path=DqPath.BULK)
    pieces = sm90_bwd_dq_pieces(spec)
    offsets = bulk_piece_offsets(pieces)
    traced = {cols: _trace_coords(tmp_path, cols) for cols in {c for _, _, c in pieces}}
    element_of_word = {}
    for (row_block, col0, cols), offset in zip(pieces, offsets):
        table = traced[cols]
        for t in range(128):
            values = table[t]
            assert len(values) == cols // 2
            for i, (row, col) in enumerate(values):
                warp, lane = divmod(t, 32)
                k, v = divmod(i, 4)
                assert (row, col) == (16 * warp + lane // 4 + 8 * (v // 2), 8 * k + 2 * (lane % 4) + v % 2)
                j, e = divmod(i, BULK_VEC)
                word = offset + BULK_VEC * (128 * j + t) + e
                element_of_word[word] = (row_block * 64 + row, col0 + col)
    assert sorted(element_of_word) == list(range(tile_m * head_dim))
    assert sorted(element_of_word.values()) == [(r, c) for r in range(tile_m) for c in range(head_dim)]
